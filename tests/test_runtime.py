"""The runtime on the host CPU: a multi-step serving simulation against the reference, and every
bad input of the interface."""
import json

import numpy as np
import pytest
import torch

from msa_iree import reference as R
from msa_iree import testing
from msa_iree.layout import allocate_kv_cache
from msa_iree.runtime import BuildMismatchError, KernelLibrary, MetadataBuilder, SparseAttention, insert_kv
from serving import Server
from tolerances import assert_attend_close

BF16, F16, FNUZ, FN = torch.bfloat16, torch.float16, torch.float8_e4m3fnuz, torch.float8_e4m3fn


SEEDS = {("torch.bfloat16", "interleaved"): 101, ("torch.float16", "planes"): 102,
         ("torch.float8_e4m3fnuz", "interleaved"): 103, ("torch.float8_e4m3fn", "planes"): 104}


@pytest.mark.parametrize("kv, qd, layout, hkv, smode, wide", [
    (BF16, BF16, "interleaved", 1, "tensor", False),
    (F16, F16, "planes", 2, "tensor", False),
    (FNUZ, BF16, "interleaved", 1, "tensor", False),
    (FN, BF16, "planes", 1, "token", False),
    (BF16, BF16, "interleaved", 1, "tensor", True),  # vLLM's table: max_model_len wide, max_seq_len given
])
def test_serving_simulation(host_kernels, kv, qd, layout, hkv, smode, wide):
    s = Server(host_kernels, kv, qd, layout, hkv, smode, seed=SEEDS[str(kv), layout], wide_table=wide)
    s.step([], [("a", 200), ("b", 130)], 1)                       # two chunked prefills
    s.step(["b"], [("a", 100), ("c", 129)], 1)                    # decode, prefills with a prefix
    s.step(["a", "b", "c", None, None], [], 1)                   # a decode batch padded with 2 requests
    s.step(["a", "b", "c", None], [], 4)                          # speculative decode L = 4
    md = s.step(["a", "c"], [("d", 255), ("b", 3)], 4)            # spec decode + prefills
    assert torch.equal(md.decode.page16_block_table, md.decode.block_table * 2)


def test_forward_given_the_steps_kv_inserts_it_first_on_the_host(host_kernels):
    """forward(key=, value=) where no attend inserts itself (the host): insert_kv then the attend,
    the cache byte for byte the reference insert's; key without value is refused by name."""
    s = Server(host_kernels, FN, BF16, "interleaved", 1, "token", seed=105,
               insert_in_forward=True)
    assert not s.attn.fuses_insert
    s.step([], [("a", 127)], 1)
    md = s.step(["a"], [], 1)
    q = torch.zeros(1, 16, 128, dtype=BF16)
    key = torch.zeros(1, 1, 128, dtype=BF16)
    with pytest.raises(ValueError, match="key, value: expected both"):
        s.attn.forward(q, s.k_cache, s.v_cache, torch.empty_like(q), torch.zeros(1, 1, 16, dtype=torch.int32), md,
                       s.k_scale, s.v_scale, key=key)


