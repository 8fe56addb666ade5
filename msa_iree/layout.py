"""The SHUFFLE page-16 KV-cache layout of AITER (docs/SPEC.md, the KV cache), and fp8 quantization.

A vLLM block holds 128 tokens of K and 128 tokens of V for every KV head. AITER addresses it as
16-token pages through two strided views of one buffer:

    k_cache [pages, H, 128/x, 16, x]   element (P, h, s, d) at k[P, h, d // x, s, d % x]
    v_cache [pages', H, 16/x, 128, x]  element (P, h, s, d) at v[P, h, s // x, d, s % x]

with x = 16 bytes / element size (8 for bf16/fp16, 16 for fp8). Two physical orders exist:

- "interleaved" (LBHNC): block b is K pages 16b..16b+7 then V pages 16b+8..16b+15. The V view
  starts 8 pages in, so one page id P reaches K page P and V page P+8; it has 8 fewer pages.
- "planes" (LHBNC): all K pages, then all V pages; block b is pages 8b..8b+7 of each plane.

The page-id stride of one block is 16 (interleaved) or 8 (planes): `block_page_stride`.
"""
from __future__ import annotations

import torch

from .config import FP8_DTYPES

HEAD_DIM = 128
BLOCK_SIZE = 128
PAGE_SIZE = 16
PAGES_PER_BLOCK = BLOCK_SIZE // PAGE_SIZE  # 8 page-16 pages per side of a block
SIDES_PER_BLOCK = 2  # K and V share a block when interleaved
LAYOUTS = ("interleaved", "planes")
# block page stride of each layout (see block_page_stride)
LAYOUT_STRIDES = {"interleaved": PAGES_PER_BLOCK * SIDES_PER_BLOCK, "planes": PAGES_PER_BLOCK}


def elements_per_16_bytes(dtype: torch.dtype) -> int:
    """x of the SHUFFLE layout: 16 for fp8, 8 for bf16/fp16."""
    return 16 // dtype.itemsize


