"""Which work, run outside a CUDA graph, changes how fast the graph replays?

tools/graph_history.py found a decode step's graph replaying ~0.7 us a forward faster as a
process's first case than later (fp8 B=64, 13.4 vs 14.1-14.4 us). This captures the bench's case
(fp8 e4m3fn B=64 TP4 L=1 by default) as one rotated step graph of 57 forwards, times its replays
(wall time of a replay + sync, as the bench, and CUDA events: device time only), then runs each
action of --actions in turn, outside the graph, and times the same graph's replays again. With
--profile, each timing also reads one replay's kernels from CUPTI (torch.profiler): the @split and
@merge durations and the gaps between consecutive kernels (medians and means), a gap negative where
a programmatic dependent launch (PDL) started a kernel before the one it waits on had ended
(CUPTI, once attached, slows the later wall and events timings themselves: see the profile
action). --history first runs what a full bench run runs before its fp8 cases. --long also times a graph of 4 x 57 forwards, which
splits a forward's share into a per-forward and a per-replay part.

Actions: idle (0.5 s), torch-add (one tiny torch kernel), torch-sort (a torch.sort of 1M floats,
as a sampler's), fill (4 GiB allocated and written, kept), empty-cache, forward (one forward of
the case launched outside the graph), capture (the same calls captured into another graph, kept),
profile (one forward outside the graph under torch.profiler's CUDA activity, as the bench's
kernel-time pass: from then on the graph replays ~1 us a forward slower and a forward no longer
brings the fast level back, tools/PERF.md).

    python3 tools/graph_state.py --build-dir .devbuild/cuda --profile
    python3 tools/graph_state.py --build-dir .devbuild/cuda --actions torch-sort,forward,forward
    python3 tools/graph_state.py --build-dir .devbuild/cuda --history --profile --actions forward
"""
import argparse
import statistics
import time

import torch

from msa_iree import bench
from msa_iree.runtime import KernelLibrary


LAYERS = 57
ACTIONS = ("idle", "torch-add", "torch-sort", "fill", "empty-cache", "forward", "capture", "profile")
DEFAULT_ACTIONS = "idle,torch-add,forward,torch-sort,forward,fill,forward,forward,capture,forward,torch-sort,empty-cache,forward"


def kernel_gaps(graph):
    """One replay's kernels from CUPTI: (@split us, @merge us, gap after a @split, gap after a
    @merge: medians; then the same means); a gap is the next kernel's start minus this one's end."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)[-2 * LAYERS:]  # the last replay
    durations = lambda name: [end - start for start, end, n in kernels if n == name]
    gaps = lambda name: [kernels[i + 1][0] - kernels[i][1] for i in range(len(kernels) - 1) if kernels[i][2] == name]
    samples = (durations("split"), durations("merge"), gaps("split"), gaps("merge"))
    return tuple(statistics.median(x) for x in samples) + tuple(statistics.mean(x) for x in samples)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_graph_case_args(p, context=131072)
    p.add_argument("--actions", default=DEFAULT_ACTIONS)
    p.add_argument("--history", action="store_true",
                   help="first run what a full bench run runs before its fp8 cases (every bf16 decode case "
                        "and the bf16 prefill, first pass): the level in a long process")
    p.add_argument("--long", action="store_true",
                   help="also a graph of 4 x 57 forwards: a replay's fixed cost (launch to first kernel, last "
                        "kernel to sync) from the two per-forward times")
    p.add_argument("--profile", action="store_true", help="also each replay's kernel durations and gaps (CUPTI)")
    bench.add_launch_args(p)
    a = p.parse_args()
    unknown = [name for name in a.actions.split(",") if name not in ACTIONS]
    if unknown:
        p.error(f"--actions: expected some of {', '.join(ACTIONS)}, got {', '.join(map(repr, unknown))}")
    lib = KernelLibrary("cuda", a.build_dir, compile_missing=False,
                        **bench.launch_options(a))
    dev = torch.device("cuda")
    if a.history:  # `msa-iree bench --matrix auto --prefill --iters 20`'s bf16 pass, its defaults
        for _ in bench.dtype_rows(lib, dev, "bf16", (16, 8), (1, 4), (4096, 32768, 131072), (8, 32, 64, 128), 20,
                                  prefill=True, flushes=bench.Flushes(dev)):
            pass
    c, attn, out, _ = bench._decode_setup(lib, dev, a.batch, a.context, 1, 16, a.kv_dtype, 16)
    calls = bench.decode_step_calls(lib, dev, c, attn, out)
    graph = bench.capture_step(calls, LAYERS)
    long_graph = bench.capture_step(calls, 4 * LAYERS) if a.long else None
    kept = []  # what the actions allocate, alive to the end
    tiny, keys = torch.zeros(1024, device=dev), torch.rand(1 << 20, device=dev)

    def fill():
        kept.append(torch.empty(4 << 30, dtype=torch.uint8, device=dev).fill_(1))

    actions = {"idle": lambda: time.sleep(0.5), "torch-add": lambda: tiny.add_(1),
               "torch-sort": lambda: kept.append(torch.sort(keys)), "fill": fill,
               "empty-cache": torch.cuda.empty_cache, "forward": calls[0],
               "capture": lambda: kept.append(bench.capture_step(calls, LAYERS)),
               "profile": lambda: bench.kernel_us(calls[0], dev, iters=1)}
    assert set(actions) == set(ACTIONS)

    def show(when):
        wall = bench.wall_us(graph.replay, 20, dev) / LAYERS
        device = bench.events_us(graph.replay, 20, dev) / LAYERS
        line = f"{when:28s} wall {wall:6.2f} events {device:6.2f} us a forward"
        if long_graph is not None:
            long_device = bench.events_us(long_graph.replay, 20, dev) / (4 * LAYERS)
            fixed = (device - long_device) / (1 / LAYERS - 1 / (4 * LAYERS))  # t(n) = forward + fixed / n
            line += f" | 4 x 57: events {long_device:6.2f}, so {long_device - fixed / (4 * LAYERS):.2f} a forward + {fixed:.0f} a replay"
        if a.profile:
            line += (" | median: split {:.2f} merge {:.2f} gap after split {:+.2f} after merge {:+.2f}"
                     " | mean: {:.2f} {:.2f} {:+.2f} {:+.2f}").format(*kernel_gaps(graph))
        print(line, flush=True)

    print(f"{a.kv_dtype} B={a.batch} TP4 L=1 ctx {a.context // 1024}K, one rotated step graph, a forward's share")
    show("captured")
    for name in a.actions.split(","):
        actions[name]()
        torch.cuda.synchronize()
        show(f"after {name}")


if __name__ == "__main__":
    main()
