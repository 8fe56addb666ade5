"""The kernels: every MSA operation as a specialisation (a spec) that names one compiled module.

- ops/portable.py: the PyTorch formulations (iree-turbine export), every target; ops/indexer.py
  the indexer's scores and top-k, the same way, and ops/indexer_gpu.py its hand-written GPU
  kernel (both built when `msa-iree compile` is given an index cache dtype);
- ops/fma.py, ops/mma.py, ops/mfma.py: the hand-written GPU attend's three families (vector FMAs,
  CUDA tensor cores, gfx942 matrix cores), their shared part in ops/attend_gpu.py, their knobs in
  ops/tuning.py; ops/insert_gpu.py: the in-place GPU KV insert; the templates in ops/templates/.

This module is the registry: which spec classes exist, which attend family a target serves with,
and the kernel set a deployment of one config needs (`kernel_set`).
"""
from __future__ import annotations

import dataclasses

from ..config import MsaConfig
from ..layout import PAGES_PER_BLOCK
from .attend_gpu import GpuAttendSpec
from .fma import SparseAttnDecodeFmaSpec, SparseAttnPagedFmaSpec, SparseAttnPrefillFmaSpec
from .indexer import IndexCacheInsertSpec, IndexTopkSpec, index_q_dtype
from .indexer_gpu import QUERY_TILE, IndexTopkGpuSpec
from .insert_gpu import IndexCacheInsertGpuSpec, InsertKvGpuSpec
from .mfma import (SparseAttnDecodeMfmaEmulatedSpec, SparseAttnDecodeMfmaSpec, SparseAttnPagedMfmaEmulatedSpec,
                   SparseAttnPagedMfmaSpec, SparseAttnPrefillMfmaEmulatedSpec, SparseAttnPrefillMfmaSpec)
from .mma import SparseAttnDecodeMmaSpec, SparseAttnPagedMmaSpec, SparseAttnPrefillMmaSpec
from .portable import (BuildDecodeTableSpec, BuildPrefillTableSpec, InsertKvSpec, RebaseBlockTableSpec,
                       RebaseSlotsSpec, SparseAttnDecodeSpec, SparseAttnPrefillSpec, SparsePagedAttendSpec)
from .spec import KernelSpec, TemplateSpec
from .tuning import INDEXER, INDEXER_DOT, INDEXER_TILED

PORTABLE_SPECS = (RebaseBlockTableSpec, RebaseSlotsSpec, BuildDecodeTableSpec, BuildPrefillTableSpec,
                  SparseAttnDecodeSpec, SparseAttnPrefillSpec, SparsePagedAttendSpec, InsertKvSpec, IndexTopkSpec,
                  IndexCacheInsertSpec)
GPU_SPECS = (SparseAttnDecodeFmaSpec, SparseAttnPrefillFmaSpec, SparseAttnDecodeMmaSpec, SparseAttnPrefillMmaSpec,
             SparseAttnDecodeMfmaSpec, SparseAttnPrefillMfmaSpec, SparseAttnDecodeMfmaEmulatedSpec,
             SparseAttnPrefillMfmaEmulatedSpec, SparseAttnPagedFmaSpec, SparseAttnPagedMmaSpec, SparseAttnPagedMfmaSpec,
             SparseAttnPagedMfmaEmulatedSpec, InsertKvGpuSpec, IndexTopkGpuSpec, IndexCacheInsertGpuSpec)
ALL_KERNELS = {cls.kernel: cls for cls in (*PORTABLE_SPECS, *GPU_SPECS)}

# (attend family, target) -> the GPU attend's (decode, prefill) spec classes. "mfma" on cuda is the
# gfx942 kernel with its MFMAs emulated: it proves that kernel's numerics on an NVIDIA GPU (slow,
# test only: no deployment kernel set holds it)
GPU_ATTEND = {
    ("fma", "cuda"): (SparseAttnDecodeFmaSpec, SparseAttnPrefillFmaSpec),
    ("fma", "gfx942"): (SparseAttnDecodeFmaSpec, SparseAttnPrefillFmaSpec),
    ("mma", "cuda"): (SparseAttnDecodeMmaSpec, SparseAttnPrefillMmaSpec),
    ("mfma", "gfx942"): (SparseAttnDecodeMfmaSpec, SparseAttnPrefillMfmaSpec),
    ("mfma", "cuda"): (SparseAttnDecodeMfmaEmulatedSpec, SparseAttnPrefillMfmaEmulatedSpec),
}
# (attend family, target) -> the GPU attend over a given page table (the indexer's emitted table;
# interleaved caches only, block page stride 16, as the page-16 rebase assumes)
GPU_PAGED_ATTEND = {
    ("fma", "cuda"): SparseAttnPagedFmaSpec,
    ("fma", "gfx942"): SparseAttnPagedFmaSpec,
    ("mma", "cuda"): SparseAttnPagedMmaSpec,
    ("mfma", "gfx942"): SparseAttnPagedMfmaSpec,
    ("mfma", "cuda"): SparseAttnPagedMfmaEmulatedSpec,
}
# the matrix-core family each GPU target serves with
NATIVE_MATRIX = {"cuda": "mma", "gfx942": "mfma"}


