"""The GPU-level kernels (msa_iree/ops/templates/) on the CPU machine: they render, compile for CUDA and
gfx942, and the gfx942 ISA has the properties the MI300X targets need (benchmarks/PERF.md). Their numerics are tested on a
GPU by tests/test_gpu.py (the CPU cannot run them: llvm-cpu has no gpu.thread_id)."""
import dataclasses
import re
import subprocess

import pytest
from gpu_cases import with_e4m3_dot
from toolchain import MISSING, PTXAS

from msa_iree import compile as C
from msa_iree import ops as K
from msa_iree.config import MsaConfig
from msa_iree.ops.indexer import indexer_config
from msa_iree.ops.tuning import (ARRIVAL_COUNTERS, INDEXER as INDEXER_DECODE, INDEXER_MMA, INDEXER_TILED, TUNING,
                                 AttendTuning, IndexerTuning)
from msa_iree.inspect import kernel_report

DECODE = [K.SparseAttnDecodeFmaSpec(MsaConfig(kv_dtype="fp8_e4m3fnuz"), 16),
          K.SparseAttnDecodeFmaSpec(MsaConfig(kv_dtype="bf16", num_heads=8, decode_query_len=4), 8)]
INSERT = [K.InsertKvGpuSpec(MsaConfig(kv_dtype="fp8_e4m3fnuz", num_kv_heads=2), 16)]


def test_decode_attend_is_two_dispatches_with_the_table_build_fused():
    text = DECODE[0].render()
    main = text[text.index("func.func @main"):text.index("func.func private @attend")]
    attend = text[text.index("func.func private @attend"):]
    assert "func.call @attend" in main and "iree.abi.output = 0" in main
    assert len(re.findall(r"flow\.dispatch @", attend)) == 2  # split + merge, nothing else
    assert "topk" in attend and "%bt" in attend  # reads top-k and the block table itself


@pytest.mark.parametrize("spec", [K.SparseAttnDecodeMmaSpec(MsaConfig(), 16), K.SparseAttnPrefillMmaSpec(MsaConfig(), 8),
                                  K.SparseAttnDecodeMfmaSpec(MsaConfig(kv_dtype="fp8_e4m3fnuz"), 16),
                                  K.SparseAttnPagedMfmaEmulatedSpec(MsaConfig(), 16)], ids=lambda s: s.name)
def test_a_fused_merge_attend_is_one_dispatch_that_counts_its_splits(spec):
    """fused_merge (the matrix families' tuning rows): no @merge; @split counts a row's finished
    splits in the workspace's arrival counters (one atomic add, ordered with the partials'
    writes and reads), and the last one merges the row and sets the count back to 0."""
    assert spec.tuning.fused_merge and "fm" in spec.tag.split(".")
    text = spec.render()
    attend = text[text.index("func.func private @attend"):]
    assert re.findall(r"flow\.dispatch @(\w+)::@(\w+)", attend) == [("msa_decode", "split")]
    assert "func.func @merge" not in text
    split = text[text.index("func.func @split"):]
    fences = [m.start() for m in re.finditer(r"llvm\.fence", split)]
    count = split.index("llvm.atomicrmw add")
    if spec.family == "mfma" and not spec.emulate_mfma:  # gfx942: agent-scope fences around a relaxed count
        assert len(fences) == 2 and fences[0] < count < fences[1]
        assert re.search(r'llvm\.atomicrmw add [^\n]*syncscope\("agent"\) monotonic', split)
    else:  # CUDA: the count itself acquire-release at GPU scope
        assert not fences and re.search(r'llvm\.atomicrmw add [^\n]*syncscope\("device"\) acq_rel', split)
    assert re.search(r"memref\.store %c0_i32, %arrivals\[%row\]", split)


def test_the_decode_attends_graph_variant_is_the_two_dispatch_module():
    """for_graph: what a CUDA / HIP graph captures; with fused_merge the same attend without it
    (its own module and name, the same workspace bound), else the spec itself; a deployment's
    kernel set holds both for the matrix families' decode and page-table attends, not prefill."""
    fused = K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16)
    graph = fused.for_graph()
    assert fused.tuning.fused_merge and not graph.tuning.fused_merge
    assert graph.name == fused.name.replace(".fm", "").replace(".bt1024", ".mr4x2.bt1024")
    assert graph.workspace_floats(300) == fused.workspace_floats(300) and graph.for_graph() is graph
    fma = K.SparseAttnDecodeFmaSpec(MsaConfig(), 16)
    assert fma.for_graph() is fma
    for target, family in (("cuda", "mma"), ("gfx942", "mfma")):
        names = {s.name for s in K.kernel_set(MsaConfig(kv_dtype="fp8_e4m3fn"), target=target)}
        for spec in [s for s in K.kernel_set(MsaConfig(kv_dtype="fp8_e4m3fn"), target=target)
                     if getattr(s, "family", None) == family and not s.prefill]:
            assert spec.for_graph().name in names, spec.name


def test_the_inserting_decode_attend_writes_the_new_kv_before_its_first_page_read():
    """with_insert (forward(key=, value=) on a decode step): the one-dispatch decode attend that
    also takes key, value and slots after v_scale and writes the k/v page views in place (their
    results' storage), every store before the barrier ahead of the block loop; on gfx942 a
    workgroup fence on each side of it (its barrier orders LDS only). Only the matrix families'
    decode attends have one, their graph variants too (two dispatches, still inserting); a
    deployment's kernel set holds both for each decode L and layout."""
    for spec in (K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype="fp8_e4m3fn", decode_query_len=4), 8),
                 K.SparseAttnDecodeMfmaSpec(MsaConfig(kv_dtype="fp8_e4m3fnuz"), 16)):
        ins = spec.with_insert()
        assert ins.insert_kv and ins.name == spec.name + ".ins" and ins.written_operands == (-2, -1, 1, 2)
        text = ins.render()
        main = text[text.index("func.func @main"):text.index("func.func private @attend")]
        assert "%k: tensor<?x2048xi8> {iree.abi.output = 2 : index}" in main
        assert "%v: tensor<?x2048xi8> {iree.abi.output = 3 : index}" in main
        assert re.search(r"%vs: tensor<1x\?xf32>, %key: tensor<\?x1x128xbf16>, %value: tensor<\?x1x128xbf16>, "
                         r"%slots: tensor<\?xi32>", main)
        attend = text[text.index("func.func private @attend"):]
        assert re.findall(r"flow\.dispatch @(\w+)::@(\w+)", attend) == [("msa_decode", "split")]
        split = text[text.index("func.func @split"):]
        loop = split.index("scf.for %i = %e0 to %e1")
        barrier = split.rindex("gpu.barrier", 0, loop)
        stores = [m.start() for m in re.finditer(r"memref\.store %ins_q, %[kv]p\[", split)]
        assert len(stores) == 2 and max(stores) < barrier
        assert not re.search(r"memref\.(load|store)[^\n]*%[kv]p\[", split[:min(stores)])  # no page access before
        fences = re.findall(r'llvm\.fence syncscope\("workgroup"\) (\w+)', split[barrier - 200:barrier + 200])
        assert fences == (["release", "acquire"] if spec.family == "mfma" else [])
        assert spec.render() == dataclasses.replace(ins, insert_kv=False).render()
    for spec in (K.SparseAttnDecodeFmaSpec(MsaConfig(), 16), K.SparseAttnPrefillMmaSpec(MsaConfig(), 16),
                 K.SparseAttnPagedMmaSpec(MsaConfig(), 16)):
        assert spec.with_insert() is None, spec.name
    with pytest.raises(ValueError, match="insert_kv: expected only for a decode attend of the mma/mfma families"):
        K.SparseAttnDecodeFmaSpec(MsaConfig(), 16, insert_kv=True)
    with pytest.raises(ValueError, match="insert_kv: expected only for a decode attend of the mma/mfma families"):
        K.SparseAttnPrefillMmaSpec(MsaConfig(), 16, insert_kv=True)
    plain = K.SparseAttnDecodeMmaSpec(MsaConfig(), 16)
    graph = plain.with_insert().for_graph()  # the graph variant inserts too, in two dispatches
    assert graph == plain.for_graph().with_insert() and graph.name == plain.for_graph().name + ".ins"
    attend = graph.render()[graph.render().index("func.func private @attend"):]
    assert re.findall(r"flow\.dispatch @\w+::@(\w+)", attend) == ["split", "merge"]
    for target, family in (("cuda", "mma"), ("gfx942", "mfma")):
        specs = K.kernel_set(MsaConfig(kv_dtype="fp8_e4m3fn" if target == "cuda" else "fp8_e4m3fnuz"), target=target)
        inserting = [(s.stride, s.cfg.decode_query_len, s.tuning.fused_merge) for s in specs
                     if getattr(s, "insert_kv", False)]
        assert sorted(inserting) == sorted((st, L, fm) for st in (16, 8) for L in (1, 2, 3, 4) for fm in (False, True))
        assert all(s.family == family for s in specs if getattr(s, "insert_kv", False))