# ---- bad inputs ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_setup(host_kernels):
    c = testing.decode_case([300, 129], kv_dtype=FNUZ, seed=21)
    attn = SparseAttention(16, 1, 128, c.scale, FNUZ, kernels=host_kernels)
    builder = MetadataBuilder(4, 4096, num_cache_blocks=c.k_cache.shape[0] // 16, kernels=host_kernels)
    md = builder.build(c.block_table.clamp(min=0), c.seq_lens, torch.arange(3, dtype=torch.int32),
                       c.seq_lens - 1, 1, 2)
    return c, attn, md, builder


def call(c, attn, md, **over):
    args = dict(query=c.q, k_cache=c.k_cache, v_cache=c.v_cache, output=torch.empty_like(c.q), topk=c.topk,
                metadata=md, k_scale=c.k_scale, v_scale=c.v_scale)
    args.update(over)
    return attn.forward(**args)


def test_forward_matches_the_reference_with_and_without_an_emitted_table(fp8_setup):
    c, attn, md, _ = fp8_setup
    ref = torch.empty_like(c.q)
    R.sparse_attn_decode(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.seq_lens, 1, c.scale, ref,
                         c.k_scale, c.v_scale)
    bt, ctx = R.build_sparse_block_table_decode(c.topk, c.block_table, c.seq_lens, 1, 16)
    assert_attend_close(call(c, attn, md), ref, "top-k")
    assert_attend_close(call(c, attn, md, sparse_block_table=bt, sparse_context_lens=ctx), ref, "emitted table")


@pytest.mark.parametrize("over, err, match", [
    (lambda c: dict(query=c.q.float()), ValueError, "q: expected"),
    (lambda c: dict(query=c.q.half()), ValueError, "query: expected torch.bfloat16"),
    (lambda c: dict(query=c.q[:, :8]), ValueError, r"q: expected shape \[\*, 16, 128\]"),
    (lambda c: dict(k_cache=c.k_cache.view(torch.float8_e4m3fn), v_cache=c.v_cache.view(torch.float8_e4m3fn)),
     ValueError, "k_cache: expected torch.float8_e4m3fnuz, got torch.float8_e4m3fn.*silent garbage"),
    (lambda c: dict(k_cache=c.k_cache.view(torch.uint8), v_cache=c.v_cache.view(torch.uint8)), ValueError, "k_cache"),
    (lambda c: dict(v_cache=c.v_cache[:-2]), ValueError, "v_cache.shape"),
    (lambda c: dict(k_cache=c.k_cache.to("meta"), v_cache=c.v_cache.to("meta")), ValueError, "device"),
    (lambda c: dict(output=torch.empty(2, 16, 128, dtype=torch.float16)), ValueError, "out: expected"),
    (lambda c: dict(topk=c.topk.long()), ValueError, "topk"),
    (lambda c: dict(k_scale=torch.ones(1, 5)), ValueError, "k_scale"),
    (lambda c: dict(k_scale=torch.ones(1, dtype=torch.float16)), ValueError, "k_scale"),
    (lambda c: dict(sparse_block_table=torch.zeros(2, 128, dtype=torch.int32)), ValueError, "provided together"),
    (lambda c: dict(sparse_block_table=torch.full((2, 128), 10 ** 6, dtype=torch.int32),
                    sparse_context_lens=torch.full((2,), 2048, dtype=torch.int32)), IndexError, "out of range"),
])
def test_bad_forward_inputs(fp8_setup, over, err, match):
    c, attn, md, _ = fp8_setup
    with pytest.raises(err, match=match):
        call(c, attn, md, **over(c))


def test_emitted_table_on_planes_cache_is_a_stride_error(host_kernels):
    c = testing.decode_case([129], layout="planes", seed=22)
    attn = SparseAttention(16, 1, 128, c.scale, BF16, kernels=host_kernels)
    md = MetadataBuilder(2, 1024, kernels=host_kernels).build(c.block_table, c.seq_lens,
                                                              torch.arange(2, dtype=torch.int32), c.seq_lens - 1, 1, 1)
    bt, ctx = R.build_sparse_block_table_decode(c.topk, c.block_table, c.seq_lens, 1, 8)
    with pytest.raises(RuntimeError, match="block spanning 16 pages, but this KV cache lays a block out over 8"):
        call(c, attn, md, sparse_block_table=bt, sparse_context_lens=ctx, k_scale=None, v_scale=None)


def test_builder_errors(fp8_setup):
    c, _, _, builder = fp8_setup
    bt = c.block_table.clamp(min=0)
    with pytest.raises(ValueError, match=r"exceeds the page-16 rebase buffer \(4, 32\)"):
        builder.build(torch.zeros(5, 2, dtype=torch.int32), torch.ones(5, dtype=torch.int32),
                      torch.arange(6, dtype=torch.int32), torch.zeros(5, dtype=torch.int32), 1, 5)
    with pytest.raises(IndexError, match=r"block_table: expected ids in \[0, \d+\) \(num_cache_blocks\), got 10"):
        builder.build(bt + 1000, c.seq_lens, torch.arange(3, dtype=torch.int32), c.seq_lens - 1, 1, 2)
    with pytest.raises(ValueError, match="decode query lengths: expected decode_query_len=4 for each of the first "
                                         "num_decodes=2 requests, got 4 for request 1|got 1 for request 0"):
        builder.build(bt, c.seq_lens, torch.tensor([0, 1, 2], dtype=torch.int32), c.seq_lens - 1, 4, 2)
    with pytest.raises(ValueError, match="decode_query_len: expected > 0"):
        builder.build(bt, c.seq_lens, torch.arange(3, dtype=torch.int32), c.seq_lens - 1, 0, 2)
    with pytest.raises(ValueError, match="block_table: expected torch.int32, got torch.int64"):
        builder.build(bt.long(), c.seq_lens, torch.arange(3, dtype=torch.int32), c.seq_lens - 1, 1, 2)


def test_the_builder_checks_the_steps_slots_once(fp8_setup, host_kernels):
    """The builder finds the step's largest slot (so that insert_kv needs no sync per layer) and,
    with num_cache_blocks, refuses a slot past the cache; padding (-1) passes, slots for more
    tokens than the step has are cut to the step, fewer refused."""
    c, _, _, builder = fp8_setup
    bt, qsl = c.block_table.clamp(min=0), torch.arange(3, dtype=torch.int32)
    capacity = builder.num_cache_blocks * 128
    md = builder.build(bt, c.seq_lens, qsl, c.seq_lens - 1, 1, 2, slot_mapping=torch.tensor([-1, 5, 99]))
    assert md.max_slot == 5 and md.slot_mapping.tolist() == [-1, 5]
    assert md.insert_slots.tolist() == [5] and md.insert_token_index.tolist() == [1]  # host writer: compacted
    with pytest.raises(IndexError, match=f"slot_mapping: expected ids in \\[0, {capacity}\\)"):
        builder.build(bt, c.seq_lens, qsl, c.seq_lens - 1, 1, 2, slot_mapping=torch.tensor([0, capacity]))
    with pytest.raises(ValueError, match="slot_mapping: expected at least num_tokens=2 entries, got 1"):
        builder.build(bt, c.seq_lens, qsl, c.seq_lens - 1, 1, 2, slot_mapping=torch.tensor([0]))
    unchecked = MetadataBuilder(4, 4096, kernels=host_kernels).build(bt, c.seq_lens, qsl, c.seq_lens - 1, 1, 2,
                                                                      slot_mapping=torch.tensor([0, capacity]))
    assert unchecked.max_slot == capacity  # insert_kv refuses it for its cache (test below)


def test_insert_rejects_slots_beyond_cache(host_kernels):
    kc, vc = allocate_kv_cache(2, 1, BF16, "interleaved", fill=0)
    key = torch.zeros(1, 1, 128, dtype=BF16)
    with pytest.raises(IndexError, match="slot_mapping"):
        insert_kv(host_kernels, key, key, kc, vc, torch.tensor([256], dtype=torch.int32))
    # metadata checked against a larger cache than this one: insert_kv checks the step's largest slot
    md = MetadataBuilder(1, 1024, num_cache_blocks=8, kernels=host_kernels).build(
        torch.zeros(1, 8, dtype=torch.int32), torch.tensor([300]), torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([299]), 1, 1, slot_mapping=torch.tensor([300]))
    assert md.max_slot == 300
    with pytest.raises(IndexError, match="slot_mapping: expected slots below k_cache's 256 tokens, got 300"):
        insert_kv(host_kernels, key, key, kc, vc, md)
    with pytest.raises(ValueError, match="key: expected at least num_actual_tokens=1 rows"):
        insert_kv(host_kernels, key[:0], key[:0], kc, vc, md)


def test_insert_kv_unit_scale_is_made_once_per_device():
    """A 16-bit cache's scale operand (ones) is one tensor per library and device, handed out as
    [H, 1] views: insert_kv allocates nothing (queues no fill kernel) per call for it."""
    lib = KernelLibrary("host", compile_missing=True)
    cpu = torch.device("cpu")
    two, four = lib.unit_scale(2, cpu), lib.unit_scale(4, cpu)
    assert two.shape == (2, 1) and four.shape == (4, 1) and two.dtype == torch.float32
    assert two.eq(1).all() and four.eq(1).all()
    assert two.data_ptr() == four.data_ptr() == lib.unit_scale(1, cpu).data_ptr()


def test_mismatched_builds_are_refused(tmp_path):
    from msa_iree import compile as C
    from msa_iree import ops as K
    from msa_iree.config import MsaConfig

    spec = K.RebaseSlotsSpec(MsaConfig())
    C.build(MsaConfig(), ["host"], tmp_path, specs=[spec], log=lambda m: None)
    lib = KernelLibrary("host", tmp_path, compile_missing=False)
    lib.function(spec)  # loads
    with pytest.raises(BuildMismatchError, match="expected target 'cuda'"):
        KernelLibrary("cuda", tmp_path)
    m = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**m, "iree_compiler_version": "3.9.0"}))
    with pytest.raises(BuildMismatchError, match="IREE 3.9.0"):
        KernelLibrary("host", tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    (tmp_path / m["kernels"][spec.name]["file"]).write_bytes(b"garbage")
    with pytest.raises(BuildMismatchError, match="sha256"):
        KernelLibrary("host", tmp_path).function(spec)
    missing = K.SparseAttnDecodeSpec(MsaConfig(), 16)
    with pytest.raises(BuildMismatchError, match=f"expected kernel {missing.name} in the manifest, got none; build it "
                       f"with `msa-iree compile --target host --num-heads 16 --num-kv-heads 1 --kv-dtype bf16 "
                       f"--query-dtype bf16 --out {tmp_path}`"):
        KernelLibrary("host", tmp_path).function(missing)  # no compilation unless asked for
    alone = K.RebaseBlockTableSpec(MsaConfig())  # in no kernel set: the call that builds it
    with pytest.raises(BuildMismatchError, match=r"msa_iree\.compile\.build\(None, \['host'\]"):
        KernelLibrary("host", tmp_path).function(alone)


def test_the_builder_runs_no_compiled_module(host_kernels, monkeypatch):
    """A step's build is copies and host work (the page-16 rebase included): a compiled module's
    synchronous call (~0.7 ms on an H200 host) would cost more than the step's checks and copies
    together."""
    from msa_iree.runtime import MetadataBuilder

    ran = []
    monkeypatch.setattr(type(host_kernels), "run", lambda self, spec, *a, **k: ran.append(spec.name))
    builder = MetadataBuilder(max_num_seqs=2, max_model_len=512, kernels=host_kernels)
    bt = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    seq = torch.tensor([300, 129], dtype=torch.int32)
    md = builder.build(bt, seq, torch.tensor([0, 1, 2], dtype=torch.int32), seq - 1, decode_query_len=1,
                       num_decodes=2, slot_mapping=torch.tensor([299, 128 * 5], dtype=torch.int32))
    assert ran == []
    assert md.decode.page16_block_table.tolist() == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert md.page16_slot_mapping.tolist() == [299 + 2 * 128, 128 * 10]  # slot + its block's first slot


def test_a_table_past_the_host_rebase_bound_is_rebased_by_torch_ops():
    """A block table of more ids than _HOST_REBASE_IDS (as wide as the contexts: nothing trimmed):
    its page-16 tables (the decodes' and the prefill's rows) and the prefill's rows come from
    torch ops, not the host's numpy; each equals the reference's rebase, for a mixed step and the
    next step of the same shape with other ids."""
    from msa_iree.runtime import MetadataBuilder
    from msa_iree.runtime.metadata import _HOST_REBASE_IDS

    cols = _HOST_REBASE_IDS // 2 + 1  # 3 requests: past the bound
    builder = MetadataBuilder(max_num_seqs=3, max_model_len=cols * 128)
    seq = torch.tensor([cols * 128, 300, 5], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 7], dtype=torch.int32)
    for base in (0, 7):
        bt = (torch.arange(3 * cols, dtype=torch.int32) * 3 + base).reshape(3, cols)
        md = builder.build(bt, seq, qsl, seq - (qsl[1:] - qsl[:-1]), 1, 2)
        page16 = R.rebase_block_table_to_page16(bt)
        assert torch.equal(md.decode.page16_block_table, page16[:2]), base
        assert torch.equal(md.prefill.page16_block_table, page16[2:]), base
        assert torch.equal(md.prefill.block_table, bt[2:]), base


