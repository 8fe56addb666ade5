"""Per-step metadata: what every sparse layer of one step shares, built once by `MetadataBuilder`.

The builder does, once per step, everything that needs the host or the step's values: the
decode-first split, the checks of every id against what it indexes (so that no layer has to sync
with the host), per-token positions, the page-16 rebase, the insert's slots. It writes the step's
tensors into buffers it keeps at stable addresses, so that a layer's bound launch (and a captured
CUDA graph) reads the next step's values from the same memory. A layer's calls read the plain
`MsaMetadata` it returns (docs/SPEC.md, "Per-step metadata").
"""
from __future__ import annotations

import dataclasses
import functools
import typing
import weakref

import numpy as np
import torch

from .. import checks
from ..layout import BLOCK_SIZE
from ..ops import InsertKvGpuSpec
from ..ops.indexer_gpu import QUERY_TILE
from .library import KernelLibrary, _current_raw_stream


@dataclasses.dataclass
class DecodeMetadata:
    """The decode requests of a step (the first num_decodes), each with decode_query_len tokens."""

    block_table: torch.Tensor          # [num_decodes, cols] int32 cache block ids, unrebased
    seq_lens: torch.Tensor             # [num_decodes] int32, the new tokens included
    decode_query_len: int              # L: 1, or 1 + speculative tokens
    page16_block_table: torch.Tensor   # [num_decodes, cols] int32: block_table * 2 (vLLM's page16 view)


@dataclasses.dataclass
class PrefillMetadata:
    """The (chunked) prefill requests of a step, their request ids relative to the prefills."""

    block_table: torch.Tensor          # [num_prefills, cols] int32
    cu_seqlens_q: torch.Tensor         # [num_prefills + 1] int32, from 0
    seq_lens: torch.Tensor             # [num_prefills] int32
    context_lens: torch.Tensor         # [num_prefills] int32: tokens computed before this step
    query_req_id: torch.Tensor         # [num_prefill_tokens] int32
    query_abs_pos: torch.Tensor        # [num_prefill_tokens] int32
    page16_block_table: torch.Tensor   # [num_prefills, cols] int32


@dataclasses.dataclass
class MsaMetadata:
    """One step, as every layer's `forward` and `insert_kv` read it. The tensors are views of the
    builder's buffers (stable addresses); the ints were checked by the builder."""

    num_actual_tokens: int             # the step's tokens (decode first); rows past it are not touched
    num_decodes: int
    num_decode_tokens: int             # num_decodes * decode_query_len (padding requests included)
    num_prefills: int
    num_prefill_tokens: int
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None
    slot_mapping: torch.Tensor         # [num_actual_tokens] int32 logical slots, < 0 = not written
    page16_slot_mapping: torch.Tensor  # [num_actual_tokens] int32 the slots rebased for an interleaved cache
    insert_token_index: torch.Tensor   # [M] int32 rows of key/value the insert writes ...
    insert_slots: torch.Tensor         # [M] int32 ... at these slots (the GPU writer: every token, < 0 skipped)
    block_table: torch.Tensor          # [reqs, cols] int32 the step's block table as given (all requests)
    token_req_id: torch.Tensor         # [num_actual_tokens] int32 each token's request in the step (decode first)
    token_abs_pos: torch.Tensor        # [num_actual_tokens] int32 ... and its position (< 0: a padded request's)
    max_block_id: int                  # the largest cache block id the step's requests reference (-1: none)
    max_slot: int                      # the largest slot the step writes (-1: none)
    # where and how big the step's tensors are: two steps with one key have their tensors at the
    # same addresses in the same shapes, so a launch bound for one serves the other
    step_key: tuple = ()
    # a step with prefills: its tokens in tiles of QUERY_TILE consecutive tokens of one request
    # (fewer at a request's end), [tiles] int32 each tile's first token, the requests in order
    # (the GPU indexer's tiled launch); None for a decode-only step
    query_tiles: torch.Tensor | None = None
    # the page tables msa-iree's Indexer emitted through this step's block table (emit_table,
    # topk_with_table), by address: each tensor as it was written (_Written)
    _emitted: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def _record_emitted_table(self, sparse_bt, sparse_ctx):
        """A page table [rows, 128] / [rows] int32 emitted through this step's block table: valid
        by construction for any cache the step's blocks fit (its ids are block table entries the
        builder checked, its lengths at most 16 blocks), so the attend need not check it again."""
        self._emitted[sparse_bt.data_ptr()] = (_Written.of(sparse_bt), _Written.of(sparse_ctx))

    def _emitted_table_unchanged(self, sparse_bt, sparse_ctx, rows: int) -> bool:
        """Whether rows [0, rows) of the given table are those of a table emitted for this step,
        its memory alive since (so not reused by another tensor at the same address) and written
        to by no torch operation on it (torch's version counters: a write from outside torch, a
        raw kernel's, or through another tensor over the same memory is not seen)."""
        table = self._emitted.get(sparse_bt.data_ptr())
        return table is not None and table[0].holds(sparse_bt, rows) and table[1].holds(sparse_ctx, rows)

    def check_cache_blocks(self, num_blocks: int, what="k_cache"):
        """Refuse a cache with fewer blocks than the step references (no sync: ints)."""
        if self.max_block_id >= num_blocks:
            raise IndexError(f"block_table: expected cache block ids below {what}'s {num_blocks} blocks, "
                             f"got {self.max_block_id} (out of range)")

    def check_cache_slots(self, capacity: int, what="k_cache"):
        if self.max_slot >= capacity:
            raise IndexError(f"slot_mapping: expected slots below {what}'s {capacity} tokens, got {self.max_slot} "
                             "(out of range)")


class _Written(typing.NamedTuple):
    """An int32 tensor as an emitter left it (MsaMetadata._record_emitted_table)."""
    address: int
    rows: int
    stride: tuple
    version: int
    memory: weakref.ref  # the tensor owning its memory (alive: the address is still its own)

    @classmethod
    def of(cls, t):
        return cls(t.data_ptr(), t.shape[0], t.stride(), t._version, weakref.ref(t if t._base is None else t._base))

    def holds(self, t, rows: int) -> bool:
        """Whether t's first `rows` rows are this tensor's, unchanged since."""
        return (self.memory() is not None and t.data_ptr() == self.address and rows <= self.rows
                and t.stride() == self.stride and t.dtype == torch.int32 and t._version == self.version)


