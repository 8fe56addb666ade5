"""Compile the cuda modules that tests/test_gpu.py and `msa-iree bench` call, into one build dir.

Run here (the compiler lives on the CPU machine), then carry the directory to the GPU machine:

    python tools/build_gpu_tests.py --out .devbuild/cuda
    # on the GPU machine (see tools/GPU.md):
    MSA_IREE_CUDA_BUILD=.devbuild/cuda python -m pytest -q tests/test_gpu.py
    python -m msa_iree.cli bench --build-dir .devbuild/cuda --json bench.json --plot bench.png
"""
import argparse

from benchmarks.bench import bench_specs
from msa_iree.compile import build
from msa_iree.testing import gpu_test_specs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="build/cuda-tests")
    p.add_argument("--target", default="cuda")
    p.add_argument("--no-bench", action="store_true", help="only the test kernels")
    a = p.parse_args()
    specs = gpu_test_specs() + ([] if a.no_bench else bench_specs())
    build(None, [a.target], a.out, specs=list({s.name: s for s in specs}.values()))


if __name__ == "__main__":
    main()
