"""`Indexer`: MiniMax-M3's lightning indexer of one layer (the index-cache insert, the block
scores and top-k the attend reads), on the same per-step metadata as `SparseAttention`.

The index cache is a KV-cache group of its own (its own block table and slots): its step is
built by a `MetadataBuilder` over the index group's tensors, once per step for all layers, and a
layer's calls read that metadata (token positions, the index block table, the insert's rows).

The scores and top-k run the hand-written GPU kernel (ops/indexer_gpu.py) on CUDA and gfx942,
launched on torch's stream where the library does (CUDA: run; gfx942: compiled only, never run),
with the library's shared workspace; on the host the portable kernel of ops/indexer.py (a
[tokens, columns, 128, 128] key gather: correct, slow). The index-cache insert too: on a GPU the
hand-written one (ops/insert_gpu.py: in place, the step's padding skipped in the kernel, no host
sync), on the host the portable one. The emitted table on its own (`emit_table`) is the portable
kernel on every target (on a GPU IREE's synchronous call); `topk_with_table` writes it in the
top-k's own launch.
"""
from __future__ import annotations

import torch

from .. import checks
from ..config import DTYPES, dtype_name
from ..layout import BLOCK_SIZE, HEAD_DIM, PAGES_PER_BLOCK
from ..ops import IndexCacheInsertGpuSpec, indexer_set
from ..ops.fp8 import storage_dtype
from ..ops.indexer import INDEX_QUERY_DTYPES, indexer_config
from ..ops.indexer_gpu import MAX_COLUMNS
from ..ops.tuning import INDEXER
from .kv_insert import drop_padding
from .library import KernelLibrary
from .metadata import MsaMetadata


# index_q's dtypes: 16-bit, or e4m3fn (an e4m3fn index cache's, as vLLM's model casts them)
QUERY_DTYPES = tuple(DTYPES[name] for name in INDEX_QUERY_DTYPES)