_INDEX_DTYPES = (torch.int32, torch.int64)
_NO_PREFILLS = np.zeros(0, np.int64)


def _cdiv(a, b):
    return -(-a // b)


# the per-step path reduces a few dozen small arrays: ndarray.any/max/min go through Python
# wrappers, the ufuncs' reductions and count_nonzero do not (~1 us less each)
_max, _min = np.maximum.reduce, np.minimum.reduce


def _none(mask) -> bool:
    return not np.count_nonzero(mask)


def _first(mask) -> int | None:
    """The index of the first True of a numpy mask, None if none."""
    return int(mask.argmax()) if mask.any() else None


_MASKED_IDS = 1 << 14  # block tables up to this many ids are reduced through a mask, larger ones by segments
_HOST_REBASE_IDS = 1 << 14  # block tables up to this many ids are rebased on the host, larger ones on the device
_HOST_CHECK_IDS = 1 << 14  # up to this many used ids are checked on the host; more on the device (CUDA)


@functools.lru_cache(maxsize=64)
def _column_starts(cols) -> np.ndarray:
    """Each of `cols` columns' first position: a column is used by a request whose seq_len passes it."""
    return np.arange(cols, dtype=np.int64) * BLOCK_SIZE


def _largest_used_id(block_table, seq) -> int:
    """The largest id of the columns each request uses, block_table[r, :cdiv(seq[r], 128)], read
    as uint32 (-1 where none is used): one pass finds both checks' answer, since a negative id
    reads as 2**31 or more. A mask costs a pass over the table per operation; past _MASKED_IDS the
    used segments are reduced in one pass (3x faster at 64 x 1024 ids)."""
    reqs, cols = block_table.shape
    if block_table.size <= _MASKED_IDS:
        ids = block_table[_column_starts(cols) < seq[:, None]]
        return int(_max(ids.view(np.uint32))) if ids.size else -1
    need = (seq + (BLOCK_SIZE - 1)) >> 7  # cdiv(seq_len, 128)
    used = need > 0
    if not used.any():
        return -1
    # reduceat over [r * cols, r * cols + need[r]] for every request but the last: the used
    # segments are the even ones (an unused one between them); the last runs from the last
    # request's first column to the table's end (an end reduceat cannot take as an index), so its
    # used columns are reduced on their own
    flat = block_table.reshape(-1).view(np.uint32)
    spans = np.empty(2 * reqs - 1, np.int64)
    spans[0::2] = np.arange(reqs) * cols
    spans[1::2] = spans[0:-1:2] + need[:-1]
    highs = np.maximum.reduceat(flat, spans)[0::2]
    if need[-1] > 0:
        highs[-1] = _max(flat[spans[-1]:spans[-1] + need[-1]])
    return int(_max(highs[used]))


def used_id_extremes(block_table, seq_lens, column_starts, out, used=None, values=None):
    """The smallest and largest id of the columns each request uses, block_table[r, :cdiv(seq_lens[r],
    128)], into out[0] and out[1], unused columns counting as 0 (so no used id is negative where
    the smallest is >= 0, and the largest is right where any column is used). block_table [reqs,
    cols] int32, seq_lens [reqs] int32, column_starts [cols] int32 (each column's first position),
    out [2] int32; used [reqs, cols] bool and values [reqs, cols] int32: where the mask and the
    masked ids go (new tensors if None). Torch ops, on the device that holds the tensors: what
    the device checks of a long block table run (_DeviceCheck), and on the host what the tests
    compare them with."""
    used = torch.lt(column_starts, seq_lens[:, None], out=used)
    torch.aminmax(torch.mul(used, block_table, out=values), out=(out[0], out[1]))


class _DeviceCheck:
    """The device's side of a long block table's step (CUDA, one per step shape (reqs, cols)): a
    CUDA graph that finds the used ids' extremes (used_id_extremes) and writes the page-16 table
    (block table * 2), so that the table never crosses to the host. One graph launch costs the
    host less than the ops' launches, and the table's transfer and its reduction on the host
    cost more than both from about _HOST_CHECK_IDS used ids on. It reads the block table where
    the kernels do (the input buffer's prefix) and the seq_lens from a copy past it, and writes
    the extremes and the mask after that, [block table | extremes (2) | seq_lens | used mask
    (bools)], in the input buffer; the masked ids go where the page-16 table then does. So the
    graph holds no memory of its own but its reduction's."""

    def __init__(self, builder, b, cols):
        device = builder.device
        self.block_table, self.extremes, self.seq_lens, self.used, self.page16 = \
            self.regions(builder._inputs, builder._derived, b, cols)
        self.column_starts = torch.arange(cols, dtype=torch.int32, device=device) * BLOCK_SIZE
        self.extremes_at, self.seq_lens_at = self.extremes.data_ptr(), self.seq_lens.data_ptr()
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._run()  # once outside the capture: anything the ops set up on first use
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._run()
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        raw = getattr(self.graph, "raw_cuda_graph_exec", None)  # torch >= 2.8
        self.graph_exec = raw() if raw is not None else None

    def launch(self, driver, stream):
        """On `stream`, the current one (torch's replay, where torch does not give the graph's handle)."""
        if self.graph_exec is not None:
            driver.launch_graph(self.graph_exec, stream)
        else:
            self.graph.replay()

    @staticmethod
    def size(b, cols):
        """The input buffer's int32 values it uses."""
        return b * cols + 2 + b + _cdiv(b * cols, 4)

    @staticmethod
    def regions(inputs, derived, b, cols):
        """Its views of the builder's input buffer [block table | extremes | seq_lens | used mask]
        and of the derived buffer's page-16 table (every step layout's first tensor)."""
        at = b * cols
        return (inputs[:at].view(b, cols), inputs[at:at + 2], inputs[at + 2:at + 2 + b],
                inputs[at + 2 + b:].view(torch.bool)[:at].view(b, cols), derived[:at].view(b, cols))

    def _run(self):
        used_id_extremes(self.block_table, self.seq_lens, self.column_starts, self.extremes, self.used, self.page16)
        torch.mul(self.block_table, 2, out=self.page16)


def _write_query_tiles(out, starts, lens) -> int:
    """Each request's tokens [starts[r], starts[r] + lens[r]) in tiles of QUERY_TILE: the tiles'
    first tokens into out, requests in order. Returns their count."""
    per_req = -(-lens // QUERY_TILE)
    count = int(per_req.sum())
    first_tile = np.cumsum(per_req) - per_req
    nth = np.arange(count) - np.repeat(first_tile, per_req)
    out[:count] = np.repeat(starts, per_req) + nth * QUERY_TILE
    return count


def _copy_driver(device):
    """The CUDA driver's copies for a builder on an NVIDIA GPU (None elsewhere: torch's copies).
    A serving step's build spends less host time in a few driver calls than in torch's
    concatenation and copies (benchmarks/PERF.md, decision record)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    from .cuda_launch import CudaDriver
    # a runtime call that needs the device's context makes torch's (the primary) current on this
    # thread, which the driver's calls use: a builder may be the first GPU work of its process
    torch.cuda.synchronize(device)
    return CudaDriver()


ALIGN = 16  # int32 elements: every tensor a step hands the kernels starts 64-byte aligned


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _aligned_starts(sizes) -> list[int]:
    """Where consecutive segments of `sizes` elements start, each on an ALIGN boundary."""
    starts, at = [], 0
    for size in sizes:
        starts.append(at)
        at = _aligned(at + size)
    return starts


class _InputLayout:
    """Where the inputs of one step shape sit in the input buffer, and the host views the checks
    read: [block table | qsl | seq_lens | computed | slots | the block table's first `used`
    columns], packed (only the block table, which the kernels read where it is, needs an aligned
    start: the buffer's). The host gets the rest in one transfer: from the block table on when
    every column is used, after it otherwise (the used columns, packed, are what the checks
    read)."""

    def __init__(self, builder, b, cols, n_slots, used):
        self.trimmed = used < cols
        at_small = b * cols
        at_slots = at_small + 3 * b + 1
        at_used = at_slots + n_slots
        end = at_used + b * used if self.trimmed else at_used
        self.stage, self.host_stage = builder._inputs[:end], builder._host_inputs[:end]
        first = at_small if self.trimmed else 0  # the first value the host needs
        self.to_host, self.host_part = self.stage[first:], self.host_stage[first:]
        host = self.host_stage.numpy()
        self.small, self.slots = host[at_small:at_slots], host[at_slots:at_used]
        self.block_table = (host[at_used:end] if self.trimmed else host[:at_small]).reshape(b, used)

    @staticmethod
    def size(b, cols, n_slots):
        """The most values an input layout of this shape takes."""
        return 2 * b * cols + 3 * b + 1 + n_slots


class _CopiedInputs:
    """Where the inputs of one step shape land in the pinned host buffer when the driver copies
    them from the caller's tensors (CUDA; int32 qsl, seq_lens and computed): [qsl | seq_lens |
    computed | slots in their own dtype (vLLM's are int64) | the block table's first `used`
    columns, or the used ids' extremes where the device checks them], packed, each copy's host
    address beside it. The kernels' block table is the input buffer's prefix, copied there on
    the device. The checks read it through the views an _InputLayout has (small, slots,
    block_table)."""

    def __init__(self, builder, b, cols, n_slots, slot_bytes, used):
        self.trimmed = used < cols
        at_slots = (3 * b + 2) // 2 * 2  # int32 elements, even: an int64 slot starts 8-byte aligned
        slot_words = n_slots * slot_bytes // 4
        at_table = at_slots + slot_words
        host = builder._host_inputs.numpy()
        self.small = host[:3 * b + 1]
        self.slots = host[at_slots:at_table].view(np.int64 if slot_bytes == 8 else np.int32)
        self.block_table = host[at_table:at_table + b * used].reshape(b, used)
        self.extremes = host[at_table:at_table + 2]  # where the table checked on the device is not
        base = builder._host_inputs.data_ptr()
        self.qsl_at, self.seq_at, self.computed_at = base, base + 4 * (b + 1), base + 4 * (2 * b + 1)
        self.slots_at, self.table_at = base + 4 * at_slots, base + 4 * at_table
        self.table_bytes, self.row_bytes, self.pitch = 4 * b * cols, 4 * used, 4 * cols
        self.stage_at = builder._inputs.data_ptr()  # the kernels' block table

    @staticmethod
    def size(b, cols, n_slots, slot_bytes):
        return 3 * b + 2 + n_slots * slot_bytes // 4 + b * cols


class _StepLayout:
    """Where the tensors of one step shape live in the builder's buffers: the views that every
    step of the shape reuses (making them costs more host time than the rest of a decode step's
    build). shape: (reqs, cols, slot entries given (0: none), tokens, decodes, L).

    The input buffer holds the step's inputs as given (_InputLayout; the kernels read its block
    table); the derived buffer what the builder works out, [page-16 block table |
    page-16 slots | slots | cu_seqlens_q | context_lens | query_req_id | query_abs_pos | query
    tiles | every token's request | every token's position | seq_lens | the prefills' seq_lens,
    block table and page-16 block table | the portable insert's rows]. Each tensor a kernel
    reads starts on an ALIGN-element (64-byte) boundary: the compiled kernels take their
    operands' addresses as aligned (IREE's bindings are 16-byte aligned, and a kernel may load
    two neighbours at once); so the seq_lens and the prefills' rows are host-written copies of
    their own, not views into the packed inputs.
    """

    def __init__(self, builder, shape):
        b, cols, n_slots, n, nd, L = shape
        num_prefills, n_prefill = b - nd, n - nd * L
        names = ["page16", "page16_slots", "slots"] + (["cu", "ctx", "qreq", "qpos", "tiles"] if num_prefills else []) \
            + ["req", "pos", "seq", "seq_prefill", "bt_prefill", "page16_prefill"]
        # (a request's tiles: ceil(its tokens / QUERY_TILE), so all of them at most n / QUERY_TILE + b)
        sizes = [b * cols, n, n] + ([num_prefills + 1, num_prefills, n_prefill, n_prefill, n // QUERY_TILE + b]
                                    if num_prefills else []) \
            + [n, n, b, num_prefills, num_prefills * cols, num_prefills * cols]
        self.at = dict(zip(names, _aligned_starts(sizes)))  # name -> its first element in the derived buffer
        self.n_derived = _aligned(self.at[names[-1]] + sizes[-1])
        self.derived, self.host_derived = builder._derived[:self.n_derived], builder._host_derived[:self.n_derived]
        views = [self.derived[self.at[k]:self.at[k] + size] for k, size in zip(names, sizes)]
        host = self.host_derived.numpy()
        self.host = {k: host[self.at[k]:self.at[k] + size] for k, size in zip(names, sizes)}  # what _derive writes
        self.num_prefills, self.decode_tokens, self.L = num_prefills, nd * L, L
        # the decode rows' requests (t // L) and their positions' offsets from seq_len (t % L - L)
        self.decode_req = np.arange(nd * L, dtype=np.int32) // L
        self.decode_offset = np.arange(nd * L, dtype=np.int32) % L - L
        # with prefills: their tokens' index among them, and where L fits a query tile, the decode
        # requests' tiles (one each, at its first token)
        self.prefill_token_index = np.arange(n_prefill)
        self.decode_tiles = np.arange(nd, dtype=np.int32) * L if num_prefills and L <= QUERY_TILE else None
        page16 = views[0].view(b, cols)
        self.page16, self.page16_slots, self.slots = page16, views[1], views[2]
        self.prefill_views, self.tiles = (views[3:7], views[7]) if num_prefills else ((), None)
        self.token_req_id, self.token_abs_pos, seq_lens, seq_prefill, bt_prefill, page16_prefill = views[-6:]
        block_table = builder._inputs[:b * cols].view(b, cols)
        self.block_table = block_table
        self.decode = DecodeMetadata(block_table[:nd], seq_lens[:nd], L, page16[:nd]) if nd else None
        self.prefill = None
        if num_prefills:
            cu, ctx, query_req_id, query_abs_pos = self.prefill_views
            self.prefill = PrefillMetadata(bt_prefill.view(num_prefills, cols), cu, seq_prefill, ctx, query_req_id,
                                           query_abs_pos, page16_prefill.view(num_prefills, cols))
        self.token_index = builder._token_index[:n]
        step = (block_table, seq_lens, page16, self.slots, self.token_index, *self.prefill_views,
                self.token_req_id, self.token_abs_pos)
        self.key = (shape, *((t.data_ptr(), tuple(t.shape)) for t in step))


class MetadataBuilder:
    """Builds a step's metadata once for all sparse layers.

    max_num_seqs, max_model_len: the engine's limits (vLLM's scheduler and model config); a step
    beyond them is refused. max_num_tokens: the most tokens a step holds (vLLM's
    max_num_batched_tokens), which sizes the per-token buffers; a larger step reallocates them
    (their addresses change: a graph captured before must be captured again). num_cache_blocks:
    the KV cache's blocks, so that an out-of-range block id or slot is refused here rather than
    by each layer (each layer checks its own cache's size against the step's largest id, without
    a sync, either way). kernels: the library whose KV writer decides the insert's slot form.

    The builder runs no compiled kernel of its own. On CUDA a step is the driver's copies of the
    inputs, straight from the caller's tensors, into pinned host memory (and of the block table
    into the builder's buffer, where the kernels read it), the checks and everything derived (the
    page-16 rebase included) on the host, and one asynchronous copy back; elsewhere on a GPU (or
    for int64 query_start_loc, seq_lens or num_computed_tokens) the inputs are concatenated into
    one device buffer first and cross in one transfer. A block table wider than the step's
    max_seq_len is rebased on the device instead (two torch ops), so that only its used columns
    cross to the host. On CUDA a step of more than _HOST_CHECK_IDS used ids keeps its table on the
    device altogether: one CUDA graph (captured once per step shape) finds the used ids' smallest
    and largest, which cross to the host with the other inputs, and writes the page-16 table.
    """

    _LAYOUTS = 16  # step shapes whose views are kept (a decode server repeats a few)

    def __init__(self, max_num_seqs: int, max_model_len: int, *, max_num_tokens: int | None = None,
                 num_cache_blocks: int | None = None, kernels: KernelLibrary | None = None, device="cpu"):
        if max_num_seqs < 1 or max_model_len < 1:
            raise ValueError(f"max_num_seqs, max_model_len: expected >= 1, got {max_num_seqs}, {max_model_len}")
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.num_cache_blocks = num_cache_blocks
        self.kernels = kernels
        self.device = torch.device(device)
        self.max_cols = _cdiv(max_model_len, BLOCK_SIZE)
        self.gpu_writer = kernels is not None and kernels.target in InsertKvGpuSpec.targets
        self._layouts = {}
        self._decode_qsl = {}  # (reqs, L) -> a decode step's query_start_loc
        self._copy_stream = None  # on a GPU: the stream of the last copy of the derived values to the device
        self._driver = _copy_driver(self.device)
        self._checks = {}  # (reqs, cols) -> _DeviceCheck (CUDA)
        tokens = max_num_tokens or max_num_seqs * 8
        self._allocate_inputs(_InputLayout.size(max_num_seqs, self.max_cols, tokens))
        self._allocate_derived(tokens)
        if self._driver is not None:  # recorded after the copies of what the host reads first
            self._inputs_copied = self._driver.event()
            weakref.finalize(self, self._driver.lib.cuEventDestroy_v2, self._inputs_copied)

    # ---- the buffers: on a GPU each with a pinned host twin, on the host the buffer itself ----

    def _buffer(self, n):
        """(a device buffer of n int32, its host twin)."""
        t = torch.empty(n, dtype=torch.int32, device=self.device)
        return t, t if self.device.type == "cpu" else torch.empty(n, dtype=torch.int32, pin_memory=True)

    def _allocate_inputs(self, n):
        self._await_copies()
        self._inputs, self._host_inputs = self._buffer(n)
        self._stages = {}  # (reqs, cols, slot entries, used columns) -> _InputLayout
        self._layouts.clear()
        self._checks.clear()

    def _input_layout(self, b, cols, n_slots, used) -> _InputLayout:
        layout = self._stages.get((b, cols, n_slots, used))
        if layout is None:
            if _InputLayout.size(b, cols, n_slots) > self._inputs.shape[0]:
                self._allocate_inputs(_InputLayout.size(b, cols, n_slots))
            layout = self._stages[(b, cols, n_slots, used)] = _InputLayout(self, b, cols, n_slots, used)
        return layout

    def _copied_inputs(self, b, cols, n_slots, slot_bytes, used) -> _CopiedInputs:
        key = (b, cols, n_slots, used, slot_bytes)
        layout = self._stages.get(key)
        if layout is None:
            need = max(_CopiedInputs.size(b, cols, n_slots, slot_bytes), _DeviceCheck.size(b, cols))
            if need > self._inputs.shape[0]:
                self._allocate_inputs(max(need, _InputLayout.size(b, cols, n_slots)))
            layout = self._stages[key] = _CopiedInputs(self, b, cols, n_slots, slot_bytes, used)
        return layout

    def _await_copies(self):
        """Before a buffer is given up: the copies the driver queued from its host twin, and the
        device checks' graphs reading it, are done (torch's allocators know nothing of them, and
        would hand the memory out again)."""
        if self._copy_stream is not None or self._checks:
            torch.cuda.synchronize(self.device)

    def _device_check(self, b, cols) -> _DeviceCheck:
        check = self._checks.get((b, cols))
        if check is None:
            if len(self._checks) >= self._LAYOUTS:
                self._await_copies()
                self._checks.pop(next(iter(self._checks)))
            check = self._checks[(b, cols)] = _DeviceCheck(self, b, cols)
        return check

    def _allocate_derived(self, tokens):
        self._await_copies()
        self.max_tokens = tokens
        # vLLM's page-16 table (at most [max_num_seqs, cdiv(max_model_len, 128)]), then the per-token values
        self._derived, self._host_derived = self._buffer(self.max_num_seqs * (3 * self.max_cols + 5) + 1 + 8 * tokens
                                                         + tokens // QUERY_TILE + 17 * ALIGN)
        self._token_index = torch.arange(tokens, dtype=torch.int32, device=self.device)
        self._layouts.clear()
        self._checks.clear()

    def _raw_stream(self) -> int:
        index = self.device.index
        return _current_raw_stream(torch.cuda.current_device() if index is None else index)

    def _layout(self, shape) -> _StepLayout:
        layout = self._layouts.get(shape)
        if layout is None:
            if shape[3] > self.max_tokens:
                self._allocate_derived(shape[3])
            if len(self._layouts) >= self._LAYOUTS:
                self._layouts.pop(next(iter(self._layouts)))
            layout = self._layouts[shape] = _StepLayout(self, shape)
        return layout

    # ---- the step's checks (host values, once per step) ----

    def _split(self, qsl, seq, computed, decode_query_len, num_decodes, num_actual_tokens, longest):
        """(the prefills' query lengths, num_decode_tokens, num_tokens) after checking the
        decode-first split: every decode request has L tokens, except trailing padding requests of
        length 0 and seq_len 0 (vLLM's padded uniform decode batch, whose L tokens count in
        num_actual_tokens). A step with no padding passes in a few whole-array tests; anything else
        is looked at request by request (and named when it fails). longest: the largest seq_len."""
        L, num_reqs = decode_query_len, seq.shape[0]
        num_decode_tokens = num_decodes * L
        if num_decodes == num_reqs and num_actual_tokens in (None, num_decode_tokens):  # a decode step
            if (_none(qsl != self._decode_offsets(num_reqs, L)) and _none(seq != computed + L)
                    and longest <= self.max_model_len):
                return _NO_PREFILLS, num_decode_tokens, num_decode_tokens
        qlens, total = qsl[1:] - qsl[:-1], int(qsl[-1])
        if (qsl[0] == 0 and num_actual_tokens in (None, total) and (qlens[:num_decodes] == L).all()
                and not ((qlens < 0) | (seq > self.max_model_len) | (seq != computed + qlens)).any()):
            return qlens[num_decodes:], num_decode_tokens, total
        if qsl[0] != 0 or (qlens < 0).any():
            raise ValueError(f"query_start_loc: expected non-decreasing offsets from 0, got {qsl.tolist()}")
        pad = _first(qlens[:num_decodes] == 0)
        real = num_decodes if pad is None else pad  # the first padding request
        if (i := _first(qlens[:real] != L)) is not None:
            raise ValueError(f"decode query lengths: expected decode_query_len={L} for each of the first "
                             f"num_decodes={num_decodes} requests, got {qlens[i]} for request {i}")
        if (i := _first((qlens[real:num_decodes] != 0) | (seq[real:num_decodes] != 0))) is not None:
            i += real
            raise ValueError(f"decode padding: expected the padding requests of a decode batch (query length 0) "
                             f"at its end with seq_len 0, got query length {qlens[i]} and seq_len {seq[i]} for "
                             f"request {i} after padding request {real}")
        num_tokens = total if num_actual_tokens is None else num_actual_tokens
        if real < num_decodes:  # a padded batch: decodes only, num_actual_tokens counting the padding
            if num_decodes != num_reqs or num_tokens != num_decode_tokens:
                raise ValueError(f"num_actual_tokens: expected num_decodes * decode_query_len = {num_decode_tokens} "
                                 f"for a decode batch padded with {num_decodes - real} requests of length 0 (and no "
                                 f"prefills), got {num_tokens} tokens and {num_reqs - num_decodes} prefill requests")
        elif num_tokens != total:
            raise ValueError(f"num_actual_tokens: expected query_start_loc[-1] = {total} (padding tokens only "
                             f"in a padded decode batch), got {num_tokens}")
        if (r := _first(seq > self.max_model_len)) is not None:
            raise ValueError(f"seq_lens: expected at most max_model_len={self.max_model_len} tokens a request, "
                             f"got {seq[r]} for request {r}")
        if (r := _first(seq != computed + qlens)) is not None:
            raise ValueError(f"seq_lens: expected num_computed_tokens + query length = {computed[r] + qlens[r]} "
                             f"for request {r}, got {seq[r]}")
        return qlens[num_decodes:], num_decode_tokens, num_tokens

    @staticmethod
    def _used_columns(max_seq_len) -> int:
        if type(max_seq_len) is int and max_seq_len >= 0:  # the common case, without the full type test
            return _cdiv(max_seq_len, BLOCK_SIZE)
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, (int, np.integer)) or max_seq_len < 0:
            raise ValueError(f"max_seq_len: expected an int >= 0 (at least the step's longest seq_len), "
                             f"got {max_seq_len!r}")
        return _cdiv(int(max_seq_len), BLOCK_SIZE)

    def _decode_offsets(self, num_reqs, L):
        """query_start_loc of a decode step of num_reqs requests of L tokens (0, L, 2L, ...)."""
        offsets = self._decode_qsl.get((num_reqs, L))
        if offsets is None:
            offsets = self._decode_qsl[(num_reqs, L)] = np.arange(num_reqs + 1, dtype=np.int64) * L
        return offsets

    def _check_ids(self, block_table, seq, slots, longest, extremes=None):
        """(max_block_id, max_slot) of the step (host values: block_table [reqs, cols] int32, the
        written slots), after checking that every block a request's context spans has a column
        and a block id >= 0 (and < num_cache_blocks), and every slot written is in range: what a
        layer's attend and insert would otherwise clamp. longest: the largest seq_len (0: none).
        extremes: the used ids' (smallest, largest) where the device found them (the smallest >=
        0; block_table is then not read)."""
        reqs, cols = block_table.shape
        if _cdiv(longest, BLOCK_SIZE) > cols:
            need = (seq + (BLOCK_SIZE - 1)) >> 7  # cdiv(seq_len, 128)
            r = _first(need > cols)
            raise IndexError(f"block_table: expected at least cdiv(seq_len, 128) = {need[r]} columns for request {r} "
                             f"(seq_len {seq[r]}), got {cols} columns")
        if extremes is None:
            max_block = _largest_used_id(block_table, seq)
        else:  # (unused columns count as 0 there: the largest is right where any column is used)
            max_block = int(extremes[1]) if longest else -1
        if max_block >= 1 << 31:  # a negative id
            used = _column_starts(cols) < seq[:, None]
            r, c = (int(i) for i in np.argwhere(used & (block_table < 0))[0])
            raise IndexError(f"block_table: expected a cache block id >= 0 for every block of a request's context, "
                             f"got {int(block_table[r, c])} at request {r}, column {c} (seq_len {seq[r]})")
        if max_block >= 1 << 30:
            raise IndexError(f"block_table: expected ids below 2**30 (their page-16 ids are int32), got {max_block}")
        max_slot = int(_max(slots, initial=-1))
        if max_slot >= 1 << 30:
            raise IndexError(f"slot_mapping: expected slots below 2**30 (their page-16 slots are int32), "
                             f"got {max_slot}")
        if self.num_cache_blocks is not None:
            if max_block >= self.num_cache_blocks:
                raise IndexError(f"block_table: expected ids in [0, {self.num_cache_blocks}) (num_cache_blocks), "
                                 f"got {max_block} (out of range)")
            if max_slot >= self.num_cache_blocks * BLOCK_SIZE:
                raise IndexError(f"slot_mapping: expected ids in [0, {self.num_cache_blocks * BLOCK_SIZE}) "
                                 f"(num_cache_blocks * 128), got {max_slot} (out of range)")
        return max_block, max_slot

    def _check_args(self, block_table, seq_lens, query_start_loc, num_computed_tokens, decode_query_len, num_decodes,
                    slot_mapping):
        """The arguments' dtypes, shapes and devices: a step in order passes one expression; one
        that is not is looked at argument by argument (and named)."""
        num_reqs, device, ints = seq_lens.shape[0], block_table.device, _INDEX_DTYPES
        if (block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == num_reqs
                and seq_lens.dim() == 1 and query_start_loc.shape == (num_reqs + 1,)
                and num_computed_tokens.shape == (num_reqs,) and seq_lens.dtype in ints
                and query_start_loc.dtype in ints and num_computed_tokens.dtype in ints
                and seq_lens.device == device and query_start_loc.device == device
                and num_computed_tokens.device == device and decode_query_len > 0 and 0 <= num_decodes <= num_reqs
                and num_reqs <= self.max_num_seqs and block_table.shape[1] <= self.max_cols
                and (slot_mapping is None or (slot_mapping.dim() == 1 and slot_mapping.dtype in ints
                                              and slot_mapping.device == device))):
            return
        checks.check_dtype("block_table", block_table, torch.int32)
        checks.check_shape("block_table", block_table, (num_reqs, None))
        for name, t, shape in (("seq_lens", seq_lens, (num_reqs,)), ("query_start_loc", query_start_loc, (num_reqs + 1,)),
                               ("num_computed_tokens", num_computed_tokens, (num_reqs,))):
            checks.check_dtype(name, t, (torch.int32, torch.int64))
            checks.check_shape(name, t, shape)
        if decode_query_len <= 0:
            raise ValueError(f"decode_query_len: expected > 0, got {decode_query_len}")
        if not 0 <= num_decodes <= num_reqs:
            raise ValueError(f"num_decodes: expected 0..num_reqs={num_reqs}, got {num_decodes}")
        if num_reqs > self.max_num_seqs or block_table.shape[1] > self.max_cols:
            raise ValueError(f"block table {(num_reqs, block_table.shape[1])} exceeds the page-16 rebase buffer "
                             f"{(self.max_num_seqs, self.max_cols)}")
        if slot_mapping is not None:
            checks.check_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
            checks.check_shape("slot_mapping", slot_mapping, (None,))
        device = block_table.device
        for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc),
                        ("num_computed_tokens", num_computed_tokens), ("slot_mapping", slot_mapping)):
            if t is not None and t.device != device:
                raise ValueError(f"{name}: expected the block table's device {device}, got {t.device}")

    # ---- the step ----

    def build(self, block_table, seq_lens, query_start_loc, num_computed_tokens, decode_query_len: int,
              num_decodes: int, slot_mapping=None, *, num_actual_tokens: int | None = None,
              max_seq_len: int | None = None) -> MsaMetadata:
        """One step's metadata (vLLM's CommonAttentionMetadata, decode-first).

        block_table [reqs, cols] int32 cache block ids (128-token blocks); seq_lens [reqs] int32
        (the step's tokens included); query_start_loc [reqs + 1] int32; num_computed_tokens [reqs]
        int32 (seq_lens - query lengths); decode_query_len L; num_decodes: the first requests,
        each L tokens (a padded batch ends in requests of length 0 and seq_len 0, counted in
        num_actual_tokens); slot_mapping [>= tokens] int32 logical slots (< 0: not written).
        max_seq_len: at least the step's longest seq_len, where the caller knows it on the host
        (vLLM's CommonAttentionMetadata.max_seq_len); the block table's columns past
        cdiv(max_seq_len, 128) are then neither brought to the host nor checked, so that a table
        as wide as max_model_len allows (as vLLM's is) costs what its used columns do.
        """
        self._check_args(block_table, seq_lens, query_start_loc, num_computed_tokens, decode_query_len, num_decodes,
                         slot_mapping)
        b, cols = block_table.shape
        used = cols if max_seq_len is None else min(cols, self._used_columns(max_seq_len))
        n_slots = 0 if slot_mapping is None else slot_mapping.shape[0]
        stream = self._raw_stream() if self._host_derived is not self._derived else None
        inputs, extremes = self._inputs_to_host(block_table, seq_lens, query_start_loc, num_computed_tokens,
                                                slot_mapping, n_slots, used, stream)
        small = inputs.small.astype(np.int64)
        qsl, seq, computed = small[:b + 1], small[b + 1:2 * b + 1], small[2 * b + 1:]
        longest = int(_max(seq, initial=0))
        prefill_qlens, num_decode_tokens, n = self._split(qsl, seq, computed, decode_query_len, num_decodes,
                                                          num_actual_tokens, longest)
        if slot_mapping is not None and n_slots < n:
            raise ValueError(f"slot_mapping: expected at least num_tokens={n} entries, got {n_slots}")
        host_slots = inputs.slots[:n] if n_slots else np.full(n, -1, np.int32)
        if max_seq_len is not None and longest > max_seq_len:
            r = _first(seq > max_seq_len)
            raise ValueError(f"max_seq_len: expected at least the step's longest seq_len, got {max_seq_len} "
                             f"(request {r}'s seq_len is {seq[r]})")
        layout = self._layout((b, cols, n_slots, n, num_decodes, decode_query_len))
        # the page-16 tables from the block table on the device where the host has only its used
        # columns (or none of them), or where a long table would cost the host more than two torch ops
        tables_on_device = inputs.trimmed or b * cols > _HOST_REBASE_IDS or extremes is not None
        count, num_tiles = self._derive(layout, inputs.block_table, host_slots, prefill_qlens, computed[num_decodes:],
                                        seq, stream, tables_on_device)
        # the ids checked once the step's values are derived (nothing reaches the device before
        # the checks pass), so that a device check's graph runs while the host derives them
        if extremes is not None:
            self._driver.synchronize(stream)
            if extremes[0] < 0:  # a negative id: found on the host, as in a short table
                self._check_ids(block_table[:, :used].cpu().numpy(), seq, host_slots, longest)
        max_block, max_slot = self._check_ids(inputs.block_table, seq, host_slots, longest, extremes)
        if self.gpu_writer:
            token_index, insert_slots = layout.token_index, layout.slots  # the GPU writer skips slots < 0
        else:  # the portable writer takes the written tokens only, after the layout's derived values
            keep = np.flatnonzero(host_slots >= 0)
            m, lo = keep.shape[0], layout.n_derived
            hi = lo + _aligned(m)
            out = self._host_derived.numpy()
            out[lo:lo + m], out[hi:hi + m] = keep, host_slots[keep]
            count = hi + m
            token_index, insert_slots = self._derived[lo:lo + m], self._derived[hi:hi + m]
        if not tables_on_device:
            self._copy_back(layout, stream, 0, count)
        else:  # all but the tables, which the device rebases from the block table where it is
            self._copy_back(layout, stream, layout.at["page16_slots"], layout.at["bt_prefill"])
            self._copy_back(layout, stream, layout.n_derived, count)  # the portable insert's rows, if any
            # (a device check wrote the page-16 table, unless the derived buffer has grown since)
            self._rebase_on_device(layout, page16=extremes is None or (b, cols) not in self._checks)
        return MsaMetadata(n, num_decodes, num_decode_tokens, b - num_decodes, n - num_decode_tokens, layout.decode,
                           layout.prefill, layout.slots, layout.page16_slots, token_index, insert_slots,
                           layout.block_table, layout.token_req_id, layout.token_abs_pos, max_block, max_slot,
                           layout.key, None if layout.tiles is None else layout.tiles[:num_tiles])

    def _inputs_to_host(self, block_table, seq_lens, qsl, computed, slot_mapping, n_slots, used, stream):
        """The step's inputs where the host reads them, and the block table where the kernels do
        (the input buffer's prefix, a stable address). On CUDA, with int32 qsl, seq_lens and
        computed on the builder's (current) device: the driver's copies straight from the
        caller's tensors (the used columns as one strided copy); else the inputs concatenated
        into the input buffer, from which one transfer brings what the host reads. Either way
        the transfer waits for the stream's work, the last step's copy back included.
        Returns (the input layout, the used ids' extremes or None): on CUDA, past _HOST_CHECK_IDS
        used ids, the table stays on the device, which checks it (_DeviceCheck) and rebases it;
        the extremes are there once the stream is synchronized, the rest on return."""
        b, cols = block_table.shape
        driver = self._driver
        if (driver is not None and qsl.dtype == seq_lens.dtype == computed.dtype == torch.int32
                and block_table.device == self._inputs.device and block_table.is_contiguous()
                and qsl.is_contiguous() and seq_lens.is_contiguous() and computed.is_contiguous()
                and (slot_mapping is None or slot_mapping.is_contiguous())
                and block_table.device.index == torch.cuda.current_device()):
            slot_bytes = 0 if slot_mapping is None else slot_mapping.element_size()
            inputs = self._copied_inputs(b, cols, n_slots, slot_bytes, used)
            driver.copy_to_host(inputs.qsl_at, qsl.data_ptr(), 4 * (b + 1), stream)
            if b:  # (an empty tensor may have no address)
                driver.copy_to_host(inputs.seq_at, seq_lens.data_ptr(), 4 * b, stream)
                driver.copy_to_host(inputs.computed_at, computed.data_ptr(), 4 * b, stream)
            if n_slots:
                driver.copy_to_host(inputs.slots_at, slot_mapping.data_ptr(), n_slots * slot_bytes, stream)
            if b * used <= _HOST_CHECK_IDS:
                if inputs.table_bytes:
                    if not inputs.trimmed:
                        driver.copy_to_host(inputs.table_at, block_table.data_ptr(), inputs.table_bytes, stream)
                    elif inputs.row_bytes:
                        driver.copy_rows_to_host(inputs.table_at, block_table.data_ptr(), inputs.row_bytes,
                                                 inputs.pitch, b, stream)
                    driver.copy_on_device(inputs.stage_at, block_table.data_ptr(), inputs.table_bytes, stream)
                driver.synchronize(stream)
                return inputs, None
            # the host waits for the small inputs only; the extremes are read after the stream's
            # synchronize (build), the graph running meanwhile
            check = self._device_check(b, cols)
            driver.record(self._inputs_copied, stream)
            driver.copy_on_device(inputs.stage_at, block_table.data_ptr(), inputs.table_bytes, stream)
            driver.copy_on_device(check.seq_lens_at, seq_lens.data_ptr(), 4 * b, stream)
            check.launch(driver, stream)
            driver.copy_to_host(inputs.table_at, check.extremes_at, 8, stream)
            driver.wait(self._inputs_copied)
            return inputs, inputs.extremes
        inputs = self._input_layout(b, cols, n_slots, used)
        parts = [block_table.reshape(-1), qsl, seq_lens, computed]
        if slot_mapping is not None:
            parts.append(slot_mapping)
        if inputs.trimmed:
            parts.append(block_table[:, :used].reshape(-1))
        if block_table.device == inputs.stage.device:
            torch.cat(parts, out=inputs.stage)
        else:
            inputs.stage.copy_(torch.cat(parts))
        if self._host_inputs is not self._inputs:
            inputs.host_part.copy_(inputs.to_host)
        return inputs, None

    def _derive(self, layout, block_table, slots, qlens, computed, seq, stream, tables_on_device) -> tuple[int, int]:
        """Write the derived values into the host side of the derived buffer (once the last
        step's copy of it has left): the page-16 block table and slots, the slots, for prefills
        cu_seqlens_q, context_lens, query_req_id and query_abs_pos, every token's request and
        position (decode rows: seq_len - L + t % L, reference.decode_token_positions; a padded
        request's are below 0), seq_lens and the prefills' rows of it and of both block tables;
        with prefills the query tiles. qlens, computed: the prefills'. block_table: the used
        columns only where trimmed. With tables_on_device the page-16 tables and the prefills'
        block table are _rebase_on_device's, not written here.
        Returns (their count, the query tiles' count)."""
        if self._copy_stream is not None and self._copy_stream != stream:
            torch.cuda.synchronize(self.device)  # the last copy back went on another stream: let it finish
        out, nd = layout.host, layout.decode_tokens
        if not tables_on_device:  # reference.rebase_block_table_to_page16
            np.multiply(block_table.reshape(-1), 2, out=out["page16"])
        out["seq"][:] = seq
        # reference.rebase_slots_to_page16: slot + its block's first slot (block * 128), < 0 kept
        np.add(slots, np.maximum(slots, 0) & -BLOCK_SIZE, out=out["page16_slots"])
        out["slots"][:] = slots
        req_of, pos_of = out["req"], out["pos"]  # every token's
        req_of[:nd] = layout.decode_req
        if layout.L == 1:
            np.subtract(seq[:nd], 1, out=pos_of[:nd])
        else:
            np.add(seq[layout.decode_req], layout.decode_offset, out=pos_of[:nd])
        if not layout.num_prefills:
            return layout.n_derived, 0
        num_decodes = seq.shape[0] - layout.num_prefills
        if not tables_on_device:  # the prefills' rows again, at their own start
            m = block_table.size
            out["page16_prefill"][:] = out["page16"][m - out["page16_prefill"].shape[0]:]
            out["bt_prefill"][:] = block_table[num_decodes:].reshape(-1)
        out["seq_prefill"][:] = seq[num_decodes:]
        cu = out["cu"]
        cu[0] = 0
        np.cumsum(qlens, out=cu[1:])
        out["ctx"][:] = computed
        req = np.repeat(np.arange(qlens.shape[0]), qlens)  # reference.query_token_positions
        out["qreq"][:] = req
        qpos = out["qpos"]  # a request's k-th token at computed + k: token t at t + (computed - its first token)
        np.add(np.repeat(computed - cu[:-1], qlens), layout.prefill_token_index, out=qpos)
        np.add(req, num_decodes, out=req_of[nd:])
        pos_of[nd:] = qpos
        tiles = out["tiles"]
        if layout.decode_tiles is not None:  # a decode request's L tokens are one tile
            tiles[:num_decodes] = layout.decode_tiles
            return layout.n_derived, num_decodes + _write_query_tiles(tiles[num_decodes:], nd + cu[:-1], qlens)
        starts = np.concatenate([np.arange(num_decodes) * layout.L, nd + cu[:-1]])
        lens = np.concatenate([np.full(num_decodes, layout.L), qlens])
        return layout.n_derived, _write_query_tiles(tiles, starts, lens)

    def _copy_back(self, layout, stream, first, end):
        """The derived buffer's values [first, end) to the device (a GPU's: asynchronously on
        `stream`; the next step's transfer to the host waits for it, being on the same stream)."""
        if stream is None or end <= first:
            return
        if self._driver is not None:
            self._driver.copy_to_device(self._derived.data_ptr() + 4 * first, self._host_derived.data_ptr() + 4 * first,
                                        4 * (end - first), stream)
        elif first == 0 and end == layout.n_derived:
            layout.derived.copy_(layout.host_derived, non_blocking=True)
        else:
            self._derived[first:end].copy_(self._host_derived[first:end], non_blocking=True)
        self._copy_stream = stream

    @staticmethod
    def _rebase_on_device(layout, page16=True):
        """The page-16 block table (unless a device check wrote it), and the prefills' rows of
        both tables, from the whole block table where the kernels read it (the copy back leaves
        these out)."""
        if page16:
            torch.mul(layout.block_table, 2, out=layout.page16)
        if layout.prefill is not None:
            rows = layout.block_table[-layout.num_prefills:]
            layout.prefill.block_table.copy_(rows)
            torch.mul(rows, 2, out=layout.prefill.page16_block_table)
