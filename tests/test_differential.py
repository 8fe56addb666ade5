"""The runtime against the reference on seeded random steps (decode, speculative decode, mixed,
padded), the edge cases users of the anchors hit among them, and two regressions by name.

Every cache byte a step may not read is poisoned with NaN (the blocks no request owns, and each
request's last block past its length): a kernel that reads past a row's context turns NaN.
"""
import pytest
import torch

from msa_iree import reference as R
from msa_iree.layout import BLOCK_SIZE, is_fp8, pack_kv_cache, quantize_fp8
from msa_iree.runtime import MetadataBuilder, SparseAttention
from tolerances import assert_attend_close

BF16, F16, FNUZ, FN = torch.bfloat16, torch.float16, torch.float8_e4m3fnuz, torch.float8_e4m3fn
SCALE = 128 ** -0.5
EDGE_LENS = (1, 2, 127, 128, 129, 255, 256, 257, 383, 384, 385, 1024, 1025)
# (kv dtype, query heads, kv heads, layout, decode L, scale mode, query dtype): configs whose modules
# the other host tests compile too, so that CI compiles few more
CONFIGS = [(BF16, 16, 1, "interleaved", 1, None, BF16), (FNUZ, 16, 1, "interleaved", 4, "tensor", BF16),
           (FN, 16, 1, "planes", 4, "token", BF16), (F16, 16, 2, "planes", 1, None, F16),
           (FN, 8, 2, "planes", 2, "token", BF16)]
CASES_PER_CONFIG = 200  # 1000 steps in all


def nan_of(dtype):
    return {FNUZ: 0x80, FN: 0x7F}.get(dtype)


def poisoned_cache(g, num_blocks, h, dtype, layout, owned, lens, scales):
    """A packed cache whose owned blocks hold random K/V up to each request's length and NaN past
    it; every other block NaN. owned: [(request's blocks)], lens: their seq lens."""
    shape = (num_blocks, BLOCK_SIZE, h, 128)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    if is_fp8(dtype):
        ks, vs = scales
        k, v = (_quantize(x, s, dtype) for x, s in ((k, ks), (v, vs)))
    else:
        k, v = k.to(dtype), v.to(dtype)
    live = torch.zeros(num_blocks, BLOCK_SIZE, dtype=torch.bool)
    for blocks, n in zip(owned, lens):
        for j, b in enumerate(blocks):
            live[b, :max(0, min(BLOCK_SIZE, n - j * BLOCK_SIZE))] = True
    for x in (k, v):
        if is_fp8(dtype):
            x.view(torch.uint8)[~live] = nan_of(dtype)
        else:
            x[~live] = float("nan")
    return pack_kv_cache(k, v, layout)


def _quantize(x, scale, dtype):
    if scale.numel() == 1:
        return quantize_fp8(x, scale, dtype)
    nb, _, h, _ = x.shape
    return quantize_fp8(x, scale.T.reshape(nb, BLOCK_SIZE, h, 1), dtype)


def random_topk_row(g, pos, topk=16):
    """Top-k entries of a token at pos: its own block usually, older blocks, -1 holes, sometimes a
    duplicate, a future block or no own block, in random order."""
    if pos < 0:
        return [-1] * topk
    own = pos // BLOCK_SIZE
    older = torch.randperm(own, generator=g).tolist()[: int(torch.randint(0, topk, (1,), generator=g))]
    row = ([own] if torch.rand(1, generator=g) < 0.85 else []) + older
    if row and torch.rand(1, generator=g) < 0.1:
        row.append(row[int(torch.randint(0, len(row), (1,), generator=g))])  # a duplicate
    if torch.rand(1, generator=g) < 0.2:
        row.append(own + 1 + int(torch.randint(0, 3, (1,), generator=g)))  # a block in the future
    row = row[:topk] + [-1] * (topk - len(row[:topk]))
    return [row[i] for i in torch.randperm(topk, generator=g).tolist()]


def random_step(g, h, L, max_len=1300):
    """(decode seq lens, prefill (prefix, chunk) pairs, padding requests) of one step."""
    pick = lambda: EDGE_LENS[int(torch.randint(0, len(EDGE_LENS), (1,), generator=g))] if torch.rand(
        1, generator=g) < 0.5 else int(torch.randint(L, max_len, (1,), generator=g))
    decodes = [max(pick(), L) for _ in range(int(torch.randint(0, 4, (1,), generator=g)))]
    prefills, padding = [], 0
    if torch.rand(1, generator=g) < 0.4:
        for _ in range(int(torch.randint(1, 3, (1,), generator=g))):
            chunk = int(torch.randint(1, 20, (1,), generator=g))
            prefix = pick() - 1 if torch.rand(1, generator=g) < 0.5 else 0
            prefills.append((prefix, chunk))
    elif decodes and torch.rand(1, generator=g) < 0.4:
        padding = int(torch.randint(1, 3, (1,), generator=g))
    if not decodes and not prefills:
        decodes = [pick()]
    return decodes, prefills, padding


