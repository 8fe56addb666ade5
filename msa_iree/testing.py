"""Seeded random MSA cases for tests and benchmarks.

A case is a batch of requests over a packed SHUFFLE cache with a random block table and a
top-k selection that stresses the table builder: the query's own block (usually), random older
blocks, -1 holes, blocks in the future, unsorted order.
"""
from __future__ import annotations

import dataclasses

import torch

from .layout import BLOCK_SIZE, HEAD_DIM, is_fp8, pack_kv_cache, quantize_fp8
from .reference import decode_token_positions, query_token_positions


def cdiv(a, b):
    return -(-a // b)


@dataclasses.dataclass
class Case:
    q: torch.Tensor                 # [T, Hq, 128]
    k_cache: torch.Tensor           # SHUFFLE views
    v_cache: torch.Tensor
    k_logical: torch.Tensor         # [blocks, 128, H, 128] (cache dtype)
    v_logical: torch.Tensor
    topk: torch.Tensor              # [H, T, K] int32
    block_table: torch.Tensor       # [reqs, cols] int32
    seq_lens: torch.Tensor          # [reqs] int32, KV length including the new tokens
    query_req_id: torch.Tensor      # [T] int32
    query_abs_pos: torch.Tensor     # [T] int32
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    scale: float
    num_kv_heads: int
    decode_query_len: int | None = None       # set for decode cases
    cu_seqlens_q: torch.Tensor | None = None  # set for prefill cases
    prefix_lens: torch.Tensor | None = None


def random_topk_row(gen, abs_pos, topk, *, keep_own=True, holes=True, future=True):
    """One selection of `topk` logical block ids for a query at abs_pos (int32, -1 padded)."""
    if abs_pos < 0:
        return [-1] * topk
    own = abs_pos // BLOCK_SIZE
    older = torch.randperm(own, generator=gen).tolist()
    chosen = ([own] if keep_own else []) + older
    chosen = chosen[: topk]
    if future and len(chosen) < topk and torch.rand((), generator=gen) < 0.5:
        chosen.append(own + 1 + int(torch.randint(0, 3, (), generator=gen)))
    row = chosen + [-1] * (topk - len(chosen))
    if holes:  # shuffle so that -1 holes and the tail land anywhere in the row
        row = [row[i] for i in torch.randperm(topk, generator=gen).tolist()]
    return row


def _cache_and_table(gen, seq_lens, num_kv_heads, kv_dtype, layout, spare_blocks, scale_mode):
    blocks_per_req = [cdiv(int(s), BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    cols = max(max(blocks_per_req), 1)
    block_table = torch.full((len(seq_lens), cols), -1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = perm[used:used + n].int()
        used += n
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    k_scale = v_scale = None
    if is_fp8(kv_dtype):
        if scale_mode == "tensor":
            k_scale, v_scale = torch.tensor([0.37]), torch.tensor([1.9])
        else:  # per token, [H, slots], varying across heads and tokens
            k_scale = 0.1 + torch.rand(num_kv_heads, num_blocks * BLOCK_SIZE, generator=gen)
            v_scale = 0.1 + torch.rand(num_kv_heads, num_blocks * BLOCK_SIZE, generator=gen)
        k = _quantize_logical(k, k_scale, kv_dtype)
        v = _quantize_logical(v, v_scale, kv_dtype)
    else:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    k_cache, v_cache = pack_kv_cache(k, v, layout)
    return k, v, k_cache, v_cache, block_table, k_scale, v_scale


def _quantize_logical(x, scale, dtype):
    if scale.numel() == 1:
        return quantize_fp8(x, scale, dtype)
    nb, _, h, _ = x.shape
    per_elem = scale.T.reshape(nb, BLOCK_SIZE, h, 1)  # scale[h, block*128 + o]
    return quantize_fp8(x, per_elem, dtype)


def _topk_for(gen, abs_pos, num_kv_heads, topk, keep_own_prob):
    rows = []
    for h in range(num_kv_heads):
        rows.append([random_topk_row(gen, int(p), topk,
                                     keep_own=bool(torch.rand((), generator=gen) < keep_own_prob))
                     for p in abs_pos])
    return torch.tensor(rows, dtype=torch.int32).reshape(num_kv_heads, len(abs_pos), topk)


def decode_case(seq_lens, *, decode_query_len=1, num_heads=16, num_kv_heads=1, kv_dtype=torch.bfloat16,
                q_dtype=torch.bfloat16, layout="interleaved", topk=16, seed=0, spare_blocks=2,
                keep_own_prob=0.9, scale_mode="tensor") -> Case:
    """A decode batch: request r has seq_lens[r] tokens, its last L new (0 = padded request)."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    k, v, kc, vc, bt, ks, vs = _cache_and_table(gen, seq_lens, num_kv_heads, kv_dtype, layout,
                                                spare_blocks, scale_mode)
    req, pos = decode_token_positions(seq, decode_query_len)
    q = torch.randn(len(pos), num_heads, HEAD_DIM, generator=gen).to(q_dtype)
    tk = _topk_for(gen, pos.tolist(), num_kv_heads, topk, keep_own_prob)
    return Case(q, kc, vc, k, v, tk, bt, seq, req, pos, ks, vs, HEAD_DIM ** -0.5, num_kv_heads,
                decode_query_len=decode_query_len)


def prefill_case(query_lens, prefix_lens, *, num_heads=16, num_kv_heads=1, kv_dtype=torch.bfloat16,
                 q_dtype=torch.bfloat16, layout="interleaved", topk=16, seed=0, spare_blocks=2,
                 keep_own_prob=0.9, scale_mode="tensor") -> Case:
    """A chunked-prefill batch: request r computes query_lens[r] tokens after prefix_lens[r]."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, query_lens)]
    k, v, kc, vc, bt, ks, vs = _cache_and_table(gen, seq_lens, num_kv_heads, kv_dtype, layout,
                                                spare_blocks, scale_mode)
    cu = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    prefix = torch.tensor(prefix_lens, dtype=torch.int32)
    req, pos = query_token_positions(cu, prefix, int(cu[-1]))
    q = torch.randn(len(pos), num_heads, HEAD_DIM, generator=gen).to(q_dtype)
    tk = _topk_for(gen, pos.tolist(), num_kv_heads, topk, keep_own_prob)
    return Case(q, kc, vc, k, v, tk, bt, torch.tensor(seq_lens, dtype=torch.int32), req, pos, ks, vs,
                HEAD_DIM ** -0.5, num_kv_heads, cu_seqlens_q=cu, prefix_lens=prefix)
