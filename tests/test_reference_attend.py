"""The two reference formulations (virtual sequences over SHUFFLE pages vs. the formula of docs/SPEC.md as a mask
over a logical cache) agree; scales, dtypes and bad inputs behave."""
import pytest
import torch

from msa_iree import layout as L
from msa_iree import reference as R
from msa_iree import testing

FP8 = [torch.float8_e4m3fnuz, torch.float8_e4m3fn]


def run_decode(c, **kw):
    out = torch.full_like(c.q, float("nan"))  # poison: every element must be written
    R.sparse_attn_decode(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.seq_lens, c.num_kv_heads,
                         c.scale, out, c.k_scale, c.v_scale, decode_query_len=c.decode_query_len, **kw)
    return out


def run_prefill(c, **kw):
    out = torch.full_like(c.q, float("nan"))
    R.sparse_attn_prefill(c.q, c.k_cache, c.v_cache, c.topk, c.block_table, c.query_req_id, c.query_abs_pos,
                          c.num_kv_heads, c.scale, out, c.k_scale, c.v_scale, **kw)
    return out


def masked(c):
    return R.masked_sparse_attention(c.q, c.k_logical, c.v_logical, c.topk, c.block_table, c.query_req_id,
                                     c.query_abs_pos, c.num_kv_heads, c.scale, c.k_scale, c.v_scale)


def assert_matches(out, ref, c):
    assert not out.isnan().any()
    rtol = 2 ** -8 if out.dtype == torch.bfloat16 else 2 ** -10  # one rounding of the output
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=1e-5)


DECODE_CASES = [
    # seq_lens, L, heads, kv heads, kv dtype, layout
    ([1, 127, 128, 129], 1, 16, 1, torch.bfloat16, "interleaved"),
    ([256, 4097, 0], 1, 8, 1, torch.float16, "planes"),
    ([129, 0, 300], 4, 16, 2, torch.bfloat16, "interleaved"),
    ([4, 4097], 4, 16, 1, torch.float8_e4m3fnuz, "interleaved"),
    ([130, 257, 0], 2, 8, 2, torch.float8_e4m3fn, "planes"),
]


@pytest.mark.parametrize("seq, L, hq, hkv, dtype, layout", DECODE_CASES)
def test_decode_formulations_agree(seq, L, hq, hkv, dtype, layout):
    q_dtype = torch.float16 if dtype == torch.float16 else torch.bfloat16
    c = testing.decode_case(seq, decode_query_len=L, num_heads=hq, num_kv_heads=hkv, kv_dtype=dtype,
                            q_dtype=q_dtype, layout=layout, seed=len(seq) * 7 + L)
    assert_matches(run_decode(c), masked(c), c)


@pytest.mark.parametrize("qlens, prefix, hkv, dtype, layout, scale_mode", [
    ([129, 257], [0, 0], 2, torch.bfloat16, "interleaved", "tensor"),
    ([65, 3, 130], [64, 1024, 3600], 1, torch.bfloat16, "planes", "tensor"),
    ([40, 17], [127, 4000], 1, torch.float8_e4m3fnuz, "interleaved", "token"),
    ([33], [200], 2, torch.float8_e4m3fn, "planes", "token"),
])
def test_prefill_formulations_agree(qlens, prefix, hkv, dtype, layout, scale_mode):
    c = testing.prefill_case(qlens, prefix, num_heads=16, num_kv_heads=hkv, kv_dtype=dtype, layout=layout,
                             seed=sum(qlens), scale_mode=scale_mode)
    assert_matches(run_prefill(c), masked(c), c)


def test_padded_rows_are_finite_zero():
    c = testing.decode_case([0, 129], decode_query_len=1)
    out = run_decode(c)
    assert out[0].eq(0).all() and out[1].abs().sum() > 0


def test_emitted_table_is_used_and_must_come_whole():
    c = testing.decode_case([129, 300], seed=4)
    bt, ctx = R.build_sparse_block_table_decode(c.topk, c.block_table, c.seq_lens, 1, 16)
    torch.testing.assert_close(run_decode(c, sparse_block_table=bt, sparse_context_lens=ctx), run_decode(c))
    with pytest.raises(ValueError, match="provided together"):
        run_decode(c, sparse_block_table=bt)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_scale_changes_result(dtype, which):
    c = testing.decode_case([300, 129], kv_dtype=dtype, seed=5)
    base = run_decode(c).float()
    setattr(c, which, getattr(c, which) * 2)
    changed = run_decode(c).float()
    ref = masked(c)
    assert (changed - base).abs().max() > 0.05  # the scale is applied, not dropped
    assert_matches(changed.to(c.q.dtype), ref, c)


