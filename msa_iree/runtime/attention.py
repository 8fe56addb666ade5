"""`SparseAttention`: the MiniMax-M3 sparse attend of one layer over SHUFFLE page-16 caches.

Per call it checks what is the layer's own and runs the compiled attend for the step's decode and
prefill parts: the hand-written GPU attend where the target and head grouping allow it (launched
on torch's stream on CUDA), else the portable module. On the GPU attend a step is one launch: a
decode-only step's decode attend, or for a step with prefills the prefill attend over every row
(decode rows included, each at its own request and position). Given the step's new key and value, `forward`
also inserts them: on the GPU top-k attend, inside the attend's own launch, decode-only steps and
steps with prefills alike (GpuAttendSpec.insert_kv: one launch a layer), else through `insert_kv`
first.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import checks
from ..config import DTYPES, MsaConfig, dtype_name
from ..layout import BLOCK_SIZE, PAGES_PER_BLOCK, block_page_stride
from ..ops import (GPU_ATTEND, GPU_PAGED_ATTEND, NATIVE_MATRIX, SparseAttnDecodeFmaSpec, SparseAttnDecodeSpec,
                   SparseAttnPrefillFmaSpec, SparseAttnPrefillSpec, SparsePagedAttendSpec)
from ..ops.fp8 import storage_dtype
from ..ops.tuning import COUNTER_WORDS
from .binding import _contiguous_copies, _LayerBinding, _refresh_copies
from .kv_insert import _insert_plan, _InsertLaunch, _run_insert
from .library import KernelLibrary, _current_raw_stream, module_scale
from .metadata import MsaMetadata


@dataclasses.dataclass
class _LayerState:
    """SparseAttention's per-layer operands (see SparseAttention._layer_state)."""
    stride: int                 # block page stride of the cache layout
    num_blocks: int             # 128-token blocks the cache holds
    kp: torch.Tensor            # folded page views [pages * H, ...], storage dtype
    vp: torch.Tensor
    ks: torch.Tensor            # module scales [H, 1 or slots]
    vs: torch.Tensor
    operands: tuple             # (kp flat, vp flat, scale, ks, vs): keeps the viewed memory alive
    views: tuple                # the same as IREE views (GPU drivers) or tensors (host)
    refresh: tuple = ()         # stream launch: (contiguous copy, strided operand), copied per call


def _gpu_matrix(target, cfg, gpu_matrix):
    """The GPU attend variant to use: `gpu_matrix` checked against the target and config; "auto"
    is the target's matrix-core kernel where it supports cfg (mma on cuda, mfma on gfx942), else fma."""
    if gpu_matrix not in ("auto", "fma", "mma", "mfma"):
        raise ValueError(f"gpu_matrix: expected 'auto', 'fma', 'mma' or 'mfma', got {gpu_matrix!r}")
    if gpu_matrix == "auto":
        native = NATIVE_MATRIX.get(target)
        return native if native and GPU_ATTEND[native, target][0].supports(cfg) else "fma"
    if gpu_matrix == "fma":
        return "fma"
    specs = GPU_ATTEND.get((gpu_matrix, target))
    if specs is None or not specs[0].supports(cfg):
        where = "a cuda target" if gpu_matrix == "mma" else "a gfx942 (or, emulated for tests, cuda) target"
        raise ValueError(f"gpu_matrix={gpu_matrix!r}: expected {where}, 8 or 16 heads per KV head and an fp8 or "
                         f"query-dtype cache, got target {target!r}, {cfg.group_size} "
                         f"heads per KV head, a {cfg.kv_dtype} cache with {cfg.query_dtype} queries")
    return gpu_matrix