@pytest.mark.parametrize("b, cols, n_slots, slot_bytes, used", [
    (1, 1, 0, 0, 1), (3, 8, 7, 8, 8), (4, 8, 5, 8, 2), (64, 32, 64, 4, 32), (2, 5, 3, 4, 0), (2, 5, 3, 8, 5)])
def test_the_driver_copies_land_in_disjoint_aligned_views_inside_the_host_buffer(b, cols, n_slots, slot_bytes, used):
    """Where a CUDA builder's driver copies write (`_CopiedInputs`; the copies themselves run on a
    GPU only): each target inside a host buffer of `size` values, no two overlapping, an int64
    slot 8-byte aligned, and each view the checks read at its copy's address, in its dtype and shape."""
    from msa_iree.runtime.metadata import _CopiedInputs

    builder = type("Buffers", (), {})()
    builder._host_inputs = torch.zeros(_CopiedInputs.size(b, cols, n_slots, slot_bytes), dtype=torch.int32)
    builder._inputs = torch.zeros(b * cols, dtype=torch.int32)
    inputs = _CopiedInputs(builder, b, cols, n_slots, slot_bytes, used)
    base, end = builder._host_inputs.data_ptr(), builder._host_inputs.data_ptr() + 4 * builder._host_inputs.numel()
    targets = sorted([(inputs.qsl_at, 4 * (b + 1)), (inputs.seq_at, 4 * b), (inputs.computed_at, 4 * b),
                      (inputs.slots_at, n_slots * slot_bytes), (inputs.table_at, 4 * b * used)])
    assert base <= targets[0][0] and targets[-1][0] + targets[-1][1] <= end
    for (at, n), (next_at, _) in zip(targets, targets[1:]):
        assert at + n <= next_at, targets
    assert (inputs.slots_at - base) % 8 == 0 or slot_bytes != 8
    assert inputs.small.ctypes.data == inputs.qsl_at and inputs.small.shape == (3 * b + 1,)
    assert inputs.slots.shape == (n_slots,) and (not n_slots or inputs.slots.ctypes.data == inputs.slots_at)
    assert inputs.slots.dtype == (np.int64 if slot_bytes == 8 else np.int32)
    assert inputs.block_table.shape == (b, used) and (not used or inputs.block_table.ctypes.data == inputs.table_at)
    assert (inputs.trimmed, inputs.row_bytes, inputs.pitch, inputs.table_bytes) == (used < cols, 4 * used, 4 * cols,
                                                                                     4 * b * cols)


@pytest.mark.parametrize("b, cols, n_slots, slot_bytes", [(1, 1, 0, 0), (5, 7, 3, 8), (64, 1024, 64, 8),
                                                         (128, 1024, 4096, 4)])
def test_a_device_checks_views_fit_the_builders_buffers(b, cols, n_slots, slot_bytes):
    """Where a CUDA builder's device check of a long table (`_DeviceCheck`; its graph runs on a
    GPU only) reads and writes: in a builder whose input buffer holds just the driver copies'
    values (as an earlier step shape with many slots can leave it), the block table, extremes,
    seq_lens and mask inside the input buffer, disjoint, in their dtypes and shapes, the table at
    the buffer's start (where the kernels read it), the page-16 table at the derived buffer's."""
    from msa_iree.runtime import MetadataBuilder
    from msa_iree.runtime.metadata import _CopiedInputs, _DeviceCheck

    builder = MetadataBuilder(max_num_seqs=b, max_model_len=cols * 128, max_num_tokens=1)
    builder._allocate_inputs(_CopiedInputs.size(b, cols, n_slots, slot_bytes))
    builder._copied_inputs(b, cols, n_slots, slot_bytes, cols)
    views = _DeviceCheck.regions(builder._inputs, builder._derived, b, cols)
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views[:4])
    base = builder._inputs.data_ptr()
    assert spans[0][0] == base == views[0].data_ptr()
    assert spans[-1][1] <= base + 4 * builder._inputs.numel()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), spans
    assert [(tuple(v.shape), v.dtype) for v in views] == [
        ((b, cols), torch.int32), ((2,), torch.int32), ((b,), torch.int32), ((b, cols), torch.bool),
        ((b, cols), torch.int32)]
    assert views[4].data_ptr() == builder._derived.data_ptr()


