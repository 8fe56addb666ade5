"""The indexer's scores and top-k, decode and prefill: msa-iree's GPU kernel (ops/indexer_gpu.py)
against vLLM's Triton indexer, in one process on the same bytes, by the anchor's protocol (anchor.py).

vLLM serves MiniMax-M3's indexer on CUDA with `minimax_m3_index_decode` of
`vllm/models/minimax_m3/common/ops/index_topk.py` (the vllm wheel; `--anchor PATH` is a copy taken
for the measurement, not part of this repository): block scores and a split top-k, 1 index head,
init 0 / local 1 forced blocks. Each case is a decode batch of `c` requests, every one `ctx`
tokens long with L new tokens (positions ctx - L .. ctx - 1), random index keys, each request its
own blocks; `--columns N` gives every block table N columns, zeros past a request's blocks, as
vLLM's are (as wide as its longest context: 8,192 for 1M tokens).

Index queries (`--queries`): "vllm" (the default) gives both sides the queries in the index
cache's dtype, as vLLM's model writes them (its fused projection emits e4m3fn index queries for an
e4m3fn cache): Triton then takes the fp8 dot on e4m3fn x e4m3fn, and msa-iree runs the kernels its
vLLM plugin serves (`fp8_queries`). "bf16" gives both bf16 queries whatever the cache (Triton then
converts an e4m3fn cache's keys to bf16): the protocol of runs before the option existed.

Per case and dot (`--dot`: "mma" tensor cores, "fma" lane-wise products; the one runtime.Indexer
serves on CUDA, ops.indexer_dot, in bold): cold and warm us (anchor.cold_us / warm_us) of both,
their ratio (Triton / msa-iree), GB/s over the index-key bytes each request must read (c x ctx x 128 x the cache's element size)
and that against a device copy measured in the run; `same`: the share of rows whose 16 ids
(and order) the two agree on, and `ref`: whether msa-iree's rows of one request equal
reference.index_topk's (computed on the host over that request's blocks); `+table`: warm us with
the attend's page table emitted in the same launch over warm us without.

Prefill (`--prefill`, q:ctx cases): one request's chunk of q tokens ending at ctx (positions
ctx - q .. ctx - 1) against vLLM's Triton prefill indexer (`minimax_m3_index_score`, then
`minimax_m3_index_topk`: a score tensor through memory); msa-iree's query tiles (the tiled kernel
runtime.Indexer serves a step with prefills, in bold, and the other dot's) and one token a
workgroup (what it served before the tiles); `ref` over a sample of the rows (every 97th and the
first 16), GB/s over the same key bytes (each key read once: the bound a tile's sharing aims at).

    python -m benchmarks.indexer --build-dir .devbuild/cuda --anchor PATH/index_topk.py --json indexer.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from msa_iree import reference as R
from msa_iree.config import DTYPES
from msa_iree.ops import IndexTopkGpuSpec, indexer_dot, indexer_set
from msa_iree.ops.indexer import indexer_config
from msa_iree.ops.indexer_gpu import QUERY_TILE
from msa_iree.ops.tuning import INDEXER, INDEXER_TILED
from msa_iree.runtime import KernelLibrary

from . import anchor
from .bench import copy_bandwidth_GBps

CASES = [(c, ctx, L) for c in (64, 256) for ctx in (8192, 32768, 131072) for L in (1,)] + \
    [(64, 8192, 4), (64, 32768, 4)]
PREFILL_CASES = [(4096, 32768)]


def decode_case(c, ctx, L, cache_dtype, device, gen, columns=None):
    """(q [c L, 1, 128] bf16, cache [blocks, 128, 128], block_table [c, columns or ctx / 128],
    seq_lens [c], req_id and abs_pos [c L]) of a decode batch: every request ctx tokens, its own
    blocks (then zeros to `columns`)."""
    nb = -(-ctx // 128)
    if columns is not None and columns < nb:
        raise ValueError(f"--columns: expected at least the {nb} blocks of a {ctx}-token context, got {columns}")
    table = torch.zeros(c, columns or nb, dtype=torch.int32)
    table[:, :nb] = torch.randperm(c * nb, generator=gen).view(c, nb).int()
    table = table.to(device)
    cache = torch.empty(c * nb, 128, 128, dtype=torch.bfloat16, device=device)
    cache.normal_(generator=torch.Generator(device).manual_seed(int(torch.randint(1 << 30, (1,), generator=gen))))
    cache = cache.to(DTYPES[cache_dtype])
    q = torch.randn(c * L, 1, 128, generator=gen).to(torch.bfloat16).to(device)
    seq = torch.full((c,), ctx, dtype=torch.int32, device=device)
    req = torch.arange(c, device=device).repeat_interleave(L).int()
    pos = (ctx - L + torch.arange(c * L, device=device) % L).int()
    return q, cache, table, seq, req, pos


def prefill_case(nq, ctx, cache_dtype, device, gen, columns=None):
    """(q [nq, 1, 128] bf16, cache [blocks, 128, 128], block_table [1, columns or ctx / 128],
    req_id and abs_pos [nq], tiles) of one request's chunk of nq tokens ending at ctx, its query
    tiles."""
    q, cache, table, _, _, _ = decode_case(1, ctx, 1, cache_dtype, device, gen, columns)
    q = torch.randn(nq, 1, 128, generator=gen).to(torch.bfloat16).to(device)
    req = torch.zeros(nq, dtype=torch.int32, device=device)
    pos = (ctx - nq + torch.arange(nq, device=device)).int()
    tiles = torch.arange(0, nq, QUERY_TILE, dtype=torch.int32, device=device)
    return q, cache, table, req, pos, tiles


def reference_rows(q, cache, table, req, pos, request=0, every=1):
    """reference.index_topk of one request's rows (every `every`-th, and the first 16), on the host
    over that request's blocks only."""
    rows = (req == request).nonzero().flatten()
    nth = torch.arange(len(rows), device=rows.device)
    rows = rows[(nth % every == 0) | (nth < 16)]
    ncols = int(pos[rows].max()) // 128 + 1  # the rows' candidates (not the table's padding)
    blocks = cache[table[request, :ncols].long()].cpu()
    local = torch.arange(ncols, dtype=torch.int32)[None]
    return rows, R.index_topk(q[rows].cpu(), blocks, local, torch.zeros(len(rows), dtype=torch.int32), pos[rows].cpu())


