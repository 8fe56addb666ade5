"""The indexer's kernels, portable (iree-turbine export, every target): the index-cache insert,
and the block scores and top-k:
`reference.index_topk` for rows given by request and absolute position (decode and prefill
alike), the top-16 chosen by sixteen rounds of max-then-smallest-id, so that ties go to the
smaller block id as the reference's stable sort has it.

What it computes for every (token, index head): the scores of all of the request's blocks in
the index block table, [T, H, C] from a [T, C, 128, 128] key gather, so it is meant for the
host and for tests: its memory grows with tokens x columns (a 32K-token row gathers 8 MiB of
keys), and IREE splits it into 54 dispatches on gfx942. The GPU kernel is ops/indexer_gpu.py.

Shapes: T tokens, H index heads, C index block-table columns, N index-cache blocks.
"""
from __future__ import annotations

import dataclasses

import torch

from ..config import FP8_DTYPES, MsaConfig
from ..layout import BLOCK_SIZE, HEAD_DIM
from .fp8 import decode_fp8, encode_fp8, storage_dtype
from .portable import _dims, flat_index2, rows_per_call
from .spec import ExportedSpec

FORCED_INIT_SCORE, FORCED_LOCAL_SCORE, NAN_SCORE = 1e30, 1e29, -1e30  # as reference.index_topk
INDEX_CACHE_DTYPES = ("bf16", "fp8_e4m3fn")
# index queries in e4m3fn (`fp8_queries`): what vLLM's MiniMax-M3 writes for an fp8 index cache,
# its queries cast to the cache's dtype
FP8_QUERIES_CACHE = "fp8_e4m3fn"
# the index queries' dtypes: 16-bit (cfg.query_dtype), or e4m3fn (fp8_queries)
INDEX_QUERY_DTYPES = ("bf16", "fp16", FP8_QUERIES_CACHE)


def indexer_config(num_index_heads: int, index_cache_dtype: str, query_dtype: str) -> MsaConfig:
    """The config the indexer's kernels are specialised on: num_kv_heads = index heads per rank (one
    per KV head), kv_dtype = the index cache's dtype, query_dtype = the index keys' (the insert's
    input) and, unless the kernels take fp8_queries, the index queries'."""
    return MsaConfig(num_heads=16 * num_index_heads, num_kv_heads=num_index_heads, kv_dtype=index_cache_dtype,
                     query_dtype=query_dtype)


def check_index_cache_dtype(cfg, fp8_queries: bool = False):
    """cfg.kv_dtype is the index cache's: refuse what the indexer kernels cannot read."""
    if cfg.kv_dtype not in INDEX_CACHE_DTYPES:
        raise ValueError(f"kv_dtype: expected an index cache of {' or '.join(INDEX_CACHE_DTYPES)}, got {cfg.kv_dtype}")
    if fp8_queries and cfg.kv_dtype != FP8_QUERIES_CACHE:
        raise ValueError(f"fp8_queries: expected an {FP8_QUERIES_CACHE} index cache for e4m3fn index queries (the "
                         f"queries vLLM casts to its fp8 index cache's dtype), got a {cfg.kv_dtype} cache")


def index_q_dtype(cfg, fp8_queries: bool) -> str:
    """The index queries' dtype name: e4m3fn for fp8_queries, else cfg.query_dtype."""
    return FP8_QUERIES_CACHE if fp8_queries else cfg.query_dtype


def example_index_cache(cfg):
    """An export example of the index cache [N, 128, 128] (storage dtype) and its dynamic block count."""
    cache = torch.zeros(4, BLOCK_SIZE, HEAD_DIM, dtype=storage_dtype(cfg.kv_torch_dtype))
    return cache, torch.export.Dim("index_blocks", min=2, max=2 ** 31 - 1)


def block_scores(index_q, keys, abs_pos):
    """index_q [T, H, 128] f32; keys [T, C, 128, 128] f32 (block c's positions); abs_pos [T] int64
    -> [T, H, C] f32: the max of dot(q, key p) over the block's positions p <= abs_pos (-inf: none)."""
    s = torch.einsum("thd,tcpd->thcp", index_q, keys)
    c = keys.shape[1]
    position = torch.arange(c)[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)[None, :]   # [C, 128]
    seen = position[None, None] <= abs_pos[:, None, None, None]
    return torch.where(seen, s, float("-inf")).amax(-1)