def test_fused_merge_is_refused_where_split_cannot_write_the_output():
    with pytest.raises(ValueError, match="tuning.fused_merge: expected only for the mma/mfma families"):
        K.SparseAttnDecodeFmaSpec(MsaConfig(), 16, AttendTuning(fused_merge=True))
    with pytest.raises(ValueError, match="expected rows split over workgroups only up to 128"):
        AttendTuning(splits=((256, 2),))


def test_specs_refuse_what_they_cannot_build():
    with pytest.raises(ValueError, match="num_heads / num_kv_heads"):
        K.SparseAttnDecodeFmaSpec(MsaConfig(num_heads=4), 16)
    with pytest.raises(ValueError, match="bt_preload: expected a multiple of 256 block-table columns, got 300"):
        K.SparseAttnDecodeMmaSpec(MsaConfig(), 16, AttendTuning(bt_preload=300))
    with pytest.raises(C.CompileError, match="expected a target in"):
        C.compiled_module(DECODE[0], "host")
    assert K.SparseAttnDecodeFmaSpec.output_storage
    names = {s.name for s in K.kernel_set(MsaConfig(), target="cuda")}
    assert K.SparseAttnDecodeFmaSpec(MsaConfig(), 16).name in names
    assert {K.SparseAttnPagedFmaSpec(MsaConfig(), 16).name, K.SparseAttnPagedMmaSpec(MsaConfig(), 16).name} <= names
    assert {s.stride for s in K.kernel_set(MsaConfig(), target="cuda") if getattr(s, "paged", False)} == {16}
    assert not any("gpu" in s.name for s in K.kernel_set(MsaConfig(), target="host"))


PAGED_CUDA = [K.SparseAttnPagedMmaSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16),
              K.SparseAttnPagedFmaSpec(MsaConfig(kv_dtype="bf16"), 16)]


INDEXER = [K.IndexTopkSpec(MsaConfig(kv_dtype="bf16")), K.IndexTopkSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16, 1, 1)]
GPU_INDEXER = [K.IndexTopkGpuSpec(MsaConfig(kv_dtype="bf16")),
               K.IndexTopkGpuSpec(MsaConfig(num_heads=64, num_kv_heads=4, kv_dtype="fp8_e4m3fn"), 16, 1, 1),
               K.IndexTopkGpuSpec(MsaConfig(kv_dtype="bf16"), 16, 0, 1, emit_table=True),
               K.IndexTopkGpuSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16, 0, 1, rows=4),
               K.IndexTopkGpuSpec(MsaConfig(num_heads=32, num_kv_heads=2, kv_dtype="bf16"), 16, 0, 1, rows=2),
               # query tiles (steps with prefills): 4 tokens a workgroup, and 2 of two index heads with the table
               K.IndexTopkGpuSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16, 0, 1, rows=4, tiled=True),
               K.IndexTopkGpuSpec(MsaConfig(num_heads=32, num_kv_heads=2, kv_dtype="bf16"), 16, 1, 1, emit_table=True,
                                  rows=2, tiled=True),
               # e4m3fn index queries (an e4m3fn cache's, as vLLM writes them)
               K.IndexTopkGpuSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16, 0, 1, rows=2, fp8_queries=True),
               K.IndexTopkGpuSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16, 1, 1, emit_table=True, rows=4, tiled=True,
                                  fp8_queries=True)]


# the index-cache insert (bf16 and e4m3fn caches from bf16 keys)
INDEX_INSERT = [K.IndexCacheInsertGpuSpec(MsaConfig(kv_dtype=kv)) for kv in ("bf16", "fp8_e4m3fn")]


# the tensor-core scoring (CUDA only)
GPU_INDEXER_MMA = [dataclasses.replace(s, dot="mma") for s in GPU_INDEXER]
# gfx942's matrix-core scoring (bf16 keys and queries): one token, a decode step's tokens (one and
# two index heads, with the table), query tiles of one and four index heads; and its CUDA twin
GPU_INDEXER_MFMA = [K.IndexTopkGpuSpec(MsaConfig(), 16, 0, 1, dot="mfma"),
                    K.IndexTopkGpuSpec(MsaConfig(), 16, 0, 1, rows=4, dot="mfma"),
                    K.IndexTopkGpuSpec(MsaConfig(num_heads=32, num_kv_heads=2), 16, 1, 1, emit_table=True, rows=2,
                                       dot="mfma"),
                    K.IndexTopkGpuSpec(MsaConfig(), 16, 1, 1, emit_table=True, rows=32, tiled=True, dot="mfma"),
                    K.IndexTopkGpuSpec(MsaConfig(num_heads=64, num_kv_heads=4), 16, 0, 1, rows=8, tiled=True,
                                       dot="mfma"),
                    # e4m3fn keys and queries (remapped to e4m3fnuz) on the fp8 MFMA
                    K.IndexTopkGpuSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16, 0, 1, dot="mfma", fp8_queries=True),
                    K.IndexTopkGpuSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16, 1, 1, emit_table=True, rows=32, tiled=True,
                                       dot="mfma", fp8_queries=True)]
GPU_INDEXER_MFMA_TWIN = [dataclasses.replace(s, emulate_mfma=True) for s in GPU_INDEXER_MFMA]


@pytest.mark.parametrize("spec", DECODE + INSERT + PAGED_CUDA + INDEXER + GPU_INDEXER + GPU_INDEXER_MMA + GPU_INDEXER_MFMA_TWIN
                         + INDEX_INSERT,
                         ids=lambda s: s.name)
def test_compiles_for_cuda(tmp_path, spec):
    manifest = C.build(None, ["cuda"], tmp_path, specs=[spec], log=lambda m: None)["cuda"]
    # the module holds the kernel's binary (the smallest, the index-cache insert, is about 8 KB)
    assert (manifest.parent / f"{spec.name}.vmfb").stat().st_size > 5_000


def test_gfx942_isa(tmp_path):
    """gfx942 (compiled, never run here): decode attend (FMA) = 2 dispatches, no scratch; bf16 K/V read
    with 16-byte loads (16 per block: 8 K + 8 V pages, plus the q loads); the insert = 1 dispatch
    without scratch."""
    bf16 = K.SparseAttnDecodeFmaSpec(MsaConfig(kv_dtype="bf16"), 16)
    C.build(None, ["gfx942"], tmp_path, specs=[DECODE[0], bf16] + INSERT, log=lambda m: None)
    report = {r["kernel"]: r for r in kernel_report(tmp_path)}
    for spec in (DECODE[0], bf16):
        attend = report[spec.name]
        assert attend["dispatches"] == 2
        split = next(f for f in attend["functions"] if f["function"] == "split")
        assert split["scratch_bytes"] == 0
    bf16_split = next(f for f in report[bf16.name]["functions"] if f["function"] == "split")
    assert bf16_split["global_load_x4"] >= 16 + 16  # 16 q loads, 16 K/V page loads
    insert = report[INSERT[0].name]
    assert insert["dispatches"] == 1 and insert["functions"][0]["scratch_bytes"] == 0


MFMA = [K.SparseAttnDecodeMfmaSpec(MsaConfig(kv_dtype="bf16"), 16),
        K.SparseAttnPrefillMfmaSpec(MsaConfig(kv_dtype="fp16", query_dtype="fp16"), 8),
        K.SparseAttnDecodeMfmaSpec(MsaConfig(kv_dtype="fp8_e4m3fnuz"), 16),
        K.SparseAttnPrefillMfmaSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 8),
        K.SparseAttnDecodeMfmaSpec(MsaConfig(num_heads=8, kv_dtype="bf16", decode_query_len=4), 8),
        K.SparseAttnDecodeMfmaSpec(MsaConfig(kv_dtype="fp8_e4m3fnuz"), 16).with_insert(),
        K.SparseAttnDecodeMfmaSpec(MsaConfig(num_heads=8, kv_dtype="bf16", decode_query_len=4), 8).with_insert()]