QUERIES = ("vllm", "bf16")
QDTYPE = {False: "bf16", True: "fp8_e4m3fn"}  # a row's queries, by whether they are e4m3fn


def index_queries(q, cache_dtype, queries):
    """The index queries both sides take: bf16 `q` as it is, or (queries "vllm") in the index
    cache's dtype where that is e4m3fn, as vLLM's model writes them for an fp8 index cache."""
    if queries not in QUERIES:
        raise ValueError(f"--queries: expected one of {QUERIES}, got {queries!r}")
    return q.to(torch.float8_e4m3fn) if queries == "vllm" and cache_dtype == "fp8_e4m3fn" else q


def msa_queries(q):
    """(the queries as msa-iree's kernel takes them: e4m3fn as bytes, whether they are e4m3fn)."""
    fp8 = q.dtype == torch.float8_e4m3fn
    return (q.view(torch.uint8) if fp8 else q), fp8


def decode_spec(cache_dtype, L, dot, fp8_queries):
    """The decode kernel runtime.Indexer launches for `dot`: a step's L tokens of a request together."""
    return IndexTopkGpuSpec(indexer_config(1, cache_dtype, "bf16"), rows=INDEXER.rows_for(L, 1), dot=dot,
                            fp8_queries=fp8_queries)


def prefill_specs(cache_dtype, dots, fp8_queries):
    """The tiled kernel of each of `dots` and the one-token-a-workgroup kernel served before tiles."""
    cfg = indexer_config(1, cache_dtype, "bf16")
    specs = [IndexTopkGpuSpec(cfg, rows=INDEXER_TILED.tile_rows(1, dot), tiled=True, dot=dot, fp8_queries=fp8_queries)
             for dot in dots]
    return specs + [IndexTopkGpuSpec(cfg, dot=indexer_dot(cfg, "cuda", 1, fp8_queries), fp8_queries=fp8_queries)]


