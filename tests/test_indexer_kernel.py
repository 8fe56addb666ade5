"""The indexer's scores and top-k as a compiled portable kernel (ops/indexer.py) on the host,
against reference.index_topk: ids and order exactly equal, at block edges, for padded rows,
ties, NaN scores, forced init and local blocks, and an fp8 index cache."""
import pytest
import torch

from msa_iree import reference as R
from msa_iree.config import MsaConfig
from msa_iree.ops import IndexTopkSpec

BF16, FN = torch.bfloat16, torch.float8_e4m3fn
POSITIONS = [0, 126, 127, 128, 129, 1000, -1, 2047, 255, 256]  # edges, a padded row, 16 blocks


def case(gen, index_heads, cache_dtype, cols=16, blocks=64):
    """Queries, an index cache and its table for 3 requests, rows at POSITIONS; blocks 5 and 9
    of every request's table hold equal keys (ties), and one key of block 3 is NaN."""
    n = len(POSITIONS)
    q = torch.randn(n, index_heads, 128, generator=gen).to(BF16)
    keys = torch.randn(blocks, 128, 128, generator=gen)
    table = torch.randperm(blocks, generator=gen)[:3 * cols].reshape(3, cols).int()
    for r in range(3):
        keys[table[r, 9]] = keys[table[r, 5]]
    keys[table[1, 3], 17, 4] = float("nan")
    cache = keys.to(cache_dtype)
    req = torch.tensor([r % 3 for r in range(n)], dtype=torch.int32)
    return q, cache, table, req, torch.tensor(POSITIONS, dtype=torch.int32)


def step_rows(computed, qlens):
    """A step of len(qlens) requests, qlens[r] new tokens after computed[r]: (query_start_loc,
    seq_lens, every token's request and position) int32."""
    q_lens = torch.tensor(qlens, dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).int()])
    seq = computed + q_lens
    req = torch.repeat_interleave(torch.arange(len(qlens), dtype=torch.int32), q_lens)
    pos = torch.cat([torch.arange(int(c), int(s)) for c, s in zip(computed, seq)]).int()
    return qsl, seq, req, pos


def run(lib, spec, q, cache, table, req, pos):
    raw = cache.view(torch.uint8) if cache.dtype == FN else cache  # fp8 caches travel as bytes
    (got,) = lib.run(spec, q, raw, table, req, pos, out_dtypes=[torch.int32])
    return got


@pytest.mark.parametrize("heads, cache_dtype, init, local", [(2, "bf16", 0, 1), (1, "bf16", 1, 1),
                                                             (1, "fp8_e4m3fn", 2, 0)])
def test_the_compiled_top_k_is_the_references(host_kernels, heads, cache_dtype, init, local):
    gen = torch.Generator().manual_seed(heads * 10 + init)
    spec = IndexTopkSpec(MsaConfig(num_kv_heads=heads, kv_dtype=cache_dtype), 16, init, local)
    args = case(gen, heads, {"bf16": BF16, "fp8_e4m3fn": FN}[cache_dtype])
    want = R.index_topk(*args, init_blocks=init, local_blocks=local)
    got = run(host_kernels, spec, *args)
    assert got.dtype == torch.int32 and got.shape == (heads, len(POSITIONS), 16)
    assert torch.equal(got, want)
    row = POSITIONS.index(-1)
    assert got[:, row].eq(-1).all()  # a padded row selects nothing
    assert (got[:, POSITIONS.index(129)] >= 0).sum(-1).eq(2).all()  # 2 candidates, the rest -1


def test_ties_go_to_the_smaller_block_and_nan_ranks_below_every_number(host_kernels):
    """A hand-made request: block 0's keys score 1, blocks 1 and 2 tie at 3, block 3 holds a NaN,
    block 4 scores -5 (index_q = e_0, a key's first element its score); the own block (4) is
    forced local. Expected: [4 (local), 1, 2, 0, 3 (NaN: -1e30)]."""
    q = torch.zeros(1, 1, 128, dtype=BF16)
    q[0, 0, 0] = 1
    keys = torch.zeros(5, 128, 128)
    for b, v in enumerate([1.0, 3.0, 3.0, float("nan"), -5.0]):
        keys[b, :, 0] = v
    table = torch.arange(5, dtype=torch.int32)[None]
    pos = torch.tensor([4 * 128 + 10], dtype=torch.int32)
    spec = IndexTopkSpec(MsaConfig(num_kv_heads=1, kv_dtype="bf16"), 16, 0, 1)
    got = run(host_kernels, spec, q, keys.to(BF16), table, torch.zeros(1, dtype=torch.int32), pos)
    assert got[0, 0, :6].tolist() == [4, 1, 2, 0, 3, -1]


