"""Where a decode attend's time goes inside its workgroups: the clock-stamped mma attend
(SparseAttnDecodeMmaTraceSpec, built by tools/build_gpu_tests.py) run on a bench decode case, the
L2 flushed before each call, its per-workgroup stamps turned into phase durations.

    python3 tools/trace_phases.py --build-dir .devbuild/cuda-main --batch 8,64,128 --kv-dtype bf16,fp8_e4m3fn
    python3 tools/trace_phases.py --build-dir .devbuild/cuda-main --batch 64 --flush dirty

Per phase: p10 / p50 / p90 / max over the workgroups (us, SM clock converted with the clock rate
the stamps themselves give against the globaltimer), median over --calls calls. Phases: the page
ids (top-k row, block-table row), each block's first softmax barrier after the previous block's
second (the previous PV, this block's K, its QK), the softmax between the two barriers (V in
flight), the last PV and the l reduction, the partials' stores; start/end: globaltimer against the
earliest workgroup's start. --flush clean (a 512 MiB read, the harness's kernel_us) or dirty (a
512 MiB write: the L2 full of dirty lines, kernel_dirty_us).
"""
import argparse
import statistics
import sys

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


def trace_case(lib, device, kv, batch, flush, calls):
    c, attn, out, _ = bench._decode_setup(lib, device, batch, 4096, 1, 16, kv, 16)
    _, args, _ = bench.decode_module_operands(attn, c)
    spec = SparseAttnDecodeMmaTraceSpec(MsaConfig(kv_dtype=kv), 16)
    ws = torch.empty(spec.workspace_floats(batch), dtype=torch.float32, device=device)
    run = lambda: lib.run(spec, *args, out=[out, ws])
    run()
    per_call = []
    for _ in range(calls):
        flush()
        torch.cuda.synchronize()
        run()
        torch.cuda.synchronize()
        per_call.append(phases(spec.stamps(ws, batch).cpu().tolist(), 16 // spec.splits(batch)))
    return spec.splits(batch), per_call


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", required=True)
    p.add_argument("--batch", default="8,64,128")
    p.add_argument("--kv-dtype", default="bf16,fp8_e4m3fn")
    p.add_argument("--flush", choices=("clean", "dirty"), default="clean")
    p.add_argument("--calls", type=int, default=5)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    lib = KernelLibrary("cuda", a.build_dir, compile_missing=False)
    flush = bench.l2_flusher(device, dirty=a.flush == "dirty")
    for kv in a.kv_dtype.split(","):
        for batch in (int(b) for b in a.batch.split(",")):
            splits, per_call = trace_case(lib, device, kv, batch, flush, a.calls)
            print(f"== {kv}, decode B={batch} L=1 TP4 ctx 4K, {splits} splits, {batch * splits} workgroups, "
                  f"L2 flushed {a.flush} (us: p10 p50 p90 max over workgroups, median of {a.calls} calls)")
            for name in per_call[0]:
                cols = [statistics.median(pct(call[name], q) for call in per_call) for q in (0.1, 0.5, 0.9, 1.0)]
                print(f"  {name:26s}" + "".join(f"{x:8.2f}" for x in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