def test_a_step_of_the_same_shape_lands_at_the_same_addresses():
    """What a captured graph and a bound launch read: the next step's values (new tensors, same
    shapes) in the same memory; a mixed step (decodes, then a prefill). (The host's portable KV
    writer takes a compacted token list of its own each step: not compared.)"""
    from msa_iree.runtime import MetadataBuilder

    builder = MetadataBuilder(max_num_seqs=3, max_model_len=1024)

    def step(base, prefix):
        bt = torch.arange(base, base + 24, dtype=torch.int32).reshape(3, 8)
        seq = torch.tensor([300, 129, prefix + 5], dtype=torch.int32)
        qsl = torch.tensor([0, 1, 2, 7], dtype=torch.int32)
        slots = torch.tensor([base * 128 + 299, base * 128 + 128, -1, 5, 6, 7, 8], dtype=torch.int64)
        return builder.build(bt, seq, qsl, seq - (qsl[1:] - qsl[:-1]), 1, 2, slot_mapping=slots)

    def tensors(md):
        p = md.prefill
        return [md.decode.block_table, md.decode.seq_lens, md.decode.page16_block_table, md.slot_mapping,
                md.page16_slot_mapping, p.block_table, p.page16_block_table, p.cu_seqlens_q, p.context_lens,
                p.query_req_id, p.query_abs_pos, md.token_req_id, md.token_abs_pos, md.query_tiles]

    one = step(0, 100)
    addresses = [t.data_ptr() for t in tensors(one)]
    # every one 64-byte aligned: the compiled kernels take their operands aligned
    assert [a % 64 for a in addresses] == [0] * len(addresses)
    two = step(30, 200)
    assert [t.data_ptr() for t in tensors(two)] == addresses
    assert two.decode.block_table[0].tolist() == list(range(30, 38))
    assert two.prefill.page16_block_table.tolist() == [list(range(92, 108, 2))]  # block ids 46..53, doubled
    assert two.slot_mapping.tolist() == [30 * 128 + 299, 30 * 128 + 128, -1, 5, 6, 7, 8]
    assert two.page16_slot_mapping.tolist()[:3] == [30 * 128 + 299 + 32 * 128, 30 * 128 + 128 + 31 * 128, -1]
    assert two.prefill.query_abs_pos.tolist() == [200, 201, 202, 203, 204]
    assert two.prefill.context_lens.tolist() == [200] and two.prefill.cu_seqlens_q.tolist() == [0, 5]
    assert two.prefill.block_table.tolist() == [list(range(46, 54))] and two.prefill.seq_lens.tolist() == [205]
    assert two.prefill.query_req_id.tolist() == [0] * 5
    # every token's request in the step and position: two decodes, then the prefill's five
    assert two.token_req_id.tolist() == [0, 1, 2, 2, 2, 2, 2]
    assert two.token_abs_pos.tolist() == [299, 128, 200, 201, 202, 203, 204]
    assert two.query_tiles.tolist() == [0, 1, 2]  # a tile per decode, the prefill's 5 tokens in one


def test_the_builder_tiles_a_steps_queries_by_request():
    """MsaMetadata.query_tiles (the GPU indexer's tiled launch): each request's tokens in tiles of
    64 from its first, the last one shorter; none for a request of no tokens; a decode-only step
    has none. Two decodes of L = 2, then prefills of 1, 7, 8, 9, 0 and 70 tokens; two decodes of
    L = 70 (two tiles each) and a prefill."""
    from msa_iree.runtime import MetadataBuilder

    q_lens = torch.tensor([2, 2, 1, 7, 8, 9, 0, 70], dtype=torch.int32)
    computed = torch.tensor([10, 20, 0, 5, 100, 128, 3, 120], dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).int()])  # 0 2 4 5 12 20 29 29 99
    table = torch.arange(8 * 32, dtype=torch.int32).view(8, 32)
    builder = MetadataBuilder(8, 4096)
    md = builder.build(table, computed + q_lens, qsl, computed, 2, 2)
    assert md.query_tiles.tolist() == [0, 2, 4, 5, 12, 20, 29, 93]
    # every token in exactly one tile, a tile's tokens of one request
    first = md.query_tiles.tolist() + [int(qsl[-1])]
    for a, b in zip(first, first[1:]):
        assert 0 < b - a <= 64 and md.token_req_id[a:b].unique().numel() == 1
    assert builder.build(table[:2], computed[:2] + 2, qsl[:3], computed[:2], 2, 2).query_tiles is None
    # decodes of more tokens than a tile (L = 70: two tiles each), then a prefill of 5 tokens
    long = builder.build(table[:3], torch.tensor([100, 200, 5], dtype=torch.int32),
                         torch.tensor([0, 70, 140, 145], dtype=torch.int32), torch.tensor([30, 130, 0], dtype=torch.int32),
                         70, 2)
    assert long.query_tiles.tolist() == [0, 64, 70, 134, 140]
    assert long.token_abs_pos[138:].tolist() == [198, 199, 0, 1, 2, 3, 4]


def test_on_demand_compilation_says_so_only_when_it_compiles(tmp_path, monkeypatch):
    from msa_iree import ops as K
    from msa_iree.config import MsaConfig

    monkeypatch.setenv("MSA_IREE_CACHE", str(tmp_path / "cache"))
    said = []
    spec = K.RebaseSlotsSpec(MsaConfig())
    KernelLibrary("host", compile_missing=True, log=said.append).function(spec)
    assert len(said) == 1 and said[0].startswith(f"msa-iree: compiling {spec.name} for host on demand")
    KernelLibrary("host", compile_missing=True, log=said.append).function(spec)  # a cache hit
    assert len(said) == 1


