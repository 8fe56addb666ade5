"""Argument checks shared by the reference and the compiled-kernel runtime.

Every failure raises with the argument's name, what was expected and what was given. These
checks read shapes, dtypes and devices only (no host sync); range checks that need the data
are in `check_ids_in_range`, which callers run once per step, not per layer.
"""
from __future__ import annotations

import torch

from .config import DTYPES, FP8_DTYPES
from .layout import HEAD_DIM, PAGE_SIZE, elements_per_16_bytes


def _fail(name, expected, actual, exc=ValueError):
    raise exc(f"{name}: expected {expected}, got {actual}")


def check_dtype(name, t, expected):
    expected = expected if isinstance(expected, tuple) else (expected,)
    if t.dtype not in expected:
        hint = ""
        if t.dtype in FP8_DTYPES and any(e in FP8_DTYPES for e in expected):
            hint = (" (e4m3fnuz and e4m3fn encode different values in the same bytes; "
                    "reading one as the other gives silent garbage)")
        _fail(name, " or ".join(map(str, expected)), f"{t.dtype}{hint}")


def check_shape(name, t, expected):
    """expected: tuple with None for free dims."""
    ok = t.dim() == len(expected) and all(e is None or e == a for e, a in zip(expected, t.shape))
    if not ok:
        shown = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        _fail(name, f"shape {shown}", list(t.shape))


def check_device(name, t, device):
    if t.device != device:
        _fail(name, f"device {device}", t.device)


def check_query(q, num_heads):
    check_dtype("q", q, (torch.bfloat16, torch.float16))
    check_shape("q", q, (None, num_heads, HEAD_DIM))


def check_new_kv(key, value, num_kv_heads, dtypes):
    """A step's new keys / values: key [N, H, 128] of one of `dtypes`, value as key."""
    check_shape("key", key, (None, num_kv_heads, HEAD_DIM))
    check_shape("value", value, tuple(key.shape))
    check_dtype("key", key, dtypes)
    check_dtype("value", value, key.dtype)


def check_out(out, q):
    check_shape("out", out, tuple(q.shape))
    check_dtype("out", out, q.dtype)
    check_device("out", out, q.device)
    if not out.is_contiguous():
        raise ValueError("out: expected a contiguous tensor, got a strided view")


