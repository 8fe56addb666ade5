"""No input gives silent garbage: every bad input is refused by name, before anything is written
(docs/SPEC.md, "Bad inputs"), and the padded decode batch vLLM builds for CUDA graphs is served."""
import numpy as np
import pytest
import torch

from msa_iree import reference as R
from msa_iree.layout import allocate_kv_cache, pack_kv_cache
from msa_iree.runtime import MetadataBuilder, SparseAttention, insert_kv
from msa_iree.runtime.metadata import _MASKED_IDS, _largest_used_id, used_id_extremes
from tolerances import assert_attend_close

BF16 = torch.bfloat16


def i32(x):
    return torch.tensor(x, dtype=torch.int32)


@pytest.fixture(scope="module")
def layer(host_kernels):
    """A bf16 layer over a 64-block interleaved cache of random K/V."""
    g = torch.Generator().manual_seed(2027)
    k, v = (torch.randn(64, 128, 1, 128, generator=g).to(BF16) for _ in range(2))
    k_cache, v_cache = pack_kv_cache(k, v, "interleaved")
    attn = SparseAttention(16, 1, 128, 128 ** -0.5, BF16, kernels=host_kernels)
    return attn, k_cache, v_cache, g


def decode_step(builder, block_table, seq_lens, **kw):
    n = len(seq_lens)
    seq = i32(seq_lens)
    return builder.build(i32(block_table), seq, torch.arange(n + 1, dtype=torch.int32), seq - 1, 1, n, **kw)


