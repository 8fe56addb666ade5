"""The cache inserts as hand-written GPU-level MLIR texts, in place, one dispatch each:

- the KV insert (templates/insert_kv_gpu.mlir.j2): a workgroup per token writes its K and V rows
  of every KV head into the SHUFFLE page-16 views (fp8 caches quantized by the scale, round to
  nearest even, saturating);
- the index-cache insert (templates/insert_index_gpu.mlir.j2): a workgroup per token writes its
  index key into the key-only index cache (an fp8 cache cast with no scale, as the KV insert
  rounds).

Both skip slots < 0, so a step's whole slot mapping goes in at a fixed size (no host sync: a
captured step). GPU targets only; the host CPU uses the portable inserts.
"""
from __future__ import annotations

from .indexer import check_index_cache_dtype
from .spec import FP8_FORMAT, MLIR_ELEMENT, TemplateSpec, render_template


class InsertKvGpuSpec(TemplateSpec):
    """Operands as the portable InsertKvSpec's; `main` writes into the cache argument itself
    (iree.abi.output on it, the dispatch tied to it), so the call updates the caller's buffer
    without a copy."""

    kernel = "insert_kv_gpu"
    template = "insert_kv_gpu.mlir.j2"
    targets = ("cuda", "gfx942")
    written_operands = (0,)  # the cache (a stream launch writes only into its operands)

    @property
    def variant(self):
        c = self.cfg
        return f"kv{c.num_kv_heads}.{c.kv_dtype}.q{c.query_dtype}.s{self.stride}"

    def render(self) -> str:
        c = self.cfg
        return render_template(self.template, H=c.num_kv_heads, QT=MLIR_ELEMENT[c.query_dtype],
                               KT=MLIR_ELEMENT[c.kv_dtype], FP8=FP8_FORMAT.get(c.kv_dtype), STRIDE=self.stride)


class IndexCacheInsertGpuSpec(TemplateSpec):
    """Operands as the portable IndexCacheInsertSpec's but the cache as [blocks, 16384] storage
    elements (index_cache, index_k [T, 128] in cfg.query_dtype, token_index, slot_mapping [M]
    int32, slots < 0 skipped); `main` writes into the cache argument itself (iree.abi.output)."""

    kernel = "insert_index_gpu"
    template = "insert_index_gpu.mlir.j2"
    targets = ("cuda", "gfx942")
    written_operands = (0,)  # the cache

    def __post_init__(self):
        check_index_cache_dtype(self.cfg)

    @property
    def variant(self):
        return f"{self.cfg.kv_dtype}.q{self.cfg.query_dtype}"

    def render(self) -> str:
        c = self.cfg
        return render_template(self.template, QT=MLIR_ELEMENT[c.query_dtype], KT=MLIR_ELEMENT[c.kv_dtype],
                               FP8=FP8_FORMAT.get(c.kv_dtype))
