"""`msa-iree`: compile the kernels, inspect gfx942 builds, run the quickstart self-check."""
from __future__ import annotations

import argparse
import sys
import time

# layout.LAYOUT_STRIDES, spelled out: the CLI validates options before it imports torch
LAYOUT_STRIDES = {"interleaved": 16, "planes": 8}


def _csv(kind):
    def parse(text):
        return [kind(x) for x in text.split(",") if x]
    return parse


def _config(args, target):
    from .config import MsaConfig, resolve_dtype

    kv = resolve_dtype(args.kv_dtype, target)
    return MsaConfig(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, kv_dtype=kv,
                     query_dtype=resolve_dtype(args.query_dtype, target))


def cmd_compile(args):
    from .compile import TARGETS, VERIFIED_ON, build, request_key, up_to_date

    targets = args.target
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise SystemExit(f"msa-iree compile: unknown target {unknown[0]!r}; expected one of {sorted(TARGETS)}")
    bad = [l for l in args.layouts if l not in LAYOUT_STRIDES]
    if bad:
        raise SystemExit(f"msa-iree compile: --layouts: unknown layout {bad[0]!r}; expected {sorted(LAYOUT_STRIDES)}")
    t0 = time.perf_counter()
    for target in targets:
        out = args.out if args.out and len(targets) == 1 else (f"{args.out}/{target}" if args.out else f"build/{target}")
        options = {k: v for k, v in vars(args).items() if k not in ("fn", "out", "target")}
        key = request_key(options, target)
        if not args.emit_mlir and up_to_date(out, key):
            print(f"{target}: {out}/manifest.json up to date ({VERIFIED_ON[target]})")
            continue
        try:
            cfg = _config(args, target)
        except ValueError as e:
            raise SystemExit(f"msa-iree compile: {e}")
        manifest = build(cfg, [target], out, strides=[LAYOUT_STRIDES[l] for l in args.layouts],
                         decode_query_lens=args.decode_query_lens, emit_mlir=args.emit_mlir, request_key=key)[target]
        print(f"{target}: {manifest} ({VERIFIED_ON[target]})")
    print(f"done in {time.perf_counter() - t0:.1f} s")


def cmd_inspect(args):
    from .inspect import format_report, kernel_report

    try:
        print(format_report(kernel_report(args.build_dir)))
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"msa-iree inspect: {e}")


def cmd_quickstart(args):
    """Build the gfx942 kernel set, then run one decode step on the host CPU against the reference."""
    import torch

    from . import reference, testing
    from .compile import build
    from .config import MsaConfig
    from .inspect import format_report, kernel_report
    from .runtime import KernelLibrary, MetadataBuilder, SparseAttention

    cfg = MsaConfig(num_heads=16, num_kv_heads=1, kv_dtype="fp8_e4m3fnuz")
    print("== compiling the kernel set for gfx942 (MI300X; compiled and inspected, not run here)")
    manifest = build(cfg, ["gfx942"], args.out)["gfx942"]
    print(format_report(kernel_report(manifest.parent)))
    print("== one decode step on the host CPU (fp8 e4m3fnuz KV, scale 0.37/1.9, TP4 heads) vs torch reference")
    case = testing.decode_case([4097, 129, 1, 0], kv_dtype=torch.float8_e4m3fnuz, seed=0)
    lib = KernelLibrary("host")
    attn = SparseAttention(16, 1, 128, case.scale, torch.float8_e4m3fnuz, kernels=lib)
    builder = MetadataBuilder(max_num_seqs=8, max_model_len=8192, kernels=lib)
    # 4 decode requests of one new token each; the last is graph padding (seq_len 0).
    md = builder.build(case.block_table.clamp(min=0), case.seq_lens, torch.arange(5, dtype=torch.int32),
                       (case.seq_lens - 1).clamp(min=0), decode_query_len=1, num_decodes=4)
    out = torch.full_like(case.q, float("nan"))
    attn.forward(case.q, case.k_cache, case.v_cache, out, case.topk, md, case.k_scale, case.v_scale)
    ref = torch.empty_like(out)
    reference.sparse_attn_decode(case.q, case.k_cache, case.v_cache, case.topk, case.block_table, case.seq_lens, 1,
                                 case.scale, ref, case.k_scale, case.v_scale)
    err = (out.float() - ref.float()).abs()
    ok = bool(err.max() < 1.7e-2 and err.mean() < 2.5e-4 and not out.isnan().any())
    print(f"max abs err {err.max():.3e}, mean abs err {err.mean():.3e}: {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def main(argv=None):
    p = argparse.ArgumentParser(prog="msa-iree", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="build the kernel modules (vmfb + manifest.json) for targets")
    c.add_argument("--target", type=_csv(str), default=["gfx942"],
                   help="gfx942 (MI300X, default; compiled, not run here), host (llvm-cpu), cuda (sm_80; the e4m3fn mma attend sm_89); comma list")
    c.add_argument("--num-heads", type=int, default=16, help="query heads per rank (default 16 = MiniMax-M3 TP4)")
    c.add_argument("--num-kv-heads", type=int, default=1, help="KV heads per rank (default 1)")
    c.add_argument("--kv-dtype", default="fp8", help="bf16, fp16, fp8 (the target's native: e4m3fnuz on gfx942), "
                   "fp8_e4m3fnuz, fp8_e4m3fn (default fp8)")
    c.add_argument("--query-dtype", default="bf16", help="bf16 or fp16 (default bf16)")
    c.add_argument("--decode-query-lens", type=_csv(int), default=[1, 2, 3, 4],
                   help="decode query lengths L to build (default 1,2,3,4)")
    c.add_argument("--layouts", type=_csv(str), default=["interleaved", "planes"],
                   help="cache layouts: interleaved (LBHNC, stride 16), planes (LHBNC, stride 8)")
    c.add_argument("--out", help="output directory (default build/<target>)")
    c.add_argument("--emit-mlir", action="store_true", help="keep the exported MLIR under <out>/mlir")
    c.set_defaults(fn=cmd_compile)
    i = sub.add_parser("inspect", help="per-kernel gfx942 resources and dispatch counts of a build")
    i.add_argument("build_dir")
    i.set_defaults(fn=cmd_inspect)
    q = sub.add_parser("quickstart", help="compile for gfx942, run one decode step on the host vs the reference")
    q.add_argument("--out", default=None, help="gfx942 build directory (default build/gfx942)")
    q.set_defaults(fn=cmd_quickstart)
    args = p.parse_args(argv)
    return args.fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
