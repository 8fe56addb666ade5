"""The benchmark protocol on one IREE device, against torch eager in the same run.

Per decode case (batch x context x L x heads per KV head x KV dtype; every row sees 16 blocks,
its own block always among them):
- the output of the compiled attend is checked against the torch reference first;
- cold_us / warm_us, the headline: the anchor's protocol (anchor.py: one forward in a CUDA graph
  replayed after a 256 MiB write; a graph of 20 back-to-back forwards), for msa-iree and, with
  --anchor, vLLM's Triton attend on the same bytes (triton_*, x_triton_* = Triton / msa-iree);
  --anchor-only stops there;
- kernel_us: the device time of the module's kernels in one forward call (CUDA activity records
  through torch.profiler, durations summed: the gaps between kernels are not in it), the L2
  flushed before each call by reading 512 MiB (cold and clean: every K/V byte comes from DRAM,
  and the L2 holds no one else's dirty lines);
- kernel_dirty_us: the same with the L2 flushed by writing 512 MiB (what the harness reported
  before, and what a `zero_()` flush such as triton.testing.do_bench's leaves): the kernel's
  reads then also pay for writing back up to the L2's size of the flush's dirty lines;
- call_us: one module call from Python (lib.run; on cuda launched on torch's stream, msa_iree.runtime.cuda_launch),
  and forward_us: one SparseAttention.forward (checks + call), each waited for (+ sync), the L2
  flushed before each call as for kernel_us (so forward_over_kernel compares like with like),
  medians of >= 100 calls on cuda;
- graph_us (cuda, stream launches): per forward of 57 forwards over 16 block-table rotations
  captured in a CUDA graph and replayed, median replay (how vLLM runs decode: "rotate inputs": consecutive forwards read disjoint blocks, so each finds its K/V
  in DRAM, with no flush and none of a flush's dirty lines; the gaps between kernels count):
  the median of three captures (graph_us_all: all three; a capture's replays agree, captures
  differ by up to ~0.7 us);
- step_us (cuda, stream launches): per forward of a decode step of 57 forwards run eagerly, back
  to back, as serving without a graph runs them (one step's metadata, each layer its own cache
  slice of the pool, consecutive layers sharing no block, one sync a step): the end-to-end
  per-call time of forward in serving;
- paged_kernel_us (cuda, decode): kernel_us of the same step attended through the page table an
  indexer emits for it (SparseAttention.forward with sparse_block_table: the GPU attend over a
  given table), its output checked first; paged_over_topk its ratio to kernel_us;
- torch_us: torch eager's reference attend over the prebuilt page table (CUDA events, median);
- GB/s counts the selected K and V bytes the queries see, divided by kernel_us, and % copy
  relates it to a device-to-device copy measured in the same run.
Prefill (q = 4096 over a 32K context) reports kernel_us (as for decode; on the host: forward_us), forward_us and torch_us.

On cuda every kernel time is taken in a last pass over the rows (add_kernel_time): once the
profiler has attached CUPTI, a graph's replays stay ~1 us a forward slower for the rest of the
process.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import torch

from msa_iree import reference
from msa_iree.config import DTYPES, MsaConfig
from msa_iree.ops import SparseAttnDecodeFmaSpec, SparseAttnDecodeMfmaSpec, SparseAttnDecodeMmaSpec
from msa_iree.layout import BLOCK_SIZE, PAGES_PER_BLOCK, SIDES_PER_BLOCK, allocate_kv_cache
from msa_iree.runtime import KernelLibrary, MetadataBuilder, SparseAttention

from . import anchor

TOPK = 16
POOL_BYTES = 256 << 20  # cache pool for the L2 rotation: >= 2 block tables' worth and ~5x the H200's 50 MiB L2
FILL_CHUNK = 1 << 28  # cache elements filled at once (DecodeCase): 1 GiB of f32 temporaries
WALL_ITERS = 100  # at least this many single calls for a wall-clock median: the H200 host's clock jitters by us


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def wall_us(fn, iters, device, flush=None):
    """Median wall time of `fn` + a device sync, the device idle at the start; `flush` (an L2
    flush, as events_us's) runs before each call, outside the measurement."""
    times = []
    for _ in range(iters):
        if flush is not None:
            flush()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def events_us(fn, iters, device, flush=None):
    if device.type != "cuda":
        return wall_us(fn, iters, device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        if flush is not None:
            flush()
        start.record(); fn(); end.record(); torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def kernel_us(fn, device, iters=10, flush=None, by_kernel=None):
    """Device time of the kernels `fn` launches (their durations summed per call), median over
    calls, from CUDA's activity records (torch.profiler/CUPTI sees IREE's launches too). The gaps
    between kernels are not in it (graph_us has them). `flush` runs before each call (outside the
    measurement) to evict the L2. `by_kernel`, a dict, receives each kernel name's median time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    per_call, per_kernel = [], {}
    for _ in range(iters):
        if flush is not None:
            flush()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        call = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                call[e.name] = call.get(e.name, 0.0) + e.device_time
        per_call.append(sum(call.values()))
        for name, us in call.items():
            per_kernel.setdefault(name, []).append(us)
    if by_kernel is not None:
        by_kernel.update({name: statistics.median(v) for name, v in per_kernel.items()})
    return statistics.median(per_call)


def l2_flusher(device, nbytes=512 << 20, dirty=False):
    """Evicts the L2 (50 MiB on an H200) through a 512 MiB buffer: read (the L2 ends up holding
    clean lines of it) or, dirty=True, written (it ends up holding dirty lines, which the next
    kernel's misses write back before its reads)."""
    if dirty:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return lambda: buf.zero_()
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    total = torch.empty((), dtype=torch.float32, device=device)
    return lambda: torch.sum(buf, dim=0, out=total)


class Flushes:
    """A run's two L2 flushes (l2_flusher's read and write), each 512 MiB buffer made once, on
    first use; None on a device without an L2 to flush here (the host CPU)."""

    def __init__(self, device):
        self.device = device

    @functools.cached_property
    def clean(self):
        return l2_flusher(self.device) if self.device.type == "cuda" else None

    @functools.cached_property
    def dirty(self):
        return l2_flusher(self.device, dirty=True) if self.device.type == "cuda" else None

    @functools.cached_property
    def anchor(self):
        return anchor.write_flusher(self.device) if self.device.type == "cuda" else None


def copy_bandwidth_GBps(device, nbytes=1 << 30):
    """Device-to-device copy, bytes read + written per second (the run's own bandwidth limit)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    us = events_us(lambda: b.copy_(a), 10, device)
    return 2 * nbytes / us / 1e3


def draw_topk(pos: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Top-k of tokens at absolute positions pos [T]: each row its own block, then 15 distinct
    older blocks drawn at random (-1 where the context has fewer): [1, T, 16] int32."""
    own = pos // BLOCK_SIZE
    older = torch.rand(pos.shape[0], int(own.max()) + 1, generator=g, device=pos.device)
    older = older.masked_fill(torch.arange(older.shape[1], device=pos.device)[None, :] >= own[:, None], 2.0)
    picks = older.argsort(dim=1)[:, : TOPK - 1]
    picks = torch.where(torch.gather(older, 1, picks) < 2.0, picks, -1)
    if picks.shape[1] < TOPK - 1:  # fewer than 16 blocks of context: -1 padding
        picks = torch.nn.functional.pad(picks, (0, TOPK - 1 - picks.shape[1]), value=-1)
    return torch.cat([own[:, None], picks], 1).int()[None]


def visible_tokens(topk: torch.Tensor, pos: torch.Tensor) -> int:
    """Tokens the rows of draw_topk see: the older blocks whole, the own block up to the row."""
    return int(((topk[0, :, 1:] >= 0).sum(1) * BLOCK_SIZE + pos % BLOCK_SIZE + 1).sum())


class DecodeCase:
    """A decode batch on `device`: every request has `context` tokens, the last L of them new;
    each row selects its own block and 15 older distinct blocks."""

    def __init__(self, batch, context, L, num_heads, kv_dtype, device, rotations, seed=0, pool_bytes=POOL_BYTES):
        g = torch.Generator(device=device).manual_seed(seed)
        self.L, self.batch, self.context = L, batch, context
        blocks_per_req = -(-context // BLOCK_SIZE)
        block_bytes = 2 * BLOCK_SIZE * 128 * kv_dtype.itemsize
        mapped = batch * blocks_per_req  # the blocks one block table maps
        pool = max(2 * mapped, pool_bytes // block_bytes)
        self.k_cache, self.v_cache = allocate_kv_cache(pool, 1, kv_dtype, device=device)
        raw = self.k_cache.view(-1)[: pool * 16 * 2048]  # the whole buffer (interleaved)
        fp8 = kv_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
        # filled a chunk at a time: the random temporaries of a 16 GiB pool at once exceed an 80 GB card
        for part in raw.split(FILL_CHUNK):
            if fp8:
                # random finite codes of either sign; magnitude >= 1 keeps clear of 0x80 (NaN in e4m3fnuz)
                part.view(torch.uint8).copy_(
                    torch.randint(1, 0x78, part.shape, generator=g, device=device, dtype=torch.uint8)
                    | (torch.randint(0, 2, part.shape, generator=g, device=device, dtype=torch.uint8) << 7))
            else:
                part.copy_(torch.randn(part.shape, generator=g, device=device).to(kv_dtype))
        if fp8:
            self.k_scale = torch.tensor([0.05], device=device)
            self.v_scale = torch.tensor([0.08], device=device)
        else:
            self.k_scale = self.v_scale = None
        # rotations of the block table: rotation r a random map onto slice r % slices of the pool, so
        # that consecutive rotations share no block (a replay of them finds none of its K/V in the L2)
        self.mapped, self.slices = mapped, pool // mapped
        slices = self.slices
        self.bt_rot = torch.stack([(torch.randperm(mapped, generator=g, device=device) + r % slices * mapped)
                                   .reshape(batch, blocks_per_req).int() for r in range(rotations)])
        self.block_table = self.bt_rot[0].contiguous()
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        # [batch] logical slots of each request's last token (what an L = 1 step inserts)
        last = self.seq_lens.long() - 1
        owner = self.block_table.long().gather(1, (last // BLOCK_SIZE)[:, None])[:, 0]
        self.last_token_slots = (owner * BLOCK_SIZE + last % BLOCK_SIZE).int()
        tokens = batch * L
        pos = (self.seq_lens.long().repeat_interleave(L) - L + torch.arange(L, device=device).repeat(batch))
        self.topk = draw_topk(pos, g)                                          # [1, T, 16]
        self.q = torch.randn(tokens, num_heads, 128, generator=g, device=device).to(torch.bfloat16)
        self.visible_tokens = visible_tokens(self.topk, pos)
        self.kv_bytes = self.visible_tokens * 128 * 2 * self.k_cache.element_size()

    def layer_cache(self, i):
        """(k_cache, v_cache) views of slice i % slices of the pool, `mapped` blocks each: read
        through block_table (rotation 0, ids below `mapped`), block b of layer i is the pool's
        block b + (i % slices) * mapped, so layers i and i + 1 share no block (as separate
        layers' caches)."""
        block = PAGES_PER_BLOCK * SIDES_PER_BLOCK  # pages: a block's K pages, then its V pages
        first, pages = i % self.slices * self.mapped * block, self.mapped * block
        return self.k_cache[first:first + pages], self.v_cache[first:first + pages - PAGES_PER_BLOCK]


def _decode_setup(lib, device, batch, context, L, num_heads, kv_name, rotations, matrix="auto"):
    kv_dtype = DTYPES[kv_name]
    c = DecodeCase(batch, context, L, num_heads, kv_dtype, device, rotations, seed=batch * 31 + L)
    scale = 128 ** -0.5
    attn = SparseAttention(num_heads, 1, 128, scale, kv_dtype, kernels=lib, gpu_matrix=matrix)
    (md,) = _decode_metadata(lib, device, c, [c.block_table])
    out = torch.full_like(c.q, float("nan"))
    fwd = lambda: attn.forward(c.q, c.k_cache, c.v_cache, out, c.topk, md, c.k_scale, c.v_scale)
    return c, attn, out, fwd


def _decode_metadata(lib, device, c, block_tables):
    """One decode step's metadata for DecodeCase `c` per block table (all rows decode, L each)."""
    builder = MetadataBuilder(max_num_seqs=c.batch, max_model_len=c.context, kernels=lib, device=device)
    qsl = torch.arange(0, c.batch * c.L + 1, c.L, dtype=torch.int32, device=device)
    return [builder.build(bt, c.seq_lens, qsl, c.seq_lens - c.L, decode_query_len=c.L, num_decodes=c.batch)
            for bt in block_tables]


def decode_module_operands(attn, c):
    """The GPU decode module's operands for DecodeCase `c`, as SparseAttention passes them:
    (spec, inputs [q, k pages, v pages, topk, block table, seq_lens, scale, k_scale, v_scale],
    a workspace of spec.workspace_floats)."""
    layer = attn._layer_state(c.k_cache, c.v_cache, c.k_scale, c.v_scale)
    kp, vp, scale, ks, vs = layer.operands
    spec = attn._spec(attn.decode_spec, layer.stride, c.L)
    inputs = [c.q, kp, vp, c.topk, c.block_table, c.seq_lens, scale, ks.contiguous(), vs.contiguous()]
    return spec, inputs, torch.empty(spec.workspace_floats(c.q.shape[0]), dtype=torch.float32, device=c.q.device)


def check_output(out, ref, what):
    """Raise unless the compiled attend's output is the reference's within the tests' tolerance
    (scaled for outputs larger than the tests' O(1) ones, plus the output dtype's rounding at the
    largest output: fp8 cases' outputs reach ~19, where one bf16 step is 0.125): no row is timed
    over a wrong result."""
    err = (out.float() - ref.float()).abs()
    ref_max = float(ref.abs().max())
    bound = 1.7e-2 * max(1.0, ref_max / 4) + torch.finfo(out.dtype).eps * ref_max
    if bool(out.isnan().any()) or float(err.max()) >= bound:
        raise RuntimeError(f"{what}: the compiled attend differs from the reference (max abs error "
                           f"{float(err.max()):.3g}, bound {bound:.3g}); not benchmarked")
    return err


def bench_decode(lib, device, batch, context, L, num_heads, kv_name, iters, rotations=16, matrix="auto",
                 flushes=None, triton_module=None, anchor_only=False):
    """Correctness check and the wall-clock numbers of one decode case (no profiler in this pass:
    CUPTI, once attached, slows every later CUDA call of the process): the anchor's protocol for
    msa-iree and, given `triton_module` (anchor.load_triton_module), for vLLM's Triton attend on the
    same bytes; unless `anchor_only`, the harness's other columns."""
    c, attn, out, fwd = _decode_setup(lib, device, batch, context, L, num_heads, kv_name, rotations, matrix)
    fwd()
    flushes = flushes or Flushes(device)
    single_iters = max(iters, WALL_ITERS) if device.type == "cuda" else iters
    bt, ctx = reference.build_sparse_block_table_decode(c.topk, c.block_table, c.seq_lens, L, 16)
    ref = torch.empty_like(c.q)
    eager = lambda: reference.sparse_paged_attend(c.q, c.k_cache, c.v_cache, bt, ctx, 1, attn.scale, ref,
                                                  c.k_scale, c.v_scale)
    eager()
    err = check_output(out, ref, f"decode B={batch} ctx={context} L={L} {kv_name}")
    row = {"phase": "decode", "batch": batch, "context": context, "L": L, "q_heads": num_heads, "kv_dtype": kv_name,
           "kernel": attn.decode_spec.kernel if attn.gpu_decode else "portable", "matrix": matrix,
           "max_abs_err": float(err.max()), "mean_abs_err": float(err.mean()), "ref_max_abs": float(ref.abs().max()),
           "kv_MB": c.kv_bytes / 1e6}
    if device.type == "cuda":
        stream = attn.gpu_decode and lib.stream_kernel(attn._spec(attn.decode_spec, 16, L)) is not None
        triton = triton_module and anchor.TritonDecode(
            triton_module, c.q, anchor.vllm_kv_cache(*c.layer_cache(0)), c.topk, c.block_table, c.seq_lens, L,
            attn.scale, c.k_scale, c.v_scale)
        row.update(anchor_protocol(fwd if stream else None, triton, out, ref, flushes))
    if anchor_only:
        return row
    row["forward_us"] = wall_us(fwd, single_iters, device, flushes.clean)
    row["torch_us"] = events_us(eager, iters, device, flushes.clean)
    row["x_torch"] = row["torch_us"] / row["forward_us"]  # replaced by the kernel ratio when kernel time is known
    row["GBps"] = c.kv_bytes / row["forward_us"] / 1e3
    if attn.gpu_decode and device.type == "cuda":
        spec, args, ws = decode_module_operands(attn, c)
        row["call_us"] = wall_us(lambda: lib.run(spec, *args, out=[out, ws]), single_iters, device, flushes.clean)
        if lib.stream_kernel(spec) is not None:
            # three captures (each over new step metadata): one capture's replays agree within
            # ~0.1 us, but the time sits on one of two levels ~0.7 us apart
            row["graph_us_all"] = sorted(graph_us(lib, device, c, attn, out, iters) for _ in range(3))
            row["graph_us"] = row["graph_us_all"][1]
            row["step_us"] = step_us(lib, device, c, attn, iters)
    return row


def anchor_protocol(ours, triton, out, ref, flushes):
    """The anchor's cold and warm times (anchor.cold_us, anchor.warm_us) of msa-iree's forward
    `ours` (None where it cannot be captured in a graph: no stream launch) and of vLLM's Triton
    attend `triton` (None: not given) on the same inputs, with the Triton output's error against
    the reference `ref` (the compiled attend's was checked before)."""
    row = {}
    if ours is not None:
        row["cold_us"] = anchor.cold_us(ours, flushes.anchor)
        row["warm_us"] = anchor.warm_us(ours)
    if triton is not None:
        t_out = torch.full_like(out, float("nan"))
        triton(t_out)
        t_err = (t_out.float() - ref.float()).abs()
        row.update(triton_max_abs_err=float(t_err.max()), triton_mean_abs_err=float(t_err.mean()))
        call = lambda: triton(t_out)
        row["triton_cold_us"] = anchor.cold_us(call, flushes.anchor)
        row["triton_warm_us"] = anchor.warm_us(call)
        if ours is not None:
            row["x_triton_cold"] = row["triton_cold_us"] / row["cold_us"]
            row["x_triton_warm"] = row["triton_warm_us"] / row["warm_us"]
    return row


def step_us(lib, device, c, attn, iters, layers=57):
    """Per forward of a decode step run eagerly (serving_step_calls, one sync a step): median wall
    time of a step / `layers`. The end-to-end per-call time of forward in serving."""
    calls = serving_step_calls(lib, device, c, attn, layers)
    return wall_us(lambda: [call() for call in calls], iters, device) / layers


def serving_step_calls(lib, device, c, attn, layers=57):
    """The `layers` forwards of one decode step of DecodeCase `c` as serving makes them: one step's
    metadata for all, each layer its own SparseAttention (like `attn`) over its own cache
    (c.layer_cache, up to 16 layers cycled: consecutive layers share no block, as in graph_us).
    Each layer's first call is made here (checked once; its later calls take its bound launch)."""
    (md,) = _decode_metadata(lib, device, c, [c.block_table])
    n = min(c.slices, 16)
    calls = []
    for i in range(n):
        layer = SparseAttention(attn.cfg.num_heads, 1, 128, attn.scale, c.k_cache.dtype, kernels=lib,
                                gpu_matrix=attn.gpu_matrix)
        k, v = c.layer_cache(i)
        out = torch.empty_like(c.q)
        calls.append(lambda layer=layer, k=k, v=v, out=out:
                     layer.forward(c.q, k, v, out, c.topk, md, c.k_scale, c.v_scale))
        calls[-1]()
    return [calls[i % n] for i in range(layers)]


def graph_us(lib, device, c, attn, out, iters, layers=57, pool=None):
    """Per forward of a decode step replayed from a CUDA graph, as vLLM runs decode (capture_step
    over decode_step_calls): median wall time of a replay + sync, divided by `layers`."""
    calls = decode_step_calls(lib, device, c, attn, out)  # held: the graph reads their step metadata
    graph = capture_step(calls, layers, pool)
    return wall_us(graph.replay, iters, device) / layers


def decode_step_calls(lib, device, c, attn, out):
    """One forward per rotation of the block table (other blocks, as each layer's own cache would
    be), over step metadata built for each, each called once (outside any capture: each step's
    tensors, the launch plan, the workspace)."""
    steps = _decode_metadata(lib, device, c, [bt.contiguous() for bt in c.bt_rot])
    calls = [lambda md=md: attn.forward(c.q, c.k_cache, c.v_cache, out, c.topk, md, c.k_scale, c.v_scale)
             for md in steps]
    for call in calls:
        call()
    torch.cuda.synchronize()
    return calls


def capture_step(calls, layers=57, pool=None):
    """A CUDA graph of `layers` of `calls` in turn (launched on torch's stream, so captured);
    `pool`: a graph memory pool to capture into (torch.cuda.graph_pool_handle()), else its own.
    The graph reads the calls' tensors (query, caches, step metadata) at their addresses: keep
    them alive while it is replayed."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        for i in range(layers):
            calls[i % len(calls)]()
    return graph


def add_kernel_time(lib, device, row, rotations=16, flushes=None):
    """Second pass (profiler attached): the device time of one forward's kernels, L2 flushed.
    A run's last pass: CUPTI, once attached, keeps a graph's replays ~1 us a forward slower for
    the rest of the process, so no wall or graph time may follow it."""
    if row["phase"] == "prefill":
        c, _, _, _, fwd = _prefill_setup(lib, device, row["kv_dtype"], row["L"], row["context"], row["q_heads"],
                                         row["matrix"])
    else:
        c, _, _, fwd = _decode_setup(lib, device, row["batch"], row["context"], row["L"], row["q_heads"],
                                     row["kv_dtype"], rotations, row["matrix"])
    by_kernel = {}
    flushes = flushes or Flushes(device)
    k_us = kernel_us(fwd, device, flush=flushes.clean, by_kernel=by_kernel)
    row.update(kernel_us=k_us, kernels_us=by_kernel, GBps=c.kv_bytes / k_us / 1e3,
               x_torch=row["torch_us"] / k_us, overhead_us=row["forward_us"] - k_us,
               forward_over_kernel=row["forward_us"] / k_us, kernel_dirty_us=kernel_us(fwd, device, flush=flushes.dirty))
    if row["phase"] == "decode":
        paged = paged_decode_forward(lib, device, c, row["q_heads"], row["kv_dtype"], row["matrix"])
        if paged is not None:
            row["paged_kernel_us"] = kernel_us(paged, device, flush=flushes.clean)
            row["paged_over_topk"] = row["paged_kernel_us"] / k_us


def paged_decode_forward(lib, device, c, num_heads, kv_name, matrix):
    """The same decode step attended through the page table an indexer would emit for it
    (reference.build_sparse_block_table_decode; the GPU attend over a given table), its output
    checked against the reference; None where the target has no GPU paged attend. The layer does
    not validate the table (a host sync): the timed call is the launch alone."""
    attn = SparseAttention(num_heads, 1, 128, 128 ** -0.5, DTYPES[kv_name], kernels=lib, gpu_matrix=matrix,
                           validate_emitted_tables=False)
    if attn.paged_spec is None:
        return None
    (md,) = _decode_metadata(lib, device, c, [c.block_table])
    bt, ctx = reference.build_sparse_block_table_decode(c.topk, c.block_table, c.seq_lens, c.L, 16)
    out = torch.full_like(c.q, float("nan"))
    fwd = lambda: attn.forward(c.q, c.k_cache, c.v_cache, out, c.topk, md, c.k_scale, c.v_scale,
                               sparse_block_table=bt, sparse_context_lens=ctx)
    fwd()
    ref = torch.empty_like(c.q)
    reference.sparse_paged_attend(c.q, c.k_cache, c.v_cache, bt, ctx, 1, attn.scale, ref, c.k_scale, c.v_scale)
    check_output(out, ref, f"paged decode B={c.batch} ctx={c.context} L={c.L} {kv_name}")
    return fwd


def _prefill_setup(lib, device, kv_name, q_len, context, num_heads, matrix):
    """One request computing its last q_len tokens over a context of `context`: (case, attend,
    output, metadata, forward)."""
    kv_dtype = DTYPES[kv_name]
    c = DecodeCase(1, context, q_len, num_heads, kv_dtype, device, 1, seed=5)
    attn = SparseAttention(num_heads, 1, 128, 128 ** -0.5, kv_dtype, kernels=lib, gpu_matrix=matrix)
    builder = MetadataBuilder(max_num_seqs=1, max_model_len=context, kernels=lib, device=device)
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device=device)
    md = builder.build(c.block_table, c.seq_lens, qsl, c.seq_lens - q_len, decode_query_len=1, num_decodes=0)
    out = torch.full_like(c.q, float("nan"))
    fwd = lambda: attn.forward(c.q, c.k_cache, c.v_cache, out, c.topk, md, c.k_scale, c.v_scale)
    return c, attn, out, md, fwd


def bench_prefill(lib, device, kv_name, iters, q_len=4096, context=32768, num_heads=16, matrix="auto",
                  flushes=None, triton_module=None, anchor_only=False):
    """One request computing its last q_len tokens over a context of `context`: the correctness
    check and the wall-clock numbers (on cuda, add_kernel_time adds the kernel time in the run's
    last pass; on the host, where one call takes seconds and its overhead is noise, kernel_us is
    forward_us)."""
    c, attn, out, md, fwd = _prefill_setup(lib, device, kv_name, q_len, context, num_heads, matrix)
    fwd()
    p = md.prefill
    bt, ctx = reference.build_sparse_block_table_prefill(c.topk, p.block_table, p.query_req_id, p.query_abs_pos, 16)
    ref = torch.empty_like(c.q)
    eager = lambda: reference.sparse_paged_attend(c.q, c.k_cache, c.v_cache, bt, ctx, 1, attn.scale, ref,
                                                  c.k_scale, c.v_scale)
    eager()
    err = check_output(out, ref, f"prefill q={q_len} ctx={context} {kv_name}")
    flushes = flushes or Flushes(device)
    row = {"phase": "prefill", "batch": 1, "context": context, "L": q_len, "q_heads": num_heads, "kv_dtype": kv_name,
           "kernel": attn.prefill_spec.kernel if attn.gpu_decode else "portable", "matrix": matrix,
           "max_abs_err": float(err.max()), "mean_abs_err": float(err.mean()), "ref_max_abs": float(ref.abs().max()),
           "kv_MB": c.kv_bytes / 1e6}
    if device.type == "cuda":
        triton = triton_module and anchor.TritonPrefill(
            triton_module, c.q, anchor.vllm_kv_cache(*c.layer_cache(0)), c.topk, c.block_table, c.seq_lens,
            attn.scale, c.k_scale, c.v_scale)
        stream = attn.gpu_decode and lib.stream_kernel(attn._spec(attn.prefill_spec, 16)) is not None
        row.update(anchor_protocol(fwd if stream else None, triton, out, ref, flushes))
    if anchor_only:
        return row
    row["forward_us"] = forward_us = wall_us(fwd, iters, device, flushes.clean)
    row["torch_us"] = torch_us = events_us(eager, iters, device, flushes.clean)
    if device.type != "cuda":
        row.update(kernel_us=forward_us, kernels_us={}, kernel_dirty_us=None, forward_over_kernel=1.0,
                   GBps=c.kv_bytes / forward_us / 1e3, x_torch=torch_us / forward_us)
    return row


def bench_specs(heads=(16, 8), kv_dtypes=("bf16", "fp8_e4m3fn"), decode_query_lens=(1, 4), prefill=True):
    """The compiled kernels a bench run calls (stride 16: the interleaved cache the cases use)."""
    from msa_iree.ops import (SparseAttnPagedFmaSpec, SparseAttnPagedMmaSpec, SparseAttnPrefillFmaSpec,
                              SparseAttnPrefillMmaSpec, with_variants)

    specs = []
    for kv in kv_dtypes:
        for hq in heads:
            cfg = MsaConfig(num_heads=hq, kv_dtype=kv)
            specs += [cls(cfg, 16) for cls in (SparseAttnPagedFmaSpec, SparseAttnPagedMmaSpec) if cls.supports(cfg)]
            specs += [SparseAttnDecodeFmaSpec(cfg.replace(decode_query_len=L), 16) for L in decode_query_lens]
            if SparseAttnDecodeMmaSpec.supports(cfg):
                specs += [SparseAttnDecodeMmaSpec(cfg.replace(decode_query_len=L), 16) for L in decode_query_lens]
        if prefill:  # (every head count: the serving step's mixed batches)
            specs += [cls(MsaConfig(num_heads=hq, kv_dtype=kv), 16) for hq in heads
                      for cls in (SparseAttnPrefillFmaSpec, SparseAttnPrefillMmaSpec)]
    # and the graph variants (what the graph-captured rows launch) and the top-k attends'
    # inserting variants (the serving step's layers: forward(key=, value=))
    return list({s.name: s for s in with_variants(specs)}.values())


def dtype_rows(lib, device, kv_name, heads, query_lens, contexts, batches, iters, matrix="auto", prefill=False,
               flushes=None, triton_module=None, anchor_only=False):
    """A run's first pass over one KV dtype, in its order: bench_decode for every (query heads, L,
    context, batch) the matrix variant supports, then bench_prefill; each row yielded as measured."""
    extra = {"flushes": flushes, "triton_module": triton_module, "anchor_only": anchor_only}
    for hq in heads:
        if matrix == "mma" and not SparseAttnDecodeMmaSpec.supports(MsaConfig(num_heads=hq, kv_dtype=kv_name)):
            continue
        if matrix == "mfma" and not SparseAttnDecodeMfmaSpec.supports(MsaConfig(num_heads=hq, kv_dtype=kv_name)):
            continue
        for L in query_lens:
            for ctx in contexts:
                for b in batches:
                    yield bench_decode(lib, device, b, ctx, L, hq, kv_name, iters, matrix=matrix, **extra)
    if prefill:
        yield bench_prefill(lib, device, kv_name, max(3, iters // 10), matrix=matrix, **extra)


def table_cell(value, width, fmt=".1f"):
    """`value` formatted to `width`, or "-" where it was not measured (None)."""
    return f"{value:{width}{fmt}}" if value is not None else f"{'-':>{width}}"


def format_anchor_table(rows, copy_GBps):
    """The headline: the anchor's protocol (cold: one forward in a graph after a 256 MiB write;
    warm: per forward of a graph of 20), msa-iree beside vLLM's Triton attend, x = Triton / msa-iree,
    % copy = the selected K/V bytes over the warm time against the run's device copy."""
    head = (f"{'phase':>7} {'matrix':>6} {'kv':>10} {'Hq':>3} {'B':>4} {'ctx':>6} {'L':>4} "
            f"{'cold us':>8} {'triton':>8} {'x':>5} {'warm us':>8} {'triton':>8} {'x':>5} {'%copy':>5} "
            f"{'max err':>8} {'triton err':>10}")
    lines = [f"device-to-device copy: {copy_GBps:.0f} GB/s", head]
    for r in rows:
        warm = r.get("warm_us")
        pct = 100 * r["kv_MB"] * 1e6 / warm / 1e3 / copy_GBps if warm and r["phase"] == "decode" else None
        lines.append(f"{r['phase']:>7} {r.get('matrix', 'auto'):>6} {r['kv_dtype'][:10]:>10} {r['q_heads']:>3} "
                     f"{r['batch']:>4} {r['context']:>6} {r['L']:>4} {table_cell(r.get('cold_us'), 8)} "
                     f"{table_cell(r.get('triton_cold_us'), 8)} {table_cell(r.get('x_triton_cold'), 5, '.2f')} "
                     f"{table_cell(warm, 8)} {table_cell(r.get('triton_warm_us'), 8)} {table_cell(r.get('x_triton_warm'), 5, '.2f')} "
                     f"{table_cell(pct, 5)} {r['max_abs_err']:8.1e} {table_cell(r.get('triton_max_abs_err'), 10, '.1e')}")
    return "\n".join(lines)


def format_table(rows, copy_GBps):
    if not any("forward_us" in r for r in rows):
        return format_anchor_table(rows, copy_GBps)
    head = (f"{'phase':>7} {'matrix':>6} {'kv':>10} {'Hq':>3} {'B':>4} {'ctx':>6} {'L':>4} {'kernel us':>9} {'GB/s':>6} {'%copy':>5} {'dirty us':>8} "
            f"{'call us':>8} {'fwd us':>8} {'fwd/k':>5} {'step us':>7} {'graph us':>8} {'torch us':>9} {'x torch':>7} {'max err':>8} "
            f"{'paged/k':>7}")
    lines = [format_anchor_table(rows, copy_GBps), "", "the harness's other columns:", head]
    for r in rows:
        k = f"{r['kernel_us']:9.1f}" if r.get("kernel_us") else f"{'-':>9}"
        call = f"{r['call_us']:8.1f}" if r.get("call_us") else f"{'-':>8}"
        ratio = f"{r['forward_over_kernel']:5.2f}" if r.get("forward_over_kernel") else f"{'-':>5}"
        graph = f"{r['graph_us']:8.1f}" if r.get("graph_us") else f"{'-':>8}"
        step = f"{r['step_us']:7.1f}" if r.get("step_us") else f"{'-':>7}"
        dirty = f"{r['kernel_dirty_us']:8.1f}" if r.get("kernel_dirty_us") else f"{'-':>8}"
        paged = table_cell(r.get("paged_over_topk"), 7, ".3f")
        lines.append(f"{r['phase']:>7} {r.get('matrix', 'auto'):>6} {r['kv_dtype'][:10]:>10} {r['q_heads']:>3} {r['batch']:>4} {r['context']:>6} "
                     f"{r['L']:>4} {k} {r['GBps']:6.0f} {100 * r['GBps'] / copy_GBps:5.1f} {dirty} {call} "
                     f"{r['forward_us']:8.1f} {ratio} {step} {graph} {r['torch_us']:9.1f} {r['x_torch']:7.2f} {r['max_abs_err']:8.1e} "
                     f"{paged}")
    return "\n".join(lines)


VARIANT_LABEL = {"sparse_attn_decode_mma": "mma (tensor cores)", "sparse_attn_decode_fma": "fma (portable)",
                 "sparse_attn_decode_mfma": "mfma (matrix cores)"}


def plot(rows, path, copy_GBps=None):
    """GB/s vs decode batch (L=1, the smallest context run), one line per dtype, heads, variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    ctx = min(r["context"] for r in rows if r["phase"] == "decode")
    for ax, kv in zip(axes, ("bf16", "fp8_e4m3fn")):
        for hq in (16, 8):
            for matrix in sorted({r.get("matrix", "auto") for r in rows}):
                pts = sorted((r["batch"], r["GBps"]) for r in rows if r["phase"] == "decode" and r["kv_dtype"] == kv
                             and r["q_heads"] == hq and r["L"] == 1 and r["context"] == ctx
                             and r.get("matrix", "auto") == matrix)
                if pts:
                    kernel = next(r.get("kernel", "") for r in rows if r["q_heads"] == hq and r.get("matrix", "auto") == matrix)
                    ax.plot(*zip(*pts), marker="o", label=f"{hq} q heads, {VARIANT_LABEL.get(kernel, kernel)}")
        if copy_GBps:
            ax.axhline(copy_GBps, color="grey", ls="--", lw=1, label="device copy")
        ax.set_title(f"{kv} KV, decode L=1, ctx {ctx}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decode batch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("GB/s of selected K/V (kernel time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


DEPENDENT_LAUNCH = {"auto": None, "on": True, "off": False}  # --dependent-launch -> KernelLibrary(dependent_launch=)


def add_launch_args(parser):
    """The stream-launch options of KernelLibrary, as flags (read back by `launch_options`)."""
    parser.add_argument("--dependent-launch", choices=tuple(DEPENDENT_LAUNCH), default="auto",
                        help="stream launches as programmatic dependent launches: auto = where the GPU has them (sm_90+)")
    parser.add_argument("--l2-evict-first", choices=("on", "off"), default="on",
                        help="decode attends that read each page once mark their loads L2 evict-first")


def launch_options(args) -> dict:
    """KernelLibrary's keyword arguments for the flags of `add_launch_args`."""
    return {"dependent_launch": DEPENDENT_LAUNCH[args.dependent_launch], "l2_evict_first": args.l2_evict_first == "on"}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="cuda", help="cuda (NVIDIA) or host; gfx942 needs an AMD GPU (none here)")
    p.add_argument("--build-dir", help="a build of the target (tools/build_gpu_tests.py builds what a run calls)")
    p.add_argument("--batch", default="8,32,64,128")
    p.add_argument("--context", default="4096,32768,131072")
    p.add_argument("--L", default="1,4")
    p.add_argument("--heads", default="16,8", help="query heads per KV head: 16 = TP4, 8 = TP8")
    p.add_argument("--kv-dtype", default="bf16,fp8_e4m3fn")
    p.add_argument("--prefill", action="store_true", help="also prefill q=4096 over 32K")
    p.add_argument("--matrix", default="auto", help="GPU attend variants, comma list: auto (the target's matrix "
                   "cores where possible: mma on cuda, mfma on hip), fma (portable), mma, mfma")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--anchor", metavar="SPARSE_ATTN_PY", help="vLLM's Triton MSA kernels (a copy of "
                   "vllm/models/minimax_m3/common/ops/sparse_attn.py from the vllm wheel): run beside every row")
    p.add_argument("--anchor-only", action="store_true",
                   help="only the anchor's protocol (cold and warm graph replays), none of the other columns")
    add_launch_args(p)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--plot", help="write a PNG of GB/s vs batch here (needs matplotlib)")
    p.add_argument("--from-json", help="no run: print the table (and --plot) of an earlier run's JSON")
    a = p.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            run = json.load(f)
        print(format_table(run["rows"], run["copy_GBps"]))
        if a.plot:
            plot(run["rows"], a.plot, run.get("copy_GBps"))
        return 0
    if not a.build_dir:
        p.error("--build-dir is required for a run")
    device = torch.device("cuda" if a.target in ("cuda", "hip") else "cpu")
    lib = KernelLibrary(a.target, a.build_dir, compile_missing=False, **launch_options(a))
    copy = copy_bandwidth_GBps(device) if device.type == "cuda" else float("nan")
    flushes = Flushes(device)  # the flush buffers, made once for the run
    triton_module = anchor.load_triton_module(a.anchor) if a.anchor else None
    rows = []

    def report(row):  # one JSON line per case, and the JSON file rewritten as the run goes
        print(json.dumps(row), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"copy_GBps": copy, "device": torch.cuda.get_device_name() if device.type == "cuda"
                           else "cpu", "dependent_launch": lib.dependent_launch,
                           "l2_evict_first": lib.l2_evict_first, "anchor": a.anchor,
                           "command": "python -m benchmarks.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
                           "rows": rows}, f, indent=1)

    ints = lambda s: [int(x) for x in s.split(",") if x]
    for matrix in a.matrix.split(","):
        for kv in a.kv_dtype.split(","):
            for row in dtype_rows(lib, device, kv, ints(a.heads), ints(a.L), ints(a.context), ints(a.batch), a.iters,
                                  matrix, a.prefill, flushes, triton_module, a.anchor_only):
                rows.append(row)
                report(row)
    if device.type == "cuda" and not a.anchor_only:  # kernel times last: the profiler would slow the wall-clock and graph pass
        for row in rows:
            if row["phase"] == "prefill" or row.get("call_us") is not None:
                add_kernel_time(lib, device, row, flushes=flushes)
                report(row)
    print(format_table(rows, copy))
    if a.plot:
        plot(rows, a.plot, copy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