def run_case(g, kernels, attn, cfg, builder):
    kv, hq, h, layout, L, smode, qd = cfg
    decodes, prefills, padding = random_step(g, h, L)
    lens = decodes + [p + c for p, c in prefills] + [0] * padding
    blocks_of = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks_of) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    owned, at = [], 0
    for n in blocks_of:
        owned.append(perm[at:at + n])
        at += n
    cols = max(blocks_of + [1])
    bt = torch.tensor([b + [perm[-1]] * (cols - len(b)) for b in owned], dtype=torch.int32)  # past: any block
    scales = (None, None)
    if smode == "tensor":
        scales = (torch.tensor([0.3]), torch.tensor([1.7]))
    elif smode == "token":
        scales = tuple(0.05 + torch.rand(h, num_blocks * BLOCK_SIZE, generator=g) for _ in range(2))
    k_cache, v_cache = poisoned_cache(g, num_blocks, h, kv, layout, owned, lens, scales)
    nd = len(decodes) + padding
    qlens = [L] * len(decodes) + [0] * padding + [c for _, c in prefills]
    order = decodes + [0] * padding + [p + c for p, c in prefills]  # decode first, padding last among decodes
    bt = torch.cat([bt[:len(decodes)], bt[len(decodes) + len(prefills):], bt[len(decodes):len(decodes) + len(prefills)]])
    seq = torch.tensor(order, dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    computed = seq - torch.tensor(qlens, dtype=torch.int32)
    n = len(decodes) * L + padding * L + sum(c for _, c in prefills)
    md = builder.build(bt, seq, qsl, computed, L, nd, num_actual_tokens=n if padding else None)
    # token positions: decode rows seq - L + i (padding: negative), prefill rows prefix + i
    pos = [s - L + i if s else -1 for s in order[:nd] for i in range(L)]
    pos += [p + i for p, c in prefills for i in range(c)]
    topk = torch.tensor([[random_topk_row(g, p) for p in pos] for _ in range(h)], dtype=torch.int32)
    q = torch.randn(n, hq, 128, generator=g).to(qd)
    out = torch.full_like(q, float("nan"))
    attn.forward(q, k_cache, v_cache, out, topk, md, *scales)
    ref = torch.full_like(q, float("nan"))
    dt = nd * L
    if nd:
        R.sparse_attn_decode(q[:dt], k_cache, v_cache, topk[:, :dt], md.decode.block_table, md.decode.seq_lens, h,
                             SCALE, ref[:dt], *scales, decode_query_len=L)
    if prefills:
        p = md.prefill
        R.sparse_attn_prefill(q[dt:], k_cache, v_cache, topk[:, dt:], p.block_table, p.query_req_id,
                              p.query_abs_pos, h, SCALE, ref[dt:], *scales)
    assert_attend_close(out, ref, f"{cfg} {decodes} {prefills} pad {padding}")
    empty = torch.tensor(pos) < 0
    assert out[empty].eq(0).all()


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-h{c[1]}kv{c[2]}-{c[3]}-L{c[4]}-{c[5]}")
def test_random_steps_match_the_reference(host_kernels, cfg):
    kv, hq, h, layout, L, _, qd = cfg
    g = torch.Generator().manual_seed(3000 + CONFIGS.index(cfg))
    attn = SparseAttention(hq, h, 128, SCALE, kv, kernels=host_kernels, query_dtype=qd)
    builder = MetadataBuilder(8, 4096, max_num_tokens=256, kernels=host_kernels)
    for _ in range(CASES_PER_CONFIG):
        run_case(g, host_kernels, attn, cfg, builder)


# ---- regressions of bugs users of the anchors hit ----

@pytest.mark.parametrize("scale_mode", ["tensor", "token"])
def test_speculative_decode_l4_with_an_fnuz_cache_and_scales(host_kernels, scale_mode):
    """Speculative decode (L = 4) over an fp8 e4m3fnuz cache with scales != 1: AITER's sparse
    attend returned garbage there on gfx942 (vLLM gates that path off)."""
    g = torch.Generator().manual_seed(52860)
    cfg = (FNUZ, 16, 1, "interleaved", 4, scale_mode, BF16)
    attn = SparseAttention(16, 1, 128, SCALE, FNUZ, kernels=host_kernels)
    builder = MetadataBuilder(8, 4096, kernels=host_kernels)
    for _ in range(20):
        run_case(g, host_kernels, attn, cfg, builder)


@pytest.mark.parametrize("kv", [BF16, FNUZ, FN])
def test_sixteen_blocks_with_a_context_ending_late_in_the_last_partition(host_kernels, kv):
    """16 heads per KV head, all 16 blocks selected, the row's length 1920 + t with the own block's
    t in 113..127 tokens, i.e. 241..255 tokens into the last 256-token partition: AITER's maskless
    fp8 kernel returned NaN there."""
    g = torch.Generator().manual_seed(2211)
    blocks = list(range(16))
    for tail in range(113, 128):
        seq_len = 15 * BLOCK_SIZE + tail
        perm = torch.randperm(20, generator=g).tolist()
        owned = perm[:16]
        scales = (torch.tensor([0.6]), torch.tensor([1.3])) if is_fp8(kv) else (None, None)
        k_cache, v_cache = poisoned_cache(g, 20, 1, kv, "interleaved", [owned], [seq_len], scales)
        attn = SparseAttention(16, 1, 128, SCALE, kv, kernels=host_kernels)
        md = MetadataBuilder(4, 4096, kernels=host_kernels).build(
            torch.tensor([owned], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([seq_len - 1], dtype=torch.int32), 1, 1)
        topk = torch.tensor([[blocks[::-1]]], dtype=torch.int32)
        q = torch.randn(1, 16, 128, generator=g).to(BF16)
        out = torch.full_like(q, float("nan"))
        attn.forward(q, k_cache, v_cache, out, topk, md, *scales)
        ref = torch.empty_like(q)
        R.sparse_attn_decode(q, k_cache, v_cache, topk, md.decode.block_table, md.decode.seq_lens, 1, SCALE, ref,
                             *scales)
        _, ctx = R.build_sparse_block_table_decode(topk, md.decode.block_table, md.decode.seq_lens, 1, 16)
        assert int(ctx) % 256 == tail + 128 and 241 <= int(ctx) % 256 <= 255
        assert_attend_close(out, ref, f"tail {tail}")