def test_gfx942_mfma_isa(tmp_path):
    """gfx942's MFMA attend (compiled, never run here; its numerics run on CUDA as the emulated
    twin, tests/test_gpu.py): 1 dispatch (fused_merge), both products on the matrix cores (16 QK + 16 PV MFMAs
    a block), no scratch, >= 4 waves per SIMD counting registers and LDS, every K/V load 16 bytes
    (bf16/f16: 8 K + 8 V a block, plus q's one copy into LDS; fp8: 4 K + 4 V, V traded between
    lane pairs), no 8-byte loads before the fused merge; the same with the KV insert fused in
    (with_insert). e4m3fnuz (gfx942's fp8) converts in hardware: 2 v_cvt_pk_f32_fp8
    per K/V word (16 K + 16 V words a block); e4m3fn decodes by integer ops. q's copy into LDS is
    requested with the page-id loads, before the first barrier (SparseAttnDecodeMfmaSpec.q_first:
    after it, its wait put a memory round trip before the first block's K loads)."""
    C.build(None, ["gfx942"], tmp_path, specs=MFMA, log=lambda m: None)
    report = {r["kernel"]: r for r in kernel_report(tmp_path)}
    for spec in MFMA:
        attend = report[spec.name]
        assert attend["dispatches"] == 1
        split = next(f for f in attend["functions"] if f["function"] == "split")
        assert split["mfma"] == 32
        assert split["scratch_bytes"] == 0 and split["scratch_ops"] == 0
        assert split["waves_per_simd"] >= 4, split
        assert split["global_load_x4"] >= (4 + 4 + 1 if spec.cfg.is_fp8 else 17), split
        asm = "".join(f.read_text() for f in (tmp_path / "isa" / spec.name).glob("*.rocmasm"))
        split_asm = asm[asm.index("\nsplit:"):]
        # 8-byte loads only in the fused merge after the arrival count (its (m, l) pairs)
        assert "global_load_dwordx2" not in split_asm[:split_asm.index("global_atomic_add")], spec.name
        assert split["cvt_fp8"] == (64 if spec.cfg.kv_dtype == "fp8_e4m3fnuz" else 0), split
        assert "global_load_dwordx4" in split_asm[:split_asm.index("s_barrier")], spec.name


PAGED = [K.SparseAttnPagedMfmaSpec(MsaConfig(kv_dtype="fp8_e4m3fnuz"), 16),
         K.SparseAttnPagedMfmaSpec(MsaConfig(kv_dtype="bf16"), 16), K.SparseAttnPagedFmaSpec(MsaConfig(kv_dtype="bf16"), 16)]


def test_the_portable_indexer_compiles_for_gfx942(tmp_path):
    """The indexer's scores and top-k (ops/indexer.py, the portable formulation) for gfx942:
    compiled, never run here."""
    manifest = C.build(None, ["gfx942"], tmp_path, specs=INDEXER[:1], log=lambda m: None)["gfx942"]
    assert (manifest.parent / f"{INDEXER[0].name}.vmfb").stat().st_size > 10_000


def _gfx942_indexer_functions(tmp_path, specs):
    """Build `specs` for gfx942 and check what every GPU indexer there has: two dispatches (@score,
    @merge), no scratch, >= 4 waves per SIMD; yield each spec with its functions' ISA report."""
    C.build(None, ["gfx942"], tmp_path, specs=specs, log=lambda m: None)
    report = {r["kernel"]: r for r in kernel_report(tmp_path)}
    for spec in specs:
        functions = {f["function"]: f for f in report[spec.name]["functions"]}
        assert report[spec.name]["dispatches"] == 2 and set(functions) == {"score", "merge"}
        for f in functions.values():
            assert f["scratch_bytes"] == 0 and f["scratch_ops"] == 0 and f["waves_per_simd"] >= 4, (spec.name, f)
        yield spec, functions


def test_gfx942_indexer_isa(tmp_path):
    """The hand-written indexer on gfx942 (compiled, never run here), with and without the table
    emission, one token or a decode step's tokens of a request a workgroup: two dispatches, no
    scratch, >= 4 waves per SIMD, the keys read in 16-byte loads, no score tensor between the
    dispatches (@merge reads only the picks and each row's split count)."""
    for spec, functions in _gfx942_indexer_functions(tmp_path, GPU_INDEXER):
        loads = spec.tuning_row.loads_for(spec.rows, spec.cfg.num_kv_heads, spec.cfg.is_fp8)
        assert functions["score"]["global_load_x4"] >= loads, functions["score"]
    text = GPU_INDEXER[0].render()
    merge = text[text.index("func.func @merge"):text.index("func.func @main")]
    # a pick's key (%at*) and block id (%ati*) of each of a lane's 4 entries, and the row's
    # split count (%rec_at), nothing else
    assert sorted(re.findall(r"memref\.load %ws\[(%\w+)\]", merge)) == sorted(
        [f"%at{e}" for e in range(4)] + [f"%ati{e}" for e in range(4)] + ["%rec_at"])


def test_gfx942_mfma_indexer_isa(tmp_path):
    """gfx942's MFMA indexer (compiled, never run here; its numerics run on CUDA as the emulated
    twin): two dispatches, no scratch, >= 4 waves per SIMD, @score's dot products all on
    v_mfma_f32_16x16x16_bf16 or, e4m3fn, v_mfma_f32_16x16x32_fp8_fp8 (a block's 8 / 4 k-steps a
    tile for each group of 16 columns, at least the tiles of one loop step) with no lane-wise
    products nor fp8 conversions, the keys and queries in 16-byte loads (a tile's 4 / 2 a lane,
    and each column group's), @merge with no MFMA."""
    for spec, functions in _gfx942_indexer_functions(tmp_path, GPU_INDEXER_MFMA):
        groups = -(-spec.rows * spec.cfg.num_kv_heads // 16)
        tiles, loads = spec.tuning_row.mfma_tiles, 2 if spec.cfg.is_fp8 else 4
        score = functions["score"]
        assert score["mfma"] >= 2 * loads * groups * tiles and functions["merge"]["mfma"] == 0, (spec.name, score)
        assert score["global_load_x4"] >= loads * (tiles + groups) and score["cvt_fp8"] == 0, (spec.name, score)
        text = "".join(f.read_text() for f in (tmp_path / "isa" / spec.name).glob("*.rocmasm"))
        body = text[text.index("\nscore:"):]
        body = body[:body.index("\nmerge:")] if "\nmerge:" in body else body
        mfma = "v_mfma_f32_16x16x32_fp8_fp8" if spec.cfg.is_fp8 else "v_mfma_f32_16x16x16_bf16"
        assert set(re.findall(r"v_mfma\w*", body)) == {mfma}
        # (the lane-wise score has 36-68 f32 multiplies and FMAs; the split count's 64-bit
        # division a few)
        assert len(re.findall(r"v_(pk_)?(fma|fmac|mul)_f32", body)) < 16, spec.name


def test_the_mfma_indexer_is_gfx942s_and_its_twin_cudas():
    """dot="mfma" compiles for gfx942 only and emulate_mfma (its twin) for CUDA only (sm_89 for
    its fp8 operands' conversion), each named apart; both take bf16 keys and queries or e4m3fn
    keys and queries only; gfx942 serves it (tuning.INDEXER_DOT) for a decode step's tokens
    together, query tiles and e4m3fn keys with e4m3fn queries, lane-wise otherwise; the tuning
    knobs refuse what the template cannot tile."""
    native, twin = GPU_INDEXER_MFMA[3], GPU_INDEXER_MFMA_TWIN[3]
    with pytest.raises(ValueError, match="target: dot='mfma' compiles for gfx942, got cuda"):
        native.target_flags("cuda")
    with pytest.raises(ValueError, match="target: dot='mfma' with emulate_mfma compiles for cuda, got gfx942"):
        twin.target_flags("gfx942")
    assert native.name.endswith(".mfma2wpe4.t32.emit") and twin.name.endswith(".mfma2emu.t32.emit")
    assert "rocdl.waves_per_eu = 4 : i32" in native.render() and "waves_per_eu" not in twin.render()
    assert "llvm.amdgcn.mfma" in native.render() and "llvm.amdgcn.mfma" not in twin.render()
    with pytest.raises(ValueError, match="kv_dtype, query_dtype: expected a bf16 index cache with bf16 index queries "
                                         "or an fp8_e4m3fn one with fp8_e4m3fn queries .* got fp8_e4m3fn, bf16"):
        K.IndexTopkGpuSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), dot="mfma")
    assert GPU_INDEXER_MFMA_TWIN[5].cuda_arch == 89 and GPU_INDEXER_MFMA_TWIN[0].cuda_arch is None
    assert "llvm.amdgcn.mfma.f32.16x16x32.fp8.fp8" in GPU_INDEXER_MFMA[5].render()
    with pytest.raises(ValueError, match="kv_dtype, query_dtype: .* got bf16, fp16"):
        K.IndexTopkGpuSpec(MsaConfig(query_dtype="fp16"), dot="mfma")
    with pytest.raises(ValueError, match="emulate_mfma: expected dot='mfma' .* got dot='mma'"):
        K.IndexTopkGpuSpec(MsaConfig(), dot="mma", emulate_mfma=True)
    with pytest.raises(ValueError, match="rows: expected a divisor of the 64-token query tile with rows x index heads "
                                         "<= 64 for tiled=True and dot='mfma', got 128 with 1"):
        K.IndexTopkGpuSpec(MsaConfig(), rows=128, tiled=True, dot="mfma")
    with pytest.raises(ValueError, match="IndexerTuning.mfma_tiles, tile_row_heads_mfma: .* got 3, 32"):
        IndexerTuning(mfma_tiles=3)
    with pytest.raises(ValueError, match="IndexerTuning.mfma_tiles, tile_row_heads_mfma: .* got 2, 8"):
        IndexerTuning(tile_row_heads_mfma=8)
    assert INDEXER_TILED.tile_rows(1, "mfma") == 32 and INDEXER_TILED.tile_rows(4, "mfma") == 8
    bf16 = K.indexer_set(MsaConfig(), "gfx942")
    assert (bf16.gpu(1).dot, bf16.gpu(4).dot, bf16.gpu_tiled().dot) == ("fma", "mfma", "mfma")
    fp8q = K.indexer_set(MsaConfig(kv_dtype="fp8_e4m3fn"), "gfx942", fp8_queries=True)
    assert {s.dot for s in fp8q.topk_gpu.values()} | {fp8q.gpu_tiled().dot} == {"mfma"}
    fp8 = K.indexer_set(MsaConfig(kv_dtype="fp8_e4m3fn"), "gfx942")  # bf16 queries: no MFMA takes them
    assert {s.dot for s in fp8.topk_gpu.values()} | {fp8.gpu_tiled().dot} == {"fma"}
    assert K.indexer_dot(MsaConfig(query_dtype="fp16"), "gfx942", 4) == "fma"
    assert K.indexer_dot(MsaConfig(), "cuda", 4) == "mma"


