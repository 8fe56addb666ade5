"""Where a decode attend's time goes inside its workgroups: the clock-stamped mma attend
(SparseAttnDecodeMmaTraceSpec, built by tools/build_gpu_tests.py) run on a bench decode case, the
L2 flushed before each call, its per-workgroup stamps turned into phase durations.

    python3 tools/trace_phases.py --build-dir .devbuild/cuda-main --batch 8,64,128 --kv-dtype bf16,fp8_e4m3fn
    python3 tools/trace_phases.py --build-dir .devbuild/cuda-main --batch 64 --flush dirty
    python3 tools/trace_phases.py --build-dir .devbuild/cuda-main --batch 64 --context 131072 --rotate --warm-tlb

Per phase: p10 / p50 / p90 / max over the workgroups (us, SM clock converted with the clock rate
the stamps themselves give against the globaltimer), median over --calls calls. Phases: the page
ids (top-k row, block-table row), each block's first softmax barrier after the previous block's
second (the previous PV, this block's K, its QK), the softmax between the two barriers (V in
flight), the last PV and the l reduction, the partials' stores; start/end: globaltimer against the
earliest workgroup's start. --flush clean (a 512 MiB read, the harness's kernel_us) or dirty (a
512 MiB write: the L2 full of dirty lines, kernel_dirty_us). --rotate: each call over the next
rotation of the block table (other blocks of the pool, as the bench's graph_us replays them: at
long contexts a call's blocks then spread over GiBs); --warm-tlb [KiB]: after the flush, one byte
read from every 2 MiB (or KiB) of the cache pool (address translations warm, practically nothing
of the K/V in the L2), to see what the first touch of a page costs.

    python3 tools/trace_phases.py --build-dir .devbuild/cuda-main --batch 64 --kv-dtype fp8_e4m3fn --after-writes 24

--after-writes GIB: does the attend run slower right after GiBs of DRAM traffic (the rotated
graph did, tenth session), and is it the SM clock? Calls one after another (each waited for,
tables rotated, no flush) for 50 ms, then GIB GiB written and freed, then --seconds more; per 20 ms
window the medians of the stamps' SM clock, the median workgroup, the last workgroup's end and
the blocks' phases.
"""
import argparse
import statistics
import sys
import time

import torch

from msa_iree import bench
from msa_iree.config import MsaConfig
from msa_iree.kernels import SparseAttnDecodeMmaTraceSpec
from msa_iree.runtime import KernelLibrary


