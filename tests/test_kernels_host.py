"""Every compiled kernel, built for the host CPU and run through iree.runtime, against the reference.

Table builders and rebases must be bit-exact; the attend must match within one output rounding
of the reference (both read the same cache bytes); the fp8 writer must produce the bytes torch's
own fp8 cast produces.
"""
import pytest
import tolerances as tol
import torch

from msa_iree import ops as K
from msa_iree.ops import fp8
from msa_iree import layout as L
from msa_iree import reference as R
from msa_iree import testing
from msa_iree.config import MsaConfig, dtype_name
from msa_iree.layout import block_page_stride


def i32(x):
    return torch.tensor(x, dtype=torch.int32)


def test_rebase_kernels_bit_exact(host_kernels):
    g = torch.Generator().manual_seed(0)
    bt = torch.randint(-1, 70000, (5, 33), generator=g, dtype=torch.int32)
    (got,) = host_kernels.run(K.RebaseBlockTableSpec(MsaConfig()), bt, out_dtypes=[torch.int32])
    assert torch.equal(got, R.rebase_block_table_to_page16(bt))
    slots = torch.cat([i32([-1, 0, 127, 128, 129, 255, 256]), torch.randint(-1, 2 ** 24, (100,), generator=g,
                                                                         dtype=torch.int32)])
    (got,) = host_kernels.run(K.RebaseSlotsSpec(MsaConfig()), slots, out_dtypes=[torch.int32])
    assert torch.equal(got, R.rebase_slots_to_page16(slots))
    assert got[:7].tolist() == [-1, 0, 127, 256, 257, 383, 512]


