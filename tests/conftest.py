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


@pytest.fixture
def page_table_checks(monkeypatch):
    """The calls of checks.check_page_table (the attend's check of a given page table, a host
    sync) during the test: one entry appended per call, the check then run as before."""
    from msa_iree import checks

    checked, check = [], checks.check_page_table
    monkeypatch.setattr(checks, "check_page_table", lambda *a, **kw: checked.append(1) or check(*a, **kw))
    return checked