def test_fp8_format_mismatch_is_refused():
    c = testing.decode_case([129], kv_dtype=torch.float8_e4m3fnuz, seed=6)
    with pytest.raises(ValueError, match="e4m3fn.*silent garbage"):
        run_decode(c, kv_cache_dtype=torch.float8_e4m3fn)
    wrong = c.k_cache.view(torch.float8_e4m3fn), c.v_cache.view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_cache"):
        R.sparse_attn_decode(c.q, *wrong, c.topk, c.block_table, c.seq_lens, 1, c.scale, torch.empty_like(c.q),
                             c.k_scale, c.v_scale, kv_cache_dtype=torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="k_cache"):  # raw bytes are not a cache dtype
        R.sparse_attn_decode(c.q, c.k_cache.view(torch.uint8), c.v_cache.view(torch.uint8), c.topk, c.block_table,
                             c.seq_lens, 1, c.scale, torch.empty_like(c.q))


@pytest.mark.parametrize("mutate, err, match", [
    (lambda c: setattr(c, "q", c.q.float()), ValueError, "q: expected"),
    (lambda c: setattr(c, "q", c.q[:, :, :64]), ValueError, "q: expected"),
    (lambda c: setattr(c, "topk", c.topk.long()), ValueError, "topk"),
    (lambda c: setattr(c, "k_scale", torch.ones(1, 7)), ValueError, "k_scale"),
    (lambda c: setattr(c, "v_cache", c.v_cache[:-1]), ValueError, "v_cache.shape"),
    (lambda c: setattr(c, "block_table", c.block_table + 1000), IndexError, "sparse_block_table"),
])
def test_bad_inputs_raise_named_errors(mutate, err, match):
    c = testing.decode_case([129, 200], kv_dtype=torch.float8_e4m3fnuz, seed=7)
    mutate(c)
    with pytest.raises(err, match=match):
        run_decode(c)


INSERT_CASES = [(torch.bfloat16, layout, "tensor") for layout in ("interleaved", "planes")] + [
    (dtype, layout, mode) for dtype in FP8 for layout in ("interleaved", "planes") for mode in ("tensor", "token")]


@pytest.mark.parametrize("dtype, layout, scale_mode", INSERT_CASES)
def test_insert_kv_matches_logical_write(dtype, layout, scale_mode):
    c = testing.decode_case([300, 129], num_kv_heads=2, kv_dtype=dtype, layout=layout, seed=8,
                            scale_mode=scale_mode)
    g = torch.Generator().manual_seed(9)
    slots = torch.tensor([0, 127, 128, -1, 129, 383], dtype=torch.int32)
    key = torch.randn(6, 2, 128, generator=g).bfloat16()
    value = torch.randn(6, 2, 128, generator=g).bfloat16()
    R.insert_kv(key, value, c.k_cache, c.v_cache, slots, c.k_scale, c.v_scale)
    k_log, v_log = L.unpack_kv_cache(c.k_cache, c.v_cache)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, 128)
        for h in range(2):
            got_k, got_v = k_log[b, o, h].float(), v_log[b, o, h].float()
            if dtype in FP8:
                ks = c.k_scale.reshape(-1)[0] if scale_mode == "tensor" else c.k_scale[h, s]
                vs = c.v_scale.reshape(-1)[0] if scale_mode == "tensor" else c.v_scale[h, s]
                got_k, got_v = got_k * ks, got_v * vs
                tol = dict(rtol=2 ** -4, atol=float(max(ks, vs)) * 2 ** -9)
            else:
                tol = dict(rtol=0, atol=0)
            torch.testing.assert_close(got_k, key[i, h].float(), **tol)
            torch.testing.assert_close(got_v, value[i, h].float(), **tol)
    written = torch.zeros(k_log.shape[:2], dtype=torch.bool)
    for s in slots.tolist():
        if s >= 0:
            written[s // 128, s % 128] = True
    assert torch.equal(k_log[~written].view(torch.uint8), c.k_logical[~written].view(torch.uint8))
    assert torch.equal(v_log[~written].view(torch.uint8), c.v_logical[~written].view(torch.uint8))