TABLE_CASES = [  # seq_lens, L, kv heads, stride
    ([129, 0], 1, 1, 8),
    ([1, 127, 128, 129, 255, 256, 257, 4097, 0], 1, 1, 16),
    ([260, 132, 0], 4, 1, 8),
    ([4097, 65537 // 8, 1], 2, 2, 16),
]


@pytest.mark.parametrize("seq, L, hkv, stride", TABLE_CASES)
def test_decode_table_kernel_bit_exact(host_kernels, seq, L, hkv, stride):
    c = testing.decode_case(seq, decode_query_len=L, num_kv_heads=hkv, seed=len(seq) + L, keep_own_prob=0.8)
    bt = c.block_table.clamp(min=0)
    spec = K.BuildDecodeTableSpec(MsaConfig(num_kv_heads=hkv, num_heads=16, decode_query_len=L), stride)
    got_bt, got_ctx = host_kernels.run(spec, c.topk, bt, c.seq_lens, out_dtypes=[torch.int32, torch.int32])
    ref_bt, ref_ctx = R.build_sparse_block_table_decode(c.topk, bt, c.seq_lens, L, stride)
    assert torch.equal(got_bt.reshape(ref_bt.shape), ref_bt)
    assert torch.equal(got_ctx.reshape(-1), ref_ctx)


def test_decode_table_kernel_spec_vector(host_kernels):
    topk = i32([[[1, 0, -1] + [-1] * 13, [0, 1, -1] + [-1] * 13]])
    spec = K.BuildDecodeTableSpec(MsaConfig(), 8)
    bt, ctx = host_kernels.run(spec, topk, i32([[5, 7], [11, 13]]), i32([129, 0]), out_dtypes=[torch.int32] * 2)
    assert ctx.reshape(-1).tolist() == [129, 0]
    assert bt.reshape(2, -1)[0, :16].tolist() == list(range(40, 48)) + list(range(56, 64))
    assert bt.reshape(2, -1)[0, 16:].eq(0).all() and bt.reshape(2, -1)[1].eq(0).all()


@pytest.mark.parametrize("qlens, prefix, hkv, stride", [([65, 3, 130], [64, 1024, 3600], 1, 16),
                                                          ([129, 257], [0, 0], 2, 8)])
def test_prefill_table_kernel_bit_exact(host_kernels, qlens, prefix, hkv, stride):
    c = testing.prefill_case(qlens, prefix, num_kv_heads=hkv, seed=3, keep_own_prob=0.8)
    bt = c.block_table.clamp(min=0)
    spec = K.BuildPrefillTableSpec(MsaConfig(num_kv_heads=hkv), stride)
    got_bt, got_ctx = host_kernels.run(spec, c.topk, bt, c.query_req_id, c.query_abs_pos,
                                       out_dtypes=[torch.int32, torch.int32])
    ref_bt, ref_ctx = R.build_sparse_block_table_prefill(c.topk, bt, c.query_req_id, c.query_abs_pos, stride)
    assert torch.equal(got_bt.reshape(ref_bt.shape), ref_bt) and torch.equal(got_ctx.reshape(-1), ref_ctx)


# ---- attend ------------------------------------------------------------------------------------

BF16, F16, FNUZ, FN = torch.bfloat16, torch.float16, torch.float8_e4m3fnuz, torch.float8_e4m3fn


def cfg_for(c, kv_dtype, q_dtype, L=1):
    return MsaConfig(num_heads=c.q.shape[1], num_kv_heads=c.num_kv_heads, kv_dtype=dtype_name(kv_dtype),
                     query_dtype=dtype_name(q_dtype), decode_query_len=L)


def scales2d(s, h):
    from msa_iree.runtime.library import module_scale

    return module_scale(s, h)


def folded(cache):
    return cache.reshape(-1, *cache.shape[2:]).view(fp8.storage_dtype(cache.dtype))


def assert_attend_close(got, ref_out):
    """Same cache bytes, fp32 math in both: differences are summation order plus one output rounding."""
    tol.assert_attend_close(got, ref_out)
    torch.testing.assert_close(got.float(), ref_out.float(), rtol=tol.PORTABLE_RTOL[got.dtype], atol=1e-3)


DECODE = [  # seq_lens, L, heads, kv heads, kv dtype, q dtype, layout, scale mode
    ([1, 127, 128, 129, 0], 1, 16, 1, BF16, BF16, "interleaved", "tensor"),
    ([256, 4097, 0], 1, 8, 1, F16, F16, "planes", "tensor"),
    ([129, 0, 300], 4, 16, 2, BF16, BF16, "interleaved", "tensor"),
    ([4, 4097], 4, 16, 1, FNUZ, BF16, "interleaved", "tensor"),
    ([130, 257, 0], 2, 8, 2, FN, BF16, "planes", "token"),
    ([1, 129, 2000], 3, 16, 1, FNUZ, BF16, "planes", "token"),
]


@pytest.mark.parametrize("seq, L, hq, hkv, kv, qd, layout, smode", DECODE)
def test_decode_attend_kernel(host_kernels, seq, L, hq, hkv, kv, qd, layout, smode):
    c = testing.decode_case(seq, decode_query_len=L, num_heads=hq, num_kv_heads=hkv, kv_dtype=kv, q_dtype=qd,
                            layout=layout, seed=sum(seq) + L, scale_mode=smode)
    ref = torch.full_like(c.q, float("nan"))
    R.sparse_attn_decode(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.seq_lens, hkv, c.scale, ref,
                         c.k_scale, c.v_scale, decode_query_len=L)
    stride = block_page_stride(c.k_cache, c.v_cache)
    spec = K.SparseAttnDecodeSpec(cfg_for(c, kv, qd, L), stride)
    (got,) = host_kernels.run(spec, c.q, folded(c.k_cache), folded(c.v_cache), c.topk, c.block_table.clamp(min=0),
                              c.seq_lens, torch.tensor([c.scale]), scales2d(c.k_scale, hkv), scales2d(c.v_scale, hkv),
                              out_dtypes=[qd])
    active = (c.query_abs_pos >= 0)
    assert_attend_close(got[active], ref[active])
    assert got[~active].eq(0).all()  # padded rows: finite zeros


PREFILL = [
    ([129, 257], [0, 0], 2, BF16, BF16, "interleaved", "tensor"),
    ([65, 3, 130], [64, 1024, 3600], 1, F16, F16, "planes", "tensor"),
    ([40, 17], [127, 4000], 1, FNUZ, BF16, "interleaved", "token"),
    ([33], [200], 1, FN, BF16, "planes", "tensor"),
]


@pytest.mark.parametrize("qlens, prefix, hkv, kv, qd, layout, smode", PREFILL)
def test_prefill_attend_kernel(host_kernels, qlens, prefix, hkv, kv, qd, layout, smode):
    c = testing.prefill_case(qlens, prefix, num_kv_heads=hkv, kv_dtype=kv, q_dtype=qd, layout=layout,
                             seed=sum(qlens), scale_mode=smode)
    ref = torch.full_like(c.q, float("nan"))
    R.sparse_attn_prefill(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.query_req_id, c.query_abs_pos, hkv,
                          c.scale, ref, c.k_scale, c.v_scale)
    spec = K.SparseAttnPrefillSpec(cfg_for(c, kv, qd), block_page_stride(c.k_cache, c.v_cache))
    (got,) = host_kernels.run(spec, c.q, folded(c.k_cache), folded(c.v_cache), c.topk, c.block_table.clamp(min=0),
                              c.query_req_id, c.query_abs_pos, torch.tensor([c.scale]), scales2d(c.k_scale, hkv),
                              scales2d(c.v_scale, hkv), out_dtypes=[qd])
    assert_attend_close(got, ref)


def test_paged_attend_kernel_on_emitted_table(host_kernels):
    c = testing.decode_case([300, 129, 4097], num_kv_heads=2, seed=11)
    bt, ctx = R.build_sparse_block_table_decode(c.topk, c.block_table, c.seq_lens, 1, 16)
    ref = torch.full_like(c.q, float("nan"))
    R.sparse_paged_attend(c.q, c.k_cache, c.v_cache, bt, ctx, 2, c.scale, ref)
    spec = K.SparsePagedAttendSpec(cfg_for(c, BF16, BF16), 16)
    (got,) = host_kernels.run(spec, c.q, folded(c.k_cache), folded(c.v_cache), bt.reshape(3, 2, -1),
                              ctx.reshape(3, 2), torch.tensor([c.scale]), torch.ones(2, 1), torch.ones(2, 1),
                              out_dtypes=[BF16])
    assert_attend_close(got, ref)


def test_attend_kernel_never_reads_past_context(host_kernels):
    """NaN-poison what no row may see: page 0 (the table's filler id) and each tail block past abs_pos."""
    seed = next(s for s in range(100) if 0 not in testing.decode_case([129, 0, 5], seed=s).block_table.tolist()[0]
                + testing.decode_case([129, 0, 5], seed=s).block_table.tolist()[2])
    c = testing.decode_case([129, 0, 5], seed=seed)
    k, v = L.unpack_kv_cache(c.k_cache, c.v_cache)
    nan = float("nan")
    for t in (k, v):
        t[0] = nan                                   # block 0 is unused: only the filler can reach it
        t[int(c.block_table[0, 1]), 1:] = nan        # request 0 sees token 128 = offset 0 of its block 1
        t[int(c.block_table[2, 0]), 5:] = nan        # request 2 sees positions 0..4
    kc, vc = L.pack_kv_cache(k, v, "interleaved")
    spec = K.SparseAttnDecodeSpec(cfg_for(c, BF16, BF16), 16)
    (got,) = host_kernels.run(spec, c.q, folded(kc), folded(vc), c.topk, c.block_table.clamp(min=0),
                              c.seq_lens, torch.tensor([c.scale]), torch.ones(1, 1), torch.ones(1, 1),
                              out_dtypes=[BF16])
    assert not got.isnan().any()
    assert got[0].abs().sum() > 0 and got[1].eq(0).all()


# ---- fp8 codec and insert ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [FNUZ, FN])
def test_fp8_encode_matches_torch_cast(dtype):
    g = torch.Generator().manual_seed(13)
    fmax = torch.finfo(dtype).max
    x = torch.cat([torch.randn(20000, generator=g) * 30, torch.randn(2000, generator=g) * 1e-3,
                   fp8.fp8_decode_table(dtype)[:127].nan_to_num(0),                      # every code exactly
                   fp8.fp8_rounding_midpoints(dtype), -fp8.fp8_rounding_midpoints(dtype),  # ties to even
                   torch.tensor([fmax * 3, -fmax * 3, 0.0])])
    want = x.clamp(-fmax, fmax).to(dtype).view(torch.uint8)
    assert torch.equal(fp8.encode_fp8(x, dtype), want)
    assert torch.equal(fp8.decode_fp8(want, dtype), want.view(dtype).float())


INSERT = [(BF16, BF16, "interleaved", "tensor"), (F16, F16, "planes", "tensor"),
          (FNUZ, BF16, "interleaved", "token"), (FN, BF16, "planes", "tensor"), (FNUZ, BF16, "planes", "tensor")]


@pytest.mark.parametrize("kv, qd, layout, smode", INSERT)
def test_insert_kernel_matches_reference(host_kernels, kv, qd, layout, smode):
    from msa_iree.runtime import insert_kv

    c = testing.decode_case([300, 129], num_kv_heads=2, kv_dtype=kv, layout=layout, seed=14, scale_mode=smode)
    g = torch.Generator().manual_seed(15)
    slots = i32([0, 127, 128, -1, 129, 383, 200, -1])
    key = torch.randn(8, 2, 128, generator=g).to(qd)
    value = torch.randn(8, 2, 128, generator=g).to(qd)
    want_k, want_v = L.pack_kv_cache(*L.unpack_kv_cache(c.k_cache, c.v_cache), layout)  # an independent copy
    R.insert_kv(key, value, want_k, want_v, slots, c.k_scale, c.v_scale)
    insert_kv(host_kernels, key, value, c.k_cache, c.v_cache, slots, c.k_scale, c.v_scale)
    assert torch.equal(c.k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(c.v_cache.view(torch.uint8), want_v.view(torch.uint8))