class Indexer:
    """num_index_heads: index heads per rank (one per KV head); index_cache_dtype: bf16 or
    float8_e4m3fn; init_blocks, local_blocks: MiniMax-M3's sparse_init_block, sparse_local_block;
    query_dtype: index_q's, bf16, fp16 or float8_e4m3fn (an e4m3fn cache's queries as vLLM's
    model writes them: cast to the cache's dtype, no scale); key_dtype: index_k's (the insert's),
    16-bit (default: query_dtype where that is 16-bit, else bf16)."""

    def __init__(self, num_index_heads: int, index_cache_dtype, *, init_blocks: int = 0, local_blocks: int = 1,
                 target: str = "host", build_dir=None, kernels=None, query_dtype=torch.bfloat16, key_dtype=None):
        cache_name = index_cache_dtype if isinstance(index_cache_dtype, str) else dtype_name(index_cache_dtype)
        if query_dtype not in QUERY_DTYPES:
            raise ValueError(f"query_dtype: expected one of {', '.join(map(str, QUERY_DTYPES))}, got {query_dtype}")
        self.fp8_queries = query_dtype == torch.float8_e4m3fn
        if key_dtype is None:
            key_dtype = torch.bfloat16 if self.fp8_queries else query_dtype
        self.query_dtype = query_dtype
        self.cfg = indexer_config(num_index_heads, cache_name, dtype_name(key_dtype))
        self.kernels = kernels or KernelLibrary(target, build_dir)
        # (the specs refuse what they cannot build); the attend's page table for a top-k goes
        # through the attention group's block table (page-16 rebase: both K/V sides in one block)
        self.specs = indexer_set(self.cfg, self.kernels.target, init_blocks, local_blocks,
                                 fp8_queries=self.fp8_queries)

    def _check_cache(self, index_cache, metadata):
        checks.check_dtype("index_cache", index_cache, self.cfg.kv_torch_dtype)
        checks.check_shape("index_cache", index_cache, (None, BLOCK_SIZE, HEAD_DIM))
        if not isinstance(metadata, MsaMetadata):
            raise TypeError(f"metadata: expected the index group's MsaMetadata (MetadataBuilder.build), "
                            f"got {type(metadata).__name__}")
        return index_cache.view(storage_dtype(index_cache.dtype))

    def insert(self, index_k, index_cache, metadata: MsaMetadata):
        """Write the step's index keys index_k [>= tokens, 128] into index_cache [blocks, 128, 128]
        in place at the index group's slots (metadata.slot_mapping; < 0 skipped)."""
        raw = self._check_cache(index_cache, metadata)
        checks.check_shape("index_k", index_k, (None, HEAD_DIM))
        checks.check_dtype("index_k", index_k, self.cfg.query_torch_dtype)
        n = metadata.num_actual_tokens
        if index_k.shape[0] < n:
            raise ValueError(f"index_k: expected at least num_actual_tokens={n} rows, got {index_k.shape[0]}")
        metadata.check_cache_slots(index_cache.shape[0] * BLOCK_SIZE, "index_cache")
        rows, slots = metadata.insert_token_index, metadata.insert_slots
        if isinstance(self.specs.insert, IndexCacheInsertGpuSpec):  # in place, padding skipped by the kernel
            if not index_cache.is_cuda:
                raise ValueError(f"index_cache: expected a GPU tensor for the {self.kernels.target} kernels, got one "
                                 f"on {index_cache.device}")
            checks.check_device("index_k", index_k, index_cache.device)
            if slots.numel():
                self.kernels.run(self.specs.insert, raw.view(raw.shape[0], -1), index_k, rows, slots)
            return
        rows, slots = drop_padding(rows, slots)  # (the portable insert cannot skip padding)
        if slots.numel() == 0:
            return
        (updated,) = self.kernels.run(self.specs.insert, raw, index_k, rows, slots, out_dtypes=[raw.dtype])
        raw.copy_(updated)

    def topk(self, index_q, index_cache, metadata: MsaMetadata, out=None) -> torch.Tensor:
        """topk [H, tokens, 16] int32 (what SparseAttention.forward takes): each token's
        highest-scoring blocks of its request, as reference.index_topk; index_q [>= tokens, H,
        128] in query_dtype. out: where it is written, [H, >= tokens, 16] int32 contiguous (rows past the
        step's tokens untouched; a captured step's stable buffer), returned whole (the portable
        kernel's result is copied into it)."""
        q, raw = self._checked_q(index_q, index_cache, metadata)
        gpu = self._gpu_spec(metadata, q)
        if gpu is not None:
            h, n = self.cfg.num_kv_heads, q.shape[0]
            topk = self._output_buffer("out", out, (h, n, self.cfg.topk), q.device)
            if n:
                self._run_gpu(gpu, q, raw, metadata, (topk,))
            return topk
        topk = self._portable_topk(q, raw, metadata)
        if out is None:
            return topk
        out = self._output_buffer("out", out, tuple(topk.shape), topk.device)
        out[:, :topk.shape[1]].copy_(topk)  # the portable kernel allocates its result
        return out

    def _portable_topk(self, q, raw, metadata):
        """The portable kernel's top-k of the step's tokens, in calls of at most its rows_per_call
        tokens (each call gathers the keys of its tokens' whole table rows)."""
        spec, table = self.specs.topk, metadata.block_table
        per_call = spec.rows_per_call(table.shape[1])
        parts = [self.kernels.run(spec, q[a:a + per_call], raw, table, metadata.token_req_id[a:a + per_call],
                                  metadata.token_abs_pos[a:a + per_call], out_dtypes=[torch.int32])[0]
                 for a in range(0, max(q.shape[0], 1), per_call)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    def _gpu_spec(self, metadata, q, emit_table=False):
        """The GPU kernel for this step (None: the portable one): a decode-only step's tokens of a
        request scored together (its rows are L consecutive tokens of each request), any other
        step's in its query tiles (metadata.query_tiles)."""
        if not q.is_cuda:
            return None
        tiled = self.specs.gpu_tiled(emit_table)
        if metadata.query_tiles is not None and tiled is not None:
            return tiled
        rows = 1
        if metadata.prefill is None and metadata.decode is not None:
            rows = INDEXER.rows_for(metadata.decode.decode_query_len, self.cfg.num_kv_heads)
            if q.shape[0] % rows:  # padding rows past the requests' tokens
                rows = 1
        return self.specs.gpu(rows, emit_table) or self.specs.gpu(1, emit_table)

    def _checked_q(self, index_q, index_cache, metadata):
        """(the step's rows of index_q, the cache's storage view) after every per-call check."""
        raw = self._check_cache(index_cache, metadata)
        checks.check_shape("index_q", index_q, (None, self.cfg.num_kv_heads, HEAD_DIM))
        checks.check_dtype("index_q", index_q, self.query_dtype)
        n = metadata.num_actual_tokens
        if index_q.shape[0] < n:
            raise ValueError(f"index_q: expected at least num_actual_tokens={n} rows, got {index_q.shape[0]}")
        metadata.check_cache_blocks(index_cache.shape[0], "index_cache")
        return index_q[:n].view(storage_dtype(index_q.dtype)), raw

    @staticmethod
    def _output_buffer(name, given, shape, device):
        """`given` checked as a contiguous int32 [shape[0], >= shape[1], ...] on `device`, else a new one."""
        if given is None:
            return torch.empty(shape, dtype=torch.int32, device=device)
        checks.check_dtype(name, given, torch.int32)
        checks.check_device(name, given, device)
        rows = 1 if name == "out" else 0  # topk is head-major
        if (given.dim() != len(shape) or given.shape[rows] < shape[rows] or not given.is_contiguous()
                or any(g != s for i, (g, s) in enumerate(zip(given.shape, shape)) if i != rows)):
            want = ", ".join(f">= {s}" if i == rows else str(s) for i, s in enumerate(shape))
            raise ValueError(f"{name}: expected a contiguous [{want}] int32 tensor, got shape {tuple(given.shape)}, "
                             f"strides {given.stride()}")
        return given

    def _run_gpu(self, spec, index_q, raw, metadata, outputs, extra=()):
        columns = metadata.block_table.shape[1]
        if columns > MAX_COLUMNS:
            raise ValueError(f"metadata: expected an index block table of at most {MAX_COLUMNS} columns "
                             f"({MAX_COLUMNS * BLOCK_SIZE} tokens) for the GPU indexer, got {columns}")
        ws = self.kernels.workspace(spec.workspace_floats(index_q.shape[0], columns), index_q.device, "indexer")
        tiles = (metadata.query_tiles,) if spec.tiled else ()
        self.kernels.run(spec, index_q, raw.view(raw.shape[0], -1), metadata.block_table, metadata.token_req_id,
                         metadata.token_abs_pos, *tiles, *extra, out=[*outputs, ws])

    def topk_with_table(self, index_q, index_cache, metadata: MsaMetadata, attend_metadata: MsaMetadata, *,
                        out=None, table_out=None):
        """(topk [H, tokens, 16], sparse_bt [tokens * H, 128], sparse_ctx [tokens * H]) int32: `topk`
        and the attend's page table for it (`emit_table`), on a GPU in one launch (the table written
        by the top-k's own merge). out: as topk's; table_out: (sparse_bt [>= tokens, H, 128],
        sparse_ctx [>= tokens, H]) int32 contiguous to write the table into (the returned views are
        their first rows, folded to [tokens * H, ...])."""
        q, raw = self._checked_q(index_q, index_cache, metadata)
        spec = self._gpu_spec(metadata, q, emit_table=True)
        if spec is None:  # the portable kernels, one after the other
            topk = self.topk(index_q, index_cache, metadata, out=out)
            sbt, sctx = self._table(topk, attend_metadata)
            if table_out is None:
                return (topk, *_emitted(attend_metadata, sbt, sctx))
            n, h = q.shape[0], self.cfg.num_kv_heads
            sbt_out = self._output_buffer("sparse_bt", table_out[0], (n, h, sbt.shape[1]), sbt.device)
            sctx_out = self._output_buffer("sparse_ctx", table_out[1], (n, h), sctx.device)
            sbt_out[:n].copy_(sbt.view(n, h, -1))
            sctx_out[:n].copy_(sctx.view(n, h))
            return (topk, *_emitted(attend_metadata, sbt_out[:n].reshape(n * h, -1), sctx_out[:n].reshape(n * h)))
        if not isinstance(attend_metadata, MsaMetadata):
            raise TypeError(f"attend_metadata: expected the attention group's MsaMetadata, "
                            f"got {type(attend_metadata).__name__}")
        n, h, k = q.shape[0], self.cfg.num_kv_heads, self.cfg.topk
        if attend_metadata.num_actual_tokens != n or attend_metadata.block_table.shape[0] != metadata.block_table.shape[0]:
            raise ValueError(f"attend_metadata: expected the step's {n} tokens of {metadata.block_table.shape[0]} "
                             f"requests (the index group's), got {attend_metadata.num_actual_tokens} tokens of "
                             f"{attend_metadata.block_table.shape[0]}")
        sbt_out, sctx_out = (None, None) if table_out is None else table_out
        topk = self._output_buffer("out", out, (h, n, k), q.device)
        sbt = self._output_buffer("sparse_bt", sbt_out, (n, h, k * PAGES_PER_BLOCK), q.device)
        sctx = self._output_buffer("sparse_ctx", sctx_out, (n, h), q.device)
        if n:
            self._run_gpu(spec, q, raw, metadata, (topk, sbt, sctx), (attend_metadata.block_table,))
        return (topk, *_emitted(attend_metadata, sbt[:n].reshape(n * h, -1), sctx[:n].reshape(n * h)))

    def emit_table(self, topk, attend_metadata: MsaMetadata):
        """The attend's page table for `topk` (what SparseAttention.forward takes as
        sparse_block_table / sparse_context_lens, so that it builds none): [tokens * H, 128] and
        [tokens * H] int32, through the *attention* group's metadata (its block table, every
        token's request and position), as reference.build_sparse_block_table_prefill."""
        return _emitted(attend_metadata, *self._table(topk, attend_metadata))

    def _table(self, topk, attend_metadata):
        """emit_table's tables, not yet recorded in the metadata."""
        if not isinstance(attend_metadata, MsaMetadata):
            raise TypeError(f"attend_metadata: expected the attention group's MsaMetadata, "
                            f"got {type(attend_metadata).__name__}")
        n, h = attend_metadata.num_actual_tokens, self.cfg.num_kv_heads
        checks.check_topk(topk, h, None, self.cfg.topk)
        if topk.shape[1] < n:
            raise ValueError(f"topk: expected at least num_actual_tokens={n} rows, got {topk.shape[1]}")
        md = attend_metadata
        bt, ctx = self.kernels.run(self.specs.table, topk[:, :n], md.block_table, md.token_req_id, md.token_abs_pos,
                                   out_dtypes=[torch.int32, torch.int32])
        return bt.reshape(n * h, -1), ctx.reshape(n * h)


def _emitted(attend_metadata, sparse_bt, sparse_ctx):
    """(sparse_bt, sparse_ctx), recorded in the step's metadata as emitted through its block
    table, so that the attend does not check them again (MsaMetadata._record_emitted_table)."""
    attend_metadata._record_emitted_table(sparse_bt, sparse_ctx)
    return sparse_bt, sparse_ctx
