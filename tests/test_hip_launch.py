"""runtime/hip_launch.py on the CPU machine (the HIP driver calls themselves never ran: no AMD GPU):
the code object a gfx942 build stores, its kernels' metadata read from it against the ISA dump's
own text, the launch plan checked against each kernel's declared arguments, and the argument
blocks a launch hands the driver."""
import ctypes
import json
import re

import gpu_cases
import pytest
import torch

from msa_iree import compile as C
from msa_iree import ops as K
from msa_iree.config import MsaConfig
from msa_iree.runtime.hip_launch import HipStreamKernel, KernelInfo, check_kernarg_layout, hsaco_of, kernels_of
from msa_iree.runtime.launch_plan import DispatchPlan

MFMA = K.SparseAttnDecodeMfmaSpec(MsaConfig(kv_dtype="fp8_e4m3fnuz"), 16)
INSERT = K.InsertKvGpuSpec(MsaConfig(kv_dtype="fp8_e4m3fnuz"), 16)
MFMA_INS = MFMA.with_insert()  # the decode attend that writes the step's K/V too
# a step with prefills: the prefill attend whose insert workgroups write the step's K/V first
PREFILL_INS = K.SparseAttnPrefillMfmaSpec(MsaConfig(kv_dtype="fp8_e4m3fnuz"), 16).with_insert()
# the indexer gfx942 serves on matrix cores: a decode step's 4 tokens together, and query tiles
# with the attend's page table emitted (e4m3fn keys and queries)
INDEX_DECODE = K.indexer_set(MsaConfig(), "gfx942").gpu(4)
INDEX_TILED = K.indexer_set(MsaConfig(kv_dtype="fp8_e4m3fn"), "gfx942", fp8_queries=True).gpu_tiled(True)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    out = tmp_path_factory.mktemp("gfx942")
    C.build(None, ["gfx942"], out, specs=[MFMA, INSERT, MFMA_INS, PREFILL_INS, INDEX_DECODE, INDEX_TILED], log=lambda m: None)
    return out, json.loads((out / "manifest.json").read_text())["kernels"]


def _module(build, spec):
    out, kernels = build
    entry = kernels[spec.name]
    return (out / entry["file"]).read_bytes(), (out / entry["launch_plan"]["file"]).read_text()


def _yaml_args(rocmasm: str, kernel: str):
    """(offset, size, kind) of the kernel's arguments, read from the ISA dump's metadata text."""
    meta = rocmasm[rocmasm.index(".amdgpu_metadata"):]
    at = re.search(rf"^\s*\.name:\s+{kernel}\s*$", meta, re.M).start()
    block = meta[:at]
    block = block[block.rindex(".args:"):]
    return [(int(o), int(s), k) for o, s, k in re.findall(r"\.offset:\s+(\d+)\s+\.size:\s+(\d+)\s+\.value_kind:\s+(\w+)",
                                                          block)]


def test_the_code_object_and_its_metadata(build):
    """The AMDGPU ELF in the vmfb, its kernels as its metadata note declares them: the same
    arguments the ISA dump's text lists, the workgroup size and LDS of the kernel descriptors."""
    vmfb, _ = _module(build, MFMA)
    hsaco = hsaco_of(vmfb)
    assert hsaco[:4] == b"\x7fELF" and int.from_bytes(hsaco[18:20], "little") == 224
    kernels = kernels_of(hsaco)
    assert set(kernels) == {"split"}  # fused_merge
    out, _ = build
    asm = "".join(f.read_text() for f in (out / "isa" / MFMA.name).glob("*.rocmasm"))
    for name, info in kernels.items():
        assert info.args == _yaml_args(asm, name), name
        assert info.block == (256, 1, 1)
    assert kernels["split"].lds_bytes > 0
    assert kernels["split"].kernarg_size == 8 * 11 + 4 * sum(k == "by_value" for _, _, k in kernels["split"].args)


def _operands(spec, tokens):
    c = spec.cfg
    hq, h = c.num_heads, c.num_kv_heads
    shapes = [(tokens, hq, 128), (4000, 2048), (4000, 2048), (h, tokens, 16), (tokens, 40), (tokens,), (1,), (h, 1),
              (h, 1), (tokens, hq, 128), (spec.workspace_floats(tokens),)]
    dtypes = ["bfloat16", "uint8", "uint8", "int32", "int32", "int32", "float32", "float32", "float32", "bfloat16",
              "float32"]
    return shapes, dtypes


