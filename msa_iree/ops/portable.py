"""The portable kernels: each MSA operation as a PyTorch module exported to MLIR with
iree-turbine (`aot.export`), beside the spec that names its specialisation.

One formulation compiles with IREE 3.13 for the host CPU (what the tests run), gfx942 and CUDA
sm_80, in ~1-2 s per target. Rules that keep one source valid for every target (each learnt from
a failing compile; docs/DESIGN.md):
- fp8 caches arrive as raw bytes (uint8), decoded through a 256-entry table and quantized by
  counting rounding midpoints (ops/fp8.py): native fp8 casts fail on sm_80 and differ on llvm-cpu;
- every gather index is int64 and clamped into range, so no input can read out of bounds; range
  *errors* are raised by the runtime's builder (once per step), not here;
- token counts, requests, table columns and cache pages are dynamic dimensions; head counts,
  head_dim, block, page and top-k are compile-time.

Shapes below: T tokens, Hq query heads, H KV heads, G = Hq/H, K top-k, C table columns,
P pages, x = 16 bytes / element.
"""
from __future__ import annotations

import torch

from ..config import FP8_DTYPES
from ..layout import BLOCK_SIZE, HEAD_DIM, PAGE_SIZE, PAGES_PER_BLOCK, elements_per_16_bytes
from .fp8 import decode_fp8, encode_fp8, storage_dtype
from .spec import ExportedSpec

# The attend and the indexer's top-k gather every row's keys (the attend its values too) as f32
# before they reduce them, so one call's memory grows with its rows: the runtime calls one over
# at most this many gathered bytes at a time (whole rows, at least one), whatever the step's size
GATHER_BYTES_PER_CALL = 256 << 20


def rows_per_call(bytes_per_row: int) -> int:
    """Rows of one portable call whose gathers stay within GATHER_BYTES_PER_CALL (at least 1)."""
    return max(1, GATHER_BYTES_PER_CALL // bytes_per_row)


# ---- shared pieces of the formulations ------------------------------------------------------


def sparse_rows(topk, table_block, abs_pos, block_page_stride, num_kv_heads):
    """The sparse page table of every row (docs/SPEC.md), gather- and scatter-free (one-hot over
    the top-k slots).

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
        """The table build (docs/SPEC.md) fused with the attend: one module call per layer."""
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


# ---- the specialisations (manifest names) ---------------------------------------------------


def _dims():
    D = torch.export.Dim
    return dict(T=D("tokens", min=1, max=2 ** 20), P=D("pages", min=2, max=2 ** 31 - 1),
                B=D("requests", min=1, max=2 ** 16), C=D("columns", min=1, max=2 ** 16),
                S=D("scale_slots", min=1, max=2 ** 31 - 1), N=D("slots", min=1, max=2 ** 20),
                # V has its own page count (8 fewer when interleaved) and its own scale tensor
                Pv=D("v_pages", min=2, max=2 ** 31 - 1), Sv=D("v_scale_slots", min=1, max=2 ** 31 - 1))


class RebaseBlockTableSpec(ExportedSpec):
    kernel = "rebase_block_table_to_page16"
    variant = "i32"

    def module(self):
        return RebaseBlockTable()

    def example_args(self):
        return (torch.zeros(3, 4, dtype=torch.int32),)

    def dynamic_shapes(self):
        d = _dims()
        return {"block_table": {0: d["B"], 1: d["C"]}}


class RebaseSlotsSpec(ExportedSpec):
    kernel = "rebase_slots_to_page16"
    variant = "i32"

    def module(self):
        return RebaseSlots()

    def example_args(self):
        return (torch.zeros(5, dtype=torch.int32),)

    def dynamic_shapes(self):
        return {"slot_mapping": {0: _dims()["N"]}}


class _TableSpec(ExportedSpec):
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


class _AttendSpec(ExportedSpec):
    def rows_per_call(self) -> int:
        """Query rows of one call: a row gathers K and V of its top-k blocks for every KV head, as f32."""
        c = self.cfg
        return rows_per_call(2 * c.topk * BLOCK_SIZE * c.num_kv_heads * HEAD_DIM * 4)


class SparsePagedAttendSpec(_AttendSpec):
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


class SparseAttnDecodeSpec(_AttendSpec):
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


class SparseAttnPrefillSpec(_AttendSpec):
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


class InsertKvSpec(ExportedSpec):
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
