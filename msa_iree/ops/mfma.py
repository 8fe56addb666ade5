"""The MFMA family of the GPU attend: both products on gfx942's matrix cores (MFMA 16x16x16, bf16
or f16), for MI300X (templates/mfma_split.j2). What SparseAttention serves on gfx942.

NOT RUN: no AMD GPU was available. It is compiled and its ISA inspected here (msa-iree inspect);
its numerics are proven on CUDA by the emulated twin below, the same text with each MFMA computed
through LDS by the 64 threads of the emulated wave. What no test here can prove is the hardware's
fragment layout (taken from IREE's MFMA_F32_16x16x16 layouts) and the fp8 converter's byte order.

Each of the 4 waves is an independent flash-decoding worker over 2 pages of every block (own m, l,
o; no barrier in the block loop), combined once per split. QK as S^T = K q^T, so that the C
fragment is PV's B operand in O^T = V^T P^T (P never leaves the registers). q is staged in LDS.
e4m3fnuz words convert in hardware (v_cvt_pk_f32_fp8); e4m3fn words decode by integer ops. A
split's partial o goes to the workspace in f16 relative to its head's largest |o|, and fp8 rows
split at most 8 ways: the bytes between the split and the merge stay under 10% of the K/V a row
reads.
Knobs: the "mfma" row of ops/tuning.py.
"""
from __future__ import annotations

from .attend_gpu import MatrixAttendSpec


class SparseAttnDecodeMfmaSpec(MatrixAttendSpec):
    """The decode attend on gfx942's matrix cores. NOT RUN (no AMD GPU)."""

    kernel = "sparse_attn_decode_mfma"
    family = "mfma"
    targets = ("gfx942",)
    native_fp8 = "fp8_e4m3fnuz"


class SparseAttnPrefillMfmaSpec(SparseAttnDecodeMfmaSpec):
    """The MFMA attend for (chunked) prefill rows. NOT RUN (no AMD GPU)."""

    kernel = "sparse_attn_prefill_mfma"
    prefill = True


class SparseAttnDecodeMfmaEmulatedSpec(SparseAttnDecodeMfmaSpec):
    """TEST ONLY: SparseAttnDecodeMfmaSpec's text for CUDA with every MFMA computed by the 64
    threads of the emulated wave through LDS (same lane layout), the wave's cross-warp shuffle
    through LDS, and gfx942's fp8 converter replaced by a software stand-in with the same byte
    order. It runs the gfx942 kernel's data movement, tile mapping and softmax where a GPU exists.
    Slow (two barriers per MFMA); never in a deployment's kernel set."""

    kernel = "sparse_attn_decode_mfma_emulated"
    targets = ("cuda",)
    emulate_mfma = True
    test_only = True


class SparseAttnPrefillMfmaEmulatedSpec(SparseAttnDecodeMfmaEmulatedSpec):
    """TEST ONLY: the emulated MFMA attend for prefill rows."""

    kernel = "sparse_attn_prefill_mfma_emulated"
    prefill = True


class SparseAttnPagedMfmaSpec(SparseAttnDecodeMfmaSpec):
    """The MFMA attend over a given page table (SparseAttnPagedFmaSpec's operands). NOT RUN (no AMD GPU)."""

    kernel = "sparse_attn_paged_mfma"
    paged = True


class SparseAttnPagedMfmaEmulatedSpec(SparseAttnDecodeMfmaEmulatedSpec):
    """TEST ONLY: the emulated MFMA attend over a given page table."""

    kernel = "sparse_attn_paged_mfma_emulated"
    paged = True
