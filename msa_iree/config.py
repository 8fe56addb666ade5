"""Configuration of one MSA attention specialisation, as data.

Everything a compiled kernel is specialised on lives here: model dimensions that are
compile-time constants (head_dim, block, page, top-k, heads per rank) and the dtypes.
Token counts, batch and cache size are *not* here: they are dynamic dimensions of the
compiled modules.
"""
from __future__ import annotations

import dataclasses

import torch

# Canonical dtype names used in the CLI, manifests and kernel names.
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3fnuz": torch.float8_e4m3fnuz,  # gfx942 (MI300) native fp8
    "fp8_e4m3fn": torch.float8_e4m3fn,  # gfx950 (MI350/355) and NVIDIA fp8
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
FP8_DTYPES = (torch.float8_e4m3fnuz, torch.float8_e4m3fn)
QUERY_DTYPES = ("bf16", "fp16")

# The fp8 format a target reads natively ("fp8" on the command line resolves through this).
NATIVE_FP8 = {"gfx942": "fp8_e4m3fnuz", "gfx950": "fp8_e4m3fn", "host": "fp8_e4m3fnuz", "cuda": "fp8_e4m3fn"}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(DTYPES)}") from None


def resolve_dtype(name: str, target: str = "gfx942") -> str:
    """Canonical dtype name; 'fp8' means the target's native fp8 format."""
    if name in ("fp8", "fp8_e4m3"):
        return NATIVE_FP8.get(target, "fp8_e4m3fnuz")
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
    name = aliases.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)} or 'fp8'")
    return name


@dataclasses.dataclass(frozen=True)
class MsaConfig:
    """One specialisation of MiniMax-M3 sparse attention on one tensor-parallel rank.

    Defaults are MiniMax-M3 at TP4: 16 query heads and 1 KV head per rank.
    """

    num_heads: int = 16
    num_kv_heads: int = 1
    head_dim: int = 128
    sparse_block_size: int = 128
    page_size: int = 16
    topk: int = 16
    kv_dtype: str = "bf16"
    query_dtype: str = "bf16"
    decode_query_len: int = 1

    def __post_init__(self):
        def bad(what, expected, actual):
            raise ValueError(f"MsaConfig.{what}: expected {expected}, got {actual!r}")

        if self.head_dim != 128:
            bad("head_dim", "128 (the only head size MSA and AITER build)", self.head_dim)
        if self.sparse_block_size != 128:
            bad("sparse_block_size", "128", self.sparse_block_size)
        if self.page_size != 16:
            bad("page_size", "16 (the AITER page)", self.page_size)
        if not 1 <= self.topk <= 64:
            bad("topk", "1..64", self.topk)
        if self.num_kv_heads < 1:
            bad("num_kv_heads", ">= 1", self.num_kv_heads)
        if self.num_heads < 1 or self.num_heads % self.num_kv_heads:
            bad("num_heads", f"a positive multiple of num_kv_heads={self.num_kv_heads}", self.num_heads)
        if self.kv_dtype not in DTYPES:
            bad("kv_dtype", sorted(DTYPES), self.kv_dtype)
        if self.query_dtype not in QUERY_DTYPES:
            bad("query_dtype", QUERY_DTYPES, self.query_dtype)
        if not 1 <= self.decode_query_len <= 8:
            bad("decode_query_len", "1..8", self.decode_query_len)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def pages_per_block(self) -> int:
        return self.sparse_block_size // self.page_size

    @property
    def max_context(self) -> int:
        """Tokens one (query token, KV head) row can attend: top-k whole blocks."""
        return self.topk * self.sparse_block_size

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.kv_dtype]

    @property
    def query_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.query_dtype]

    @property
    def is_fp8(self) -> bool:
        return self.kv_torch_dtype in FP8_DTYPES

    def replace(self, **changes) -> "MsaConfig":
        return dataclasses.replace(self, **changes)
