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


def test_the_spec_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="kv_dtype: expected an index cache of bf16 or fp8_e4m3fn, got fp16"):
        IndexTopkSpec(MsaConfig(kv_dtype="fp16", query_dtype="fp16"))
    with pytest.raises(ValueError, match="init_blocks, local_blocks: expected >= 0, got -1, 1"):
        IndexTopkSpec(MsaConfig(), 16, -1)
    assert IndexTopkSpec(MsaConfig(), 16, 1, 1).name != IndexTopkSpec(MsaConfig(), 16, 0, 1).name