def test_an_fp8_hardware_kernel_on_an_older_gpu_is_refused_by_name(monkeypatch):
    """The e4m3fn mma attend is built for sm_89: on a compute-capability-8.0 GPU the library must
    say so (kernel, wanted and actual capability) instead of surfacing the driver's JIT error."""
    import types

    from msa_iree.config import MsaConfig
    from msa_iree.ops import SparseAttnDecodeMmaSpec

    lib = types.SimpleNamespace(target="cuda", driver="cuda")
    fp8 = SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype="fp8_e4m3fn"), 16)
    bf16 = SparseAttnDecodeMmaSpec(MsaConfig(kv_dtype="bf16"), 16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(RuntimeError, match=r"sparse_attn_decode_mma.*>= 8\.9.*got 8\.0"):
        KernelLibrary._check_arch(lib, fp8)
    KernelLibrary._check_arch(lib, bf16)  # built for sm_80: loads anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    KernelLibrary._check_arch(lib, fp8)


def test_a_step_past_the_builders_sizes_and_many_step_shapes_keep_their_values():
    """A step with more tokens than max_num_tokens reallocates the buffers; more step shapes than
    the builder keeps views for evict the oldest: each step's tensors still hold its own values."""
    from msa_iree.runtime import MetadataBuilder

    builder = MetadataBuilder(max_num_seqs=2, max_model_len=1024, max_num_tokens=2)
    bt = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]], dtype=torch.int32)
    for chunk in range(1, 21):  # a decode, then a prefill chunk of 1..20 tokens: 20 step shapes
        seq = torch.tensor([700, 500 + chunk], dtype=torch.int32)
        qsl = torch.tensor([0, 1, 1 + chunk], dtype=torch.int32)
        slots = torch.arange(1 + chunk, dtype=torch.int32) + 128 * 3
        md = builder.build(bt, seq, qsl, seq - (qsl[1:] - qsl[:-1]), 1, 1, slot_mapping=slots)
        assert md.num_actual_tokens == 1 + chunk
        assert md.prefill.query_abs_pos.tolist() == list(range(500, 500 + chunk))
        assert md.prefill.page16_block_table.tolist() == [list(range(22, 38, 2))]
        assert md.slot_mapping.tolist() == slots.tolist()
        assert md.page16_slot_mapping.tolist() == (slots + 128 * 3).tolist()
    again = builder.build(bt, torch.tensor([700, 501], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
                          torch.tensor([699, 500], dtype=torch.int32), 1, 1)
    assert again.prefill.query_abs_pos.tolist() == [500] and again.slot_mapping.tolist() == [-1, -1]


def test_portable_calls_split_a_step_so_that_each_gathers_a_bounded_amount(host_kernels, monkeypatch):
    """With a gather budget of 3 MiB (an attend row gathers 2 MiB, a top-k token 64 KiB a
    column), the portable attend runs a call a prefill row and a call a decode request (its 4
    rows together), and the indexer's top-k 16 tokens a call over a 3-column table: the step's
    outputs are still the reference's."""
    import collections

    from msa_iree.ops import portable
    from msa_iree.runtime import Indexer

    monkeypatch.setattr(portable, "GATHER_BYTES_PER_CALL", 3 << 20)
    calls = collections.Counter()
    run = host_kernels.run
    monkeypatch.setattr(host_kernels, "run", lambda spec, *a, **kw: calls.update([spec.kernel]) or run(spec, *a, **kw))

    gen = torch.Generator().manual_seed(31)
    scales = torch.tensor([0.05]), torch.tensor([0.04])
    kc, vc = allocate_kv_cache(12, 1, FNUZ, "interleaved", fill=0)
    index_cache = torch.randn(12, 128, 128, generator=gen).to(BF16)
    table = torch.randperm(12, generator=gen)[:12].int().view(4, 3)
    everything = torch.arange(12 * 128)
    R.insert_kv(*(torch.randn(12 * 128, 1, 128, generator=gen).to(BF16) for _ in range(2)), kc, vc, everything,
                *scales)
    # two decodes of 4 tokens (seq_len 300, 129), then prefills of 5 tokens from 0 and 9 from 250
    seq = torch.tensor([300, 129, 5, 259], dtype=torch.int32)
    qlens = torch.tensor([4, 4, 5, 9], dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), qlens.cumsum(0).int()])
    req = torch.repeat_interleave(torch.arange(4), qlens).int()
    pos = torch.cat([torch.arange(s - q, s) for s, q in zip(seq.tolist(), qlens.tolist())]).int()
    md = MetadataBuilder(4, 384, num_cache_blocks=12, kernels=host_kernels).build(table, seq, qsl, seq - qlens, 4, 2)
    n = int(qsl[-1])
    q = torch.randn(n, 16, 128, generator=gen).to(BF16)
    index_q = torch.randn(n, 1, 128, generator=gen).to(BF16)

    topk = Indexer(1, BF16, kernels=host_kernels).topk(index_q, index_cache, md)
    assert torch.equal(topk, R.index_topk(index_q, index_cache, table, req, pos))
    attn = SparseAttention(16, 1, 128, 128 ** -0.5, FNUZ, kernels=host_kernels)
    out = attn.forward(q, kc, vc, torch.full_like(q, float("nan")), topk, md, *scales)
    sbt, sctx = R.build_sparse_block_table_prefill(topk, table, req, pos, 16)
    by_table = attn.forward(q, kc, vc, torch.full_like(q, float("nan")), topk, md, *scales,
                            sparse_block_table=sbt, sparse_context_lens=sctx)
    ref = torch.empty_like(q)
    R.sparse_attn_prefill(q, kc, vc, topk, table, req, pos, 1, 128 ** -0.5, ref, *scales)
    assert_attend_close(out, ref, "split calls")
    assert_attend_close(by_table, ref, "split calls over the table")
    assert (calls["index_topk"], calls["sparse_attn_decode"], calls["sparse_attn_prefill"],
            calls["sparse_paged_attend"]) == (2, 2, 14, 22)


# ---- a bound step (the GPU fast path's serve-or-refuse decision, with stand-in launches) --------

class _RecordingKernel:
    """A stream kernel's stand-in: its bound launch records (name, stream, addresses) in `log`;
    `bound` keeps the tensors it was bound with."""

    def __init__(self, name, log):
        self.name, self.log, self.bound = name, log, None

    def bind(self, args, variable):
        self.bound = args
        return lambda stream, *addresses: self.log.append((self.name, stream, addresses))


