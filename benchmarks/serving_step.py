"""A serving step as an engine runs it, on one CUDA device: fresh metadata every step
(`MetadataBuilder.build` on the step's own new tensors), then for each of 57 layers, each its own
`SparseAttention` over its own KV cache, the step's new tokens inserted and attended; one sync a
step. --insert says how a layer inserts: "forward" (the default) passes them to `forward(key=,
value=)`, which writes them inside the attend's own launch (one launch a layer, decode and mixed
steps alike; a kernel fewer in a captured step); "separate" calls `insert_kv`, then `forward`.

Cases: decode B x context x query heads per KV head x KV dtype (every request `context` tokens,
one new), and a mixed step (one 2K-token prefill chunk, the last 2048 tokens of a 4K request,
after 63 decodes at 4K). The block table is as wide as the context, or, with --max-model-len, as
wide as that (vLLM's table: cdiv(max_model_len, 128) columns whatever the context), the step's
longest seq_len given to the builder as vLLM gives it (max_seq_len). Per layer (a step's time / 57, medians over steps):
- build_us: one step's `MetadataBuilder.build` (+ sync), not divided by the layers;
- build_alone_us: the same build in a loop of builds with no layers between them (the host's
  caches warm: what the step's layers cost the build is the difference);
- build_idle_us: the same build after the host slept as long as the step waited for its
  kernels (idle_ms; the wait's median): what waking from that wait costs the build alone (a
  CPU idle for milliseconds runs its next few hundred microseconds of work several times slower);
- host_us: the host time of a layer's insert and attend (the 57 layers issued, before the sync);
- eager_us: a step run eagerly: build + 57 layers + sync;
- graph_us (decode steps): the step's 57 layers captured in a CUDA graph once, each replay after
  the next step's build wrote its metadata into the builder's buffers: replay + sync (vLLM runs
  uniform decode from full CUDA graphs and mixed batches eagerly);
- kernels_us: the device time of one eager step's kernels (builder, inserts, attends; CUPTI
  durations summed, taken last: CUPTI slows later graph replays).
Last, the device memory the library and layers allocate in the steady state beyond the case's
own tensors, with 1 and with 57 layers (library_memory_MB in the JSON).

--cpu N pins the process (its threads, the CUDA driver's included) to CPU N before anything is
measured: on a shared GPU host a process free to move between CPUs measured larger and more
variable host and build times than a pinned one (benchmarks/PERF.md, decision record).

Each layer's cache is its own slice of one pool while 57 slices fit in --pool-gib; past that the
slices are cycled (consecutive layers never share a block, so each finds its K/V in DRAM).

    python -m benchmarks.serving_step --build-dir .devbuild/cuda --json serving.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from msa_iree.config import DTYPES
from msa_iree.layout import num_cache_blocks
from msa_iree.runtime import KernelLibrary, MetadataBuilder, SparseAttention

from .bench import DecodeCase, add_launch_args, capture_step, draw_topk, kernel_us, launch_options, table_cell
from .host_wake import after_wait_us

LAYERS = 57  # MiniMax-M3's sparse layers
STEPS = 20   # timed steps per measurement
STEP_TENSORS = 4  # distinct sets of step input tensors, cycled: every build sees new tensors
INSERT_MODES = ("forward", "separate")


class ServingCase:
    """The step inputs of one case: the caches (DecodeCase's pool), the per-step tensors, the
    57 layers, and the new tokens' query, key and value."""

    def __init__(self, lib, device, batch, context, num_heads, kv_name, prefill_chunk=0, pool_gib=16.0,
                 layers=LAYERS, insert="forward", max_model_len=None):
        if insert not in INSERT_MODES:
            raise ValueError(f"insert: expected one of {INSERT_MODES}, got {insert!r}")
        self.insert = insert
        kv_dtype = DTYPES[kv_name]
        block_bytes = 2 * 128 * 128 * kv_dtype.itemsize
        mapped = batch * -(-context // 128)
        pool_bytes = int(min(layers * mapped * block_bytes, pool_gib * (1 << 30)))
        self.case = c = DecodeCase(batch, context, 1, num_heads, kv_dtype, device, 1, seed=batch + context % 97,
                                   pool_bytes=pool_bytes)
        self.batch, self.context, self.chunk = batch, context, prefill_chunk
        g = torch.Generator(device=device).manual_seed(7)
        decodes = batch - 1 if prefill_chunk else batch
        qlens = torch.tensor([1] * decodes + ([prefill_chunk] if prefill_chunk else []), device=device)
        self.num_decodes = decodes
        self.qsl = torch.cat([torch.zeros(1, dtype=torch.long, device=device), qlens.cumsum(0)]).int()
        self.computed = (c.seq_lens - qlens).int()
        pos = torch.cat([torch.arange(int(n), device=device) + int(s) for n, s in zip(qlens, self.computed)])
        req = torch.repeat_interleave(torch.arange(batch, device=device), qlens)
        self.topk = draw_topk(pos, g) if prefill_chunk else c.topk
        owner = c.block_table.long()[req, pos // 128]
        self.slots = (owner * 128 + pos % 128).int()
        tokens = pos.shape[0]
        self.q = torch.randn(tokens, num_heads, 128, generator=g, device=device).to(torch.bfloat16)
        self.key = torch.randn(tokens, 1, 128, generator=g, device=device).to(torch.bfloat16)
        self.value = torch.randn(tokens, 1, 128, generator=g, device=device).to(torch.bfloat16)
        self.layers = []
        for i in range(layers):
            k, v = c.layer_cache(i)
            attn = SparseAttention(num_heads, 1, 128, 128 ** -0.5, kv_dtype, kernels=lib)
            self.layers.append((attn, k, v, torch.empty_like(self.q)))
        self.max_model_len = max_model_len = max(context, max_model_len or 0)
        self.builder = MetadataBuilder(max_num_seqs=batch, max_model_len=max_model_len, kernels=lib, device=device,
                                       num_cache_blocks=num_cache_blocks(*c.layer_cache(0)))
        self.max_seq_len = int(c.seq_lens.max())
        table = c.block_table.new_zeros(batch, -(-max_model_len // 128))  # vLLM's: the unused columns 0
        table[:, :c.block_table.shape[1]] = c.block_table
        # new tensors for every step, as an engine hands the builder (same values: the step repeats)
        self.step_tensors = [tuple(t.clone() for t in (table, c.seq_lens, self.qsl, self.computed, self.slots))
                             for _ in range(STEP_TENSORS)]
        self.steps = 0

    def build(self):
        bt, seq, qsl, computed, slots = self.step_tensors[self.steps % STEP_TENSORS]
        self.steps += 1
        return self.builder.build(bt, seq, qsl, computed, 1, self.num_decodes, slot_mapping=slots,
                                  max_seq_len=self.max_seq_len)

    def layers_call(self, md):
        c = self.case
        if self.insert == "forward":
            for attn, k, v, out in self.layers:
                attn.forward(self.q, k, v, out, self.topk, md, c.k_scale, c.v_scale, key=self.key, value=self.value)
            return
        for attn, k, v, out in self.layers:
            attn.insert_kv(self.key, self.value, k, v, md, c.k_scale, c.v_scale)
            attn.forward(self.q, k, v, out, self.topk, md, c.k_scale, c.v_scale)


def pin_to_cpu(cpu: int) -> None:
    """Run this process (the calling thread and every thread it starts after) on CPU `cpu` only."""
    allowed = sorted(os.sched_getaffinity(0))
    if cpu not in allowed:
        raise ValueError(f"cpu: expected one of the CPUs this process may run on, {allowed}, got {cpu}")
    os.sched_setaffinity(0, {cpu})


def _median(xs):
    return statistics.median(xs) * 1e6


def measure(case: ServingCase, graph: bool) -> dict:
    """The per-layer numbers of one case (module docstring)."""
    case.layers_call(case.build())  # each layer's first, fully checked call; its later calls bound
    torch.cuda.synchronize()
    build, host, eager, wait = [], [], [], []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        md = case.build()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        case.layers_call(md)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        build.append(t1 - t0)
        host.append((t2 - t1) / LAYERS)
        eager.append((t3 - t0) / LAYERS)
        wait.append(t3 - t2)
    idle_s = statistics.median(wait)

    def build_and_sync():
        case.build()
        torch.cuda.synchronize()
    row = {"build_us": _median(build), "build_alone_us": after_wait_us(build_and_sync, 0, False, STEPS),
           "build_idle_us": after_wait_us(build_and_sync, idle_s, False, STEPS), "idle_ms": idle_s * 1e3,
           "host_us": _median(host), "eager_us": _median(eager)}
    if graph:
        md = case.build()
        case.layers_call(md)
        torch.cuda.synchronize()
        g = capture_step([lambda: case.layers_call(md)], layers=1)
        replays = []
        for _ in range(STEPS):
            case.build()  # the next step's metadata, into the buffers the graph reads
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g.replay()
            torch.cuda.synchronize()
            replays.append((time.perf_counter() - t0) / LAYERS)
        row["graph_us"] = _median(replays)
        row["eager_over_graph"] = row["eager_us"] / row["graph_us"]
    return row


def add_kernel_sum(case: ServingCase, row: dict) -> None:
    row["kernels_us"] = kernel_us(lambda: case.layers_call(case.build()), torch.device("cuda"), iters=5) / LAYERS
    if "graph_us" in row:
        row["graph_over_kernels"] = row["graph_us"] / row["kernels_us"]


def library_memory_MB(build_dir, device, layers, launch) -> float:
    """The device memory the library and the layers allocate in the steady state, beyond what
    the case holds (caches, step inputs, the layers' outputs): allocated after three steps minus
    allocated before the first, with a library of its own (its workspace is made on first use).
    B=64 4K fp8 TP4."""
    lib = KernelLibrary("cuda", build_dir, compile_missing=False, **launch)
    case = ServingCase(lib, device, 64, 4096, 16, "fp8_e4m3fn", layers=layers)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    for _ in range(3):
        case.layers_call(case.build())
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated(device) - before
    del case, lib
    torch.cuda.empty_cache()
    return grown / 1e6


# the table's measured columns: (row key, width, format)
COLUMNS = [("build_us", 8, ".1f"), ("build_alone_us", 7, ".1f"), ("build_idle_us", 7, ".1f"), ("idle_ms", 7, ".2f"),
           ("host_us", 7, ".1f"), ("eager_us", 8, ".1f"), ("graph_us", 8, ".1f"),
           ("kernels_us", 10, ".1f"), ("eager_over_graph", 11, ".2f"), ("graph_over_kernels", 10, ".2f")]


def format_table(rows) -> str:
    head = (f"{'step':>8} {'insert':>8} {'kv':>10} {'Hq':>3} {'B':>4} {'ctx':>6} {'table':>7} {'build us':>8} "
            f"{'alone':>7} {'idle':>7} {'idle ms':>7} {'host us':>7} {'eager us':>8} {'graph us':>8} {'kernels us':>10} {'eager/graph':>11} {'graph/kern':>10}")
    lines = ["per layer (57 layers a step; build us: a step's metadata build, alone: in a loop of builds; table: "
             "its block table's width in tokens; idle: after the host slept idle ms, the step's wait for its kernels)", head]
    for r in rows:
        cells = [table_cell(r.get(k), w, f) for k, w, f in COLUMNS]
        lines.append(f"{r['step']:>8} {r.get('insert', 'separate'):>8} {r['kv_dtype'][:10]:>10} {r['q_heads']:>3} "
                     f"{r['batch']:>4} {r['context']:>6} {r.get('max_model_len', r['context']):>7} " + " ".join(cells))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", help="a cuda build (tools/build_gpu_tests.py builds what a run calls)")
    p.add_argument("--batch", default="8,64,128")
    p.add_argument("--context", default="4096,131072")
    p.add_argument("--heads", default="16,8", help="query heads per KV head: 16 = TP4, 8 = TP8")
    p.add_argument("--kv-dtype", default="fp8_e4m3fn,bf16")
    p.add_argument("--no-mixed", action="store_true", help="leave out the mixed step (2K prefill chunk + 63 decodes)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="the block table's width in tokens, as vLLM's (default: each case's context)")
    p.add_argument("--pool-gib", type=float, default=16.0, help="the layers' caches at most this much")
    p.add_argument("--insert", default="forward", help=f"how layers insert, one row per mode: {','.join(INSERT_MODES)}")
    add_launch_args(p)
    p.add_argument("--cpu", type=int, default=None, help="pin the process to this CPU before measuring")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--from-json", help="no run: print the table of an earlier run's JSON")
    a = p.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            print(format_table(json.load(f)["rows"]))
        return 0
    if not a.build_dir:
        p.error("--build-dir is required for a run")
    if a.cpu is not None:
        try:  # before CUDA starts its threads, so that they inherit it
            pin_to_cpu(a.cpu)
        except ValueError as e:
            p.error(f"--{e}")
    if not torch.cuda.is_available():
        p.error("the serving step is measured on a CUDA device; none is visible")
    device = torch.device("cuda")
    lib = KernelLibrary("cuda", a.build_dir, compile_missing=False, **launch_options(a))
    ints = lambda s: [int(x) for x in s.split(",") if x]
    modes = a.insert.split(",")
    for m in modes:
        if m not in INSERT_MODES:
            p.error(f"--insert: expected modes among {','.join(INSERT_MODES)}, got {m!r}")
    cases = [(kv, hq, b, ctx, 0, m) for kv in a.kv_dtype.split(",") for hq in ints(a.heads)
             for ctx in ints(a.context) for b in ints(a.batch) for m in modes]
    if not a.no_mixed:
        cases += [(kv, hq, 64, 4096, 2048, m) for kv in a.kv_dtype.split(",") for hq in ints(a.heads) for m in modes]
    rows = []

    def save():  # the JSON rewritten as the run goes
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "cpu": a.cpu, "command": "python -m benchmarks.serving_step "
                           + " ".join(argv if argv is not None else sys.argv[1:]), "rows": rows}, f, indent=1)

    for kv, hq, b, ctx, chunk, mode in cases:
        case = ServingCase(lib, device, b, ctx, hq, kv, chunk, a.pool_gib, insert=mode, max_model_len=a.max_model_len)
        row = {"step": "mixed" if chunk else "decode", "insert": mode, "kv_dtype": kv, "q_heads": hq, "batch": b,
               "context": ctx, "max_model_len": case.max_model_len, "prefill_chunk": chunk,
               **measure(case, graph=not chunk)}
        rows.append(row)
        save()
        print(json.dumps(row), flush=True)
        del case
        torch.cuda.empty_cache()
    for row in rows:  # kernel sums last (CUPTI)
        case = ServingCase(lib, device, row["batch"], row["context"], row["q_heads"], row["kv_dtype"],
                           row["prefill_chunk"], a.pool_gib, insert=row["insert"], max_model_len=a.max_model_len)
        case.layers_call(case.build())
        add_kernel_sum(case, row)
        del case
        torch.cuda.empty_cache()
        save()
    print(format_table(rows))
    memory = {n: library_memory_MB(a.build_dir, device, n, launch_options(a)) for n in (1, LAYERS)}
    print(f"device memory the library allocates in the steady state (B=64 4K fp8): {memory[1]:.1f} MB with one "
          f"layer, {memory[LAYERS]:.1f} MB with {LAYERS}")
    if a.json:
        with open(a.json) as f:
            saved = json.load(f)
        saved["library_memory_MB"] = {str(n): mb for n, mb in memory.items()}
        with open(a.json, "w") as f:
            json.dump(saved, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
