"""`msa-iree`: compile the kernels, inspect gfx942 builds, run the quickstart self-check."""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

from . import __version__

# layout.LAYOUT_STRIDES, spelled out: the CLI validates options before it imports torch
LAYOUT_STRIDES = {"interleaved": 16, "planes": 8}


class UsageError(Exception):
    """A user error: printed as one line, exit status 2."""


def _csv(kind, name):
    def parse(text):
        try:
            return [kind(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of {kind.__name__}, got {text!r}") from None
    parse.__name__ = name
    return parse


def _config(args, target):
    from .config import MsaConfig, resolve_dtype

    return MsaConfig(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                     kv_dtype=resolve_dtype(args.kv_dtype, target), query_dtype=resolve_dtype(args.query_dtype, target))


# MiniMax-M3: 64 query heads, 4 KV heads (replicated past TP4)
MODEL_HEADS, MODEL_KV_HEADS = 64, 4
# vLLM's --kv-cache-dtype names -> msa-iree's (fp8: the target's native format)
VLLM_KV_DTYPES = {"auto": "bf16", "bfloat16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8"}


def _apply_vllm_options(args):
    """The kernel set a vLLM configuration of MiniMax-M3 needs: per-rank heads from the tensor
    parallel size, the KV dtype from vLLM's name, L = 1 .. 1 + speculative tokens, and the
    interleaved cache layout (where vLLM's page-16 path lands for this model)."""
    vllm_given = [o for o in ("tensor_parallel_size", "kv_cache_dtype", "num_speculative_tokens")
                  if getattr(args, o) is not None]
    if not vllm_given:
        args.num_heads = 16 if args.num_heads is None else args.num_heads
        args.num_kv_heads = 1 if args.num_kv_heads is None else args.num_kv_heads
        args.layouts = args.layouts or ["interleaved", "planes"]
        args.index_query_dtype = args.index_query_dtype or args.query_dtype
        return
    # vLLM's MiniMax-M3 writes its index queries in the index cache's dtype
    args.index_query_dtype = args.index_query_dtype or args.index_cache_dtype or args.query_dtype
    if args.tensor_parallel_size is None:
        raise UsageError(f"--{vllm_given[0].replace('_', '-')}: expected with --tensor-parallel-size (a vLLM "
                         "configuration), got it alone")
    tp = args.tensor_parallel_size
    if tp < 1 or MODEL_HEADS % tp:
        raise UsageError(f"--tensor-parallel-size: expected a divisor of MiniMax-M3's {MODEL_HEADS} query heads, got {tp}")
    if args.num_heads is not None or args.num_kv_heads is not None:
        raise UsageError("--num-heads/--num-kv-heads: expected none with --tensor-parallel-size (it sets them), got both")
    args.num_heads, args.num_kv_heads = MODEL_HEADS // tp, max(1, MODEL_KV_HEADS // tp)
    kv = args.kv_cache_dtype or "auto"
    if kv not in VLLM_KV_DTYPES:
        raise UsageError(f"--kv-cache-dtype: expected one of {sorted(VLLM_KV_DTYPES)} (vLLM's names msa-iree builds), "
                         f"got {kv!r}")
    args.kv_dtype = VLLM_KV_DTYPES[kv]
    k = args.num_speculative_tokens or 0
    if not 0 <= k <= 7:
        raise UsageError(f"--num-speculative-tokens: expected 0..7, got {k}")
    args.decode_query_lens = list(range(1, k + 2))
    args.layouts = args.layouts or ["interleaved"]


def _check_compile_options(args):
    from .compile import TARGETS

    for target in args.target:
        if target not in TARGETS:
            raise UsageError(f"--target: expected one of {sorted(TARGETS)}, got {target!r}")
    for layout in args.layouts:
        if layout not in LAYOUT_STRIDES:
            raise UsageError(f"--layouts: expected {sorted(LAYOUT_STRIDES)}, got {layout!r}")
    bad = [L for L in args.decode_query_lens if not 1 <= L <= 8]
    if bad or not args.decode_query_lens:
        raise UsageError(f"--decode-query-lens: expected decode query lengths in 1..8, got {bad or 'none'}")


def _indexer_specs(args, cfg, target) -> list:
    """The indexer's kernels --index-cache-dtype asks for (none without it), one index head per KV
    head a rank: the index-cache insert, the scores and top-k (portable, and on a GPU target the
    hand-written kernel), the attend's page table for a top-k."""
    if args.index_cache_dtype is None:
        return []
    from .ops import indexer_set
    from .ops.indexer import FP8_QUERIES_CACHE, INDEX_QUERY_DTYPES, indexer_config

    try:
        indexer_config(cfg.num_kv_heads, args.index_cache_dtype, cfg.query_dtype)  # the cache's dtype first
        if args.index_query_dtype not in INDEX_QUERY_DTYPES:
            raise ValueError(f"index_query_dtype: expected one of {', '.join(INDEX_QUERY_DTYPES)}, "
                             f"got {args.index_query_dtype!r}")
        fp8_queries = args.index_query_dtype == FP8_QUERIES_CACHE
        # the index keys (the insert's input) come in the model's dtype: the attend's queries'
        cfg = indexer_config(cfg.num_kv_heads, args.index_cache_dtype,
                             cfg.query_dtype if fp8_queries else args.index_query_dtype)
        return indexer_set(cfg, target, args.index_init_blocks, args.index_local_blocks, args.decode_query_lens,
                           fp8_queries=fp8_queries).specs()
    except ValueError as e:
        raise UsageError(f"--index-cache-dtype / --index-query-dtype / --index-init-blocks / --index-local-blocks: "
                         f"{e}") from None


def cmd_compile(args):
    from .compile import VERIFIED_ON, build, request_key, up_to_date

    _apply_vllm_options(args)
    _check_compile_options(args)
    t0 = time.perf_counter()
    for target in args.target:
        out = args.out if args.out and len(args.target) == 1 else (f"{args.out}/{target}" if args.out else f"build/{target}")
        try:
            cfg = _config(args, target)
        except ValueError as e:
            raise UsageError(str(e)) from None
        from .ops import unbuilt_attends

        for kernel, why in unbuilt_attends(cfg, target).items():
            print(f"{target}: not building {kernel}: {why}; on {target} SparseAttention then serves this config "
                  "with the portable attend (much slower on a GPU)")
        indexer = _indexer_specs(args, cfg, target)
        options = {k: v for k, v in vars(args).items() if k not in ("fn", "out", "target")}
        key = request_key(options, target)
        if not args.emit_mlir and up_to_date(out, key):
            print(f"{target}: {out}/manifest.json up to date ({VERIFIED_ON[target]})")
            continue
        strides = [LAYOUT_STRIDES[lay] for lay in args.layouts]
        extra = {}
        if indexer:
            from .ops import kernel_set

            extra["specs"] = kernel_set(cfg, strides, args.decode_query_lens, target) + indexer
        manifest = build(cfg, [target], out, strides=strides, decode_query_lens=args.decode_query_lens,
                         emit_mlir=args.emit_mlir, request_key=key, **extra)[target]
        print(f"{target}: {manifest} ({VERIFIED_ON[target]})")
    print(f"done in {time.perf_counter() - t0:.1f} s")


def _build_dir_of(path: str) -> pathlib.Path:
    p = pathlib.Path(path)
    if p.is_file() and p.name == "manifest.json":
        return p.parent
    if not (p / "manifest.json").is_file():
        raise UsageError(f"{path}: expected a build directory (or its manifest.json) from msa-iree compile, "
                         "found no manifest.json")
    return p


def cmd_inspect(args):
    from .inspect import format_report, kernel_report

    print(format_report(kernel_report(_build_dir_of(args.build_dir))))


def cmd_quickstart(args):
    """Build the gfx942 kernel set, then run one decode step on the host CPU against the reference."""
    import torch

    from . import reference, testing
    from .compile import build
    from .config import MsaConfig
    from .inspect import format_report, kernel_report, summary
    from .runtime import KernelLibrary, MetadataBuilder, SparseAttention

    cfg = MsaConfig(num_heads=16, num_kv_heads=1, kv_dtype="fp8_e4m3fnuz")
    out = pathlib.Path(args.out or "build/gfx942")
    print(f"== 1/2: the gfx942 (MI300X) kernel set into {out}: compiled and inspected here, never run (no AMD GPU)")
    manifest = build(cfg, ["gfx942"], out, log=(print if args.verbose else lambda msg: None))["gfx942"]
    report = kernel_report(manifest.parent)
    print(format_report(report) if args.verbose else summary(report))
    print("== 2/2: one fp8 e4m3fnuz decode step (16 heads, 1 KV head, k/v scale 0.37/1.9, 4 requests, one of them "
          "graph padding) through the compiled host kernels, against the torch reference")
    case = testing.decode_case([4097, 129, 1, 0], kv_dtype=torch.float8_e4m3fnuz, seed=0)
    lib = KernelLibrary("host", compile_missing=True, log=print)
    attn = SparseAttention(16, 1, 128, case.scale, torch.float8_e4m3fnuz, kernels=lib)
    builder = MetadataBuilder(max_num_seqs=8, max_model_len=8192, kernels=lib)
    # the fourth request is padding (query length 0, seq_len 0: vLLM's CUDA-graph padding), its token
    # counted in num_actual_tokens
    md = builder.build(case.block_table.clamp(min=0), case.seq_lens, torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32),
                       torch.tensor([4096, 128, 0, 0], dtype=torch.int32), decode_query_len=1, num_decodes=4,
                       num_actual_tokens=4)
    out_t = torch.full_like(case.q, float("nan"))
    attn.forward(case.q, case.k_cache, case.v_cache, out_t, case.topk, md, case.k_scale, case.v_scale)
    ref = torch.empty_like(out_t)
    reference.sparse_attn_decode(case.q, case.k_cache, case.v_cache, case.topk, case.block_table, case.seq_lens, 1,
                                 case.scale, ref, case.k_scale, case.v_scale)
    err = (out_t.float() - ref.float()).abs()
    ok = bool(err.max() < 1.7e-2 and err.mean() < 2.5e-4 and not out_t.isnan().any())
    print(f"max abs err {err.max():.2e} (bound 1.7e-2), mean {err.mean():.2e} (bound 2.5e-4): "
          f"{'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="msa-iree", description=__doc__)
    p.add_argument("--version", action="version", version=f"msa-iree {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="build the kernel modules (vmfb + manifest.json) for targets")
    c.add_argument("--target", type=_csv(str, "targets"), default=["gfx942"],
                   help="gfx942 (MI300X, default; compiled, never run here), host (llvm-cpu), "
                        "cuda (sm_80; the e4m3fn mma attend sm_89); a comma list")
    c.add_argument("--num-heads", type=int, default=None, help="query heads per rank (default 16 = MiniMax-M3 TP4)")
    c.add_argument("--num-kv-heads", type=int, default=None, help="KV heads per rank (default 1)")
    c.add_argument("--kv-dtype", default="fp8", help="bf16, fp16, fp8 (the target's native: e4m3fnuz on gfx942, "
                   "e4m3fn on cuda), fp8_e4m3fnuz, fp8_e4m3fn (default fp8)")
    c.add_argument("--query-dtype", default="bf16", help="bf16 or fp16 (default bf16)")
    c.add_argument("--decode-query-lens", type=_csv(int, "lengths"), default=[1, 2, 3, 4],
                   help="decode query lengths L to build, 1..8 (default 1,2,3,4: decode and speculative decode)")
    c.add_argument("--layouts", type=_csv(str, "layouts"), default=None,
                   help="cache layouts: interleaved (LBHNC, stride 16), planes (LHBNC, stride 8); default both "
                        "(for a vLLM configuration: interleaved, where vLLM's page-16 path lands for MiniMax-M3)")
    c.add_argument("--index-cache-dtype", default=None,
                   help="also build the indexer's scores and top-k (the portable kernel) for an index cache of "
                        "bf16 or fp8_e4m3fn (vLLM's indexer_kv_dtype; MI300X serves bf16); default: none")
    c.add_argument("--index-query-dtype", default=None,
                   help="the index queries' dtype: bf16, fp16, or fp8_e4m3fn (an fp8_e4m3fn index cache's, "
                        "cast with no scale); default: --query-dtype, for a vLLM configuration the index "
                        "cache's dtype (vLLM's model casts its index queries to it)")
    c.add_argument("--index-init-blocks", type=int, default=0, help="the indexer's forced first blocks "
                   "(MiniMax-M3's sparse_init_block, default 0)")
    c.add_argument("--index-local-blocks", type=int, default=1, help="the indexer's forced last blocks "
                   "(sparse_local_block, default 1: the token's own)")
    c.add_argument("--out", help="output directory (default build/<target>)")
    c.add_argument("--emit-mlir", action="store_true", help="keep each kernel's MLIR under <out>/mlir")
    v = c.add_argument_group("a vLLM configuration of MiniMax-M3 (instead of the options above: exactly its kernels)")
    v.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="vLLM's tensor parallel size: 64/TP query heads and max(1, 4/TP) KV heads a rank")
    v.add_argument("--kv-cache-dtype", default=None, help="vLLM's --kv-cache-dtype: auto/bfloat16 or fp8/fp8_e4m3")
    v.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="vLLM's speculative tokens K: decode query lengths 1..K+1 (default 0)")
    c.set_defaults(fn=cmd_compile)
    i = sub.add_parser("inspect", help="per-kernel gfx942 resources and dispatch counts of a build")
    i.add_argument("build_dir", help="a gfx942 build directory (or its manifest.json)")
    i.set_defaults(fn=cmd_inspect)
    q = sub.add_parser("quickstart", help="compile for gfx942, run one decode step on the host vs the reference")
    q.add_argument("--out", default=None, help="gfx942 build directory (default build/gfx942)")
    q.add_argument("--verbose", action="store_true", help="print every kernel's line and the full ISA table")
    q.set_defaults(fn=cmd_quickstart)
    return p


def main(argv=None):
    # progress lines appear as they happen when the output is a pipe or a file, not at the end
    sys.stdout.reconfigure(line_buffering=True)
    args = parser().parse_args(argv)
    from .compile import BuildMismatchError, CompileError

    try:
        return args.fn(args) or 0
    except (UsageError, CompileError, BuildMismatchError, ValueError, FileNotFoundError) as e:
        print(f"msa-iree {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