def served_families(cfg: MsaConfig, target: str) -> list[tuple]:
    """The (family, target) keys of the GPU attends a deployment of `cfg` on `target` needs: the
    FMA family and the target's matrix-core family, each where it can build `cfg`."""
    families = [("fma", target), (NATIVE_MATRIX.get(target), target)]
    return [f for f in families if f in GPU_ATTEND and GPU_ATTEND[f][0].supports(cfg)]


def served_attends(cfg: MsaConfig, target: str) -> list[tuple]:
    """The GPU attend (decode, prefill) spec classes of `served_families`."""
    return [GPU_ATTEND[f] for f in served_families(cfg, target)]


def unbuilt_attends(cfg: MsaConfig, target: str) -> dict[str, str]:
    """{kernel: why} for the GPU attend families `target` has that cannot build `cfg` (the
    runtime then serves with the portable attend, which is much slower on a GPU)."""
    families = [("fma", target), (NATIVE_MATRIX.get(target), target)]
    return {GPU_ATTEND[f][0].kernel: GPU_ATTEND[f][0].unsupported_reason(cfg)
            for f in families if f in GPU_ATTEND and not GPU_ATTEND[f][0].supports(cfg)}


def with_variants(specs) -> list:
    """`specs`, each followed by its graph variant where that is another module (GpuAttendSpec.for_graph:
    the decode attends a CUDA / HIP graph captures) and by its inserting variant where it has one
    (GpuAttendSpec.with_insert: the top-k attend that also writes the step's new K/V, and a
    decode's graph variant of it)."""
    inserting = [i for i in (s.with_insert() for s in specs) if i is not None]
    return [v for s in specs for v in dict.fromkeys((s, s.for_graph()))] + [
        v for s in inserting for v in dict.fromkeys((s, s.for_graph()))]


def kernel_set(cfg: MsaConfig, strides=(16, 8), decode_query_lens=(1, 2, 3, 4), target=None) -> list[KernelSpec]:
    """Every kernel a deployment of `cfg` needs: per cache layout (block page stride) and per
    decode query length L (1 = plain decode, > 1 = speculative decode). For a GPU `target` also the
    hand-written attends (where the head grouping allows them) and the in-place KV insert."""
    gpu_attends = served_attends(cfg, target)
    specs = []
    for stride in strides:
        for L in decode_query_lens:
            specs += [BuildDecodeTableSpec(cfg.replace(decode_query_len=L), stride),
                      SparseAttnDecodeSpec(cfg.replace(decode_query_len=L), stride)]
            specs += with_variants([decode(cfg.replace(decode_query_len=L), stride) for decode, _ in gpu_attends])
        specs += with_variants([prefill(cfg, stride) for _, prefill in gpu_attends])
        if stride == 16:  # a given page table is read over an interleaved cache only
            specs += with_variants([GPU_PAGED_ATTEND[f](cfg, stride) for f in served_families(cfg, target)])
        if target in InsertKvGpuSpec.targets:
            specs.append(InsertKvGpuSpec(cfg, stride))
        specs += [cls(cfg, stride) for cls in (BuildPrefillTableSpec, SparseAttnPrefillSpec, SparsePagedAttendSpec,
                                               InsertKvSpec)]
    return specs




