"""msa_iree.runtime.cuda_launch on the CPU machine: the launch plan a cuda build saves, interpreted for given
operand shapes, gives the grids the template's split rule implies, passes as many bindings and
constants as the PTX takes, and refuses what IREE's own call would refuse. The launches
themselves run on a GPU (tests/test_gpu.py compares them byte for byte with IREE's call)."""
import ctypes
import json
import re
import subprocess

import gpu_cases
import pytest
from toolchain import MISSING, PTXAS
import torch

from msa_iree import compile as C
from msa_iree import ops as K
from msa_iree.config import MsaConfig
from msa_iree.ops.tuning import ARRIVAL_COUNTERS
from msa_iree.runtime.cuda_launch import (DispatchPlan, StreamKernel, entries_using_shared, ptx_entries, ptx_of, shared_bytes,
                             with_dependent_launch, with_l2_evict_first)

MMA = K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype="bf16"), 16)                      # 16 heads, 1 KV head
FMA = K.SparseAttnDecodeFmaSpec(MsaConfig(num_heads=16, num_kv_heads=2), 8)          # 8 heads, 2 KV heads
INSERT = K.InsertKvGpuSpec(MsaConfig(kv_dtype="fp8_e4m3fn", num_kv_heads=2), 16)       # writes the cache (operand 0)
MMA_FP8 = K.SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16)            # K/V staged by cp.async
MMA_INS = MMA.with_insert()                                                          # writes the step's K/V too
# the decode indexer CUDA serves for an fp8 index cache (tensor cores; its groups take turns at the splits)
INDEX_MMA = K.IndexTopkGpuSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16, 0, 1, dot="mma")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    out = tmp_path_factory.mktemp("cuda")
    C.build(None, ["cuda"], out, specs=[MMA, FMA, INSERT, MMA_FP8, MMA_INS, INDEX_MMA], log=lambda m: None)
    return out, json.loads((out / "manifest.json").read_text())["kernels"]


def _plan(build, spec):
    out, kernels = build
    return DispatchPlan((out / kernels[spec.name]["launch_plan"]["file"]).read_text())


def _operands(spec, tokens, workspace=None):
    """(shapes, dtypes) of `main`'s operands for a decode batch of `tokens` tokens."""
    c = spec.cfg
    hq, h = c.num_heads, c.num_kv_heads
    ws = spec.workspace_floats(tokens) if workspace is None else workspace
    shapes = [(tokens, hq, 128), (4000, 2048), (4000, 2048), (h, tokens, 16), (tokens, 40), (tokens,), (1,),
              (h, 1), (h, 1), (tokens, hq, 128), (ws,)]
    dtypes = ["bfloat16"] * 3 + ["int32"] * 3 + ["float32"] * 3 + ["bfloat16", "float32"]
    return shapes, dtypes


# (decode tokens, table columns, @score's workgroups a token): 16 blocks a split, so C / 16 splits
# up to 64, and past 1,024 workgroups ceil(1024 / tokens)
@pytest.mark.parametrize("tokens, columns, sg", [(1, 32, 2), (8, 8192, 64), (64, 32, 2), (64, 8192, 16),
                                                (256, 256, 4), (256, 8192, 4), (4096, 8192, 1)])
def test_the_indexers_grid_follows_its_tuning_row(build, tokens, columns, sg):
    """@score's grid as IREE lowered the template: all of the longest row's splits a group of rows
    while the groups are few, past grid_workgroups as few as keep that many (the row's
    grid_splits), handed to @score beside the row's splits (the workspace's stride), which @merge
    gets too. 64 decode tokens over a 1M-token table take 16 workgroups each, not 64."""
    row = INDEX_MMA.tuning_row
    assert (row.min_blocks_per_split, row.grid_workgroups, row.splits(8192)) == (16, 1024, 64)
    shapes, dtypes = gpu_cases.index_operands(INDEX_MMA, tokens, columns)
    (score, grid, constants, _), (merge, _, merge_constants, _) = _plan(build, INDEX_MMA).evaluate(shapes, dtypes)
    assert row.grid_splits(columns, tokens) == sg
    assert (score, merge) == ("score", "merge") and grid == [tokens, sg, 1]  # group_major: groups along x
    # T, N, R, C, S, SG, the workspace's words (indices as low and high words, but S and SG, which
    # IREE knows to be small): the splits' stride and the grid's splits both reach @score
    assert constants == [tokens, 0, 900, 0, 4, 0, columns, 0, row.splits(columns), sg, shapes[-1][0], 0]
    assert merge_constants[:5] == [tokens, 0, columns, 0, row.splits(columns)]