def topk_own_and_first(seq_lens):
    """Each token selects its own block and block 0."""
    rows = [[(s - 1) // 128, 0] + [-1] * 14 if s > 128 else [0] + [-1] * 15 for s in seq_lens]
    return i32([rows])


def queries(g, n):
    return torch.randn(n, 16, 128, generator=g).to(BF16)


def untouched(shape):
    return torch.full(shape, float("nan"), dtype=BF16)


# ---- each bad input of the runtime, refused before anything is written ----

def test_a_context_longer_than_the_block_table_is_refused(host_kernels):
    """seq_len 700 needs 6 columns; a 2-column table would have the kernels clamp a top-k block's
    column into the table (finite numbers from the wrong block)."""
    for cache_blocks in (None, 64):
        builder = MetadataBuilder(4, 4096, num_cache_blocks=cache_blocks, kernels=host_kernels)
        with pytest.raises(IndexError, match=r"block_table: expected at least cdiv\(seq_len, 128\) = 6 columns for "
                                             r"request 0 \(seq_len 700\), got 2 columns"):
            decode_step(builder, [[3, 4]], [700])


def test_a_negative_block_id_inside_a_context_is_refused(host_kernels):
    builder = MetadataBuilder(4, 4096, kernels=host_kernels)
    for bad in (-1, -7):
        with pytest.raises(IndexError, match=f"block_table: expected a cache block id >= 0 for every block of a "
                                             f"request's context, got {bad} at request 1, column 1 \\(seq_len 300\\)"):
            decode_step(builder, [[5, 6, 7], [8, bad, 9]], [300, 300])
    decode_step(builder, [[5, 6, -1], [8, 9, 10]], [200, 300])  # past a context: padding, accepted


@pytest.mark.parametrize("cols", [4096, 8192])  # 3 x 4096 ids: through a mask; 3 x 8192: by segments
def test_a_long_block_table_is_checked_over_each_requests_columns_only(host_kernels, cols):
    """The same rule on tables of 1M-token contexts: a negative id inside a context is refused,
    one past it (or in a padded request's row) is padding; the step's largest id is the largest
    used one."""
    builder = MetadataBuilder(4, cols * 128, kernels=host_kernels)
    bt = torch.arange(3 * cols, dtype=torch.int32).reshape(3, cols)
    seq = [cols * 128, 1000, 129]                # all columns, 8 columns, 2 columns
    bt[1, 8:], bt[2, 2:] = -1, 10 ** 7           # past the contexts: never read
    md = decode_step(builder, bt.tolist(), seq)
    assert md.max_block_id == 2 * cols + 1
    for r, c in ((0, cols - 1), (1, 7), (2, 1)):
        bad = bt.clone()
        bad[r, c] = -3
        with pytest.raises(IndexError, match=f"got -3 at request {r}, column {c} "):
            decode_step(builder, bad.tolist(), seq)


@pytest.mark.parametrize("reqs", [1, 2, 5])
def test_a_long_tables_used_ids_are_reduced_over_each_requests_columns_only(reqs):
    """The builder's reduction of a table's used ids (their largest read as uint32, so that a
    negative one reads as 2**31 or more), through the mask (a table of 33 columns) and past
    _MASKED_IDS ids by segments, against numpy's, on seeded tables whose rows use no, some or all
    of their columns (the last row's end is the table's end; a seq_len anywhere in its last block),
    hold the extreme int32 values past each context, and in half the tables a negative id inside one."""
    rng = np.random.default_rng(reqs)
    for cols in (33, 2 * _MASKED_IDS):  # one row of the second is past the mask's bound
        for trial in range(6):
            bt = rng.integers(0, 10 ** 6, (reqs, cols)).astype(np.int32)
            need = rng.choice([0, 1, 7, cols - 1, cols], reqs)
            seq = np.where(need > 0, need * 128 - rng.integers(0, 128, reqs), 0)
            unused = np.arange(cols) >= need[:, None]
            bt[unused] = np.where(rng.integers(0, 2, unused.sum()) == 1, np.iinfo(np.int32).max,
                                  np.iinfo(np.int32).min)
            if trial % 2 and need.any():
                r = int(np.flatnonzero(need)[-1])
                bt[r, rng.integers(0, need[r])] = -3
            ids = bt[~unused]
            expected = int(ids.astype(np.int64).max()) if ids.size else -1
            if ids.size and ids.min() < 0:
                expected = 2 ** 32 + int(ids[ids < 0].max())  # the largest negative id, as uint32
            assert _largest_used_id(bt, seq) == expected, (cols, need)


def test_the_device_checks_extremes_cover_each_requests_used_columns_only():
    """used_id_extremes (the torch ops a CUDA builder runs in a graph on a long table) against
    numpy over the used columns: a hand-worked table first (a row crossing into its second block
    at seq_len 129, a row of exactly one block, an empty row whose ids are all negative), then
    seeded tables whose rows use no, some or all columns, the extreme int32 values past each
    context, and in half of them a negative id inside one; into given mask and value tensors
    (holding stale values) in a third of them."""
    bt = torch.tensor([[7, 9, -1], [4, -5, -5], [-9, -9, -9]], dtype=torch.int32)
    out = torch.full((2,), 99, dtype=torch.int32)
    starts = torch.arange(3, dtype=torch.int32) * 128
    used_id_extremes(bt, torch.tensor([129, 128, 0], dtype=torch.int32), starts, out)
    assert out.tolist() == [0, 9]  # the unused columns count as 0
    used_id_extremes(bt, torch.tensor([1, 256, 0], dtype=torch.int32), starts, out)
    assert out.tolist() == [-5, 7]
    rng = np.random.default_rng(11)
    for reqs, cols in ((1, 5), (4, 33), (9, 600)):
        for trial in range(6):
            table = rng.integers(0, 10 ** 6, (reqs, cols)).astype(np.int32)
            need = rng.choice([0, 1, 2, cols - 1, cols], reqs)
            seq = np.where(need > 0, need * 128 - rng.integers(0, 128, reqs), 0).astype(np.int32)
            unused = np.arange(cols) >= need[:, None]
            table[unused] = rng.choice([np.iinfo(np.int32).max, np.iinfo(np.int32).min, -1], unused.sum())
            if trial % 2 and need.any():
                r = int(np.flatnonzero(need)[0])
                table[r, rng.integers(0, need[r])] = -3
            ids = np.concatenate([table[~unused], [0]])
            scratch = (torch.ones(reqs, cols, dtype=torch.bool), torch.full((reqs, cols), 5, dtype=torch.int32)) \
                if trial % 3 == 0 else (None, None)  # where the device's graph puts them
            used_id_extremes(torch.from_numpy(table), torch.from_numpy(seq),
                             torch.arange(cols, dtype=torch.int32) * 128, out, *scratch)
            assert out.tolist() == [int(ids.min()), int(ids.max())], (reqs, cols, need)


def test_a_block_id_past_the_cache_is_refused_by_the_layer(layer, host_kernels):
    """Without num_cache_blocks the builder cannot know the cache: the layer compares the step's
    largest block id (an int the builder found) with its cache, with no sync, before writing."""
    attn, k_cache, v_cache, g = layer
    md = decode_step(MetadataBuilder(4, 4096, kernels=host_kernels), [[500, 3]], [200])
    assert md.max_block_id == 500
    q, out = queries(g, 1), untouched((1, 16, 128))
    with pytest.raises(IndexError, match="block_table: expected cache block ids below k_cache's 64 blocks, got 500"):
        attn.forward(q, k_cache, v_cache, out, topk_own_and_first([200]), md)
    assert out.isnan().all()
    with pytest.raises(IndexError, match=r"block_table: expected ids in \[0, 64\) \(num_cache_blocks\), got 500"):
        decode_step(MetadataBuilder(4, 4096, num_cache_blocks=64, kernels=host_kernels), [[500, 3]], [200])


def test_a_sequence_longer_than_max_model_len_is_refused(host_kernels):
    builder = MetadataBuilder(4, 1000, kernels=host_kernels)
    with pytest.raises(ValueError, match="seq_lens: expected at most max_model_len=1000 tokens a request, got 1010 "
                                         "for request 0"):
        decode_step(builder, [[1] * 8], [1010])


def test_metadata_none_is_a_profiling_run_and_anything_else_is_refused(layer, host_kernels):
    attn, k_cache, v_cache, g = layer
    q, out = queries(g, 1), untouched((1, 16, 128))
    assert attn.forward(q, k_cache, v_cache, out, topk_own_and_first([5]), None) is out
    assert out.isnan().all()
    for wrong in ({"layer.0": None}, "metadata", 7):
        with pytest.raises(TypeError, match=f"metadata: expected an MsaMetadata .* or None .*, got "
                                            f"{type(wrong).__name__}"):
            attn.forward(q, k_cache, v_cache, out, topk_own_and_first([5]), wrong)


def test_a_query_shorter_than_the_step_is_refused_before_any_row_is_written(layer, host_kernels):
    """One decode and one prefill request (3 tokens): a 1-row query is refused by name, and the
    decode part is not written first."""
    attn, k_cache, v_cache, g = layer
    builder = MetadataBuilder(4, 4096, kernels=host_kernels)
    md = builder.build(i32([[5, 6], [7, 8]]), i32([200, 130]), i32([0, 1, 3]), i32([199, 128]), 1, 1)
    topk = topk_own_and_first([200, 129, 130])
    for rows in (1, 2):
        out = untouched((rows, 16, 128))
        with pytest.raises(ValueError, match=f"query: expected at least num_actual_tokens=3 rows \\(the step's "
                                             f"tokens\\), got {rows}"):
            attn.forward(queries(g, rows), k_cache, v_cache, out, topk, md)
        assert out.isnan().all()
    with pytest.raises(ValueError, match="topk: expected at least num_actual_tokens=3 rows"):
        attn.forward(queries(g, 3), k_cache, v_cache, untouched((3, 16, 128)), topk[:, :2], md)


def test_rows_past_the_step_are_left_untouched(layer, host_kernels):
    attn, k_cache, v_cache, g = layer
    md = decode_step(MetadataBuilder(4, 4096, kernels=host_kernels), [[5, 6], [7, 8]], [200, 129])
    q, out = queries(g, 5), untouched((5, 16, 128))  # vLLM's buffers hold more rows than a step
    topk = torch.cat([topk_own_and_first([200, 129]), torch.full((1, 3, 16), -1, dtype=torch.int32)], 1)
    attn.forward(q, k_cache, v_cache, out, topk, md)
    assert not out[:2].isnan().any() and out[2:].isnan().all()


# ---- the padded decode batch (vLLM's full CUDA graphs) ----

def test_a_decode_batch_padded_as_vllm_pads_it_is_served(layer, host_kernels):
    """Two decode requests of L = 2, padded to four: the padding requests have query length 0 and
    seq_len 0 and stand at the end, their L tokens counted in num_actual_tokens (vLLM's
    split_decodes_and_prefills then counts every request a decode). Their rows are zero, nothing is
    written for them, and the real rows are the reference's."""
    attn, k_cache, v_cache, g = layer
    builder = MetadataBuilder(8, 4096, kernels=host_kernels)
    bt = i32([[5, 6], [7, 8], [0, 0], [0, 0]])
    seq, qsl, computed = i32([200, 130, 0, 0]), i32([0, 2, 4, 4, 4]), i32([198, 128, 0, 0])
    slots = i32([6 * 128 + 70, 6 * 128 + 71, 8 * 128 + 0, 8 * 128 + 1, -1, -1, -1, -1])
    md = builder.build(bt, seq, qsl, computed, 2, 4, slot_mapping=slots, num_actual_tokens=8)
    assert (md.num_actual_tokens, md.num_decodes, md.num_decode_tokens, md.num_prefills) == (8, 4, 8, 0)
    assert md.insert_slots.tolist() == slots[:4].tolist()  # the padding's slots written nowhere
    topk = torch.cat([topk_own_and_first([199, 200, 129, 130]), torch.full((1, 4, 16), -1, dtype=torch.int32)], 1)
    q, out = queries(g, 8), untouched((8, 16, 128))
    attn.forward(q, k_cache, v_cache, out, topk, md)
    ref = torch.empty_like(q)
    R.sparse_attn_decode(q, k_cache, v_cache, topk, bt, seq, 1, 128 ** -0.5, ref, decode_query_len=2)
    assert_attend_close(out[:4], ref[:4], "real rows")
    assert out[4:].eq(0).all()


@pytest.mark.parametrize("qsl, seq, computed, num_actual_tokens, match", [
    # the old form, padding with L tokens and seq_len 0: its seq_len contradicts its tokens
    ([0, 1, 2], [200, 0], [199, 0], None, "seq_lens: expected num_computed_tokens \\+ query length = 1 for request 1, "
                                          "got 0"),
    # padding in the middle of the decodes
    ([0, 1, 1, 2], [200, 0, 130], [199, 0, 129], 3, "decode padding: expected the padding requests of a decode batch "
                                                    "\\(query length 0\\) at its end"),
    # padding whose tokens num_actual_tokens does not count
    ([0, 1, 1], [200, 0], [199, 0], 1, "num_actual_tokens: expected num_decodes \\* decode_query_len = 2 for a decode "
                                       "batch padded with 1 requests of length 0"),
    # padding tokens outside a padded decode batch
    ([0, 1, 2], [200, 130], [199, 129], 4, "num_actual_tokens: expected query_start_loc\\[-1\\] = 2"),
])
def test_other_padding_forms_are_refused(host_kernels, qsl, seq, computed, num_actual_tokens, match):
    builder = MetadataBuilder(8, 4096, kernels=host_kernels)
    bt = i32([[5, 6]] * len(seq))
    with pytest.raises(ValueError, match=match):
        builder.build(bt, i32(seq), i32(qsl), i32(computed), 1, len(seq), num_actual_tokens=num_actual_tokens)


@pytest.mark.parametrize("L, qsl, seq, computed, match", [
    (1, [1, 2, 3], [200, 130], [199, 129], "query_start_loc: expected non-decreasing offsets from 0"),
    (1, [0, 1, 2], [200, 131], [199, 129], "seq_lens: expected num_computed_tokens \\+ query length = 130 for "
                                           "request 1, got 131"),
    (2, [0, 2, 3], [200, 130], [198, 129], "decode query lengths: expected decode_query_len=2 for each of the first "
                                           "num_decodes=2 requests, got 1 for request 1"),
    (1, [0, 1, 2], [200, 4097], [199, 4096], "seq_lens: expected at most max_model_len=4096 tokens a request, got "
                                             "4097 for request 1"),
])
def test_a_decode_step_out_of_order_is_refused_and_named(host_kernels, L, qsl, seq, computed, match):
    builder = MetadataBuilder(8, 4096, kernels=host_kernels)
    bt = i32([list(range(32))] * len(seq))
    with pytest.raises(ValueError, match=match):
        builder.build(bt, i32(seq), i32(qsl), i32(computed), L, len(seq))


def test_a_slot_whose_page16_slot_overflows_int32_is_refused(host_kernels):
    """A page-16 slot is slot + its block's first slot, int32 like vLLM's: slots from 2**30 on
    would wrap."""
    builder = MetadataBuilder(8, 4096, kernels=host_kernels)
    bt = i32([list(range(32))] * 2)
    with pytest.raises(IndexError, match="slot_mapping: expected slots below 2\\*\\*30 \\(their page-16 slots are "
                                         "int32\\), got 1073741824"):
        builder.build(bt, i32([200, 130]), i32([0, 1, 2]), i32([199, 129]), 1, 2, slot_mapping=i32([5, 1 << 30]))
    md = builder.build(bt, i32([200, 130]), i32([0, 1, 2]), i32([199, 129]), 1, 2, slot_mapping=i32([5, (1 << 30) - 1]))
    assert md.max_slot == (1 << 30) - 1 and md.page16_slot_mapping[1] == (1 << 30) - 1 + (1 << 30) - 128


@pytest.mark.parametrize("max_seq_len, match", [
    (-1, "max_seq_len: expected an int >= 0 \\(at least the step's longest seq_len\\), got -1"),
    (200.0, "max_seq_len: expected an int >= 0 \\(at least the step's longest seq_len\\), got 200.0"),
    (True, "max_seq_len: expected an int >= 0 \\(at least the step's longest seq_len\\), got True"),
    (199, "max_seq_len: expected at least the step's longest seq_len, got 199 \\(request 0's seq_len is 200\\)"),
])
def test_a_max_seq_len_below_the_steps_or_not_an_int_is_refused(host_kernels, max_seq_len, match):
    builder = MetadataBuilder(8, 4096, kernels=host_kernels)
    bt = i32([list(range(32))] * 2)
    with pytest.raises(ValueError, match=match):
        builder.build(bt, i32([200, 130]), i32([0, 1, 2]), i32([199, 129]), 1, 2, max_seq_len=max_seq_len)


def test_insert_checks_the_step_against_its_cache_without_a_sync(host_kernels):
    kc, vc = allocate_kv_cache(2, 1, BF16, "interleaved", fill=0)
    before = kc.clone()
    md = decode_step(MetadataBuilder(4, 4096, kernels=host_kernels), [[0, 1, 3]], [300],
                     slot_mapping=i32([3 * 128 + 43]))
    key = torch.ones(1, 1, 128, dtype=BF16)
    with pytest.raises(IndexError, match="slot_mapping: expected slots below k_cache's 256 tokens, got 427"):
        insert_kv(host_kernels, key, key, kc, vc, md)
    assert torch.equal(kc.view(torch.uint8), before.view(torch.uint8))


# ---- duplicate top-k entries: AITER's page table ----

def test_a_duplicated_full_block_counts_twice_and_a_duplicated_own_block_once(layer, host_kernels):
    """msa-iree follows AITER's page table (docs/SPEC.md): checked against the formula over a cache
    where the duplicate is a second, identical block (so that listing it twice is attending to
    two blocks of the same tokens)."""
    attn, k_cache, v_cache, g = layer
    builder = MetadataBuilder(4, 4096, kernels=host_kernels)
    md = decode_step(builder, [[5, 6, 9, 7]], [400])  # the token at 399: its own block is 3
    q = queries(g, 1)
    dup_full, dup_own = i32([[[0, 0, 3] + [-1] * 13]]), i32([[[3, 0, 3] + [-1] * 13]])
    # the independent expectation: block 0's bytes also as the request's (unselected) block 2
    from msa_iree.layout import unpack_kv_cache

    k, v = unpack_kv_cache(k_cache, v_cache)
    k2, v2 = torch.cat([k, k[5:6]]), torch.cat([v, v[5:6]])  # cache block 64 = block 5's bytes
    table = i32([[5, 6, 64, 7]])
    req, pos = i32([0]), i32([399])
    want_twice = R.masked_sparse_attention(q, k2, v2, i32([[[0, 2, 3] + [-1] * 13]]), table, req, pos, 1,
                                           128 ** -0.5)
    want_once = R.masked_sparse_attention(q, k2, v2, i32([[[0, 3] + [-1] * 14]]), table, req, pos, 1, 128 ** -0.5)
    for topk, want in ((dup_full, want_twice), (dup_own, want_once)):
        out = untouched((1, 16, 128))
        attn.forward(q, k_cache, v_cache, out, topk, md)
        assert_attend_close(out, want.to(BF16))
    assert (want_twice.float() - want_once.float()).abs().max() > 0.05  # the two readings differ


def test_a_given_page_table_is_checked_for_range_length_and_block_groups():
    """checks.check_page_table, the validation of an emitted table (row r = token * H + head):
    only the pages a row reads (its first cdiv(ctx, 16)) count; with a block page stride each
    read 8-page group must be one block's pages in order for the row's head."""
    from msa_iree import checks

    h = 2
    group = lambda block, head: [(block * 16 + j) * h + head for j in range(8)]
    sbt = torch.zeros(2, 128, dtype=torch.int32)
    sbt[0, :8], sbt[0, 8:16], sbt[0, 16:] = torch.tensor(group(3, 0)), torch.tensor(group(5, 0)), 10 ** 6
    sbt[0, 9:16] = 999  # row 0 reads 9 pages (ctx 130): only group 1's first; the rest is never read
    sbt[1, :8] = torch.tensor(group(4, 1))
    ctx = torch.tensor([130, 128], dtype=torch.int32)
    checks.check_page_table(sbt, ctx, h, 200, block_page_stride=16)

    def refused(exc, match, bt=sbt, lens=ctx, stride=16):
        with pytest.raises(exc, match=match):
            checks.check_page_table(bt, lens, h, 200, block_page_stride=stride)

    swapped = sbt.clone()
    swapped[1, [2, 3]] = swapped[1, [3, 2]]
    refused(ValueError, r"each 8-page group one block's pages in order.*\* 2 \+ 1 for j = 0..7, got .* at row 1, group 0",
            swapped)
    checks.check_page_table(swapped, ctx, h, 200)  # the portable attend reads any page order
    other_head = sbt.clone()
    other_head[1, :8] = torch.tensor(group(4, 0))
    refused(ValueError, "at row 1, group 0", other_head)
    unaligned = sbt.clone()
    unaligned[1, :8] += h  # pages 1..8 of block 4: not a block's first page
    refused(ValueError, "at row 1, group 0", unaligned)
    far = sbt.clone()
    far[0, 8] = 10 ** 6
    refused(IndexError, r"sparse_block_table: expected ids in \[0, 200\), got 1000000 at row 0, column 8", far)
    refused(ValueError, "sparse_context_lens: expected at most 2048 tokens .*, got 2049 at row 1",
            lens=torch.tensor([130, 2049], dtype=torch.int32))


def test_a_callers_workspace_is_checked_and_its_counters_zeroed(host_kernels):
    """SparseAttention(workspace=...): a float32, contiguous tensor of at least the attend's 160
    counters (refused by name otherwise); the layer zeroes those counters (the GPU attend's rows
    count their finished splits there, an inserting prefill attend its workgroups) and leaves the
    rest as it was."""
    from msa_iree.ops.tuning import COUNTER_WORDS

    def attn(ws):
        return SparseAttention(16, 1, 128, 128 ** -0.5, BF16, kernels=host_kernels, workspace=ws)

    with pytest.raises(ValueError, match=r"workspace: expected at least 640 bytes \(its counters\), got 636"):
        attn(torch.zeros(159))
    with pytest.raises(ValueError, match="workspace: expected a contiguous tensor"):
        attn(torch.zeros(640)[::2])
    with pytest.raises(ValueError, match="workspace"):
        attn(torch.zeros(640, dtype=torch.float16))
    ws = torch.full((COUNTER_WORDS + 7,), float("nan"))
    attn(ws)
    assert COUNTER_WORDS == 160
    assert not ws[:160].view(torch.int32).any() and ws[160:].isnan().all()