def _bound_step(monkeypatch, metadata, query, topk, output, caches, num_blocks, key=None, value=None):
    """A _StepLaunch bound as forward binds one after its checked call: the step's attend (query
    rows, caches, top-k rows, step tensors, ...) as the GPU attend takes them; `log` the launches."""
    from types import SimpleNamespace

    from msa_iree.runtime import attention

    monkeypatch.setattr(attention, "_current_raw_stream", lambda index: 7)
    log = []
    kernels = SimpleNamespace(stream_launch=True, stream_kernel=lambda spec: _RecordingKernel(spec, log))
    n = metadata.num_actual_tokens
    if metadata.prefill is None:  # the decode attend
        d = metadata.decode
        args = (query[:n], *caches, topk[:, :n], d.block_table, d.seq_lens)
        args += (None,) * 3 + ((key[:n], value[:n], metadata.slot_mapping[:n]) if key is not None else ())
        launched = ("decode", args, output[:n], None, {4: d.block_table, 5: d.seq_lens})
    else:  # with prefills: the prefill attend over every row
        m = metadata
        args = (query[:n], *caches, topk[:, :n], m.block_table, m.token_req_id, m.token_abs_pos)
        launched = ("prefill", args, output[:n], None, {4: m.block_table, 5: m.token_req_id, 6: m.token_abs_pos})
    layer = SimpleNamespace(num_blocks=num_blocks, refresh=())
    bound = attention._StepLaunch.bind(kernels, metadata, layer, (*caches, None, None), (query, topk, output),
                                       launched, new_kv=(key, value))
    return bound, log


def _steps(num_decodes, tokens):
    """Steps of one shape: requests of seq_len 300, 129 and 205, the first `num_decodes` decoding
    one token each, the next a prefill of the rest of `tokens`; step(base) gives request r the
    cache blocks from base + 8r, so that its requests reference blocks base..base + 2,
    base + 8..base + 9 and base + 16..base + 17."""
    builder = MetadataBuilder(max_num_seqs=3, max_model_len=1024)
    qlens = [1] * num_decodes + ([tokens - num_decodes] if tokens > num_decodes else [])
    qsl = torch.tensor([0, *np.cumsum(qlens)], dtype=torch.int32)
    seq = torch.tensor([300, 129, 205][:len(qlens)], dtype=torch.int32)

    def step(base):
        bt = torch.arange(base, base + 8 * len(qlens), dtype=torch.int32).reshape(len(qlens), 8)
        slots = torch.arange(base * 128, base * 128 + tokens, dtype=torch.int64)
        return builder.build(bt, seq, qsl, seq - (qsl[1:] - qsl[:-1]), 1, num_decodes, slot_mapping=slots)
    return step


def test_a_bound_mixed_step_launches_one_attend_over_every_row_and_refuses_every_other_call(monkeypatch):
    """Two decodes then a 5-token prefill: one launch of the prefill attend over all 7 rows, at the
    call tensors' first rows; anything the binding was not made for is refused with nothing
    launched."""
    step = _steps(2, 7)
    md = step(0)
    assert (step(46).max_block_id, step(47).max_block_id) == (63, 64)  # request 2's blocks 62, 63 / 63, 64
    q, topk = torch.zeros(7, 16, 128, dtype=BF16), torch.zeros(1, 7, 16, dtype=torch.int32)
    out = torch.zeros_like(q)
    caches = torch.zeros(64 * 16, 128, dtype=BF16), torch.zeros(64 * 16, 128, dtype=BF16)
    bound, log = _bound_step(monkeypatch, md, q, topk, out, caches, num_blocks=64)

    q2, out2 = torch.zeros_like(q), torch.zeros_like(q)  # the next layer's query and output
    assert bound(step(46), q2, *caches, out2, topk, None, None)  # blocks up to 63: in the cache
    qa, ta, oa = q2.data_ptr(), topk.data_ptr(), out2.data_ptr()
    assert log == [("prefill", 7, (qa, ta, oa))]

    log.clear()
    k = torch.zeros(7, 1, 128, dtype=BF16)
    refused = {
        "block 64 in a cache of 64": (step(47), q, *caches, out, topk, None, None),
        "key and value (an insert) on a binding that does not insert": (md, q, *caches, out, topk, None, None, k, k),
        "a step of another shape": (_steps(1, 7)(0), q, *caches, out, topk, None, None),
        "another k_cache": (md, q, caches[0].clone(), caches[1], out, topk, None, None),
        "a scale the binding was not made with": (md, q, *caches, out, topk, torch.ones(1), None),
        "a query of 8 rows": (md, torch.zeros(8, 16, 128, dtype=BF16), *caches, out, topk, None, None),
        "an fp16 query": (md, q.half(), *caches, out.half(), topk, None, None),
        "an int64 top-k": (md, q, *caches, out, topk.long(), None, None),
        "a strided output": (md, q, *caches, torch.zeros(16, 7, 128, dtype=BF16).transpose(0, 1), topk, None, None),
    }
    for what, call in refused.items():
        assert not bound(*call), what
    assert log == []


@pytest.mark.parametrize("L", [1, 4])
def test_a_step_with_prefills_is_one_gpu_launch_whose_rows_are_the_phases_rows(L):
    """On the GPU attend a step with prefills is one launch of the prefill attend over every row,
    reading the metadata's block table, token_req_id and token_abs_pos: with the kernels stood in
    by a recorder, forward launches it once with those tensors, and the sparse page table they
    give (reference.build_sparse_block_table_prefill) is, row for row, the decode phase's
    (reference.build_sparse_block_table_decode: L tokens a request at seq_len - L + i) followed by
    the prefill phase's."""
    from types import SimpleNamespace

    from msa_iree.ops import GPU_ATTEND

    log = []
    kernels = SimpleNamespace(target="cuda", stream_launch=False, zero_copy=False, to_iree=lambda t: t,
                              unit_scale=lambda h, device: torch.ones(h, 1),
                              workspace=lambda floats, device: torch.zeros(floats),
                              run=lambda spec, *args, out: log.append((spec, args)))
    attn = SparseAttention(16, 1, 128, 128 ** -0.5, BF16, kernels=kernels)
    builder = MetadataBuilder(max_num_seqs=3, max_model_len=1024)
    # two decode requests of L tokens (seq_len 300, 129: one crossing into a new block), then a
    # 70-token chunk of a request at 200..269 (crossing block 1 into block 2)
    qsl = torch.tensor([0, L, 2 * L, 2 * L + 70], dtype=torch.int32)
    seq = torch.tensor([300, 129, 270], dtype=torch.int32)
    bt = torch.arange(3 * 4, dtype=torch.int32).reshape(3, 4) * 3 % 13
    md = builder.build(bt, seq, qsl, seq - (qsl[1:] - qsl[:-1]), L, 2)
    n, nd = md.num_actual_tokens, md.num_decode_tokens
    g = torch.Generator().manual_seed(L)
    topk = torch.stack([torch.randperm(4, generator=g)[:3] for _ in range(n)]).int()
    topk = torch.cat([topk, torch.full((n, 13), -1, dtype=torch.int32)], 1)[None]  # [1, n, 16]
    k, v = allocate_kv_cache(13, 1, BF16, fill=0)
    q = torch.zeros(n, 16, 128, dtype=BF16)
    attn.forward(q, k, v, torch.empty_like(q), topk, md)

    ((spec, args),) = log
    assert spec == attn._spec(GPU_ATTEND["mma", "cuda"][1], 16)  # the prefill attend, once
    assert args[3] is topk and all(a is b for a, b in zip(args[4:7], (md.block_table, md.token_req_id,
                                                                          md.token_abs_pos)))
    whole = R.build_sparse_block_table_prefill(topk, md.block_table, md.token_req_id, md.token_abs_pos, 16)
    d, p = md.decode, md.prefill
    phases = [R.build_sparse_block_table_decode(topk[:, :nd], d.block_table, d.seq_lens, L, 16),
              R.build_sparse_block_table_prefill(topk[:, nd:], p.block_table, p.query_req_id, p.query_abs_pos, 16)]
    assert torch.equal(whole[0], torch.cat([phases[0][0], phases[1][0]]))
    assert torch.equal(whole[1], torch.cat([phases[0][1], phases[1][1]]))
    assert (whole[1][:nd] > 0).sum() >= nd - 1 and (whole[1][nd:] > 0).any()  # (the tables are not empty)


