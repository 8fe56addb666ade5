"""fp8 without native fp8 ops: a 256-entry decode table and a rounding-midpoint encoder.

Compiled modules receive fp8 caches as raw bytes (uint8): native fp8 casts fail on sm_80 and
e4m3fn code 0xFF decodes wrongly on llvm-cpu (docs/DESIGN.md). Both functions are bit-exact
against torch's own casts (tests/test_kernels_host.py checks every code and every tie).
"""
from __future__ import annotations

import torch

from ..config import FP8_DTYPES


def _fp8_values(dtype):
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


def _fp8_midpoints(dtype):
    finite = _fp8_values(dtype)[:128]
    finite = finite[torch.isfinite(finite)]
    return (finite[:-1] + finite[1:]) / 2


# Built at import, outside any trace: export embeds them as module constants.
_FP8_VALUES = {d: _fp8_values(d) for d in FP8_DTYPES}
_FP8_MIDPOINTS = {d: _fp8_midpoints(d) for d in FP8_DTYPES}


def fp8_decode_table(dtype: torch.dtype) -> torch.Tensor:
    """[256] fp32: the value of every byte in `dtype` (NaN codes stay NaN)."""
    return _FP8_VALUES[dtype]


def fp8_rounding_midpoints(dtype: torch.dtype) -> torch.Tensor:
    """Midpoints between consecutive finite non-negative codes, [n-1] fp32 (exact in fp32)."""
    return _FP8_MIDPOINTS[dtype]


def decode_fp8(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 bytes -> fp32 values of fp8 `dtype`."""
    return fp8_decode_table(dtype)[raw.to(torch.int64)]


def encode_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> uint8 bytes of fp8 `dtype`: round to nearest even, saturate (as torch's cast)."""
    mids = fp8_rounding_midpoints(dtype)
    fmax = torch.finfo(dtype).max
    mag = x.abs().clamp(max=fmax)[..., None]
    odd = (torch.arange(mids.shape[0]) % 2 == 1)
    code = torch.logical_or(mag > mids, torch.logical_and(mag == mids, odd)).to(torch.int64).sum(-1)
    negative = x < 0
    if dtype == torch.float8_e4m3fnuz:  # no negative zero: 0x80 is NaN there
        negative = torch.logical_and(negative, code > 0)
    return (code + negative.to(code.dtype) * 128).to(torch.uint8)


def storage_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """What a compiled module receives for a cache of kv_dtype (fp8 travels as bytes)."""
    return torch.uint8 if kv_dtype in FP8_DTYPES else kv_dtype