@dataclasses.dataclass(frozen=True)
class IndexerKernels:
    """The kernels of one layer's indexer (runtime.Indexer) on one target."""
    topk: IndexTopkSpec                   # scores and top-k, portable
    # the index-cache insert: hand-written on a GPU target (no host sync: padding skipped in the
    # kernel), else portable
    insert: IndexCacheInsertSpec | IndexCacheInsertGpuSpec
    table: BuildPrefillTableSpec          # the attend's page table for a top-k (page-16 rebase: stride 16)
    # scores and top-k, hand-written, where the target and cfg allow: (rows, emit_table) -> spec
    # (rows: a decode step's tokens of a request scored together; emit_table: the attend's page
    # table written by the same launch)
    topk_gpu: dict = dataclasses.field(default_factory=dict)
    # ... the tiled ones (any step: its tokens in query tiles, MsaMetadata.query_tiles): emit_table -> spec
    topk_gpu_tiled: dict = dataclasses.field(default_factory=dict)

    def gpu(self, rows: int = 1, emit_table: bool = False) -> IndexTopkGpuSpec | None:
        return self.topk_gpu.get((rows, emit_table))

    def gpu_tiled(self, emit_table: bool = False) -> IndexTopkGpuSpec | None:
        return self.topk_gpu_tiled.get(emit_table)

    def specs(self) -> list[KernelSpec]:
        return [self.topk, self.insert, self.table, *self.topk_gpu.values(), *self.topk_gpu_tiled.values()]


def indexer_dot(cfg: MsaConfig, target: str, rows: int = 1, fp8_queries: bool = False) -> str:
    """The GPU indexer's dot products on `target` for `rows` tokens a workgroup (tuning.INDEXER_DOT;
    "fma" for operands the matrix dot does not take: the tensor cores' bf16 dot takes bf16 index
    queries and e4m3fn ones (converted to bf16 exactly), gfx942's MFMAs bf16 keys with bf16
    queries and e4m3fn keys with e4m3fn queries)."""
    dot = INDEXER_DOT.get((target, cfg.kv_dtype), ("fma", "fma"))[rows > 1]
    if dot == "mfma":
        operands = (cfg.kv_dtype, index_q_dtype(cfg, fp8_queries))
        return dot if operands in IndexTopkGpuSpec.MFMA_OPERANDS else "fma"
    return dot if cfg.query_dtype == "bf16" or fp8_queries else "fma"


def indexer_set(cfg: MsaConfig, target=None, init_blocks: int = 0, local_blocks: int = 1,
                decode_query_lens=(1, 2, 3, 4), fp8_queries: bool = False) -> IndexerKernels:
    """The indexer's kernels for `cfg` (ops.indexer.indexer_config: index heads, index cache dtype,
    index keys' dtype) on `target`; init_blocks / local_blocks: MiniMax-M3's sparse_init_block /
    sparse_local_block; decode_query_lens: the decode steps' L, each scored in its own rows a
    workgroup; any other step (prefills) in query tiles, as many of a tile's tokens a workgroup as
    tuning.INDEXER_TILED.tile_rows says; fp8_queries: index queries in e4m3fn (an e4m3fn cache's,
    as vLLM writes them), else in cfg.query_dtype."""
    gpu, tiled, q8 = {}, {}, fp8_queries
    if target in IndexTopkGpuSpec.targets and IndexTopkGpuSpec.supports(cfg):
        for rows in sorted({1} | {INDEXER.rows_for(L, cfg.num_kv_heads) for L in decode_query_lens}):
            for emit in (False, True):
                gpu[rows, emit] = IndexTopkGpuSpec(cfg, 16, init_blocks, local_blocks, emit_table=emit, rows=rows,
                                                   dot=indexer_dot(cfg, target, rows, q8), fp8_queries=q8)
        dot = indexer_dot(cfg, target, QUERY_TILE, q8)
        rows = INDEXER_TILED.tile_rows(cfg.num_kv_heads, dot)
        if rows > 1:  # (one token a workgroup is the untiled kernel's)
            for emit in (False, True):
                tiled[emit] = IndexTopkGpuSpec(cfg, 16, init_blocks, local_blocks, emit_table=emit, rows=rows,
                                               tiled=True, dot=dot, fp8_queries=q8)
    insert = (IndexCacheInsertGpuSpec if target in IndexCacheInsertGpuSpec.targets else IndexCacheInsertSpec)(cfg)
    return IndexerKernels(IndexTopkSpec(cfg, 16, init_blocks, local_blocks, q8), insert,
                          BuildPrefillTableSpec(cfg, 2 * PAGES_PER_BLOCK), gpu, tiled)


__all__ = ["ALL_KERNELS", "IndexerKernels", "indexer_dot", "indexer_set", "with_variants", "GPU_ATTEND", "GPU_PAGED_ATTEND", "GPU_SPECS", "NATIVE_MATRIX", "PORTABLE_SPECS", "GpuAttendSpec", "KernelSpec",
           "TemplateSpec", "kernel_set", "served_attends", "served_families", "unbuilt_attends", *[c.__name__ for c in ALL_KERNELS.values()]]
