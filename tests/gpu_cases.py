"""The kernel variants and cases the GPU tests run (tests/test_gpu.py; built by
tools/build_gpu_tests.py), and a call's operand shapes as the launch-plan tests evaluate them."""
import dataclasses

from msa_iree.layout import LAYOUT_STRIDES

# ---- the kernel variants the GPU tests run (tests/test_gpu.py; built by tools/build_gpu_tests.py) ----

# (num_heads, num_kv_heads, kv dtype, query dtype, decode L, block page stride, fp8 scale mode)
GPU_DECODE_CASES = (
    (16, 1, "bf16", "bf16", 1, 16, "tensor"),
    (16, 1, "fp8_e4m3fn", "bf16", 1, 16, "token"),
    (16, 1, "fp8_e4m3fnuz", "bf16", 4, 8, "tensor"),
    (8, 1, "fp8_e4m3fn", "bf16", 1, 16, "tensor"),
    (16, 2, "bf16", "bf16", 2, 16, "tensor"),
    (16, 1, "fp16", "fp16", 3, 8, "tensor"),
    (8, 1, "fp8_e4m3fnuz", "bf16", 1, 16, "token"),  # gfx942's fp8 (its MFMA attend converts it in hardware)
)
# serving simulations through SparseAttention on the GPU: (kv dtype, query dtype, layout, kv heads, scale mode)
# the hand-written indexer's cases: (index heads, index cache dtype, init blocks, local blocks)
GPU_INDEXER_CASES = [(1, "bf16", 0, 1), (2, "bf16", 1, 1), (4, "fp8_e4m3fn", 2, 0), (1, "fp8_e4m3fn", 0, 1)]
# ... a decode step's tokens of a request scored together: (index heads, cache dtype, L = rows, emit_table)
GPU_INDEXER_ROW_CASES = [(1, "bf16", 4, False), (1, "fp8_e4m3fn", 3, True), (2, "bf16", 2, False),
                         (1, "fp8_e4m3fn", 4, False), (1, "bf16", 2, True), (1, "bf16", 3, True)]
# ... a step's tokens in query tiles (prefills): (index heads, cache dtype, rows, emit_table, dot)
GPU_INDEXER_TILE_CASES = [(1, "bf16", 32, True, "mfma"), (2, "bf16", 16, False, "mfma"), (4, "bf16", 8, True, "mfma"),
                          (1, "bf16", 64, True, "mma"), (2, "fp8_e4m3fn", 32, False, "mma"), (4, "bf16", 16, False, "mma"),
                          (1, "bf16", 32, False, "mma"), (1, "fp8_e4m3fn", 32, True, "mma"), (2, "bf16", 16, True, "mma"),
                          (4, "fp8_e4m3fn", 8, False, "mma"), (1, "bf16", 8, False, "mma"), (1, "bf16", 8, False, "fma"),
                          (1, "fp8_e4m3fn", 4, True, "fma"), (2, "bf16", 4, True, "fma"), (4, "fp8_e4m3fn", 2, False, "fma")]
# ... a block table as wide as vLLM's for a 1M-token context, each group split by its own
# candidates: (rows, tiled, dot, init blocks, local blocks)
GPU_INDEXER_WIDE_TABLE_CASES = [(1, False, "fma", 0, 1), (4, False, "mma", 0, 1), (8, True, "fma", 1, 1),
                                (32, True, "mma", 1, 1), (4, False, "mfma", 0, 1), (32, True, "mfma", 1, 1)]
# ... a step of more groups than the launch's grid_workgroups give all of the table's splits, so
# that a group's workgroups take turns at its splits (the tuning rows that have it: tensor
# cores'): (index heads, cache dtype, rows, emit_table)
GPU_INDEXER_TURN_CASES = [(1, "fp8_e4m3fn", 1, False), (1, "bf16", 4, True), (2, "fp8_e4m3fn", 2, False)]
# ... each with both ways of taking @score's dot products on CUDA (IndexTopkGpuSpec.dot) and, for
# bf16 caches, gfx942's MFMA kernel as its emulated twin ("mfma": gpu_indexer_spec)
GPU_INDEXER_DOTS = ("fma", "mma")


