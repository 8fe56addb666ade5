"""Is the rotated graph's lower level a process's first case?

In `msa-iree bench`'s full runs fp8 B=64 measures ~0.8-1 us a forward slower in the rotated
graph than in a process of its own (tools/PERF.md, twelfth session). This builds the bench's case
(fp8 e4m3fn by default, B=64, TP4, L=1) and measures its graph (three captures, each the median of
20 replays) as the process's first case, then the same case built again, after other cases (the
bench's bf16 decode cases through `bench.bench_decode`), after `torch.cuda.empty_cache()` and after
an idle pause. --shared-pool captures every graph into one memory pool
(`torch.cuda.graph_pool_handle()`) instead of a pool per graph: does the level follow the pools?
--carve GIB allocates GIB at the process's start and carves every case's KV cache out of its
first bytes, as a serving engine carves its layers' caches out of one allocation made once: does
the level follow the cache's memory? --keep keeps every case's tensors and graphs alive, so that
a later case's small tensors (query, output, top-k, step metadata, workspace) take fresh memory
instead of the earlier case's freed blocks and no graph is destroyed before the last: does the
level follow their reuse, or the graphs' destruction? Last, the first case again, kept alive: its
own graphs replayed, graphs captured anew from its calls (the same step metadata and bound
launches), and graphs over new step metadata for its tensors: does the level follow the graph,
the step's metadata and launches, or the case's tensors? --prelude does one part of a case's
work (or a torch graph, or 8 GiB written) before the first case: which part makes the next case
slow? Each row gives the bench's wall time (replay + sync) and CUDA events' (device time only).
(Thirteenth session: the level follows the non-graph work run before a replay, tools/graph_state.py.)

    python3 tools/graph_history.py --build-dir .devbuild/cuda-st12 [--context 131072] [--shared-pool] [--carve 8]
        [--keep] [--prelude torch-graph] [--stop-after-second] [--dependent-launch off]
"""
import argparse
import time

import torch

from msa_iree import bench
from msa_iree import layout
from msa_iree.runtime import KernelLibrary


LAYERS = 57


def carve_caches(storage):
    """bench.allocate_kv_cache's stand-in: the cache's raw buffer from `storage`'s first bytes."""
    def allocate(num_blocks, num_kv_heads, dtype, layout_name="interleaved", device=None, fill=None):
        rows = num_blocks * layout.PAGES_PER_BLOCK * layout.SIDES_PER_BLOCK
        cols = num_kv_heads * layout.PAGE_SIZE * layout.HEAD_DIM
        nbytes = rows * cols * dtype.itemsize
        if nbytes > storage.numel():
            raise ValueError(f"--carve: the case's cache needs {nbytes >> 20} MiB, the storage holds {storage.numel() >> 20}")
        raw = storage[:nbytes].view(dtype).view(rows, cols)
        return layout._views(raw, num_blocks, num_kv_heads, layout_name)  # the layout's own views
    return allocate


PRELUDES = ("none", "alloc", "torch-graph", "metadata", "forward", "calls", "bf16-forward")


def prelude(name, lib, dev, a):
    """Work done before the first case (`a`: the tool's arguments), its tensors dropped: "alloc"
    writes and frees 8 GiB; "torch-graph" captures and replays a graph of torch adds; "metadata"
    builds the case's tensors and step metadata (IREE calls); "forward" adds one forward; "calls"
    the 16 steps' forwards (all a capture is made of, but the capture); "bf16-forward" one forward
    of a bf16 B=8 case (another module's kernels)."""
    if name == "alloc":
        bench.write_and_free(dev, 8)
    elif name == "torch-graph":
        x = torch.zeros(1 << 20, device=dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(LAYERS):
                x.add_(1)
        for _ in range(20):
            g.replay()
    elif name in ("metadata", "forward", "calls"):
        c, attn, out, fwd = bench._decode_setup(lib, dev, a.batch, a.context, 1, 16, a.kv_dtype, 16)
        if name == "forward":
            fwd()
        if name == "calls":
            bench.decode_step_calls(lib, dev, c, attn, out)
    elif name == "bf16-forward":
        bench._decode_setup(lib, dev, 8, 4096, 1, 16, "bf16", 16)[3]()
    torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_graph_case_args(p, context=131072)
    p.add_argument("--shared-pool", action="store_true", help="every capture into one graph memory pool")
    p.add_argument("--keep", action="store_true", help="keep every case's tensors alive (no memory reused)")
    p.add_argument("--prelude", choices=PRELUDES, default="none",
                   help="done (and dropped) before the first case: which part of a case makes the next one slow?")
    p.add_argument("--stop-after-second", action="store_true", help="only the first two levels")
    p.add_argument("--carve", type=int, default=0, metavar="GIB",
                   help="every case's KV cache carved out of one allocation of GIB made first")
    bench.add_launch_args(p)
    a = p.parse_args()
    if a.carve:
        bench.allocate_kv_cache = carve_caches(torch.empty(a.carve << 30, dtype=torch.uint8, device="cuda"))
    lib = KernelLibrary("cuda", a.build_dir, compile_missing=False,
                        **bench.launch_options(a))
    dev = torch.device("cuda")
    flushes = bench.Flushes(dev)
    pool = torch.cuda.graph_pool_handle() if a.shared_pool else None
    kept = []

    def show(when, graphs):
        us = sorted(bench.wall_us(g.replay, 20, dev) / LAYERS for g, _ in graphs)
        device_us = sorted(bench.events_us(g.replay, 20, dev) / LAYERS for g, _ in graphs)
        print(f"{when:44s} graph us " + " ".join(f"{u:.2f}" for u in us)
              + " | events " + " ".join(f"{u:.2f}" for u in device_us)
              + f"  (torch holds {torch.cuda.memory_reserved() / 2 ** 30:.1f} GiB)", flush=True)

    def capture(case, calls=None):
        """Three captures, as bench.graph_us: each over new step metadata unless `calls` is given."""
        c, attn, out = case
        graphs = []  # (graph, its calls: the step metadata it reads)
        for _ in range(3):
            step = calls or bench.decode_step_calls(lib, dev, c, attn, out)
            graphs.append((bench.capture_step(step, LAYERS, pool), step))
        return graphs

    def level(when):
        case = bench._decode_setup(lib, dev, a.batch, a.context, 1, 16, a.kv_dtype, 16)[:3]
        graphs = capture(case)
        show(when, graphs)
        if a.keep:
            kept.append((case, graphs))
        return case, graphs

    prelude(a.prelude, lib, dev, a)
    print(f"{a.kv_dtype} B={a.batch} TP4 L=1 ctx {a.context // 1024}K, rotated graph, a forward's share"
          + (", one graph pool" if a.shared_pool else "") + (f", caches carved from {a.carve} GiB" if a.carve else "")
          + (", every case kept alive" if a.keep else ""))
    first = level("first case of the process")
    level("the same case built again")
    if a.stop_after_second:
        return
    for ctx in (4096, 131072):
        for b in (8, 32, 64, 128):
            bench.bench_decode(lib, dev, b, ctx, 1, 16, "bf16", 20, flushes=flushes)
    level("after 8 bf16 cases (bench_decode)")
    torch.cuda.empty_cache()
    level("after torch.cuda.empty_cache()")
    time.sleep(2)
    level("after 2 s idle")
    case, graphs = first
    show("first case: its own graphs, replayed last", graphs)
    show("first case: its calls captured again", capture(case, graphs[0][1]))
    show("first case: new step metadata, captured", capture(case))


if __name__ == "__main__":
    main()
