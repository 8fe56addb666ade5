"""Where one `SparseAttention.forward` call's wall time goes on a CUDA device (decode, bf16).
Also the KV insert's host time for the same step (each token's K/V written into the cache).

With a build that saved launch plans, forward launches on torch's stream (msa_iree.runtime.cuda_launch) and
the forward rows are its host time, one call's latency (+ sync) and the per-call time of a decode
step's 57 calls back to back; the IREE rows call the same module through IREE's runtime.

Times each step of the call path separately (median of many, host clock, the device idle at the
start of each timed call): the DLPack export and IREE import of one tensor, the torch stream
sync, the module invocation on prebuilt buffer views (kernel + IREE's own cost: IREE's sync
invocation waits for the result), `lib.run` (imports + invocation) and the whole `forward`
(checks + imports + invocation). Kernel time comes from `python -m benchmarks.bench`.

    python3 -m benchmarks.call_overhead --build-dir .devbuild/cuda [--batch 64] [--heads 16]
"""
import argparse
import statistics
import time

import torch
import torch.utils.dlpack

from benchmarks.bench import (Flushes, _decode_setup, add_launch_args, capture_step, launch_options,
                            decode_module_operands, serving_step_calls, wall_us)
from msa_iree.layout import num_cache_blocks
from msa_iree.runtime import KernelLibrary, MetadataBuilder, insert_kv


def median_us(fn, iters=200, sync=True):
    times = []
    for _ in range(iters):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def insert_rows(lib, c, attn, dev, layers):
    """The KV insert of the step's new tokens (their slots from the block table, range-checked once
    by the builder given the cache's size): runtime.insert_kv (every check, every call) and the
    layer's SparseAttention.insert_kv (its later calls bound): host time, and a step's worth back to
    back + sync."""
    builder = MetadataBuilder(max_num_seqs=c.batch, max_model_len=c.context, kernels=lib, device=dev,
                              num_cache_blocks=num_cache_blocks(c.k_cache, c.v_cache))
    qsl = torch.arange(0, c.batch + 1, dtype=torch.int32, device=dev)
    md = builder.build(c.block_table, c.seq_lens, qsl, c.seq_lens - 1, decode_query_len=1, num_decodes=c.batch,
                       slot_mapping=c.last_token_slots)
    g = torch.Generator(device=dev).manual_seed(3)
    key = torch.randn(c.batch, 1, 128, generator=g, device=dev).to(torch.bfloat16)
    value = torch.randn(c.batch, 1, 128, generator=g, device=dev).to(torch.bfloat16)
    free = lambda: insert_kv(lib, key, value, c.k_cache, c.v_cache, md, c.k_scale, c.v_scale)
    bound = lambda: attn.insert_kv(key, value, c.k_cache, c.v_cache, md, c.k_scale, c.v_scale)
    rows = {}
    for name, ins in (("runtime.insert_kv", free), ("SparseAttention.insert_kv", bound)):
        ins()

        def step():
            for _ in range(layers):
                ins()
            torch.cuda.synchronize()

        rows[f"{name}, host time"] = median_us(ins)
        rows[f"{layers} x {name} + sync, per call"] = median_us(step, iters=20) / layers
    return bound, rows


def serving_rows(lib, c, attn, dev, layers):
    """A decode step as serving runs it (bench.serving_step_calls: one step's metadata, each layer
    its own SparseAttention over its own slice of the pool, so every forward reads its K/V from
    DRAM): back to back + one sync, per call; then the same step captured in a CUDA graph."""
    calls = serving_step_calls(lib, dev, c, attn, layers)

    def step():
        for call in calls:
            call()
        torch.cuda.synchronize()

    graph = capture_step(calls, layers)
    return {f"{layers} forwards over the layers' own caches + sync, per call (serving, K/V from DRAM)":
                median_us(step, iters=20) / layers,
            "the same step in a CUDA graph, replay + sync, per call":
                median_us(lambda: (graph.replay(), torch.cuda.synchronize()), iters=20) / layers}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build-dir", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-dtype", default="bf16")
    add_launch_args(p)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile N forward (and insert_kv) calls (cProfile): the 20 costliest functions")
    a = p.parse_args()
    dev = torch.device("cuda")
    lib = KernelLibrary("cuda", a.build_dir, compile_missing=False, **launch_options(a))
    c, attn, out, fwd = _decode_setup(lib, dev, a.batch, 4096, 1, a.heads, a.kv_dtype, rotations=1)
    fwd()
    spec, inputs, ws = decode_module_operands(attn, c)
    args = [*inputs, out, ws]
    views = [lib.to_iree(t) for t in args]
    fn = lib.function(spec)
    device = lib.config.device
    cap = lambda: torch.utils.dlpack.to_dlpack(c.q)
    streamed = lib.stream_kernel(spec) is not None
    rows = {
        "to_dlpack (1 tensor)": median_us(cap),
        "to_dlpack + IREE import (1 tensor)": median_us(lambda: device.from_dlpack_capsule(cap())),
        "torch stream sync, idle": median_us(lambda: torch.cuda.current_stream().synchronize()),
        "invoke, prebuilt views (kernel + IREE)": median_us(lambda: fn(*views)),
        ("lib.run, stream launch (host time)" if streamed else "lib.run (11 imports + invoke)"):
            median_us(lambda: lib.run(spec, *args[:-2], out=args[-2:])),
    }
    if not streamed:
        rows["forward (checks + 5 imports + invoke)"] = median_us(fwd)
    else:
        # forward launches on torch's stream (msa_iree.runtime.cuda_launch): it returns once the kernels are
        # queued, so its host time, one call's latency and a serving step's per-call time differ
        layers = 57  # sparse layers per MiniMax-M3 decode step

        def step():
            for _ in range(layers):
                fwd()
            torch.cuda.synchronize()

        # one block table: a call after a call finds its K/V in the L2 (warm), unless flushed
        rows.update({"forward on the stream, host time": median_us(fwd),
                     "forward on the stream + sync (latency, warm L2)":
                         median_us(lambda: (fwd(), torch.cuda.synchronize())),
                     "forward on the stream + sync (latency, L2 flushed)": wall_us(fwd, 200, dev, Flushes(dev).clean),
                     f"{layers} forwards back to back + sync, per call": median_us(step, iters=20) / layers})
        # how vLLM runs decode: the step captured once in a CUDA graph, then replayed
        graph = capture_step([fwd], layers)
        rows[f"CUDA graph of {layers} forwards, replay + sync, per call"] = \
            median_us(lambda: (graph.replay(), torch.cuda.synchronize()), iters=20) / layers
        rows.update(serving_rows(lib, c, attn, dev, layers))
        ins, ins_rows = insert_rows(lib, c, attn, dev, layers)
        rows.update(ins_rows)
    print(f"decode B={a.batch} heads={a.heads} kv={a.kv_dtype}, dependent launch {lib.dependent_launch}, "
          "host-clock medians:")
    for k, v in rows.items():
        print(f"  {k:42s} {v:8.1f} us")
    if a.profile:
        import cProfile
        import pstats

        for name, call in (("forward", fwd), ("insert_kv", ins if streamed else None)):
            if call is None:
                continue
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.profile):
                call()
            prof.disable()
            print(f"-- {name}, {a.profile} calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