@pytest.mark.parametrize("tokens", [1, 17, 64, 300])
def test_the_plan_passes_each_kernel_the_arguments_it_declares(build, tokens):
    vmfb, plan = _module(build, MFMA)
    kernels = kernels_of(hsaco_of(vmfb))
    dispatches = DispatchPlan(plan).evaluate(*_operands(MFMA, tokens))
    assert [d[0] for d in dispatches] == ["split"]
    assert dispatches[0][1] == [MFMA.splits(tokens), tokens, 1]
    for name, grid, constants, bindings in dispatches:
        check_kernarg_layout(kernels[name], len(bindings), len(constants))


@pytest.mark.parametrize("tokens", [1, 64])
def test_the_inserting_attends_plan_passes_what_its_kernel_declares(build, tokens):
    """MFMA_INS (key, value and slots after v_scale): one dispatch whose 14 bindings and constants
    are the pointer and 4-byte arguments its code object declares, in its metadata's order."""
    vmfb, plan = _module(build, MFMA_INS)
    kernels = kernels_of(hsaco_of(vmfb))
    assert set(kernels) == {"split"}
    shapes, dtypes = _operands(MFMA_INS, tokens)
    shapes = shapes[:9] + [(tokens, 1, 128), (tokens, 1, 128), (tokens,)] + shapes[9:]
    dtypes = dtypes[:9] + ["bfloat16", "bfloat16", "int32"] + dtypes[9:]
    ((name, grid, constants, bindings),) = DispatchPlan(plan).evaluate(shapes, dtypes)
    assert grid == [MFMA.splits(tokens), tokens, 1] and sorted(k for k, _ in bindings) == list(range(14))
    check_kernarg_layout(kernels[name], len(bindings), len(constants))
    assert kernels["split"].kernarg_size == 8 * 14 + 4 * sum(k == "by_value" for _, _, k in kernels["split"].args)


