"""The vLLM plugin's tests (tests/vllm_plugin/) in the environment that has vLLM 0.33.0 installed: a
second virtual environment, since vLLM pins another torch. .ci/run makes it and names its Python
in MSA_IREE_VLLM_PYTHON; the recipe is there too."""
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_vllm_plugin_in_its_environment():
    python = os.environ.get("MSA_IREE_VLLM_PYTHON")
    if not python:
        pytest.skip("no vLLM environment: MSA_IREE_VLLM_PYTHON names none (.ci/run makes one)")
    r = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "vllm_plugin")],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    tail = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], tail
