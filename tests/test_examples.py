"""The runnable examples run, and the README shows them as they are."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("example", ["serving_step.py", "sparse_layer.py"])
def test_the_example_runs_and_agrees_with_the_reference(example):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / example)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout.strip().endswith("OK")


def test_the_readme_shows_the_example_in_full():
    example = (ROOT / "examples" / "serving_step.py").read_text()
    assert f"```python\n{example}```" in (ROOT / "README.md").read_text()
