"""Compile the cuda modules that tests/test_gpu.py and the benchmark call, into one build dir.

Run here (the compiler lives on the CPU machine), then carry the directory to the GPU machine:

    python tools/build_gpu_tests.py --out .devbuild/cuda
    # on the GPU machine (see tools/GPU.md):
    MSA_IREE_CUDA_BUILD=.devbuild/cuda python -m pytest -q tests/test_gpu.py
    python -m benchmarks.bench --build-dir .devbuild/cuda --json bench.json --plot bench.png
"""
import argparse
import pathlib
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent / d) for d in ("", "tests")]

from benchmarks.bench import bench_specs  # noqa: E402
from benchmarks.indexer import bench_specs as indexer_bench_specs  # noqa: E402
from gpu_cases import gpu_test_specs  # noqa: E402
from msa_iree.compile import build  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="build/cuda-tests")
    p.add_argument("--target", default="cuda")
    p.add_argument("--no-bench", action="store_true", help="only the test kernels")
    a = p.parse_args()
    specs = gpu_test_specs() + ([] if a.no_bench else bench_specs() + indexer_bench_specs())
    build(None, [a.target], a.out, specs=list({s.name: s for s in specs}.values()))


if __name__ == "__main__":
    main()