def sides_are_packed(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when K and V share a block (interleaved): the V view is pre-offset by 8 pages."""
    return v_cache.shape[0] != k_cache.shape[0]


def block_page_stride(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Page ids one 128-token block spans: 16 when K/V sides are interleaved, 8 for planes."""
    return PAGES_PER_BLOCK * (SIDES_PER_BLOCK if sides_are_packed(k_cache, v_cache) else 1)


def num_cache_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Number of 128-token blocks the views address."""
    return k_cache.shape[0] // block_page_stride(k_cache, v_cache)


def _views(raw: torch.Tensor, num_blocks: int, num_kv_heads: int, layout: str):
    x = elements_per_16_bytes(raw.dtype)
    k_shape = (num_kv_heads, HEAD_DIM // x, PAGE_SIZE, x)
    v_shape = (num_kv_heads, PAGE_SIZE // x, HEAD_DIM, x)
    if layout == "interleaved":
        pages = num_blocks * PAGES_PER_BLOCK * SIDES_PER_BLOCK
        k = raw.view(pages, *k_shape)
        v = raw[PAGES_PER_BLOCK:].view(pages - PAGES_PER_BLOCK, *v_shape)
    elif layout == "planes":
        pages = num_blocks * PAGES_PER_BLOCK
        k = raw[:pages].view(pages, *k_shape)
        v = raw[pages:].view(pages, *v_shape)
    else:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return k, v


def allocate_kv_cache(num_blocks: int, num_kv_heads: int, dtype: torch.dtype,
                      layout: str = "interleaved", device="cpu", fill=None):
    """A fresh cache of `num_blocks` 128-token blocks; returns (k_cache, v_cache) views.

    The raw buffer is [num_blocks * 16 pages, H * 16 * 128] elements, one row per page-16
    page, in `layout` order. `fill` (a python number) initialises it; default uninitialised.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks: expected >= 1, got {num_blocks}")
    raw = torch.empty(num_blocks * PAGES_PER_BLOCK * SIDES_PER_BLOCK,
                      num_kv_heads * PAGE_SIZE * HEAD_DIM, dtype=dtype, device=device)
    if fill is not None:
        raw.view(torch.uint8).fill_(0) if fill == 0 else raw.fill_(fill)
    return _views(raw, num_blocks, num_kv_heads, layout)


def _k_pages_from_logical(k: torch.Tensor) -> torch.Tensor:
    """[nb, 128, H, 128] -> [nb, 8, H, 128/x, 16, x] (K page order)."""
    nb, _, h, _ = k.shape
    x = elements_per_16_bytes(k.dtype)
    return k.reshape(nb, PAGES_PER_BLOCK, PAGE_SIZE, h, HEAD_DIM // x, x).permute(0, 1, 3, 4, 2, 5)


def _v_pages_from_logical(v: torch.Tensor) -> torch.Tensor:
    """[nb, 128, H, 128] -> [nb, 8, H, 16/x, 128, x] (V page order: tokens x-packed)."""
    nb, _, h, _ = v.shape
    x = elements_per_16_bytes(v.dtype)
    return v.reshape(nb, PAGES_PER_BLOCK, PAGE_SIZE // x, x, h, HEAD_DIM).permute(0, 1, 4, 2, 5, 3)


def block_pages(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Page ids [len(block_ids), 8] of the given blocks, valid for both views."""
    stride = block_page_stride(k_cache, v_cache)
    j = torch.arange(PAGES_PER_BLOCK, device=block_ids.device)
    return block_ids.long()[:, None] * stride + j


def pack_kv_cache(k: torch.Tensor, v: torch.Tensor, layout: str = "interleaved"):
    """Logical cache -> SHUFFLE views.

    k, v: [num_blocks, 128, H, 128] (block, token-in-block, KV head, dim), any cache dtype.
    Returns (k_cache, v_cache) sharing one freshly allocated buffer.
    """
    if k.shape != v.shape or k.dim() != 4 or k.shape[1] != BLOCK_SIZE or k.shape[3] != HEAD_DIM:
        raise ValueError(f"k, v: expected equal shapes [blocks, 128, H, 128], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != v.dtype:
        raise ValueError(f"k, v: expected one dtype, got {k.dtype} and {v.dtype}")
    nb, _, h, _ = k.shape
    k_cache, v_cache = allocate_kv_cache(nb, h, k.dtype, layout, device=k.device)
    pages = block_pages(k_cache, v_cache, torch.arange(nb, device=k.device)).reshape(-1)
    k_cache[pages] = _k_pages_from_logical(k).reshape(nb * PAGES_PER_BLOCK, *k_cache.shape[1:])
    v_cache[pages] = _v_pages_from_logical(v).reshape(nb * PAGES_PER_BLOCK, *v_cache.shape[1:])
    return k_cache, v_cache


def unpack_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """SHUFFLE views -> logical (k, v), each [num_blocks, 128, H, 128]."""
    nb = num_cache_blocks(k_cache, v_cache)
    h = k_cache.shape[1]
    pages = block_pages(k_cache, v_cache, torch.arange(nb, device=k_cache.device)).reshape(-1)
    kp = k_cache[pages].reshape(nb, PAGES_PER_BLOCK, *k_cache.shape[1:])  # [nb, 8, H, 128/x, 16, x]
    vp = v_cache[pages].reshape(nb, PAGES_PER_BLOCK, *v_cache.shape[1:])  # [nb, 8, H, 16/x, 128, x]
    k = kp.permute(0, 1, 4, 2, 3, 5).reshape(nb, BLOCK_SIZE, h, HEAD_DIM)
    v = vp.permute(0, 1, 3, 5, 2, 4).reshape(nb, BLOCK_SIZE, h, HEAD_DIM)
    return k, v


def logical_slots_of_pages(pages: torch.Tensor, stride: int) -> torch.Tensor:
    """Logical slot (block * 128 + token) of token 0 of each page id (unfolded, any shape)."""
    return torch.div(pages, stride, rounding_mode="floor") * BLOCK_SIZE + (pages % stride) * PAGE_SIZE


# ---- fp8 -------------------------------------------------------------------------------------

def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_fp8(x: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """stored = fp8(x / scale), saturated to the format's finite range (the cache writer's rule)."""
    if not is_fp8(dtype):
        raise ValueError(f"dtype: expected an fp8 dtype {FP8_DTYPES}, got {dtype}")
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def dequantize_fp8(x: torch.Tensor, scale) -> torch.Tensor:
    """value = fp8 * scale, in fp32."""
    return x.float() * scale


def per_token_scale(scale: torch.Tensor, slots: torch.Tensor, head: int | torch.Tensor) -> torch.Tensor:
    """Per-token scales [H, tokens] read at logical `slots` for `head`."""
    return scale[head, slots]
