"""Build an A/B variant of a CUDA test build: the tensor-core attend with spec attributes changed.

How the tools/PERF.md experiments are run: copy a build made by tools/build_gpu_tests.py, rebuild
its mma attend modules (decode and prefill) with the given attributes overridden, then on the GPU
benchmark the two builds alternately in one device run, e.g.

    python tools/build_variant.py --base .devbuild/cuda --out .devbuild/cuda-c3 --set min_ctas_per_sm=3
    # on the H200:
    for v in cuda-c3 cuda cuda-c3 cuda; do
      python3 -m msa_iree.cli bench --build-dir .devbuild/$v --matrix auto --context 4096 --prefill \
          --json $OUT/bench_$v_$RANDOM.json; done

Attributes are those of msa_iree.kernels.SparseAttnDecodeMmaSpec (e.g. async_kv=True,
min_ctas_per_sm=3, hw_fp8=False); values are Python literals. The variant's modules are compiled
into their own cache (<out>.cache), so a variant never shares cached modules with the base.
Numbers from a variant say nothing about main until the change lands and tests/test_gpu.py passes.
"""
import argparse
import ast
import os
import pathlib
import shutil


def parse_set(item: str):
    name, sep, value = item.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--set: expected NAME=VALUE, got {item!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"--set {name}: expected a Python literal, got {value!r}") from None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=pathlib.Path, help="a build from tools/build_gpu_tests.py")
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--set", dest="overrides", action="append", type=parse_set, required=True, metavar="NAME=VALUE")
    ap.add_argument("--kv-dtype", default="bf16,fp8_e4m3fn")
    ap.add_argument("--heads", default="16,8", help="query heads per KV head")
    ap.add_argument("--L", default="1,4", help="decode query lengths")
    ap.add_argument("--no-prefill", action="store_true")
    args = ap.parse_args()

    os.environ["MSA_IREE_CACHE"] = str(args.out.resolve()) + ".cache"
    from msa_iree import compile as C
    from msa_iree import kernels as K
    from msa_iree.config import MsaConfig

    overrides = dict(args.overrides)
    for name in overrides:
        if not hasattr(K.SparseAttnDecodeMmaSpec, name):
            raise SystemExit(f"--set {name}: expected an attribute of SparseAttnDecodeMmaSpec, got none of that name")
    if not (args.base / "manifest.json").exists():
        raise SystemExit(f"--base: expected a build of tools/build_gpu_tests.py (with a manifest.json), got {args.base}")
    decode = type("Decode", (K.SparseAttnDecodeMmaSpec,), overrides)
    prefill = type("Prefill", (K.SparseAttnPrefillMmaSpec,), overrides)
    probe = MsaConfig(kv_dtype=args.kv_dtype.split(",")[0])
    if C.content_key(decode(probe, 16), "cuda") == C.content_key(K.SparseAttnDecodeMmaSpec(probe, 16), "cuda"):
        # the build would skip every module as unchanged: the default already, or an attribute
        # that describe() leaves out (the content key hashes describe(), not the rendered text)
        raise SystemExit(f"--set {overrides}: changes nothing the build sees (the default already, or an "
                         "attribute missing from SparseAttnDecodeGpuSpec.describe())")
    specs = []
    for kv in args.kv_dtype.split(","):
        for heads in (int(h) for h in args.heads.split(",")):
            cfg = MsaConfig(kv_dtype=kv, num_heads=heads)
            specs += [decode(cfg.replace(decode_query_len=int(L)), 16) for L in args.L.split(",")]
            if not args.no_prefill and heads == 16:
                specs.append(prefill(cfg, 16))
    if args.out.exists():
        shutil.rmtree(args.out)
    shutil.copytree(args.base, args.out)
    C.build(None, ["cuda"], args.out, specs=specs, log=print)
    print(f"{args.out}: {len(specs)} mma attend modules rebuilt with {overrides}")


if __name__ == "__main__":
    main()