def with_dots(cases, kv_at):
    """`cases` once for each of GPU_INDEXER_DOTS, and those of a bf16 cache (case[kv_at]) for "mfma"
    too: each case then ends with its dot."""
    return [(*c, dot) for dot in GPU_INDEXER_DOTS for c in cases] + [(*c, "mfma") for c in cases if c[kv_at] == "bf16"]


def gpu_indexer_spec(cfg, *args, dot="fma", **kwargs):
    """The IndexTopkGpuSpec a GPU test runs on CUDA for `dot`: "mfma" is gfx942's kernel's emulated
    twin; "mma-e4m3" / "mma-bf16dot" the tensor cores with e4m3fn queries and keys on their e4m3
    dot / converted to bf16 for their bf16 dot (the tuning row's mma_e4m3_dot on / off, "mma"
    taking the row's own)."""
    from msa_iree.ops import IndexTopkGpuSpec
    if dot in ("mma-e4m3", "mma-bf16dot"):
        return with_e4m3_dot(IndexTopkGpuSpec(cfg, *args, dot="mma", **kwargs), dot == "mma-e4m3")
    return IndexTopkGpuSpec(cfg, *args, dot=dot, emulate_mfma=dot == "mfma", **kwargs)


def with_e4m3_dot(spec, on: bool):
    """`spec` (an IndexTopkGpuSpec) with its tuning row's mma_e4m3_dot set to `on`."""
    return dataclasses.replace(spec, tuning=dataclasses.replace(spec.tuning_row, mma_e4m3_dot=on))


# e4m3fn index queries against an e4m3fn cache (fp8_queries): (index heads, rows, tiled, emit_table, dot);
# on tensor cores each shape both ways (the served row's dot is one of them)
GPU_INDEXER_FP8_QUERY_TENSOR_CORE = [(1, 1, False, True), (2, 2, False, False), (4, 1, False, False), (1, 4, False, True),
                                     (1, 64, True, True), (2, 32, True, False), (4, 16, True, True)]
GPU_INDEXER_FP8_QUERY_CASES = [(1, 1, False, False, "fma"), (1, 4, False, True, "fma"), (2, 4, True, False, "fma"),
                               (1, 1, False, True, "mfma"), (1, 2, False, False, "mfma"), (1, 3, False, True, "mfma"),
                               (1, 4, False, False, "mfma"), (2, 1, False, False, "mfma"), (2, 2, False, False, "mfma"),
                               (4, 1, False, True, "mfma"), (1, 32, True, True, "mfma"), (2, 16, True, True, "mfma"),
                               (4, 8, True, False, "mfma")] + \
    [(*c, dot) for c in GPU_INDEXER_FP8_QUERY_TENSOR_CORE for dot in ("mma-e4m3", "mma-bf16dot")]

GPU_SERVING_CASES = (
    ("bf16", "bf16", "interleaved", 1, "tensor"),
    ("fp8_e4m3fn", "bf16", "planes", 1, "token"),
    ("fp8_e4m3fn", "bf16", "interleaved", 2, "tensor"),  # a scalar scale expanded over 2 KV heads
    ("fp8_e4m3fnuz", "bf16", "interleaved", 2, "token"),  # gfx942's fp8, per-token scales over 2 KV heads
)


# the in-place GPU insert: (kv dtype, key dtype, layout, kv heads)
GPU_INSERT_CASES = (
    ("fp8_e4m3fn", "bf16", "interleaved", 1),
    ("fp8_e4m3fnuz", "bf16", "planes", 2),
    ("bf16", "bf16", "planes", 1),
    ("fp16", "bf16", "interleaved", 2),
)


