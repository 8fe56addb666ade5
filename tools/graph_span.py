"""Does the rotated graph's decode time depend on how far apart a forward's blocks lie?

`msa-iree bench`'s graph_us at a long context is slower than at 4K (fp8 B=64: ~15.8 vs ~15.0 us).
At 128K a forward's blocks lie all over a pool of GiBs, at 4K within a 128 MiB slice; the rows'
block tables are also wider. This tool separates the two: graph_us at 4K as the bench runs it, at
4K with each forward's blocks drawn from a pool of --pool-gib (4K's tables, 128K's spread), and at
128K as the bench runs it; each measured --repeats times (sorted). --cases picks some of them
(one per process shows what a process's earlier allocations change).

    python3 tools/graph_span.py --build-dir .devbuild/cuda-cvt [--batch 64] [--kv-dtype fp8_e4m3fn,bf16]
"""
import argparse

import torch

from msa_iree import bench
from msa_iree.config import DTYPES
from msa_iree.runtime import KernelLibrary, SparseAttention


def spread_tables(c, blocks, rotations, seed=5):
    """Each rotation's table: distinct blocks drawn from the whole pool of `blocks`."""
    g = torch.Generator(device=c.q.device).manual_seed(seed)
    rows, cols = c.block_table.shape
    return torch.stack([torch.randperm(blocks, generator=g, device=c.q.device)[:rows * cols].reshape(rows, cols).int()
                        for _ in range(rotations)])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--kv-dtype", default="fp8_e4m3fn,bf16")
    p.add_argument("--pool-gib", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cases", default="4k,spread,128k", help="which of the three, in this order, in this process")
    a = p.parse_args()
    cases = {"4k": (4096, None), "spread": (4096, a.pool_gib << 30), "128k": (131072, None)}
    lib = KernelLibrary("cuda", a.build_dir, compile_missing=False)
    dev = torch.device("cuda")
    for kv in a.kv_dtype.split(","):
        for ctx, pool in (cases[name] for name in a.cases.split(",")):
            extra = {"pool_bytes": pool} if pool else {}
            c = bench.DecodeCase(a.batch, ctx, 1, 16, DTYPES[kv], dev, 16, seed=a.batch * 31 + 1, **extra)
            blocks = c.k_cache.shape[0] // 16
            if pool:
                c.bt_rot = spread_tables(c, blocks, c.bt_rot.shape[0])
                c.block_table = c.bt_rot[0].contiguous()
            attn = SparseAttention(16, 1, 128, 128 ** -0.5, DTYPES[kv], kernels=lib)
            out = torch.full_like(c.q, float("nan"))
            us = sorted(bench.graph_us(lib, dev, c, attn, out, 20) for _ in range(a.repeats))
            pool_mib = blocks * 2 * 128 * 128 * DTYPES[kv].itemsize >> 20
            how = "each forward's blocks drawn from all of it" if pool else "as msa-iree bench rotates"
            print(f"{kv} B={a.batch} ctx {ctx // 1024}K, pool {pool_mib} MiB, {how}: graph us "
                  + " ".join(f"{u:.2f}" for u in us), flush=True)


if __name__ == "__main__":
    main()