def test_gfx942_serves_the_mfma_indexer_only_in_shapes_its_twin_runs():
    """Every MFMA indexer kernel gfx942 serves (1, 2 and 4 index heads; bf16, and e4m3fn with
    e4m3fn queries; decode L 1-4 and query tiles) has an emulated twin of its shape (index heads,
    dtypes, tokens a workgroup, tiled) among the kernels the GPU tests run on CUDA."""
    from gpu_cases import gpu_test_specs

    def shape(s):
        return s.cfg.num_kv_heads, s.cfg.kv_dtype, s.fp8_queries, s.rows, s.tiled

    twins = {shape(s) for s in gpu_test_specs() if isinstance(s, K.IndexTopkGpuSpec) and s.emulate_mfma}
    served = {shape(s) for heads in (1, 2, 4) for kv, q8 in (("bf16", False), ("fp8_e4m3fn", True))
              for s in K.indexer_set(indexer_config(heads, kv, "bf16"), "gfx942", fp8_queries=q8).specs()
              if getattr(s, "dot", None) == "mfma"}
    assert len(served) == 17 and served <= twins, sorted(served - twins)


def test_gfx942_index_insert_isa(tmp_path):
    """The index-cache insert on gfx942 (compiled, never run here): one dispatch, no scratch, no LDS."""
    C.build(None, ["gfx942"], tmp_path, specs=INDEX_INSERT, log=lambda m: None)
    report = {r["kernel"]: r for r in kernel_report(tmp_path)}
    for spec in INDEX_INSERT:
        (f,) = report[spec.name]["functions"]
        assert report[spec.name]["dispatches"] == 1 and f["function"] == "insert", report[spec.name]
        assert f["scratch_bytes"] == 0 and f["scratch_ops"] == 0 and f["lds_bytes"] == 0, f


@pytest.mark.parametrize("spec", [GPU_INDEXER_MMA[0], GPU_INDEXER_MMA[3], GPU_INDEXER_MMA[7],
                                  with_e4m3_dot(GPU_INDEXER_MMA[7], False)], ids=lambda s: s.name)
def test_the_mma_indexer_ptx_scores_on_tensor_cores(tmp_path, spec):
    """dot="mma": @score's 8 k-steps a tile of 16 positions as bf16 m16n8k16, TILES tiles a loop
    step, the keys in 16-byte loads; fp8 keys (and fp8_queries' queries: 8 conversions for each of
    their 2 chunks of 16 bytes) converted by cvt.rn.f16x2.e4m3x2 (sm_89) and moved to bf16 without
    IREE's rounding emulation (whose NaN constant 0x7FC0 would show); e4m3fn queries over e4m3fn
    keys on the e4m3 dot (the served row's mma_e4m3_dot): 4 k-steps of m16n8k32 e4m3 a tile and
    nothing converted; no lane-wise products (fma.rn.f32) left in the score."""
    ptx, score = _entry_ptx(tmp_path, spec, "score")
    tiles = spec.tiles
    chunks = 2 * (4 if not spec.cfg.is_fp8 else 2)   # a tile's two positions, 16 bytes a chunk
    assert score.count("ld.global.nc.v4") >= chunks * tiles
    assert "fma.rn.f32" not in score and "0x7FC0" not in score
    assert spec.e4m3_dot == (spec.fp8_queries and spec.tuning_row.mma_e4m3_dot)
    if spec.e4m3_dot:
        assert score.count("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32") == 4 * tiles
        assert "m16n8k16" not in score and "cvt.rn.f16x2.e4m3x2" not in score and ".target sm_89" in ptx
        return
    assert score.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 8 * tiles
    if spec.cfg.is_fp8:
        queries = 2 * 8 if spec.fp8_queries else 0  # (one column group: rows x heads <= 8)
        assert ".target sm_89" in ptx and score.count("cvt.rn.f16x2.e4m3x2") == 2 * 2 * 8 * tiles + queries
    else:
        assert ".target sm_80" in ptx and "cvt.rn.f16x2.e4m3x2" not in score


