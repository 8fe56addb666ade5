"""Hand-worked vectors: those of docs/SPEC.md (vLLM's own test vectors), plus vectors worked out here by its sparse page table rule."""
import pytest
import torch

from msa_iree import reference as R


def i32(x):
    return torch.tensor(x, dtype=torch.int32)


@pytest.mark.parametrize("slots, expected", [
    ([-1, 0, 127, 128, 129, 255, 256], [-1, 0, 127, 256, 257, 383, 512]),
    ([0, 15, 16, 127, 128, 129, -1], [0, 15, 16, 127, 256, 257, -1]),
])
def test_slot_rebase_vectors(slots, expected):
    assert R.rebase_slots_to_page16(i32(slots)).tolist() == expected


def test_block_table_rebase_vector_in_place():
    out = torch.full((1, 3), 99, dtype=torch.int32)
    ptr = out.data_ptr()
    got = R.rebase_block_table_to_page16(i32([[-1, 0, 3]]), out=out)
    assert got.data_ptr() == ptr and out.tolist() == [[-2, 0, 6]]


def pages(block, stride=8):
    return list(range(block * stride, block * stride + 8))


def test_padded_decode_rows_spec_vector():
    topk = i32([[[1, 0, -1], [0, 1, -1]]])
    bt, ctx = R.build_sparse_block_table_decode(topk, i32([[5, 7], [11, 13]]), i32([129, 0]), 1, 8)
    assert ctx.tolist() == [129, 0]
    assert bt[0].tolist() == pages(5) + pages(7) + [0] * 8  # full block 0 first, tail block 1 last
    assert bt[1].tolist() == [0] * 24


def test_spec_decode_l4_vector():
    # Worked by hand from the rule (docs/SPEC.md, the sparse page table): seq_lens [260, 132, 0], L = 4 -> positions 256..259, 128..131, padded.
    topk = i32([[[2, 0, -1], [3, 1, 2], [-1, 2, 1], [0, 1, -1],
                 [1, 0, 5], [0, -1, -1], [1, -1, -1], [-1, -1, -1],
                 [0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2]]])
    bt = i32([[5, 7, 11], [13, 17, 19], [0, 0, 0]])
    sbt, ctx = R.build_sparse_block_table_decode(topk, bt, i32([260, 132, 0]), 4, 8)
    zero = [0] * 8
    assert ctx.tolist() == [129, 130, 131, 256, 129, 128, 3, 0, 0, 0, 0, 0]
    expect = [pages(5) + pages(11) + zero, pages(7) + pages(11) + zero, pages(7) + pages(11) + zero,
              pages(5) + pages(7) + zero, pages(13) + pages(17) + zero, pages(13) + zero + zero,
              pages(17) + zero + zero] + [zero * 3] * 5
    assert sbt.tolist() == expect


def test_decode_row_count_mismatch_message():
    with pytest.raises(ValueError, match=r"batch \* decode_query_len: 3 != 4"):
        R.build_sparse_block_table_decode(torch.zeros(1, 3, 16, dtype=torch.int32), i32([[0], [1]]),
                                          i32([1, 1]), 2, 8)


def test_interleaved_stride_matches_rebased_table():
    topk = i32([[[1, 0, -1]]])
    raw, seq = i32([[5, 7]]), i32([129])
    a = R.build_sparse_block_table_decode(topk, raw, seq, 1, 16)
    b = R.build_sparse_block_table_decode(topk, R.rebase_block_table_to_page16(raw), seq, 1, 8)
    assert a[0].tolist() == b[0].tolist() and a[0][0, :8].tolist() == list(range(80, 88))


def test_two_kv_heads_fold_head_minor():
    # H = 2: row t*2 + h, page id = page * 2 + h; each head has its own selection.
    topk = i32([[[0, -1]], [[-1, 0]]])  # [H=2, T=1, K=2]
    sbt, ctx = R.build_sparse_block_table_decode(topk, i32([[3]]), i32([20]), 1, 8)
    assert ctx.tolist() == [20, 20]
    assert sbt[0, :8].tolist() == [p * 2 + 0 for p in range(24, 32)]
    assert sbt[1, :8].tolist() == [p * 2 + 1 for p in range(24, 32)]
    assert sbt[:, 8:].eq(0).all()


def test_query_token_positions_vector():
    req, pos = R.query_token_positions(i32([0, 3, 4, 6]), i32([0, 130, 5]), 6)
    assert req.tolist() == [0, 0, 0, 1, 2, 2]
    assert pos.tolist() == [0, 1, 2, 130, 5, 6]


def test_prefill_rows_vector():
    # Token at abs_pos 255 (own block 1, full up to 255) and at 256 (own block 2, 1 token).
    topk = i32([[[1, 0, -1], [2, -1, 0]]])
    sbt, ctx = R.build_sparse_block_table_prefill(topk, i32([[4, 6, 9]]), i32([0, 0]), i32([255, 256]), 8)
    assert ctx.tolist() == [256, 129]
    assert sbt[0].tolist() == pages(4) + pages(6) + [0] * 8
    assert sbt[1].tolist() == pages(4) + pages(9) + [0] * 8


def test_selected_block_without_table_column_raises():
    with pytest.raises(IndexError, match="block_table"):
        R.build_sparse_block_table_decode(i32([[[1]]]), i32([[0]]), i32([200]), 1, 8)
