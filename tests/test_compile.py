"""The compile pipeline: gfx942 and CUDA artifacts, manifest, content cache, atomicity, CLI errors."""
import hashlib
import json
import subprocess
import sys
import time

import pytest

from msa_iree import compile as C
from msa_iree import ops as K
from msa_iree.cli import main
from msa_iree.config import MsaConfig
from msa_iree.inspect import kernel_report

CFG = MsaConfig(kv_dtype="fp8_e4m3fnuz")


def small_set():
    return [K.RebaseSlotsSpec(CFG), K.SparseAttnDecodeSpec(CFG, 16), K.InsertKvSpec(CFG, 16)]


@pytest.mark.parametrize("target", ["gfx942", "cuda"])
def test_gpu_targets_build_with_manifest(tmp_path, target):
    manifest_path = C.build(CFG, [target], tmp_path / target, specs=small_set(), log=lambda m: None)[target]
    m = json.loads(manifest_path.read_text())
    assert m["target"] == target and m["iree_compiler_version"] == C.iree_version()
    assert "--iree-rocm-target=gfx942" in m["flags"] if target == "gfx942" else "--iree-cuda-target=sm_80" in m["flags"]
    assert set(m["kernels"]) == {s.name for s in small_set()}
    for entry in m["kernels"].values():
        data = (manifest_path.parent / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) > 1000
    if target == "gfx942":
        report = {r["kernel"]: r for r in kernel_report(manifest_path.parent)}
        attend = report[K.SparseAttnDecodeSpec(CFG, 16).name]
        assert attend["dispatches"] >= 1 and all(f["vgpr"] > 0 for f in attend["functions"])


def test_second_build_is_cached_and_fast(tmp_path):
    logs = []
    C.build(CFG, ["host"], tmp_path, specs=small_set(), log=logs.append)
    t0 = time.perf_counter()
    C.build(CFG, ["host"], tmp_path, specs=small_set(), log=logs.append)
    assert time.perf_counter() - t0 < 1.0
    assert all(line.endswith("up to date") for line in logs[-3:])


def test_interrupted_build_leaves_no_vouched_garbage(tmp_path, monkeypatch):
    real = C.compile_mlir
    calls = []

    def flaky(mlir, target, extra_flags=()):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(mlir, target, extra_flags)

    monkeypatch.setattr(C, "compile_mlir", flaky)
    monkeypatch.setenv("MSA_IREE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(KeyboardInterrupt):
        C.build(CFG, ["host"], tmp_path / "out", specs=small_set(), log=lambda m: None)
    out = tmp_path / "out"
    assert not (out / "manifest.json").exists()  # the manifest is written last
    assert not list(out.glob(".*"))  # no half-written temp files left behind
    for f in out.glob("*.vmfb"):
        assert f.stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["compile", "--target", "gfx1100"], "--target: expected one of ['cuda', 'gfx942', 'host'], got 'gfx1100'"),
    (["compile", "--target", "host", "--num-heads", "15", "--num-kv-heads", "2"],
     "MsaConfig.num_heads: expected a positive multiple of num_kv_heads=2, got 15"),
    (["compile", "--target", "host", "--kv-dtype", "int4"], "unknown dtype 'int4'"),
    (["compile", "--target", "host", "--decode-query-lens", "0"], "--decode-query-lens: expected decode query "
                                                                  "lengths in 1..8, got [0]"),
    (["compile", "--target", "host", "--layouts", "nhd"], "--layouts: expected ['interleaved', 'planes'], got 'nhd'"),
    (["inspect", "no/such/build"], "no/such/build: expected a build directory (or its manifest.json)"),
])
def test_cli_user_errors_are_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"msa-iree {argv[0]}: error: ") and message in err, err