def _ptxas_report(tmp_path, ptx) -> dict:
    """{entry: ptxas's -v report of it} for the module's PTX assembled for sm_90 (which must succeed)."""
    path = tmp_path / "k.ptx"
    path.write_text(ptx)
    run = subprocess.run([PTXAS, "-arch=sm_90", "-v", str(path), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return {e.split("'")[1]: e for e in run.stderr.split("Compiling entry function ")[1:]}


@pytest.mark.skipif(PTXAS is None, reason=MISSING)
@pytest.mark.parametrize("kv, rows, fp8_queries", [("bf16", 1, False), ("bf16", 4, False), ("fp8_e4m3fn", 1, False),
                                                   ("fp8_e4m3fn", 1, True), ("fp8_e4m3fn", 4, True)])
def test_the_decode_indexer_scores_without_spills(tmp_path, kv, rows, fp8_queries):
    """The served decode @score on tensor cores (two workgroups an SM: at most 128 registers)
    holds everything in registers for sm_90: the split size reaches it through a lane-0 shuffle,
    where a size LLVM could bound (at least MIN_BPS) had ptxas spill the bf16 score at 128
    registers (1.26-1.33x slower on the H200, benchmarks/PERF.md); e4m3fn queries on the e4m3 dot
    with mma_tiles_e4m3 tiles in flight."""
    spec = K.IndexTopkGpuSpec(MsaConfig(kv_dtype=kv), 16, 0, 1, rows=rows, dot="mma", fp8_queries=fp8_queries)
    ptx, score = _entry_ptx(tmp_path, spec, "score")
    report = _ptxas_report(tmp_path, ptx)["score"]
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert "shfl.sync.idx" in score


# the tiled launches CUDA serves for an e4m3fn index cache: bf16 queries, e4m3fn queries (vLLM's:
# on the e4m3 dot, and converted for the bf16 dot)
TILED_FP8 = K.IndexTopkGpuSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16, 0, 1, rows=64, tiled=True, dot="mma")
TILED_FP8_QUERIES = dataclasses.replace(TILED_FP8, fp8_queries=True)
TILED_LDS = [TILED_FP8, with_e4m3_dot(TILED_FP8_QUERIES, True), with_e4m3_dot(TILED_FP8_QUERIES, False)]
TILED_LDS_IDS = ["bf16_queries", "fp8_queries_e4m3_dot", "fp8_queries_bf16_dot"]


@pytest.mark.parametrize("spec", TILED_LDS, ids=TILED_LDS_IDS)
def test_a_tiled_mma_indexer_over_fp8_keys_takes_its_queries_from_lds(tmp_path, spec):
    """INDEXER_TILED's mma_queries_lds_fp8: the tiled workgroup's 64 columns are one team's (8 groups
    of the mma's 8), their B fragments staged once (one 8-byte LDS store an entry; e4m3fn queries
    for the bf16 dot converted there, 4 bytes in two conversions) and read per tile (one 8-byte LDS
    load a fragment, inside the tile loop: 8 groups x 8 k-steps of m16n8k16 bf16 a tile, or on the
    e4m3 dot 8 x 4 of m16n8k32 e4m3, its keys not converted), so each block's keys are read (and
    converted) once; bf16 keys keep their queries in registers (two teams a block)."""
    assert spec.queries_in_lds and spec.column_sets == 1 and spec.tiles == 1 and ".qlds" in spec.name
    bf16 = dataclasses.replace(spec, cfg=MsaConfig(kv_dtype="bf16"), fp8_queries=False)
    assert not bf16.queries_in_lds and bf16.column_sets == 2 and ".qlds" not in bf16.name
    _, score = _entry_ptx(tmp_path, spec, "score")
    steps = 4 if spec.e4m3_dot else 8
    mma = "m16n8k32.row.col.f32.e4m3.e4m3" if spec.e4m3_dot else "m16n8k16.row.col.f32.bf16.bf16"
    assert score.count(f"mma.sync.aligned.{mma}.f32") == 8 * steps
    assert score.count("ld.shared.v2.b32") == 8 * steps and score.count("st.shared.b64") == 1
    # bf16 dot: one tile's two chunks of 16 keys a lane, and (e4m3fn queries) the staging loop's 4 bytes
    converted = 0 if spec.e4m3_dot else 2 * 2 * 8 + (2 if spec.fp8_queries else 0)
    assert score.count("cvt.rn.f16x2.e4m3x2") == converted


@pytest.mark.skipif(PTXAS is None, reason=MISSING)
@pytest.mark.parametrize("spec", [TILED_FP8, TILED_FP8_QUERIES], ids=["bf16_queries", "fp8_queries"])
def test_a_tiled_indexer_with_its_queries_in_lds_scores_without_spills(tmp_path, spec):
    """... and at two workgroups an SM (128 registers) ptxas keeps all of it in registers for sm_90."""
    ptx, _ = _entry_ptx(tmp_path, spec, "score")
    report = _ptxas_report(tmp_path, ptx)["score"]
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report


def test_cuda_serves_e4m3fn_queries_on_the_e4m3_dot_in_decode_and_from_lds_in_query_tiles():
    """The tuning rows' choice for e4m3fn queries over an e4m3fn cache: a decode step on the e4m3
    dot (queries in registers, mma_tiles_e4m3 tiles), query tiles on the bf16 dot with the queries
    converted as they are staged in LDS (decision record in benchmarks/PERF.md)."""
    served = K.indexer_set(MsaConfig(kv_dtype="fp8_e4m3fn"), "cuda", fp8_queries=True)
    assert all(s.e4m3_dot and not s.queries_in_lds and s.tiles == 2 for s in served.topk_gpu.values())
    assert all(not s.e4m3_dot and s.queries_in_lds for s in served.topk_gpu_tiled.values())


def test_the_mma_indexer_is_cuda_only_and_cuda_serves_it():
    with pytest.raises(ValueError, match="target: dot='mma' compiles for cuda, got gfx942"):
        GPU_INDEXER_MMA[0].target_flags("gfx942")
    with pytest.raises(ValueError, match="dot: expected one of \\['fma', 'mfma', 'mma'\\], got 'wmma'"):
        K.IndexTopkGpuSpec(MsaConfig(), dot="wmma")
    with pytest.raises(ValueError, match="query_dtype: expected bf16 index queries for dot='mma'"):
        K.IndexTopkGpuSpec(MsaConfig(query_dtype="fp16"), dot="mma")

    def dots(cfg, target):
        return {(rows, s.dot) for (rows, _), s in K.indexer_set(cfg, target).topk_gpu.items()}

    # CUDA: fp8 keys on tensor cores; bf16 keys so when a request's tokens share the loads
    assert dots(MsaConfig(kv_dtype="fp8_e4m3fn"), "cuda") == {(r, "mma") for r in (1, 2, 3, 4)}
    assert dots(MsaConfig(), "cuda") == {(1, "fma")} | {(r, "mma") for r in (2, 3, 4)}
    assert dots(MsaConfig(kv_dtype="fp8_e4m3fn"), "gfx942") == {(r, "fma") for r in (1, 2, 3, 4)}
    assert {dot for _, dot in dots(MsaConfig(query_dtype="fp16"), "cuda")} == {"fma"}
    assert GPU_INDEXER_MMA[0].name != GPU_INDEXER[0].name and ".mma1" in GPU_INDEXER_MMA[0].name
    # query tiles: CUDA's tensor cores take 64 (token, head) pairs (two teams' 4 groups of their 8
    # columns), gfx942's matrix cores 32 (bf16), the lane-wise dot 4 (gfx942's e4m3fn keys with
    # bf16 queries); a tile of one token a workgroup is the untiled kernel
    tiled = {(h, kv, target): K.indexer_set(MsaConfig(num_heads=16 * h, num_kv_heads=h, kv_dtype=kv), target).gpu_tiled()
             for h in (1, 2, 4) for kv in ("bf16", "fp8_e4m3fn") for target in ("cuda", "gfx942")}
    assert {k: (s.rows, s.dot) for k, s in tiled.items() if s is not None} == {
        **{(h, kv, "cuda"): (64 // h, "mma") for h in (1, 2, 4) for kv in ("bf16", "fp8_e4m3fn")},
        **{(h, "bf16", "gfx942"): (32 // h, "mfma") for h in (1, 2, 4)},
        **{(h, "fp8_e4m3fn", "gfx942"): (4 // h, "fma") for h in (1, 2)}}
    assert tiled[4, "fp8_e4m3fn", "gfx942"] is None
    served = K.indexer_set(MsaConfig(), "cuda")
    assert served.gpu_tiled(True).emit_table and served.gpu_tiled(True) in served.specs()
    assert served.gpu_tiled().name.endswith(".b16s64m8x16.mma1cta2.t64") and served.gpu_tiled() in served.specs()
    # a tiled launch takes the tiled row of the tuning table, an untiled one the decode row of its dot
    assert served.gpu_tiled().tuning_row is INDEXER_TILED and served.gpu().tuning_row is INDEXER_DECODE
    assert served.gpu(4).tuning_row is INDEXER_MMA and ".b16s64g1024.mma1cta2.gm.r4" in served.gpu(4).name
    assert K.indexer_set(MsaConfig(), "gfx942").gpu(4).tuning_row is INDEXER_DECODE  # (mfma)
    assert all(s.tuning_row is INDEXER_TILED for s in (tiled[1, "bf16", "gfx942"], tiled[1, "fp8_e4m3fn", "cuda"]))


def test_an_indexer_spec_with_another_dot_takes_that_dots_row():
    """The knobs in effect follow the launch (dot, tiled) unless a row is given: a spec copied
    with another dot takes that dot's row, and a given row stays with the copy."""
    fma = K.IndexTopkGpuSpec(MsaConfig(), dot="fma")
    assert fma.tuning is None and fma.tuning_row is INDEXER_DECODE
    mma = dataclasses.replace(fma, dot="mma")
    assert mma.tuning_row is INDEXER_MMA and "g1024.mma" in mma.name and "g1024" not in fma.name
    assert dataclasses.replace(mma, dot="fma", rows=4, tiled=True).tuning_row is INDEXER_TILED
    given = dataclasses.replace(INDEXER_MMA, min_ctas_per_sm=1)
    assert dataclasses.replace(K.IndexTopkGpuSpec(MsaConfig(), dot="mma", tuning=given), dot="fma").tuning_row is given


def test_the_indexer_asks_ptxas_for_workgroups_per_sm_on_tensor_cores_only():
    """min_ctas_per_sm reaches @score as nvvm.minctasm for dot="mma" (CUDA), never on the
    lane-wise dot (which gfx942 compiles too), and names the variant."""
    mma = K.IndexTopkGpuSpec(MsaConfig(), rows=32, tiled=True, dot="mma")
    fma = K.IndexTopkGpuSpec(MsaConfig(), rows=4, tiled=True, dot="fma")
    assert mma.tuning_row.min_ctas_per_sm == 2 and fma.tuning_row.min_ctas_per_sm == 2
    assert mma.render().count("nvvm.minctasm = 2 : i32") == 1 and "minctasm" not in fma.render()
    none = dataclasses.replace(mma, tuning=dataclasses.replace(INDEXER_DECODE, min_ctas_per_sm=None))
    assert "minctasm" not in none.render() and "cta" not in none.name.split(".")[-2]
    with pytest.raises(ValueError, match="IndexerTuning.min_ctas_per_sm: expected None or 1..8 .* got 0"):
        IndexerTuning(min_ctas_per_sm=0)


def test_a_decode_indexers_groups_run_along_x_and_a_tiled_launchs_splits():
    """group_major: a decode launch's groups along the grid's x (every group's first split
    dispatched before any second, the working workgroups of a wide table's before its idle
    ones), a tiled launch's splits along x (they fetch one request's keys from DRAM together);
    the name says which."""
    decode = K.IndexTopkGpuSpec(MsaConfig(), dot="mma")
    tiled = K.IndexTopkGpuSpec(MsaConfig(), rows=64, tiled=True, dot="mma")
    assert decode.tuning_row.group_major and not tiled.tuning_row.group_major
    d, t = decode.render(), tiled.render()
    assert "%group = gpu.block_id x" in d and "%split = gpu.block_id y" in d and "@score[%G, %SG]" in d
    assert "%split = gpu.block_id x" in t and "%group = gpu.block_id y" in t and "@score[%S, %G]" in t
    assert decode.name.endswith(".mma1cta2.gm") and ".gm" not in tiled.name


def test_the_indexer_merges_several_rows_a_workgroup_in_tiled_launches_only():
    """merge_rows reaches @merge as the fewest teams a row (8 / merge_rows) and
    merge_splits_per_team as a team's splits: a tiled launch shares a workgroup's 8 teams between
    up to 8 rows, 16 splits a team, and names both (m8x16); a decode launch keeps one row a
    workgroup and 8 splits a team; the knobs refuse what 8 teams cannot split."""
    tiled = K.IndexTopkGpuSpec(MsaConfig(), rows=64, tiled=True, dot="mma")
    decode = K.IndexTopkGpuSpec(MsaConfig(), dot="mma")
    assert (tiled.tuning_row.merge_rows, tiled.tuning_row.merge_splits_per_team) == (8, 16)
    assert (decode.tuning_row.merge_rows, decode.tuning_row.merge_splits_per_team) == (1, 8)
    t, d = tiled.render(), decode.render()
    assert "%mr_least = arith.constant 1 : index" in t and "%mr_spt = arith.constant 16 : index" in t
    assert "%mr_least = arith.constant 8 : index" in d and "%mr_spt = arith.constant 8 : index" in d
    assert ".b16s64m8x16." in tiled.name and ".b16s64g1024.mma" in decode.name
    with pytest.raises(ValueError, match="IndexerTuning.merge_rows: expected 1, 2, 4 or 8 .* got 3"):
        IndexerTuning(merge_rows=3)
    with pytest.raises(ValueError, match="IndexerTuning.merge_splits_per_team: expected 8 or 16 .* got 12"):
        IndexerTuning(merge_splits_per_team=12)


def test_the_indexer_splits_each_request_by_its_own_candidates():
    """The template's rule as the spec states it: a group of C candidate blocks splits into
    MIN_BPS blocks a split up to MAX_SPLITS splits, then as many as fit MAX_SPLITS, whatever
    the table's width (vLLM's is as wide as its longest context); every candidate is in a split,
    no split is empty, and the grid's splits for any width cover every row it can hold (513
    columns hold a row of 512 candidates: 64 splits of 8, not 57 of 9)."""
    t = GPU_INDEXER[0].tuning_row
    assert (t.min_blocks_per_split, t.max_splits) == (8, 64)
    for row in (t, INDEXER_MMA, INDEXER_TILED):  # every row of the table (8 and 16 blocks a split)
        for cols in [1, 7, 8, 9, 15, 16, 17, 511, 512, 513, 1000, 1024, 1025, 4095, 8192]:
            assert row.splits(cols) <= row.max_splits
            for cand in sorted({1, 7, 8, 9, 16, 17, 32, 511, 512, 513, 1024, 1025, cols // 2 + 1, cols - 1, cols} - {0}):
                if cand > cols:
                    continue
                bps = row.blocks_per_split(cand)
                splits = -(-cand // bps)
                assert bps <= 128 and splits <= row.splits(cols) and (splits - 1) * bps < cand <= splits * bps, \
                    (row.min_blocks_per_split, cols, cand)
    assert [t.blocks_per_split(c) for c in (32, 512, 513, 8192)] == [8, 8, 9, 128]
    assert [t.splits(c) for c in (1, 32, 512, 513, 8192)] == [1, 4, 64, 64, 64]
    # each (token, head, split)'s 16 keys and 16 ids, then a split count per token
    assert GPU_INDEXER[0].workspace_floats(3, 64) == 2 * 3 * 1 * 8 * 16 + 3


def test_the_gpu_indexer_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="num_kv_heads: expected index heads per rank in \\(1, 2, 4\\) for the GPU "
                                         "indexer, got 3"):
        K.IndexTopkGpuSpec(MsaConfig(num_heads=48, num_kv_heads=3))
    with pytest.raises(ValueError, match="kv_dtype: expected an index cache of bf16 or fp8_e4m3fn, got fp8_e4m3fnuz"):
        K.IndexTopkGpuSpec(MsaConfig(kv_dtype="fp8_e4m3fnuz"))
    with pytest.raises(ValueError, match="IndexerTuning.tile_row_heads_mma: expected 8, 16, 32 or 64 .* got 24"):
        IndexerTuning(tile_row_heads_mma=24)
    with pytest.raises(ValueError, match="IndexerTuning.key_loads: expected a divisor of 32"):
        K.IndexTopkGpuSpec(MsaConfig(), 16, 0, 1, IndexerTuning(key_loads=6))
    assert K.IndexTopkGpuSpec(MsaConfig(), 16, 0, 1, IndexerTuning(key_loads=4)).name != GPU_INDEXER[0].name
    assert K.indexer_set(MsaConfig(), "host").topk_gpu == {}
    gfx = K.indexer_set(MsaConfig(), "gfx942")
    assert gfx.gpu().name == GPU_INDEXER[0].name and gfx.gpu(1, True).name == GPU_INDEXER[2].name
    # one index head: each L's tokens together; two: pairs (4 (token, head) pairs at most)
    assert sorted({rows for rows, _ in gfx.topk_gpu}) == [1, 2, 3, 4]
    assert sorted({rows for rows, _ in K.indexer_set(MsaConfig(num_heads=32, num_kv_heads=2), "cuda").topk_gpu}) == [1, 2]
    with pytest.raises(ValueError, match="rows: expected 1..4 tokens a workgroup with rows x index heads <= 8"):
        K.IndexTopkGpuSpec(MsaConfig(num_heads=64, num_kv_heads=4), rows=3)
    with pytest.raises(ValueError, match="rows: expected 1..4 tokens a workgroup .* got 8 with 1"):
        K.IndexTopkGpuSpec(MsaConfig(), rows=8)
    with pytest.raises(ValueError, match="rows: expected a divisor of the 64-token query tile with rows x index heads "
                                         "<= 8 for tiled=True and dot='fma', got 3 with 1 index heads"):
        K.IndexTopkGpuSpec(MsaConfig(), rows=3, tiled=True)
    with pytest.raises(ValueError, match="rows: expected a divisor of the 64-token query tile .* got 8 with 2 index heads"):
        K.IndexTopkGpuSpec(MsaConfig(num_heads=32, num_kv_heads=2), rows=8, tiled=True)
    with pytest.raises(ValueError, match="<= 64 for tiled=True and dot='mma', got 64 with 2 index heads"):
        K.IndexTopkGpuSpec(MsaConfig(num_heads=32, num_kv_heads=2), rows=64, tiled=True, dot="mma")
    assert K.IndexTopkGpuSpec(MsaConfig(), rows=8, tiled=True).name.endswith(".t8")


def test_gfx942_paged_attend_isa(tmp_path):
    """The attend over a given page table (the indexer's emitted table) on gfx942 (compiled, never
    run here): it reads the table, not top-k, a block table or positions; the same dispatches (FMA:
    two, MFMA: one) and no scratch; the MFMA variant keeps its 32 MFMAs a block and >= 4 waves per SIMD."""
    for spec in PAGED:
        attend = spec.render()
        attend = attend[attend.index("func.func private @attend"):]
        assert "%sbt" in attend and "%sctx" in attend and "%topk" not in attend and "%bt," not in attend
    C.build(None, ["gfx942"], tmp_path, specs=PAGED, log=lambda m: None)
    report = {r["kernel"]: r for r in kernel_report(tmp_path)}
    for spec in PAGED:
        assert report[spec.name]["dispatches"] == (1 if spec.tuning.fused_merge else 2)
        split = next(f for f in report[spec.name]["functions"] if f["function"] == "split")
        assert split["scratch_bytes"] == 0 and split["scratch_ops"] == 0, spec.name
        if spec.family == "mfma":
            assert split["mfma"] == 32 and split["waves_per_simd"] >= 4, split


def test_waves_per_simd_counts_lds():
    from msa_iree.inspect import waves_per_simd

    assert waves_per_simd(120, 0, 256) == 4
    assert waves_per_simd(120, 33472, 256) == 1  # one 4-wave workgroup per CU: LDS, not registers
    assert waves_per_simd(120, 12992, 256) == 4
    assert waves_per_simd(48, 8192, 128) == 4  # 8 two-wave workgroups a CU by LDS


def test_mfma_specs_refuse_what_they_cannot_build():
    with pytest.raises(ValueError, match="num_heads / num_kv_heads"):
        K.SparseAttnDecodeMfmaSpec(MsaConfig(num_heads=4), 16)
    with pytest.raises(ValueError, match="kv_dtype: expected fp8 or the query dtype"):
        K.SparseAttnDecodeMfmaSpec(MsaConfig(kv_dtype="fp16"), 16)
    assert K.SparseAttnDecodeMfmaEmulatedSpec.targets == ("cuda",) and K.SparseAttnDecodeMfmaSpec.targets == ("gfx942",)
    names = {s.name for s in K.kernel_set(MsaConfig(kv_dtype="bf16"), target="gfx942")}
    assert K.SparseAttnDecodeMfmaSpec(MsaConfig(kv_dtype="bf16"), 16).name in names
    assert K.SparseAttnPrefillMfmaSpec(MsaConfig(kv_dtype="bf16"), 8).name in names
    assert not any("mfma" in s.name for s in K.kernel_set(MsaConfig(kv_dtype="bf16"), target="cuda"))


def test_gpu_matrix_picks_the_targets_matrix_kernel():
    from msa_iree.runtime.attention import _gpu_matrix

    bf16, fp8, h8 = MsaConfig(kv_dtype="bf16"), MsaConfig(kv_dtype="fp8_e4m3fnuz"), MsaConfig(num_heads=8, kv_dtype="bf16")
    h4, f16_bf16q = MsaConfig(num_heads=4, kv_dtype="bf16"), MsaConfig(kv_dtype="fp16")
    for cfg in (bf16, fp8, h8):
        assert _gpu_matrix("gfx942", cfg, "auto") == "mfma"
    assert _gpu_matrix("gfx942", h4, "auto") == "fma" and _gpu_matrix("gfx942", f16_bf16q, "auto") == "fma"
    assert _gpu_matrix("cuda", bf16, "auto") == "mma" and _gpu_matrix("cuda", bf16, "mfma") == "mfma"
    assert _gpu_matrix("host", bf16, "auto") == "fma"
    with pytest.raises(ValueError, match="gpu_matrix='mfma': expected a gfx942"):
        _gpu_matrix("gfx942", f16_bf16q, "mfma")
    with pytest.raises(ValueError, match="gpu_matrix='mma': expected a cuda target"):
        _gpu_matrix("gfx942", bf16, "mma")
    with pytest.raises(ValueError, match="gpu_matrix: expected 'auto'"):
        _gpu_matrix("cuda", bf16, "tensorcore")


@pytest.mark.parametrize("hq, h", [(16, 1), (8, 1), (32, 2)])
def test_workspace_bound_covers_every_row_count(hq, h):
    """workspace_floats must cover what the split writes for any token count, and be tight where
    the split count halves (so that the module's own size check would catch an off-by-one)."""
    spec = K.SparseAttnDecodeFmaSpec(MsaConfig(num_heads=hq, num_kv_heads=h), 16)
    g = hq // h
    for tokens in range(1, 700):
        rows = tokens * h
        need = ARRIVAL_COUNTERS + rows * spec.splits(rows) * g * 130
        assert spec.workspace_floats(tokens) >= need, tokens
    assert spec.workspace_floats(16 // h) == ARRIVAL_COUNTERS + 16 * 16 * g * 130


@pytest.mark.parametrize("spec", [K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16),
                                  K.SparseAttnPrefillFmaSpec(MsaConfig(kv_dtype="bf16"), 8),
                                  K.SparseAttnPrefillMfmaEmulatedSpec(MsaConfig(kv_dtype="fp8_e4m3fnuz"), 16)],
                         ids=lambda s: s.name)
def test_the_attend_call_allocates_nothing(spec):
    """`main` writes into the caller's output and workspace: after IREE's stream partitioning it
    holds no allocation, copy or fill (an allocating call cost ~100 us more host time on an H200)."""
    import iree.compiler as ic

    text = ic.compile_str(spec.render(), input_type="auto", extra_args=C.TARGETS["cuda"] + ["--compile-to=stream"])
    text = text.decode() if isinstance(text, bytes) else text
    start = text.index("@main(")
    main = text[start:]
    assert "stream.cmd.dispatch" in main
    for op in ("stream.resource.alloca", "stream.resource.alloc ", "stream.cmd.copy", "stream.cmd.fill"):
        assert op not in main, op


def _entry_ptx(tmp_path, spec, entry="split"):
    """The PTX text of the spec's module and of its @split (or `entry`) kernel, from its `.entry`
    to the next entry."""
    C.compiled_module(spec, "cuda", isa_dir=tmp_path)
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    start = ptx.index(f".entry {entry}(")
    end = ptx.find(".entry", start + 1)
    return ptx, ptx[start:end if end > 0 else None]


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3fn"])
def test_mma_split_ptx_keeps_its_fast_paths(tmp_path, kv):
    """What the H200 numbers in benchmarks/PERF.md rest on, checked in the generated PTX so that a
    template or IREE change cannot drop it silently: exp as one ex2.approx (not the polynomial
    IREE's MathTransform expands math.exp into for CUDA: its ln 2 high part 0xBF318000), 48
    mma.sync (QK 16 + PV 16, PV twice: tail block masked, full blocks not); for e4m3fn the sm_89
    build with the hardware conversion and the cp.async staging of K/V. PV's probability
    fragments come back from LDS 16 bytes a lane (an extra LDS allocation once moved them off
    16-byte alignment: 4-byte loads, 1.1-1.3x slower on the H200). For fp8, q's fragments are
    requested before the page-id fetch's barrier, next to the top-k row (SparseAttnDecodeMmaSpec.q_first)."""
    spec = K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype=kv), 16)
    ptx, split = _entry_ptx(tmp_path, spec)
    assert split.count("ld.shared.v4.b32") >= 16  # 8 fragments a block, masked and unmasked PV
    assert split.count("ex2.approx") >= 10  # 8 probabilities + 2 rescales a block
    assert "0fBF318000" not in split
    assert split.count("mma.sync") == 48
    # 16-byte global loads before the first barrier: the top-k row's 4, for fp8 also q's 8
    before_page_ids = split[:split.index("bar.sync")]
    assert before_page_ids.count("ld.global.nc.v4.b32") == (4 if kv == "bf16" else 12)
    # the page ids (between the first two barriers) take no register that both an LDS and a
    # global load write: ptxas waited for such a merged value on the global load's scoreboard,
    # which q's loads share (fp8 B=8 7.05 -> 6.70 us, B=64 14.15 -> 13.8 once gone, benchmarks/PERF.md)
    page_ids = split.split("bar.sync")[1]
    written = lambda op: set(re.findall(op + r"[.\w]*\s+(%r\d+),", page_ids))
    assert written("ld.global") and written("ld.shared")
    assert not written("ld.global") & written("ld.shared")
    if kv == "bf16":
        assert ".target sm_80" in ptx and "cp.async" not in split
    else:
        assert ".target sm_89" in ptx
        assert split.count("cvt.rn.f16x2.e4m3x2") == 96  # 2 per word: K 16 words, V 16 words twice
        assert split.count("cp.async.ca.shared.global") == 3 * 4 + 4  # K at 3 places, 4 copies; V 4


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3fn"])
def test_mma_merge_ptx_weighs_splits_with_single_instructions(tmp_path, kv):
    """The CUDA merge's split weights exp(m - max) are one ex2.approx each and 1 / l one
    rcp.approx: math.exp became IREE's polynomial (its ln 2 high part 0xBF318000) and the f32
    division div.rn.f32 a slow-path branch, @merge 1.73 -> 1.63 us at fp8 B=64 and 2.34 -> 1.98
    at B=8 on the H200 (benchmarks/PERF.md). With fused_merge the merge is @split's tail."""
    spec = K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype=kv), 16)
    assert spec.tuning.fused_merge
    _, split = _entry_ptx(tmp_path, spec)
    # the merge's weights: a chunk of min(n, 8) splits per step for 2, 4, 8, 16 splits, beside
    # the block loop's softmax
    assert split.count("ex2.approx") >= 2 + 4 + 8 + 8
    assert "0fBF318000" not in split
    assert split.count("rcp.approx") == 1  # the merge's normalisation (one split divides: div.rn)


@pytest.mark.parametrize("family", ["mma", "mfma"])
def test_a_requests_rows_visit_their_blocks_in_order_only_where_they_share_them(family):
    """sort_blocks (the matrix families' rows): the rows of a decode step of L > 1 tokens a request
    take their entries in ascending block order (the name's .sb, its graph and inserting variants
    too); one token a request, prefill rows and a given page table keep the top-k's order."""
    target = "cuda" if family == "mma" else "gfx942"
    decode, prefill = K.GPU_ATTEND[family, target]
    paged = K.GPU_PAGED_ATTEND[family, target]
    for L in (1, 2, 4):
        spec = decode(MsaConfig(kv_dtype="bf16", decode_query_len=L), 16)
        for variant in (spec, spec.for_graph(), spec.with_insert()):
            assert variant.knobs()["SORT_BLOCKS"] == (L > 1), variant.name
            assert variant.name.split(".L")[1].split(".").count("sb") == (L > 1), variant.name
    assert not prefill(MsaConfig(kv_dtype="bf16"), 16).knobs()["SORT_BLOCKS"]
    assert not paged(MsaConfig(kv_dtype="bf16"), 16, read_once=False).knobs()["SORT_BLOCKS"]
    unsorted = decode(MsaConfig(kv_dtype="bf16", decode_query_len=4), 16,
                      dataclasses.replace(TUNING[family], sort_blocks=False))
    assert not unsorted.knobs()["SORT_BLOCKS"] and ".sb" not in unsorted.name


def test_the_sorted_order_costs_one_barrier(tmp_path):
    """The rank sort runs between the page-id fetch and the block loop: @split of a decode step of 4
    tokens a request has exactly one barrier more than the same kernel unsorted, and reads the
    sorted entries (a second pair of LDS arrays)."""
    sorted_ = K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype="bf16", decode_query_len=4), 16)
    unsorted = dataclasses.replace(sorted_, tuning=dataclasses.replace(sorted_.tuning, sort_blocks=False))
    _, split_sorted = _entry_ptx(tmp_path / "s", sorted_)
    _, split_unsorted = _entry_ptx(tmp_path / "u", unsorted)
    assert split_sorted.count("bar.sync") == split_unsorted.count("bar.sync") + 1
    assert "%TBu" in sorted_.render() and "%TBu" not in unsorted.render()


def test_only_rows_that_read_their_own_pages_prefetch_the_next_block():
    """prefetch_next (mma): a decode of one token a request asks the L2 for its next block's pages
    of the row's sides for its dtype (the served row: bf16 K, fp8 none), its graph and inserting
    variants too (the name's .pfk / .pfkv); rows that share pages (L > 1, prefill) and a given page
    table do not; other families refuse it."""
    served = K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16)
    assert K.SparseAttnDecodeMmaSpec(MsaConfig(), 16).knobs()["PREFETCH_NEXT"] == "k"
    assert served.knobs()["PREFETCH_NEXT"] == "" and ".pf" not in served.name
    row = dataclasses.replace(TUNING["mma"], prefetch_next="k", prefetch_next_fp8="kv")
    for kv, sides in (("bf16", "k"), ("fp8_e4m3fn", "kv")):
        for L in (1, 2, 4):
            spec = K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype=kv, decode_query_len=L), 16, row)
            for variant in (spec, spec.for_graph(), spec.with_insert()):
                assert variant.knobs()["PREFETCH_NEXT"] == (sides if L == 1 else ""), variant.name
                assert variant.name.split(".L")[1].split(".").count(f"pf{sides}") == (L == 1), variant.name
        assert not K.SparseAttnPrefillMmaSpec(MsaConfig(kv_dtype=kv), 16, row).knobs()["PREFETCH_NEXT"]
        for read_once in (False, True):
            assert not K.SparseAttnPagedMmaSpec(MsaConfig(kv_dtype=kv), 16, row, read_once=read_once).knobs()["PREFETCH_NEXT"]
    with pytest.raises(ValueError, match="tuning.prefetch_next: expected only for the mma family"):
        K.SparseAttnDecodeMfmaSpec(MsaConfig(kv_dtype="bf16"), 16, dataclasses.replace(TUNING["mfma"], prefetch_next="k"))
    with pytest.raises(ValueError, match=r"prefetch_next, prefetch_next_fp8: expected '', 'k', 'v' or 'kv'.*'q', None"):
        AttendTuning(prefetch_next="q")


@pytest.mark.parametrize("kv, sides", [("bf16", "k"), ("bf16", "kv"), ("fp8_e4m3fn", "kv"), ("fp8_e4m3fn", "v")])
def test_the_prefetch_asks_for_the_next_blocks_pages_in_the_cache(tmp_path, kv, sides):
    """In the PTX of @split: one prefetch.global.L2 a lane and side (fp8 with both sides: one, its
    lanes split between them), each at a K or V binding's address plus a page id times the page's
    bytes (4096 bf16, 2048 fp8), that page id clamped into its binding's pages (min.s64) like
    every load's; none without the knob."""
    tuning = dataclasses.replace(TUNING["mma"], prefetch_next=sides, prefetch_next_fp8=sides)
    spec = K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype=kv), 16, tuning)
    _, split = _entry_ptx(tmp_path / "p", spec)
    prefetches = re.findall(r"prefetch\.global\.L2 \[(%rd\d+)\];", split)
    assert len(prefetches) == (1 if kv != "bf16" and sides == "kv" else len(sides))
    shift = 12 if kv == "bf16" else 11
    params = {"k": "split_param_1", "v": "split_param_2"}
    for reg in prefetches:
        # walk the address back: adds of a base and a shifted, clamped page id
        chain = _defining_chain(split, reg)
        assert "shl.b64" in chain and f", {shift};" in chain and "min.s64" in chain, chain
        assert any(params[side] in chain for side in sides), chain
    unprefetched = dataclasses.replace(spec, tuning=dataclasses.replace(tuning, prefetch_next="", prefetch_next_fp8=""))
    assert "prefetch" not in _entry_ptx(tmp_path / "n", unprefetched)[1]


