"""Is one captured decode step's replay time stable, and does it follow the GPU's clocks?

Captures the bench's rotated graph of 57 decode forwards once (fp8 e4m3fn by default) and measures
it 12 times (median of 20 replays each), a 3 s pause after the sixth, then again after 400
replays, printing nvidia-smi's SM and memory clocks, power, temperature and throttle reasons
beside each measurement. --graphs N: N captures of the same calls measured in turn, 4 rounds.

    python3 tools/graph_levels.py --build-dir .devbuild/cuda-cvt [--batch 64] [--context 4096]
"""
import argparse
import statistics
import subprocess
import time

import torch

from msa_iree import bench
from msa_iree.config import DTYPES
from msa_iree.runtime import KernelLibrary, SparseAttention

LAYERS = 57


def smi():
    q = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()


def replay_us(graph, iters=20):
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6 / LAYERS


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--kv-dtype", default="fp8_e4m3fn")
    p.add_argument("--graphs", type=int, default=1,
                   help="capture this many graphs of the same calls and measure them in turn (is the level the capture's?)")
    a = p.parse_args()
    lib = KernelLibrary("cuda", a.build_dir, compile_missing=False)
    dev, dtype = torch.device("cuda"), DTYPES[a.kv_dtype]
    c = bench.DecodeCase(a.batch, a.context, 1, 16, dtype, dev, 16, seed=a.batch * 31 + 1)
    attn = SparseAttention(16, 1, 128, 128 ** -0.5, dtype, kernels=lib)
    out = torch.full_like(c.q, float("nan"))
    steps = bench._decode_metadata(lib, dev, c, [bt.contiguous() for bt in c.bt_rot])
    calls = [lambda md=md: attn.forward(c.q, c.k_cache, c.v_cache, out, c.topk, md, c.k_scale, c.v_scale)
             for md in steps]
    for call in calls:
        call()
    torch.cuda.synchronize()
    graphs = []
    for _ in range(a.graphs):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(LAYERS):
                calls[i % len(calls)]()
        graphs.append(graph)
    if a.graphs > 1:
        for r in range(4):
            print(f"round {r}: " + " ".join(f"{replay_us(g):.2f}" for g in graphs), flush=True)
        return
    graph = graphs[0]
    print("idle:", smi(), flush=True)
    for i in range(12):
        print(f"{i:2d} {replay_us(graph):.2f} us a forward | {smi()}", flush=True)
        if i == 5:
            time.sleep(3)
            print("after 3 s idle:", smi(), flush=True)
    for _ in range(400):
        graph.replay()
    torch.cuda.synchronize()
    print(f"after 400 replays: {replay_us(graph):.2f} us a forward | {smi()}", flush=True)


if __name__ == "__main__":
    main()