def test_cli_names_the_attend_families_a_head_count_cannot_build(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(C, "build", lambda *a, **k: {"cuda": tmp_path / "manifest.json"})  # no compile needed
    assert main(["compile", "--target", "cuda", "--num-heads", "7", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for kernel in ("sparse_attn_decode_fma", "sparse_attn_decode_mma"):
        assert f"cuda: not building {kernel}: num_heads / num_kv_heads: expected one of (8, 16)" in out


def test_cli_entry_points_run():
    for argv in (["-m", "msa_iree", "--help"], ["-m", "msa_iree.cli", "--help"]):
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
        assert r.returncode == 0 and "compile" in r.stdout and "inspect" in r.stdout
    r = subprocess.run([sys.executable, "-m", "msa_iree", "--version"], capture_output=True, text=True)
    from msa_iree import __version__
    assert r.returncode == 0 and r.stdout.strip() == f"msa-iree {__version__}"


def test_inspect_takes_the_manifest_path_too(tmp_path, capsys):
    spec = K.InsertKvGpuSpec(CFG, 16)
    C.build(CFG, ["gfx942"], tmp_path, specs=[spec], log=lambda m: None)
    assert main(["inspect", str(tmp_path / "manifest.json")]) == 0
    assert spec.name in capsys.readouterr().out


def test_the_content_cache_serves_a_new_output_directory(tmp_path):
    """A second build of the same kernels into another directory compiles nothing (vmfb and, for
    gfx942, the ISA dump come from the cache) and leaves the same files."""
    specs = [K.RebaseSlotsSpec(CFG), K.InsertKvGpuSpec(CFG, 16)]
    C.build(CFG, ["gfx942"], tmp_path / "a", specs=specs, log=lambda m: None)
    logs = []
    C.build(CFG, ["gfx942"], tmp_path / "b", specs=specs, log=logs.append)
    assert all(": cached (" in line for line in logs), logs
    for spec in specs:
        a, b = (sorted(p.relative_to(d) for p in (d / "isa" / spec.name).rglob("*"))
                for d in (tmp_path / "a", tmp_path / "b"))
        assert a == b and a
        assert (tmp_path / "a" / f"{spec.name}.vmfb").read_bytes() == (tmp_path / "b" / f"{spec.name}.vmfb").read_bytes()


def test_request_key_short_circuit(tmp_path):
    key = C.request_key({"num_heads": 16}, "host")
    assert not C.up_to_date(tmp_path, key)
    C.build(CFG, ["host"], tmp_path, specs=small_set()[:1], log=lambda m: None, request_key=key)
    assert C.up_to_date(tmp_path, key)
    assert not C.up_to_date(tmp_path, C.request_key({"num_heads": 8}, "host"))
    vmfb = next(tmp_path.glob("*.vmfb"))
    vmfb.write_bytes(vmfb.read_bytes() + b"x")  # a tampered module is not up to date
    assert not C.up_to_date(tmp_path, key)


@pytest.mark.parametrize("argv, heads, kv_heads, kv, lens", [
    (["--tensor-parallel-size", "4", "--kv-cache-dtype", "fp8"], 16, 1, "fp8_e4m3fnuz", [1]),
    (["--tensor-parallel-size", "8", "--kv-cache-dtype", "fp8_e4m3", "--num-speculative-tokens", "3"], 8, 1,
     "fp8_e4m3fnuz", [1, 2, 3, 4]),
    (["--tensor-parallel-size", "2"], 32, 2, "bf16", [1]),
])
def test_compile_builds_the_kernel_set_of_a_vllm_configuration(monkeypatch, tmp_path, argv, heads, kv_heads, kv, lens):
    """MiniMax-M3 at TP N: 64/N query heads and max(1, 4/N) KV heads a rank, vLLM's KV dtype
    names (fp8: the target's own), L up to 1 + speculative tokens, the interleaved layout."""
    seen = {}

    def fake_build(cfg, targets, out, strides, decode_query_lens, **kw):
        seen.update(cfg=cfg, strides=strides, lens=decode_query_lens)
        return {targets[0]: tmp_path / "manifest.json"}

    monkeypatch.setattr(C, "build", fake_build)
    assert main(["compile", "--target", "gfx942", "--out", str(tmp_path)] + argv) == 0
    cfg = seen["cfg"]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.kv_dtype) == (heads, kv_heads, kv)
    assert seen["strides"] == [16] and seen["lens"] == lens
    assert main(["compile", "--target", "gfx942", "--num-heads", "16"] + argv) == 2  # heads come from the TP size


def test_compile_adds_the_indexer_kernel_when_asked(monkeypatch, tmp_path):
    """--index-cache-dtype adds the indexer's kernels to the kernel set (one index head per KV head
    a rank, the forced blocks as given): the insert, the portable scores and top-k, the emitted
    table, and on a GPU target the hand-written scores and top-k; without it nothing of the
    indexer is built; a dtype it cannot build is a one-line error."""
    seen = {}

    def fake_build(cfg, targets, out, strides, decode_query_lens, specs=None, **kw):
        seen.update(specs=specs, cfg=cfg, strides=strides, lens=decode_query_lens)
        return {targets[0]: tmp_path / "manifest.json"}

    monkeypatch.setattr(C, "build", fake_build)
    argv = ["compile", "--target", "host", "--num-kv-heads", "2", "--num-heads", "32", "--out", str(tmp_path)]
    assert main(argv) == 0 and seen["specs"] is None
    for target, kinds in (("host", [K.IndexTopkSpec, K.IndexCacheInsertSpec, K.BuildPrefillTableSpec]),
                          ("gfx942", [K.IndexTopkSpec, K.IndexCacheInsertGpuSpec, K.BuildPrefillTableSpec]
                           + [K.IndexTopkGpuSpec] * 6)):
        argv[2] = target
        assert main(argv + ["--index-cache-dtype", "fp8_e4m3fn", "--index-init-blocks", "1"]) == 0
        attend = K.kernel_set(seen["cfg"], seen["strides"], seen["lens"], target)
        assert [s.name for s in seen["specs"][:len(attend)]] == [s.name for s in attend]
        indexer = seen["specs"][len(attend):]
        assert [type(s) for s in indexer] == kinds
        assert {(s.cfg.num_kv_heads, s.cfg.kv_dtype) for s in indexer} == {(2, "fp8_e4m3fn")}
        assert [(s.init_blocks, s.local_blocks) for s in indexer if hasattr(s, "init_blocks")] == \
            [(1, 1)] * (len(kinds) - 2)
        # on the GPU: one token a workgroup and, two index heads, a decode step's token pairs, and
        # query tiles two tokens a workgroup (the lane-wise dot's 4 (token, head) pairs); each with
        # and without the emitted table
        assert sorted((s.tiled, s.rows, s.emit_table) for s in indexer if isinstance(s, K.IndexTopkGpuSpec)) == \
            ([(False, 1, False), (False, 1, True), (False, 2, False), (False, 2, True), (True, 2, False),
              (True, 2, True)] if target == "gfx942" else [])
        assert not any(s.fp8_queries for s in indexer if hasattr(s, "fp8_queries"))  # bf16 queries, as asked
    argv[2] = "host"
    assert main(argv + ["--index-cache-dtype", "fp16"]) == 2
    # e4m3fn index queries: asked for, or a vLLM configuration's for its fp8 index cache (its
    # model casts the index queries to the cache's dtype); the index keys stay the model's bf16
    for extra in (["--index-query-dtype", "fp8_e4m3fn"],
                  ["--tensor-parallel-size", "4", "--kv-cache-dtype", "fp8"]):
        base = argv[:3] + ["--out", str(tmp_path)] if extra[0] == "--tensor-parallel-size" else argv
        assert main(base + extra + ["--index-cache-dtype", "fp8_e4m3fn"]) == 0
        topk = [s for s in seen["specs"] if isinstance(s, K.IndexTopkSpec)]
        assert [s.fp8_queries for s in topk] == [True] and "qfp8_e4m3fn" in topk[0].name
        assert [s.cfg.query_dtype for s in seen["specs"] if "insert_index" in s.name] == ["bf16"]
    assert main(argv + ["--index-cache-dtype", "bf16", "--index-query-dtype", "fp8_e4m3fn"]) == 2
    assert main(argv + ["--index-cache-dtype", "bf16", "--index-query-dtype", "fp32"]) == 2
