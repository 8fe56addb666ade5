import os
import pathlib

import pytest

# Compiled modules are content-addressed: reuse them across tests and runs (CI starts empty).
os.environ.setdefault("MSA_IREE_CACHE", str(pathlib.Path(__file__).resolve().parent.parent / "build" / "test-cache"))


@pytest.fixture(scope="session")
def host_kernels():
    from msa_iree.runtime import KernelLibrary

    return KernelLibrary("host", compile_missing=True, log=lambda msg: None)
