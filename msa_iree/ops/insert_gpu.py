"""The KV insert as one hand-written GPU-level MLIR text (templates/insert_kv_gpu.mlir.j2), in place.

One dispatch: a workgroup per token writes its K and V rows of every KV head into the SHUFFLE
page-16 views (fp8 caches quantized by the scale, round to nearest even, saturating), skipping
slots < 0. GPU targets only; the host CPU uses the portable `insert_kv`.
"""
from __future__ import annotations

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