@pytest.mark.parametrize("tokens", [1, 16, 17, 40, 64, 65, 128, 300])
def test_grids_follow_the_tuning_tables_split_rule(build, tokens):
    """The grid IREE's lowering of the rendered template computes is the split count the tuning
    table gives (ops/tuning.py; spec.splits reads it), at and around each of its row limits."""
    rows = tokens  # the mma spec: one KV head
    dispatches = _plan(build, MMA).evaluate(*_operands(MMA, tokens))
    # fused_merge: a row's last split merges it, no @merge dispatch
    assert [d[0] for d in dispatches] == ["split"]
    assert dispatches[0][1] == [MMA.splits(rows), rows, 1]
    fma = _plan(build, FMA).evaluate(*_operands(FMA, tokens))
    assert [d[0] for d in fma] == ["split", "merge"]
    assert fma[0][1] == [FMA.splits(2 * tokens), 2 * tokens, 1] and fma[1][1] == [2 * tokens, 8, 1]


def test_the_default_split_rule_by_hand():
    """The documented default (a hand-worked reading of ops/tuning.py's SPLITS): a batch of 8
    decode rows fills the GPU with 16 workgroups a row, a batch of 300 takes one."""
    assert [MMA.splits(r) for r in (8, 16, 17, 40, 100, 300)] == [16, 16, 8, 4, 2, 1]


def test_plans_pass_what_the_ptx_takes(build):
    out, kernels = build
    for spec in (MMA, FMA):
        vmfb = (out / kernels[spec.name]["file"]).read_bytes()
        entries = ptx_entries(ptx_of(vmfb).decode())
        assert set(entries) == ({"split"} if spec.tuning.fused_merge else {"split", "merge"})
        for name, grid, constants, bindings in _plan(build, spec).evaluate(*_operands(spec, 40)):
            block, pointers, words = entries[name]
            assert block == (256, 1, 1) or (name == "merge" and block == (128, 1, 1))
            assert (len(bindings), len(constants)) == (pointers, words), name
            assert all(0 <= k < 11 for k, _ in bindings)
    # the mma split's LDS: row maxima 16 x 8 f32, P fragments 8 x 32 x 4 i32, the block table 16
    # index + 16 i32 (templates/mma_split.j2, the template's TB/TK), the staged block-table row
    # (the tuning's bt_preload i32), the fused merge's one i32 flag (this workgroup is the row's last)
    vmfb = (out / kernels[MMA.name]["file"]).read_bytes()
    assert shared_bytes(vmfb, (256, 1, 1)) == (16 * 8 * 4 + 8 * 32 * 4 * 4 + 16 * 8 + 16 * 4 + MMA.tuning.bt_preload * 4
                                               + 4)


def test_only_kernels_that_touch_shared_memory_get_it(build):
    """IREE sizes one dynamic shared memory for all of a module's kernels; the launcher gives it only to
    those whose PTX touches it: through a .shared access or a generic pointer made from IREE's symbol."""
    ptx = "\n".join([
        ".extern .shared .align 16 .b8 __dynamic_shared_memory__[];",
        ".visible .entry a(\n.param .u64 a_0\n)\n.maxntid 256, 1, 1\n{\n\tld.shared.u32 %r1, [%rd1];\n\tret;\n}",
        ".visible .entry b(\n.param .u64 b_0\n)\n.maxntid 256, 1, 1\n{\n\tmov.u64 %rd1, __dynamic_shared_memory__;"
        "\n\tld.u32 %r1, [%rd1];\n\tret;\n}",
        ".visible .entry c(\n.param .u64 c_0\n)\n.maxntid 256, 1, 1\n{\n\tld.global.u32 %r1, [%rd1];\n\tret;\n}"])
    assert entries_using_shared(ptx) == {"a", "b"}
    out, kernels = build
    for spec, expected in ((MMA, {"split"}), (FMA, {"split"}), (INSERT, set())):
        assert entries_using_shared(ptx_of((out / kernels[spec.name]["file"]).read_bytes()).decode()) == expected, spec.name