def _defining_chain(ptx: str, reg: str, depth: int = 40) -> str:
    """The PTX lines that define `reg` and, recursively, their operands (up to `depth` levels)."""
    lines, todo, seen = [], [reg], set()
    while todo and depth:
        depth -= 1
        nxt = []
        for r in todo:
            if r in seen:
                continue
            seen.add(r)
            for line in re.findall(rf"^\s*[\w.:]+\s+{re.escape(r)},[^\n]*$", ptx, re.M):
                lines.append(line.strip())
                nxt += re.findall(r"%rd?\d+", line.split(",", 1)[1])
        todo = nxt
    return "\n".join(lines)


def test_the_tensor_core_prefill_takes_its_prefill_row():
    """PREFILL_TUNING: the fp8 tensor-core prefill reads K/V straight into registers at 3 workgroups
    an SM (its rows are bound by L1/LDS traffic, not by the L2); bf16 keeps the decode row's 2 and
    its early V; the decode keeps cp.async staging; a tuning row given explicitly wins."""
    fp8, bf16 = MsaConfig(kv_dtype="fp8_e4m3fn"), MsaConfig(kv_dtype="bf16")
    prefill = K.SparseAttnPrefillMmaSpec(fp8, 16).knobs()
    assert prefill["MIN_CTAS"] == 3 and not prefill["ASYNC_KV"]
    decode = K.SparseAttnDecodeMmaSpec(fp8, 16).knobs()
    assert decode["MIN_CTAS"] == 2 and decode["ASYNC_KV"]
    prefill16 = K.SparseAttnPrefillMmaSpec(bf16, 16).knobs()
    assert prefill16["MIN_CTAS"] == 2 and prefill16["EARLY_V"]
    assert K.SparseAttnPrefillMmaSpec(fp8, 16, TUNING["mma"]).knobs()["ASYNC_KV"]
    assert K.SparseAttnPrefillMfmaSpec(fp8, 16).tuning == TUNING["mfma"]


