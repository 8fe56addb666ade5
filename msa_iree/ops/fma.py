"""The FMA family of the GPU attend: both products on vector FMAs, for every GPU target
(templates/fma_split.j2). What the runtime serves where the matrix-core family does not apply.

Threads (256 a workgroup) of @split, per block:
  A  QK: thread (s = t / 16, c = t % 16) owns dims 8c..8c+7 of token s of every page; q of all G
     heads for those dims lives in registers; a 16-lane reduce-scatter of shuffles leaves lane c
     with the score of head c >> (4 - log2 G).
  B  softmax: G groups of 256/G threads update (m, l) per head and turn scores into p.
  C  PV: thread (d = t % 128, half = t / 128) accumulates o[:, d] over 8 tokens of each page.
255 registers on sm_90 (1 workgroup per SM); on gfx942 256 VGPR + 70-100 AGPR, 1 wave per SIMD.
"""
from __future__ import annotations

from .attend_gpu import GpuAttendSpec


class SparseAttnDecodeFmaSpec(GpuAttendSpec):
    """The decode attend on vector FMAs; operands as the portable sparse_attn_decode's."""

    kernel = "sparse_attn_decode_fma"
    family = "fma"
    targets = ("cuda", "gfx942")


class SparseAttnPrefillFmaSpec(SparseAttnDecodeFmaSpec):
    """The FMA attend for (chunked) prefill rows: each token's request and absolute position from
    query_req_id / query_abs_pos (operands as the portable sparse_attn_prefill's)."""

    kernel = "sparse_attn_prefill_fma"
    prefill = True


class SparseAttnPagedFmaSpec(SparseAttnDecodeFmaSpec):
    """The FMA attend over a given page table (the indexer's emitted sparse_bt [T, H, 128] and
    sparse_ctx [T, H], each 8-page group one block's pages: operands as the portable
    sparse_paged_attend's), for decode and prefill rows alike."""

    kernel = "sparse_attn_paged_fma"
    paged = True