def test_plans_refuse_what_iree_refuses(build):
    plan = _plan(build, MMA)
    shapes, dtypes = _operands(MMA, 8)
    with pytest.raises(ValueError, match="input0 .*expected element type bf16, got float16"):
        plan.evaluate(shapes, ["float16"] + dtypes[1:])
    with pytest.raises(ValueError, match=r"input9 .*expected shape \(8, 16, 128\), got \(8, 8, 128\)"):
        plan.evaluate(shapes[:9] + [(8, 8, 128)] + shapes[10:], dtypes)
    with pytest.raises(ValueError, match="output: expected as many rows as the query"):
        plan.evaluate(shapes[:9] + [(9, 16, 128)] + shapes[10:], dtypes)
    with pytest.raises(ValueError, match="workspace"):
        plan.evaluate(*_operands(MMA, 8, workspace=ARRIVAL_COUNTERS + 8 * 16 * 16 * 130 - 1))
    plan.evaluate(*_operands(MMA, 8, workspace=ARRIVAL_COUNTERS + 8 * 16 * 16 * 130))  # exactly enough


def test_what_is_not_interpreted_raises():
    plan = DispatchPlan("%c1 = arith.constant 1 : index\n%x = arith.floordivsi %c1, %c1 : index")
    with pytest.raises(NotImplementedError, match="floordivsi"):
        plan.evaluate([], [])
    with pytest.raises(NotImplementedError, match="scf.if"):
        DispatchPlan("scf.if %c1 {").evaluate([], [])


@pytest.mark.parametrize("tokens", [1, 40, 300])
def test_the_insert_plan_is_one_dispatch_over_the_tokens(build, tokens):
    out, kernels = build
    shapes = [(6 * 16 * 2 * 2, 4096), (tokens, 2, 128), (tokens, 2, 128), (tokens,), (tokens,), (2, 1), (2, 1)]
    dtypes = ["float8_e4m3fn", "bfloat16", "bfloat16", "int32", "int32", "float32", "float32"]
    ((name, grid, constants, bindings),) = _plan(build, INSERT).evaluate(shapes, dtypes)
    entries = ptx_entries(ptx_of((out / kernels[INSERT.name]["file"]).read_bytes()).decode())
    assert grid == [tokens, 1, 1]  # a workgroup per token written
    assert (len(bindings), len(constants)) == entries[name][1:]
    assert sorted(k for k, _ in bindings) == list(range(7))


def _inserting_operands(tokens, key_rows=None, slot_rows=None):
    """(shapes, dtypes) of the inserting attend's `main`: the attend's, then key, value, slots
    after v_scale."""
    shapes, dtypes = _operands(MMA_INS, tokens)
    new = [(key_rows or tokens, 1, 128), (key_rows or tokens, 1, 128), (slot_rows or tokens,)]
    return shapes[:9] + new + shapes[9:], dtypes[:9] + ["bfloat16", "bfloat16", "int32"] + dtypes[9:]


@pytest.mark.parametrize("tokens", [1, 40, 300])
def test_the_inserting_attend_is_one_dispatch_over_its_new_kv(build, tokens):
    """MMA_INS (forward(key=, value=) on a decode step): one dispatch with the attend's grid, whose
    bindings are every operand (the k/v pages it also writes, the new key, value and slots among
    them) as the PTX takes them; rows of key, value or slots other than the query's are refused."""
    out, kernels = build
    ((name, grid, constants, bindings),) = _plan(build, MMA_INS).evaluate(*_inserting_operands(tokens))
    entries = ptx_entries(ptx_of((out / kernels[MMA_INS.name]["file"]).read_bytes()).decode())
    assert (name, grid) == ("split", [MMA.splits(tokens), tokens, 1])
    assert (len(bindings), len(constants)) == entries[name][1:]
    assert sorted(k for k, _ in bindings) == list(range(14))
    assert MMA_INS.written_operands == (-2, -1, 1, 2)
    plan = _plan(build, MMA_INS)
    with pytest.raises(ValueError, match="key: expected as many rows as the query"):
        plan.evaluate(*_inserting_operands(tokens, key_rows=tokens + 1))
    with pytest.raises(ValueError, match="slots: expected one per query row"):
        plan.evaluate(*_inserting_operands(tokens, slot_rows=tokens + 1))