def test_a_step_with_prefills_inserts_its_new_kv_in_its_one_launch():
    """forward(key=, value=) on a step with prefills, the attends launched on the stream: no
    insert launch of its own; the one launch is the prefill attend's inserting variant (its
    insert workgroups first, templates/sparse_attend.mlir.j2) over every row, the step's key,
    value and slot rows its last operands. Kernels without that variant insert first."""
    from types import SimpleNamespace

    from msa_iree.ops import GPU_ATTEND

    for inserting in (True, False):
        log = []
        kernels = SimpleNamespace(target="cuda", stream_launch=True, zero_copy=False, to_iree=lambda t: t,
                                  unit_scale=lambda h, device: torch.ones(h, 1), stream_kernel=lambda spec: None,
                                  workspace=lambda floats, device: torch.zeros(floats),
                                  run=lambda spec, *args, out: log.append((spec, args)))
        attn = SparseAttention(16, 1, 128, 128 ** -0.5, BF16, kernels=kernels)
        assert attn.fuses_insert
        attn.insert_kv = lambda *a, **kw: log.append(("insert_kv", a))  # an insert launch of its own, if any
        if not inserting:  # (the GPU attends of a family without the variant)
            attn.fuses_insert = False
        builder = MetadataBuilder(max_num_seqs=2, max_model_len=1024, num_cache_blocks=13)
        qsl = torch.tensor([0, 1, 71], dtype=torch.int32)
        seq = torch.tensor([300, 270], dtype=torch.int32)
        bt = torch.tensor([[3, 5, 7, 0], [1, 2, 4, 6]], dtype=torch.int32)
        slots = torch.cat([torch.tensor([7 * 128 + 299 - 256]), 4 * 128 + torch.arange(200, 270) - 256]).int()
        md = builder.build(bt, seq, qsl, seq - (qsl[1:] - qsl[:-1]), 1, 1, slot_mapping=slots)
        n = md.num_actual_tokens
        topk = torch.full((1, n, 16), -1, dtype=torch.int32)
        k, v = allocate_kv_cache(13, 1, BF16, fill=0)
        q = torch.zeros(n, 16, 128, dtype=BF16)
        key, value = torch.ones(n, 1, 128, dtype=BF16), torch.ones(n, 1, 128, dtype=BF16)
        attn.forward(q, k, v, torch.empty_like(q), topk, md, key=key, value=value)
        prefill = GPU_ATTEND["mma", "cuda"][1]
        if inserting:
            assert [entry[0] for entry in log] == [attn._spec(GPU_ATTEND["mma", "cuda"][1], 16, insert=True)]
            ((spec, args),) = log
            assert spec == attn._spec(prefill, 16, insert=True) and spec.insert_kv and spec.prefill
            assert args[-3] is key and args[-2] is value and args[-1] is md.slot_mapping
            assert all(a is b for a, b in zip(args[4:7], (md.block_table, md.token_req_id, md.token_abs_pos)))
        else:
            (insert, _), (spec, args) = log
            assert insert == "insert_kv" and spec == attn._spec(prefill, 16) and not spec.insert_kv
            assert len(args) == 10  # the attend alone: no key, value or slots


def test_a_bound_inserting_step_serves_only_calls_that_bring_its_key_and_value(monkeypatch):
    """A decode-only step whose attend inserts: the key and value rows launched beside the query's;
    a call without them, of another dtype, or writing a slot past the cache is refused."""
    step = _steps(3, 3)
    md = step(0)
    assert (step(46).max_block_id, step(47).max_block_id, step(46).max_slot) == (63, 64, 46 * 128 + 2)
    q, topk = torch.zeros(3, 16, 128, dtype=BF16), torch.zeros(1, 3, 16, dtype=torch.int32)
    out = torch.zeros_like(q)
    k, v = torch.zeros(3, 1, 128, dtype=BF16), torch.zeros(3, 1, 128, dtype=BF16)
    caches = torch.zeros(64 * 16, 128, dtype=BF16), torch.zeros(64 * 16, 128, dtype=BF16)
    bound, log = _bound_step(monkeypatch, md, q, topk, out, caches, num_blocks=64, key=k, value=v)

    assert bound(step(46), q, *caches, out, topk, None, None, k, v)  # blocks up to 63, slots 46 * 128 + 0..2
    assert log == [("decode", 7, (q.data_ptr(), topk.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()))]

    log.clear()
    past = step(46)
    past.max_slot = 64 * 128  # the first slot past the cache (the step's blocks in it)
    refused = {
        "no key and value": (md, q, *caches, out, topk, None, None),
        "a key without its value": (md, q, *caches, out, topk, None, None, k, None),
        "an fp16 key and value": (md, q, *caches, out, topk, None, None, k.half(), v.half()),
        "a key of 4 rows": (md, q, *caches, out, topk, None, None, torch.zeros(4, 1, 128, dtype=BF16), v),
        "a slot past the cache": (past, q, *caches, out, topk, None, None, k, v),
        "block 64 in a cache of 64": (step(47), q, *caches, out, topk, None, None, k, v),
    }
    for what, call in refused.items():
        assert not bound(*call), what
    assert log == []


