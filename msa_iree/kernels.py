"""Every MSA operation as a PyTorch module exported to MLIR with iree-turbine (`aot.export`).

One kernel = one `nn.Module` (its forward is the formulation) + one `KernelSpec` subclass that
names its specialisation; `spec.name` is the manifest key and the vmfb's file name.

Why PyTorch export for all of them (measured, see docs/DESIGN.md): one formulation compiles with
IREE 3.13 for the host CPU (what the tests run), gfx942 and CUDA sm_80, in ~1-2 s per target.
The GPU-level hand-written decode attend (kernels_mlir/) is the performance route of issue 5.

Formulation rules that keep one source valid for every target (TOOLCHAIN.md):
- fp8 caches arrive as raw bytes (uint8) and are decoded through a 256-entry table, and
  quantized by counting rounding midpoints: native fp8 casts fail on sm_80 and differ on llvm-cpu.
- every gather index is int64 and clamped into range, so no input can read out of bounds;
  range *errors* are raised by the runtime's builder (once per step), not here.
- token counts, requests, table columns and cache pages are dynamic dimensions; head counts,
  head_dim, block, page and top-k are compile-time.

Shapes below: T tokens, Hq query heads, H KV heads, G = Hq/H, K top-k, C table columns,
P pages, x = 16 bytes / element.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from . import KERNELS_MLIR
from .config import FP8_DTYPES, MsaConfig
from .layout import BLOCK_SIZE, HEAD_DIM, PAGE_SIZE, PAGES_PER_BLOCK, elements_per_16_bytes

# ---- fp8 without native fp8 ops -------------------------------------------------------------


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


# ---- shared pieces of the formulations ------------------------------------------------------


def sparse_rows(topk, table_block, abs_pos, block_page_stride, num_kv_heads):
    """SPEC §3.2 for all rows, gather- and scatter-free (one-hot over the top-k slots).

    topk [H, T, K] int32; table_block [T, H, K] int64 (the block table at each selection);
    abs_pos [T] int64. Returns (sparse_bt [T, H, K*8] int32, sparse_ctx [T, H] int32).
    """
    blocks = topk.permute(1, 0, 2).to(torch.int64)                     # [T, H, K]
    pos = abs_pos[:, None, None]
    causal_len = (pos + 1).clamp(min=0)
    self_blk = torch.div(pos, BLOCK_SIZE, rounding_mode="floor")
    valid = torch.logical_and(torch.logical_and(blocks >= 0, blocks <= self_blk), causal_len > 0)
    is_tail = torch.logical_and(valid, blocks == self_blk)
    is_full = torch.logical_and(valid, blocks < self_blk)
    n_full = is_full.to(torch.int64).sum(-1, keepdim=True)
    slot = torch.where(is_full, is_full.to(torch.int64).cumsum(-1) - 1, n_full)
    slot = torch.where(valid, slot, -1)

    k = topk.shape[-1]
    head = torch.arange(num_kv_heads)[None, :, None]
    first_page = (table_block.clamp(min=0) * block_page_stride) * num_kv_heads + head  # [T, H, K]
    lands = slot[..., None, :] == torch.arange(k)[:, None]              # [T, H, K slots, K entries]
    page0 = torch.where(lands, first_page[..., None, :], 0).amax(-1)    # [T, H, K slots]
    j = torch.arange(PAGES_PER_BLOCK) * num_kv_heads
    filled = lands.any(-1)[..., None]
    bt = torch.where(filled, page0[..., None] + j, 0).reshape(*page0.shape[:2], k * PAGES_PER_BLOCK)

    n_valid = valid.to(torch.int64).sum(-1, keepdim=True)
    tail_ctx = n_full * BLOCK_SIZE + (causal_len - self_blk * BLOCK_SIZE)
    ctx = torch.where(is_tail.any(-1, keepdim=True), tail_ctx, torch.minimum(n_valid * BLOCK_SIZE, causal_len))
    return bt.to(torch.int32), ctx[..., 0].to(torch.int32)


def table_lookup(block_table, req, topk):
    """block_table[req[t], topk[h, t, i]] -> [T, H, K] int64, indices clamped into the table."""
    rows = req.to(torch.int64).clamp(0, block_table.shape[0] - 1)[:, None, None]
    cols = topk.permute(1, 0, 2).to(torch.int64).clamp(0, block_table.shape[1] - 1)
    return flat_index2(block_table.to(torch.int64), rows, cols)


def flat_index2(table, rows, cols):
    """table[rows, cols] through one flat 1-D gather (IREE lowers only single-index gathers)."""
    return table.reshape(-1)[rows * table.shape[1] + cols]


def decode_positions(seq_lens, num_tokens, decode_query_len):
    """Decode row t -> (request t // L, abs_pos seq_len - L + t % L), int64 [T]."""
    t = torch.arange(num_tokens)
    req = torch.div(t, decode_query_len, rounding_mode="floor")
    req = req.clamp(0, seq_lens.shape[0] - 1)
    return req, seq_lens.to(torch.int64)[req] - decode_query_len + (t - req * decode_query_len)


def gather_kv(k_pages, v_pages, ids, kv_dtype):
    """Head-folded page ids [T, H, P] -> K, V token rows [T, H, P*16, 128] fp32 (unscaled)."""
    ids = ids.to(torch.int64)
    kp, vp = k_pages[ids.clamp(0, k_pages.shape[0] - 1)], v_pages[ids.clamp(0, v_pages.shape[0] - 1)]                   # [T, H, P, 128/x, 16, x], [T, H, P, 16/x, 128, x]
    if kv_dtype in FP8_DTYPES:
        kp, vp = decode_fp8(kp, kv_dtype), decode_fp8(vp, kv_dtype)
    t, h, p = ids.shape
    k = kp.permute(0, 1, 2, 4, 3, 5).reshape(t, h, p * PAGE_SIZE, HEAD_DIM)
    v = vp.permute(0, 1, 2, 3, 5, 4).reshape(t, h, p * PAGE_SIZE, HEAD_DIM)
    return k.float(), v.float()


def token_scales(scale, ids, num_kv_heads, block_page_stride):
    """Scale per token [T, H, P*16] from [Hs, S] (S == 1: one scale, else per-token by logical slot)."""
    ids = ids.to(torch.int64)
    head = torch.remainder(ids, num_kv_heads).clamp(max=scale.shape[0] - 1)
    page = torch.div(ids, num_kv_heads, rounding_mode="floor")
    first = torch.div(page, block_page_stride, rounding_mode="floor") * BLOCK_SIZE + \
        torch.remainder(page, block_page_stride) * PAGE_SIZE
    slots = (first[..., None] + torch.arange(PAGE_SIZE)).clamp(max=scale.shape[1] - 1)
    return flat_index2(scale, head[..., None], slots).reshape(*ids.shape[:2], -1)


def attend(q, k, v, ctx, scale):
    """q [T, Hq, 128]; k, v [T, H, N, 128] fp32; ctx [T, H] -> [T, Hq, 128] fp32. Empty rows: 0."""
    t, hq, _ = q.shape
    h, n = k.shape[1], k.shape[2]
    # Scaling q first keeps its bf16->f32 extension out of the QK contraction: fused there, it made a
    # mixed bf16 x f32 matmul that spilled 516 bytes of scratch on gfx942.
    qg = (q.float() * scale).reshape(t, h, hq // h, HEAD_DIM)
    s = torch.einsum("thgd,thnd->thgn", qg, k)
    visible = (torch.arange(n)[None, None, :] < ctx.to(torch.int64)[..., None])[:, :, None, :]
    s = torch.where(visible, s, float("-inf"))
    # Tokens past ctx (page 0 fillers, the rest of the tail block) may hold anything, NaN included:
    # 0 * NaN is NaN, so they are excluded from the value sum, not just weighted by 0.
    v = torch.where(visible[:, :, 0, :, None], v, 0.0)
    m = s.amax(-1, keepdim=True)
    m = torch.where(m == float("-inf"), 0.0, m)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    o = torch.einsum("thgn,thnd->thgd", p, v) / torch.where(denom == 0, 1.0, denom)
    return o.reshape(t, hq, HEAD_DIM)


def paged_attend(q, k_pages, v_pages, sparse_bt, sparse_ctx, scale, k_scale, v_scale, cfg, stride):
    kv_dtype = cfg.kv_torch_dtype
    k, v = gather_kv(k_pages, v_pages, sparse_bt, kv_dtype)
    if kv_dtype in FP8_DTYPES:
        k = k * token_scales(k_scale, sparse_bt, cfg.num_kv_heads, stride)[..., None]
        v = v * token_scales(v_scale, sparse_bt, cfg.num_kv_heads, stride)[..., None]
    return attend(q, k, v, sparse_ctx, scale).to(q.dtype)


# ---- the kernels: formulation modules --------------------------------------------------------


class RebaseBlockTable(torch.nn.Module):
    def forward(self, block_table):  # [R, C] int32 -> [R, C] int32
        return block_table * 2


class RebaseSlots(torch.nn.Module):
    def forward(self, slot_mapping):  # [N] int32 -> [N] int32
        s = slot_mapping.to(torch.int64)
        return (torch.div(s.clamp(min=0), BLOCK_SIZE, rounding_mode="floor") * BLOCK_SIZE + s).to(torch.int32)


class BuildDecodeTable(torch.nn.Module):
    def __init__(self, cfg, stride):
        super().__init__()
        self.cfg, self.stride = cfg, stride

    def forward(self, topk, block_table, seq_lens):
        """topk [H, T, K], block_table [B, C], seq_lens [B] -> sparse_bt [T, H, K*8], ctx [T, H]."""
        req, pos = decode_positions(seq_lens, topk.shape[1], self.cfg.decode_query_len)
        return sparse_rows(topk, table_lookup(block_table, req, topk), pos, self.stride, self.cfg.num_kv_heads)


class BuildPrefillTable(torch.nn.Module):
    def __init__(self, cfg, stride):
        super().__init__()
        self.cfg, self.stride = cfg, stride

    def forward(self, topk, block_table, query_req_id, query_abs_pos):
        """topk [H, T, K], block_table [R, C], req/pos [T] -> sparse_bt [T, H, K*8], ctx [T, H]."""
        pos = query_abs_pos.to(torch.int64)
        return sparse_rows(topk, table_lookup(block_table, query_req_id, topk), pos, self.stride,
                           self.cfg.num_kv_heads)


class SparsePagedAttend(torch.nn.Module):
    def __init__(self, cfg, stride):
        super().__init__()
        self.cfg, self.stride = cfg, stride

    def forward(self, q, k_pages, v_pages, sparse_bt, sparse_ctx, scale, k_scale, v_scale):
        """q [T, Hq, 128]; k/v_pages head-folded [P*H, ...]; sparse_bt [T, H, K*8]; ctx [T, H]."""
        return paged_attend(q, k_pages, v_pages, sparse_bt, sparse_ctx, scale, k_scale, v_scale,
                            self.cfg, self.stride)


class SparseAttnDecode(BuildDecodeTable):
    def forward(self, q, k_pages, v_pages, topk, block_table, seq_lens, scale, k_scale, v_scale):
        """Table build (SPEC §3) fused with the attend: one module call per layer."""
        bt, ctx = super().forward(topk, block_table, seq_lens)
        return paged_attend(q, k_pages, v_pages, bt, ctx, scale, k_scale, v_scale, self.cfg, self.stride)


class SparseAttnPrefill(BuildPrefillTable):
    def forward(self, q, k_pages, v_pages, topk, block_table, query_req_id, query_abs_pos, scale, k_scale, v_scale):
        bt, ctx = super().forward(topk, block_table, query_req_id, query_abs_pos)
        return paged_attend(q, k_pages, v_pages, bt, ctx, scale, k_scale, v_scale, self.cfg, self.stride)


class InsertKv(torch.nn.Module):
    """Write M tokens into one SHUFFLE buffer holding both sides, returned updated.

    `cache` [pages, H*16*128] (storage dtype) is the whole buffer: interleaved, K page P at row
    P and V at row P+8; planes, K plane rows then V plane rows. Padding slots (negative) are
    dropped by the caller once per step (`token_index` lists the rows of key/value to write):
    a masked scatter needs a reduction over the tokens that IREE's GPU codegen cannot build.
    """

    def __init__(self, cfg, stride):
        super().__init__()
        self.cfg, self.stride = cfg, stride

    def forward(self, cache, key, value, token_index, slot_mapping, k_scale, v_scale):
        """key/value [N, H, 128]; token_index [M] int32 rows to write; slot_mapping [M] logical slots >= 0."""
        cfg = self.cfg
        x = elements_per_16_bytes(cfg.kv_torch_dtype)
        rows = token_index.to(torch.int64).clamp(0, key.shape[0] - 1)
        logical = slot_mapping.to(torch.int64).clamp(min=0)
        if self.stride == 16:  # K and V share a block: only the block part of the slot doubles
            page16 = torch.div(logical, BLOCK_SIZE, rounding_mode="floor") * BLOCK_SIZE + logical
            v_first = PAGES_PER_BLOCK
        else:
            page16, v_first = logical, cache.shape[0] // 2
        page = torch.div(page16, PAGE_SIZE, rounding_mode="floor")[:, None, None]
        s = torch.remainder(page16, PAGE_SIZE)[:, None, None]
        head = torch.arange(cfg.num_kv_heads)[None, :, None] * (PAGE_SIZE * HEAD_DIM)
        d = torch.arange(HEAD_DIM)[None, None, :]
        page_elems = cfg.num_kv_heads * PAGE_SIZE * HEAD_DIM
        k_idx = page * page_elems + head + torch.div(d, x, rounding_mode="floor") * (PAGE_SIZE * x) + s * x + \
            torch.remainder(d, x)
        v_idx = (page + v_first) * page_elems + head + torch.div(s, x, rounding_mode="floor") * (HEAD_DIM * x) + \
            d * x + torch.remainder(s, x)
        kq = self._quantize(key[rows], k_scale, logical)
        vq = self._quantize(value[rows], v_scale, logical)
        flat = cache.reshape(-1)
        idx = torch.cat([k_idx.reshape(-1), v_idx.reshape(-1)]).clamp(0, flat.shape[0] - 1)
        return torch.scatter(flat, 0, idx, torch.cat([kq.reshape(-1), vq.reshape(-1)])).reshape(cache.shape)

    def _quantize(self, x, scale, logical):
        kv_dtype = self.cfg.kv_torch_dtype
        if kv_dtype not in FP8_DTYPES:
            return x.to(kv_dtype)
        head = torch.arange(self.cfg.num_kv_heads).clamp(max=scale.shape[0] - 1)[None, :, None]
        slots = logical.clamp(max=scale.shape[1] - 1)[:, None, None]
        return encode_fp8(x.float() / flat_index2(scale, head, slots), kv_dtype)


# ---- specialisations: the names in the manifest ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """A kernel specialised for one config; `name` is the manifest key and vmfb file name."""

    cfg: MsaConfig
    stride: int = 16  # block_page_stride the module is built for: 16 interleaved, 8 planes

    kernel = ""  # set by subclasses: the operation's name (the reference's function name)

    def __post_init__(self):  # subclasses validate their specialisation here
        pass

    @property
    def name(self) -> str:
        return f"{self.kernel}.{self.variant}"

    @property
    def variant(self) -> str:
        c = self.cfg
        return f"h{c.num_heads}kv{c.num_kv_heads}.{c.kv_dtype}.q{c.query_dtype}.s{self.stride}"

    def module(self) -> torch.nn.Module:
        raise NotImplementedError

    def example_args(self):
        raise NotImplementedError

    def dynamic_shapes(self):
        raise NotImplementedError

    def describe(self) -> dict:
        return {"kernel": self.kernel, "variant": self.variant, "config": dataclasses.asdict(self.cfg),
                "block_page_stride": self.stride}

    # the oldest CUDA compute capability (x10, e.g. 89) the module runs on, where it is newer than
    # the cuda target's sm_80; compile builds for it, the runtime refuses older GPUs by name
    cuda_arch = None

    def target_flags(self, target: str) -> list[str]:
        """Compiler flags this kernel adds after `target`'s own (a later --iree-cuda-target wins)."""
        return [f"--iree-cuda-target=sm_{self.cuda_arch}"] if target == "cuda" and self.cuda_arch else []

    # example tensors (sizes >= 2 so export keeps the dims symbolic)
    def _q(self, t=3):
        return torch.randn(t, self.cfg.num_heads, HEAD_DIM).to(self.cfg.query_torch_dtype)

    def _pages(self, p=40):
        kvd = storage_dtype(self.cfg.kv_torch_dtype)
        x = elements_per_16_bytes(self.cfg.kv_torch_dtype)
        h = self.cfg.num_kv_heads
        return (torch.zeros(p * h, HEAD_DIM // x, PAGE_SIZE, x, dtype=kvd),
                torch.zeros(p * h, PAGE_SIZE // x, HEAD_DIM, x, dtype=kvd))

    def _scales(self):
        return torch.ones(1), torch.ones(self.cfg.num_kv_heads, 2), torch.ones(self.cfg.num_kv_heads, 2)

    def _topk(self, t=3):
        return torch.zeros(self.cfg.num_kv_heads, t, self.cfg.topk, dtype=torch.int32)


def _dims():
    D = torch.export.Dim
    return dict(T=D("tokens", min=1, max=2 ** 20), P=D("pages", min=2, max=2 ** 31 - 1),
                B=D("requests", min=1, max=2 ** 16), C=D("columns", min=1, max=2 ** 16),
                S=D("scale_slots", min=1, max=2 ** 31 - 1), N=D("slots", min=1, max=2 ** 20),
                # V has its own page count (8 fewer when interleaved) and its own scale tensor
                Pv=D("v_pages", min=2, max=2 ** 31 - 1), Sv=D("v_scale_slots", min=1, max=2 ** 31 - 1))


class RebaseBlockTableSpec(KernelSpec):
    kernel = "rebase_block_table_to_page16"
    variant = "i32"

    def module(self):
        return RebaseBlockTable()

    def example_args(self):
        return (torch.zeros(3, 4, dtype=torch.int32),)

    def dynamic_shapes(self):
        d = _dims()
        return {"block_table": {0: d["B"], 1: d["C"]}}


class RebaseSlotsSpec(KernelSpec):
    kernel = "rebase_slots_to_page16"
    variant = "i32"

    def module(self):
        return RebaseSlots()

    def example_args(self):
        return (torch.zeros(5, dtype=torch.int32),)

    def dynamic_shapes(self):
        return {"slot_mapping": {0: _dims()["N"]}}


class _TableSpec(KernelSpec):
    @property
    def variant(self):
        c = self.cfg
        return f"kv{c.num_kv_heads}.k{c.topk}.s{self.stride}" + (f".L{c.decode_query_len}" if "decode" in self.kernel else "")


class BuildDecodeTableSpec(_TableSpec):
    kernel = "build_sparse_block_table_decode"

    def module(self):
        return BuildDecodeTable(self.cfg, self.stride)

    def example_args(self):
        L = self.cfg.decode_query_len
        return (self._topk(2 * L), torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))

    def dynamic_shapes(self):
        d = _dims()
        L = self.cfg.decode_query_len
        return {"topk": {1: d["B"] * L if L > 1 else d["B"]}, "block_table": {0: d["B"], 1: d["C"]},
                "seq_lens": {0: d["B"]}}


class BuildPrefillTableSpec(_TableSpec):
    kernel = "build_sparse_block_table_prefill"

    def module(self):
        return BuildPrefillTable(self.cfg, self.stride)

    def example_args(self):
        z = torch.zeros(3, dtype=torch.int32)
        return (self._topk(3), torch.zeros(2, 4, dtype=torch.int32), z, z.clone())

    def dynamic_shapes(self):
        d = _dims()
        return {"topk": {1: d["T"]}, "block_table": {0: d["B"], 1: d["C"]}, "query_req_id": {0: d["T"]},
                "query_abs_pos": {0: d["T"]}}


def _attend_dims(d):
    return {"q": {0: d["T"]}, "k_pages": {0: d["P"]}, "v_pages": {0: d["Pv"]}, "scale": None,
            "k_scale": {1: d["S"]}, "v_scale": {1: d["Sv"]}}


class SparsePagedAttendSpec(KernelSpec):
    kernel = "sparse_paged_attend"

    def module(self):
        return SparsePagedAttend(self.cfg, self.stride)

    def example_args(self):
        k, v = self._pages()
        s, ks, vs = self._scales()
        h, kk = self.cfg.num_kv_heads, self.cfg.topk * PAGES_PER_BLOCK
        return (self._q(3), k, v, torch.zeros(3, h, kk, dtype=torch.int32), torch.zeros(3, h, dtype=torch.int32),
                s, ks, vs)

    def dynamic_shapes(self):
        d = _dims()
        return {**_attend_dims(d), "sparse_bt": {0: d["T"]}, "sparse_ctx": {0: d["T"]}}


class SparseAttnDecodeSpec(KernelSpec):
    kernel = "sparse_attn_decode"

    @property
    def variant(self):
        return super().variant + f".L{self.cfg.decode_query_len}"

    def module(self):
        return SparseAttnDecode(self.cfg, self.stride)

    def example_args(self):
        k, v = self._pages()
        s, ks, vs = self._scales()
        L = self.cfg.decode_query_len
        return (self._q(2 * L), k, v, self._topk(2 * L), torch.zeros(2, 4, dtype=torch.int32),
                torch.zeros(2, dtype=torch.int32), s, ks, vs)

    def dynamic_shapes(self):
        d = _dims()
        L = self.cfg.decode_query_len
        t = d["B"] * L if L > 1 else d["B"]
        dims = _attend_dims(d)
        dims["q"] = {0: t}
        return {**dims, "topk": {1: t}, "block_table": {0: d["B"], 1: d["C"]}, "seq_lens": {0: d["B"]}}


class SparseAttnPrefillSpec(KernelSpec):
    kernel = "sparse_attn_prefill"

    def module(self):
        return SparseAttnPrefill(self.cfg, self.stride)

    def example_args(self):
        k, v = self._pages()
        s, ks, vs = self._scales()
        z = torch.zeros(3, dtype=torch.int32)
        return (self._q(3), k, v, self._topk(3), torch.zeros(2, 4, dtype=torch.int32), z, z.clone(), s, ks, vs)

    def dynamic_shapes(self):
        d = _dims()
        return {**_attend_dims(d), "topk": {1: d["T"]}, "block_table": {0: d["B"], 1: d["C"]},
                "query_req_id": {0: d["T"]}, "query_abs_pos": {0: d["T"]}}


class InsertKvSpec(KernelSpec):
    kernel = "insert_kv"

    @property
    def variant(self):
        c = self.cfg
        return f"kv{c.num_kv_heads}.{c.kv_dtype}.q{c.query_dtype}.s{self.stride}"

    def module(self):
        return InsertKv(self.cfg, self.stride)

    def example_args(self):
        h = self.cfg.num_kv_heads
        cache = torch.zeros(64, h * PAGE_SIZE * HEAD_DIM, dtype=storage_dtype(self.cfg.kv_torch_dtype))
        key = torch.zeros(3, h, HEAD_DIM, dtype=self.cfg.query_torch_dtype)
        _, ks, vs = self._scales()
        return (cache, key, key.clone(), torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), ks, vs)

    def dynamic_shapes(self):
        d = _dims()
        m = torch.export.Dim("written", min=1, max=2 ** 20)
        return {"cache": {0: d["P"]}, "key": {0: d["N"]}, "value": {0: d["N"]}, "token_index": {0: m},
                "slot_mapping": {0: m},
                "k_scale": {1: d["S"]}, "v_scale": {1: d["Sv"]}}


# ---- hand-written GPU-level kernels (kernels_mlir/, issue 5) ----------------------------------


@functools.cache
def _template_env():
    import jinja2

    # one environment: it keeps the parsed templates (and reloads one whose file changed)
    return jinja2.Environment(loader=jinja2.FileSystemLoader(KERNELS_MLIR), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True)


def render_template(name: str, **params) -> str:
    """Render one Jinja MLIR template of kernels_mlir/ (undefined parameters are errors)."""
    if not (KERNELS_MLIR / name).exists():
        raise FileNotFoundError(f"{KERNELS_MLIR / name}: the MLIR templates ship with the source tree; "
                                "install msa-iree from a checkout (pip install -e .)")
    return _template_env().get_template(name).render(**params)


_MLIR_ELEMENT = {"bf16": "bf16", "fp16": "f16", "fp8_e4m3fn": "i8", "fp8_e4m3fnuz": "i8"}
_FP8_FORMAT = {"fp8_e4m3fn": "fn", "fp8_e4m3fnuz": "fnuz"}


class _TemplateSpec(KernelSpec):
    """A kernel rendered from a kernels_mlir/ template for the GPU targets in `targets`."""

    template = ""
    targets: tuple = ()

    def describe(self) -> dict:
        return {**super().describe(), "template": self.template, "targets": list(self.targets)}


class SparseAttnDecodeGpuSpec(_TemplateSpec):
    """The decode attend as one hand-written GPU-level MLIR text (sparse_attn_decode_gpu.mlir.j2).

    Same operation as SparseAttnDecodeSpec (table build fused), different module interface:
    k/v pages arrive flat, [pages * H, 2048] storage elements, and the output tensor comes last
    as the result's storage. GPU targets only (gpu.thread_id
    has no llvm-cpu lowering); heads per KV head must be 8 or 16 (256-thread workgroups whose
    softmax groups are subgroup clusters of 256 / G <= 32 lanes).
    """

    kernel = "sparse_attn_decode_gpu"
    template = "sparse_attn_decode_gpu.mlir.j2"
    # `main` takes the output tensor and a workspace (workspace_floats) last and writes into them
    # (iree.abi.output): the call allocates nothing (an allocation cost ~100 us of host time per call)
    output_storage = True
    # main writes only into operands it is given: msa_iree.launch can run it on torch's stream
    # (the output and the workspace, the last two operands)
    written_operands = (-2, -1)
    prefill = False
    mma = False
    min_ctas_per_sm = None  # workgroups per SM asked of ptxas (mma variant only; caps its registers)
    # fp8 converted by the hardware: e4m3fn on CUDA sm_89+ (mma variant), e4m3fnuz on gfx942 (mfma)
    hw_fp8 = False
    async_kv = False  # K/V staged in LDS by cp.async one step ahead (mma variant only)
    mfma = False  # both products on gfx942's matrix cores (kernels_mlir/mfma_split.j2)
    emulate_mfma = False  # ... each MFMA computed through LDS instead, so that CUDA can run and test it
    waves_per_eu = None  # waves per SIMD asked of the gfx942 register allocator (mfma variant only)
    early_v = False  # V loaded right after QK, before the softmax (mma variant, without async_kv)
    # q requested during the page-id fetch, not after it (with bt_preload; mma: fp8's fragments,
    # mfma: q's staging in LDS)
    q_first = False
    merge_rows_splits = 0  # up to this many splits @merge takes a workgroup per row (mma, mfma variants)
    merge_row_parts = 1  # ... at exactly merge_rows_splits splits this many, G / merge_row_parts heads each
    # the request's block-table row staged in LDS, requested with the top-k row, when the table has
    # at most this many columns (a multiple of 256; 0: each top-k entry's column read after the top-k)
    bt_preload = 0
    trace = False  # measurements only: per-workgroup clock stamps after the partials (mma; tools/trace_phases.py)
    targets = ("cuda", "gfx942")
    GROUP_SIZES = (8, 16)

    def __post_init__(self):
        if self.cfg.group_size not in self.GROUP_SIZES:
            raise ValueError(f"num_heads / num_kv_heads: expected one of {self.GROUP_SIZES} for the GPU decode "
                             f"attend, got {self.cfg.group_size}")
        if self.cfg.topk != 16:
            raise ValueError(f"topk: expected 16 for the GPU decode attend, got {self.cfg.topk}")
        if self.bt_preload % 256:  # the staged row is copied by the 256 threads, 256 columns a step
            raise ValueError(f"bt_preload: expected a multiple of 256 block-table columns, got {self.bt_preload}")

    @property
    def variant(self):
        base = super().variant
        return base if self.prefill else base + f".L{self.cfg.decode_query_len}"

    @classmethod
    def supports(cls, cfg) -> bool:
        """True when `cfg` can be built by this kernel (what __post_init__ would otherwise refuse)."""
        return cfg.group_size in cls.GROUP_SIZES and cfg.topk == 16

    @property
    def kv_read_once(self) -> bool:
        """Whether each K/V page it reads is read by one row only: a decode with one query token a
        sequence (a row reads its own top-k blocks; rows share pages only through a shared prefix).
        Its loads may then be marked L2 evict-first (msa_iree.launch.with_l2_evict_first). H200,
        TP4 B=64 (tools/PERF.md, A/B runs): graph us fp8 14.2-14.6 -> 13.4-14.1, bf16 22.4-22.9
        -> 21.7-22.4; after a dirty flush fp8 15.7-16.5 -> 14.6-15.1, bf16 25.9-26.4 -> 23.0-23.3;
        kernel us unchanged. Where rows share pages (several tokens a sequence, prefill) the hint
        cost re-reads: bf16 L=4 4K B=64 51.7 -> 59.5 us, prefill 528 -> 583 us."""
        return not self.prefill and self.cfg.decode_query_len == 1

    def workspace_floats(self, num_tokens: int) -> int:
        """f32 elements of the workspace `main` takes after the output (the split partials o and
        (m, l) of rows x splits x G heads, 130 floats each; the template uses 16 splits up to 16
        rows, halving per doubling, 1 above 128: rows x splits <= max(256, rows)). An upper bound
        for the MFMA variant: its partials take 67 floats' room per (row, split, head) (o in f16,
        then m, l and o's scale) and its fp8 rows at most 8 splits."""
        rows = num_tokens * self.cfg.num_kv_heads
        return max(256, rows) * self.cfg.group_size * 130

    def render(self) -> str:
        c = self.cfg
        return render_template(self.template, G=c.group_size, H=c.num_kv_heads, L=c.decode_query_len,
                               QT=_MLIR_ELEMENT[c.query_dtype], KT=_MLIR_ELEMENT[c.kv_dtype],
                               FP8=_FP8_FORMAT.get(c.kv_dtype), STRIDE=self.stride, PREFILL=self.prefill,
                               MMA=self.mma, MIN_CTAS=self.min_ctas_per_sm, HW_FP8=self.uses_hw_fp8,
                               ASYNC_KV=self.mma and self.async_kv, MFMA=self.mfma, EMULATE=self.emulate_mfma,
                               WAVES_PER_EU=self.waves_per_eu, EARLY_V=self.mma and self.early_v,
                               Q_FIRST=self.uses_q_first,
                               MERGE_ROWS_SPLITS=self.merge_rows_splits if (self.mma or self.mfma) else 0,
                               BT_PRELOAD=self.bt_preload, TRACE=self.mma and self.trace, MRP=self.merge_row_parts)

    def describe(self) -> dict:
        return {**super().describe(), "mma": self.mma, "min_ctas_per_sm": self.min_ctas_per_sm,
                "hw_fp8": self.uses_hw_fp8, "async_kv": self.mma and self.async_kv, "mfma": self.mfma,
                "emulate_mfma": self.emulate_mfma, "waves_per_eu": self.waves_per_eu,
                "early_v": self.mma and self.early_v,
                "q_first": self.uses_q_first,
                "merge_rows_splits": self.merge_rows_splits,
                "bt_preload": self.bt_preload, "trace": self.mma and self.trace,
                "merge_row_parts": self.merge_row_parts}

    @property
    def uses_hw_fp8(self) -> bool:
        native = "fp8_e4m3fn" if self.mma else "fp8_e4m3fnuz" if self.mfma else None
        return self.hw_fp8 and self.cfg.kv_dtype == native

    @property
    def uses_q_first(self) -> bool:
        # q's early loads sit between the staged block-table row's loads and stores
        return self.q_first and self.bt_preload > 0 and (self.mfma or (self.mma and self.cfg.is_fp8))

    @property
    def cuda_arch(self):
        # cvt.rn.f16x2.e4m3x2 exists from sm_89 (Ada, Hopper) on: such a module does not load on sm_80
        return 89 if self.mma and self.uses_hw_fp8 else None


class SparseAttnPrefillGpuSpec(SparseAttnDecodeGpuSpec):
    """The same GPU-level attend for (chunked) prefill rows: each token's request and absolute
    position come from query_req_id / query_abs_pos (operands in SparseAttnPrefillSpec's order)."""

    kernel = "sparse_attn_prefill_gpu"
    prefill = True


class _MatrixCoreSpec(SparseAttnDecodeGpuSpec):
    """A GPU attend whose products run on matrix instructions: both operands share one type, so the
    cache holds the query's dtype or fp8 (decoded exactly into f16, the query converted to f16)."""

    matrix = ""
    # @merge: a 256-thread workgroup per row (8 dims a thread) up to 4 splits (>= 33 rows), per
    # (row, head pair) above. On the H200 (tools/PERF.md), against the (row, head) grid: TP4 bf16
    # B=64 27.7 -> 27.4 us, B=128 45.2 -> 44.3, fp8 B=64 17.8 -> 17.2, B=128 28.9 -> 27.6
    merge_rows_splits = 4

    def __post_init__(self):
        super().__post_init__()
        if not self.cfg.is_fp8 and self.cfg.kv_dtype != self.cfg.query_dtype:
            raise ValueError(f"kv_dtype: expected fp8 or the query dtype {self.cfg.query_dtype} for the {self.matrix} "
                             f"attend (both operands share one type), got {self.cfg.kv_dtype}")

    @classmethod
    def supports(cls, cfg) -> bool:
        return super().supports(cfg) and (cfg.is_fp8 or cfg.kv_dtype == cfg.query_dtype)


class SparseAttnDecodeMmaSpec(_MatrixCoreSpec):
    """The GPU attend with both products on NVIDIA tensor cores (mma.sync m16n8k16 through
    nvgpu.mma.sync; the heads of a KV head are M). CUDA only; 8 or 16 heads per KV head; the cache
    holds the query's dtype, or fp8 (then both products run in f16: fp8 values and bf16 queries
    convert exactly, queries clamped to +-65504). gfx942's matrix-core twin is
    SparseAttnDecodeMfmaSpec (a different structure: one wave per page pair, wave64 fragments)."""

    kernel = "sparse_attn_decode_mma"
    matrix = "mma"
    targets = ("cuda",)  # GROUP_SIZES as the FMA variant's; 8 heads: rows 8..15 of M are zero padding
    mma = True
    # 2 workgroups (16 warps) per SM, i.e. <= 128 registers: left alone, ptxas gave the 8-head
    # kernel 184 registers and 1 workgroup per SM, 1.3x slower at B=64 (tools/PERF.md)
    min_ctas_per_sm = 2
    # e4m3fn K/V converted two bytes per instruction (cvt.rn.f16x2.e4m3x2) instead of ~14 integer
    # ops per word: the module is built for sm_89 (runs on Ada and Hopper, not on sm_80)
    hw_fp8 = True

    @property
    def async_kv(self) -> bool:
        # Each warp stages its K page and V slice in LDS with cp.async, one step ahead (K of the
        # next block during this one, V of this block during its QK). Measured on the H200
        # (tools/PERF.md): fp8 TP4 B=64 20.0 -> 17.7 us, L=4 B=64 46.8 -> 38.9 us; bf16 (64 KiB of
        # LDS a workgroup) TP4 B=64 27.4 -> 28.9 us and prefill 559 -> 650 us: fp8 only
        return self.cfg.is_fp8

    # bf16/f16 (K and V read straight into registers): V requested right after QK, so that its
    # loads are in flight during the softmax (127 registers, no spills). Measured on the H200
    # (tools/PERF.md): prefill bf16 552 -> 532 us, L=4 B=128 113.4 -> 111.8 us, L=1 unchanged
    early_v = True
    # fp8: q's fragments requested during the page-id fetch (after the block-table row's loads, before
    # the barrier). The first block's QK needs them converted to f16; requested after the page ids,
    # next to that block's K, they came back behind it (ptxas puts the K copies first). H200
    # (tools/PERF.md, A/B runs): TP4 L=1 B=64 14.85 -> 14.1-14.2 us, B=8 7.5 -> 7.1, B=128 23.2 ->
    # 22.0-22.4, prefill 535 -> 524; for bf16 (raw q, no conversion) q at the kernel's entry was
    # slower (B=64 20.8 -> 21.6 us), so fp8 only (uses_q_first)
    q_first = True

    # @merge with 4 splits (33-64 rows): two workgroups a row (8 heads, 4 dims a thread). H200
    # (tools/PERF.md, clean cold L2, TP4 B=64): merge 1.87 -> 1.60-1.65 us bf16, 1.97 -> 1.76 fp8;
    # with 2 splits it was slower (B=128 1.63 -> 1.74), so fewer splits keep one workgroup a row
    merge_row_parts = 2
    # up to 1024 block-table columns (128K tokens a request) the page ids wait on one global load,
    # not two in a chain (4 KiB of LDS). H200 (tools/PERF.md): TP4 bf16 L=1 B=8 9.1 -> 8.2 us,
    # B=64 27.5 -> 26.7, B=128 44.5 -> 43.5; fp8 B=64 17.4 -> 17.2
    bt_preload = 1024


class SparseAttnDecodeMmaTraceSpec(SparseAttnDecodeMmaSpec):
    """The mma decode attend with clock stamps (TRACE): thread 0 of every workgroup writes 16 i64
    after the partials in the workspace (kernels_mlir/mma_split.j2 says which), read back by
    `stamps`. For measurements only (tools/trace_phases.py); never what SparseAttention serves."""

    kernel = "sparse_attn_decode_mma_trace"
    trace = True

    def splits(self, rows: int) -> int:
        """The template's split rule: 16 up to 16 rows, halving per doubling, 1 above 128 rows."""
        return 16 if rows <= 16 else 8 if rows <= 32 else 4 if rows <= 64 else 2 if rows <= 128 else 1

    def workspace_floats(self, num_tokens: int) -> int:
        rows = num_tokens * self.cfg.num_kv_heads
        return super().workspace_floats(num_tokens) + max(256, rows) * 32

    def stamps(self, workspace, num_tokens: int):
        """[workgroups (row-major over (row, split)), 16] int64: 0 globaltimer (ns) and 1 SM clock at
        entry, 2 page ids ready, 3 + 2j / 4 + 2j block j's (j < 4) two softmax barriers, 11 the
        epilogue's barrier, 12 partials stored, 13 globaltimer at the end."""
        rows = num_tokens * self.cfg.num_kv_heads
        groups = rows * self.splits(rows)
        at = groups * self.cfg.group_size * 130  # after o (128 floats) and (m, l) of every (group, head)
        return workspace[at:at + groups * 32].view(torch.int64).reshape(groups, 16)


class SparseAttnPrefillMmaSpec(SparseAttnDecodeMmaSpec):
    """The mma attend for (chunked) prefill rows (operands as SparseAttnPrefillSpec's)."""

    kernel = "sparse_attn_prefill_mma"
    prefill = True


class SparseAttnDecodeMfmaSpec(_MatrixCoreSpec):
    """The GPU attend with both products on gfx942's matrix cores (MFMA 16x16x16, bf16 or f16; the
    lane layout and the wave-per-page structure are described in kernels_mlir/mfma_split.j2).
    8 or 16 heads per KV head; the cache holds the query's dtype, or fp8 (e4m3fn / e4m3fnuz: then both
    products run in f16, the fp8 bytes decoded exactly a word at a time, queries clamped to +-65504).
    A split's partial o goes to the workspace in f16, relative to its head's largest |o| (that scale
    in f32 next to (m, l)), and fp8 rows split at most 8 ways: the bytes between the two dispatches
    stay under 10% of the K/V bytes a row reads (a gfx942 target of tools/PERF.md; f32 partials
    were 13% for bf16 and 25% for fp8 at 16 splits).
    NOT RUN: no AMD GPU was available. Its numerics are proven by SparseAttnDecodeMfmaEmulatedSpec,
    the same text with each MFMA emulated, on CUDA (tests/test_gpu.py)."""

    kernel = "sparse_attn_decode_mfma"
    targets = ("gfx942",)  # GROUP_SIZES as the FMA variant's; 8 heads: heads 8..15 of N are zero padding
    matrix = "MFMA"
    mfma = True
    # 4 waves per SIMD asked of the register allocator (<= 128 VGPRs): fp8 took 124 with it, 128
    # without (bf16 111 either way; since the hardware conversion e4m3fnuz 121, e4m3fn 128); with q
    # in registers it had taken 155 (3 waves) or spilled
    waves_per_eu = 4
    # e4m3fnuz K/V converted by gfx942's v_cvt_pk_f32_fp8 (+ v_cvt_pkrtz_f16_f32): 4 instructions per
    # 4 values instead of ~19 integer ops (one a quarter-rate v_mul_lo_u32). With V's tail masked
    # by one AND a word: @split 1800 -> 1299 instructions, its block loop ~943 -> ~478 a wave
    # (gfx942 ISA, tools/PERF.md). The emulated twin runs the same conversion in software. NOT RUN
    hw_fp8 = True
    # the page ids wait on one global load up to 256 block-table columns (32K tokens a request):
    # 1 KiB of LDS keeps 4 workgroups (16 waves) a CU; on the H200 the CUDA mma attend's 1024 took
    # TP4 bf16 L=1 from 9.1 to 8.2 us at B=8, 27.5 to 26.7 at B=64; gfx942's gain is unmeasured
    bt_preload = 256
    # q's staging in LDS requested during the page-id fetch: after the page ids (its own barrier)
    # it put a memory round trip between them and the first block's K (gfx942 ISA, tools/PERF.md).
    # The CUDA mma attend's fp8 twin of this move gained 0.6-0.7 us at B=64; here unmeasured
    q_first = True


class SparseAttnPrefillMfmaSpec(SparseAttnDecodeMfmaSpec):
    """The MFMA attend for (chunked) prefill rows (operands as SparseAttnPrefillSpec's). NOT RUN."""

    kernel = "sparse_attn_prefill_mfma"
    prefill = True


class SparseAttnDecodeMfmaEmulatedSpec(SparseAttnDecodeMfmaSpec):
    """SparseAttnDecodeMfmaSpec's text for CUDA with every MFMA computed by the 64 threads of the
    emulated wave through LDS (same lane layout) and the wave's cross-warp shuffle through LDS: it
    runs the gfx942 kernel's data movement, tile mapping and softmax where a GPU exists. Slow (two
    barriers per MFMA): for tests, never for serving."""

    kernel = "sparse_attn_decode_mfma_emulated"
    targets = ("cuda",)
    emulate_mfma = True


class SparseAttnPrefillMfmaEmulatedSpec(SparseAttnDecodeMfmaEmulatedSpec):
    """The emulated MFMA attend for prefill rows (tests only)."""

    kernel = "sparse_attn_prefill_mfma_emulated"
    prefill = True


ATTEND_SPECS = (SparseAttnDecodeSpec, SparseAttnPrefillSpec, SparsePagedAttendSpec)
TABLE_SPECS = (BuildDecodeTableSpec, BuildPrefillTableSpec)
REBASE_SPECS = (RebaseBlockTableSpec, RebaseSlotsSpec)


class InsertKvGpuSpec(_TemplateSpec):
    """The KV insert as one hand-written GPU-level MLIR text (insert_kv_gpu.mlir.j2), in place.

    Operands as InsertKvSpec's; `main` writes into the cache argument itself (iree.abi.output on
    it, dispatch tied to it), so the call updates the caller's buffer without a copy. GPU
    targets only.
    """

    kernel = "insert_kv_gpu"
    template = "insert_kv_gpu.mlir.j2"
    targets = ("cuda", "gfx942")
    written_operands = (0,)  # the cache (see SparseAttnDecodeGpuSpec.written_operands)

    @property
    def variant(self):
        c = self.cfg
        return f"kv{c.num_kv_heads}.{c.kv_dtype}.q{c.query_dtype}.s{self.stride}"

    def render(self) -> str:
        c = self.cfg
        return render_template(self.template, H=c.num_kv_heads, QT=_MLIR_ELEMENT[c.query_dtype],
                               KT=_MLIR_ELEMENT[c.kv_dtype], FP8=_FP8_FORMAT.get(c.kv_dtype), STRIDE=self.stride)


GPU_SPECS = (SparseAttnDecodeGpuSpec, SparseAttnPrefillGpuSpec, SparseAttnDecodeMmaSpec, SparseAttnPrefillMmaSpec,
             SparseAttnDecodeMfmaSpec, SparseAttnPrefillMfmaSpec, SparseAttnDecodeMfmaEmulatedSpec,
             SparseAttnPrefillMfmaEmulatedSpec, InsertKvGpuSpec)
ALL_KERNELS = {cls.kernel: cls for cls in (*REBASE_SPECS, *TABLE_SPECS, *ATTEND_SPECS, InsertKvSpec, *GPU_SPECS)}

# (matrix variant, target) -> the GPU attend's (decode, prefill) spec classes. "mfma" on cuda is the
# gfx942 kernel with its MFMAs emulated: it proves that kernel's numerics on an NVIDIA GPU (slow,
# tests only: no deployment kernel set holds it)
GPU_ATTEND = {
    ("fma", "cuda"): (SparseAttnDecodeGpuSpec, SparseAttnPrefillGpuSpec),
    ("fma", "gfx942"): (SparseAttnDecodeGpuSpec, SparseAttnPrefillGpuSpec),
    ("mma", "cuda"): (SparseAttnDecodeMmaSpec, SparseAttnPrefillMmaSpec),
    ("mfma", "gfx942"): (SparseAttnDecodeMfmaSpec, SparseAttnPrefillMfmaSpec),
    ("mfma", "cuda"): (SparseAttnDecodeMfmaEmulatedSpec, SparseAttnPrefillMfmaEmulatedSpec),
}
# the matrix-core variant each GPU target serves with
NATIVE_MATRIX = {"cuda": "mma", "gfx942": "mfma"}


def kernel_set(cfg: MsaConfig, strides=(16, 8), decode_query_lens=(1, 2, 3, 4), target=None) -> list[KernelSpec]:
    """Every kernel a deployment of `cfg` needs: per cache layout (block page stride) and per
    decode query length L (1 = plain decode, > 1 = speculative decode). For a GPU `target`
    also the hand-written decode attend, where the head grouping allows it."""
    # the hand-written attends this target serves with: FMA, and its matrix-core variant
    gpu_attends = [GPU_ATTEND[m, target] for m in ("fma", NATIVE_MATRIX.get(target))
                   if (m, target) in GPU_ATTEND and GPU_ATTEND[m, target][0].supports(cfg)]
    specs = [RebaseBlockTableSpec(cfg), RebaseSlotsSpec(cfg)]
    for stride in strides:
        for L in decode_query_lens:
            specs += [BuildDecodeTableSpec(cfg.replace(decode_query_len=L), stride),
                      SparseAttnDecodeSpec(cfg.replace(decode_query_len=L), stride)]
            specs += [decode(cfg.replace(decode_query_len=L), stride) for decode, _ in gpu_attends]
        specs += [prefill(cfg, stride) for _, prefill in gpu_attends]
        if target in InsertKvGpuSpec.targets:
            specs.append(InsertKvGpuSpec(cfg, stride))
        specs += [cls(cfg, stride) for cls in (BuildPrefillTableSpec, SparseAttnPrefillSpec, SparsePagedAttendSpec,
                                               InsertKvSpec)]
    return specs