def test_fp8_index_queries_score_as_their_e4m3fn_values(host_kernels):
    """e4m3fn index queries (an e4m3fn cache's, as vLLM's model writes them) are cast as they are:
    a hand-made request where the cast decides. index_q = (1, 1.06, 0, ...) is (1, 1.0625) in
    bf16 but (1, 1) in e4m3fn (steps of 0.125 above 1); block 0's keys are (1, 0, ...), block 1's
    (0, 1, ...), block 2 is the own block (forced local). In bf16 block 1 outscores block 0:
    [2, 1, 0]; in e4m3fn they tie and the smaller id goes first: [2, 0, 1]."""
    q = torch.zeros(1, 1, 128)
    q[0, 0, :2] = torch.tensor([1.0, 1.06])
    keys = torch.zeros(3, 128, 128)
    keys[0, :, 0] = 1
    keys[1, :, 1] = 1
    cache = keys.to(FN)
    args = (torch.arange(3, dtype=torch.int32)[None], torch.zeros(1, dtype=torch.int32),
            torch.tensor([2 * 128 + 5], dtype=torch.int32))
    cfg = MsaConfig(num_kv_heads=1, kv_dtype="fp8_e4m3fn")
    bf16 = run(host_kernels, IndexTopkSpec(cfg, 16, 0, 1), q.to(BF16), cache, *args)
    fp8 = host_kernels.run(IndexTopkSpec(cfg, 16, 0, 1, fp8_queries=True), q.to(FN).view(torch.uint8),
                           cache.view(torch.uint8), *args, out_dtypes=[torch.int32])[0]
    assert bf16[0, 0, :4].tolist() == [2, 1, 0, -1]
    assert fp8[0, 0, :4].tolist() == [2, 0, 1, -1]
    assert torch.equal(R.index_topk(q.to(FN), cache, *args), fp8)


@pytest.mark.parametrize("heads, init", [(1, 0), (2, 1)])
def test_the_compiled_top_k_of_fp8_queries_is_the_references(host_kernels, heads, init):
    """Seeded e4m3fn queries against an e4m3fn cache (the rows of `case`: block edges, a padded
    row, ties, a NaN key): ids and order exactly reference.index_topk's."""
    gen = torch.Generator().manual_seed(40 + heads)
    q, cache, table, req, pos = case(gen, heads, FN)
    q = (4 * q.float()).to(FN)  # (e4m3fn's normal range, not only its subnormals)
    spec = IndexTopkSpec(MsaConfig(num_kv_heads=heads, kv_dtype="fp8_e4m3fn"), 16, init, 1, fp8_queries=True)
    (got,) = host_kernels.run(spec, q.view(torch.uint8), cache.view(torch.uint8), table, req, pos,
                              out_dtypes=[torch.int32])
    assert torch.equal(got, R.index_topk(q, cache, table, req, pos, init_blocks=init))


def test_the_spec_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="kv_dtype: expected an index cache of bf16 or fp8_e4m3fn, got fp16"):
        IndexTopkSpec(MsaConfig(kv_dtype="fp16", query_dtype="fp16"))
    with pytest.raises(ValueError, match="init_blocks, local_blocks: expected >= 0, got -1, 1"):
        IndexTopkSpec(MsaConfig(), 16, -1)
    assert IndexTopkSpec(MsaConfig(), 16, 1, 1).name != IndexTopkSpec(MsaConfig(), 16, 0, 1).name
    with pytest.raises(ValueError, match="fp8_queries: expected an fp8_e4m3fn index cache for e4m3fn index "
                                         "queries .*, got a bf16 cache"):
        IndexTopkSpec(MsaConfig(), 16, 0, 1, fp8_queries=True)
    fn = MsaConfig(kv_dtype="fp8_e4m3fn")
    assert IndexTopkSpec(fn, 16, 0, 1, fp8_queries=True).name != IndexTopkSpec(fn, 16, 0, 1).name


