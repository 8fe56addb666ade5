"""The mma family of the GPU attend: both products on NVIDIA tensor cores (mma.sync m16n8k16
through nvgpu.mma.sync; the heads of a KV head are M), CUDA only (templates/mma_split.j2 and
templates/mma_kv_loads.j2). What SparseAttention serves on CUDA.

8 or 16 heads per KV head (8: rows 8..15 of M are zero padding); the cache holds the query's dtype,
or fp8 (then both products run in f16: fp8 values and bf16 queries convert exactly, queries clamped
to +-65504). bf16/f16 caches keep PTX's fragment order (4-byte K/V loads, P rounded to bf16 with
integer ops); fp8 caches a lane-owned order, so that K comes in 16-byte loads and one i32 word
decodes into both of a fragment's f16 pairs. Knobs: the "mma" row of ops/tuning.py.
"""
from __future__ import annotations

from .attend_gpu import MatrixAttendSpec


class SparseAttnDecodeMmaSpec(MatrixAttendSpec):
    """The decode attend on tensor cores."""

    kernel = "sparse_attn_decode_mma"
    family = "mma"
    targets = ("cuda",)
    native_fp8 = "fp8_e4m3fn"

    def q_first_applies(self, wanted: bool) -> bool:
        # fp8 only: bf16's raw q requested at the kernel's entry made it slower
        return wanted and self.cfg.is_fp8

    @property
    def cuda_arch(self):
        # cvt.rn.f16x2.e4m3x2 exists from sm_89 (Ada, Hopper) on: such a module does not load on sm_80
        return 89 if self.knobs()["HW_FP8"] else None


class SparseAttnPrefillMmaSpec(SparseAttnDecodeMmaSpec):
    """The tensor-core attend for (chunked) prefill rows."""

    kernel = "sparse_attn_prefill_mma"
    prefill = True


class SparseAttnPagedMmaSpec(SparseAttnDecodeMmaSpec):
    """The tensor-core attend over a given page table (SparseAttnPagedFmaSpec's operands)."""

    kernel = "sparse_attn_paged_mma"
    paged = True