class _RecordingDriver:
    """A CudaDriver stand-in for the CPU machine: loads nothing, records each cuLaunchKernel with
    the values its argument block points at (pointers u64, then constants u32, as the PTX takes)."""

    def __init__(self):
        self.launched = []
        self.allowed = []
        self.lib = self

    def load(self, ptx, names):
        return None, {name: ctypes.c_void_p(1000 + i) for i, name in enumerate(names)}

    def allow_shared(self, fn, nbytes):
        self.allowed.append((fn.value, nbytes))

    def cuLaunchKernelEx(self, config_ref, fn, args, extra):  # noqa: N802 - CUDA's name
        c = config_ref._obj
        attribute = c.attrs.contents
        assert (c.num_attrs, attribute.id, attribute.value[0]) == (1, 6, 1)  # programmatic serialization on
        return self.cuLaunchKernel(fn, *c.grid, *c.block, c.shared, ctypes.c_void_p(c.stream), args, extra)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, args, extra):  # noqa: N802 - CUDA's name
        name = next(n for n, f in self.sk.functions.items() if f.value == fn.value)
        _, pointers, words = self.sk.entries[name]
        values = [ctypes.cast(args[i], ctypes.POINTER(ctypes.c_uint64)).contents.value for i in range(pointers)]
        values += [ctypes.cast(args[pointers + i], ctypes.POINTER(ctypes.c_uint32)).contents.value for i in range(words)]
        self.launched.append((name, (gx, gy, gz), (bx, by, bz), shared, stream.value, values))
        return 0


def _recorded_mma(build, dependent, spec=MMA):
    """The MMA attend's (or `spec`'s) StreamKernel over a _RecordingDriver: (kernel, driver)."""
    out, kernels = build
    entry = kernels[spec.name]
    driver = _RecordingDriver()
    sk = StreamKernel(spec.name, (out / entry["file"]).read_bytes(), (out / entry["launch_plan"]["file"]).read_text(),
                      driver, dependent_launch=dependent)
    driver.sk = sk
    return sk, driver


def test_a_kernel_past_48_kib_of_shared_memory_opts_in(build, monkeypatch):
    """CUDA launches a kernel with more than 48 KiB of dynamic shared memory only after
    cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES): the launcher asks for exactly what it will
    launch with, for the kernels that get shared memory, and for none at 48 KiB or less."""
    from msa_iree.runtime import cuda_launch

    out, kernels = build
    entry = kernels[MMA.name]
    vmfb, plan = (out / entry["file"]).read_bytes(), (out / entry["launch_plan"]["file"]).read_text()
    driver = _RecordingDriver()
    StreamKernel(MMA.name, vmfb, plan, driver)
    assert driver.allowed == [] and 0 < shared_bytes(vmfb, (256, 1, 1)) <= 48 * 1024
    monkeypatch.setattr(cuda_launch, "shared_bytes", lambda vmfb, block: 100 * 1024)
    sk = StreamKernel(MMA.name, vmfb, plan, driver)
    using = [n for n in sk.entries if sk.shared[n]]
    assert using and driver.allowed == [(sk.functions[n].value, 100 * 1024) for n in using]

    class Lib:  # libcuda's two calls allow_shared makes
        def __init__(self, rc):
            self.rc, self.calls = rc, []

        def cuFuncSetAttribute(self, fn, attribute, value):  # noqa: N802 - CUDA's name
            self.calls.append((fn.value, attribute, value.value))
            return self.rc

        def cuGetErrorName(self, rc, name):  # noqa: N802 - CUDA's name
            return 0

    real = object.__new__(cuda_launch.CudaDriver)
    real.lib = Lib(0)
    real.allow_shared(ctypes.c_void_p(7), 64 * 1024)
    assert real.lib.calls == [(7, 8, 64 * 1024)]  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    real.lib = Lib(1)
    with pytest.raises(RuntimeError, match="cuFuncSetAttribute MAX_DYNAMIC_SHARED_SIZE_BYTES"):
        real.allow_shared(ctypes.c_void_p(7), 64 * 1024)