def forced(scores, abs_pos, init_blocks, local_blocks):
    """The candidates' scores with the forced blocks and NaN as the reference has them; -inf past
    the candidates. Returns (scores [T, H, C], candidates [T] int64)."""
    c = scores.shape[-1]
    b = torch.arange(c)[None, :]
    candidates = (torch.div(abs_pos.clamp(min=-1), BLOCK_SIZE, rounding_mode="floor") + 1).clamp(min=0)
    visible = (b < candidates[:, None])[:, None, :]                                      # [T, 1, C]
    scores = torch.where(torch.isnan(scores), NAN_SCORE, scores)
    scores = torch.where(torch.logical_and(visible, (b < init_blocks)[:, None, :]), FORCED_INIT_SCORE, scores)
    local = (b >= candidates[:, None] - local_blocks)[:, None, :]
    scores = torch.where(torch.logical_and(visible, local), FORCED_LOCAL_SCORE, scores)
    return torch.where(visible, scores, float("-inf")), candidates


def top_blocks(scores, candidates, k):
    """[T, H, C] scores -> [H, T, k] int32 block ids, highest first, ties to the smaller id;
    min(k, candidates) of them, -1 after. A visible block of score -inf still ranks (last)."""
    t, h, c = scores.shape
    # block ids as f32 (exact below 2**24): CUDA's codegen fails to distribute an i64 min reduction
    cols = torch.arange(c, dtype=torch.float32)[None, None, :]
    available = torch.ones(t, h, c, dtype=torch.bool)
    picks = []
    for _ in range(k):
        best = torch.where(available, scores, float("-inf")).amax(-1, keepdim=True)
        at = torch.logical_and(available, scores == best)
        pick = torch.where(at, cols, float("inf")).amin(-1)                               # [T, H]; inf: none
        available = torch.logical_and(available, cols != pick[..., None])
        picks.append(pick)
    picked = torch.stack(picks, -1)                                                       # [T, H, k]
    keep = (torch.arange(k)[None, :] < candidates.clamp(max=k)[:, None])[:, None, :]
    keep = torch.logical_and(keep, picked < float("inf"))
    return torch.where(keep, picked, -1.0).to(torch.int32).permute(1, 0, 2)