def gpu_test_specs():
    """Every compiled kernel tests/test_gpu.py calls, for `cuda`."""
    from msa_iree.config import MsaConfig
    from msa_iree.ops import (InsertKvGpuSpec, RebaseBlockTableSpec, SparseAttnDecodeFmaSpec,
                          SparseAttnDecodeMfmaEmulatedSpec as Mfma, SparseAttnDecodeMmaSpec,
                          SparseAttnPrefillFmaSpec,
                          SparseAttnPrefillMfmaEmulatedSpec as MfmaPrefill, SparseAttnPrefillMmaSpec, with_variants)

    specs = [RebaseBlockTableSpec(MsaConfig())]  # (test_gpu's rebase on the device)
    for hq, h, kv, qd, L, stride, _ in GPU_DECODE_CASES:
        cfg = MsaConfig(num_heads=hq, num_kv_heads=h, kv_dtype=kv, query_dtype=qd, decode_query_len=L)
        specs += [SparseAttnDecodeFmaSpec(cfg, stride), SparseAttnPrefillFmaSpec(cfg.replace(decode_query_len=1), stride)]
        if SparseAttnDecodeMmaSpec.supports(cfg):
            specs += [SparseAttnDecodeMmaSpec(cfg, stride), SparseAttnPrefillMmaSpec(cfg.replace(decode_query_len=1), stride)]
        if Mfma.supports(cfg):
            specs += [Mfma(cfg, stride), MfmaPrefill(cfg.replace(decode_query_len=1), stride)]
    for kv, qd, layout, h, _ in GPU_SERVING_CASES:
        stride = LAYOUT_STRIDES[layout]
        cfg = MsaConfig(num_kv_heads=h, kv_dtype=kv, query_dtype=qd)
        specs += [SparseAttnPrefillFmaSpec(cfg, stride), InsertKvGpuSpec(cfg, stride), SparseAttnPrefillMmaSpec(cfg, stride)]
        decodes = [cls(cfg.replace(decode_query_len=L), stride) for L in (1, 4)
                   for cls in (SparseAttnDecodeFmaSpec, SparseAttnDecodeMmaSpec, Mfma)]
        # ... and the decode attends that insert the step's K/V themselves (forward(key=, value=))
        specs += [MfmaPrefill(cfg, stride)] + with_variants(decodes)
    for kv, qd, layout, h in GPU_INSERT_CASES:
        cfg = MsaConfig(num_heads=8 * h, num_kv_heads=h, kv_dtype=kv, query_dtype=qd)
        specs.append(InsertKvGpuSpec(cfg, LAYOUT_STRIDES[layout]))
    for kv in ("fp8_e4m3fn", "fp8_e4m3fnuz"):  # the NaN-code tests: decode L=1, interleaved
        specs += [cls(MsaConfig(kv_dtype=kv), 16) for cls in (SparseAttnDecodeFmaSpec, SparseAttnDecodeMmaSpec, Mfma)]
    specs += [cls(MsaConfig(), 16) for cls in (SparseAttnDecodeMmaSpec, Mfma)]  # workspace, NaN-tail tests (bf16)
    from msa_iree.ops import GPU_PAGED_ATTEND  # the attend over a given page table (test_gpu's paged tests)
    for matrix, kv in (("fma", "bf16"), ("mma", "bf16"), ("mma", "fp8_e4m3fn"), ("mfma", "bf16"),
                       ("mfma", "fp8_e4m3fnuz"), ("fma", "fp8_e4m3fn")):
        specs.append(GPU_PAGED_ATTEND[matrix, "cuda"](MsaConfig(kv_dtype=kv), 16))
    from msa_iree.ops import IndexTopkSpec  # the portable indexer on the GPU (test_gpu's indexer test)
    specs += [IndexTopkSpec(MsaConfig(num_kv_heads=2, kv_dtype="bf16")),
              IndexTopkSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16, 1, 1)]
    from msa_iree.ops import IndexTopkGpuSpec, indexer_set  # the hand-written indexer (test_gpu's GPU indexer tests)
    from msa_iree.ops.indexer import indexer_config
    from msa_iree.ops.tuning import INDEXER_TILED
    for heads, kv, init, local, dot in with_dots(GPU_INDEXER_CASES, 1):
        specs += [gpu_indexer_spec(indexer_config(heads, kv, "bf16"), 16, init, local, emit_table=emit, dot=dot)
                  for emit in (False, True)]
    for heads, kv, L, emit, dot in with_dots(GPU_INDEXER_ROW_CASES, 1):
        specs.append(gpu_indexer_spec(indexer_config(heads, kv, "bf16"), 16, 0, 1, emit_table=emit, rows=L, dot=dot))
    specs += [gpu_indexer_spec(indexer_config(heads, kv, "bf16"), 16, 1, 1, emit_table=emit, rows=rows, tiled=True,
                               dot=dot)
              for heads, kv, rows, emit, dot in GPU_INDEXER_TILE_CASES]
    specs += [gpu_indexer_spec(indexer_config(heads, "fp8_e4m3fn", "bf16"), 16, 1, 1, emit_table=emit, rows=rows,
                               tiled=tiled, dot=dot, fp8_queries=True)
              for heads, rows, tiled, emit, dot in GPU_INDEXER_FP8_QUERY_CASES]
    specs += [gpu_indexer_spec(indexer_config(1, "bf16", "bf16"), 16, init, local, rows=rows, tiled=tiled, dot=dot)
              for rows, tiled, dot, init, local in GPU_INDEXER_WIDE_TABLE_CASES]
    specs += [gpu_indexer_spec(indexer_config(heads, kv, "bf16"), 16, 1, 1, emit_table=emit, rows=rows, dot="mma")
              for heads, kv, rows, emit in GPU_INDEXER_TURN_CASES]
    # the hand-made request and the long contexts (bf16 keys: 64 and 8,192 columns)
    specs.append(gpu_indexer_spec(indexer_config(1, "bf16", "bf16"), dot="mfma"))
    specs.append(gpu_indexer_spec(indexer_config(1, "fp8_e4m3fn", "bf16"), dot="mfma", fp8_queries=True))
    specs += [gpu_indexer_spec(indexer_config(1, "fp8_e4m3fn", "bf16"), dot=dot, fp8_queries=True)
              for dot in ("mma-e4m3", "mma-bf16dot")]
    # runtime.Indexer's for an e4m3fn cache's e4m3fn queries (what the vLLM plugin serves it with)
    specs += indexer_set(indexer_config(1, "fp8_e4m3fn", "bf16"), "cuda", fp8_queries=True).specs()
    for kv in ("bf16", "fp8_e4m3fn"):  # runtime.Indexer's, and the benchmark's (both dots: its A/B)
        served = indexer_set(indexer_config(1, kv, "bf16"), "cuda")
        specs += served.specs()
        specs += [dataclasses.replace(s, dot=dot) for s in served.topk_gpu.values() for dot in GPU_INDEXER_DOTS]
        specs += [dataclasses.replace(s, dot=dot, rows=INDEXER_TILED.tile_rows(1, dot))
                  for s in served.topk_gpu_tiled.values() for dot in GPU_INDEXER_DOTS]
    # and the decode attends' graph variants (what a forward captured in a CUDA graph launches)
    specs += [s.for_graph() for s in specs if hasattr(s, "for_graph")]
    return list({s.name: s for s in specs}.values())