def _mma_operands(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, 16, 128, generator=g).bfloat16(), torch.zeros(64, 2048, dtype=torch.bfloat16),
            torch.zeros(64, 2048, dtype=torch.bfloat16), torch.zeros(1, tokens, 16, dtype=torch.int32),
            torch.zeros(tokens, 40, dtype=torch.int32), torch.zeros(tokens, dtype=torch.int32), torch.ones(1),
            torch.ones(1, 1), torch.ones(1, 1), torch.empty(tokens, 16, 128, dtype=torch.bfloat16),
            torch.empty(MMA.workspace_floats(tokens))]


@pytest.mark.parametrize("dependent", [False, True], ids=["launch", "dependent-launch"])
@pytest.mark.parametrize("tokens", [8, 64, 300])
def test_a_bound_launch_passes_what_an_unbound_one_passes(build, tokens, dependent):
    """SparseAttention's per-call path (BoundLaunch: the plan evaluated once, only the query, top-k
    and output addresses written per call) queues the same kernels with the same grids and the
    same argument values as a launch that works everything out from the operands."""
    sk, driver = _recorded_mma(build, dependent)
    first = _mma_operands(tokens, 1)
    bound = sk.bind(first, variable=(0, 3, 9))
    later = list(first)
    for i, t in zip((0, 3, 9), _mma_operands(tokens, 2)[0:1] + [torch.zeros_like(first[3]), torch.empty_like(first[9])]):
        later[i] = t
    bound(77, later[0].data_ptr(), later[3].data_ptr(), later[9].data_ptr())
    sk(later, 77)
    bound_launches, launches = driver.launched[:1], driver.launched[1:]
    assert [d[0] for d in launches] == ["split"]  # fused_merge
    assert bound_launches == launches
    # the later tensors' addresses went out, not those the launch was bound with
    passed = {v for d in bound_launches for v in d[5]}
    assert {later[i].data_ptr() for i in (0, 3, 9)} <= passed
    assert not {first[i].data_ptr() for i in (0, 3, 9)} & passed


def test_a_bound_inserting_launch_passes_the_calls_new_kv(build):
    """The inserting attend's binding (SparseAttention's bound decode with key/value): the call's
    query, top-k, key, value and output addresses go out, the rest as bound, as an unbound launch
    of the same operands passes them."""
    sk, driver = _recorded_mma(build, False, MMA_INS)
    g = torch.Generator().manual_seed(3)
    new_kv = lambda: [torch.randn(8, 1, 128, generator=g).bfloat16() for _ in range(2)]
    base = _mma_operands(8, 1)
    first = base[:9] + new_kv() + [torch.arange(8, dtype=torch.int32)] + base[9:]
    variable = (0, 3, 9, 10, 12)
    bound = sk.bind(first, variable=variable)
    later = list(first)
    later[0], later[9], later[10], later[12] = _mma_operands(8, 2)[0], *new_kv(), torch.empty_like(first[12])
    later[3] = torch.zeros_like(first[3])
    bound(77, *(later[i].data_ptr() for i in variable))
    sk(later, 77)
    bound_launches, launches = driver.launched[:1], driver.launched[1:]
    assert [d[0] for d in launches] == ["split"] and bound_launches == launches
    passed = set(bound_launches[0][5])
    assert {later[i].data_ptr() for i in variable} <= passed
    assert not {first[i].data_ptr() for i in variable} & passed


