"""Where a serving step's host time goes, on one CUDA device (the serving step's cases, TP4 fp8).

- build: `MetadataBuilder.build` + sync in a loop of builds alone (the serving step's build_us
  interleaves it with 57 layers and reads higher), with --profile its cProfile top;
- a layer's bound calls at B=64 4K: insert_kv, forward, their bound launches alone, one kernel
  launch through ctypes (and through cuda-bindings when it is importable), the bound checks;
  then forward(key=, value=) (the insert inside the attend's launch), its bound launch alone and
  with --profile its cProfile top;
- with --profile, the cProfile top of ten mixed steps after a first one (each a build and 57
  layers' bound calls).

Host times are per call, medians over rounds of 57 calls (one sync a round).

    python -m benchmarks.host_profile --build-dir .devbuild/cuda [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import pstats
import statistics
import sys
import time

import torch

from msa_iree.runtime import KernelLibrary
from msa_iree.runtime.library import _current_raw_stream

from .bench import add_launch_args, launch_options
from .serving_step import ServingCase


def per_call_us(fn, reps=57, rounds=60) -> float:
    """Median over `rounds` of the host time of `reps` calls of fn, per call (a sync between rounds)."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def profile_top(fn, calls, top=15) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def build_rows(lib, device, profile):
    for batch, context, chunk in ((8, 4096, 0), (64, 4096, 0), (128, 4096, 0), (64, 131072, 0), (64, 4096, 2048)):
        case = ServingCase(lib, device, batch, context, 16, "fp8_e4m3fn", chunk, layers=1)
        build = lambda: (case.build(), torch.cuda.synchronize())
        print(f"build B={batch} ctx={context} prefill chunk={chunk}: {per_call_us(build, reps=1, rounds=300):.1f} us")
        if profile and batch == 64 and not chunk:
            print(profile_top(build, 300))
        del case
        torch.cuda.empty_cache()


def launch_rows(lib, device):
    case = ServingCase(lib, device, 64, 4096, 16, "fp8_e4m3fn", insert="separate")
    md = case.build()
    case.layers_call(md)
    c, layers = case.case, case.layers
    attn, k, v, out = layers[0]
    if attn._decode_launch is None or attn._insert_launch is None:
        raise RuntimeError("the layer's calls were not bound: a build without launch plans?")
    turn = [0]

    def layer():
        turn[0] += 1
        return layers[turn[0] % len(layers)]

    def insert():
        a, k, v, _ = layer()
        a.insert_kv(case.key, case.value, k, v, md, c.k_scale, c.v_scale)

    def forward():
        a, k, v, o = layer()
        a.forward(case.q, k, v, o, case.topk, md, c.k_scale, c.v_scale)

    stream = _current_raw_stream(device.index or 0)
    attend, writer = attn._decode_launch.launch, attn._insert_launch.launch
    q, topk, o, key, value = (t.data_ptr() for t in (case.q, case.topk, out, case.key, case.value))
    first = attend._launches[0]
    print(f"insert_kv + forward: {per_call_us(lambda: (insert(), forward())):.2f} us")
    print(f"insert_kv: {per_call_us(insert):.2f} us; forward: {per_call_us(forward):.2f} us")
    print(f"bound attend launch ({len(attend._launches)} kernels): {per_call_us(lambda: attend(stream, q, topk, o)):.2f} us;"
          f" bound insert launch: {per_call_us(lambda: writer(stream, key, value)):.2f} us")
    print(f"one kernel launch through ctypes ({'cuLaunchKernelEx' if first.config is not None else 'cuLaunchKernel'}): "
          f"{per_call_us(lambda: first.launch(attend._driver.lib, stream)):.2f} us")
    print(f"the bound attend's checks: {per_call_us(lambda: attn._decode_launch._serves(md, k, v, c.k_scale, c.v_scale)):.2f} us")
    try:
        from cuda.bindings import driver
    except ImportError:
        print("cuda-bindings: not installed (pip install cuda-bindings to compare its launch)")
    else:
        fn, hs = driver.CUfunction(init_value=first.fn.value), driver.CUstream(init_value=stream)
        args, g, b = ctypes.addressof(first.args), first.grid, first.block
        launch = lambda: driver.cuLaunchKernel(fn, g[0], g[1], g[2], b[0], b[1], b[2], first.shared, hs, args, 0)
        print(f"one kernel launch through cuda-bindings (cuLaunchKernel): {per_call_us(launch):.2f} us")
    del case
    torch.cuda.empty_cache()


def inserting_rows(lib, device, profile):
    """forward(key=, value=) at B=64 4K: one launch a layer (the insert inside the attend)."""
    case = ServingCase(lib, device, 64, 4096, 16, "fp8_e4m3fn", insert="forward")
    md = case.build()
    case.layers_call(md)
    c, layers = case.case, case.layers
    bound = layers[0][0]._decode_launch
    if bound is None or not bound.insert:
        raise RuntimeError("forward(key=, value=) was not bound to the inserting attend: a build without it?")
    turn = [0]

    def forward():
        turn[0] += 1
        a, k, v, o = layers[turn[0] % len(layers)]
        a.forward(case.q, k, v, o, case.topk, md, c.k_scale, c.v_scale, key=case.key, value=case.value)

    stream = _current_raw_stream(device.index or 0)
    ptrs = [t.data_ptr() for t in (case.q, case.topk, case.key, case.value, layers[0][3])]
    print(f"forward(key=, value=): {per_call_us(forward):.2f} us; its bound launch alone "
          f"({len(bound.launch._launches)} kernel): {per_call_us(lambda: bound.launch(stream, *ptrs)):.2f} us")
    if profile:
        print(profile_top(forward, 57 * 40))
    del case
    torch.cuda.empty_cache()


def mixed_profile(lib, device):
    case = ServingCase(lib, device, 64, 4096, 16, "fp8_e4m3fn", 2048)
    case.layers_call(case.build())

    def step():
        case.layers_call(case.build())
        torch.cuda.synchronize()

    print(profile_top(step, 10, top=25))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", required=True, help="a cuda build (tools/build_gpu_tests.py)")
    p.add_argument("--profile", action="store_true", help="add the cProfile tops (build, a mixed step's layers)")
    add_launch_args(p)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the host profile is taken on a CUDA device; none is visible")
    device = torch.device("cuda", 0)
    lib = KernelLibrary("cuda", a.build_dir, compile_missing=False, **launch_options(a))
    build_rows(lib, device, a.profile)
    launch_rows(lib, device)
    inserting_rows(lib, device, a.profile)
    if a.profile:
        mixed_profile(lib, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
