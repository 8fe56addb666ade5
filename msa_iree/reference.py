"""Torch eager reference of MiniMax-M3 sparse attention on the AITER page-16 path (docs/SPEC.md).

This module is the statement of the semantics every compiled kernel is tested against. It is
written to be read: short functions, fp32 math, no cleverness. Names and argument orders are
vLLM's own (docs/SPEC.md cites its files).

Shapes (T query tokens, Hq query heads, H KV heads, K = top-k = 16, R = T * H table rows):
    q            [T, Hq, 128] bf16/fp16
    k_cache      [pages, H, 128/x, 16, x]   SHUFFLE page-16 view (layout.py)
    v_cache      [pages', H, 16/x, 128, x]
    topk         [H, T, K] int32 logical block ids, -1 = none
    block_table  [reqs, cols] int32 vLLM block ids (128-token blocks), unrebased
    sparse_bt    [R, K*8] int32 page ids, row r = t*H + h (head-minor), id folded as page*H + h
    sparse_ctx   [R] int32 tokens of the row's virtual sequence
"""
from __future__ import annotations

import torch

from . import checks
from .layout import (BLOCK_SIZE, HEAD_DIM, PAGE_SIZE, PAGES_PER_BLOCK, block_page_stride,
                     elements_per_16_bytes, is_fp8, logical_slots_of_pages,
                     quantize_fp8, sides_are_packed)

# ---- the page-16 rebase ---------------------------------------------------------------------


