"""Is one captured decode step's replay time stable, and does it follow the GPU's clocks?

Captures the bench's rotated graph of 57 decode forwards once (bench.decode_step_calls and
capture_step; fp8 e4m3fn by default) and measures it 12 times (median of 20 replays each), a 3 s
pause after the sixth, then again after 400
replays, printing nvidia-smi's SM and memory clocks, power, temperature and throttle reasons
beside each measurement. --graphs N: N captures of the same calls measured in turn, 4 rounds.

    python3 tools/graph_levels.py --build-dir .devbuild/cuda-cvt [--batch 64] [--context 4096]
"""
import argparse
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


def replay_us(graph, device):
    """A forward's share of one replay + sync, median of 20 (as the bench's graph_us)."""
    return bench.wall_us(graph.replay, 20, device) / LAYERS


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
    calls = bench.decode_step_calls(lib, dev, c, attn, out)
    graphs = [bench.capture_step(calls, LAYERS) for _ in range(a.graphs)]
    if a.graphs > 1:
        for r in range(4):
            print(f"round {r}: " + " ".join(f"{replay_us(g, dev):.2f}" for g in graphs), flush=True)
        return
    graph = graphs[0]
    print("idle:", smi(), flush=True)
    for i in range(12):
        print(f"{i:2d} {replay_us(graph, dev):.2f} us a forward | {smi()}", flush=True)
        if i == 5:
            time.sleep(3)
            print("after 3 s idle:", smi(), flush=True)
    for _ in range(400):
        graph.replay()
    torch.cuda.synchronize()
    print(f"after 400 replays: {replay_us(graph, dev):.2f} us a forward | {smi()}", flush=True)


if __name__ == "__main__":
    main()