def bench_specs(dots=("mma", "fma")):
    """Every kernel a run of the default grid may call (tools/build_gpu_tests.py builds them)."""
    specs = []
    for cache, fp8q in (("bf16", False), ("fp8_e4m3fn", False), ("fp8_e4m3fn", True)):
        specs += [decode_spec(cache, L, dot, fp8q) for L in sorted({L for _, _, L in CASES}) for dot in dots]
        specs += prefill_specs(cache, dots, fp8q)
    return specs + [dataclasses.replace(s, emit_table=True) for s in specs]


def run_case(lib, triton_mod, c, ctx, L, cache_dtype, flush, copy_GBps, gen, dots, columns=None, queries="vllm"):
    """One row per dot of `dots` (IndexTopkGpuSpec.dot), on the same inputs, Triton's columns
    measured once and repeated in each."""
    device = torch.device("cuda")
    q, *rest = decode_case(c, ctx, L, cache_dtype, device, gen, columns)
    inputs = (index_queries(q, cache_dtype, queries), *rest)
    rows = [measure_msa(lib, inputs, c, ctx, L, cache_dtype, flush, dot) for dot in dots]
    if triton_mod is not None:
        q, cache, table, seq, req, pos = inputs
        tout = torch.empty(1, c * L, 16, dtype=torch.int32, device=device)

        def triton():
            triton_mod.minimax_m3_index_decode(q, cache, table, seq, ctx, 16, 0, 1, 1, L, L, out=tout)

        add_anchor_columns(rows, triton, tout, flush)
    add_bandwidth_columns(rows, c * ctx * 128 * inputs[1].dtype.itemsize, copy_GBps)
    return rows


def add_anchor_columns(rows, triton, tout, flush):
    """Triton's cold and warm us (measured once), the ratios and `same` (the share of rows whose
    top-k Triton's `tout` equals, after one call of `triton`) into each of msa-iree's rows."""
    triton()
    cold, warm = anchor.cold_us(triton, flush), anchor.warm_us(triton)
    for row in rows:
        row["same"] = float((tout == row["_out"]).all(-1).float().mean())
        row["triton_cold_us"], row["triton_warm_us"] = cold, warm
        row["x_cold"] = cold / row["msa_cold_us"]
        row["x_warm"] = warm / row["msa_warm_us"]


def add_bandwidth_columns(rows, key_bytes, copy_GBps):
    """GB/s over `key_bytes` from each warm time, and that against the run's copy bandwidth."""
    for row in rows:
        row.pop("_out", None)
        for who in ("msa", "triton"):
            if f"{who}_warm_us" in row:
                row[f"{who}_GBps"] = key_bytes / row[f"{who}_warm_us"] / 1e3
                row[f"{who}_pct_copy"] = 100 * row[f"{who}_GBps"] / copy_GBps


def measure_msa(lib, inputs, c, ctx, L, cache_dtype, flush, dot):
    device = torch.device("cuda")
    q, cache, table, seq, req, pos = inputs
    mq, fp8q = msa_queries(q)
    spec = decode_spec(cache_dtype, L, dot, fp8q)
    raw = (cache.view(torch.uint8) if cache.dtype.itemsize == 1 else cache).view(cache.shape[0], -1)
    out = torch.empty(1, c * L, 16, dtype=torch.int32, device=device)
    ws = torch.empty(spec.workspace_floats(c * L, table.shape[1]), device=device)

    emit = dataclasses.replace(spec, emit_table=True)
    sbt = torch.empty(c * L, 1, 128, dtype=torch.int32, device=device)
    sctx = torch.empty(c * L, 1, dtype=torch.int32, device=device)

    def msa():
        lib.run(spec, mq, raw, table, req, pos, out=[out, ws])

    def msa_emit():  # the attend's table too (through the index table: the bytes are what count)
        lib.run(emit, mq, raw, table, req, pos, table, out=[out, sbt, sctx, ws])

    msa()
    rows, want = reference_rows(q, cache, table, req, pos)
    row = {"c": c, "ctx": ctx, "L": L, "columns": table.shape[1], "cache": cache_dtype, "queries": QDTYPE[fp8q],
           "dot": dot, "kernel": spec.name, "served": dot == indexer_dot(spec.cfg, "cuda", spec.rows, fp8q),
           "ref": bool(torch.equal(out[:, rows].cpu(), want)), "_out": out.clone()}
    row["msa_cold_us"], row["msa_warm_us"] = anchor.cold_us(msa, flush), anchor.warm_us(msa)
    row["emit_warm_us"] = anchor.warm_us(msa_emit)
    row["emit_over_topk"] = row["emit_warm_us"] / row["msa_warm_us"]
    return row