def phases(stamps, blocks):
    """{phase: [us per workgroup]} from `stamps` [workgroups, 16] (lists of ints)."""
    g0 = min(r[0] for r in stamps)
    ghz = statistics.median((r[12] - r[1]) / max(1, r[13] - r[0]) for r in stamps)
    us = lambda cycles: cycles / ghz / 1e3
    out = {"start": [(r[0] - g0) / 1e3 for r in stamps], "end": [(r[13] - g0) / 1e3 for r in stamps],
           "page ids": [us(r[2] - r[1]) for r in stamps], "block 0: K, QK": [us(r[3] - r[2]) for r in stamps]}
    for j in range(min(blocks, 4)):
        if j:
            out[f"block {j}: PV {j - 1}, K, QK"] = [us(r[3 + 2 * j] - r[2 + 2 * j]) for r in stamps]
        out[f"block {j}: softmax"] = [us(r[4 + 2 * j] - r[3 + 2 * j]) for r in stamps]
    last = 2 + 2 * min(blocks, 4)
    out["last PV, l" if blocks <= 4 else f"blocks 4-{blocks - 1}, last PV, l"] = [us(r[11] - r[last]) for r in stamps]
    out["stores"] = [us(r[12] - r[11]) for r in stamps]
    out["workgroup"] = [us(r[12] - r[1]) for r in stamps]
    out["clock GHz"] = [ghz] * len(stamps)
    return out


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def traced(lib, device, kv, batch, context, rotate):
    """(splits, run(i): queue the traced attend over table i, read(): the last call's phases, the
    cache pool [pages, ...]) for a bench decode case, TP4, L=1."""
    c, attn, out, _ = bench._decode_setup(lib, device, batch, context, 1, 16, kv, 16)
    _, args, _ = bench.decode_module_operands(attn, c)
    spec = SparseAttnDecodeMmaTraceSpec(MsaConfig(kv_dtype=kv), 16)
    ws = torch.empty(spec.workspace_floats(batch), dtype=torch.float32, device=device)
    tables = [bt.contiguous() for bt in c.bt_rot] if rotate else [args[4]]
    run = lambda i: lib.run(spec, *args[:4], tables[i % len(tables)], *args[5:], out=[out, ws])
    read = lambda: phases(spec.stamps(ws, batch).cpu().tolist(), 16 // spec.splits(batch))
    return spec.splits(batch), run, read, c.k_cache


def trace_case(lib, device, kv, batch, context, flush, calls, rotate=False, warm_tlb=0):
    splits, run, read, pool = traced(lib, device, kv, batch, context, rotate)
    pages = pool.view(torch.uint8).view(-1)[::max(1, warm_tlb) << 10]  # one byte per warm_tlb KiB of the pool
    touched = torch.empty((), dtype=torch.int64, device=device)
    run(0)
    per_call = []
    for i in range(calls):
        flush()
        if warm_tlb:
            torch.sum(pages, dim=0, dtype=torch.int64, out=touched)
        torch.cuda.synchronize()
        run(i + 1)
        torch.cuda.synchronize()
        per_call.append(read())
    return splits, per_call


def after_writes(lib, device, kv, batch, context, gib, seconds, window=0.02):
    """Prints, per `window` seconds, the medians of the calls' SM clock, median workgroup, last end
    and block phases: 50 ms of calls, then `gib` GiB written and freed, then `seconds` of calls."""
    _, run, read, _ = traced(lib, device, kv, batch, context, rotate=True)
    run(0)
    torch.cuda.synchronize()

    def series(duration):
        rows, t0, i = [], time.perf_counter(), 0
        while time.perf_counter() - t0 < duration:
            i += 1
            run(i)
            torch.cuda.synchronize()
            ph = read()
            later = [x for name, xs in ph.items() if name.startswith("block") and "QK" in name
                     and not name.startswith("block 0") for x in xs]
            rows.append((time.perf_counter() - t0, ph["clock GHz"][0], statistics.median(ph["workgroup"]),
                         max(ph["end"]), statistics.median(ph["block 0: K, QK"]), statistics.median(later)))
        return rows

    def show(name, rows):
        print(f"== {name}: {len(rows)} calls; per {window * 1e3:.0f} ms: start ms, SM GHz, workgroup p50, "
              f"last end, block 0 p50, later blocks p50 (us)")
        for w in range(int(rows[-1][0] / window) + 1):
            sel = [r for r in rows if w * window <= r[0] < (w + 1) * window]
            if sel:
                cols = [statistics.median(r[k] for r in sel) for k in range(1, 6)]
                print(f"  {w * window * 1e3:6.0f} {cols[0]:7.3f}" + "".join(f"{x:8.2f}" for x in cols[1:]) + f"  ({len(sel)} calls)")

    show("idle before", series(0.05))
    bench.write_and_free(device, int(gib))
    show(f"right after {int(gib)} GiB written", series(seconds))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", required=True)
    p.add_argument("--batch", default="8,64,128")
    p.add_argument("--kv-dtype", default="bf16,fp8_e4m3fn")
    p.add_argument("--flush", choices=("clean", "dirty"), default="clean")
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--rotate", action="store_true", help="each call over the next block-table rotation")
    p.add_argument("--warm-tlb", type=int, nargs="?", const=2048, default=0, metavar="KIB",
                   help="after the flush, read one byte of every KIB KiB of the pool (default 2048)")
    p.add_argument("--after-writes", type=float, default=0, metavar="GIB",
                   help="calls in a row before and after GIB GiB of DRAM writes (see above)")
    p.add_argument("--seconds", type=float, default=0.3, help="... for this long after the writes")
    a = p.parse_args(argv)
    device = torch.device("cuda")
    lib = KernelLibrary("cuda", a.build_dir, compile_missing=False)
    if a.after_writes:
        for kv in a.kv_dtype.split(","):
            for batch in (int(b) for b in a.batch.split(",")):
                print(f"-- {kv}, decode B={batch} L=1 TP4 ctx {a.context // 1024}K, tables rotated, no flush")
                after_writes(lib, device, kv, batch, a.context, a.after_writes, a.seconds)
        return 0
    flush = bench.l2_flusher(device, dirty=a.flush == "dirty")
    for kv in a.kv_dtype.split(","):
        for batch in (int(b) for b in a.batch.split(",")):
            splits, per_call = trace_case(lib, device, kv, batch, a.context, flush, a.calls, a.rotate, a.warm_tlb)
            how = "".join((", tables rotated" if a.rotate else "", f", TLB warmed every {a.warm_tlb} KiB" if a.warm_tlb else ""))
            print(f"== {kv}, decode B={batch} L=1 TP4 ctx {a.context // 1024}K, {splits} splits, {batch * splits} "
                  f"workgroups, L2 flushed {a.flush}{how} (us: p10 p50 p90 max over workgroups, median of "
                  f"{a.calls} calls)")
            for name in per_call[0]:
                cols = [statistics.median(pct(call[name], q) for call in per_call) for q in (0.1, 0.5, 0.9, 1.0)]
                print(f"  {name:26s}" + "".join(f"{x:8.2f}" for x in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