def test_a_bound_insert_serves_its_steps_and_sees_a_strided_scale_changed_in_place(monkeypatch):
    """_InsertLaunch: served for a step of its shape with the same caches and scales (key and value
    launched at their addresses, a scale expanded over the KV heads refreshed into its contiguous
    copy first); refused, with nothing launched, for a slot past the cache and for what it was not
    made with."""
    from types import SimpleNamespace

    from msa_iree.runtime import kv_insert

    monkeypatch.setattr(kv_insert, "_current_raw_stream", lambda index: 7)
    log = []
    kernel = _RecordingKernel("insert", log)
    kernels = SimpleNamespace(stream_launch=True, stream_kernel=lambda spec: kernel)
    step = _steps(3, 3)
    md = step(0)
    k, v = torch.zeros(3, 2, 128, dtype=BF16), torch.zeros(3, 2, 128, dtype=BF16)
    caches = torch.zeros(64 * 16, 256, dtype=BF16), torch.zeros(64 * 16, 256, dtype=BF16)
    k_scale = torch.full((1, 1), 0.5)
    ks = k_scale.expand(2, 1)  # one scale over both KV heads: a stride-0 view
    operands = [caches[0], k, v, md.insert_token_index, md.insert_slots, ks, torch.ones(2, 1)]
    bound = kv_insert._InsertLaunch.bind(kernels, "insert", md, (*caches, k_scale, None), operands, 64 * 128)

    k_scale.fill_(0.25)
    assert bound(step(46), k, v, *caches, k_scale, None)
    assert log == [("insert", 7, (k.data_ptr(), v.data_ptr()))]
    assert kernel.bound[5].stride() == (1, 1) and kernel.bound[5].flatten().tolist() == [0.25, 0.25]

    log.clear()
    past = step(46)
    past.max_slot = 64 * 128
    refused = {
        "a slot past the cache": (past, k, v, *caches, k_scale, None),
        "slots of no step (a tensor)": (md.slot_mapping, k, v, *caches, k_scale, None),
        "another v_cache": (md, k, v, caches[0], caches[1].clone(), k_scale, None),
        "another k_scale": (md, k, v, *caches, k_scale.clone(), None),
        "a key of 4 rows": (md, torch.zeros(4, 2, 128, dtype=BF16), v, *caches, k_scale, None),
        "an fp16 value": (md, k, v.half(), *caches, k_scale, None),
        "a strided key": (md, torch.zeros(2, 3, 128, dtype=BF16).transpose(0, 1), v, *caches, k_scale, None),
    }
    for what, call in refused.items():
        assert not bound(*call), what
    assert log == []


def test_a_table_the_indexer_emitted_for_the_step_is_not_checked_again_while_unchanged(host_kernels, monkeypatch,
                                                                                     page_table_checks):
    """A page table msa-iree's Indexer emitted through the step's metadata (topk_with_table,
    emit_table) is valid by construction: the attend takes it without its per-call check (a host
    sync), and attends as the reference does. Written to since, another step's, or built
    elsewhere, the attend checks it (and refuses an id past the cache)."""
    from msa_iree.runtime import Indexer

    checked = page_table_checks
    gen = torch.Generator().manual_seed(32)
    scales = torch.tensor([0.05]), torch.tensor([0.04])
    kc, vc = allocate_kv_cache(8, 1, FNUZ, "interleaved", fill=0)
    R.insert_kv(*(torch.randn(8 * 128, 1, 128, generator=gen).to(BF16) for _ in range(2)), kc, vc,
                torch.arange(8 * 128), *scales)
    index_cache = torch.randn(8, 128, 128, generator=gen).to(BF16)
    # a decode at position 299 (blocks 5, 2, 7), then a 3-token prefill at positions 127..129 (blocks 1, 4)
    table = torch.tensor([[5, 2, 7], [1, 4, -1]], dtype=torch.int32)
    seq, qlens = torch.tensor([300, 130], dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
    req, pos = torch.tensor([0, 1, 1, 1], dtype=torch.int32), torch.tensor([299, 127, 128, 129], dtype=torch.int32)
    builder = MetadataBuilder(2, 384, num_cache_blocks=8, kernels=host_kernels)
    md = builder.build(table, seq, qsl, seq - qlens, 1, 1)
    q = torch.randn(4, 16, 128, generator=gen).to(BF16)
    index_q = torch.randn(4, 1, 128, generator=gen).to(BF16)
    indexer = Indexer(1, BF16, kernels=host_kernels)
    attn = SparseAttention(16, 1, 128, 128 ** -0.5, FNUZ, kernels=host_kernels)

    def attend(metadata, sbt, sctx):
        return attn.forward(q, kc, vc, torch.full_like(q, float("nan")), topk, metadata, *scales,
                            sparse_block_table=sbt, sparse_context_lens=sctx)

    topk, sbt, sctx = indexer.topk_with_table(index_q, index_cache, md, md)
    ref = torch.empty_like(q)
    R.sparse_attn_prefill(q, kc, vc, topk, table, req, pos, 1, 128 ** -0.5, ref, *scales)
    assert_attend_close(attend(md, sbt, sctx), ref, "the emitted table")
    assert_attend_close(attend(md, *indexer.emit_table(topk, md)), ref, "emit_table's")
    assert checked == []

    by_hand = R.build_sparse_block_table_prefill(topk, table, req, pos, 16)
    other_step = builder.build(table, seq, qsl, seq - qlens, 1, 1)
    assert_attend_close(attend(md, *by_hand), ref, "a table built elsewhere")
    assert_attend_close(attend(other_step, sbt, sctx), ref, "the emitted table with another step's metadata")
    assert checked == [1, 1]

    sbt[0, 0] = 8 * 16  # the first page past the cache (8 blocks of 16 pages, one KV head)
    with pytest.raises(IndexError, match="out of range"):
        attend(md, sbt, sctx)
    assert checked == [1, 1, 1]

    # an emitted table's tensors freed, and a new tensor at its address (as an allocator reuses
    # memory) with as many torch writes as the emission made (one copy each): checked
    bt_memory, ctx_memory = np.zeros((4, 1, 128), np.int32), np.zeros((4, 1), np.int32)
    recorded = []
    record = md._record_emitted_table
    monkeypatch.setattr(md, "_record_emitted_table", lambda bt, ctx: recorded.append(bt.data_ptr()) or record(bt, ctx))
    _, sbt, sctx = indexer.topk_with_table(index_q, index_cache, md, md,
                                           table_out=(torch.from_numpy(bt_memory), torch.from_numpy(ctx_memory)))
    assert recorded == [bt_memory.ctypes.data]  # the caller's buffers alone, not the portable kernel's own table
    assert_attend_close(attend(md, sbt, sctx), ref, "the table emitted into the caller's buffers")
    assert checked == [1, 1, 1]
    del sbt, sctx
    reused_bt, reused_ctx = torch.from_numpy(bt_memory).view(4, 128), torch.from_numpy(ctx_memory).view(4)
    reused_bt[0, 0] = 8 * 16
    reused_ctx.add_(0)
    with pytest.raises(IndexError, match="out of range"):
        attend(md, reused_bt, reused_ctx)
    assert checked == [1, 1, 1, 1]