class IndexTopk(torch.nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.spec = spec

    def forward(self, index_q, index_cache, index_block_table, req_id, abs_pos):
        """index_q [T, H, 128] bf16/fp16 (fp8_queries: e4m3fn bytes); index_cache [N, 128, 128]
        bf16 (or fp8 bytes); index_block_table [R, C] int32; req_id, abs_pos [T] int32 -> topk
        [H, T, 16] int32."""
        s = self.spec
        table = index_block_table.to(torch.int64)
        cols = torch.arange(table.shape[1])
        req = req_id.to(torch.int64).clamp(0, table.shape[0] - 1)
        blocks = flat_index2(table, req[:, None], cols[None, :]).clamp(0, index_cache.shape[0] - 1)   # [T, C]
        keys = index_cache[blocks]                                                        # [T, C, 128, 128]
        keys = decode_fp8(keys, s.cfg.kv_torch_dtype) if s.cfg.kv_torch_dtype in FP8_DTYPES else keys.float()
        pos = abs_pos.to(torch.int64)
        q = decode_fp8(index_q, torch.float8_e4m3fn) if s.fp8_queries else index_q.float()
        scores = block_scores(q, keys, pos)
        scores, candidates = forced(scores, pos, s.init_blocks, s.local_blocks)
        return top_blocks(scores, candidates, s.cfg.topk)


@dataclasses.dataclass(frozen=True)
class IndexTopkSpec(ExportedSpec):
    """The indexer's scores and top-k for rows given by request and position (cfg: num_kv_heads =
    index heads per rank, kv_dtype = the index cache's dtype, bf16 or fp8_e4m3fn; query_dtype =
    the index queries'); init_blocks / local_blocks: MiniMax-M3's sparse_init_block /
    sparse_local_block; fp8_queries: the index queries in e4m3fn instead (as bytes, the cache's
    storage; an e4m3fn index cache only), cast as they are: no scale."""

    init_blocks: int = 0
    local_blocks: int = 1
    fp8_queries: bool = False

    kernel = "index_topk"

    def __post_init__(self):
        check_index_cache_dtype(self.cfg, self.fp8_queries)
        if self.init_blocks < 0 or self.local_blocks < 0:
            raise ValueError(f"init_blocks, local_blocks: expected >= 0, got {self.init_blocks}, {self.local_blocks}")

    @property
    def variant(self):
        c = self.cfg
        return (f"h{c.num_kv_heads}.{c.kv_dtype}.q{index_q_dtype(c, self.fp8_queries)}.k{c.topk}.init{self.init_blocks}."
                f"local{self.local_blocks}")

    def module(self):
        return IndexTopk(self)

    def rows_per_call(self, columns: int) -> int:
        """Tokens of one call over an index block table of `columns` columns: a token gathers the
        128 keys of every column as f32."""
        return rows_per_call(columns * BLOCK_SIZE * HEAD_DIM * 4)

    def example_args(self):
        c = self.cfg
        z = torch.zeros(3, dtype=torch.int32)
        q_dtype = torch.uint8 if self.fp8_queries else c.query_torch_dtype
        return (torch.zeros(3, c.num_kv_heads, HEAD_DIM, dtype=q_dtype), example_index_cache(c)[0],
                torch.zeros(2, 4, dtype=torch.int32), z, z.clone())

    def dynamic_shapes(self):
        d = _dims()
        return {"index_q": {0: d["T"]}, "index_cache": {0: example_index_cache(self.cfg)[1]}, "index_block_table": {0: d["B"], 1: d["C"]},
                "req_id": {0: d["T"]}, "abs_pos": {0: d["T"]}}


class IndexCacheInsert(torch.nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.spec = spec

    def forward(self, index_cache, index_k, token_index, slot_mapping):
        """index_cache [N, 128, 128] (storage dtype), returned updated; index_k [T, 128] 16-bit;
        token_index [M] int32 rows of index_k to write at slot_mapping [M] (>= 0: the runtime
        drops padding first, as for the KV insert)."""
        rows = token_index.to(torch.int64).clamp(0, index_k.shape[0] - 1)
        slots = slot_mapping.to(torch.int64).clamp(0, index_cache.shape[0] * BLOCK_SIZE - 1)
        values = index_k[rows]
        kv_dtype = self.spec.cfg.kv_torch_dtype
        values = encode_fp8(values.float(), kv_dtype) if kv_dtype in FP8_DTYPES else values.to(index_cache.dtype)
        at = (slots[:, None] * HEAD_DIM + torch.arange(HEAD_DIM)[None, :]).reshape(-1)
        return torch.scatter(index_cache.reshape(-1), 0, at, values.reshape(-1)).reshape(index_cache.shape)


@dataclasses.dataclass(frozen=True)
class IndexCacheInsertSpec(ExportedSpec):
    """The index-cache insert (reference.insert_index_cache: cast with no scale; cfg.kv_dtype =
    the index cache's dtype, query_dtype = the index keys')."""

    kernel = "insert_index_cache"

    def __post_init__(self):
        check_index_cache_dtype(self.cfg)

    @property
    def variant(self):
        return f"{self.cfg.kv_dtype}.q{self.cfg.query_dtype}"

    def module(self):
        return IndexCacheInsert(self)

    def example_args(self):
        z = torch.zeros(2, dtype=torch.int32)
        return (example_index_cache(self.cfg)[0], torch.zeros(3, HEAD_DIM, dtype=self.cfg.query_torch_dtype), z,
                z.clone())

    def dynamic_shapes(self):
        d = _dims()
        m = torch.export.Dim("written", min=1, max=2 ** 20)
        return {"index_cache": {0: example_index_cache(self.cfg)[1]}, "index_k": {0: d["N"]}, "token_index": {0: m}, "slot_mapping": {0: m}}