def check_kv_cache(k_cache, v_cache, num_kv_heads, kv_dtype=None):
    """The SHUFFLE page-16 views (docs/SPEC.md, the KV cache)."""
    check_dtype("k_cache", k_cache, tuple(DTYPES.values()) if kv_dtype is None else kv_dtype)
    check_dtype("v_cache", v_cache, k_cache.dtype)
    x = elements_per_16_bytes(k_cache.dtype)
    check_shape("k_cache", k_cache, (None, num_kv_heads, HEAD_DIM // x, PAGE_SIZE, x))
    check_shape("v_cache", v_cache, (None, num_kv_heads, PAGE_SIZE // x, HEAD_DIM, x))
    check_device("v_cache", v_cache, k_cache.device)
    pk, pv = k_cache.shape[0], v_cache.shape[0]
    if pv not in (pk, pk - 8):
        _fail("v_cache.shape[0]", f"{pk} (K/V planes) or {pk - 8} (interleaved, V view offset by 8 pages)", pv)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError(f"{name}: expected whole 16-byte rows (contiguous last two dims), got strides {t.stride()}")


def check_scale(name, scale, kv_dtype, num_kv_heads, token_capacity):
    """None for 16-bit caches; fp32 [1] (per tensor) or [H, >= capacity] (per token) for fp8."""
    if kv_dtype not in FP8_DTYPES:
        if scale is not None:
            _fail(name, f"None for a {kv_dtype} cache (scales apply to fp8 caches only)", "a tensor")
        return
    if scale is None:
        return
    check_dtype(name, scale, torch.float32)
    if scale.numel() == 1:
        return
    if scale.dim() != 2 or scale.shape[0] != num_kv_heads:
        _fail(name, f"a scalar or [num_kv_heads={num_kv_heads}, max_kv_tokens] scales", list(scale.shape))
    if scale.shape[1] < token_capacity:
        _fail(name, f"at least the cache token capacity {token_capacity} per-token scales "
              "(KV scale tensor is smaller than the cache token capacity)", scale.shape[1])


def check_topk(topk, num_kv_heads, num_tokens, k=None):
    check_dtype("topk", topk, torch.int32)
    check_shape("topk", topk, (num_kv_heads, num_tokens, k))


def check_sparse_table(sparse_bt, sparse_ctx, rows, topk):
    if (sparse_bt is None) != (sparse_ctx is None):
        raise ValueError("prepared sparse block table and context lengths must be provided together "
                         f"(got sparse_block_table={'a tensor' if sparse_bt is not None else None}, "
                         f"sparse_context_lens={'a tensor' if sparse_ctx is not None else None})")
    if sparse_bt is None:
        return False
    check_dtype("sparse_block_table", sparse_bt, torch.int32)
    check_dtype("sparse_context_lens", sparse_ctx, torch.int32)
    check_shape("sparse_block_table", sparse_bt, (rows, topk * 8))
    check_shape("sparse_context_lens", sparse_ctx, (rows,))
    return True


def check_ids_in_range(name, ids, upper, lower=0):
    """Host-syncing range check, run once per step by builders, never per layer."""
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < lower or hi >= upper:
        bad = lo if lo < lower else hi
        _fail(name, f"ids in [{lower}, {upper})", f"{bad} (out of range)", IndexError)


def check_page_table(sparse_bt, sparse_ctx, num_kv_heads, upper, block_page_stride=None):
    """Host-syncing check (one sync) of a given page table, sparse_bt [rows, 128] folded page ids
    and sparse_ctx [rows] lengths (row r = token * H + head): every page a row reads (its first
    cdiv(ctx, 16)) in [0, upper), ctx at most 128 pages' tokens; with block_page_stride, each
    8-page group a row reads one block's pages in order (folded ids (block * stride + j) * H + h),
    as the GPU attend reads a group through its first page."""
    rows = sparse_bt.shape[0]
    if rows == 0:
        return
    dev, h = sparse_bt.device, num_kv_heads
    ids, ctx = sparse_bt.long(), sparse_ctx.long()
    read = (torch.arange(sparse_bt.shape[1], device=dev) * 16)[None, :] < ctx[:, None]
    flags = [(read & ((ids < 0) | (ids >= upper))).any(), (ctx > sparse_bt.shape[1] * 16).any()]
    if block_page_stride is not None:
        groups, read8 = ids.view(rows, -1, 8), read.view(rows, -1, 8)
        first = groups[:, :, :1]
        head = (torch.arange(rows, device=dev) % h)[:, None, None]
        aligned = (torch.div(first, h, rounding_mode="floor") % block_page_stride == 0) & (first % h == head)
        in_order = groups == first + torch.arange(8, device=dev) * h
        flags.append((read8 & ~(in_order & aligned)).any())
    flags = torch.stack(flags).tolist()
    if flags[0]:
        r, c = (int(i) for i in (read & ((ids < 0) | (ids >= upper))).nonzero()[0])
        _fail("sparse_block_table", f"ids in [0, {upper})", f"{int(ids[r, c])} at row {r}, column {c} (out of range)",
              IndexError)
    if flags[1]:
        r = int((ctx > sparse_bt.shape[1] * 16).nonzero()[0])
        _fail("sparse_context_lens", f"at most {sparse_bt.shape[1] * 16} tokens (the table's pages)",
              f"{int(ctx[r])} at row {r}")
    if len(flags) > 2 and flags[2]:
        r, g = (int(i) for i in (read8 & ~(in_order & aligned)).any(2).nonzero()[0])
        _fail("sparse_block_table", f"each 8-page group one block's pages in order, (block * {block_page_stride} + j) "
              f"* {h} + {r % h} for j = 0..7", f"{groups[r, g].tolist()} at row {r}, group {g}")