def run_prefill_case(lib, triton_mod, nq, ctx, cache_dtype, flush, copy_GBps, gen, dots, columns=None,
                     queries="vllm"):
    """Rows for msa-iree's tiled kernel (each of `dots`) and its one-token-a-workgroup kernel on one
    chunk, Triton's prefill indexer on the same inputs measured once and repeated in each."""
    device = torch.device("cuda")
    q, cache, table, req, pos, tiles = prefill_case(nq, ctx, cache_dtype, device, gen, columns)
    q = index_queries(q, cache_dtype, queries)
    mq, fp8q = msa_queries(q)
    served = indexer_set(indexer_config(1, cache_dtype, "bf16"), "cuda", fp8_queries=fp8q).gpu_tiled()
    specs = prefill_specs(cache_dtype, dots, fp8q)
    raw = (cache.view(torch.uint8) if cache.dtype.itemsize == 1 else cache).view(cache.shape[0], -1)
    sample, want = reference_rows(q, cache, table, req, pos, every=97)
    rows = []
    for spec in specs:
        out = torch.empty(1, nq, 16, dtype=torch.int32, device=device)
        ws = torch.empty(spec.workspace_floats(nq, table.shape[1]), device=device)
        emit = dataclasses.replace(spec, emit_table=True)
        sbt = torch.empty(nq, 1, 128, dtype=torch.int32, device=device)
        sctx = torch.empty(nq, 1, dtype=torch.int32, device=device)
        ins = (mq, raw, table, req, pos) + ((tiles,) if spec.tiled else ())

        def msa():
            lib.run(spec, *ins, out=[out, ws])

        def msa_emit():
            lib.run(emit, *ins, table, out=[out, sbt, sctx, ws])

        msa()
        row = {"c": 1, "q": nq, "ctx": ctx, "columns": table.shape[1], "cache": cache_dtype, "queries": QDTYPE[fp8q],
               "dot": spec.dot, "rows": spec.rows,
               "tiled": spec.tiled, "kernel": spec.name, "served": spec.name == served.name,
               "ref": bool(torch.equal(out[:, sample].cpu(), want)), "_out": out.clone()}
        row["msa_cold_us"], row["msa_warm_us"] = anchor.cold_us(msa, flush), anchor.warm_us(msa)
        row["emit_warm_us"] = anchor.warm_us(msa_emit)
        row["emit_over_topk"] = row["emit_warm_us"] / row["msa_warm_us"]
        rows.append(row)
    if triton_mod is not None:
        cu = torch.tensor([0, nq], dtype=torch.int32, device=device)
        seq = torch.tensor([ctx], dtype=torch.int32, device=device)
        prefix = torch.tensor([ctx - nq], dtype=torch.int32, device=device)
        tout = torch.empty(1, nq, 16, dtype=torch.int32, device=device)

        def triton():
            score = triton_mod.minimax_m3_index_score(q, cache, table, cu, seq, prefix, nq, ctx, 1)
            triton_mod.minimax_m3_index_topk(score, cu, prefix, nq, 16, 0, 1, out=tout)

        add_anchor_columns(rows, triton, tout, flush)
    add_bandwidth_columns(rows, ctx * 128 * cache.dtype.itemsize, copy_GBps)
    return rows


def against_triton(r, kind) -> str:
    """A table cell "Triton / msa (x)" of `kind` ("cold" or "warm") us; "- / msa" without Triton."""
    if f"triton_{kind}_us" not in r:
        return f"- / {r[f'msa_{kind}_us']:.1f}"
    return f"{r[f'triton_{kind}_us']:.1f} / {r[f'msa_{kind}_us']:.1f} ({r[f'x_{kind}']:.2f})"


