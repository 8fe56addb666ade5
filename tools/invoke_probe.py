"""Two runtime probes behind tools/PERF.md's per-call numbers (CUDA).

1. What an IREE invocation costs when the module allocates vs when it writes in place: the
   in-place GPU insert (1 dispatch, no allocation), the portable page-16 rebase (1 dispatch, an
   allocated result) and the GPU attend (2 dispatches, caller's workspace), each called
   synchronously on prebuilt buffer views.
2. Whether an asynchronous (coarse-fences) invocation followed by `torch.cuda.synchronize()`
   (instead of waiting on IREE's fence) leaves complete outputs: it does not (PERF.md).

On the CPU machine, build the GPU test modules and the coarse-fences twin of the attend:

    python tools/build_gpu_tests.py --out .devbuild/cuda
    python tools/invoke_probe.py --build-async .devbuild/async

on the GPU machine (see GPU.md for the runtime wheel):

    python3 tools/invoke_probe.py --build-dir .devbuild/cuda --async-dir .devbuild/async
"""
import argparse
import pathlib
import statistics
import time

import torch

ASYNC_FLAGS = ["--iree-execution-model=async-external"]


def _attend_spec():
    from msa_iree.config import MsaConfig
    from msa_iree.kernels import SparseAttnDecodeMmaSpec

    return SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype="bf16"), 16)


def build_async(out):
    from msa_iree.compile import compiled_module

    spec = _attend_spec()
    vmfb, _, _ = compiled_module(spec, "cuda", extra_flags=ASYNC_FLAGS)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{spec.name}.vmfb").write_bytes(vmfb)
    print(f"wrote {out / spec.name}.vmfb")


def median_us(fn, iters=200):
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def probe(build_dir, async_dir):
    import iree.runtime as rt

    from msa_iree.bench import _decode_setup, decode_module_operands
    from msa_iree.config import MsaConfig
    from msa_iree.kernels import InsertKvGpuSpec, RebaseBlockTableSpec
    from msa_iree.layout import allocate_kv_cache
    from msa_iree.runtime import KernelLibrary

    dev = torch.device("cuda")
    lib = KernelLibrary("cuda", build_dir, compile_missing=False)
    for batch in (8, 64):
        c, attn, out, fwd = _decode_setup(lib, dev, batch, 4096, 1, 16, "bf16", rotations=1)
        fwd()
        torch.cuda.synchronize()
        ref = out.clone()
        spec, inputs, ws = decode_module_operands(attn, c)
        views = [lib.to_iree(t) for t in (*inputs, out, ws)]
        attend = lib.function(spec)
        print(f"B={batch}: attend (2 dispatches, caller's workspace) sync invoke {median_us(lambda: attend(*views)):.1f} us")

        # the coarse-fences twin: [inputs..., wait fence, signal fence]
        ctx = rt.SystemContext(config=lib.config)
        vmfb = (pathlib.Path(async_dir) / f"{spec.name}.vmfb").read_bytes()
        ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
        afn = ctx.modules.module["main"].vm_function
        sem = lib.config.device.create_semaphore(0)
        count = [0]

        def invoke_async():
            count[0] += 1
            args = rt.VmVariantList(len(views) + 2)
            for v in views:
                args.push_ref(v)
            args.push_ref(rt.HalFence(1))  # empty: nothing to wait for
            args.push_ref(rt.HalFence.create_at(sem, count[0]))
            ctx.vm_context.invoke(afn, args, rt.VmVariantList(2))

        print(f"B={batch}: async invoke, host part {median_us(invoke_async):.1f} us")
        wrong = 0
        for _ in range(300):
            out.fill_(float("nan"))
            torch.cuda.synchronize()
            invoke_async()
            torch.cuda.synchronize()
            wrong += not torch.equal(out, ref)
        sem.wait(count[0])
        print(f"B={batch}: outputs incomplete after async invoke + torch.cuda.synchronize: {wrong}/300")

    # in place vs allocating, one dispatch each
    kc, _ = allocate_kv_cache(64, 1, torch.bfloat16, device=dev)
    row = kc[0].numel()
    raw = torch.as_strided(kc, (16 * 64, row), (row, 1))
    key = torch.randn(64, 1, 128, device=dev, dtype=torch.bfloat16)
    tok = torch.arange(64, dtype=torch.int32, device=dev)
    ones = torch.ones(1, 1, device=dev)
    insert = InsertKvGpuSpec(MsaConfig(kv_dtype="bf16"), 16)
    iviews = [lib.to_iree(t) for t in (raw, key, key.clone(), tok, tok * 3, ones, ones)]
    fi = lib.function(insert)
    rviews = [lib.to_iree(c.block_table)]
    fr = lib.function(RebaseBlockTableSpec(MsaConfig()))
    print(f"insert (1 dispatch, in place) sync invoke {median_us(lambda: fi(*iviews)):.1f} us")
    print(f"rebase (1 dispatch, allocated result) sync invoke {median_us(lambda: fr(*rviews)):.1f} us")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build-async", metavar="DIR", help="CPU machine: compile the coarse-fences attend into DIR")
    p.add_argument("--build-dir", help="GPU machine: the cuda test build")
    p.add_argument("--async-dir", help="GPU machine: where --build-async wrote the coarse-fences attend")
    a = p.parse_args()
    if a.build_async:
        build_async(a.build_async)
    elif a.build_dir and a.async_dir:
        probe(a.build_dir, a.async_dir)
    else:
        p.error("expected --build-async DIR (CPU machine) or --build-dir and --async-dir (GPU machine)")


if __name__ == "__main__":
    main()
