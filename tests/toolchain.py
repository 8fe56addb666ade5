"""NVIDIA's assembler for the tests that check what ptxas makes of the generated PTX (registers,
spills, that sm_90 accepts it): `ptxas` on PATH, else the one the test extra installs from PyPI
(nvidia-cuda-nvcc-cu12, pyproject.toml), so that CI runs these tests on its CPU machine."""
import importlib.util
import os
import shutil


def ptxas() -> str | None:
    """The path of a ptxas to run, or None where neither is installed."""
    found = shutil.which("ptxas")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia.cuda_nvcc") if importlib.util.find_spec("nvidia") else None
    for root in (spec.submodule_search_locations if spec else []):
        path = os.path.join(root, "bin", "ptxas")
        if os.access(path, os.X_OK):
            return path
    return None


PTXAS = ptxas()
MISSING = "ptxas: neither on PATH nor installed by the test extra (pip install -e '.[test]')"
