"""Is one captured decode step's replay time stable, and does it follow the GPU's clocks?

Captures the bench's rotated graph of 57 decode forwards once (bench.decode_step_calls and
capture_step; fp8 e4m3fn by default) and measures it 12 times (median of 20 replays each), a 3 s
pause after the sixth, then again after 400
replays, printing nvidia-smi's SM and memory clocks, power, temperature and throttle reasons
beside each measurement. --graphs N: N captures of the same calls measured in turn, 4 rounds.

    python3 tools/graph_levels.py --build-dir .devbuild/cuda-cvt [--batch 64] [--context 4096]
    python3 tools/graph_levels.py --build-dir .devbuild/cuda-cvt --graphs 2 --preallocate 24 --dependent-launch off
"""
import argparse
import statistics
import subprocess
import time

import torch

from msa_iree import bench
from msa_iree.runtime import KernelLibrary

LAYERS = 57


def smi():
    q = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()


def replay_us(graph, device):
    """A forward's share of one replay + sync, median of 20 (as the bench's graph_us)."""
    return bench.wall_us(graph.replay, 20, device) / LAYERS


def timings(graph, device, iree_call=None):
    """One graph three ways, a forward's share: wall time of a replay + sync (the bench's graph_us),
    CUDA events around a replay (device time only), and 10 replays back to back + one sync (the
    host's launch and wake-up amortised); with `iree_call`, again after one synchronous IREE call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def events():
        times = []
        for _ in range(20):
            start.record(); graph.replay(); end.record(); torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times) / LAYERS

    def batched():
        return bench.wall_us(lambda: [graph.replay() for _ in range(10)], 5, device) / (10 * LAYERS)

    rows = [("wall", lambda: replay_us(graph, device)), ("events", events), ("10 back to back", batched)]
    for when in ("", " after an IREE call") if iree_call else ("",):
        if when:
            iree_call()
        for name, fn in rows:
            print(f"{name + when:32s} " + " ".join(f"{fn():.2f}" for _ in range(5)), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_graph_case_args(p, context=4096)
    p.add_argument("--graphs", type=int, default=1,
                   help="capture this many graphs of the same calls and measure them in turn (is the level the capture's?)")
    p.add_argument("--timings", action="store_true",
                   help="one graph timed three ways (wall + sync, CUDA events, 10 replays + one sync), "
                        "then again after a synchronous IREE call: is the level the device's or the host's?")
    p.add_argument("--preallocate", type=float, default=0, metavar="GIB",
                   help="first allocate, write and free this many GiB in 1 GiB tensors (kept by torch's "
                        "caching allocator, as a bench run's earlier cases leave them): does the level follow?")
    p.add_argument("--empty-cache", action="store_true", help="... then return them to the driver")
    bench.add_launch_args(p)
    a = p.parse_args()
    lib = KernelLibrary("cuda", a.build_dir, compile_missing=False, **bench.launch_options(a))
    dev = torch.device("cuda")
    if a.preallocate:
        bench.write_and_free(dev, int(a.preallocate))  # freed into torch's cache, not to the driver
        if a.empty_cache:
            torch.cuda.empty_cache()
    c, attn, out, _ = bench._decode_setup(lib, dev, a.batch, a.context, 1, 16, a.kv_dtype, 16)
    calls = bench.decode_step_calls(lib, dev, c, attn, out)
    graphs = [bench.capture_step(calls, LAYERS) for _ in range(a.graphs)]
    if a.timings:
        spec, args, ws = bench.decode_module_operands(attn, c)
        timings(graphs[0], dev, lambda: lib.run(spec, *args, out=[out, ws]))
        return
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
