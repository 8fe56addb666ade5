"""`Indexer`: MiniMax-M3's lightning indexer of one layer (the index-cache insert, the block
scores and top-k the attend reads), on the same per-step metadata as `SparseAttention`.

The index cache is a KV-cache group of its own (its own block table and slots): its step is
built by a `MetadataBuilder` over the index group's tensors, once per step for all layers, and a
layer's calls read that metadata (token positions, the index block table, the insert's rows).

It runs the portable kernels of ops/indexer.py on every target: correct everywhere, fast nowhere
(a [tokens, columns, 128, 128] key gather; on a GPU IREE's synchronous call, and the insert's
padding dropped with a host sync). The GPU indexer kernels are not written yet.
"""
from __future__ import annotations

import torch

from .. import checks
from ..config import MsaConfig, dtype_name
from ..layout import BLOCK_SIZE, HEAD_DIM
from ..layout import PAGES_PER_BLOCK
from ..ops import BuildPrefillTableSpec, IndexCacheInsertSpec, IndexTopkSpec
from ..ops.fp8 import storage_dtype
from .kv_insert import drop_padding
from .library import KernelLibrary
from .metadata import MsaMetadata


class Indexer:
    """num_index_heads: index heads per rank (one per KV head); index_cache_dtype: bf16 or
    float8_e4m3fn; init_blocks, local_blocks: MiniMax-M3's sparse_init_block, sparse_local_block."""

    def __init__(self, num_index_heads: int, index_cache_dtype, *, init_blocks: int = 0, local_blocks: int = 1,
                 target: str = "host", build_dir=None, kernels=None, query_dtype=torch.bfloat16):
        cache_name = index_cache_dtype if isinstance(index_cache_dtype, str) else dtype_name(index_cache_dtype)
        self.cfg = MsaConfig(num_heads=16 * num_index_heads, num_kv_heads=num_index_heads, kv_dtype=cache_name,
                             query_dtype=dtype_name(query_dtype))
        self.topk_spec = IndexTopkSpec(self.cfg, 16, init_blocks, local_blocks)  # refuses what it cannot build
        self.insert_spec = IndexCacheInsertSpec(self.cfg)
        # the attend's page table for a top-k, through the attention group's block table (page-16
        # rebase: both K/V sides in one 16-page block)
        self.table_spec = BuildPrefillTableSpec(self.cfg, 2 * PAGES_PER_BLOCK)
        self.kernels = kernels or KernelLibrary(target, build_dir)

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
        # the GPU KV writer's form keeps padding, which the portable insert cannot skip
        rows, slots = drop_padding(metadata.insert_token_index, metadata.insert_slots)
        if slots.numel() == 0:
            return
        (updated,) = self.kernels.run(self.insert_spec, raw, index_k, rows, slots, out_dtypes=[raw.dtype])
        raw.copy_(updated)

    def topk(self, index_q, index_cache, metadata: MsaMetadata) -> torch.Tensor:
        """topk [H, tokens, 16] int32 (what SparseAttention.forward takes): each token's
        highest-scoring blocks of its request, as reference.index_topk; index_q [>= tokens, H,
        128] 16-bit."""
        raw = self._check_cache(index_cache, metadata)
        checks.check_shape("index_q", index_q, (None, self.cfg.num_kv_heads, HEAD_DIM))
        checks.check_dtype("index_q", index_q, self.cfg.query_torch_dtype)
        n = metadata.num_actual_tokens
        if index_q.shape[0] < n:
            raise ValueError(f"index_q: expected at least num_actual_tokens={n} rows, got {index_q.shape[0]}")
        metadata.check_cache_blocks(index_cache.shape[0], "index_cache")
        (topk,) = self.kernels.run(self.topk_spec, index_q[:n], raw, metadata.block_table, metadata.token_req_id,
                                   metadata.token_abs_pos, out_dtypes=[torch.int32])
        return topk

    def emit_table(self, topk, attend_metadata: MsaMetadata):
        """The attend's page table for `topk` (what SparseAttention.forward takes as
        sparse_block_table / sparse_context_lens, so that it builds none): [tokens * H, 128] and
        [tokens * H] int32, through the *attention* group's metadata (its block table, every
        token's request and position), as reference.build_sparse_block_table_prefill."""
        if not isinstance(attend_metadata, MsaMetadata):
            raise TypeError(f"attend_metadata: expected the attention group's MsaMetadata, "
                            f"got {type(attend_metadata).__name__}")
        n, h = attend_metadata.num_actual_tokens, self.cfg.num_kv_heads
        checks.check_topk(topk, h, None, self.cfg.topk)
        if topk.shape[1] < n:
            raise ValueError(f"topk: expected at least num_actual_tokens={n} rows, got {topk.shape[1]}")
        md = attend_metadata
        bt, ctx = self.kernels.run(self.table_spec, topk[:, :n], md.block_table, md.token_req_id, md.token_abs_pos,
                                   out_dtypes=[torch.int32, torch.int32])
        return bt.reshape(n * h, -1), ctx.reshape(n * h)