def test_a_knob_is_part_of_the_variant_name():
    """Two modules that differ in a tuning knob are two manifest entries, and the name spells the
    knobs in effect (a knob that does not apply to the config is not in it)."""
    base = K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype="bf16"), 16)
    other = K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype="bf16"), 16, AttendTuning(bt_preload=512))
    assert base.name != other.name and "bt1024" in base.name and "bt512" in other.name
    # bf16: no fp8 knobs; fused_merge: no @merge grid knobs
    assert base.name.endswith(".L1.r16s16-r32s8-r64s4-r128s2.bt1024.cta2.ev.fm.pfk")
    fp8 = K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16)
    assert fp8.name.endswith(".hwcvt.akv.qf.fm")  # no early V with cp.async staging
    unfused = K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype="bf16"), 16,
                                        dataclasses.replace(base.tuning, fused_merge=False))
    assert unfused.name.endswith(".L1.r16s16-r32s8-r64s4-r128s2.mr4x2.bt1024.cta2.ev.pfk")
    mfma = K.SparseAttnDecodeMfmaSpec(MsaConfig(kv_dtype="fp8_e4m3fnuz"), 16)
    assert ".r16s8-r32s8-r64s4-r128s2." in mfma.name and ".wpe4." in mfma.name
    assert ".wpe" not in K.SparseAttnDecodeMfmaEmulatedSpec(MsaConfig(kv_dtype="fp8_e4m3fnuz"), 16).name
