"""The benchmark harness on the CPU: its generated cases are what the protocol says (every row
sees 16 blocks with its own block among them, rotations map into the pool, fp8 bytes are finite),
a host run checks the output against the reference, and a recorded run prints back."""
import pytest
import torch

from benchmarks import bench
from msa_iree.layout import BLOCK_SIZE, block_pages, num_cache_blocks

def test_decode_case_follows_the_protocol():
    c = bench.DecodeCase(batch=3, context=4100, L=2, num_heads=16, kv_dtype=torch.bfloat16, device=torch.device("cpu"),
                         rotations=3, seed=1, pool_bytes=1 << 20)
    pos = (c.seq_lens.long().repeat_interleave(2) - 2 + torch.arange(2).repeat(3))
    own = pos // BLOCK_SIZE
    topk = c.topk[0].long()
    assert topk.shape == (6, 16)
    assert torch.equal(topk[:, 0], own)                       # the query's own block is always there
    assert ((topk >= 0) & (topk <= own[:, None])).all()        # 16 valid, causal blocks ...
    assert all(len(set(row.tolist())) == 16 for row in topk)   # ... all distinct: 2048 visible tokens
    assert c.visible_tokens == 3 * (2 * 15 * BLOCK_SIZE + (4098 % 128 + 1) + (4099 % 128 + 1))  # 15 whole + own
    assert c.kv_bytes == c.visible_tokens * 128 * 2 * 2
    pool = c.k_cache.shape[0] // 16
    for table in c.bt_rot:                                      # each rotation: an injective map into the pool
        ids = table.reshape(-1)
        assert ids.unique().numel() == ids.numel() and int(ids.min()) >= 0 and int(ids.max()) < pool
    assert not torch.equal(c.bt_rot[0], c.bt_rot[1])


def test_short_context_rows_are_padded():
    c = bench.DecodeCase(batch=2, context=300, L=1, num_heads=16, kv_dtype=torch.bfloat16, device=torch.device("cpu"),
                         rotations=1, pool_bytes=1 << 20)
    topk = c.topk[0]
    assert topk.shape == (2, 16)
    assert (topk >= 0).sum(1).tolist() == [3, 3] and (topk[:, 3:] == -1).all()  # blocks 0..2, then -1
    assert c.visible_tokens == 2 * 300


def test_fp8_case_bytes_are_finite_in_both_formats():
    for dtype in (torch.float8_e4m3fnuz, torch.float8_e4m3fn):
        c = bench.DecodeCase(batch=1, context=256, L=1, num_heads=8, kv_dtype=dtype, device=torch.device("cpu"),
                             rotations=1, pool_bytes=1 << 20)
        raw = c.k_cache.view(torch.uint8).reshape(-1)
        assert not (raw == 0x80).any() and not ((raw & 0x7F) == 0x7F).any()
        assert torch.isfinite(c.k_cache.float()).all()


def test_host_run_checks_against_the_reference(monkeypatch, host_kernels):
    monkeypatch.setattr(bench, "POOL_BYTES", 1 << 20)
    row = bench.bench_decode(host_kernels, torch.device("cpu"), batch=2, context=300, L=1, num_heads=16,
                             kv_name="fp8_e4m3fnuz", iters=2, rotations=1)
    assert row["kernel"] == "portable" and row["forward_us"] > 0 and row["torch_us"] > 0


def test_a_wrong_output_is_not_benchmarked(monkeypatch, host_kernels):
    """The harness times nothing whose output differs from the reference: with the reference
    perturbed (as a wrong kernel would differ from it), the case raises instead of reporting."""
    real = bench.reference.sparse_paged_attend

    def off_by_one(*args):
        out = real(*args)
        out += 1.0
        return out

    monkeypatch.setattr(bench, "POOL_BYTES", 1 << 20)
    monkeypatch.setattr(bench.reference, "sparse_paged_attend", off_by_one)
    with pytest.raises(RuntimeError, match="differs from the reference"):
        bench.bench_decode(host_kernels, torch.device("cpu"), batch=2, context=300, L=1, num_heads=16,
                           kv_name="bf16", iters=1, rotations=1)


def test_host_prefill_row_checks_against_the_reference(host_kernels):
    # the prefill row's wall-clock pass; on the host its kernel time is the forward's (cuda adds
    # it in the run's last, profiled pass)
    row = bench.bench_prefill(host_kernels, torch.device("cpu"), "fp8_e4m3fnuz", iters=1, q_len=5, context=300,
                              num_heads=16)
    assert row["phase"] == "prefill" and row["kernel"] == "portable"
    assert row["kernel_us"] == row["forward_us"] > 0 and row["torch_us"] > 0
    assert row["GBps"] > 0 and row["kv_MB"] > 0


def test_layer_caches_are_disjoint_slices_of_the_pool():
    # step_us's layers: layer i reads, through the case's block table, the pool's blocks of slice i
    c = bench.DecodeCase(batch=2, context=300, L=1, num_heads=16, kv_dtype=torch.bfloat16, device=torch.device("cpu"),
                         rotations=1, pool_bytes=1 << 20)
    assert c.slices >= 2 and int(c.block_table.max()) < c.mapped
    ids = c.block_table.reshape(-1)
    pages = block_pages(c.k_cache, c.v_cache, ids)
    for i in range(c.slices + 1):
        k, v = c.layer_cache(i)
        assert num_cache_blocks(k, v) == c.mapped
        shifted = block_pages(c.k_cache, c.v_cache, ids + i % c.slices * c.mapped)
        assert torch.equal(k[pages], c.k_cache[shifted]) and torch.equal(v[pages], c.v_cache[shifted])
        assert k.data_ptr() == c.k_cache[shifted[0, 0] - pages[0, 0]].data_ptr()