def test_a_whole_sparse_layer_runs_as_the_reference(host_kernels):
    """One layer over two steps (two chunked prefills, then a decode of both requests), every part
    compiled: index keys into the index cache (its own block table and slots), the indexer's
    top-k, the K/V insert, the attend over that top-k, and over the page table the indexer emits
    for it; each against the reference (caches, top-k and table exactly, the outputs within the
    attend's tolerance)."""
    from msa_iree.layout import allocate_kv_cache
    from msa_iree.runtime import Indexer, MetadataBuilder, SparseAttention
    from tolerances import assert_attend_close

    gen = torch.Generator().manual_seed(77)
    index_cache = torch.zeros(16, 128, 128, dtype=BF16)
    ref_index = index_cache.clone()
    kc, vc = allocate_kv_cache(16, 1, BF16, "interleaved", fill=0)
    ref_kc, ref_vc = allocate_kv_cache(16, 1, BF16, "interleaved", fill=0)
    index_bt = torch.tensor([[3, 7, 1, 9], [2, 5, 11, 4]], dtype=torch.int32)  # the index group's blocks
    kv_bt = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)     # the attention group's
    scale = 128 ** -0.5
    attn = SparseAttention(16, 1, 128, scale, BF16, kernels=host_kernels)
    indexer = Indexer(1, BF16, kernels=host_kernels)
    kv_builder, index_builder = (MetadataBuilder(4, 512, num_cache_blocks=16, kernels=host_kernels) for _ in range(2))
    computed = torch.tensor([0, 0], dtype=torch.int32)
    for qlens, num_decodes in (([200, 130], 0), ([1, 1], 2)):
        qsl, seq, req, pos = step_rows(computed, qlens)
        slots = lambda bt: (bt.long()[req.long(), pos.long() // 128] * 128 + pos.long() % 128).int()
        kv_md = kv_builder.build(kv_bt, seq, qsl, computed, 1, num_decodes, slot_mapping=slots(kv_bt))
        index_md = index_builder.build(index_bt, seq, qsl, computed, 1, num_decodes, slot_mapping=slots(index_bt))
        n = int(qsl[-1])
        index_k = torch.randn(n, 128, generator=gen).to(BF16)
        index_q = torch.randn(n, 1, 128, generator=gen).to(BF16)
        key, value = (torch.randn(n, 1, 128, generator=gen).to(BF16) for _ in range(2))
        q = torch.randn(n, 16, 128, generator=gen).to(BF16)

        indexer.insert(index_k, index_cache, index_md)
        R.insert_index_cache(index_k, ref_index, slots(index_bt))
        assert torch.equal(index_cache, ref_index)
        topk = indexer.topk(index_q, index_cache, index_md)
        assert torch.equal(topk, R.index_topk(index_q, ref_index, index_bt, req, pos))
        attn.insert_kv(key, value, kc, vc, kv_md)
        R.insert_kv(key, value, ref_kc, ref_vc, slots(kv_bt))
        assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
        out = attn.forward(q, kc, vc, torch.full_like(q, float("nan")), topk, kv_md)
        ref = torch.empty_like(q)
        R.sparse_attn_prefill(q, ref_kc, ref_vc, topk, kv_bt, req, pos, 1, scale, ref)
        assert_attend_close(out, ref, f"step of {qlens}")
        # the attend's page table emitted for that top-k: the builder's table, and the same output
        sbt, sctx = indexer.emit_table(topk, kv_md)
        want_bt, want_ctx = R.build_sparse_block_table_prefill(topk, kv_bt, req, pos, 16)
        assert torch.equal(sbt, want_bt) and torch.equal(sctx, want_ctx)
        by_table = attn.forward(q, kc, vc, torch.full_like(q, float("nan")), topk, kv_md,
                                sparse_block_table=sbt, sparse_context_lens=sctx)
        assert_attend_close(by_table, ref, f"step of {qlens}, emitted table")
        # both at once into a caller's buffers (rows past the step untouched)
        bufs = (torch.full((1, n + 2, 16), -7, dtype=torch.int32), torch.full((n + 2, 1, 128), -7, dtype=torch.int32),
                torch.full((n + 2, 1), -7, dtype=torch.int32))
        got = indexer.topk_with_table(index_q, index_cache, index_md, kv_md, out=bufs[0], table_out=bufs[1:])
        assert got[0] is bufs[0] and torch.equal(got[0][:, :n], topk) and got[0][:, n:].eq(-7).all()
        assert torch.equal(got[1], want_bt) and torch.equal(got[2], want_ctx)
        assert bufs[1][n:].eq(-7).all() and bufs[2][n:].eq(-7).all()
        computed = seq


def test_the_indexer_refuses_bad_calls_by_name(host_kernels):
    from msa_iree.runtime import Indexer, MetadataBuilder

    with pytest.raises(ValueError, match="kv_dtype: expected an index cache of bf16 or fp8_e4m3fn, got fp16"):
        Indexer(1, torch.float16, kernels=host_kernels)
    indexer = Indexer(1, BF16, kernels=host_kernels)
    md = MetadataBuilder(2, 512, kernels=host_kernels).build(
        torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([129], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([128], dtype=torch.int32), 1, 1,
        slot_mapping=torch.tensor([300], dtype=torch.int32))
    cache = torch.zeros(2, 128, 128, dtype=BF16)
    with pytest.raises(ValueError, match="index_cache: expected torch.bfloat16"):
        indexer.topk(torch.zeros(1, 1, 128, dtype=BF16), cache.float(), md)
    with pytest.raises(ValueError, match=r"index_q: expected shape \[\*, 1, 128\]"):
        indexer.topk(torch.zeros(1, 2, 128, dtype=BF16), cache, md)
    with pytest.raises(IndexError, match="slot_mapping: expected slots below index_cache's 256 tokens, got 300"):
        indexer.insert(torch.zeros(1, 128, dtype=BF16), cache, md)
    with pytest.raises(TypeError, match="metadata: expected the index group's MsaMetadata"):
        indexer.topk(torch.zeros(1, 1, 128, dtype=BF16), cache, None)
    with pytest.raises(ValueError, match=r"out: expected a contiguous \[1, >= 1, 16\] int32 tensor, got shape \(1, 1, 8\)"):
        indexer.topk(torch.zeros(1, 1, 128, dtype=BF16), cache, md, out=torch.zeros(1, 1, 8, dtype=torch.int32))


def test_the_indexer_takes_fp8_queries_as_vllm_writes_them(host_kernels):
    """runtime.Indexer for an e4m3fn index cache with e4m3fn index queries (vLLM's MiniMax-M3 casts
    them to the cache's dtype) and bf16 index keys: the insert and the top-k of a chunked prefill
    and a decode step as the reference; a bf16 query is refused by name."""
    from msa_iree.runtime import Indexer, MetadataBuilder

    gen = torch.Generator().manual_seed(91)
    indexer = Indexer(1, FN, query_dtype=FN, kernels=host_kernels)
    builder = MetadataBuilder(4, 512, num_cache_blocks=16, kernels=host_kernels)
    index_bt = torch.tensor([[3, 7, 1, 9], [2, 5, 11, 4]], dtype=torch.int32)
    cache, ref_cache = torch.zeros(16, 128, 128, dtype=FN), torch.zeros(16, 128, 128, dtype=FN)
    computed = torch.tensor([0, 0], dtype=torch.int32)
    for qlens, num_decodes in (([300, 129], 0), ([1, 1], 2)):
        qsl, seq, req, pos = step_rows(computed, qlens)
        slots = (index_bt.long()[req.long(), pos.long() // 128] * 128 + pos.long() % 128).int()
        md = builder.build(index_bt, seq, qsl, computed, 1, num_decodes, slot_mapping=slots)
        n = int(qsl[-1])
        index_k = torch.randn(n, 128, generator=gen).to(BF16)
        index_q = (2 * torch.randn(n, 1, 128, generator=gen)).to(FN)
        indexer.insert(index_k, cache, md)
        R.insert_index_cache(index_k, ref_cache, slots)
        assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
        assert torch.equal(indexer.topk(index_q, cache, md), R.index_topk(index_q, ref_cache, index_bt, req, pos))
        computed = seq
    with pytest.raises(ValueError, match="index_q: expected torch.float8_e4m3fn, got torch.bfloat16"):
        indexer.topk(index_q.to(BF16), cache, md)
    with pytest.raises(ValueError, match="fp8_queries: expected an fp8_e4m3fn index cache"):
        Indexer(1, BF16, query_dtype=FN, kernels=host_kernels)
    with pytest.raises(ValueError, match="query_dtype: expected one of .*float8_e4m3fn, got torch.float8_e4m3fnuz"):
        Indexer(1, FN, query_dtype=torch.float8_e4m3fnuz, kernels=host_kernels)


def test_a_missing_indexer_kernel_names_the_command_that_builds_it(tmp_path):
    """A build without the indexer (msa-iree compile without --index-cache-dtype): the indexer's
    call is an error naming the command that builds its kernels."""
    from msa_iree.compile import BuildMismatchError, build
    from msa_iree.runtime import Indexer, KernelLibrary, MetadataBuilder

    build(None, ["host"], tmp_path, specs=[], log=lambda m: None)
    lib = KernelLibrary("host", tmp_path)
    md = MetadataBuilder(2, 512, kernels=KernelLibrary("host", compile_missing=True, log=lambda m: None)).build(
        torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([129], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([128], dtype=torch.int32), 1, 1)
    indexer = Indexer(1, FN, init_blocks=1, kernels=lib)
    with pytest.raises(BuildMismatchError, match=r"index_topk\.h1\.fp8_e4m3fn.* build it with `msa-iree compile "
                                                 r"--target host .*--index-cache-dtype fp8_e4m3fn --index-init-blocks 1 "
                                                 r"--index-local-blocks 1 --out "):
        indexer.topk(torch.zeros(1, 1, 128, dtype=BF16), torch.zeros(2, 128, 128, dtype=FN), md)
    fp8_queries = Indexer(1, FN, query_dtype=FN, kernels=lib)
    with pytest.raises(BuildMismatchError, match=r"index_topk\.h1\.fp8_e4m3fn\.qfp8_e4m3fn.* build it with `msa-iree "
                                                 r"compile --target host .*--index-local-blocks 1 --index-query-dtype "
                                                 r"fp8_e4m3fn --out "):
        fp8_queries.topk(torch.zeros(1, 1, 128, dtype=FN), torch.zeros(2, 128, 128, dtype=FN), md)
