"""The GPU-level kernels and the zero-copy runtime, run on a CUDA GPU through IREE's cuda driver.

These tests need an NVIDIA GPU, the iree-base-runtime cuda driver and prebuilt cuda modules
(`python tools/build_gpu_tests.py --out DIR`, then MSA_IREE_CUDA_BUILD=DIR): the CPU CI has none
of them, so there they are skipped with the reason; benchmarks/results/gpu-tests.json records their last GPU run.
"""
import functools
import os
import pathlib

import pytest
import torch

from msa_iree import reference as R
from msa_iree import testing
from msa_iree.config import DTYPES, MsaConfig
import gpu_cases
import tolerances as tol
from msa_iree.ops import GPU_ATTEND, GPU_PAGED_ATTEND, SparseAttnDecodeFmaSpec
from msa_iree.ops.fp8 import storage_dtype
from msa_iree.ops.tuning import ARRIVAL_COUNTERS
from msa_iree.ops.indexer import indexer_config
from msa_iree.runtime.library import module_scale

pytestmark = pytest.mark.gpu
BUILD = pathlib.Path(os.environ.get("MSA_IREE_CUDA_BUILD", pathlib.Path(__file__).resolve().parent.parent / "build" / "cuda-tests"))


@functools.cache
def _library_or_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (GPU-level kernels are tested on an NVIDIA GPU; see tools/GPU.md)"
    try:
        import iree.runtime as rt

        rt.get_driver("cuda")
    except Exception as e:  # noqa: BLE001 - any failure means: no usable driver
        return f"IREE cuda driver unavailable: {e}"
    if not (BUILD / "manifest.json").exists():
        return f"no cuda test build at {BUILD} (python tools/build_gpu_tests.py --out {BUILD})"
    from msa_iree.runtime import KernelLibrary

    return KernelLibrary("cuda", BUILD, compile_missing=False)


@pytest.fixture
def cuda_kernels():
    lib = _library_or_reason()
    if isinstance(lib, str):
        pytest.skip(lib)
    return lib


def _flat_pages(cache):
    """SHUFFLE view -> [pages * H, 2048] storage elements (the GPU kernel's operand)."""
    return cache.reshape(cache.shape[0] * cache.shape[1], -1).view(storage_dtype(cache.dtype))


def _module_operands(c, *positions):
    """A testing Case as the GPU attend module's inputs: q, flat pages, top-k, block table, the
    row positions (seq_lens for decode; query_req_id, query_abs_pos for prefill), scales."""
    ks, vs = (module_scale(s, c.num_kv_heads).contiguous() for s in (c.k_scale, c.v_scale))
    return [c.q, _flat_pages(c.k_cache), _flat_pages(c.v_cache), c.topk, c.block_table, *positions,
            torch.tensor([c.scale]), ks, vs]


def _poisoned_workspace(spec, num_tokens):
    """A workspace for `num_tokens` rows filled with NaN past its arrival counters, which start at
    zero (as the library's and SparseAttention's do): what the partials held must not matter."""
    ws = torch.full((spec.workspace_floats(num_tokens),), float("nan"), device=torch.device("cuda"))
    ws[:ARRIVAL_COUNTERS] = 0
    return ws


def _cpu(t):
    return None if t is None else t.cpu()


def _assert_every_row_written_and_close(got, ref, label=None):
    """got: an attend's output on the CPU; within two bf16 roundings of the largest reference
    output (fp8 outputs reach |19|) and a little more, every element written (no NaN poison left)."""
    assert not got.isnan().any(), label
    assert (got.float() - ref.float()).abs().max() < 2 * 2 ** -8 * ref.float().abs().max() + 1e-2, label


def _decode_spec(matrix, kv="bf16"):
    """The decode attend of one matrix variant (mfma: gfx942's, emulated), 16 heads, L=1, interleaved."""
    return GPU_ATTEND[matrix, "cuda"][0](MsaConfig(kv_dtype=kv), 16)


def _variants(prefill):
    """(case, spec class) for every GPU decode case: the portable FMA kernel, and where they apply
    the tensor-core (mma) kernel CUDA serves with and gfx942's MFMA kernel with its MFMAs emulated
    (its numerics, proven here)."""
    out = []
    for c in gpu_cases.GPU_DECODE_CASES:
        cfg = MsaConfig(num_heads=c[0], num_kv_heads=c[1], kv_dtype=c[2], query_dtype=c[3])
        for name in ("fma", "mma", "mfma"):
            decode, prefill_cls = GPU_ATTEND[name, "cuda"]
            if decode.supports(cfg):
                out.append(pytest.param(*c, prefill_cls if prefill else decode,
                                        id=f"{name}-h{c[0]}kv{c[1]}-{c[2]}-L{c[4]}-s{c[5]}-{c[6]}"))
    return out


@pytest.mark.parametrize("hq, h, kv, qd, L, stride, smode, spec_cls", _variants(prefill=False))
def test_decode_gpu_kernel_matches_reference(cuda_kernels, hq, h, kv, qd, L, stride, smode, spec_cls):
    # padded (0), a lone token, block edges (127/128/129), 16 full blocks and a long context
    seq = [0, 1, 127, 128, 129, 300, 2048, 2049, 5000, 9000]
    seq = [s if s == 0 else max(s, L) for s in seq]
    c = testing.decode_case(seq, decode_query_len=L, num_heads=hq, num_kv_heads=h, kv_dtype=DTYPES[kv],
                            q_dtype=DTYPES[qd], layout="interleaved" if stride == 16 else "planes",
                            seed=hq + 7 * L + stride, scale_mode=smode)
    # duplicates: the own block twice (counted once) and an older block twice (counted twice, as the table does)
    t = c.topk.shape[1] - 1
    own = int(c.query_abs_pos[t]) // 128
    c.topk[0, t, :4] = torch.tensor([own, own, 3, 3], dtype=torch.int32)
    spec = spec_cls(MsaConfig(num_heads=hq, num_kv_heads=h, kv_dtype=kv, query_dtype=qd, decode_query_len=L), stride)
    dev = torch.device("cuda")
    args = _module_operands(c, c.seq_lens)
    out = torch.full(c.q.shape, float("nan"), dtype=DTYPES[qd], device=dev)  # poisoned: every element must be written
    ws = _poisoned_workspace(spec, c.q.shape[0])
    got, _ = cuda_kernels.run(spec, *[a.to(dev) for a in args], out=[out, ws])
    assert got is out

    ref = torch.full_like(c.q, float("nan"))
    R.sparse_attn_decode(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.seq_lens, h, c.scale, ref,
                         c.k_scale, c.v_scale, decode_query_len=L)
    out = out.cpu()
    assert not out.isnan().any()
    err = (out.float() - ref.float()).abs()
    assert err.max() < tol.MAX_ABS[torch.bfloat16] and err.mean() < tol.MEAN_ABS[torch.bfloat16], (float(err.max()), float(err.mean()))
    empty = c.query_abs_pos < 0
    assert out[empty].eq(0).all(), "rows of padded requests must be exactly zero"


@pytest.mark.parametrize("hq, h, kv, qd, L, stride, smode, spec_cls", _variants(prefill=True))
def test_prefill_gpu_kernel_matches_reference(cuda_kernels, hq, h, kv, qd, L, stride, smode, spec_cls):
    # chunks with and without a prefix, crossing block edges, one token, a long prompt
    c = testing.prefill_case([130, 1, 127, 300, 64], [0, 128, 1, 2000, 4000], num_heads=hq, num_kv_heads=h,
                             kv_dtype=DTYPES[kv], q_dtype=DTYPES[qd], layout="interleaved" if stride == 16 else "planes",
                             seed=hq + stride, scale_mode=smode)
    c.query_abs_pos[5] = -1  # a padded token: must come out exactly zero
    spec = spec_cls(MsaConfig(num_heads=hq, num_kv_heads=h, kv_dtype=kv, query_dtype=qd), stride)
    dev = torch.device("cuda")
    args = _module_operands(c, c.query_req_id, c.query_abs_pos)
    out = torch.full(c.q.shape, float("nan"), dtype=DTYPES[qd], device=dev)
    ws = _poisoned_workspace(spec, c.q.shape[0])
    cuda_kernels.run(spec, *[a.to(dev) for a in args], out=[out, ws])
    ref = torch.full_like(c.q, float("nan"))
    R.sparse_attn_prefill(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.query_req_id, c.query_abs_pos, h,
                          c.scale, ref, c.k_scale, c.v_scale)
    out = out.cpu()
    assert not out.isnan().any()
    err = (out.float() - ref.float()).abs()
    assert err.max() < tol.MAX_ABS[torch.bfloat16] and err.mean() < tol.MEAN_ABS[torch.bfloat16], (float(err.max()), float(err.mean()))
    assert out[5].eq(0).all()


def test_output_is_written_in_place(cuda_kernels):
    """The GPU attend writes into the caller's tensor (iree.abi.output over a DLPack import): the
    same memory, and rows outside the slice it was given stay untouched."""
    c = testing.decode_case([300, 2049], seed=3)
    spec = SparseAttnDecodeFmaSpec(MsaConfig(), 16)
    dev = torch.device("cuda")
    args = _module_operands(c, c.seq_lens)
    big = torch.full((4, 16, 128), 7.0, dtype=torch.bfloat16, device=dev)
    target = big[1:3]
    ptr = target.data_ptr()
    ws = _poisoned_workspace(spec, 2)
    cuda_kernels.run(spec, *[a.to(dev) for a in args], out=[target, ws])
    assert target.data_ptr() == ptr
    ref = torch.empty_like(c.q)
    R.sparse_attn_decode(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.seq_lens, 1, c.scale, ref)
    assert (big[1:3].cpu().float() - ref.float()).abs().max() < tol.MAX_ABS[torch.bfloat16]
    assert big[0].eq(7).all() and big[3].eq(7).all()