# ---- a call's operands as the launch-plan tests evaluate them (test_launch.py, test_hip_launch.py) ----

def index_operands(spec, tokens, columns):
    """(shapes, dtypes) of an indexer call: index_q, the index cache's storage, the index block
    table, req_id, abs_pos, (tiled) the tiles, (emit_table) the attend's block table, then topk,
    (emit_table) sparse_bt and sparse_ctx, and the workspace."""
    h, q8 = spec.cfg.num_kv_heads, spec.fp8_queries
    shapes = [(tokens, h, 128), (900, 16384), (4, columns), (tokens,), (tokens,)]
    dtypes = ["uint8" if q8 else "bfloat16", "uint8" if spec.cfg.is_fp8 else "bfloat16", "int32", "int32", "int32"]
    if spec.tiled:
        shapes, dtypes = shapes + [(-(-tokens // 64) + 3,)], dtypes + ["int32"]
    if spec.emit_table:
        shapes, dtypes = shapes + [(4, columns)], dtypes + ["int32"]
    shapes, dtypes = shapes + [(h, tokens, 16)], dtypes + ["int32"]
    if spec.emit_table:
        shapes, dtypes = shapes + [(tokens, h, 128), (tokens, h)], dtypes + ["int32", "int32"]
    return shapes + [(spec.workspace_floats(tokens, columns),)], dtypes + ["float32"]
