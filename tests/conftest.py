import importlib.util
import os
import pathlib

import pytest

# Compiled modules are content-addressed: reuse them across tests and runs (CI starts empty).
os.environ.setdefault("MSA_IREE_CACHE", str(pathlib.Path(__file__).resolve().parent.parent / "build" / "test-cache"))

# tests/vllm_plugin/ runs where vLLM is installed (its own environment: tests/test_vllm_env.py runs it there)
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_plugin"]


@pytest.fixture(scope="session")
def host_kernels():
    from msa_iree.runtime import KernelLibrary

    return KernelLibrary("host", compile_missing=True, log=lambda msg: None)