@pytest.mark.parametrize("tokens", [5, 2111])
def test_the_inserting_prefills_plan_passes_what_its_kernel_declares(build, tokens):
    """PREFILL_INS (query positions, then key, value and slots after v_scale): one dispatch, its
    grid the attend's rows plus ceil(ceil(tokens / 16) / splits) rows of insert workgroups, its 15
    bindings and constants what its code object declares."""
    vmfb, plan = _module(build, PREFILL_INS)
    kernels = kernels_of(hsaco_of(vmfb))
    assert set(kernels) == {"split"}
    shapes = [(tokens, 16, 128), (4000, 2048), (4000, 2048), (1, tokens, 16), (3, 40), (tokens,), (tokens,), (1,),
              (1, 1), (1, 1), (tokens, 1, 128), (tokens, 1, 128), (tokens,), (tokens, 16, 128),
              (PREFILL_INS.workspace_floats(tokens),)]
    dtypes = ["bfloat16", "int8", "int8"] + ["int32"] * 4 + ["float32"] * 3 + ["bfloat16", "bfloat16", "int32",
                                                                                "bfloat16", "float32"]
    ((name, grid, constants, bindings),) = DispatchPlan(plan).evaluate(shapes, dtypes)
    splits, inserts = PREFILL_INS.splits(tokens), -(-tokens // 16)
    assert grid == [splits, tokens + -(-inserts // splits), 1] and sorted(k for k, _ in bindings) == list(range(15))
    check_kernarg_layout(kernels[name], len(bindings), len(constants))


@pytest.mark.parametrize("spec", [INDEX_DECODE, INDEX_TILED], ids=lambda s: s.name)
@pytest.mark.parametrize("tokens, columns", [(4, 32), (200, 1000), (4096, 8192)])
def test_the_mfma_indexers_plan_passes_each_kernel_the_arguments_it_declares(build, spec, tokens, columns):
    """The MFMA indexer gfx942 serves: two dispatches, @score and @merge, each handed the pointer
    and 4-byte arguments its code object declares, in its metadata's order, with a grid covering
    the call (@score's: a workgroup per split and group of rows)."""
    assert spec.dot == "mfma"
    vmfb, plan = _module(build, spec)
    kernels = kernels_of(hsaco_of(vmfb))
    assert set(kernels) == {"score", "merge"}
    dispatches = DispatchPlan(plan).evaluate(*gpu_cases.index_operands(spec, tokens, columns))
    assert [d[0] for d in dispatches] == ["score", "merge"]
    for name, grid, constants, bindings in dispatches:
        check_kernarg_layout(kernels[name], len(bindings), len(constants))
        assert min(grid) >= 1 and kernels[name].block == (256, 1, 1)
    score_grid = dispatches[0][1]
    assert score_grid[0] * score_grid[1] * score_grid[2] >= spec.tuning_row.splits(columns) * -(-tokens // 64)


def test_a_code_object_declaring_other_arguments_is_refused():
    info = KernelInfo("split", (256, 1, 1), [(0, 8, "global_buffer"), (8, 4, "by_value"), (12, 4, "by_value")], 16, 0)
    check_kernarg_layout(info, 1, 2)
    with pytest.raises(ValueError, match="split: expected 2 pointer and 1 4-byte arguments"):
        check_kernarg_layout(info, 2, 1)


class FakeHip:
    """Records what HipStreamKernel hands libamdhip64 (no GPU here)."""

    def __init__(self):
        self.launches = []
        outer = self

        class Lib:
            def hipModuleLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, args, extra):
                outer.launches.append(dict(fn=fn, grid=(gx, gy, gz), block=(bx, by, bz), shared=shared,
                                           stream=stream.value, args=args))
                return 0

        self.lib = Lib()

    def load(self, hsaco, names):
        return "module", {n: n for n in names}

    def check(self, rc, what):
        assert rc == 0, what


def test_a_launch_hands_the_driver_the_plans_grid_pointers_and_constants(build):
    """The insert (one dispatch, the cache written in place): its grid, its workgroup size from the
    code object, no dynamic LDS, and an argument block of the operands' addresses (plus the
    bindings' offsets) then the plan's constants, each at the place the kernel declares."""
    vmfb, plan = _module(build, INSERT)
    fake = FakeHip()
    sk = HipStreamKernel(INSERT.name, vmfb, plan, driver=fake)
    n = 5
    cache = torch.zeros(64, 2048, dtype=torch.uint8)
    key, value = torch.zeros(n, 1, 128, dtype=torch.bfloat16), torch.zeros(n, 1, 128, dtype=torch.bfloat16)
    ti, slots = torch.arange(n, dtype=torch.int32), torch.arange(n, dtype=torch.int32)
    ks, vs = torch.ones(1, 1), torch.ones(1, 1)
    tensors = [cache, key, value, ti, slots, ks, vs]
    sk(tensors, 1234)
    (d,) = DispatchPlan(plan).evaluate([tuple(t.shape) for t in tensors],
                                       [str(t.dtype).replace("torch.", "") for t in tensors])
    (got,) = fake.launches
    info = sk.kernels[d[0]]
    assert got["fn"] == d[0] and list(got["grid"]) == d[1] and got["block"] == info.block and got["shared"] == 0
    assert got["stream"] == 1234
    args = got["args"]
    pointers = [ctypes.c_uint64.from_address(args[i]).value for i in range(len(d[3]))]
    assert pointers == [tensors[k].data_ptr() + offset for k, offset in d[3]]
    constants = [ctypes.c_uint32.from_address(args[len(d[3]) + i]).value for i in range(len(d[2]))]
    assert constants == d[2]
    # a bound launch passes the same, the variable operands (key, value) at their new addresses
    key2, value2 = key.clone(), value.clone()
    bound = sk.bind(tensors, variable=(1, 2))
    bound(99, key2.data_ptr(), value2.data_ptr())
    again = fake.launches[-1]["args"]
    moved = [ctypes.c_uint64.from_address(again[i]).value for i in range(len(d[3]))]
    want = [(key2 if k == 1 else value2 if k == 2 else tensors[k]).data_ptr() + off for k, off in d[3]]
    assert moved == want