def _nan_case(kv):
    """A decode case with fp8 NaN codes: K at a position row 0 sees (its scores, so its whole
    output, become NaN), V at a position row 1 sees (dim 77 of its output), and both in row 2's
    own block past its position (must change nothing). Returns (case, reference output)."""
    from msa_iree.layout import pack_kv_cache

    c = testing.decode_case([300, 2049, 129], kv_dtype=DTYPES[kv], seed=21, keep_own_prob=1.0)
    nan = 0x7F if kv == "fp8_e4m3fn" else 0x80
    own = [int(c.block_table[r, int(c.query_abs_pos[r]) // 128]) for r in range(3)]
    kb, vb = c.k_logical.view(torch.uint8), c.v_logical.view(torch.uint8)
    kb[own[0], 0, 0, 5] = nan      # row 0 sees tokens 0..43 of its own block
    vb[own[1], 0, 0, 77] = nan     # row 1 (position 2048) sees token 0 of its own block only
    kb[own[2], 1, 0, 9] = nan      # row 2 (position 128) sees token 0 only
    vb[own[2], 64, 0, 1] = nan
    c.k_cache, c.v_cache = pack_kv_cache(c.k_logical, c.v_logical, "interleaved")
    ref = torch.full_like(c.q, float("nan"))
    R.sparse_attn_decode(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.seq_lens, 1, c.scale, ref,
                         c.k_scale, c.v_scale, decode_query_len=1)
    return c, ref


def test_the_nan_case_is_what_it_says():
    """(CPU) The reference turns exactly row 0 and dim 77 of row 1 into NaN for _nan_case."""
    for kv in ("fp8_e4m3fn", "fp8_e4m3fnuz"):
        c, ref = _nan_case(kv)
        want = torch.zeros_like(ref, dtype=torch.bool)
        want[0] = True
        want[1, :, 77] = True
        assert torch.equal(ref.isnan(), want), kv


@pytest.mark.parametrize("kv", ["fp8_e4m3fn", "fp8_e4m3fnuz"])
@pytest.mark.parametrize("matrix", ["fma", "mma", "mfma"])
def test_fp8_nan_codes_propagate_as_in_the_reference(cuda_kernels, kv, matrix):
    """No silent garbage: a NaN code the row sees gives NaN where the reference does (the mma and
    mfma kernels' word decode marks NaN codes explicitly), and one it does not see changes nothing."""
    c, ref = _nan_case(kv)
    spec = _decode_spec(matrix, kv)
    dev = torch.device("cuda")
    args = _module_operands(c, c.seq_lens)
    out = torch.zeros(c.q.shape, dtype=c.q.dtype, device=dev)
    ws = _poisoned_workspace(spec, c.q.shape[0])
    cuda_kernels.run(spec, *[a.to(dev) for a in args], out=[out, ws])
    out = out.cpu()
    assert torch.equal(out.isnan(), ref.isnan())
    seen = ~ref.isnan()
    assert (out[seen].float() - ref[seen].float()).abs().max() < tol.MAX_ABS[torch.bfloat16]


def test_a_short_workspace_is_refused(cuda_kernels):
    """The module checks the workspace it is given before any dispatch writes into it."""
    c = testing.decode_case([300, 2049], seed=3)
    spec = SparseAttnDecodeFmaSpec(MsaConfig(), 16)
    dev = torch.device("cuda")
    args = _module_operands(c, c.seq_lens)
    out = torch.empty_like(c.q, device=dev)
    # the arrival counters, then 2 rows' splits (the tuning table) of 16 heads' o + (m, l)
    needed = ARRIVAL_COUNTERS + 2 * spec.splits(2) * 16 * 130
    short = torch.empty(needed - 1, device=dev)
    with pytest.raises(Exception, match="workspace"):
        cuda_kernels.run(spec, *[a.to(dev) for a in args], out=[out, short])


def test_results_come_back_on_the_gpu(cuda_kernels):
    """A module that allocates its result (the page-16 rebase) returns a torch GPU tensor."""
    from msa_iree.ops import RebaseBlockTableSpec

    bt = torch.randint(-1, 1000, (5, 9), dtype=torch.int32, device="cuda")
    (got,) = cuda_kernels.run(RebaseBlockTableSpec(MsaConfig()), bt, out_dtypes=[torch.int32])
    assert got.device.type == "cuda"
    assert torch.equal(got, R.rebase_block_table_to_page16(bt))


@pytest.mark.parametrize("kv, qd, layout, h, smode", gpu_cases.GPU_SERVING_CASES)
@pytest.mark.parametrize("matrix, wide", [("fma", False), ("mma", False), ("mfma", False), ("mma", True)])
def test_serving_simulation_on_gpu(cuda_kernels, kv, qd, layout, h, smode, matrix, wide):
    """wide: the block table as wide as max_model_len with max_seq_len given (vLLM's form): only
    its used columns come to the host, the page-16 tables are rebased on the GPU."""
    from serving import Server

    s = Server(cuda_kernels, DTYPES[kv], DTYPES[qd], layout, h, smode, seed=11, device="cuda", gpu_matrix=matrix,
               wide_table=wide)
    assert s.attn.gpu_decode and s.attn.gpu_matrix == matrix
    s.step([], [("a", 200), ("b", 130)], 1)                       # two chunked prefills
    s.step(["b"], [("a", 100), ("c", 129)], 1)                    # decode, prefills with a prefix
    s.step(["a", "b", "c", None, None], [], 1)                   # a decode batch padded with 2 requests
    s.step(["a", "b", "c", None], [], 4)                          # speculative decode L = 4
    s.step(["a", "c"], [("d", 255), ("b", 3)], 4)                 # spec decode + prefills
    assert s.k_cache.device.type == "cuda"


def _metadata_values(md, prefix=""):
    """Every value of a step's metadata (tensors on the host), by field name; not step_key (addresses)."""
    import dataclasses

    values = {}
    for f in dataclasses.fields(md):
        v = getattr(md, f.name)
        if dataclasses.is_dataclass(v):
            values.update(_metadata_values(v, f"{prefix}{f.name}."))
        elif f.name != "step_key":
            values[prefix + f.name] = v.cpu() if isinstance(v, torch.Tensor) else v
    return values


@pytest.mark.parametrize("writer", ["gpu", "portable"])
@pytest.mark.parametrize("blocks, cols", [(400, 48), (20000, 4608)])
def test_the_builder_on_cuda_gives_the_hosts_metadata(cuda_kernels, writer, blocks, cols):
    """A step built on CUDA (the driver's copies from int32 inputs, int64 slots as vLLM's; torch's
    copies from int64 ones) holds the values the same step built on the host does: decode steps,
    a padded batch, spec decode, a mixed step in a table wider than max_seq_len (its used columns
    copied as rows), without slots, and the same shape again with new values; for the GPU's KV
    writer and the portable one (its rows after the rest); in a table of 48 columns and in one
    past _HOST_REBASE_IDS (the page-16 tables rebased by torch ops) whose decode steps of four
    requests are past _HOST_CHECK_IDS (checked and rebased by the device's graph), one of them
    the first step past max_num_tokens (the derived buffer grown after the graph ran), the last
    through torch's replay of the graph (a torch that gives no graph handle)."""
    from msa_iree.runtime import MetadataBuilder

    gen = torch.Generator().manual_seed(5)
    kernels = cuda_kernels if writer == "gpu" else None

    def step(qlens, seq_lens, slot_dtype=torch.int32, ints=torch.int32):
        seq = torch.tensor(seq_lens, dtype=ints)
        q = torch.tensor(qlens, dtype=ints)
        qsl = torch.cat([torch.zeros(1, dtype=ints), q.cumsum(0).to(ints)])
        table = torch.randperm(blocks, generator=gen)[:len(qlens) * cols].view(len(qlens), cols).int()
        table[:, 40:] = -1  # past every request's blocks (stale in vLLM's table)
        req = torch.repeat_interleave(torch.arange(len(qlens)), q.long())
        pos = (seq - q).long()[req] + torch.arange(req.shape[0]) - qsl.long()[req]
        slots = (table.long()[req, pos.clamp(min=0) // 128] * 128 + pos % 128).where(pos >= 0, -1).to(slot_dtype)
        return table, seq, qsl, seq - q, slots

    cases = [  # (qlens, seq_lens, L, num_decodes, keywords, step options)
        ([1, 1, 1, 1], [300, 129, 128, 1], 1, 4, {}, {}),
        ([1, 1, 1, 1], [5000, 17, 1024, 2], 1, 4, {}, {}),   # the same shape, new values
        ([1, 1, 80, 20], [300, 129, 1000, 20], 1, 2, {}, {}),  # past max_num_tokens (64) for the first time
        ([1, 1, 1, 1], [300, 129, 128, 1], 1, 4, {}, {"slot_dtype": torch.int64}),
        ([1, 1, 0, 0], [300, 129, 0, 0], 1, 4, {"num_actual_tokens": 4}, {}),
        ([4, 4, 4], [300, 131, 4], 4, 3, {}, {"slot_dtype": torch.int64}),
        ([1, 1, 200, 57], [300, 129, 1000, 57], 1, 2, {"max_seq_len": 1100}, {"slot_dtype": torch.int64}),
        ([1, 1, 200, 57], [300, 129, 1000, 57], 1, 2, {"max_seq_len": 1100}, {"ints": torch.int64}),
        ([1, 1, 1], [300, 129, 4096], 1, 3, {"max_seq_len": 4096, "no_slots": True}, {}),
        "replay",  # the device checks' graphs from here on through torch's replay (no graph handle)
        ([1, 1, 1, 1], [2000, 17, 1024, 5], 1, 4, {}, {}),
    ]
    on_cuda = MetadataBuilder(8, cols * 128, num_cache_blocks=blocks, kernels=kernels, device="cuda")
    on_host = MetadataBuilder(8, cols * 128, num_cache_blocks=blocks, kernels=kernels, device="cpu")
    for i, case in enumerate(cases):
        if case == "replay":
            for check in on_cuda._checks.values():
                check.graph_exec = None
            continue
        qlens, seq_lens, L, nd, kw, opts = case
        kw = dict(kw)
        table, seq, qsl, computed, slots = step(qlens, seq_lens, **opts)
        if kw.pop("no_slots", False):
            slots = None
        elif "num_actual_tokens" in kw:  # a padded batch's slots cover its padding tokens too
            slots = torch.cat([slots, slots.new_full((kw["num_actual_tokens"] - slots.shape[0],), -1)])
        want = _metadata_values(on_host.build(table, seq, qsl, computed, L, nd, slots, **kw))
        table, seq, qsl, computed, slots = (None if t is None else t.cuda() for t in (table, seq, qsl, computed, slots))
        got = _metadata_values(on_cuda.build(table, seq, qsl, computed, L, nd, slots, **kw))
        assert got.keys() == want.keys(), i
        for name, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[name], value), (i, name)
            else:
                assert got[name] == value, (i, name)


_FIRST_IN_ITS_PROCESS = """
import torch
from msa_iree.runtime import MetadataBuilder

b = MetadataBuilder(4, 4096, num_cache_blocks=200, device="cuda")  # nothing has touched the GPU before
table = torch.randperm(200, generator=torch.Generator().manual_seed(2))[:4 * 32].view(4, 32).int()
seq = torch.tensor([300, 129, 4096, 1], dtype=torch.int32)
qsl = torch.arange(5, dtype=torch.int32)
args = (table, seq, qsl, seq - 1, 1, 4)
on_host = MetadataBuilder(4, 4096, num_cache_blocks=200).build(*args)
on_cuda = b.build(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in args))
assert torch.equal(on_cuda.decode.page16_block_table.cpu(), on_host.decode.page16_block_table)
assert torch.equal(on_cuda.token_abs_pos.cpu(), on_host.token_abs_pos)
print("built")
"""


def test_a_builder_made_first_in_its_process_builds_on_cuda(cuda_kernels):
    """A MetadataBuilder on CUDA made before anything else in its process touched the GPU (no
    context current on its thread until the builder makes torch's current) builds a decode step
    whose tables and positions are the host builder's."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _FIRST_IN_ITS_PROCESS], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "built", run.stderr[-3000:]


@pytest.mark.parametrize("cols", [48, 4608])
def test_the_builder_on_cuda_refuses_the_ids_the_host_refuses(cuda_kernels, cols):
    """A block id below 0 or past num_cache_blocks in a column a request uses is refused by the
    builder on CUDA with the host builder's error, in a table checked on the host (48 columns)
    and in one checked on the device (4 x 4608 ids, past _HOST_CHECK_IDS); the same ids past a
    request's context are not read (the step builds)."""
    from msa_iree.runtime import MetadataBuilder
    from msa_iree.runtime.metadata import _HOST_CHECK_IDS

    assert (4 * cols > _HOST_CHECK_IDS) == (cols == 4608)
    blocks = 20000
    seq = torch.tensor([300, 129, 5000, 1], dtype=torch.int32)
    qsl = torch.arange(5, dtype=torch.int32)
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(3))[:4 * cols].view(4, cols).int()
    cases = [((2, 39), -1), ((1, 1), -7), ((0, 2), blocks), ((3, 0), blocks + 5),  # used: refused
             ((1, 2), -1), ((0, 3), blocks)]                                      # past the context: read by no one
    for (r, c), bad in cases:
        t = table.clone()
        t[r, c] = bad
        builders = [MetadataBuilder(8, cols * 128, num_cache_blocks=blocks, kernels=cuda_kernels, device=d)
                    for d in ("cpu", "cuda")]
        args = [(t.to(d), seq.to(d), qsl.to(d), (seq - 1).to(d), 1, 4) for d in ("cpu", "cuda")]
        try:
            want = builders[0].build(*args[0]).max_block_id
        except IndexError as e:
            with pytest.raises(IndexError) as got:
                builders[1].build(*args[1])
            assert str(got.value) == str(e), ((r, c), bad)
        else:
            assert c >= (int(seq[r]) + 127) // 128, ((r, c), bad)  # the host refuses every used one
            assert builders[1].build(*args[1]).max_block_id == want


@pytest.mark.parametrize("kv, qd, layout, h, smode", gpu_cases.GPU_SERVING_CASES)
@pytest.mark.parametrize("matrix", ["mma", "mfma"])
def test_forward_inserts_a_decode_steps_kv_in_its_own_launch(cuda_kernels, kv, qd, layout, h, smode, matrix):
    """forward(key=, value=): a decode-only step's attend writes the step's K/V itself (the
    cache byte for byte the reference insert's, the output the reference attend's over it): checked
    and bound calls, L = 1 and 4 (a token reads the request's earlier new tokens of the step),
    padding requests, a request crossing into a new block; prefill and mixed steps insert first,
    a mixed step of a bound shape too (its binding, which does not insert, serves the attend)."""
    from serving import Server

    s = Server(cuda_kernels, DTYPES[kv], DTYPES[qd], layout, h, smode, seed=13, device="cuda", gpu_matrix=matrix,
               insert_in_forward=True)
    assert s.attn.fuses_insert
    s.step([], [("a", 200), ("b", 126)], 1)                       # prefills: insert_kv, then the attend
    for L, batch in ((1, ["a", "b"]), (4, ["a", "b", None, None])):
        s.step(batch, [], L)                                      # checked: binds the inserting attend
        bound = s.attn._decode_launch
        assert bound is not None and bound.insert
        s.step(batch, [], L)                                      # the next step of this shape: bound
        assert s.attn._decode_launch is bound
    s.step(["a"], [("c", 129)], 1)                                # mixed: insert_kv, then the attend
    s.step(["a"], [("c", 50)], 1)                                 # c at 129..178: binds
    mixed = s.attn._mixed_launch
    s.step(["a"], [("c", 50)], 1)                                 # 179..228, the same shape: insert_kv, the binding
    assert mixed is not None and not mixed.insert and s.attn._mixed_launch is mixed


@pytest.mark.parametrize("kv, qd, layout, h, smode", gpu_cases.GPU_SERVING_CASES)
def test_a_mixed_steps_later_calls_are_bound_and_attend(cuda_kernels, kv, qd, layout, h, smode):
    """A step with decode and prefill parts binds its one attend over every row (_StepLaunch; the
    call's top-k rows are all of its tensor, so contiguous for any KV heads); the next step of the
    same shape (fresh metadata, new query, top-k, K/V) is served by that binding and attends as
    the reference, also with speculative decode rows (L=4) beside the chunk; a decode-only step
    keeps a binding of its own."""
    from serving import Server

    s = Server(cuda_kernels, DTYPES[kv], DTYPES[qd], layout, h, smode, seed=17, device="cuda")
    s.step([], [("a", 200), ("d", 500)], 1)
    s.step(["a"], [], 1)
    decode = s.attn._decode_launch
    s.step(["a"], [("d", 60)], 1)                                  # binds; d's chunk at 500..559
    mixed = s.attn._mixed_launch
    assert mixed is not None and not mixed.insert
    s.step(["a"], [("d", 60)], 1)                                  # 560..619: the same shape, served by the binding
    assert s.attn._mixed_launch is mixed and s.attn._decode_launch is decode
    s.step(["a"], [("d", 30)], 4)                                  # speculative decode beside a chunk: binds anew
    spec = s.attn._mixed_launch
    s.step(["a"], [("d", 30)], 4)                                  # the same shape: served by that binding
    assert spec is not None and spec is not mixed and s.attn._mixed_launch is spec


INSERT_CASES = [(*c, m) for c in gpu_cases.GPU_INSERT_CASES for m in (("tensor", "token") if "fp8" in c[0] else ("none",))]


@pytest.mark.parametrize("kv, kd, layout, h, smode", INSERT_CASES)
def test_insert_kv_gpu_is_in_place_and_exact(cuda_kernels, kv, kd, layout, h, smode):
    """The GPU writer updates the cache's own memory and stores exactly the reference's bytes
    (torch's fp8 cast: round to nearest even, saturation, subnormals, ties); other bytes stay."""
    from msa_iree.layout import allocate_kv_cache
    from msa_iree.runtime import insert_kv

    g = torch.Generator().manual_seed(len(kv) * 7 + h)
    dtype = DTYPES[kv]
    blocks = 6
    kc, vc = allocate_kv_cache(blocks, h, dtype, layout, fill=0)
    base = torch.randint(0, 256, (blocks * 16 * h * 2048 * dtype.itemsize,), generator=g, dtype=torch.uint8)
    whole = torch.as_strided(kc.view(torch.uint8), (base.numel(),), (1,))
    whole.copy_(base)  # random old bytes, so that unwritten bytes are checked too
    n = 40
    key = (torch.randn(n, h, 128, generator=g) * 3).to(DTYPES[kd])
    value = (torch.randn(n, h, 128, generator=g) * 3).to(DTYPES[kd])
    key[0, 0, :8] = torch.tensor([0.0, 1e-9, -1e-9, 500.0, -900.0, 0.0009765625, 0.001953125, 3.25])  # edges
    slots = torch.randperm(blocks * 128, generator=g)[:n].int()
    slots[3] = -1  # padding: skipped
    ks = vs = None
    if kv.startswith("fp8"):
        if smode == "tensor":
            ks, vs = torch.tensor([0.5]), torch.tensor([0.25])
        else:
            ks = 0.05 + torch.rand(h, blocks * 128, generator=g)
            vs = 0.05 + torch.rand(h, blocks * 128, generator=g)
    R.insert_kv(key, value, kc, vc, slots, ks, vs)  # in place on the CPU views (one shared buffer)
    want = whole.clone()

    dev = torch.device("cuda")
    gk, gv = allocate_kv_cache(blocks, h, dtype, layout, device=dev, fill=0)
    torch.as_strided(gk.view(torch.uint8), (base.numel(),), (1,)).copy_(base.to(dev))
    ptr = gk.data_ptr()
    cuda = lambda t: None if t is None else t.to(dev)
    insert_kv(cuda_kernels, key.to(dev), value.to(dev), gk, gv, slots.to(dev), cuda(ks), cuda(vs))
    assert gk.data_ptr() == ptr
    got = torch.as_strided(gk.view(torch.uint8), (base.numel(),), (1,)).cpu()
    assert not torch.equal(want, base)  # the reference did write
    bad = (got != want).nonzero().reshape(-1)
    assert bad.numel() == 0, f"{bad.numel()} bytes differ, first at {bad[:5].tolist()}: got {got[bad[:5]].tolist()} want {want[bad[:5]].tolist()}"


@pytest.mark.parametrize("matrix", ["fma", "mma", "mfma"])
def test_one_workspace_serves_calls_of_every_split_count(cuda_kernels, matrix):
    """One output-poisoned call after another on one workspace, with row counts that give 16, 8,
    4, 2, 1 and again 16 splits (with one split the mma and mfma attends write the output
    themselves; with more the last workgroup of a row merges it, counted in the arrival
    counters): every call matches the reference and leaves the counters zero."""
    spec = _decode_spec(matrix)
    dev = torch.device("cuda")
    ws = _poisoned_workspace(spec, 300)
    gen = torch.Generator().manual_seed(5)
    for batch in (3, 20, 40, 100, 300, 5):
        c = testing.decode_case(torch.randint(1, 1200, (batch,), generator=gen).tolist(), seed=batch)
        out = torch.full(c.q.shape, float("nan"), dtype=c.q.dtype, device=dev)
        cuda_kernels.run(spec, *[a.to(dev) for a in _module_operands(c, c.seq_lens)], out=[out, ws])
        ref = torch.empty_like(c.q)
        R.sparse_attn_decode(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.seq_lens, 1, c.scale, ref)
        err = (out.cpu().float() - ref.float()).abs()
        assert err.max() < tol.MAX_ABS[torch.bfloat16], (batch, float(err.max()))
        counters = ws[:ARRIVAL_COUNTERS].view(torch.int32).cpu()
        assert not counters.any(), (batch, counters.nonzero().flatten()[:5].tolist())


@pytest.mark.parametrize("matrix", ["fma", "mma", "mfma"])
def test_what_no_row_may_see_is_never_read(cuda_kernels, matrix):
    """NaN in every K/V slot past each row's position in its own block (and in a block no table
    names) must not reach the output: the kernels mask scores and zero V there (0 * NaN is NaN)."""
    from msa_iree.layout import pack_kv_cache

    c = testing.decode_case([129, 300, 2049, 77, 1000], seed=31, keep_own_prob=1.0)
    k, v = c.k_logical.clone(), c.v_logical.clone()
    named = set(c.block_table[c.block_table >= 0].tolist())
    for t in (k, v):
        for b in set(range(t.shape[0])) - named:
            t[b] = float("nan")
        for r in range(len(c.seq_lens)):
            pos = int(c.query_abs_pos[r])
            t[int(c.block_table[r, pos // 128]), pos % 128 + 1:] = float("nan")
    c.k_cache, c.v_cache = pack_kv_cache(k, v, "interleaved")
    spec = _decode_spec(matrix)
    dev = torch.device("cuda")
    out = torch.full(c.q.shape, float("nan"), dtype=c.q.dtype, device=dev)
    cuda_kernels.run(spec, *[a.to(dev) for a in _module_operands(c, c.seq_lens)], out=[out, _poisoned_workspace(spec, 5)])
    ref = torch.empty_like(c.q)
    R.sparse_attn_decode(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.seq_lens, 1, c.scale, ref)
    assert not ref.isnan().any()  # the reference, too, reads none of it
    out = out.cpu()
    assert not out.isnan().any()
    assert (out.float() - ref.float()).abs().max() < tol.MAX_ABS[torch.bfloat16]


def _lift_to_the_top(c, dtype, nan_code):
    """Case c's blocks moved to the top of an interleaved GPU cache of more than 2 GiB (block b to
    a permuted id past 2^31 bytes: page-16 ids past 2^19), every other byte `nan_code` (an fp8 NaN
    code, or a bf16 NaN's high byte pair): (k view, v view, block table of the big ids, the map)."""
    from msa_iree.layout import allocate_kv_cache, num_cache_blocks

    dev = torch.device("cuda")
    small = c.k_cache.view(torch.uint8).reshape(num_cache_blocks(c.k_cache, c.v_cache), -1)
    nb, block_bytes = small.shape
    total = (1 << 31) // block_bytes + 2 * nb
    kc, vc = allocate_kv_cache(total, 1, dtype, "interleaved", device=dev)
    rows = kc.view(torch.uint8).reshape(total, block_bytes)
    rows.fill_(nan_code) if dtype != torch.bfloat16 else kc.fill_(float("nan"))
    top = total - nb + torch.randperm(nb, generator=torch.Generator().manual_seed(nb))  # small id -> big id
    assert int(top.min()) * block_bytes >= 1 << 31 and int(top.min()) * 16 >= 1 << 16
    rows[top.to(dev)] = small.to(dev)
    bt = torch.where(c.block_table >= 0, top[c.block_table.clamp(min=0).long()].int(), c.block_table)
    return kc, vc, bt, top


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3fn"])
@pytest.mark.parametrize("matrix", ["fma", "mma", "mfma"])
def test_page_ids_past_16_bits_and_byte_offsets_past_2_31(cuda_kernels, matrix, kv):
    """A bug users of AITER hit (page ids >= 65,536 and byte offsets >= 2^31 silently truncated: aiter #3062,
    ATOM #702): the rows' blocks at the top of a cache of more than 2 GiB, everything else NaN;
    the attend's output is the reference's over the small cache they came from."""
    dtype = DTYPES[kv]
    c = testing.decode_case([300, 2049, 5000, 77], seed=41, kv_dtype=dtype)
    kc, vc, bt, _ = _lift_to_the_top(c, dtype, 0x7F)
    spec = _decode_spec(matrix, kv)
    dev = torch.device("cuda")
    args = [a.to(dev) for a in _module_operands(c, c.seq_lens)]
    args[1], args[2], args[4] = _flat_pages(kc), _flat_pages(vc), bt.to(dev)
    out = torch.full(c.q.shape, float("nan"), dtype=c.q.dtype, device=dev)
    cuda_kernels.run(spec, *args, out=[out, _poisoned_workspace(spec, c.q.shape[0])])
    ref = torch.empty_like(c.q)
    R.sparse_attn_decode(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.seq_lens, 1, c.scale, ref,
                         c.k_scale, c.v_scale)
    _assert_every_row_written_and_close(out.cpu(), ref, (matrix, kv))


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3fn"])
def test_the_insert_writes_past_2_31_bytes(cuda_kernels, kv):
    """The same truncation bug for the KV insert: slots in blocks past 2^31 bytes of the cache get exactly the
    reference's bytes (written into the small cache those blocks came from); nothing else changes."""
    from msa_iree.runtime import insert_kv

    dtype = DTYPES[kv]
    c = testing.decode_case([300, 2049, 5000, 77], seed=43, kv_dtype=dtype)
    kc, vc, bt, top = _lift_to_the_top(c, dtype, 0x7F)
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(44)
    n = 24
    slots = torch.randperm(int(c.block_table.max() + 1) * 128, generator=g)[:n].int()
    key, value = ((torch.randn(n, 1, 128, generator=g) * 2).bfloat16() for _ in range(2))
    big_slots = (top[(slots // 128).long()] * 128 + slots % 128).int()
    before = kc.view(torch.uint8).reshape(-1).clone()
    insert_kv(cuda_kernels, key.to(dev), value.to(dev), kc, vc, big_slots.to(dev),
              *(None if t is None else t.to(dev) for t in (c.k_scale, c.v_scale)))
    R.insert_kv(key, value, c.k_cache, c.v_cache, slots, c.k_scale, c.v_scale)
    nb = top.shape[0]
    rows = kc.view(torch.uint8).reshape(-1, c.k_cache.view(torch.uint8).numel() // nb)
    want = before.view(rows.shape)
    want[top.to(dev)] = c.k_cache.view(torch.uint8).reshape(nb, -1).to(dev)
    assert torch.equal(rows, want)


@pytest.mark.parametrize("matrix, seq", [("mma", 40000), ("mma", 150000), ("mfma", 40000), ("mfma", 150000)])
def test_page_ids_from_block_tables_either_side_of_the_lds_row(cuda_kernels, matrix, seq):
    """The matrix-core attends stage a request's whole block-table row in LDS when the table has at
    most spec.tuning.bt_preload columns (mma 1024, mfma 256) and read each top-k entry's column from global
    memory otherwise. Tables of 313 and 1172 columns (one on each side for mma, both past mfma's),
    with top-k entries in their far columns, match the reference."""
    spec = _decode_spec(matrix)
    c = testing.decode_case([seq, 129, 0, seq // 2 + 5], seed=seq % 97, keep_own_prob=1.0)
    cols = c.block_table.shape[1]
    assert spec.tuning.bt_preload and cols == -(-seq // 128)
    own = (seq - 1) // 128
    c.topk[0, 0, 1:4] = torch.tensor([own - 1, own - 2, cols // 2], dtype=torch.int32)  # the far columns
    dev = torch.device("cuda")
    out = torch.full(c.q.shape, float("nan"), dtype=c.q.dtype, device=dev)
    cuda_kernels.run(spec, *[a.to(dev) for a in _module_operands(c, c.seq_lens)], out=[out, _poisoned_workspace(spec, 4)])
    ref = torch.empty_like(c.q)
    R.sparse_attn_decode(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.seq_lens, 1, c.scale, ref)
    out = out.cpu()
    assert not out.isnan().any()
    err = (out.float() - ref.float()).abs()
    assert err.max() < tol.MAX_ABS[torch.bfloat16] and err.mean() < tol.MEAN_ABS[torch.bfloat16], (cols, float(err.max()), float(err.mean()))


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3fn"])
def test_mfma_writes_under_a_tenth_of_the_kv_between_its_dispatches(cuda_kernels, kv):
    """gfx942's target: the bytes @split leaves in the workspace for @merge stay under 10% of the
    K/V bytes a row reads (16 full blocks), at every split count. Measured, not computed: the
    workspace starts as all-ones bytes and every 16-bit unit the call changed counts as written
    (the emulated MFMA attend runs gfx942's text, partial layout and split rule included)."""
    spec = _decode_spec("mfma", kv)
    dev = torch.device("cuda")
    kv_bytes_per_row = 16 * 128 * 128 * 2 * DTYPES[kv].itemsize
    for batch in (3, 16, 17, 32, 33, 64, 65, 128):
        c = testing.decode_case([3000 + 7 * i for i in range(batch)], kv_dtype=DTYPES[kv], seed=batch, keep_own_prob=1.0)
        ws = torch.full((spec.workspace_floats(batch),), -1, dtype=torch.int32, device=dev)
        ws[:ARRIVAL_COUNTERS] = 0
        out = torch.full(c.q.shape, float("nan"), dtype=c.q.dtype, device=dev)
        cuda_kernels.run(spec, *[a.to(dev) for a in _module_operands(c, c.seq_lens)], out=[out, ws.view(torch.float32)])
        written = int((ws[ARRIVAL_COUNTERS:].view(torch.int16) != -1).sum()) * 2
        assert 0 < written < 0.10 * kv_bytes_per_row * batch, (batch, written / (kv_bytes_per_row * batch))
        ref = torch.empty_like(c.q)
        R.sparse_attn_decode(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.seq_lens, 1, c.scale, ref,
                             c.k_scale, c.v_scale)
        assert (out.cpu().float() - ref.float()).abs().max() < tol.MAX_ABS[torch.bfloat16], batch


@functools.cache
def _iree_call_library():
    """The same build called through IREE's synchronous invocation (no stream launch)."""
    from msa_iree.runtime import KernelLibrary

    return KernelLibrary("cuda", BUILD, compile_missing=False, stream_launch=False)


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3fn"])
@pytest.mark.parametrize("matrix", ["fma", "mma", "mfma"])
def test_stream_launch_writes_what_irees_call_writes(cuda_kernels, matrix, kv, prefill):
    """msa_iree.runtime.cuda_launch: the kernel launched on torch's stream from the build's launch plan gives
    the same bytes as IREE's own call of it (output and workspace), at 16, 4, 2 and 1 splits;
    decode at L=1 launched with its loads marked L2 evict-first (the PTX rewritten), prefill not."""
    decode_cls, prefill_cls = GPU_ATTEND[matrix, "cuda"]
    spec = (prefill_cls if prefill else decode_cls)(MsaConfig(kv_dtype=kv), 16)
    sk = cuda_kernels.stream_kernel(spec)
    assert sk is not None, "the build saved no launch plan for it"
    assert sk.l2_evict_first == (not prefill) and ("%msa_l2_evict_first" in sk.ptx) == (not prefill)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(11)
    for batch in (5, 40, 100, 300):
        seq = torch.randint(1, 3000, (batch,), generator=gen).tolist()
        c = testing.decode_case(seq, kv_dtype=DTYPES[kv], seed=batch)
        positions = (c.query_req_id, c.query_abs_pos) if prefill else (c.seq_lens,)
        args = [a.to(dev) for a in _module_operands(c, *positions)]
        got = []
        for lib in (cuda_kernels, _iree_call_library()):
            out = torch.full(c.q.shape, float("nan"), dtype=c.q.dtype, device=dev)
            ws = torch.zeros(spec.workspace_floats(batch), device=dev)
            lib.run(spec, *args, out=[out, ws])
            got.append((out.view(torch.int16).cpu(), ws.cpu()))
        assert torch.equal(got[0][0], got[1][0]), (batch, "output")
        assert torch.equal(got[0][1].view(torch.int32), got[1][1].view(torch.int32)), (batch, "workspace")


def test_stream_launch_is_ordered_with_torch_work(cuda_kernels):
    """No synchronisation around a stream launch: the query is produced by torch work queued just
    before (a long one, so that it is still running when the launch is queued) and the output is
    consumed by torch work queued just after; the result is still the reference's."""
    spec = GPU_ATTEND["mma", "cuda"][0](MsaConfig(), 16)
    assert cuda_kernels.stream_kernel(spec) is not None
    c = testing.decode_case([300, 2049, 5000, 77], seed=21)
    dev = torch.device("cuda")
    args = [a.to(dev) for a in _module_operands(c, c.seq_lens)]
    torch.cuda.synchronize()
    busy = torch.randn(4096, 4096, device=dev)
    q = torch.zeros_like(args[0])
    for _ in range(20):
        busy = busy @ busy * 1e-3  # keeps the stream busy for milliseconds
    q.copy_(args[0] + busy[0, 0] * 0)  # the query, written only after that work
    out = torch.full(c.q.shape, float("nan"), dtype=c.q.dtype, device=dev)
    cuda_kernels.run(spec, q, *args[1:], out=[out, _poisoned_workspace(spec, 4)])
    seen = out.float() * 1.0  # consumed right away, on the same stream
    ref = torch.empty_like(c.q)
    R.sparse_attn_decode(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.seq_lens, 1, c.scale, ref)
    assert (seen.cpu() - ref.float()).abs().max() < tol.MAX_ABS[torch.bfloat16]


@pytest.mark.parametrize("matrix", ["fma", "mma"])
def test_a_scale_changed_in_place_is_seen(cuda_kernels, matrix):
    """Per-tensor fp8 scales over 2 KV heads reach the kernel as a contiguous [2, 1] copy (a stream
    launch reads memory, not strides): a scale the caller changes in place between steps must be
    what the next step uses (the serving simulation checks every step against the reference)."""
    from serving import Server

    s = Server(cuda_kernels, DTYPES["fp8_e4m3fn"], torch.bfloat16, "interleaved", 2, "tensor", seed=5, device="cuda",
               gpu_matrix=matrix)
    s.step([], [("a", 300), ("b", 140)], 1)
    s.k_scale.mul_(1.5)
    s.v_scale.mul_(0.5)
    s.step(["a", "b"], [], 1)
    s.step(["a", "b"], [], 1)


def test_a_later_call_of_a_step_sees_a_scale_changed_in_place(cuda_kernels):
    """The bound path (a later call of the same step) refreshes the contiguous [2, 1] copy of a
    per-tensor fp8 scale over 2 KV heads on every call, as the checked path does: a scale changed
    in place between two calls of one step is what the second call uses."""
    from serving import Server

    s = Server(cuda_kernels, DTYPES["fp8_e4m3fn"], torch.bfloat16, "interleaved", 2, "tensor", seed=8, device="cuda",
               gpu_matrix="mma")
    s.step([], [("a", 300), ("b", 140)], 1)
    md = s.step(["a", "b"], [], 1)  # checks every argument and binds the step's launch
    bound = s.attn._decode_launch
    assert bound is not None
    g = torch.Generator().manual_seed(3)
    pos = [s.lens["a"] - 1, s.lens["b"] - 1]
    topk = torch.tensor([[testing.random_topk_row(g, p, 16) for p in pos] for _ in range(2)], dtype=torch.int32)
    for factor in (1.0, 1.5):
        s.k_scale.mul_(factor)
        s.v_scale.mul_(1 / factor)
        q = torch.randn(2, 16, 128, generator=g).bfloat16()
        out = torch.full((2, 16, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        s.attn.forward(q.cuda(), s.k_cache, s.v_cache, out, topk.cuda(), md, s.k_scale, s.v_scale)
        assert s.attn._decode_launch is bound  # served by the binding, not bound anew
        ref = torch.empty_like(q)
        R.sparse_attn_decode(q, s.k_cache.cpu(), s.v_cache.cpu(), topk, md.decode.block_table.cpu(),
                             md.decode.seq_lens.cpu(), 2, 128 ** -0.5, ref, s.k_scale.cpu(), s.v_scale.cpu())
        assert (out.cpu().float() - ref.float()).abs().max() < tol.MAX_ABS[torch.bfloat16], factor


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3fn"])
def test_forward_is_captured_by_a_cuda_graph(cuda_kernels, kv):
    """vLLM replays decode steps from CUDA graphs. A forward launched on torch's stream is captured
    like a torch op: replays with new query values in the same buffer match the reference."""
    from benchmarks.bench import _decode_setup

    dev = torch.device("cuda")
    c, attn, out, fwd = _decode_setup(cuda_kernels, dev, 8, 4096, 1, 16, kv, rotations=1)
    fwd()  # warm-up outside the capture: launch plans, workspace, the step's tensors
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fwd()
    # eagerly the one-dispatch attend, in the graph its two-dispatch variant (GpuAttendSpec.for_graph)
    # (SparseAttention._spec's keys: (class, stride, L, read_once, graph, insert))
    launched = {key[4]: spec for key, spec in attn._specs.items() if key[0] is attn.decode_spec and not key[5]}
    assert launched[False].tuning.fused_merge and launched[True] == launched[False].for_graph() != launched[False]
    gen = torch.Generator(device=dev).manual_seed(3)
    for _ in range(2):
        c.q.copy_(torch.randn(c.q.shape, generator=gen, device=dev).to(c.q.dtype))
        out.fill_(float("nan"))
        graph.replay()
        ref = torch.empty(c.q.shape, dtype=c.q.dtype)
        R.sparse_attn_decode(c.q.cpu(), c.k_cache.cpu(), c.v_cache.cpu(), c.topk.cpu(), c.block_table.cpu(),
                             c.seq_lens.cpu(), 1, 128 ** -0.5, ref, _cpu(c.k_scale), _cpu(c.v_scale))
        _assert_every_row_written_and_close(out.cpu(), ref)


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3fn"])
def test_later_calls_of_a_step_are_checked_and_attend(cuda_kernels, kv):
    """The first forward of a decode step binds its launch; later calls with the same metadata and
    caches go through the binding (only the query, output and top-k are checked per call, then
    launched): each result is the reference's, another layer's caches rebind, and a query, output
    or top-k the binding was not made for takes the checked path and is refused by name."""
    from benchmarks.bench import _decode_metadata, _decode_setup
    from msa_iree.layout import allocate_kv_cache

    dev = torch.device("cuda")
    c, attn, _, _ = _decode_setup(cuda_kernels, dev, 8, 4096, 1, 16, kv, rotations=1)
    (md,) = _decode_metadata(cuda_kernels, dev, c, [c.block_table])
    other = allocate_kv_cache(c.k_cache.shape[0] // 16, 1, c.k_cache.dtype, device=dev)  # another layer's
    raw = lambda k: k.view(-1).view(torch.uint8)  # the whole interleaved buffer, as bytes
    raw(other[0]).copy_(raw(c.k_cache).roll(2048))
    fewer = c.topk.clone()
    fewer[..., 8:] = -1  # the own block and 7 older ones
    gen = torch.Generator(device=dev).manual_seed(4)
    bindings = []
    for caches, topk in ((c.k_cache, c.v_cache), c.topk), ((c.k_cache, c.v_cache), fewer), (other, c.topk), \
                        ((c.k_cache, c.v_cache), fewer):
        q = torch.randn(c.q.shape, generator=gen, device=dev).to(c.q.dtype)
        out = torch.full_like(q, float("nan"))
        attn.forward(q, *caches, out, topk, md, c.k_scale, c.v_scale)
        bindings.append(attn._decode_launch)
        ref = torch.empty(q.shape, dtype=q.dtype)
        R.sparse_attn_decode(q.cpu(), caches[0].cpu(), caches[1].cpu(), topk.cpu(), c.block_table.cpu(),
                             c.seq_lens.cpu(), 1, attn.scale, ref, _cpu(c.k_scale), _cpu(c.v_scale))
        _assert_every_row_written_and_close(out.cpu(), ref)
    assert bindings[0] is not None and bindings[1] is bindings[0]  # served by the binding
    assert bindings[2] is not bindings[1] and bindings[3] is not bindings[2]  # other caches: bound anew
    q, out = c.q.clone(), torch.empty_like(c.q)
    with pytest.raises(ValueError, match="query: expected torch.bfloat16"):
        attn.forward(q.half(), c.k_cache, c.v_cache, out, fewer, md, c.k_scale, c.v_scale)
    with pytest.raises(ValueError, match="out: expected shape"):
        attn.forward(q, c.k_cache, c.v_cache, out[:, :8], fewer, md, c.k_scale, c.v_scale)
    with pytest.raises(ValueError, match="topk: expected torch.int32"):
        attn.forward(q, c.k_cache, c.v_cache, out, fewer.long(), md, c.k_scale, c.v_scale)
    with pytest.raises(ValueError, match="topk: expected at least num_actual_tokens=8 rows"):
        attn.forward(q, c.k_cache, c.v_cache, out, fewer[:, :4], md, c.k_scale, c.v_scale)


def test_dependent_launches_read_what_the_kernel_before_wrote(cuda_kernels):
    """Programmatic dependent launches (sm_90+) start a kernel before the one ahead of it has
    finished: each must wait for it before reading. Six layers chained with nothing between them,
    each layer's query the previous layer's output buffer (NaN until that layer's @merge writes
    it), and all sharing one workspace: every layer's output is the reference's for its query."""
    from benchmarks.bench import _decode_metadata, _decode_setup

    if not cuda_kernels.dependent_launch:
        pytest.skip("this GPU has no programmatic dependent launch (sm_90+): stream order alone applies")
    dev = torch.device("cuda")
    c, attn, _, _ = _decode_setup(cuda_kernels, dev, 8, 4096, 1, 16, "bf16", rotations=1)
    (md,) = _decode_metadata(cuda_kernels, dev, c, [c.block_table])
    buffers = [c.q] + [torch.full_like(c.q, float("nan")) for _ in range(6)]
    torch.cuda.synchronize()
    for q, out in zip(buffers, buffers[1:]):
        attn.forward(q, c.k_cache, c.v_cache, out, c.topk, md)
    got = [b.cpu() for b in buffers]
    for i in range(6):
        ref = torch.empty(c.q.shape, dtype=c.q.dtype)
        R.sparse_attn_decode(got[i], c.k_cache.cpu(), c.v_cache.cpu(), c.topk.cpu(), c.block_table.cpu(),
                             c.seq_lens.cpu(), 1, attn.scale, ref)
        _assert_every_row_written_and_close(got[i + 1], ref, i)


@pytest.mark.parametrize("layout", ["interleaved", "planes"])
def test_the_gpu_insert_skips_padding_and_slots_past_the_cache(cuda_kernels, layout):
    """The GPU writer itself skips a token whose slot is -1 (padding) or past the cache's last
    block (which the builder refuses before; the writer must not clamp it onto the last page):
    every other byte of the cache stays as it was."""
    from msa_iree.ops import InsertKvGpuSpec
    from msa_iree.layout import allocate_kv_cache

    g = torch.Generator().manual_seed(9)
    dev = torch.device("cuda")
    blocks, n = 3, 6
    kc, vc = allocate_kv_cache(blocks, 1, torch.bfloat16, layout, fill=0)
    base = torch.randint(0, 256, (blocks * 16 * 2048 * 2,), generator=g, dtype=torch.uint8)
    torch.as_strided(kc.view(torch.uint8), (base.numel(),), (1,)).copy_(base)
    key = torch.randn(n, 1, 128, generator=g).bfloat16()
    value = torch.randn(n, 1, 128, generator=g).bfloat16()
    slots = torch.tensor([5, -1, blocks * 128, 200, blocks * 128 + 300, 383], dtype=torch.int32)
    valid = slots.clone()
    valid[(slots < 0) | (slots >= blocks * 128)] = -1
    R.insert_kv(key, value, kc, vc, valid)  # the reference skips -1
    want = torch.as_strided(kc.view(torch.uint8), (base.numel(),), (1,)).clone()

    gk, gv = allocate_kv_cache(blocks, 1, torch.bfloat16, layout, device=dev, fill=0)
    raw = torch.as_strided(gk.view(torch.uint8), (base.numel(),), (1,))
    raw.copy_(base.to(dev))
    spec = InsertKvGpuSpec(MsaConfig(num_kv_heads=1), 16 if layout == "interleaved" else 8)
    ones = torch.ones(1, 1, device=dev)
    whole = raw.view(torch.bfloat16).view(-1, 2048)
    cuda_kernels.run(spec, whole, key.to(dev), value.to(dev), torch.arange(n, dtype=torch.int32, device=dev),
                     slots.to(dev), ones, ones, out_dtypes=())
    got = raw.cpu()
    bad = (got != want).nonzero().reshape(-1)
    assert bad.numel() == 0, f"{bad.numel()} bytes differ, first at {bad[:5].tolist()}"


@pytest.mark.parametrize("kv, h", [("bf16", 1), ("fp8_e4m3fn", 2)])
def test_later_inserts_of_a_layer_go_through_its_binding(cuda_kernels, kv, h):
    """SparseAttention.insert_kv: a layer's first call runs every check and binds the launch; its
    later steps over the builder's stable slot buffers (new slots, keys and values each step, one
    token padding in the last, a scalar fp8 scale over 2 KV heads changed in place) are served by
    that binding and write exactly the reference's bytes; other caches rebind; a wrong key dtype
    or too few key rows are refused by name with a binding in place."""
    from msa_iree.layout import allocate_kv_cache
    from msa_iree.runtime import MetadataBuilder, SparseAttention

    dev, dtype = torch.device("cuda"), DTYPES[kv]
    g = torch.Generator().manual_seed(12 + h)
    layers = [SparseAttention(8 * h, h, 128, 128 ** -0.5, dtype, kernels=cuda_kernels) for _ in range(2)]
    blocks, n = 6, 9
    caches = [allocate_kv_cache(blocks, h, dtype, "interleaved", device=dev, fill=0) for _ in layers]
    refs = [allocate_kv_cache(blocks, h, dtype, "interleaved", fill=0) for _ in layers]
    fp8 = dtype != torch.bfloat16
    scale = (torch.tensor([0.07], device=dev), torch.tensor([0.09], device=dev)) if fp8 else (None, None)
    builder = MetadataBuilder(n, 1024, num_cache_blocks=blocks, kernels=cuda_kernels, device=dev)
    bt = torch.zeros(n, 1, dtype=torch.int32, device=dev)
    seq = torch.full((n,), 100, dtype=torch.int32, device=dev)
    qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
    raw = lambda k: k.reshape(-1).view(torch.uint8)
    cpu_scale = lambda: tuple(None if t is None else t.cpu() for t in scale)
    bindings = [[] for _ in layers]
    for step in range(3):
        slots = torch.randperm(blocks * 128, generator=g)[:n].int()
        if step == 2:
            slots[4] = -1
        if fp8:
            scale[0].fill_(0.07 + 0.01 * step)
        md = builder.build(bt, seq, qsl, seq - 1, 1, n, slot_mapping=slots.to(dev))
        for i, attn in enumerate(layers):
            key, value = (torch.randn(n, h, 128, generator=g).bfloat16() for _ in range(2))
            attn.insert_kv(key.to(dev), value.to(dev), *caches[i], md, *scale)
            bindings[i].append(attn._insert_launch)
            R.insert_kv(key, value, *refs[i], slots, *cpu_scale())
            torch.cuda.synchronize()
            assert torch.equal(raw(caches[i][0]).cpu(), raw(refs[i][0])), (step, i)
    for b in bindings:  # bound by the first step, the same binding served the next two
        assert b[0] is not None and b[1] is b[0] and b[2] is b[0]
    key, value = (torch.randn(n, h, 128, generator=g).bfloat16() for _ in range(2))
    layers[0].insert_kv(key.to(dev), value.to(dev), *caches[1], md, *scale)  # layer 1's caches: rebinds
    R.insert_kv(key, value, *refs[1], slots, *cpu_scale())
    assert layers[0]._insert_launch is not bindings[0][0]
    assert torch.equal(raw(caches[1][0]).cpu(), raw(refs[1][0]))
    with pytest.raises(ValueError, match="key"):
        layers[1].insert_kv(key.float().to(dev), value.float().to(dev), *caches[1], md, *scale)
    with pytest.raises(ValueError, match="key: expected at least num_actual_tokens=9 rows"):
        layers[1].insert_kv(key[:3].to(dev), value[:3].to(dev), *caches[1], md, *scale)


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3fn"])
def test_a_decode_step_with_its_inserts_is_captured(cuda_kernels, kv):
    """A decode step as vLLM replays it: the new tokens' K/V inserted, then the attend, captured
    once in a CUDA graph. The builder (knowing the cache's size) checked the slots and keeps them
    at one address, so insert_kv does not sync; a later step's new slots (one token now padding),
    keys, values and queries, written into the same buffers, are what the replay uses."""
    from benchmarks.bench import _decode_setup
    from msa_iree.layout import allocate_kv_cache
    from msa_iree.runtime import MetadataBuilder, insert_kv

    dev = torch.device("cuda")
    c, attn, _, _ = _decode_setup(cuda_kernels, dev, 8, 4096, 1, 16, kv, rotations=1)
    builder = MetadataBuilder(8, 4096, num_cache_blocks=c.k_cache.shape[0] // 16, kernels=cuda_kernels, device=dev)
    slots = c.last_token_slots  # each request's new token
    qsl = torch.arange(9, dtype=torch.int32, device=dev)
    build = lambda sm: builder.build(c.block_table, c.seq_lens, qsl, c.seq_lens - 1, 1, 8, slot_mapping=sm)
    md = build(slots)
    assert md.max_slot >= 0 and md.insert_slots.shape[0] == 8  # whole, not compacted
    gen = torch.Generator(device=dev).manual_seed(6)
    key, value = (torch.randn(8, 1, 128, generator=gen, device=dev).bfloat16() for _ in range(2))
    q, out = c.q.clone(), torch.empty_like(c.q)

    def step():
        insert_kv(cuda_kernels, key, value, c.k_cache, c.v_cache, md, c.k_scale, c.v_scale)
        attn.forward(q, c.k_cache, c.v_cache, out, c.topk, md, c.k_scale, c.v_scale)

    step()  # outside the capture: launch plans, the bound attend, the workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    raw = lambda k: k.reshape(-1).view(torch.uint8)  # the interleaved K view spans the whole buffer
    for later in range(2):
        for t in (key, value, q):
            t.copy_(torch.randn(t.shape, generator=gen, device=dev).to(t.dtype))
        step_slots = slots.clone()
        if later:
            step_slots[3] = -1  # padding this step: its cache slot keeps what the first replay wrote
            build(step_slots)  # into the builder's buffers, at the captured addresses
        # the reference: the same step on a CPU copy of the cache (views of one buffer, as on the GPU)
        kc, vc = allocate_kv_cache(c.k_cache.shape[0] // 16, 1, c.k_cache.dtype)
        raw(kc).copy_(raw(c.k_cache).cpu())
        R.insert_kv(key.cpu(), value.cpu(), kc, vc, step_slots.cpu(), _cpu(c.k_scale), _cpu(c.v_scale))
        ref = torch.empty(q.shape, dtype=q.dtype)
        R.sparse_attn_decode(q.cpu(), kc, vc, c.topk.cpu(), c.block_table.cpu(), c.seq_lens.cpu(), 1, attn.scale,
                             ref, _cpu(c.k_scale), _cpu(c.v_scale))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(raw(c.k_cache).cpu(), raw(kc)), later  # the whole cache buffer, byte for byte
        _assert_every_row_written_and_close(out.cpu(), ref, later)


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3fn"])
@pytest.mark.parametrize("in_forward", [False, True], ids=["insert_kv", "forward-inserts"])
def test_a_captured_decode_step_replays_the_next_steps_fresh_metadata(cuda_kernels, kv, in_forward):
    """Serving as vLLM runs it: every step builds new metadata; the builder writes it into its
    buffers at stable addresses, so a decode step captured once (insert + attend, or the attend
    inserting itself: forward(key=, value=), its graph variant) and replayed after the next
    step's build attends with that step's sequence lengths, slots and block table. Also eagerly:
    the layer's bound launch serves the new metadata object (no rebinding)."""
    from benchmarks.bench import _decode_setup
    from msa_iree.layout import allocate_kv_cache
    from msa_iree.runtime import MetadataBuilder

    dev = torch.device("cuda")
    c, attn, _, _ = _decode_setup(cuda_kernels, dev, 8, 4000, 1, 16, kv, rotations=1)  # the own block has room
    blocks = c.k_cache.shape[0] // 16
    builder = MetadataBuilder(8, 8192, num_cache_blocks=blocks, kernels=cuda_kernels, device=dev)
    qsl = torch.arange(9, dtype=torch.int32, device=dev)
    seq = c.seq_lens.clone()
    gen = torch.Generator(device=dev).manual_seed(7)
    key, value = (torch.randn(8, 1, 128, generator=gen, device=dev).bfloat16() for _ in range(2))
    q, out = c.q.clone(), torch.empty_like(c.q)
    holder = {}

    def build(seq_lens):
        pos = seq_lens.long() - 1
        slots = (c.block_table.long().gather(1, (pos // 128)[:, None])[:, 0] * 128 + pos % 128).int()
        holder["slots"] = slots
        return builder.build(c.block_table, seq_lens, qsl, seq_lens - 1, 1, 8, slot_mapping=slots)

    md = build(seq)

    def step(md):
        if in_forward:
            attn.forward(q, c.k_cache, c.v_cache, out, c.topk, md, c.k_scale, c.v_scale, key=key, value=value)
            return
        attn.insert_kv(key, value, c.k_cache, c.v_cache, md, c.k_scale, c.v_scale)
        attn.forward(q, c.k_cache, c.v_cache, out, c.topk, md, c.k_scale, c.v_scale)

    step(md)
    bound = attn._decode_launch
    assert bound is not None and bound.insert == in_forward
    md2 = build(seq)  # a new object over the same buffers: the bound launch serves it
    step(md2)
    assert attn._decode_launch is bound
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(md2)
    captured = attn._decode_launch  # bound by the capture: the graph variant (two dispatches), inserting or not
    assert captured.graph and captured.insert == in_forward
    spec = attn._specs[attn.decode_spec, 16, 1, False, True, in_forward]
    assert not spec.tuning.fused_merge and spec.insert_kv == in_forward
    raw = lambda k: k.reshape(-1).view(torch.uint8)
    for later in range(2):
        seq = seq + 1  # one more token each (the own block's tail moves; the top-k stays valid)
        build(seq)     # the next step's metadata, into the captured addresses
        for t in (key, value, q):
            t.copy_(torch.randn(t.shape, generator=gen, device=dev).to(t.dtype))
        kc, vc = allocate_kv_cache(blocks, 1, c.k_cache.dtype)
        raw(kc).copy_(raw(c.k_cache).cpu())
        R.insert_kv(key.cpu(), value.cpu(), kc, vc, holder["slots"].cpu(), _cpu(c.k_scale), _cpu(c.v_scale))
        ref = torch.empty(q.shape, dtype=q.dtype)
        R.sparse_attn_decode(q.cpu(), kc, vc, c.topk.cpu(), c.block_table.cpu(), seq.cpu(), 1, attn.scale, ref,
                             _cpu(c.k_scale), _cpu(c.v_scale))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(raw(c.k_cache).cpu(), raw(kc)), later
        _assert_every_row_written_and_close(out.cpu(), ref, later)


@pytest.mark.parametrize("matrix, kv", [("fma", "bf16"), ("mma", "bf16"), ("mma", "fp8_e4m3fn"), ("mfma", "bf16"),
                                        ("mfma", "fp8_e4m3fnuz"), ("fma", "fp8_e4m3fn")])
def test_sixteen_blocks_with_a_context_ending_late_in_the_last_partition(cuda_kernels, matrix, kv):
    """16 heads per KV head, all 16 blocks selected, the row's length 1920 + t for t in 113..127
    (241..255 tokens into the last 256-token partition, where AITER's maskless fp8 kernel returned
    NaN), through each GPU family on CUDA (mfma: gfx942's kernel with its MFMAs emulated)."""
    dev = torch.device("cuda")
    spec = _decode_spec(matrix, kv)
    seq = [15 * 128 + t for t in range(113, 128)]
    c = testing.decode_case(seq, kv_dtype=DTYPES[kv], seed=2211, spare_blocks=4)
    for r in range(len(seq)):  # every block of the request, own block first
        c.topk[0, r] = torch.tensor(list(range(15, -1, -1)), dtype=torch.int32)
    ref = torch.empty_like(c.q)
    R.sparse_attn_decode(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.seq_lens, 1, c.scale, ref,
                         c.k_scale, c.v_scale)
    out = torch.full(c.q.shape, float("nan"), dtype=c.q.dtype, device=dev)
    ws = _poisoned_workspace(spec, c.q.shape[0])
    cuda_kernels.run(spec, *[a.to(dev) for a in _module_operands(c, c.seq_lens)], out=[out, ws])
    _assert_every_row_written_and_close(out.cpu(), ref, f"{matrix} {kv}")


# ---- the attend over a given page table (the indexer's emitted table) ---------------------------

PAGED_VARIANTS = [("fma", "bf16", "tensor"), ("mma", "bf16", "tensor"), ("mma", "fp8_e4m3fn", "token"),
                  ("mfma", "bf16", "tensor"), ("mfma", "fp8_e4m3fnuz", "token"), ("fma", "fp8_e4m3fn", "tensor")]


def _paged_cases(kv, smode, seed):
    """(case, sparse_bt, sparse_ctx): chunked-prefill rows (block edges, one token, a long prompt)
    and decode rows, their tables built by the reference; one row of each case emptied (all top-k
    -1: length 0, must come out zero)."""
    pre = testing.prefill_case([130, 1, 127, 300, 64], [0, 128, 1, 2000, 4000], kv_dtype=DTYPES[kv], seed=seed,
                               scale_mode=smode)
    dec = testing.decode_case([1, 127, 128, 129, 2048, 2049, 4000], kv_dtype=DTYPES[kv], seed=seed + 1,
                              scale_mode=smode)
    out = []
    for c in (pre, dec):
        c.topk[:, 3] = -1
        sbt, sctx = R.build_sparse_block_table_prefill(c.topk, c.block_table, c.query_req_id, c.query_abs_pos, 16)
        out.append((c, sbt, sctx))
    return out


@pytest.mark.parametrize("matrix, kv, smode", PAGED_VARIANTS)
def test_the_paged_attend_reads_an_emitted_table_as_the_reference(cuda_kernels, matrix, kv, smode):
    """The GPU attend over a given page table (each 8-page group one block's pages, as the
    emitters make it) against reference.sparse_paged_attend, for chunked-prefill and decode rows,
    through each family (mfma: gfx942's, emulated); a row of length 0 comes out zero."""
    dev = torch.device("cuda")
    spec = GPU_PAGED_ATTEND[matrix, "cuda"](MsaConfig(kv_dtype=kv), 16)
    for c, sbt, sctx in _paged_cases(kv, smode, seed=41):
        t = c.q.shape[0]
        ks, vs = (module_scale(x, 1).contiguous() for x in (c.k_scale, c.v_scale))
        args = [c.q, _flat_pages(c.k_cache), _flat_pages(c.v_cache), sbt.view(t, 1, -1), sctx.view(t, 1),
                torch.tensor([c.scale]), ks, vs]
        out = torch.full(c.q.shape, float("nan"), dtype=c.q.dtype, device=dev)
        cuda_kernels.run(spec, *[a.to(dev) for a in args], out=[out, _poisoned_workspace(spec, t)])
        ref = torch.empty_like(c.q)
        R.sparse_paged_attend(c.q, c.k_cache, c.v_cache, sbt, sctx, 1, c.scale, ref, c.k_scale, c.v_scale)
        out = out.cpu()
        _assert_every_row_written_and_close(out, ref, f"{matrix} {kv} rows {t}")
        assert int(sctx[3]) == 0 and out[3].eq(0).all()


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3fn"])
def test_a_layer_attends_an_emitted_table_like_its_top_k_in_one_launch(cuda_kernels, kv):
    """SparseAttention.forward with the indexer's table on CUDA: the same output as its own top-k
    path for a mixed step (decodes, then a chunked prefill: one launch over every row), and a table
    whose 8-page group is not one block's pages in order is refused by name (validation on)."""
    from msa_iree.runtime import MetadataBuilder, SparseAttention

    dev = torch.device("cuda")
    c = testing.prefill_case([1, 1, 200], [300, 2048, 129], kv_dtype=DTYPES[kv], seed=43)
    kc, vc = c.k_cache.to(dev), c.v_cache.to(dev)
    ks, vs = (None if x is None else x.to(dev) for x in (c.k_scale, c.v_scale))
    q, topk = c.q.to(dev), c.topk.to(dev)
    builder = MetadataBuilder(4, 4096, kernels=cuda_kernels, device=dev)
    qsl = c.cu_seqlens_q.to(dev)
    md = builder.build(c.block_table.to(dev), c.seq_lens.to(dev), qsl, c.prefix_lens.to(dev), 1, 2)
    attn = SparseAttention(16, 1, 128, c.scale, DTYPES[kv], kernels=cuda_kernels)
    by_topk = attn.forward(q, kc, vc, torch.empty_like(q), topk, md, ks, vs)
    sbt, sctx = R.build_sparse_block_table_prefill(c.topk, c.block_table, c.query_req_id, c.query_abs_pos, 16)
    by_table = attn.forward(q, kc, vc, torch.full_like(q, float("nan")), topk, md, ks, vs,
                            sparse_block_table=sbt.to(dev), sparse_context_lens=sctx.to(dev))
    ref = torch.empty_like(c.q)
    R.sparse_paged_attend(c.q, c.k_cache, c.v_cache, sbt, sctx, 1, c.scale, ref, c.k_scale, c.v_scale)
    _assert_every_row_written_and_close(by_table.cpu(), ref, "table")
    _assert_every_row_written_and_close(by_topk.cpu(), ref, "top-k")
    swapped = sbt.clone()
    swapped[2, [0, 1]] = swapped[2, [1, 0]]  # the last row's first group out of order
    with pytest.raises(ValueError, match=r"sparse_block_table: expected each 8-page group one block's pages in "
                                         r"order.*at row 2, group 0"):
        attn.forward(q, kc, vc, torch.empty_like(q), topk, md, ks, vs, sparse_block_table=swapped.to(dev),
                     sparse_context_lens=sctx.to(dev))


def _random_one_head_caches(gen):
    """(k_cache, v_cache, index_cache) on the host, bf16: 8 blocks of one KV head, every slot's
    key and value random; 8 random index-cache blocks."""
    from msa_iree.layout import allocate_kv_cache

    kc, vc = allocate_kv_cache(8, 1, torch.bfloat16, fill=0)
    R.insert_kv(*(torch.randn(8 * 128, 1, 128, generator=gen).to(torch.bfloat16) for _ in range(2)), kc, vc,
                torch.arange(8 * 128))
    return kc, vc, torch.randn(8, 128, 128, generator=gen).to(torch.bfloat16)


def test_a_layer_takes_the_table_its_indexer_emitted_for_the_step_without_a_check(cuda_kernels, page_table_checks):
    """On CUDA, the table the GPU indexer wrote in its own launch (topk_with_table) goes to the
    attend unchecked (no host sync) and attends as the reference does; written to since, it is
    checked, and a page past the cache refused."""
    from msa_iree.layout import allocate_kv_cache
    from msa_iree.runtime import Indexer, MetadataBuilder, SparseAttention

    checked = page_table_checks
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(34)
    kc, vc, index_cache = _random_one_head_caches(gen)
    # a decode at position 299 (blocks 5, 2, 7), then a 3-token prefill at positions 127..129 (blocks 1, 4)
    table = torch.tensor([[5, 2, 7], [1, 4, -1]], dtype=torch.int32)
    seq, qsl = torch.tensor([300, 130], dtype=torch.int32), torch.tensor([0, 1, 4], dtype=torch.int32)
    req, pos = torch.tensor([0, 1, 1, 1], dtype=torch.int32), torch.tensor([299, 127, 128, 129], dtype=torch.int32)
    md = MetadataBuilder(2, 384, num_cache_blocks=8, kernels=cuda_kernels, device=dev).build(
        table.to(dev), seq.to(dev), qsl.to(dev), (seq - torch.tensor([1, 3], dtype=torch.int32)).to(dev), 1, 1)
    q = torch.randn(4, 16, 128, generator=gen).to(bf16)
    index_q = torch.randn(4, 1, 128, generator=gen).to(bf16)
    topk, sbt, sctx = Indexer(1, bf16, kernels=cuda_kernels).topk_with_table(index_q.to(dev), index_cache.to(dev),
                                                                              md, md)
    attn = SparseAttention(16, 1, 128, 128 ** -0.5, bf16, kernels=cuda_kernels)
    gk, gv = allocate_kv_cache(8, 1, bf16, device=dev)
    gk.copy_(kc)
    gv.copy_(vc)
    attend = lambda: attn.forward(q.to(dev), gk, gv, torch.full((4, 16, 128), float("nan"), dtype=bf16, device=dev),
                                  topk, md, sparse_block_table=sbt, sparse_context_lens=sctx)
    want = R.index_topk(index_q, index_cache, table, req, pos)
    ref = torch.empty_like(q)
    R.sparse_attn_prefill(q, kc, vc, want, table, req, pos, 1, 128 ** -0.5, ref)
    assert torch.equal(topk.cpu(), want)
    _assert_every_row_written_and_close(attend().cpu(), ref, "the indexer's table")
    assert checked == []
    sbt[0, 0] = 8 * 16  # the first page past the cache (8 blocks of 16 pages, one KV head)
    with pytest.raises(IndexError, match="out of range"):
        attend()
    assert checked == [1]


def test_a_decode_step_of_indexer_and_attend_over_its_table_replays_from_a_cuda_graph(cuda_kernels, page_table_checks):
    """vLLM's decode graphs with msa-iree's indexer: the indexer's top-k and table (into the
    caller's buffers) and the attend over that table, captured once (no check of the table, so no
    host sync inside the capture), then replayed after the next step's metadata was built into the
    same buffers, with new queries and a block moved: every row is the next step's reference."""
    from msa_iree.layout import allocate_kv_cache
    from msa_iree.runtime import Indexer, MetadataBuilder, SparseAttention

    checked = page_table_checks
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(36)
    kc, vc, index_cache = _random_one_head_caches(gen)
    gk, gv = allocate_kv_cache(8, 1, bf16, device=dev)
    gk.copy_(kc)
    gv.copy_(vc)
    builder = MetadataBuilder(2, 640, num_cache_blocks=8, kernels=cuda_kernels, device=dev)
    # two decodes, at positions 299 / 511 then 300 / 512 (the second request's fifth block); the
    # second step moves the first request's first block from 5 to 6
    tables = [torch.tensor([[5, 2, 7, -1, -1], [1, 4, 0, 3, -1]], dtype=torch.int32),
              torch.tensor([[6, 2, 7, -1, -1], [1, 4, 0, 3, 5]], dtype=torch.int32)]
    seqs = [torch.tensor([300, 512], dtype=torch.int32), torch.tensor([301, 513], dtype=torch.int32)]
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32).to(dev)
    build = lambda i: builder.build(tables[i].to(dev), seqs[i].to(dev), qsl, (seqs[i] - 1).to(dev), 1, 2)
    indexer = Indexer(1, bf16, kernels=cuda_kernels)
    attn = SparseAttention(16, 1, 128, 128 ** -0.5, bf16, kernels=cuda_kernels)
    q, index_q = torch.empty(2, 16, 128, dtype=bf16, device=dev), torch.empty(2, 1, 128, dtype=bf16, device=dev)
    out, topk = torch.empty_like(q), torch.empty(1, 2, 16, dtype=torch.int32, device=dev)
    table_out = torch.empty(2, 1, 128, dtype=torch.int32, device=dev), torch.empty(2, 1, dtype=torch.int32, device=dev)
    index_cache_dev = index_cache.to(dev)

    def step(md):
        _, sbt, sctx = indexer.topk_with_table(index_q, index_cache_dev, md, md, out=topk, table_out=table_out)
        attn.forward(q, gk, gv, out, topk, md, sparse_block_table=sbt, sparse_context_lens=sctx)

    md = build(0)
    q.normal_()
    index_q.normal_()
    step(md)  # outside the capture first: launch plans, workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(md)
    assert checked == []
    build(1)  # the next step's metadata, into the buffers the graph reads
    q.copy_(torch.randn(2, 16, 128, generator=gen).to(bf16))
    index_q.copy_(torch.randn(2, 1, 128, generator=gen).to(bf16))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    req, pos = torch.tensor([0, 1], dtype=torch.int32), seqs[1] - 1
    want = R.index_topk(index_q.cpu(), index_cache, tables[1], req, pos)
    assert torch.equal(topk.cpu(), want)
    ref = torch.empty(2, 16, 128, dtype=bf16)
    R.sparse_attn_prefill(q.cpu(), kc, vc, want, tables[1], req, pos, 1, 128 ** -0.5, ref)
    _assert_every_row_written_and_close(out.cpu(), ref, "the replayed step")


def test_a_callers_workspace_serves_once_the_layer_zeroed_its_counters(cuda_kernels):
    """SparseAttention(workspace=...): the caller's tensor, NaN everywhere (its arrival counters
    too), shared by two layers, serves a decode step of 8 rows at 16 splits a row (each row
    merged by its last split to finish): each layer zeroed the counters when given the tensor,
    and each call leaves them zero."""
    from msa_iree.runtime import MetadataBuilder, SparseAttention

    dev = torch.device("cuda")
    c = testing.prefill_case([1] * 8, [299, 2048, 4999, 76, 128, 3999, 0, 999], seed=47)
    kc, vc, q, topk = (x.to(dev) for x in (c.k_cache, c.v_cache, c.q, c.topk))
    builder = MetadataBuilder(8, 8192, kernels=cuda_kernels, device=dev)
    md = builder.build(c.block_table.to(dev), c.seq_lens.to(dev), c.cu_seqlens_q.to(dev), c.prefix_lens.to(dev), 1, 8)
    size = SparseAttention(16, 1, 128, c.scale, torch.bfloat16, kernels=cuda_kernels).workspace_size(8)
    ws = torch.full((size // 4,), float("nan"), device=dev)
    layers = [SparseAttention(16, 1, 128, c.scale, torch.bfloat16, kernels=cuda_kernels, workspace=ws) for _ in range(2)]
    assert layers[0].decode_spec(layers[0].cfg, 16).splits(8) == 16
    sbt, sctx = R.build_sparse_block_table_prefill(c.topk, c.block_table, c.query_req_id, c.query_abs_pos, 16)
    ref = torch.empty_like(c.q)
    R.sparse_paged_attend(c.q, c.k_cache, c.v_cache, sbt, sctx, 1, c.scale, ref)
    for i, layer in enumerate(layers * 2):
        out = layer.forward(q, kc, vc, torch.full_like(q, float("nan")), topk, md)
        _assert_every_row_written_and_close(out.cpu(), ref, f"call {i}")
        assert not ws[:ARRIVAL_COUNTERS].view(torch.int32).any(), i


@pytest.mark.parametrize("heads, cache_dtype, init, local", [(2, "bf16", 0, 1), (1, "fp8_e4m3fn", 1, 1)])
def test_the_portable_indexer_on_the_gpu_is_the_reference(cuda_kernels, heads, cache_dtype, init, local):
    """The indexer's scores and top-k (ops/indexer.py) compiled for CUDA: ids and order exactly
    the reference's (block edges, a padded row, ties, a NaN score)."""
    from msa_iree.ops import IndexTopkSpec
    from test_indexer_kernel import case

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(heads * 10 + init)
    args = case(gen, heads, DTYPES[cache_dtype])
    want = R.index_topk(*args, init_blocks=init, local_blocks=local)
    q, cache, table, req, pos = args
    raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    spec = IndexTopkSpec(MsaConfig(num_kv_heads=heads, kv_dtype=cache_dtype), 16, init, local)
    (got,) = cuda_kernels.run(spec, *[t.to(dev) for t in (q, raw, table, req, pos)], out_dtypes=[torch.int32])
    assert torch.equal(got.cpu(), want)


# ---- the hand-written indexer (ops/indexer_gpu.py) -------------------------------------------

def _gpu_topk(lib, spec, q, cache, table, req, pos, extra_rows=0):
    """The GPU indexer's top-k [H, T, 16] (on the host), written into a buffer of `extra_rows` more
    rows filled with -7 (returned whole, so that a test sees what was not to be touched)."""
    dev = torch.device("cuda")
    raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    n, h = q.shape[0], spec.cfg.num_kv_heads
    out = torch.full((h, n + extra_rows, 16), -7, dtype=torch.int32, device=dev)
    ws = torch.empty(spec.workspace_floats(n, table.shape[1]), device=dev)
    lib.run(spec, q.to(dev), raw.reshape(raw.shape[0], -1).to(dev), table.to(dev), req.to(dev), pos.to(dev),
            out=[out, ws])
    return out.cpu()


@pytest.mark.parametrize("heads, cache_dtype, init, local, dot", gpu_cases.with_dots(gpu_cases.GPU_INDEXER_CASES, 1))
def test_the_gpu_indexer_is_the_reference(cuda_kernels, heads, cache_dtype, init, local, dot):
    """The hand-written scores and top-k: ids and order exactly the reference's (block edges, a
    padded row, ties, a NaN score, forced init and local blocks), rows past the step untouched."""
    from test_indexer_kernel import case

    gen = torch.Generator().manual_seed(heads * 10 + init + 5)
    args = case(gen, heads, DTYPES[cache_dtype])
    want = R.index_topk(*args, init_blocks=init, local_blocks=local)
    spec = gpu_cases.gpu_indexer_spec(indexer_config(heads, cache_dtype, "bf16"), 16, init, local, dot=dot)
    got = _gpu_topk(cuda_kernels, spec, *args, extra_rows=3)
    n = args[0].shape[0]
    assert torch.equal(got[:, :n], want)
    assert got[:, n:].eq(-7).all()


@pytest.mark.parametrize("heads, cache_dtype, init, local, dot", gpu_cases.with_dots(gpu_cases.GPU_INDEXER_CASES, 1))
def test_the_gpu_indexer_emits_the_attends_table_in_the_same_launch(cuda_kernels, heads, cache_dtype, init, local, dot):
    """emit_table: the top-k as without it, and the attend's page-16 table for it through the
    attention group's own block table exactly reference.build_sparse_block_table_prefill's (the own
    block last, zeros past the row's pages, a padded row empty; local 0: rows whose own block is
    not picked), rows past the step untouched."""
    from test_indexer_kernel import case

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(heads * 10 + init + 6)
    q, cache, table, req, pos = case(gen, heads, DTYPES[cache_dtype])
    attend_bt = torch.randperm(200, generator=gen)[:table.numel()].reshape(table.shape).int()
    want = R.index_topk(q, cache, table, req, pos, init_blocks=init, local_blocks=local)
    want_bt, want_ctx = R.build_sparse_block_table_prefill(want, attend_bt, req, pos, 16)
    spec = gpu_cases.gpu_indexer_spec(indexer_config(heads, cache_dtype, "bf16"), 16, init, local, emit_table=True,
                                      dot=dot)
    n = q.shape[0]
    raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    topk = torch.full((heads, n, 16), -7, dtype=torch.int32, device=dev)
    sbt = torch.full((n + 2, heads, 128), -7, dtype=torch.int32, device=dev)
    sctx = torch.full((n + 2, heads), -7, dtype=torch.int32, device=dev)
    ws = torch.empty(spec.workspace_floats(n, table.shape[1]), device=dev)
    cuda_kernels.run(spec, q.to(dev), raw.reshape(raw.shape[0], -1).to(dev), table.to(dev), req.to(dev), pos.to(dev),
                     attend_bt.to(dev), out=[topk, sbt, sctx, ws])
    assert torch.equal(topk.cpu(), want)
    assert torch.equal(sbt[:n].reshape(n * heads, -1).cpu(), want_bt)
    assert torch.equal(sctx[:n].reshape(n * heads).cpu(), want_ctx)
    assert sbt[n:].eq(-7).all() and sctx[n:].eq(-7).all()


@pytest.mark.parametrize("heads, cache_dtype, L, emit, dot", gpu_cases.with_dots(gpu_cases.GPU_INDEXER_ROW_CASES, 1))
def test_the_gpu_indexer_scores_a_requests_decode_tokens_together(cuda_kernels, heads, cache_dtype, L, emit, dot):
    """rows = L: a workgroup scores one request's L decode tokens from each key load, each token
    with its own position, candidates and forced blocks: ids and order (and with emit_table the
    attend's table) exactly the reference's, for tokens that straddle a block edge, a padded
    request, a request of fewer than 16 blocks ending at a block edge and one of 1,000 blocks."""

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(100 * L + heads)
    cols = 1000
    cache = torch.randn(cols + 100, 128, 128, generator=gen).to(DTYPES[cache_dtype])
    table = torch.randint(0, cols + 100, (4, cols), generator=gen, dtype=torch.int32)
    attend_bt = torch.randint(0, 5000, (4, cols), generator=gen, dtype=torch.int32)
    seq = [128 + L // 2, 0, 5 * 128, cols * 128 - 3]
    pos = torch.tensor([s - L + i if s else -1 for s in seq for i in range(L)], dtype=torch.int32)
    req = torch.arange(4, dtype=torch.int32).repeat_interleave(L)
    n = len(pos)
    q = torch.randn(n, heads, 128, generator=gen).to(torch.bfloat16)
    want = R.index_topk(q, cache, table, req, pos)
    spec = gpu_cases.gpu_indexer_spec(indexer_config(heads, cache_dtype, "bf16"), rows=L, emit_table=emit, dot=dot)
    raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    topk = torch.full((heads, n, 16), -7, dtype=torch.int32, device=dev)
    outs = [topk]
    extra = [attend_bt.to(dev)] if emit else []
    if emit:
        outs += [torch.full((n, heads, 128), -7, dtype=torch.int32, device=dev),
                 torch.full((n, heads), -7, dtype=torch.int32, device=dev)]
    ws = torch.empty(spec.workspace_floats(n, cols), device=dev)
    cuda_kernels.run(spec, q.to(dev), raw.reshape(raw.shape[0], -1).to(dev), table.to(dev), req.to(dev), pos.to(dev),
                     *extra, out=[*outs, ws])
    assert torch.equal(topk.cpu(), want)
    if emit:
        want_bt, want_ctx = R.build_sparse_block_table_prefill(want, attend_bt, req, pos, 16)
        assert torch.equal(outs[1].reshape(n * heads, -1).cpu(), want_bt)
        assert torch.equal(outs[2].reshape(n * heads).cpu(), want_ctx)


# block-table columns of the tiled launches: 7 splits of 16 blocks (@merge: one team a row, 8 rows
# a workgroup, the row's picks its team's), 19 (2 teams of 16 splits a row, 4 rows), 63 (4 teams,
# 2 rows)
@pytest.mark.parametrize("cols", [100, 300, 1000])
@pytest.mark.parametrize("heads, cache_dtype, rows, emit, dot", gpu_cases.GPU_INDEXER_TILE_CASES)
def test_the_gpu_indexer_scores_query_tiles_together(cuda_kernels, heads, cache_dtype, rows, emit, dot, cols):
    """tiled: a workgroup scores `rows` tokens of a query tile (64 consecutive tokens of one request
    from the tile's first) from each key load: ids and order (and with emit_table the attend's
    table) exactly the reference's for a decode token, chunks of 13 tokens across a block edge,
    of 72 (a tile and 8) across one, of 1 and of 70 at the end of a `cols`-block request, a request
    of no tokens between them, init and local blocks forced; rows past the step untouched."""
    from msa_iree.ops.indexer_gpu import QUERY_TILE

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(1000 + 10 * rows + heads + cols)
    cache = torch.randn(cols + 100, 128, 128, generator=gen).to(DTYPES[cache_dtype])
    table = torch.randint(0, cols + 100, (6, cols), generator=gen, dtype=torch.int32)
    attend_bt = torch.randint(0, 5000, (6, cols), generator=gen, dtype=torch.int32)
    # (request, first position, tokens)
    chunks = [(0, 5 * 128, 1), (1, 120, 13), (2, 0, 0), (3, 7 * 128 + 60, 72), (4, 0, 1), (5, cols * 128 - 70, 70)]
    req = torch.tensor([r for r, _, n in chunks for _ in range(n)], dtype=torch.int32)
    pos = torch.tensor([p + i for _, p, n in chunks for i in range(n)], dtype=torch.int32)
    starts = [0, 1, 14, 14, 86, 87]
    tiles = torch.tensor([s + t for s, (_, _, n) in zip(starts, chunks) for t in range(0, n, QUERY_TILE)],
                         dtype=torch.int32)
    assert tiles.tolist() == [0, 1, 14, 78, 86, 87, 151]
    n = len(pos)
    q = torch.randn(n, heads, 128, generator=gen).to(torch.bfloat16)
    want = R.index_topk(q, cache, table, req, pos, init_blocks=1, local_blocks=1)
    spec = gpu_cases.gpu_indexer_spec(indexer_config(heads, cache_dtype, "bf16"), 16, 1, 1, rows=rows, tiled=True,
                            emit_table=emit, dot=dot)
    raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    topk = torch.full((heads, n + 3, 16), -7, dtype=torch.int32, device=dev)
    outs = [topk]
    extra = [attend_bt.to(dev)] if emit else []
    if emit:
        outs += [torch.full((n + 3, heads, 128), -7, dtype=torch.int32, device=dev),
                 torch.full((n + 3, heads), -7, dtype=torch.int32, device=dev)]
    ws = torch.empty(spec.workspace_floats(n, cols), device=dev)
    cuda_kernels.run(spec, q.to(dev), raw.reshape(raw.shape[0], -1).to(dev), table.to(dev), req.to(dev), pos.to(dev),
                     tiles.to(dev), *extra, out=[*outs, ws])
    assert torch.equal(topk[:, :n].cpu(), want) and topk[:, n:].eq(-7).all()
    if emit:
        want_bt, want_ctx = R.build_sparse_block_table_prefill(want, attend_bt, req, pos, 16)
        assert torch.equal(outs[1][:n].reshape(n * heads, -1).cpu(), want_bt)
        assert torch.equal(outs[2][:n].reshape(n * heads).cpu(), want_ctx)
        assert outs[1][n:].eq(-7).all() and outs[2][n:].eq(-7).all()


@pytest.mark.parametrize("heads, rows, tiled, emit, dot", gpu_cases.GPU_INDEXER_FP8_QUERY_CASES)
def test_the_gpu_indexer_takes_fp8_queries(cuda_kernels, heads, rows, tiled, emit, dot):
    """fp8_queries: e4m3fn index queries against an e4m3fn cache (what vLLM's model writes for it),
    each converted exactly where the workgroup reads it: ids and order (and with emit_table the
    attend's table) exactly the reference's, init and local blocks forced, for a step's decode
    tokens `rows` a workgroup (a token past a block edge, a padded request, a request of 300
    blocks) or its query tiles (tiled: chunks of 1, 13 across a block edge, 0 and 70 at the end)."""
    from msa_iree.ops import IndexTopkGpuSpec
    from msa_iree.ops.indexer_gpu import QUERY_TILE

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(2000 + 100 * rows + 10 * heads + tiled)
    cols = 300
    cache = torch.randn(cols + 100, 128, 128, generator=gen).to(torch.float8_e4m3fn)
    table = torch.randint(0, cols + 100, (4, cols), generator=gen, dtype=torch.int32)
    attend_bt = torch.randint(0, 5000, (4, cols), generator=gen, dtype=torch.int32)
    if tiled:  # (request, first position, tokens)
        chunks = [(0, 5 * 128, 1), (1, 120, 13), (2, 0, 0), (3, cols * 128 - 70, 70)]
        starts = [sum(c[2] for c in chunks[:i]) for i in range(len(chunks))]
        tiles = [torch.tensor([s + t for s, (_, _, n) in zip(starts, chunks) for t in range(0, n, QUERY_TILE)],
                              dtype=torch.int32).to(dev)]
    else:
        seq = [128 + rows // 2 + 1, 0, 5 * 128, cols * 128 - 3]
        chunks = [(r, s - rows if s else -1, rows) for r, s in enumerate(seq)]
        tiles = []
    req = torch.tensor([r for r, _, n in chunks for _ in range(n)], dtype=torch.int32)
    pos = torch.tensor([p + i if p >= 0 else -1 for _, p, n in chunks for i in range(n)], dtype=torch.int32)
    n = len(pos)
    q = (2 * torch.randn(n, heads, 128, generator=gen)).to(torch.float8_e4m3fn)
    want = R.index_topk(q, cache, table, req, pos, init_blocks=1, local_blocks=1)
    spec = gpu_cases.gpu_indexer_spec(indexer_config(heads, "fp8_e4m3fn", "bf16"), 16, 1, 1, rows=rows, tiled=tiled,
                                      emit_table=emit, dot=dot, fp8_queries=True)
    topk = torch.full((heads, n + 3, 16), -7, dtype=torch.int32, device=dev)
    outs = [topk]
    if emit:
        outs += [torch.full((n + 3, heads, 128), -7, dtype=torch.int32, device=dev),
                 torch.full((n + 3, heads), -7, dtype=torch.int32, device=dev)]
    ws = torch.empty(spec.workspace_floats(n, cols), device=dev)
    cuda_kernels.run(spec, q.view(torch.uint8).to(dev), cache.view(torch.uint8).reshape(cache.shape[0], -1).to(dev),
                     table.to(dev), req.to(dev), pos.to(dev), *tiles, *([attend_bt.to(dev)] if emit else []),
                     out=[*outs, ws])
    assert torch.equal(topk[:, :n].cpu(), want) and topk[:, n:].eq(-7).all()
    if emit:
        want_bt, want_ctx = R.build_sparse_block_table_prefill(want, attend_bt, req, pos, 16)
        assert torch.equal(outs[1][:n].reshape(n * heads, -1).cpu(), want_bt)
        assert torch.equal(outs[2][:n].reshape(n * heads).cpu(), want_ctx)


@pytest.mark.parametrize("dot", gpu_cases.GPU_INDEXER_DOTS + ("mfma",))
def test_the_gpu_indexer_ranks_the_hand_made_request(cuda_kernels, dot):
    """Block 0 scores 1, blocks 1 and 2 tie at 3, block 3 holds a NaN, block 4 scores -5, the own
    block (4) forced local: [4, 1, 2, 0, 3, -1, ...] (test_indexer_kernel's vector)."""

    q = torch.zeros(1, 1, 128, dtype=torch.bfloat16)
    q[0, 0, 0] = 1
    keys = torch.zeros(5, 128, 128)
    for b, v in enumerate([1.0, 3.0, 3.0, float("nan"), -5.0]):
        keys[b, :, 0] = v
    got = _gpu_topk(cuda_kernels, gpu_cases.gpu_indexer_spec(indexer_config(1, "bf16", "bf16"), dot=dot), q,
                    keys.to(torch.bfloat16),
                    torch.arange(5, dtype=torch.int32)[None], torch.zeros(1, dtype=torch.int32),
                    torch.tensor([4 * 128 + 10], dtype=torch.int32))
    assert got[0, 0].tolist() == [4, 1, 2, 0, 3] + [-1] * 11


@pytest.mark.parametrize("dot", ["mma-e4m3", "mma-bf16dot"])
def test_the_tensor_cores_rank_the_hand_made_request_in_e4m3fn(cuda_kernels, dot):
    """The hand-made request in e4m3fn, queries and keys, on the tensor cores' e4m3 dot (and
    converted for their bf16 dot): block 0 scores 1, blocks 1 and 2 tie at 3, block 3 holds a NaN,
    block 4 scores -5, the own block (4) forced local: [4, 1, 2, 0, 3, -1, ...]."""
    fn = torch.float8_e4m3fn
    q = torch.zeros(1, 1, 128).to(fn)
    q[0, 0, 0] = 1
    keys = torch.zeros(5, 128, 128)
    for b, v in enumerate([1.0, 3.0, 3.0, float("nan"), -5.0]):
        keys[b, :, 0] = v
    keys = keys.to(fn)
    table, req, pos = torch.arange(5, dtype=torch.int32)[None], torch.zeros(1, dtype=torch.int32), \
        torch.tensor([4 * 128 + 10], dtype=torch.int32)
    spec = gpu_cases.gpu_indexer_spec(indexer_config(1, "fp8_e4m3fn", "bf16"), dot=dot, fp8_queries=True)
    assert spec.e4m3_dot == (dot == "mma-e4m3")
    got = _gpu_topk(cuda_kernels, spec, q.view(torch.uint8), keys, table, req, pos)
    assert got[0, 0].tolist() == [4, 1, 2, 0, 3] + [-1] * 11


def test_the_mfma_twin_reads_e4m3fn_as_e4m3fn(cuda_kernels):
    """gfx942's fp8 MFMA reads e4m3fnuz: the kernel remaps e4m3fn's -0 (fnuz's NaN) and NaNs (fnuz's
    +-240) first, and the twin scores the bytes as fnuz would. Block 0 scores 1; block 1 3 with -0
    in every other dim, keys and query alike; block 2 holds a NaN key (-1e30, below block 3's -5);
    the own block (4) forced local: [4, 1, 0, 3, 2, -1, ...]."""
    fn = torch.float8_e4m3fn
    q = torch.full((1, 1, 128), -0.0).to(fn)
    q[0, 0, 0] = 1
    keys = torch.full((5, 128, 128), -0.0)
    for b, v in enumerate([1.0, 3.0, 0.0, -5.0]):
        keys[b, :, 0] = v
    keys[2, 7, 5] = float("nan")
    keys = keys.to(fn)
    assert (keys.view(torch.uint8) == 0x80).any() and (keys.view(torch.uint8) & 0x7F == 0x7F).any()
    table, req, pos = torch.arange(5, dtype=torch.int32)[None], torch.zeros(1, dtype=torch.int32), \
        torch.tensor([4 * 128 + 10], dtype=torch.int32)
    want = R.index_topk(q, keys, table, req, pos)
    assert want[0, 0].tolist() == [4, 1, 0, 3, 2] + [-1] * 11
    spec = gpu_cases.gpu_indexer_spec(indexer_config(1, "fp8_e4m3fn", "bf16"), dot="mfma", fp8_queries=True)
    got = _gpu_topk(cuda_kernels, spec, q.view(torch.uint8), keys, table, req, pos)
    assert torch.equal(got, want)


@pytest.mark.parametrize("cols, cache_dtype, dot",
                         gpu_cases.with_dots([(64, "bf16"), (1000, "fp8_e4m3fn"), (8192, "bf16")], 1))
def test_the_gpu_indexer_over_long_contexts_is_the_reference(cuda_kernels, cols, cache_dtype, dot):
    """Both split rules (8 blocks a split up to 512 candidates, then candidates / 64) up to 8,192
    columns (1,048,576 tokens): rows at a request's last, first and block-edge positions and four
    consecutive (speculative decode) positions, random keys; ids and order exactly the reference's."""

    gen = torch.Generator().manual_seed(cols)
    blocks = cols + 8
    cache = torch.randn(blocks, 128, 128, generator=gen).to(DTYPES[cache_dtype])
    table = torch.randint(0, blocks, (2, cols), generator=gen, dtype=torch.int32)
    last, mid = cols * 128 - 1, cols * 64 + 5
    pos = torch.tensor([last, 0, 127, 128, last - 128, mid - 3, mid - 2, mid - 1, mid], dtype=torch.int32)
    req = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1], dtype=torch.int32)
    q = torch.randn(len(pos), 1, 128, generator=gen).to(torch.bfloat16)
    want = R.index_topk(q, cache, table, req, pos)
    got = _gpu_topk(cuda_kernels, gpu_cases.gpu_indexer_spec(indexer_config(1, cache_dtype, "bf16"), dot=dot), q, cache,
                    table, req, pos)
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows, tiled, dot, init, local", gpu_cases.GPU_INDEXER_WIDE_TABLE_CASES)
def test_the_gpu_indexer_splits_each_group_by_its_own_candidates(cuda_kernels, rows, tiled, dot, init, local):
    """A block table of 8,192 columns (vLLM's for a 1M-token context) over short requests: each
    workgroup's rows split by their own candidates (a 4K-token row into 4 splits, not 1), and a
    row whose group reaches further (tokens straddling 512 / 513 candidates: 8 blocks a split for
    the one, 9 for the other) merges the splits its group gave it: ids and order exactly the
    reference's for requests of 1, 16, 17, 32, 512 / 513 and 700 candidate blocks, a padded one,
    init and local blocks forced; rows past the step untouched."""
    from msa_iree.ops.indexer_gpu import QUERY_TILE

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3000 + rows + 10 * tiled)
    cols, blocks = 8192, 720
    cache = torch.randn(blocks, 128, 128, generator=gen).to(torch.bfloat16)
    table = torch.randint(0, blocks, (8, cols), generator=gen, dtype=torch.int32)
    # (request, last position + 1): every request's tokens end there
    ends = [(0, 100), (1, 16 * 128), (2, 16 * 128 + 1), (3, 32 * 128), (4, 512 * 128 + 2), (5, 0), (6, 700 * 128 - 5),
            (7, 512 * 128)]
    # a decode step's `rows` tokens a request, or prefill chunks of `rows` + 3 (a partial tile's)
    count = rows if not tiled else rows + 3
    chunks = [(r, end - count, count) if end else (r, -1, rows) for r, end in ends]
    req = torch.tensor([r for r, _, n in chunks for _ in range(n)], dtype=torch.int32)
    pos = torch.tensor([p + i if p >= 0 else -1 for _, p, n in chunks for i in range(n)], dtype=torch.int32)
    n = len(pos)
    cand = torch.where(pos >= 0, pos // 128 + 1, 0)
    assert {1, 16, 17, 32, 512, 513, 700} <= set(cand.tolist()) and 0 in cand.tolist()
    q = torch.randn(n, 1, 128, generator=gen).to(torch.bfloat16)
    want = R.index_topk(q, cache, table, req, pos, init_blocks=init, local_blocks=local)
    spec = gpu_cases.gpu_indexer_spec(indexer_config(1, "bf16", "bf16"), 16, init, local, rows=rows, tiled=tiled,
                                      dot=dot)
    topk = torch.full((1, n + 3, 16), -7, dtype=torch.int32, device=dev)
    ws = torch.full((spec.workspace_floats(n, cols),), float("nan"), device=dev)
    if tiled:
        starts = [sum(c[2] for c in chunks[:i]) for i in range(len(chunks))]
        tiles = [torch.tensor([s + t for s, (_, p, k) in zip(starts, chunks) if p >= 0 for t in range(0, k, QUERY_TILE)],
                              dtype=torch.int32).to(dev)]
    else:
        tiles = []
    cuda_kernels.run(spec, q.to(dev), cache.reshape(blocks, -1).to(dev), table.to(dev), req.to(dev), pos.to(dev),
                     *tiles, out=[topk, ws])
    assert torch.equal(topk[:, :n].cpu(), want) and topk[:, n:].eq(-7).all()


@pytest.mark.parametrize("heads, cache_dtype, rows, emit", gpu_cases.GPU_INDEXER_TURN_CASES)
def test_the_gpu_indexers_groups_take_turns_at_their_splits(cuda_kernels, heads, cache_dtype, rows, emit):
    """96 decode requests over a table of 8,192 columns: @score's grid holds fewer workgroups a
    group than the longest requests' splits (IndexerTuning.grid_workgroups), so those take their
    splits in turn (a 700-block request's 44 splits of 16 blocks in 4 turns of 11 workgroups), and
    the step's top-k is the reference's exactly, ids and order, for requests of 1 to 700 candidate
    blocks and padded ones; with the table, the attend's page-16 table is the builder's for it."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(4100 + 10 * heads + rows)
    cols, blocks, reqs = 8192, 720, 96
    cfg = indexer_config(heads, cache_dtype, "bf16")
    spec = gpu_cases.gpu_indexer_spec(cfg, 16, 1, 1, emit_table=emit, rows=rows, dot="mma")
    assert spec.tuning_row.grid_splits(cols, reqs) < -(-700 // spec.tuning_row.blocks_per_split(700))  # the turns
    cache = torch.randn(blocks, 128, 128, generator=gen).to(DTYPES[cache_dtype])
    table = torch.randint(0, blocks, (reqs, cols), generator=gen, dtype=torch.int32)
    lengths = [1, 17, 33, 200, 513, 700, 0, 64]  # candidate blocks (0: a padded request)
    ends = [lengths[r % len(lengths)] * 128 - (r % 5) for r in range(reqs)]
    req = torch.arange(reqs, dtype=torch.int32).repeat_interleave(rows)
    pos = torch.tensor([end - rows + i if end > 0 else -1 for end in ends for i in range(rows)], dtype=torch.int32)
    n = len(pos)
    q = torch.randn(n, heads, 128, generator=gen).to(torch.bfloat16)
    want = R.index_topk(q, cache, table, req, pos, init_blocks=1, local_blocks=1)
    topk = torch.full((heads, n + 3, 16), -7, dtype=torch.int32, device=dev)
    ws = torch.full((spec.workspace_floats(n, cols),), float("nan"), device=dev)
    raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    operands = [q.to(dev), raw.reshape(blocks, -1).to(dev), table.to(dev), req.to(dev), pos.to(dev)]
    if emit:
        sbt = torch.full((n, heads, 128), -7, dtype=torch.int32, device=dev)
        sctx = torch.full((n, heads), -7, dtype=torch.int32, device=dev)
        cuda_kernels.run(spec, *operands, table.to(dev), out=[topk, sbt, sctx, ws])
    else:
        cuda_kernels.run(spec, *operands, out=[topk, ws])
    assert torch.equal(topk[:, :n].cpu(), want) and topk[:, n:].eq(-7).all()
    if emit:
        want_bt, want_ctx = R.build_sparse_block_table_prefill(want, table, req, pos, 16)
        assert torch.equal(sbt.cpu().reshape(n * heads, 128), want_bt)
        assert torch.equal(sctx.cpu().reshape(n * heads), want_ctx)


@pytest.mark.parametrize("cache_dtype", ["bf16", "fp8_e4m3fn"])
def test_the_gpu_index_insert_is_the_reference(cuda_kernels, cache_dtype):
    """runtime.Indexer.insert on CUDA (the hand-written insert, ops/insert_gpu.py): a mixed step's
    bf16 index keys (two decode tokens, a chunk of 130 across a block edge; padding slots < 0 at
    the step's end, as a captured step passes them) at the index group's slots exactly as
    reference.insert_index_cache (e4m3fn: keys of up to +-300, two past its 448, two subnormal,
    rounded to nearest even and saturated),
    nothing else touched; then the same insert captured in a CUDA graph and replayed with new
    keys (the padding skipped in the kernel: no host sync)."""
    from msa_iree.runtime import Indexer, MetadataBuilder
    from test_indexer_kernel import step_rows

    dev = torch.device("cuda")
    dtype = DTYPES[cache_dtype]
    gen = torch.Generator().manual_seed(17 + len(cache_dtype))
    index_bt = torch.tensor([[3, 7, 1, 9, 0], [2, 5, 11, 4, 6], [8, 10, 12, 13, 14]], dtype=torch.int32)
    computed = torch.tensor([300, 511, 200], dtype=torch.int32)
    qsl, seq, req, pos = step_rows(computed, [1, 1, 130])
    n, padded = int(qsl[-1]), int(qsl[-1]) + 6
    slots = torch.full((padded,), -1, dtype=torch.int32)
    slots[:n] = index_bt[req.long(), pos.long() // 128] * 128 + pos % 128
    md = MetadataBuilder(4, 1024, num_cache_blocks=16, kernels=cuda_kernels, device=dev).build(
        index_bt.to(dev), seq.to(dev), qsl.to(dev), computed.to(dev), 1, 2, slot_mapping=slots.to(dev),
        num_actual_tokens=n)
    indexer = Indexer(1, dtype, kernels=cuda_kernels)
    assert indexer.specs.insert.name.startswith("insert_index_gpu")
    cache = torch.randn(16, 128, 128, generator=gen).to(dtype)
    ref = cache.clone()
    keys = [torch.cat([600 * torch.rand(n, 128, generator=gen) - 300, torch.randn(6, 128, generator=gen)]).to(torch.bfloat16)
            for _ in range(2)]
    keys[0][:2, :4] = torch.tensor([600.0, -600.0, 1e-3, -2.5e-3])  # past e4m3fn's 448, and its subnormals
    on_dev = cache.to(dev)
    indexer.insert(keys[0].to(dev), on_dev, md)
    R.insert_index_cache(keys[0][:n], ref, slots[:n])
    assert torch.equal(on_dev.cpu().view(torch.uint8), ref.view(torch.uint8))
    # captured: the step's fixed-size insert in a graph, replayed over new keys
    key_buf = keys[0].to(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indexer.insert(key_buf, on_dev, md)
    key_buf.copy_(keys[1].to(dev))
    graph.replay()
    torch.cuda.synchronize()
    R.insert_index_cache(keys[1][:n], ref, slots[:n])
    assert torch.equal(on_dev.cpu().view(torch.uint8), ref.view(torch.uint8))


def test_the_indexer_serves_the_gpu_kernel_on_the_step_metadata(cuda_kernels):
    """runtime.Indexer on CUDA: the step's metadata (index group) into the hand-written kernel,
    launched on torch's stream into the caller's buffer (rows past the step untouched) or its own;
    the same top-k as the reference for a mixed step (two decodes, a chunked prefill)."""
    from msa_iree.runtime import Indexer, MetadataBuilder
    from test_indexer_kernel import step_rows

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(91)
    index_bt = torch.tensor([[3, 7, 1, 9, 0], [2, 5, 11, 4, 6], [8, 10, 12, 13, 14]], dtype=torch.int32)
    cache = torch.randn(16, 128, 128, generator=gen).to(torch.bfloat16)
    computed = torch.tensor([300, 511, 200], dtype=torch.int32)
    qsl, seq, req, pos = step_rows(computed, [1, 1, 130])
    builder = MetadataBuilder(4, 1024, num_cache_blocks=16, kernels=cuda_kernels, device=dev)
    md = builder.build(index_bt.to(dev), seq.to(dev), qsl.to(dev), computed.to(dev), 1, 2)
    n = int(qsl[-1])
    index_q = torch.randn(n, 1, 128, generator=gen).to(torch.bfloat16)
    indexer = Indexer(1, torch.bfloat16, kernels=cuda_kernels)
    assert indexer.specs.gpu() is not None
    assert indexer._gpu_spec(md, index_q.to(dev)).tiled  # a step with a prefill: its query tiles
    want = R.index_topk(index_q, cache, index_bt, req, pos)
    out = torch.full((1, n + 4, 16), -7, dtype=torch.int32, device=dev)
    got = indexer.topk(index_q.to(dev), cache.to(dev), md, out=out)
    assert got is out and torch.equal(out[:, :n].cpu(), want) and out[:, n:].eq(-7).all()
    assert torch.equal(indexer.topk(index_q.to(dev), cache.to(dev), md).cpu(), want)
    with pytest.raises(ValueError, match=r"out: expected a contiguous \[1, >= 132, 16\] int32 tensor"):
        indexer.topk(index_q.to(dev), cache.to(dev), md, out=out[:, :n - 1])
    # a decode-only step of 2 tokens a request: each request's tokens scored together
    q2 = torch.tensor([2, 2, 2], dtype=torch.int32)
    qsl2 = torch.cat([torch.zeros(1, dtype=torch.int32), q2.cumsum(0).int()])
    seq2 = seq + 2
    md2 = builder.build(index_bt.to(dev), seq2.to(dev), qsl2.to(dev), seq.to(dev), 2, 3)
    assert indexer._gpu_spec(md2, index_q[:6].to(dev)).rows == 2
    req2 = torch.arange(3, dtype=torch.int32).repeat_interleave(2)
    pos2 = torch.tensor([int(s) - 2 + i for s in seq2 for i in range(2)], dtype=torch.int32)
    assert torch.equal(indexer.topk(index_q[:6].to(dev), cache.to(dev), md2).cpu(),
                       R.index_topk(index_q[:6], cache, index_bt, req2, pos2))
    # the top-k and the attend's table in one launch, through the attention group's metadata
    kv_bt = torch.tensor([[20, 21, 22, 23, 24], [30, 31, 32, 33, 34], [40, 41, 42, 43, 44]], dtype=torch.int32)
    kv_md = MetadataBuilder(4, 1024, num_cache_blocks=64, kernels=cuda_kernels, device=dev).build(
        kv_bt.to(dev), seq.to(dev), qsl.to(dev), computed.to(dev), 1, 2)
    topk, sbt, sctx = indexer.topk_with_table(index_q.to(dev), cache.to(dev), md, kv_md)
    want_bt, want_ctx = R.build_sparse_block_table_prefill(want, kv_bt, req, pos, 16)
    assert torch.equal(topk.cpu(), want) and torch.equal(sbt.cpu(), want_bt) and torch.equal(sctx.cpu(), want_ctx)
    # an e4m3fn cache with e4m3fn queries (the vLLM plugin's for an fp8 index cache), the same steps
    fn = torch.float8_e4m3fn
    indexer8, cache8, q8 = Indexer(1, fn, query_dtype=fn, kernels=cuda_kernels), cache.to(fn), index_q.to(fn)
    assert indexer8._gpu_spec(md, q8.to(dev)).fp8_queries
    topk, sbt, sctx = indexer8.topk_with_table(q8.to(dev), cache8.to(dev), md, kv_md)
    want8 = R.index_topk(q8, cache8, index_bt, req, pos)
    want_bt, want_ctx = R.build_sparse_block_table_prefill(want8, kv_bt, req, pos, 16)
    assert torch.equal(topk.cpu(), want8) and torch.equal(sbt.cpu(), want_bt) and torch.equal(sctx.cpu(), want_ctx)
    assert torch.equal(indexer8.topk(q8[:6].to(dev), cache8.to(dev), md2).cpu(),
                       R.index_topk(q8[:6], cache8, index_bt, req2, pos2))
