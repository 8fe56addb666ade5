"""Decode-attend benchmark: compiled module (IREE) vs torch eager on the same device, same run.

First, partial harness (issue 5): decode only, L = 1, all 16 blocks visible, one KV head.
Per case it reports the IREE module's per-call time (synchronous call on device-resident
arrays: kernel time *plus* IREE invocation overhead), torch eager's time for the reference
`sparse_paged_attend` (CUDA events, median), the GB/s of selected K/V bytes the queries see,
and the ratio. Outputs are checked against the reference before timing.

    python tools/bench.py --target cuda --build-dir build/cuda --batch 8,64 --context 4096
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from msa_iree import reference, testing
from msa_iree.config import MsaConfig, dtype_name
from msa_iree.kernels import SparseAttnDecodeSpec, storage_dtype
from msa_iree.runtime import KernelLibrary, module_scale, to_numpy


def median_ms(fn, iters):
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def torch_ms(fn, iters, device):
    if device.type != "cuda":
        return median_ms(fn, iters)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record(); fn(); end.record(); torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_case(lib, device, batch, context, kv_dtype, heads, iters):
    import iree.runtime as rt

    seq = [context] * batch
    c = testing.decode_case(seq, num_heads=heads, kv_dtype=kv_dtype, seed=batch, keep_own_prob=1.0)
    # every row sees its 16 blocks: own block + 15 older ones (context >= 2048)
    cfg = MsaConfig(num_heads=heads, kv_dtype=dtype_name(kv_dtype))
    spec = SparseAttnDecodeSpec(cfg, 16)
    fn = lib.function(spec)
    dev = lib.config.device
    kp = c.k_cache.reshape(-1, *c.k_cache.shape[2:]).view(storage_dtype(kv_dtype))
    vp = c.v_cache.reshape(-1, *c.v_cache.shape[2:]).view(storage_dtype(kv_dtype))
    args = [c.q, kp, vp, c.topk, c.block_table.clamp(min=0), c.seq_lens, torch.tensor([c.scale]),
            module_scale(c.k_scale, 1), module_scale(c.v_scale, 1)]
    dargs = [rt.asdevicearray(dev, to_numpy(a)) for a in args]
    got = fn(*dargs)
    out = torch.from_numpy(got.to_host().view("int16")).view(torch.bfloat16)

    gq = {k: getattr(c, k) for k in ("q", "k_cache", "v_cache", "topk", "block_table", "seq_lens")}
    gq = {k: v.to(device) for k, v in gq.items()}
    ks = None if c.k_scale is None else c.k_scale.to(device)
    vs = None if c.v_scale is None else c.v_scale.to(device)
    bt, ctx = reference.build_sparse_block_table_decode(gq["topk"], gq["block_table"], gq["seq_lens"], 1, 16)
    ref = torch.empty_like(gq["q"])
    eager = lambda: reference.sparse_paged_attend(gq["q"], gq["k_cache"], gq["v_cache"], bt, ctx, 1, c.scale, ref, ks, vs)
    eager()
    err = (out.float() - ref.float().cpu()).abs()
    iree_ms = median_ms(lambda: fn(*dargs), iters)
    eager_ms = torch_ms(eager, iters, device)
    kv_bytes = int(ctx.sum()) * 128 * 2 * c.k_cache.element_size()
    return {"batch": batch, "context": context, "kv_dtype": dtype_name(kv_dtype), "q_heads": heads,
            "iree_us": iree_ms * 1e3, "torch_us": eager_ms * 1e3, "iree_GBps": kv_bytes / iree_ms / 1e6,
            "speedup_vs_torch": eager_ms / iree_ms, "max_abs_err": float(err.max()), "mean_abs_err": float(err.mean())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="host")
    p.add_argument("--build-dir")
    p.add_argument("--batch", default="8,64")
    p.add_argument("--context", default="4096")
    p.add_argument("--kv-dtype", default="bf16,fp8_e4m3fn")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json")
    a = p.parse_args()
    device = torch.device("cuda" if a.target == "cuda" else "cpu")
    lib = KernelLibrary(a.target, a.build_dir)
    rows = []
    for kv in a.kv_dtype.split(","):
        for b in map(int, a.batch.split(",")):
            for ctx in map(int, a.context.split(",")):
                r = run_case(lib, device, b, ctx, {"bf16": torch.bfloat16, "fp8_e4m3fn": torch.float8_e4m3fn,
                                                  "fp8_e4m3fnuz": torch.float8_e4m3fnuz}[kv], a.heads, a.iters)
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(f"{'kv':>13} {'B':>4} {'ctx':>6} {'iree us':>9} {'torch us':>9} {'GB/s':>7} {'x torch':>7} {'max err':>8}")
    for r in rows:
        print(f"{r['kv_dtype']:>13} {r['batch']:>4} {r['context']:>6} {r['iree_us']:9.1f} {r['torch_us']:9.1f} "
              f"{r['iree_GBps']:7.0f} {r['speedup_vs_torch']:7.2f} {r['max_abs_err']:8.1e}")
    if a.json:
        open(a.json, "w").write(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