def prefill_table(rows) -> str:
    head = ("| cache | queries | kernel | q | ctx | cold us Triton / msa (x) | warm us Triton / msa (x) | +table | same "
            "| ref |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cold, warm = against_triton(r, "cold"), against_triton(r, "warm")
        kernel = f"{r['dot']}, " + (f"tiles of {r['rows']} a workgroup" if r["tiled"] else "one token a workgroup")
        kernel = f"**{kernel}**" if r["served"] else kernel
        lines.append(f"| {r['cache']} | {r['queries']} | {kernel} | {r['q']} | {r['ctx'] // 1024}K | {cold} | {warm} | "
                     f"{r['emit_over_topk']:.3f} | {r.get('same', '-')} | {r['ref']} |")
    return "\n".join(lines)


def table(rows) -> str:
    head = ("| cache | queries | dot | c | ctx | L | cold us Triton / msa (x) | warm us Triton / msa (x) | GB/s msa (% copy) "
            "| Triton (% copy) | +table | same | ref |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cold, warm = against_triton(r, "cold"), against_triton(r, "warm")
        tri = f"{r['triton_GBps']:.0f} ({r['triton_pct_copy']:.0f}%)" if "triton_GBps" in r else "-"
        dot = f"**{r['dot']}**" if r["served"] else r["dot"]
        lines.append(f"| {r['cache']} | {r['queries']} | {dot} | {r['c']} | {r['ctx'] // 1024}K | {r['L']} | {cold} | {warm} | "
                     f"{r['msa_GBps']:.0f} ({r['msa_pct_copy']:.0f}%) | {tri} | {r['emit_over_topk']:.3f} | "
                     f"{r.get('same', '-')} | {r['ref']} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", required=True)
    p.add_argument("--anchor", default=None, help="a copy of vLLM's minimax_m3 common/ops/index_topk.py")
    p.add_argument("--cache", default="bf16,fp8_e4m3fn", help="index cache dtypes")
    p.add_argument("--cases", default=None, help="c:ctx:L,... (default: the grid of CASES)")
    p.add_argument("--prefill", default=None, help="q:ctx,... prefill cases (default: PREFILL_CASES; 'none': none)")
    p.add_argument("--dot", default="mma,fma", help="IndexTopkGpuSpec.dot values, each its own row")
    p.add_argument("--columns", type=int, default=None,
                   help="block-table columns of every case (vLLM's: max_model_len / 128; default: ctx / 128)")
    p.add_argument("--queries", default="vllm", choices=QUERIES,
                   help="vllm: the index cache's dtype, as vLLM's model writes them; bf16: bf16 for every cache")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks.indexer: expected a CUDA GPU (the GPU indexer runs on CUDA; gfx942 is compiled only)")
    cases = CASES if a.cases is None else [tuple(int(x) for x in c.split(":")) for c in a.cases.split(",")]
    prefill = PREFILL_CASES if a.prefill is None else [] if a.prefill == "none" else \
        [tuple(int(x) for x in c.split(":")) for c in a.prefill.split(",")]
    triton_mod = anchor.load_triton_module(a.anchor, "index_topk.py", ("minimax_m3_index_decode", "minimax_m3_index_score",
                                                                        "minimax_m3_index_topk")) if a.anchor else None
    lib = KernelLibrary("cuda", a.build_dir)
    device = torch.device("cuda")
    flush = anchor.write_flusher(device)
    copy = copy_bandwidth_GBps(device)
    gen = torch.Generator().manual_seed(0)
    rows, prefill_rows = [], []
    for cache_dtype in a.cache.split(","):
        for c, ctx, L in cases:
            rows += run_case(lib, triton_mod, c, ctx, L, cache_dtype, flush, copy, gen, a.dot.split(","), a.columns,
                             a.queries)
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
        for nq, ctx in prefill:
            prefill_rows += run_prefill_case(lib, triton_mod, nq, ctx, cache_dtype, flush, copy, gen, a.dot.split(","),
                                             a.columns, a.queries)
            print(prefill_rows[-1], flush=True)
            torch.cuda.empty_cache()
    print(f"device copy: {copy:.0f} GB/s (read + written); block tables: "
          + (f"{a.columns} columns" if a.columns else "ctx / 128 columns"))
    print(table(rows))
    print(prefill_table(prefill_rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": copy, "rows": rows, "prefill_rows": prefill_rows,
                       "command": "python -m benchmarks.indexer " + " ".join(argv or sys.argv[1:])}, f, indent=1)


if __name__ == "__main__":
    main()