def test_a_dependent_launch_waits_before_its_first_instruction(build):
    """with_dependent_launch: every entry waits for the kernel before it ahead of everything else
    it does (any load of another kernel's output comes after the wait); the directives are raised
    to what griddepcontrol needs and nothing else changes."""
    out, kernels = build
    for spec in (MMA, FMA, INSERT):
        ptx = ptx_of((out / kernels[spec.name]["file"]).read_bytes()).decode()
        pdl = with_dependent_launch(ptx)
        assert re.search(r"^\.version (7\.[89]|[89]\.\d)$", pdl, re.M) and re.search(r"^\.target sm_9\d$", pdl, re.M)
        for name in ptx_entries(ptx):
            body = pdl[pdl.index(f".entry {name}("):]
            body = body[body.index("{") + 1:]
            instructions = [ln.strip() for ln in body.splitlines()
                            if ln.strip() and not ln.strip().startswith((".reg", "//"))]
            assert instructions[0] == "griddepcontrol.wait;", (spec.name, name)
        assert pdl.count("griddepcontrol.wait;") == len(ptx_entries(ptx))
        strip = lambda t: re.sub(r"^(\.version|\.target|[ \t]*griddepcontrol).*\n", "", t, flags=re.M)
        assert strip(pdl) == strip(ptx)


def _first_instructions(ptx, name, n):
    body = ptx[ptx.index(f".entry {name}("):]
    body = body[body.index("{") + 1:]
    return [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith((".reg", "//"))][:n]


GLOBAL_LOAD = re.compile(r"^\s*(ld\.global|cp\.async\.c[ag]\.shared\.global)\b.*$", re.M)


@pytest.mark.parametrize("dependent", [False, True], ids=["launch", "dependent-launch"])
def test_l2_evict_first_gives_every_global_load_the_policy(build, dependent):
    """with_l2_evict_first: every global load (plain and non-coherent loads, cp.async copies) of
    real kernels names the evict-first policy, which each entry makes ahead of its other
    instructions (after the dependent launch's wait when both are applied, as StreamKernel
    does); with the hints taken out, the PTX is the one IREE wrote."""
    out, kernels = build
    for spec in (MMA, FMA, MMA_FP8):
        ptx = ptx_of((out / kernels[spec.name]["file"]).read_bytes()).decode()
        hinted = with_l2_evict_first(ptx)
        if dependent:
            hinted = with_dependent_launch(hinted)
        loads = GLOBAL_LOAD.findall(ptx)
        assert loads and len(GLOBAL_LOAD.findall(hinted)) == len(loads)
        for m in GLOBAL_LOAD.finditer(hinted):
            assert ".L2::cache_hint" in m[0] and m[0].endswith(", %msa_l2_evict_first;"), (spec.name, m[0])
        policy = "createpolicy.fractional.L2::evict_first.b64 %msa_l2_evict_first, 1.0;"
        for name in ptx_entries(ptx):
            head = ["griddepcontrol.wait;", policy] if dependent else [policy]
            assert _first_instructions(hinted, name, len(head)) == head, (spec.name, name)
        unhinted = re.sub(r"\.L2::cache_hint|, %msa_l2_evict_first(?=;)", "", hinted)
        strip = lambda t: re.sub(r"^(\.version|\.target|[ \t]*griddepcontrol|[ \t]*createpolicy|[ \t]*\.reg \.b64 "
                                 r"%msa_l2_evict_first).*\n", "", t, flags=re.M)
        assert strip(unhinted) == strip(ptx)
        if spec is MMA_FP8:  # the copies' form is covered, not only the loads'
            assert "cp.async.ca.shared.global.L2::cache_hint" in hinted


def test_l2_evict_first_refuses_a_global_load_it_does_not_know():
    """A load form the rewrite has no rule for (here one with an L1 eviction qualifier) would
    stream through L2 unhinted: refused, naming the line."""
    ptx = (".version 7.6\n.target sm_80\n.address_size 64\n\n.visible .entry k(\n\t.param .u64 k_param_0\n)\n"
           ".maxntid 256, 1, 1\n{\n\t.reg .b32 %r<4>;\n\t.reg .b64 %rd<4>;\n\n"
           "\tld.param.u64 %rd1, [k_param_0];\n\tld.global.L1::no_allocate.b32 %r1, [%rd1];\n\tret;\n}\n")
    with pytest.raises(ValueError, match=r"ld\.global\.L1::no_allocate\.b32 %r1, \[%rd1\]"):
        with_l2_evict_first(ptx)
    plain = ptx.replace("ld.global.L1::no_allocate.b32", "ld.global.v2.f32").replace("%r1,", "{%r1, %r2},")
    assert "\tld.global.L2::cache_hint.v2.f32 {%r1, %r2}, [%rd1], %msa_l2_evict_first;\n" in with_l2_evict_first(plain)