def test_the_indexer_benchmark_pads_block_tables_as_vllm_does():
    """--columns: a decode case's block tables are that wide, each request's own blocks first (one
    permutation of the cache's blocks over the batch), zeros after; the reference rows read only
    the candidates; a table narrower than the context is refused by name."""
    from benchmarks import indexer

    cpu = torch.device("cpu")
    q, cache, table, seq, req, pos = indexer.decode_case(3, 300, 2, "bf16", cpu, torch.Generator().manual_seed(0),
                                                         columns=64)
    assert table.shape == (3, 64) and not table[:, 3:].any()
    assert sorted(table[:, :3].reshape(-1).tolist()) == list(range(9)) and cache.shape[0] == 9
    assert pos.tolist() == [298, 299] * 3 and req.tolist() == [0, 0, 1, 1, 2, 2] and seq.tolist() == [300] * 3
    rows, want = indexer.reference_rows(q, cache, table, req, pos, request=1)
    assert rows.tolist() == [2, 3]
    from msa_iree import reference as R
    assert torch.equal(want, R.index_topk(q[2:4], cache, table[1:2], torch.zeros(2, dtype=torch.int32), pos[2:4]))
    with pytest.raises(ValueError, match="--columns: expected at least the 3 blocks of a 300-token context, got 2"):
        indexer.decode_case(1, 300, 1, "bf16", cpu, torch.Generator().manual_seed(0), columns=2)


def test_the_wake_probe_times_each_work_after_each_wait(capsys):
    """benchmarks.host_wake on the host: a row per (work, sleep / spin), a duration per wait (spin
    rows none at 0 ms), and its steps are the builder's decode and mixed steps."""
    from benchmarks import host_wake

    table, seq, qsl, computed, slots, num_decodes = host_wake.step_inputs(torch.device("cpu"), host_wake.CHUNK)
    assert int(qsl[-1]) == host_wake.BATCH - 1 + host_wake.CHUNK and num_decodes == host_wake.BATCH - 1
    assert torch.equal(seq - computed, qsl[1:] - qsl[:-1]) and slots.unique().numel() == slots.numel()
    rows = host_wake.main(["--reps", "3", "--waits", "0,1"])
    assert [(r["work"], r["wait"]) for r in rows] == [(w, s) for w in ("build decode", "build mixed", "numpy loop")
                                                      for s in ("sleep", "spin")]
    assert all(set(r["us_after_ms"]) == ({0.0, 1.0} if r["wait"] == "sleep" else {1.0}) for r in rows)
    assert all(v > 0 for r in rows for v in r["us_after_ms"].values())
    assert "build mixed" in capsys.readouterr().out


def test_the_indexer_benchmark_gives_both_sides_the_queries_vllm_writes():
    """--queries vllm (the default): an e4m3fn index cache's queries in e4m3fn for Triton and
    msa-iree alike, as vLLM's model writes them, and msa-iree's kernels there the ones its vLLM
    plugin serves (fp8_queries); bf16 caches, and --queries bf16, keep bf16 queries."""
    from benchmarks import indexer
    from msa_iree.ops import indexer_set
    from msa_iree.ops.indexer import indexer_config

    q = torch.randn(5, 1, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q8 = indexer.index_queries(q, "fp8_e4m3fn", "vllm")
    assert q8.dtype == torch.float8_e4m3fn and torch.equal(q8, q.to(torch.float8_e4m3fn))
    assert indexer.index_queries(q, "bf16", "vllm") is q and indexer.index_queries(q, "fp8_e4m3fn", "bf16") is q
    with pytest.raises(ValueError, match="--queries: expected one of \\('vllm', 'bf16'\\), got 'fp8'"):
        indexer.index_queries(q, "fp8_e4m3fn", "fp8")
    raw, fp8 = indexer.msa_queries(q8)
    assert fp8 and raw.dtype == torch.uint8 and torch.equal(raw, q8.view(torch.uint8))
    assert indexer.msa_queries(q) == (q, False)

    served = indexer_set(indexer_config(1, "fp8_e4m3fn", "bf16"), "cuda", fp8_queries=True)
    for L in (1, 4):  # the decode kernel of the served dot is the plugin's, for each of the grid's L
        (spec,) = [s for (rows, emit), s in served.topk_gpu.items() if not emit and rows == indexer.INDEXER.rows_for(L, 1)]
        assert indexer.decode_spec("fp8_e4m3fn", L, spec.dot, True) == spec and spec.fp8_queries
    assert indexer.prefill_specs("fp8_e4m3fn", ("mma", "fma"), True)[0] == served.gpu_tiled()
    names = {s.name for s in indexer.bench_specs()}
    grid_rows = {indexer.INDEXER.rows_for(L, 1) for _, _, L in indexer.CASES}
    assert served.gpu_tiled().name in names
    assert all(s.name in names for (rows, _), s in served.topk_gpu.items() if rows in grid_rows)
