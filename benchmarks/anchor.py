"""The anchor: vLLM's Triton MSA attend, run in the benchmark's process on the benchmark's bytes,
and the anchor's timing protocol, applied to it and to msa-iree alike.

vLLM serves MiniMax-M3 on CUDA with the Triton kernels of
`vllm/models/minimax_m3/common/ops/sparse_attn.py` (the vllm wheel). The harness loads that file
from a path it is given (`--anchor PATH`, a copy taken from the wheel for the measurement; it is
not part of this repository), with the two vLLM names it imports stood in for: `triton`/`tl`
(`vllm.triton_utils`) and `current_platform.is_arch_support_pdl()` (vLLM's CUDA platform: compute
capability 9 or later).

The anchor's protocol (how the Triton numbers we compare with are measured):
- cold: one forward captured in a CUDA graph; each replay preceded by a 256 MiB write that
  flushes the L2; CUDA events around the replay; the median of 100 replays;
- warm: a graph of 20 back-to-back forwards on the same inputs, per forward; median of 20 replays.
"""
from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import types

import torch

from msa_iree.layout import unpack_kv_cache

COLD_ITERS = 100
WARM_CALLS = 20
WARM_ITERS = 20
FLUSH_BYTES = 256 << 20


def load_triton_module(path: str, what: str = "sparse_attn.py", required=("minimax_m3_sparse_attn",
                                                                          "minimax_m3_sparse_attn_decode")):
    """A vLLM minimax_m3 Triton file at `path` (`what`: sparse_attn.py, or the indexer's
    index_topk.py), imported with stand-ins for the vLLM names it imports; `required`: the
    functions it must have."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--anchor: expected a copy of vLLM's minimax_m3 {what}, got no file at {path!r}")
    import triton
    import triton.language as tl

    class _CudaPlatform:  # what vLLM's CudaPlatform answers the Triton files
        @staticmethod
        def is_arch_support_pdl() -> bool:
            return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

        @staticmethod
        def is_cuda() -> bool:
            return True

        @staticmethod
        def is_device_capability(capability) -> bool:  # vLLM's: this exact (major, minor)
            return torch.cuda.get_device_capability() == tuple(capability)

    stand_ins = {name: types.ModuleType(name) for name in ("vllm", "vllm.platforms", "vllm.triton_utils", "vllm.utils",
                                                           "vllm.utils.math_utils")}
    stand_ins["vllm.platforms"].current_platform = _CudaPlatform()
    stand_ins["vllm.utils.math_utils"].round_up = lambda x, m: (x + m - 1) // m * m  # vLLM's round_up
    stand_ins["vllm.triton_utils"].triton = triton
    stand_ins["vllm.triton_utils"].tl = tl
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location("anchor_minimax_m3_" + what.split(".")[0], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    for name in required:
        if not hasattr(module, name):
            raise AttributeError(f"--anchor: {path!r} has no {name} (expected vLLM's minimax_m3 {what})")
    return module


def vllm_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """The same K/V values in vLLM's main cache layout: [blocks, H, 128, 2 * 128], K then V on the
    last dim (cache dtype; fp8 codes copied bit for bit)."""
    codes = k_cache.dtype.itemsize == 1
    kc, vc = (k_cache.view(torch.uint8), v_cache.view(torch.uint8)) if codes else (k_cache, v_cache)
    k, v = unpack_kv_cache(kc, vc)  # [blocks, 128, H, 128] each
    kv = torch.cat([k, v], dim=-1).permute(0, 2, 1, 3).contiguous()
    return kv.view(k_cache.dtype) if codes else kv


class TritonDecode:
    """vLLM's decode call (minimax_m3_sparse_attn_decode) over a decode batch: q [T, Hq, 128],
    topk [1, T, 16] logical block ids (-1 unused), block_table [B, blocks] int32, seq_lens [B]."""

    def __init__(self, module, q, kv_cache, topk, block_table, seq_lens, decode_query_len, scale,
                 k_scale=None, v_scale=None):
        self.fn = module.minimax_m3_sparse_attn_decode
        self.args = (q, kv_cache, topk, block_table, seq_lens)
        self.decode_query_len, self.scale = decode_query_len, scale
        self.k_scale, self.v_scale = k_scale, v_scale

    def __call__(self, out):
        q, kv, topk, bt, seq_lens = self.args
        self.fn(q, kv, topk, bt, seq_lens, 1, self.scale, out, self.decode_query_len,
                k_scale=self.k_scale, v_scale=self.v_scale)


class TritonPrefill:
    """vLLM's prefill call (minimax_m3_sparse_attn) for one request computing its last q_len
    tokens: prefix_lens = seq_lens - q_len."""

    def __init__(self, module, q, kv_cache, topk, block_table, seq_lens, scale, k_scale=None, v_scale=None):
        self.fn = module.minimax_m3_sparse_attn
        q_len = q.shape[0]
        self.cu_seqlens_q = torch.tensor([0, q_len], dtype=torch.int32, device=q.device)
        self.prefix_lens = (seq_lens - q_len).to(torch.int32)
        self.args = (q, kv_cache, topk, block_table, seq_lens)
        self.scale, self.k_scale, self.v_scale = scale, k_scale, v_scale

    def __call__(self, out):
        q, kv, topk, bt, seq_lens = self.args
        self.fn(q, kv, topk, bt, self.cu_seqlens_q, seq_lens, self.prefix_lens, q.shape[0], 1, self.scale,
                out, k_scale=self.k_scale, v_scale=self.v_scale)


def _capture(fn, calls: int) -> torch.cuda.CUDAGraph:
    fn()  # compiles, allocates, binds: nothing of that may happen inside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return graph


def _replay_us(graph, iters, flush=None) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        if flush is not None:
            flush()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def write_flusher(device, nbytes=FLUSH_BYTES):
    """The anchor's L2 flush: a 256 MiB write (the L2 then holds the flush's dirty lines)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return lambda: buf.zero_()


def cold_us(fn, flush) -> float:
    """One call of `fn` captured in a graph; median over 100 replays, each after `flush`."""
    return _replay_us(_capture(fn, 1), COLD_ITERS, flush)


def warm_us(fn) -> float:
    """Per call of a graph of 20 back-to-back calls of `fn`; median over 20 replays."""
    return _replay_us(_capture(fn, WARM_CALLS), WARM_ITERS) / WARM_CALLS
