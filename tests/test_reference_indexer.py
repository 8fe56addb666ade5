"""The reference indexer (docs/SPEC.md, "The indexer"): hand-worked vectors first, then seeded
random cases against a second, loop-by-loop statement of the rule."""
import math

import pytest
import torch

from msa_iree import reference as R

BF16 = torch.bfloat16


def i32(x):
    return torch.tensor(x, dtype=torch.int32)


def one_hot_cache(values):
    """An index cache whose token p holds values[p] * e_0 (one request, blocks in order): with
    index_q = e_0 a block's score is the max of its visible tokens' values."""
    n = len(values)
    blocks = -(-n // 128)
    cache = torch.zeros(blocks, 128, 128)
    cache.view(-1, 128)[:n, 0] = torch.tensor(values, dtype=torch.float32)
    return cache, i32([list(range(blocks))])


def q_e0(tokens=1, heads=1):
    q = torch.zeros(tokens, heads, 128)
    q[:, :, 0] = 1
    return q


def topk_at(values, pos, **kw):
    cache, table = one_hot_cache(values)
    return R.index_topk(q_e0(), cache, table, i32([0]), i32([pos]), **kw)[0, 0].tolist()


def block_values(per_block, n):
    """Token values: block b's tokens all per_block[b] (n tokens)."""
    return [per_block[p // 128] for p in range(n)]


def test_scores_are_the_max_over_visible_tokens():
    values = [0.0] * 300
    values[10], values[200], values[290], values[299] = 5.0, 7.0, 9.0, 11.0
    cache, table = one_hot_cache(values)
    s = R.index_block_scores(q_e0(), cache, table, i32([0]), i32([295]))
    assert s[0, 0].tolist() == [5.0, 7.0, 9.0]  # token 299 (value 11) is in the future of position 295


def test_ties_go_to_the_smaller_block_id_and_scores_rank_highest_first():
    vals = block_values([1.0, 3.0, 3.0, 2.0, 3.0], 5 * 128)
    assert topk_at(vals, 639, local_blocks=0) == [1, 2, 4, 3, 0] + [-1] * 11


def test_forced_init_and_local_blocks():
    vals = block_values([0.0, 9.0, 8.0, 7.0, 6.0], 5 * 128)
    # init 1: block 0 (score 0) first; local 1: the own block 4 next; then by score
    assert topk_at(vals, 639, init_blocks=1, local_blocks=1) == [0, 4, 1, 2, 3] + [-1] * 11
    # a block both init and local ranks as local: one block only
    assert topk_at(block_values([5.0], 128), 10, init_blocks=1, local_blocks=1) == [0] + [-1] * 15
    # two local blocks, the own block and the one before
    assert topk_at(vals, 639, local_blocks=2)[:5] == [3, 4, 1, 2, 0]


def test_fewer_than_sixteen_candidates_and_block_edges():
    vals = [1.0] * 2000
    for pos, k in ((0, 1), (126, 1), (127, 1), (128, 2), (129, 2), (1999, 16)):
        got = topk_at(vals, pos)
        assert sum(b >= 0 for b in got) == k and got[k:] == [-1] * (16 - k), (pos, got)
        assert got[0] == pos // 128  # the own block forced first
    assert topk_at(vals, 128)[:2] == [1, 0]


def test_more_than_sixteen_candidates_keep_the_sixteen_highest():
    per_block = [float(b % 7) + b / 100 for b in range(40)]
    got = topk_at(block_values(per_block, 40 * 128), 40 * 128 - 1)
    want = [39] + sorted(range(39), key=lambda b: -per_block[b])[:15]
    assert got == want


def test_a_nan_score_ranks_below_every_number_and_above_the_padding():
    vals = block_values([1.0, float("nan"), -5.0], 3 * 128)
    assert topk_at(vals, 383, local_blocks=0) == [0, 2, 1] + [-1] * 13


def test_a_padded_row_selects_nothing():
    cache, table = one_hot_cache([1.0] * 256)
    got = R.index_topk(q_e0(2), cache, table, i32([0, 0]), i32([-1, 200]))
    assert got[0, 0].tolist() == [-1] * 16 and got[0, 1].tolist()[:2] == [1, 0]


def test_decode_rows_take_their_positions_from_seq_lens():
    cache, table = one_hot_cache(block_values([2.0, 1.0, 3.0], 3 * 128))
    got = R.index_topk_decode(q_e0(4), cache, i32([[0, 1, 2], [0, 1, 2]]), i32([130, 384]), 2)
    assert got[0].tolist() == [[1, 0] + [-1] * 14, [1, 0] + [-1] * 14,
                               [2, 0, 1] + [-1] * 13, [2, 0, 1] + [-1] * 13]


def test_the_index_cache_insert():
    cache = torch.zeros(3, 128, 128, dtype=BF16)
    ik = torch.arange(4 * 128, dtype=torch.float32).reshape(4, 128).to(BF16)
    R.insert_index_cache(ik, cache, i32([0, 129, -1, 383]))
    assert torch.equal(cache[0, 0], ik[0]) and torch.equal(cache[1, 1], ik[1]) and torch.equal(cache[2, 127], ik[3])
    assert cache.count_nonzero() == ik[[0, 1, 3]].count_nonzero()
    fp8 = torch.zeros(3, 128, 128, dtype=torch.float8_e4m3fn)
    R.insert_index_cache(ik.float() / 100, fp8, i32([5, -1, -1, -1]))  # cast as it is, no scale
    assert torch.equal(fp8[0, 5].view(torch.uint8), (ik[0].float() / 100).to(torch.float8_e4m3fn).view(torch.uint8))
    with pytest.raises(IndexError, match="slot_mapping"):
        R.insert_index_cache(ik[:1], cache, i32([384]))


def test_the_fp8_index_cache_insert_saturates():
    """Past e4m3fn's 448 a key is stored as +-448 (0x7e / 0xfe), never NaN (0x7f), whatever torch's
    cast does; 464 is the midpoint of 448 and the next step (480) and rounds to 448 too; 1e-3 and
    -2.5e-3 become the subnormal +-2^-9 (0x01 / 0x81), 0.25 stays exact (0x28)."""
    fp8 = torch.zeros(1, 128, 128, dtype=torch.float8_e4m3fn)
    ik = torch.zeros(1, 128, dtype=BF16)
    ik[0, :7] = torch.tensor([600.0, -600.0, 464.0, 1e4, 1e-3, -2.5e-3, 0.25])
    R.insert_index_cache(ik, fp8, i32([3]))
    assert fp8[0, 3, :7].view(torch.uint8).tolist() == [0x7E, 0xFE, 0x7E, 0x7E, 0x01, 0x81, 0x28]


def test_the_emitted_table_resolves_through_the_attends_block_table():
    """The index cache and the attend's cache are different pools: the table's pages come from the
    attend's block table (block 20 and 21 here), not the index cache's (0 and 1)."""
    cache, table = one_hot_cache(block_values([1.0, 2.0], 256))
    topk, bt, ctx = R.index_topk_with_table(q_e0(), cache, table, i32([0]), i32([200]), i32([[20, 21]]), 16)
    assert topk[0, 0].tolist()[:2] == [1, 0]
    assert ctx.tolist() == [128 + 73]
    assert bt[0].tolist()[:16] == list(range(320, 328)) + list(range(336, 344))  # block 20 full, then the own block 21


# ---- seeded random cases against the rule written out loop by loop ----

def brute_topk(q, cache, table, req, pos, init, local, k=16):
    H, T = q.shape[1], q.shape[0]
    out = [[[-1] * k for _ in range(T)] for _ in range(H)]
    for t in range(T):
        p = int(pos[t])
        if p < 0:
            continue
        nvis = p // 128 + 1
        for h in range(H):
            scored = []
            for b in range(nvis):
                best = -math.inf
                for tok in range(b * 128, min(p, b * 128 + 127) + 1):
                    key = cache[int(table[int(req[t]), tok // 128]), tok % 128].float()
                    best = max(best, float(q[t, h].float() @ key)) if not math.isnan(best) else best
                    if math.isnan(float(q[t, h].float() @ key)):
                        best = math.nan
                s = -1e30 if math.isnan(best) else best
                if b < init:
                    s = 1e30
                if b >= nvis - local:
                    s = 1e29
                scored.append((-s, b))
            chosen = [b for _, b in sorted(scored)][:k]
            out[h][t][:len(chosen)] = chosen
    return out


@pytest.mark.parametrize("seed", range(6))
def test_random_cases_match_the_rule(seed):
    g = torch.Generator().manual_seed(seed)
    heads, blocks = 2, 30
    cache = torch.randn(blocks, 128, 128, generator=g).round()  # integers: ties happen
    cache = cache.to(BF16 if seed % 2 else torch.float8_e4m3fn)
    table = torch.stack([torch.randperm(blocks, generator=g)[:12] for _ in range(2)]).int()
    pos = torch.tensor([0, 127, 128, 129, 255, 1000, 1535, -1, int(torch.randint(0, 1536, (1,), generator=g))])
    req = torch.randint(0, 2, (len(pos),), generator=g).int()
    q = torch.randn(len(pos), heads, 128, generator=g).round().to(cache.dtype)
    init, local = seed % 3, 1 + seed % 2
    got = R.index_topk(q, cache, table, req, pos.int(), init_blocks=init, local_blocks=local)
    assert got.tolist() == brute_topk(q, cache, table, req, pos, init, local)