def rebase_block_table_to_page16(block_table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[reqs, cols] int32 -> block ids doubled (K and V share a block), negatives preserved."""
    page16 = block_table * 2
    if out is None:
        return page16
    checks.check_shape("out", out, tuple(block_table.shape))
    out.copy_(page16)
    return out


def rebase_slots_to_page16(slot_mapping: torch.Tensor) -> torch.Tensor:
    """slot = b*128 + o -> 2*b*128 + o; negative (padding) slots stay as they are."""
    return torch.div(slot_mapping.clamp(min=0), BLOCK_SIZE, rounding_mode="floor") * BLOCK_SIZE + slot_mapping


# ---- per-token positions ---------------------------------------------------------------------


def query_token_positions(cu_seqlens_q: torch.Tensor, prefix_lens: torch.Tensor, total_q: int):
    """Prefill tokens -> (query_req_id [total_q] int32, query_abs_pos [total_q] int32)."""
    n = torch.arange(total_q, device=cu_seqlens_q.device, dtype=torch.int64)
    req = torch.searchsorted(cu_seqlens_q[1:].long(), n, right=True)
    abs_pos = prefix_lens.long()[req] + n - cu_seqlens_q.long()[req]
    return req.int(), abs_pos.int()


def decode_token_positions(seq_lens: torch.Tensor, decode_query_len: int):
    """Decode tokens (uniform L per request) -> (req_id, abs_pos), int32 [batch * L]."""
    n = torch.arange(seq_lens.shape[0] * decode_query_len, device=seq_lens.device)
    req = n // decode_query_len
    abs_pos = seq_lens.long()[req] - decode_query_len + n % decode_query_len
    return req.int(), abs_pos.int()


# ---- the sparse page table -------------------------------------------------------------------


def _build_sparse_rows(topk, block_table, req_id, abs_pos, block_page_stride):
    """The per-row algorithm (docs/SPEC.md, the sparse page table), for every row at once."""
    num_kv_heads, num_tokens, k = topk.shape
    blocks = topk.permute(1, 0, 2).reshape(-1, k).long()                 # [R, K], row = t*H + h
    head = torch.arange(num_kv_heads, device=topk.device).repeat(num_tokens)  # [R]
    req = req_id.long().repeat_interleave(num_kv_heads)
    pos = abs_pos.long().repeat_interleave(num_kv_heads)

    causal_len = (pos + 1).clamp(min=0)
    self_blk = torch.div(pos, BLOCK_SIZE, rounding_mode="floor")
    valid = (blocks >= 0) & (blocks <= self_blk[:, None]) & (causal_len[:, None] > 0)
    is_tail = valid & (blocks == self_blk[:, None])
    is_full = valid & (blocks < self_blk[:, None])
    n_full = is_full.sum(1)
    # Full blocks keep their top-k order; the query's own (partial) block always goes last.
    slot = torch.where(is_full, is_full.cumsum(1) - 1, n_full[:, None])

    if valid.any():
        cols = block_table.shape[1]
        worst = int(blocks[valid].max())
        if worst >= cols:
            raise IndexError(f"block_table: expected a column for selected block {worst}, got {cols} columns")
    table_block = block_table.long()[req[:, None], blocks.clamp(0, block_table.shape[1] - 1)]
    if (valid & (table_block < 0)).any():
        raise IndexError("block_table: expected a block id >= 0 for every selected block, got a negative id")

    j = torch.arange(PAGES_PER_BLOCK, device=topk.device)
    pages = (table_block[:, :, None] * block_page_stride + j) * num_kv_heads + head[:, None, None]
    sparse_bt = torch.zeros(blocks.shape[0], k * PAGES_PER_BLOCK, dtype=torch.int64, device=topk.device)
    r, i = valid.nonzero(as_tuple=True)
    dest = slot[r, i][:, None] * PAGES_PER_BLOCK + j
    sparse_bt[r[:, None], dest] = pages[r, i]

    has_tail = is_tail.any(1)
    sparse_ctx = torch.where(has_tail, n_full * BLOCK_SIZE + (causal_len - self_blk * BLOCK_SIZE),
                             torch.minimum(valid.sum(1) * BLOCK_SIZE, causal_len))
    return sparse_bt.int(), sparse_ctx.int()


def build_sparse_block_table_decode(topk, block_table, seq_lens, decode_query_len, block_page_stride):
    """Decode rows -> (sparse_bt [T*H, K*8] int32, sparse_ctx [T*H] int32); T = batch * L."""
    total_q, expected_q = topk.shape[1], seq_lens.shape[0] * decode_query_len
    if total_q != expected_q:
        raise ValueError(f"MiniMax-M3 decode top-k rows must equal batch * decode_query_len: {total_q} != {expected_q}")
    req, pos = decode_token_positions(seq_lens, decode_query_len)
    return _build_sparse_rows(topk, block_table, req, pos, block_page_stride)


def build_sparse_block_table_prefill(topk, block_table, query_req_id, query_abs_pos, block_page_stride):
    """Prefill rows (ragged, per-token request and position) -> (sparse_bt, sparse_ctx)."""
    checks.check_shape("query_req_id", query_req_id, (topk.shape[1],))
    checks.check_shape("query_abs_pos", query_abs_pos, (topk.shape[1],))
    return _build_sparse_rows(topk, block_table, query_req_id, query_abs_pos, block_page_stride)


# ---- the attend over the sparse page table --------------------------------------------------


def _gather_tokens(cache, ids, kind):
    """Page ids [R, P] of the head-folded cache -> token rows [R, P*16, 128] (cache dtype)."""
    folded = cache.reshape(-1, *cache.shape[2:])  # [pages*H, ...]: id = page*H + head
    pages = folded[ids]
    if kind == "k":  # [R, P, 128/x, 16, x] -> [R, P, 16, 128]
        tokens = pages.permute(0, 1, 3, 2, 4)
    else:  # [R, P, 16/x, 128, x] -> [R, P, 16/x, x, 128]
        tokens = pages.permute(0, 1, 2, 4, 3)
    return tokens.reshape(ids.shape[0], ids.shape[1] * PAGE_SIZE, HEAD_DIM)


def _token_scales(scale, ids, num_kv_heads, stride):
    """Scale of every token of every row, [R, P*16] fp32 (scalar or per-token [H, slots])."""
    if scale.numel() == 1:
        return scale.reshape(1, 1).float()
    head, page = ids % num_kv_heads, torch.div(ids, num_kv_heads, rounding_mode="floor")
    slots = logical_slots_of_pages(page, stride)[:, :, None] + torch.arange(PAGE_SIZE, device=ids.device)
    return scale[head[:, :, None], slots].reshape(ids.shape[0], -1).float()


def _dequant(tokens, scale, ids, num_kv_heads, stride):
    values = tokens.float()
    if is_fp8(tokens.dtype) and scale is not None:
        values = values * _token_scales(scale, ids, num_kv_heads, stride)[:, :, None]
    return values


def sparse_paged_attend(q, k_cache, v_cache, sparse_bt, sparse_ctx, num_kv_heads, scale, out,
                        k_scale=None, v_scale=None):
    """Attend each (token, KV head) row to its virtual sequence; writes and returns `out`.

    Token i < sparse_ctx[r] of row r sits in page sparse_bt[r, i // 16] at offset i % 16. No
    other mask: causality is carried by sparse_ctx. Empty rows produce zeros.
    """
    num_tokens, num_heads, _ = q.shape
    group = num_heads // num_kv_heads
    rows = num_tokens * num_kv_heads
    pages = max(0, -(-int(sparse_ctx.max()) // PAGE_SIZE)) if rows else 0  # no row reads past them
    ids = sparse_bt[:, :pages].long()
    stride = block_page_stride(k_cache, v_cache)
    k = _dequant(_gather_tokens(k_cache, ids, "k"), k_scale, ids, num_kv_heads, stride)
    v = _dequant(_gather_tokens(v_cache, ids, "v"), v_scale, ids, num_kv_heads, stride)

    qr = q.reshape(rows, group, HEAD_DIM).float()  # q head = kv_head * group + g
    scores = torch.einsum("rgd,rnd->rgn", qr, k) * scale
    visible = torch.arange(k.shape[1], device=q.device)[None, :] < sparse_ctx.long()[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(sparse_ctx[:, None, None] > 0, probs, 0.0)  # empty rows attend nothing
    v = torch.where(visible[:, :, None], v, 0.0)  # never let bytes past ctx (maybe NaN) into the sum
    o = torch.einsum("rgn,rnd->rgd", probs, v)
    out.copy_(o.reshape(num_tokens, num_heads, HEAD_DIM).to(out.dtype))
    return out


def _check_attend_args(q, k_cache, v_cache, topk, num_kv_heads, out, k_scale, v_scale, kv_cache_dtype):
    checks.check_query(q, q.shape[1])
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q: expected a head count divisible by num_kv_heads={num_kv_heads}, got {q.shape[1]}")
    checks.check_kv_cache(k_cache, v_cache, num_kv_heads, kv_cache_dtype)
    checks.check_topk(topk, num_kv_heads, q.shape[0])
    checks.check_out(out, q)
    capacity = k_cache.shape[0] // block_page_stride(k_cache, v_cache) * BLOCK_SIZE
    checks.check_scale("k_scale", k_scale, k_cache.dtype, num_kv_heads, capacity)
    checks.check_scale("v_scale", v_scale, k_cache.dtype, num_kv_heads, capacity)


def _check_table_ids(sparse_bt, k_cache, v_cache, num_kv_heads):
    checks.check_ids_in_range("sparse_block_table", sparse_bt, min(k_cache.shape[0], v_cache.shape[0]) * num_kv_heads)


def sparse_attn_decode(q, k_cache, v_cache, topk, block_table, seq_lens, num_kv_heads, scale, out,
                       k_scale=None, v_scale=None, decode_query_len=1, sparse_block_table=None,
                       sparse_context_lens=None, *, kv_cache_dtype=None):
    """Decode attend: uniform L new tokens per request (docs/SPEC.md, rows to requests and positions).

    kv_cache_dtype, when given, is the dtype the cache was declared with; a cache of any other
    dtype (e4m3fn bytes where e4m3fnuz was declared, say) is refused.
    """
    _check_attend_args(q, k_cache, v_cache, topk, num_kv_heads, out, k_scale, v_scale, kv_cache_dtype)
    rows = q.shape[0] * num_kv_heads
    if not checks.check_sparse_table(sparse_block_table, sparse_context_lens, rows, topk.shape[2]):
        sparse_block_table, sparse_context_lens = build_sparse_block_table_decode(
            topk, block_table, seq_lens, decode_query_len, block_page_stride(k_cache, v_cache))
    _check_table_ids(sparse_block_table, k_cache, v_cache, num_kv_heads)
    return sparse_paged_attend(q, k_cache, v_cache, sparse_block_table, sparse_context_lens,
                               num_kv_heads, scale, out, k_scale, v_scale)


def sparse_attn_prefill(q, k_cache, v_cache, topk, block_table, query_req_id, query_abs_pos, num_kv_heads,
                        scale, out, k_scale=None, v_scale=None, sparse_bt=None, sparse_ctx=None, *,
                        kv_cache_dtype=None):
    """(Chunked) prefill attend: ragged requests through per-token request id and position."""
    _check_attend_args(q, k_cache, v_cache, topk, num_kv_heads, out, k_scale, v_scale, kv_cache_dtype)
    rows = q.shape[0] * num_kv_heads
    if not checks.check_sparse_table(sparse_bt, sparse_ctx, rows, topk.shape[2]):
        sparse_bt, sparse_ctx = build_sparse_block_table_prefill(
            topk, block_table, query_req_id, query_abs_pos, block_page_stride(k_cache, v_cache))
    _check_table_ids(sparse_bt, k_cache, v_cache, num_kv_heads)
    return sparse_paged_attend(q, k_cache, v_cache, sparse_bt, sparse_ctx, num_kv_heads, scale, out,
                               k_scale, v_scale)


# ---- the second formulation: the formula itself, a mask over a logical cache ---------------


def masked_sparse_attention(q, k, v, topk, block_table, query_req_id, query_abs_pos, num_kv_heads, scale,
                            k_scale=None, v_scale=None):
    """out[t, g] = softmax over {p <= abs_pos(t), block(p) in topk[h, t]} of scale * q.K[p], times V[p].

    k, v: logical cache [num_blocks, 128, H, 128] (cache dtype; fp8 dequantized with the scales,
    per-token scales indexed by logical slot). Returns fp32 [T, Hq, 128]; empty rows are zero.
    """
    num_tokens, num_heads, _ = q.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, HEAD_DIM)
    for t in range(num_tokens):
        req, abs_pos = int(query_req_id[t]), int(query_abs_pos[t])
        if abs_pos < 0:
            continue
        pos = torch.arange(abs_pos + 1)
        block = block_table[req, pos // BLOCK_SIZE].long()
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
        for h in range(num_kv_heads):
            chosen = torch.isin(pos // BLOCK_SIZE, topk[h, t][topk[h, t] >= 0].long())
            if not chosen.any():
                continue
            kh = k[block, pos % BLOCK_SIZE, h].float()
            vh = v[block, pos % BLOCK_SIZE, h].float()
            if is_fp8(k.dtype):
                kh = kh * _scale_at(k_scale, h, slot)[:, None]
                vh = vh * _scale_at(v_scale, h, slot)[:, None]
            qh = q[t, h * group:(h + 1) * group].float()
            s = (qh @ kh[chosen].T) * scale
            out[t, h * group:(h + 1) * group] = torch.softmax(s, -1) @ vh[chosen]
    return out


def _scale_at(scale, head, slot):
    if scale is None:
        return torch.ones(slot.shape)
    return scale.reshape(1).expand(slot.shape).float() if scale.numel() == 1 else scale[head, slot].float()


# ---- KV insert into the SHUFFLE views -------------------------------------------------------


def insert_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, *, kv_cache_dtype=None):
    """Write new tokens' K/V into the SHUFFLE page-16 views in place (docs/SPEC.md, the KV insert).

    key, value: [N, H, 128] bf16/fp16; slot_mapping: [N] logical slots (block * 128 + offset),
    negative = skip. fp8 caches store fp8(x / scale) (scalar or per-token [H, slots] scale).
    """
    checks.check_kv_cache(k_cache, v_cache, k_cache.shape[1], kv_cache_dtype)
    h = k_cache.shape[1]
    checks.check_dtype("key", key, (torch.bfloat16, torch.float16))
    checks.check_shape("key", key, (None, h, HEAD_DIM))
    checks.check_shape("value", value, tuple(key.shape))
    checks.check_shape("slot_mapping", slot_mapping, (key.shape[0],))
    capacity = k_cache.shape[0] // block_page_stride(k_cache, v_cache) * BLOCK_SIZE
    checks.check_scale("k_scale", k_scale, k_cache.dtype, h, capacity)
    checks.check_scale("v_scale", v_scale, k_cache.dtype, h, capacity)
    checks.check_ids_in_range("slot_mapping", slot_mapping[slot_mapping >= 0], capacity)

    keep = slot_mapping >= 0
    logical = slot_mapping[keep].long()
    page16 = rebase_slots_to_page16(logical) if sides_are_packed(k_cache, v_cache) else logical
    page, s = page16 // PAGE_SIZE, page16 % PAGE_SIZE
    kq, vq = key[keep], value[keep]
    if is_fp8(k_cache.dtype):
        kq = quantize_fp8(kq, _insert_scale(k_scale, logical, h), k_cache.dtype)
        vq = quantize_fp8(vq, _insert_scale(v_scale, logical, h), k_cache.dtype)
    x = elements_per_16_bytes(k_cache.dtype)
    d = torch.arange(HEAD_DIM)
    heads = torch.arange(h)
    P, H, D = page[:, None, None], heads[None, :, None], d[None, None, :]
    S = s[:, None, None]
    k_cache[P, H, D // x, S, D % x] = kq.to(k_cache.dtype)
    v_cache[P, H, S // x, D, S % x] = vq.to(v_cache.dtype)


def _insert_scale(scale, slots, num_kv_heads):
    """Scale per written element, broadcastable to [N, H, 128]."""
    if scale is None:
        return 1.0
    if scale.numel() == 1:
        return scale.reshape(1, 1, 1).float()
    return scale[:, slots].T.float()[:, :, None]


# ---- the indexer: block scores and top-k (docs/SPEC.md, "The indexer") ----------------------

FORCED_INIT_SCORE, FORCED_LOCAL_SCORE, NAN_SCORE = 1e30, 1e29, -1e30


def insert_index_cache(index_k, index_cache, slot_mapping):
    """Write each token's index key into the key-only index cache in place.

    index_k [N, 128] bf16/fp8; index_cache [blocks, 128, 128] (bf16 or fp8 e4m3fn), written at
    (slot // 128, slot % 128), cast to the cache's dtype with no scale (an fp8 cache saturated
    to its finite range as the KV insert's: torch's own cast does not saturate in every version);
    slot < 0 is skipped.
    """
    checks.check_shape("index_k", index_k, (None, HEAD_DIM))
    checks.check_shape("index_cache", index_cache, (None, BLOCK_SIZE, HEAD_DIM))
    checks.check_shape("slot_mapping", slot_mapping, (index_k.shape[0],))
    keep = slot_mapping >= 0
    checks.check_ids_in_range("slot_mapping", slot_mapping[keep], index_cache.shape[0] * BLOCK_SIZE)
    slots = slot_mapping[keep].long()
    keys = index_k[keep]
    if is_fp8(index_cache.dtype) and not is_fp8(keys.dtype):
        keys = quantize_fp8(keys, 1.0, index_cache.dtype)
    index_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE] = keys.to(index_cache.dtype)


def index_block_scores(index_q, index_cache, index_block_table, req_id, abs_pos):
    """score [H, T, blocks] fp32 of every (index head, token, logical block): the max over the
    block's positions p <= abs_pos of dot(index_q[t, h], index key of p), in fp32 from the stored
    values, unscaled; -inf for a block with no such position (past the token, or a padded row).

    index_q [T, H, 128]; index_cache [cache blocks, 128, 128]; index_block_table [reqs, cols]
    int32 (the index cache's own block ids); req_id, abs_pos [T] int32.
    """
    num_tokens, num_heads, _ = index_q.shape
    num_blocks = max(int(abs_pos.max()) // BLOCK_SIZE + 1, 1) if num_tokens else 1
    scores = torch.full((num_heads, num_tokens, num_blocks), float("-inf"))
    for t in range(num_tokens):
        pos = int(abs_pos[t])
        if pos < 0:
            continue
        p = torch.arange(pos + 1)
        keys = index_cache[index_block_table[int(req_id[t]), p // BLOCK_SIZE].long(), p % BLOCK_SIZE].float()
        dots = index_q[t].float() @ keys.T                                   # [H, pos + 1]
        for b in range(pos // BLOCK_SIZE + 1):
            scores[:, t, b] = dots[:, b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE].max(-1).values
    return scores


def index_topk(index_q, index_cache, index_block_table, req_id, abs_pos, init_blocks=0, local_blocks=1, topk=16):
    """topk [H, T, topk] int32: each token's highest-scoring logical blocks, highest first.

    Only blocks b <= abs_pos // 128 are candidates. The first `init_blocks` score 1e30, the last
    `local_blocks` candidates (the token's own block, for 1) 1e29 (a block that is both: 1e29); a
    NaN score counts as -1e30. Ties go to the smaller block id. k = min(topk, candidates) ids,
    the rest -1 (all -1 for a padded row).
    """
    scores = index_block_scores(index_q, index_cache, index_block_table, req_id, abs_pos)
    num_heads, num_tokens, num_blocks = scores.shape
    b = torch.arange(num_blocks)
    candidates = (abs_pos.long().clamp(min=-1) // BLOCK_SIZE + 1).clamp(min=0)  # [T]; 0 for a padded row
    visible = b[None, :] < candidates[:, None]                               # [T, blocks]
    scores = torch.where(scores.isnan(), NAN_SCORE, scores)
    scores = torch.where(visible & (b[None, :] < init_blocks), FORCED_INIT_SCORE, scores)
    scores = torch.where(visible & (b[None, :] >= candidates[:, None] - local_blocks), FORCED_LOCAL_SCORE, scores)
    scores = torch.where(visible, scores, float("-inf"))
    order = torch.sort(-scores, dim=-1, stable=True).indices                 # ties: the smaller id first
    out = torch.full((num_heads, num_tokens, topk), -1, dtype=torch.int32)
    k = min(topk, num_blocks)
    keep = torch.arange(k)[None, :] < candidates.clamp(max=topk)[:, None]    # [T, k]
    out[:, :, :k] = torch.where(keep, order[:, :, :k], -1).int()
    return out


def index_topk_decode(index_q, index_cache, index_block_table, seq_lens, decode_query_len, **kw):
    """Decode rows (uniform L per request): index_topk at positions seq_len - L + t % L."""
    req, pos = decode_token_positions(seq_lens, decode_query_len)
    return index_topk(index_q, index_cache, index_block_table, req, pos, **kw)


def index_topk_with_table(index_q, index_cache, index_block_table, req_id, abs_pos, attend_block_table,
                          block_page_stride, **kw):
    """The top-k and the attend's page table for it (what AITER's gfx950 top-k emits): the table
    resolves the selection through the *attend's* block table, not the index cache's."""
    topk = index_topk(index_q, index_cache, index_block_table, req_id, abs_pos, **kw)
    return (topk, *_build_sparse_rows(topk, attend_block_table, req_id, abs_pos, block_page_stride))