class SparseAttention:
    """MiniMax-M3 sparse attend over SHUFFLE page-16 caches, backed by compiled IREE modules."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float, kv_cache_dtype,
                 target: str = "host", *, build_dir=None, query_dtype=torch.bfloat16, kernels=None,
                 validate_emitted_tables: bool = True, gpu_matrix: str = "auto", workspace=None):
        kv_name = kv_cache_dtype if isinstance(kv_cache_dtype, str) else dtype_name(kv_cache_dtype)
        self.cfg = MsaConfig(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size, kv_dtype=kv_name,
                             query_dtype=dtype_name(query_dtype))
        self.kv_dtype = DTYPES[kv_name]
        self.kernels = kernels or KernelLibrary(target, build_dir)
        self.scale = scale
        self.scale_tensor = torch.tensor([scale], dtype=torch.float32)
        self._layer_key = None
        # _StepLaunch: the bound attend (a stream launch) of the last decode-only step, and of the
        # last step with a prefill part (a chunked prefill's chunks often repeat one step shape)
        self._decode_launch = self._mixed_launch = None
        self._insert_launch = None  # _InsertLaunch: this layer's bound KV insert (stream launch)
        self._specs = {}  # (kernel class, stride, decode L, read_once, graph, insert) -> spec: built once
        self._workspace_floats = {}  # (id of a spec of _specs, tokens) -> its workspace_floats
        self.validate_emitted_tables = validate_emitted_tables
        # the GPU attend's scratch: the caller's f32 tensor (workspace_size bytes), else the library's
        self.workspace = workspace
        if workspace is not None:
            checks.check_dtype("workspace", workspace, torch.float32)
            if not workspace.is_contiguous():
                raise ValueError("workspace: expected a contiguous tensor, got a strided view")
            if workspace.numel() < COUNTER_WORDS:
                raise ValueError(f"workspace: expected at least {4 * COUNTER_WORDS} bytes (its counters), "
                                 f"got {4 * workspace.numel()}")
            # the attend's counters (its first words) must start at zero; each call leaves them so
            workspace[:COUNTER_WORDS].zero_()
            zero_copy = self.kernels.zero_copy and not self.kernels.stream_launch
            self._workspace_view = self.kernels.to_iree(workspace) if zero_copy else workspace
        # the hand-written GPU attend (decode and prefill) where the target and head grouping allow it
        self.gpu_decode = (self.kernels.target in SparseAttnDecodeFmaSpec.targets
                           and SparseAttnDecodeFmaSpec.supports(self.cfg))
        self.gpu_matrix = _gpu_matrix(self.kernels.target, self.cfg, gpu_matrix)
        self.decode_spec, self.prefill_spec = GPU_ATTEND[self.gpu_matrix, self.kernels.target] \
            if self.gpu_decode else (SparseAttnDecodeFmaSpec, SparseAttnPrefillFmaSpec)
        # a given page table (sparse_block_table): every row of a step in one launch of this
        self.paged_spec = GPU_PAGED_ATTEND[self.gpu_matrix, self.kernels.target] if self.gpu_decode else None
        # forward(key=, value=): the insert inside the attend's launch where the top-k attends (decode,
        # and prefill: a step with prefills) have that variant and are launched on torch's stream
        self.fuses_insert = bool(self.gpu_decode and self.kernels.stream_launch
                                 and all(cls(self.cfg, 16).with_insert() is not None
                                         for cls in (self.decode_spec, self.prefill_spec)))

    # the folded page views the modules read: [pages * H, ...] (id = page * H + head)
    @staticmethod
    def _folded(cache):
        return cache.reshape(-1, *cache.shape[2:]).view(storage_dtype(cache.dtype))

    def _spec(self, cls, stride, decode_query_len=1, read_once=False, graph=False, insert=False):
        """cls's spec for this layer, made once. read_once (the GPU page-table attend only): the
        step's rows each read their own pages (a decode step of one token a sequence: its loads
        then carry the L2 evict-first hint). graph: the call is being captured in a CUDA / HIP
        graph, which launches the GPU decode attends' graph variant (GpuAttendSpec.for_graph).
        insert: the GPU top-k attend that inserts the step's new K/V itself (with_insert)."""
        key = (cls, stride, decode_query_len, read_once, graph, insert)
        spec = self._specs.get(key)
        if spec is None:
            fields = {"read_once": True} if read_once else {}
            spec = cls(self.cfg.replace(decode_query_len=decode_query_len), stride, **fields)
            spec = spec.with_insert() if insert else spec
            self._specs[key] = spec = spec.for_graph() if graph else spec
        return spec

    def _on(self, device):
        """The constant operands on `device` (moved once, then reused by every call)."""
        if self.scale_tensor.device != device:
            self.scale_tensor = self.scale_tensor.to(device)

    def _layer_state(self, k_cache, v_cache, k_scale, v_scale):
        """What depends only on the layer's cache and scale tensors, worked out once and reused
        while the same tensors come back (a layer passes the same ones every step): their checks,
        the folded page views, the module scales, and for the GPU attend their IREE views
        (a DLPack import costs ~1-5 us per tensor on an H200 host, benchmarks/PERF.md)."""
        key = tuple(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
                    for t in (k_cache, v_cache, k_scale, v_scale))
        if self._layer_key == key:
            return self._layer
        cfg = self.cfg
        checks.check_kv_cache(k_cache, v_cache, cfg.num_kv_heads, self.kv_dtype)
        stride = block_page_stride(k_cache, v_cache)
        capacity = k_cache.shape[0] // stride * BLOCK_SIZE
        checks.check_scale("k_scale", k_scale, self.kv_dtype, cfg.num_kv_heads, capacity)
        checks.check_scale("v_scale", v_scale, self.kv_dtype, cfg.num_kv_heads, capacity)
        self._on(k_cache.device)
        kp, vp = self._folded(k_cache), self._folded(v_cache)
        ks, vs = self._scales(k_scale, v_scale, k_cache.device)
        operands = (kp.reshape(kp.shape[0], -1), vp.reshape(vp.shape[0], -1), self.scale_tensor, ks, vs)
        refresh = ()
        if self.kernels.stream_launch:
            # launched on torch's stream: the tensors themselves; a strided one (a scalar scale
            # expanded over 2+ KV heads) through a contiguous copy refreshed on every call, so
            # that a scale changed in place is seen, as IREE's call (which copies it) sees it
            views, refresh = _contiguous_copies(operands)
        else:
            # only a zero-copy view can be reused (it reads the tensor's current bytes); anything
            # IREE would copy (host driver, a strided scale) is imported again on every call
            views = tuple(self.kernels.to_iree(t) if self.kernels.zero_copy and t.is_cuda and t.is_contiguous() else t
                          for t in operands)
        # operands keeps the memory the views point at alive
        self._layer = _LayerState(stride, capacity // BLOCK_SIZE, kp, vp, ks, vs, operands, views, refresh)
        self._layer_key = key
        return self._layer

    def _step_views(self, holder, *names):
        """IREE views of step tensors (`names` of the metadata or of one of its phases; for stream
        launches the tensors, on the device), made by the first layer of a step and reused by the
        others (they share the step's metadata)."""
        cache = holder.__dict__.setdefault("_iree_views", {})
        views = cache.get((id(self.kernels), names))
        if views is None:
            if self.kernels.stream_launch:  # the tensors, on the query's device, contiguous
                device = self.scale_tensor.device
                views = [getattr(holder, n).to(device).contiguous() for n in names]
            else:
                views = [self.kernels.to_iree(getattr(holder, n)) for n in names]
            cache[id(self.kernels), names] = views
        return views

    def workspace_size(self, max_num_tokens: int) -> int:
        """Bytes of the GPU attend's workspace (its counters, then its split partials)
        that serve any step of up to max_num_tokens tokens, decode or prefill: the size of a
        caller-owned `workspace`. The layer zeroes the counters when it is given the workspace;
        the caller keeps other kernels from writing its first 640 bytes (COUNTER_WORDS i32)
        while layers use it (the library's own workspace is the attend's alone)."""
        specs = (self._spec(self.decode_spec, 16), self._spec(self.prefill_spec, 16))
        return 4 * max(s.workspace_floats(max_num_tokens) for s in specs)

    def _workspace_for(self, spec, num_tokens, device):
        """The GPU attend's workspace: the caller's (checked for size), else the library's, which
        every layer on it shares (their kernels run one after another on one stream)."""
        need = self._workspace_floats.get((id(spec), num_tokens))
        if need is None:
            need = self._workspace_floats[id(spec), num_tokens] = spec.workspace_floats(num_tokens)
        if self.workspace is None:
            return self.kernels.workspace(need, device)
        if self.workspace.numel() < need:
            raise ValueError(f"workspace: expected at least {4 * need} bytes for {num_tokens} tokens "
                             f"(SparseAttention.workspace_size), got {4 * self.workspace.numel()}")
        return self._workspace_view

    def _scales(self, k_scale, v_scale, device):
        h = self.cfg.num_kv_heads
        return tuple(self.kernels.unit_scale(h, device) if s is None else module_scale(s, h) for s in (k_scale, v_scale))

    def _check(self, query, k_cache, output, topk, num_tokens):
        """The per-call checks (the cache and scale checks run in _layer_state, once per tensor)."""
        cfg = self.cfg
        checks.check_query(query, cfg.num_heads)
        checks.check_dtype("query", query, cfg.query_torch_dtype)
        checks.check_device("k_cache", k_cache, query.device)
        checks.check_out(output, query)
        checks.check_topk(topk, cfg.num_kv_heads, None, cfg.topk)
        for name, rows in (("query", query.shape[0]), ("topk", topk.shape[1])):
            if rows < num_tokens:
                raise ValueError(f"{name}: expected at least num_actual_tokens={num_tokens} rows (the step's "
                                 f"tokens), got {rows}")

    def insert_kv(self, key, value, k_cache, v_cache, metadata_or_slots, k_scale=None, v_scale=None):
        """This layer's KV insert: runtime.insert_kv (same arguments, checks and result; key/value
        [N, H, 128] bf16/fp16 written into k_cache/v_cache in place). Launched on torch's stream
        with slots the builder range-checked (MetadataBuilder(num_cache_blocks=...)), the later
        calls over the same caches, scales and step buffers go through a binding that checks only
        key and value: 47-71 -> 7-10 us of host time a call on an H200 (benchmarks/PERF.md)."""
        bound = self._insert_launch
        if bound is not None and bound(metadata_or_slots, key, value, k_cache, v_cache, k_scale, v_scale):
            return
        self._insert_launch = None
        plan = _insert_plan(self.kernels, key, value, k_cache, v_cache, metadata_or_slots, k_scale, v_scale,
                            self.kv_dtype)
        if plan is None:
            return
        spec, operands, capacity = plan
        _run_insert(self.kernels, spec, operands)
        self._insert_launch = _InsertLaunch.bind(self.kernels, spec, metadata_or_slots,
                                                 (k_cache, v_cache, k_scale, v_scale), operands, capacity)

    def _fused_insert(self, metadata, query, key, value, tables) -> bool:
        """Whether forward's key/value go into the cache inside the attend's launch: a step on the
        GPU top-k attends with that variant, launched on torch's stream (eagerly or in a captured
        graph), no page table given, new keys and values in the query's dtype. (Else insert_kv
        runs first.)"""
        if (key is None) != (value is None):
            raise ValueError(f"key, value: expected both (the step's new tokens, inserted before the attend) or "
                             f"neither, got key={'None' if key is None else 'a tensor'} and value="
                             f"{'None' if value is None else 'a tensor'}")
        return self.fuses_insert and not tables and key.dtype == query.dtype and value.dtype == query.dtype

    def _check_new_kv(self, key, value, query, num_tokens):
        """forward's key/value for the attend that inserts them: [>= tokens, H, 128] of the query's
        dtype, on its device, contiguous (the kernel reads their rows from the first)."""
        checks.check_new_kv(key, value, self.cfg.num_kv_heads, query.dtype)
        checks.check_device("key", key, query.device)
        checks.check_device("value", value, query.device)
        if key.shape[0] < num_tokens:
            raise ValueError(f"key: expected at least num_actual_tokens={num_tokens} rows (the step's tokens), "
                             f"got {key.shape[0]}")
        for name, t in (("key", key), ("value", value)):
            if not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")

    def forward(self, query, k_cache, v_cache, output, topk, metadata: MsaMetadata, k_scale=None, v_scale=None,
                sparse_block_table=None, sparse_context_lens=None, key=None, value=None):
        """The attend of one layer for one step, written into `output` (returned).

        query/output [>= tokens, Hq, 128] bf16/fp16 (rows past the step's tokens are not touched);
        k_cache/v_cache: the layer's SHUFFLE views; topk [H, >= tokens, 16] int32 logical block ids
        of each token's request (-1: none), decode rows first; metadata: the step's
        (MetadataBuilder.build), or None for a profiling run (nothing attended, output untouched);
        k_scale/v_scale: fp8 caches' scales, fp32 [1] or [H, >= cache tokens]; sparse_block_table
        [tokens * H, 128] / sparse_context_lens [tokens * H] int32: a page table the indexer
        emitted (row = token * H + head), used instead of building one from topk. On a GPU the
        hand-written attend reads it, every row of the step in one launch, each 8-page group as
        one block's pages in order (what msa-iree's and AITER's emitters make); elsewhere the
        portable attend. With validate_emitted_tables (the default) the table is checked first
        (checks.check_page_table: ids in the cache, lengths, on a GPU the groups), one host sync a
        call, unless msa-iree's Indexer emitted it for this step (Indexer.emit_table,
        topk_with_table) and no torch operation wrote to it since: such a table is valid by
        construction (no sync; capturable in a CUDA graph). Without validation the kernels clamp
        every id into the cache (memory-safe, not checked).
        key/value [>= tokens, H, 128] bf16/fp16 (optional): the step's new tokens, written into
        the cache before the attend reads it, as insert_kv(key, value, k_cache, v_cache, metadata,
        k_scale, v_scale) writes them; over the GPU top-k attend (`fuses_insert`) that write is
        done by the attend's own launch, decode-only steps and steps with prefills alike (one
        launch a layer; a kernel fewer in a captured graph).
        """
        if metadata is None:
            return output  # a profiling run: nothing to attend
        if not isinstance(metadata, MsaMetadata):
            raise TypeError(f"metadata: expected an MsaMetadata (MetadataBuilder.build) or None (a profiling run), "
                            f"got {type(metadata).__name__}")
        # a call being captured in a CUDA / HIP graph launches the decode attends' graph variants
        graph = query.is_cuda and torch.cuda.is_current_stream_capturing()
        tables = sparse_block_table is not None or sparse_context_lens is not None
        bound = self._decode_launch if metadata.prefill is None else self._mixed_launch
        bound = bound if bound is not None and bound.graph == graph and not tables else None
        if bound is not None and bound(metadata, query, k_cache, v_cache, output, topk, k_scale, v_scale, key, value):
            return output  # a bound step of the same shape: only what changes per call was checked
        if (key is not None or value is not None) and not self._fused_insert(metadata, query, key, value, tables):
            self.insert_kv(key, value, k_cache, v_cache, metadata, k_scale, v_scale)
            key = value = None
            if bound is not None and bound(metadata, query, k_cache, v_cache, output, topk, k_scale, v_scale):
                return output
        cfg, h = self.cfg, self.cfg.num_kv_heads
        nd, n = metadata.num_decode_tokens, metadata.num_actual_tokens
        self._check(query, k_cache, output, topk, n)
        layer = self._layer_state(k_cache, v_cache, k_scale, v_scale)
        metadata.check_cache_blocks(layer.num_blocks)  # the step's largest block id, found by the builder
        if key is not None:  # inserted by the attend (_fused_insert)
            self._check_new_kv(key, value, query, n)
            metadata.check_cache_slots(layer.num_blocks * BLOCK_SIZE)
        stride = layer.stride
        emitted = checks.check_sparse_table(sparse_block_table, sparse_context_lens, None, cfg.topk)
        if emitted:
            if stride != PAGES_PER_BLOCK * 2:
                raise RuntimeError(f"the indexer emitted a page table for a block spanning {PAGES_PER_BLOCK * 2} pages, "
                                   f"but this KV cache lays a block out over {stride}. The page-16 rebase assumes both "
                                   "K/V sides share a block.")
            checks.check_shape("sparse_block_table", sparse_block_table, (None, cfg.topk * PAGES_PER_BLOCK))
            if sparse_block_table.shape[0] < n * h or sparse_context_lens.shape[0] < n * h:
                raise ValueError(f"sparse_block_table: expected at least num_actual_tokens * num_kv_heads = {n * h} "
                                 f"rows, got {sparse_block_table.shape[0]} and {sparse_context_lens.shape[0]}")
            gpu_paged = self.paged_spec is not None
            if self.validate_emitted_tables and not metadata._emitted_table_unchanged(
                    sparse_block_table, sparse_context_lens, n * h):
                checks.check_page_table(sparse_block_table[:n * h], sparse_context_lens[:n * h], h,
                                        min(k_cache.shape[0], v_cache.shape[0]) * h, stride if gpu_paged else None)
        _refresh_copies(layer.refresh)
        if emitted and gpu_paged and n:  # the GPU attend over the given table: every row of the step in one launch
            read_once = metadata.prefill is None and metadata.decode.decode_query_len == 1
            spec = self._spec(self.paged_spec, stride, read_once=read_once, graph=graph)
            kpv, vpv, scale_v, ksv, vsv = layer.views
            args = (_rows(query, 0, n), kpv, vpv, sparse_block_table[:n * h].reshape(n, h, -1),
                    sparse_context_lens[:n * h].reshape(n, h), scale_v, ksv, vsv)
            self.kernels.run(spec, *args, out=[_rows(output, 0, n), self._workspace_for(spec, n, query.device)])
            return output
        if emitted or not self.gpu_decode:  # the portable attend, phase by phase
            given = (sparse_block_table, sparse_context_lens) if emitted else None
            for lo, hi, phase in ((0, nd, metadata.decode), (nd, n, metadata.prefill)):
                if hi > lo:
                    self._portable_attend(metadata, phase, lo, hi, query, output, topk, layer, given)
            return output
        if n == 0:
            return output
        kpv, vpv, scale_v, ksv, vsv = layer.views
        if metadata.prefill is None:  # decode only: the decode attend (inserting the step's K/V where given)
            spec = self._spec(self.decode_spec, stride, metadata.decode.decode_query_len, graph=graph,
                              insert=key is not None)
            holder, names = metadata.decode, _DECODE_STEP
        else:  # with prefills: one attend over every row of the step, each at its own request and position
            spec = self._spec(self.prefill_spec, stride, insert=key is not None)
            holder, names = metadata, _STEP_ROWS
        step_tensors = self._step_views(holder, *names)
        args = (_rows(query, 0, n), kpv, vpv, _rows(topk, 0, n, 1), *step_tensors, scale_v, ksv, vsv)
        if key is not None:  # the step's new K/V and their slots, written by the attend
            args += (_rows(key, 0, n), _rows(value, 0, n), _rows(metadata.slot_mapping, 0, n))
        # (checks.check_out: output is contiguous)
        ws = self._workspace_for(spec, n, query.device)
        out_rows = _rows(output, 0, n)
        self.kernels.run(spec, *args, out=[out_rows, ws])  # written in place
        step = {4 + i: getattr(holder, name) for i, name in enumerate(names)}
        if key is not None:
            step[len(args) - 1] = metadata.slot_mapping
        bound = _StepLaunch.bind(self.kernels, metadata, layer, (k_cache, v_cache, k_scale, v_scale),
                                 (query, topk, output), (spec, args, out_rows, ws, step), graph, (key, value))
        if metadata.prefill is None:
            self._decode_launch = bound
        else:
            self._mixed_launch = bound
        return output

    __call__ = forward

    def _portable_attend(self, metadata, phase, lo, hi, query, output, topk, layer, tables=None):
        """The portable attend of the step's rows [lo, hi) (one phase; over the given page table
        where `tables` holds it), in calls of at most the spec's rows_per_call rows, so that
        what a call gathers stays bounded (a decode request's L rows stay in one call), each
        call's result copied into its rows of output."""
        h, stride = self.cfg.num_kv_heads, layer.stride
        if tables is not None:
            sbt, sctx = tables
            spec, unit = self._spec(SparsePagedAttendSpec, stride), 1
            rows = lambda a, b: (sbt[a * h:b * h].reshape(b - a, h, -1), sctx[a * h:b * h].reshape(b - a, h))
        elif phase is metadata.decode:  # (decode rows start at 0)
            L = phase.decode_query_len
            spec, unit = self._spec(SparseAttnDecodeSpec, stride, L), L
            rows = lambda a, b: (topk[:, a:b], phase.block_table[a // L:b // L], phase.seq_lens[a // L:b // L])
        else:
            spec, unit = self._spec(SparseAttnPrefillSpec, stride), 1
            rows = lambda a, b: (topk[:, a:b], phase.block_table, phase.query_req_id[a - lo:b - lo],
                                 phase.query_abs_pos[a - lo:b - lo])
        per_call = max(1, spec.rows_per_call() // unit) * unit
        for a in range(lo, hi, per_call):
            b = min(hi, a + per_call)
            (o,) = self.kernels.run(spec, _rows(query, a, b), layer.kp, layer.vp, *rows(a, b), self.scale_tensor,
                                    layer.ks, layer.vs, out_dtypes=[query.dtype])
            output[a:b].copy_(o)


class _StepLaunch(_LayerBinding):
    """A layer's step bound to its stream launch (FlashInfer's plan/run split): made by a forward
    that ran every check and launched the step's GPU attend in place, it serves the later calls
    whose step has the same key (the builder's step tensors at the same addresses in the same
    shapes: this step's other layers, and every later step of the same shape) over the same
    caches and scales, checking only what may change per call (the step's largest block id
    against the cache; the query, output and top-k tensors, and an inserting attend's key and
    value: the shapes, dtypes and device bound, contiguous) before it launches the attend on
    them; any other call takes the checked path (and binds anew). It keeps the bound step's
    tensors alive (as every _LayerBinding the layer's)."""

    @classmethod
    def bind(cls, kernels, metadata, layer, layer_tensors, call_tensors, launched, graph=False, new_kv=(None, None)):
        """None unless the attend is launched on torch's stream from the call tensors' own memory.
        layer_tensors: (k_cache, v_cache, k_scale, v_scale); call_tensors: (query, topk, output);
        launched: (spec, args, output rows, workspace, step tensors): the module's inputs as
        forward passed them (query rows at 0, top-k rows at 3; with new_kv, an inserting attend's
        key, value and slot rows last) and {argument index: the metadata's tensor} that
        those arguments must be (else they were copied for the launch: a later step would not be
        seen); graph: whether it was bound while a graph was captured (it then serves only such
        calls)."""
        query, topk, output = call_tensors
        key, value = new_kv
        insert = key is not None
        spec, args, out_rows, workspace, step_tensors = launched
        sk = kernels.stream_kernel(spec) if kernels.stream_launch else None
        # the kernel reads and writes the call tensors from their first rows: their addresses per call
        rows = [(args[0], query), (args[3], topk), (out_rows, output)]
        nk = len(args) - 3  # an inserting attend's key, value and slots: its last operands
        if insert:
            rows += [(args[nk], key), (args[nk + 1], value)]
        if (sk is None or not all(t.is_contiguous() and r.is_contiguous() and r.data_ptr() == t.data_ptr()
                                  for r, t in rows)
                or any(args[i].data_ptr() != t.data_ptr() for i, t in step_tensors.items())):
            return None
        self = cls()
        self.graph, self.insert = graph, insert
        self.launch = sk.bind([*args, out_rows, workspace], variable=(0, 3, nk, nk + 1, len(args)) if insert
                              else (0, 3, len(args)))
        self.num_blocks = layer.num_blocks
        self._hold(metadata.step_key, layer_tensors, layer.refresh)
        self.q_shape, self.q_dtype, self.topk_shape = query.shape, query.dtype, topk.shape
        self.kv_shape = key.shape if insert else None
        self.device_index = query.get_device()
        return self

    def __call__(self, metadata, query, k_cache, v_cache, output, topk, k_scale, v_scale, key=None,
                 value=None) -> bool:
        """Queue the attend if this call is one the binding serves (True); else False, nothing done.
        key/value: the step's new K/V, served only by an inserting attend's binding (and it only
        serves calls that bring them): refused first, so that a call with them, whose binding does
        not insert (kernels without the variant), costs one compare before its insert runs."""
        if ((key is not None or value is not None) != self.insert
                or not self._serves(metadata, k_cache, v_cache, k_scale, v_scale)
                or metadata.max_block_id >= self.num_blocks):
            return False
        q_shape, q_dtype, index = self.q_shape, self.q_dtype, self.device_index
        if not (query.shape == q_shape and output.shape == q_shape and topk.shape == self.topk_shape
                and query.dtype == q_dtype and output.dtype == q_dtype and topk.dtype == _INT32
                and query.get_device() == index and output.get_device() == index and topk.get_device() == index
                and query.is_contiguous() and output.is_contiguous() and topk.is_contiguous()):
            return False
        if self.insert:
            shape = self.kv_shape
            if not (key is not None and value is not None and key.shape == shape and value.shape == shape
                    and key.dtype == q_dtype and value.dtype == q_dtype and key.get_device() == index
                    and value.get_device() == index and key.is_contiguous() and value.is_contiguous()
                    and metadata.max_slot < self.num_blocks * _BLOCK):
                return False
            addresses = (query.data_ptr(), topk.data_ptr(), key.data_ptr(), value.data_ptr(), output.data_ptr())
        else:
            addresses = (query.data_ptr(), topk.data_ptr(), output.data_ptr())
        if self.refresh:
            self._refresh()
        self.launch(_current_raw_stream(index), *addresses)
        return True


_INT32 = torch.int32
# the step tensors the GPU attend reads, in its operand order: a decode-only step's (DecodeMetadata)
# and, for a step with prefills, the whole step's (MsaMetadata: every token's request and position)
_DECODE_STEP = ("block_table", "seq_lens")
_STEP_ROWS = ("block_table", "token_req_id", "token_abs_pos")
_BLOCK = BLOCK_SIZE


def _rows(t, lo, hi, dim=0):
    """Rows lo:hi of `t` along dim; `t` itself when that is all of it (a slice costs ~1-2 us of
    host time per call, and a decode-only step takes every row)."""
    if lo == 0 and hi == t.shape[dim]:
        return t
    return t[lo:hi] if dim == 0 else t[:, lo:hi]
