"""Do the GPU-level kernels of this checkout render the same MLIR as those of another revision?

For refactors of the templates (msa_iree/ops/templates/) and of the spec classes that render them:
a kernel that renders the same MLIR, up to comments, blank lines and indentation, compiles to the
same code, so whatever was measured or tested on a GPU for that revision still holds. Renders every
GPU variant (each attend family, decode and prefill, the KV insert; every KV and query dtype, 8/16
heads per KV head, 1, 2 and 4 KV heads, L 1-4, both cache layouts) here and in a temporary git
worktree of `--against`, and lists those that differ. Variants are matched by what they are
(kernel, heads, dtypes, L, stride), not by name, so a renamed knob suffix still compares.

    python tools/render_diff.py --against 2d14be5      # exit 0: all the same; 1: some differ
"""
import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

# runs inside the tree being rendered: it knows both the package layout of today (msa_iree.ops) and
# the one before it (msa_iree.kernels, whose FMA kernels were named *_gpu)
RENDER = r"""
import json, re, sys
try:
    from msa_iree import ops as K
    classes = list(K.GPU_SPECS)
except ImportError:
    from msa_iree import kernels as K
    classes = [c for c in K.GPU_SPECS]
from msa_iree.config import MsaConfig
RENAMED = {"sparse_attn_decode_gpu": "sparse_attn_decode_fma", "sparse_attn_prefill_gpu": "sparse_attn_prefill_fma"}

def lines(text):
    if "// For benchmarks: n attends back to back" in text:  # an entry point that was removed
        text = text[:text.index("  // For benchmarks: n attends back to back")] + "}"
    out = []
    for line in text.splitlines():
        s = re.sub(r"\s+//.*$", "", line.strip())
        if s and not s.startswith("//"):
            out.append(s)
    return out

out = {}
for cls in classes:
    for kv, qd in (("bf16", "bf16"), ("fp16", "fp16"), ("fp8_e4m3fn", "bf16"), ("fp8_e4m3fnuz", "bf16"),
                   ("fp8_e4m3fnuz", "fp16"), ("fp8_e4m3fn", "fp16"), ("bf16", "fp16")):
        for h, g in ((1, 16), (1, 8), (2, 16), (2, 8), (4, 16)):
            for L in (1, 2, 3, 4):
                for stride in (16, 8):
                    cfg = MsaConfig(num_heads=h * g, num_kv_heads=h, kv_dtype=kv, query_dtype=qd, decode_query_len=L)
                    try:
                        spec = cls(cfg, stride)
                    except ValueError:
                        continue
                    key = f"{RENAMED.get(cls.kernel, cls.kernel)} h{h} g{g} {kv} q{qd} L{L} s{stride}"
                    out[key] = lines(spec.render())
json.dump(out, sys.stdout)
"""


def render(tree: pathlib.Path) -> dict:
    """{variant: its MLIR lines without comments, blank lines and indentation}, rendered by the
    package in `tree`."""
    proc = subprocess.run([sys.executable, "-c", RENDER], cwd=tree, env={"PYTHONPATH": str(tree), "PATH": ""},
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"rendering in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="a git revision (commit, tag, branch)")
    args = ap.parse_args()
    here = render(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        tree = pathlib.Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), args.against], check=True)
        try:
            there = render(tree)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
    differ = sorted(k for k in here.keys() & there.keys() if here[k] != there[k])
    only = sorted(here.keys() ^ there.keys())
    print(f"{len(here.keys() & there.keys())} variants in both; {len(differ)} render differently; "
          f"{len(only)} exist on one side only")
    for name in differ:
        print("  differs:", name)
    for name in only:
        print("  one side only:", name, "(here)" if name in here else "(there)")
    sys.exit(1 if differ or only else 0)


if __name__ == "__main__":
    main()