@pytest.mark.skipif(PTXAS is None, reason=MISSING)
def test_ptxas_accepts_the_hinted_ptx_for_sm_90(build, tmp_path):
    """What StreamKernel loads on an H200 (hints, then the dependent launch's wait) assembles for
    sm_90 without errors."""
    out, kernels = build
    for spec in (MMA, FMA, MMA_FP8):
        ptx = ptx_of((out / kernels[spec.name]["file"]).read_bytes()).decode()
        path = tmp_path / f"{spec.name}.ptx"
        path.write_text(with_dependent_launch(with_l2_evict_first(ptx)))
        run = subprocess.run([PTXAS, "-arch=sm_90", str(path), "-o", str(tmp_path / "out.cubin")],
                             capture_output=True, text=True)
        assert run.returncode == 0, (spec.name, run.stderr)


def test_only_decode_with_one_token_a_sequence_reads_each_page_once():
    """kv_read_once, which turns the L2 hint on: decode attends at L=1 (every variant), not at
    L > 1 or in prefill, where rows of one request read the same pages."""
    cfg = MsaConfig(kv_dtype="fp8_e4m3fn")
    for cls in (K.SparseAttnDecodeFmaSpec, K.SparseAttnDecodeMmaSpec, K.SparseAttnDecodeMfmaSpec):
        assert cls(cfg, 16).kv_read_once
        assert not cls(cfg.replace(decode_query_len=4), 16).kv_read_once
    for cls in (K.SparseAttnPrefillFmaSpec, K.SparseAttnPrefillMmaSpec, K.SparseAttnPrefillMfmaSpec):
        assert not cls(cfg, 16).kv_read_once
    # a page table's rows: as the caller says (the same module either way)
    for cls in (K.SparseAttnPagedFmaSpec, K.SparseAttnPagedMmaSpec, K.SparseAttnPagedMfmaSpec):
        assert not cls(cfg, 16).kv_read_once and cls(cfg, 16, read_once=True).kv_read_once
        assert cls(cfg, 16, read_once=True).name == cls(cfg, 16).name
    with pytest.raises(ValueError, match="read_once: expected only for a page-table attend"):
        K.SparseAttnDecodeMmaSpec(cfg, 16, read_once=True)


def test_an_operand_off_the_binding_alignment_is_refused_by_name(build):
    """IREE compiles a kernel taking its bindings 16-byte aligned (and may load two neighbouring
    elements as one vector): a stream launch, bound or not, refuses an operand elsewhere instead
    of faulting or reading the wrong bytes."""
    sk, driver = _recorded_mma(build, False)
    ops = _mma_operands(8, 1)
    seq = torch.zeros(9, dtype=torch.int32)[1:]  # a view 4 bytes into its storage
    with pytest.raises(ValueError, match=rf"{MMA.name}: expected operand 5 at a 16-byte aligned address"):
        sk([*ops[:5], seq, *ops[6:]], 77)
    bound = sk.bind(ops, variable=(0, 3, 9))
    with pytest.raises(ValueError, match="expected operand at address index 1 at a 16-byte aligned address"):
        bound(77, ops[0].data_ptr(), ops[3].data_ptr() + 4, ops[9].data_ptr())
    assert not driver.launched


def test_the_2d_copy_descriptor_has_cuda_hs_layout():
    """_Memcpy2D is CUDA_MEMCPY2D as cuda.h lays it out on a 64-bit host (sixteen 8-byte slots,
    each CUmemorytype int padded to 8): the driver reads the fields at these offsets."""
    from msa_iree.runtime.cuda_launch import _Memcpy2D

    names = ["srcXInBytes", "srcY", "srcMemoryType", "srcHost", "srcDevice", "srcArray", "srcPitch", "dstXInBytes",
             "dstY", "dstMemoryType", "dstHost", "dstDevice", "dstArray", "dstPitch", "WidthInBytes", "Height"]
    assert ctypes.sizeof(_Memcpy2D) == 128
    assert [getattr(_Memcpy2D, n).offset for n in names] == [8 * i for i in range(16)]
