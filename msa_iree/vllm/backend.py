"""msa-iree's MiniMax-M3 sparse attention backend for vLLM 0.33.0 (see msa_iree.vllm).

The classes subclass vLLM's AITER page-16 ones (`vllm/models/minimax_m3/amd/sparse_attention_msa.py`)
so that vLLM's MiniMax-M3 model treats them as it treats AITER's: it views the layer's cache as
SHUFFLE page-16 pages, passes the shared top-k buffer, and calls the impl with vLLM's own
signature. What runs is msa-iree's:
- `MsaIreeMetadataBuilder.build`: vLLM's split and sub-metadata (its own base builder), then
  msa-iree's step plan (`MetadataBuilder.build`: the checks, the page-16 rebases into stable
  buffers, only the block table's used columns brought to the host); the AITER metadata's page16
  tables are the plan's;
- `MsaIreeImpl.forward`: the decode-first attend through `SparseAttention` (its top-k from
  `layer.topk_indices_buffer`, an emitted table where the layer's indexer wrote one, the fp8
  scales from `layer._k_scale` / `_v_scale`), any number of KV heads per rank;
- the layer's K/V write (`_insert_aiter_sparse_pa_kv`, which calls AITER) through msa-iree's insert,
  and its index key through msa-iree's index-cache insert where msa-iree serves the indexer.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch

from . import BUILD_DIR, VLLM_VERSION

import vllm  # noqa: E402  (this module is the part of msa-iree that needs vLLM)
from vllm.forward_context import get_forward_context  # noqa: E402
from vllm.logger import init_logger  # noqa: E402
from vllm.models.minimax_m3.amd import sparse_attention_msa as _aiter  # noqa: E402
from vllm.models.minimax_m3.common import sparse_attention as _common  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from ..runtime import KernelLibrary, MetadataBuilder, SparseAttention  # noqa: E402
from ..runtime.metadata import MsaMetadata  # noqa: E402

logger = init_logger(__name__)

HEAD_SIZE, TOPK_BLOCKS, SPARSE_BLOCK = 128, 16, 128
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")
# what install() replaces, kept to defer to and to restore (tests)
_VLLM = {}
# the selectors' last decisions: the model's layer asks its page-16 gate right after selecting its
# attention; the model asks it (emitting a table) right after selecting its indexer
_SELECTED = {"msa_iree": False, "indexer": False}


def check_vllm_version():
    """Refuse a vLLM whose MiniMax-M3 classes differ from those this module was written against."""
    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(f"msa-iree's vLLM plugin: expected vLLM {VLLM_VERSION} (the MiniMax-M3 classes it "
                           f"subclasses), got {vllm.__version__}; unset MSA_IREE_VLLM to run vLLM without it")
    import inspect

    params = list(inspect.signature(_aiter.MiniMaxM3SparseAiterPAImpl.forward).parameters)
    expected = ["self", "layer", "query", "kv_cache", "output", "query_fp8", "decode_sparse_table"]
    if params != expected:
        raise RuntimeError(f"msa-iree's vLLM plugin: expected MiniMaxM3SparseAiterPAImpl.forward{tuple(expected)}, "
                           f"got {tuple(params)}")


def unsupported_reason(topk_blocks: int, kv_cache_dtype: str, num_kv_heads: int) -> str | None:
    """Why msa-iree does not serve this configuration, or None where it does."""
    if topk_blocks != TOPK_BLOCKS:
        return f"topk_blocks={topk_blocks} is not built (msa-iree builds {TOPK_BLOCKS})"
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        return f"kv_cache_dtype={kv_cache_dtype!r} is not built (msa-iree builds {', '.join(KV_CACHE_DTYPES)})"
    if num_kv_heads < 1:
        return f"num_kv_heads={num_kv_heads}"
    return None


# ---- the kernels ------------------------------------------------------------------------------


@functools.cache
def kernel_library() -> KernelLibrary:
    """The process's kernels: the build MSA_IREE_VLLM_BUILD names (its target from its manifest);
    never compiled mid-request: a kernel the build lacks is an error naming the command."""
    path = os.environ.get(BUILD_DIR)
    if not path:
        raise RuntimeError(f"{BUILD_DIR}: expected the build directory of `msa-iree compile --target gfx942 "
                           f"--tensor-parallel-size <tp> --kv-cache-dtype <dtype> --out <dir>`, got nothing")
    import json
    import pathlib

    manifest = pathlib.Path(path) / "manifest.json"
    if not manifest.is_file():
        raise RuntimeError(f"{BUILD_DIR}={path}: expected a build directory from msa-iree compile, found no "
                           "manifest.json")
    target = json.loads(manifest.read_text())["target"]
    return KernelLibrary(target, path)


def _cache_torch_dtype(kv_cache_dtype: str, fp8_dtype: torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return fp8_dtype
    return torch.bfloat16 if kv_cache_dtype == "bfloat16" else model_dtype


# ---- backend, metadata, builder, impl ---------------------------------------------------------


class MsaIreeBackend(_aiter.MiniMaxM3SparseAiterPABackend):
    """MiniMax-M3's sparse attention on msa-iree's kernels (the AITER page-16 backend's contract)."""

    supported_kv_cache_dtypes = list(KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "MSA_IREE"

    @staticmethod
    def get_impl_cls():
        return MsaIreeImpl

    @staticmethod
    def get_builder_cls():
        return MsaIreeMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls):
        # interleaved first (block-compact: the indexer's side cache shares the block pool), as AITER's
        return (KVCacheLayout.LBHNC, KVCacheLayout.LHBNC)


@dataclasses.dataclass
class MsaIreeMetadata(_common.MiniMaxM3SparseMetadata):
    """vLLM's MiniMax-M3 metadata (decode and prefill as the AITER builder makes them) and the
    step's msa-iree plan, which every layer's attend and insert read."""

    msa: MsaMetadata | None = None


class MsaIreeMetadataBuilder(_aiter.MiniMaxM3SparseAiterPAMetadataBuilder):
    """Per step: vLLM's own split and sub-metadata (the base builder), then msa-iree's plan, once
    for all sparse layers; the page-16 block table and slot mapping are the plan's (in buffers at
    stable addresses, which a captured decode replays through)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if kv_cache_spec.block_size != SPARSE_BLOCK:
            raise ValueError(f"MiniMax-M3 msa-iree sparse attention requires block_size == {SPARSE_BLOCK}, "
                             f"got {kv_cache_spec.block_size}")
        # the base computes the query positions and the page-16 slot mapping only when AITER is
        # requested; this backend serves the same metadata without AITER
        self.use_aiter_sparse_pa = True
        scheduler = vllm_config.scheduler_config
        self.page16_slot_mapping_buffer = torch.empty(scheduler.max_num_batched_tokens, dtype=torch.int64,
                                                      device=device)
        self.plan_builder = MetadataBuilder(scheduler.max_num_seqs, vllm_config.model_config.max_model_len,
                                            max_num_tokens=scheduler.max_num_batched_tokens,
                                            kernels=kernel_library(), device=device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cm = common_attn_metadata
        md = _common.MiniMaxM3SparseMetadataBuilder.build(self, common_prefix_len, cm, fast_build)
        L = md.decode.decode_query_len if md.decode is not None else 1
        plan = self.plan_builder.build(cm.block_table_tensor, cm.seq_lens, cm.query_start_loc,
                                       cm.compute_num_computed_tokens(), L, md.num_decodes,
                                       slot_mapping=cm.slot_mapping, num_actual_tokens=md.num_actual_tokens,
                                       max_seq_len=cm.max_seq_len)
        fields = {f.name: getattr(md, f.name) for f in dataclasses.fields(md)}
        fields["page16_slot_mapping"] = plan.page16_slot_mapping
        if md.decode is not None:
            fields["decode"] = _aiter.MiniMaxM3SparseAiterPADecodeMetadata(
                **vars(md.decode), page16_block_table=plan.decode.page16_block_table)
        if md.prefill is not None:
            fields["prefill"] = _aiter.MiniMaxM3SparseAiterPAPrefillMetadata(
                **vars(md.prefill), page16_block_table=plan.prefill.page16_block_table)
        return MsaIreeMetadata(**fields, msa=plan)


class MsaIreeImpl(_aiter.MiniMaxM3SparseAiterPAImpl):
    """The AITER page-16 impl's forward, on msa-iree's kernels: any number of KV heads per rank,
    with or without a table the indexer emitted."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, kv_cache_dtype="auto", *, topk_blocks,
                 sparse_block_size, msa_decode_backend="triton"):
        super().__init__(num_heads, head_size, scale, num_kv_heads, kv_cache_dtype, topk_blocks=topk_blocks,
                         sparse_block_size=sparse_block_size, msa_decode_backend=msa_decode_backend)
        if head_size != HEAD_SIZE:
            raise ValueError(f"MiniMax-M3 msa-iree sparse attention requires head_dim == {HEAD_SIZE}, got {head_size}")
        if sparse_block_size != SPARSE_BLOCK:
            raise ValueError(f"MiniMax-M3 msa-iree sparse attention requires sparse_block_size == {SPARSE_BLOCK}, "
                             f"got {sparse_block_size}")
        reason = unsupported_reason(topk_blocks, kv_cache_dtype, self.num_kv_heads)
        if reason is not None:
            raise ValueError(f"MiniMax-M3 msa-iree sparse attention: {reason}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"MiniMax-M3 msa-iree sparse attention requires num_heads divisible by num_kv_heads, "
                             f"got {self.num_heads} and {self.num_kv_heads}")
        self.kernels = kernel_library()
        self._attn = {}  # (query dtype, cache dtype) -> SparseAttention: one layer's attend and insert

    def attention(self, query_dtype, cache_dtype) -> SparseAttention:
        attn = self._attn.get((query_dtype, cache_dtype))
        if attn is None:
            attn = self._attn[query_dtype, cache_dtype] = SparseAttention(
                self.num_heads, self.num_kv_heads, self.head_size, self.scale, cache_dtype, kernels=self.kernels,
                query_dtype=query_dtype)
        return attn

    def _plan(self, layer) -> MsaMetadata | None:
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return None  # a profiling run: caches unbound
        md = attn_metadata[layer.layer_name]
        if not isinstance(md, MsaIreeMetadata) or md.msa is None:
            raise TypeError(f"MiniMax-M3 msa-iree sparse attention: expected the metadata of MsaIreeMetadataBuilder "
                            f"for {layer.layer_name}, got {type(md).__name__}")
        return md.msa

    def _scales(self, layer):
        if not self.use_fp8_kv:
            return None, None
        return getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)

    def forward(self, layer, query, kv_cache, output, *, query_fp8=None, decode_sparse_table=None):
        plan = self._plan(layer)
        if plan is None:
            return output
        n, h, hd = plan.num_actual_tokens, self.num_kv_heads, self.head_size
        q = query[:n].view(-1, self.num_heads, hd)
        out = output[:n].view(-1, self.num_heads, hd)
        topk = layer.topk_indices_buffer
        if topk is None:
            raise RuntimeError("MiniMax-M3 msa-iree sparse attention: expected the layer's topk_indices_buffer "
                               "(the indexer's selection), got None")
        k_cache, v_cache = layer.get_aiter_sparse_pa_kv_cache()
        sparse_bt = getattr(layer, "sparse_bt_buffer", None)
        sparse_ctx = getattr(layer, "sparse_ctx_buffer", None)
        table = {}
        if sparse_bt is not None:
            # the table the indexer emitted into the layer's buffers: its rows for this step (the
            # attend checks the cache stride it was scaled for, and raises vLLM's error)
            table = dict(sparse_block_table=sparse_bt[:n * h], sparse_context_lens=sparse_ctx[:n * h])
        # decode_sparse_table (a table the Triton indexer fused for the decode rows) is not needed:
        # the attend builds the same table itself
        self.attention(q.dtype, k_cache.dtype).forward(q, k_cache, v_cache, out, topk, plan, *self._scales(layer),
                                                        **table)
        return output

    def insert_kv(self, layer, key, value, key_cache, value_cache):
        """The layer's K/V write (what AITER's reshape_and_cache does on vLLM's path): key/value
        [tokens, H, 128] of this step into the layer's page-16 views."""
        plan = self._plan(layer)
        if plan is None:
            return
        n = plan.num_actual_tokens
        self.attention(key.dtype, key_cache.dtype).insert_kv(key[:n], value[:n], key_cache, value_cache, plan,
                                                             *self._scales(layer))


# ---- the selection ----------------------------------------------------------------------------


def select_main_backend_and_impl_cls(*, topk_blocks, kv_cache_dtype, num_kv_heads, emits_sparse_block_table=False):
    """vLLM's selector, msa-iree first: its classes where it serves the configuration."""
    reason = unsupported_reason(topk_blocks, kv_cache_dtype, num_kv_heads)
    _SELECTED["msa_iree"] = reason is None
    if reason is None:
        logger.info_once("MiniMax M3 sparse attention selected MSA_IREE (kv_cache_dtype=%s, topk_blocks=%s, "
                         "num_kv_heads=%s)", kv_cache_dtype, topk_blocks, num_kv_heads)
        return MsaIreeBackend, MsaIreeImpl
    logger.info_once("MiniMax M3 sparse attention: msa-iree does not serve this configuration (%s); vLLM's own "
                     "selection", reason)
    return _VLLM["select"](topk_blocks=topk_blocks, kv_cache_dtype=kv_cache_dtype, num_kv_heads=num_kv_heads,
                           emits_sparse_block_table=emits_sparse_block_table)


def use_page16_path(num_kv_heads, *, emits_sparse_block_table=False):
    """The model's `minimax_m3_use_aiter_sparse_pa` (asked by a layer right after it selected its
    backend, and by the model right after it selected its table-emitting indexer): True, the
    page-16 cache views and K/V write, where the selection was msa-iree's, for any number of KV
    heads per rank; vLLM's own answer otherwise."""
    if _SELECTED["msa_iree"] or (emits_sparse_block_table and _SELECTED["indexer"]):
        return True
    return _VLLM["gate"](num_kv_heads, emits_sparse_block_table=emits_sparse_block_table)


def _insert_kv(layer, k, v, index_k, slot_mapping, index_slot_mapping, key_cache, value_cache):
    """The layer's `_insert_aiter_sparse_pa_kv`: msa-iree's insert for K/V (the slots are the
    plan's logical ones; `slot_mapping`, rebased for AITER's writer, is not needed), then the
    index key into the indexer's side cache."""
    if layer.kv_cache.numel() == 0:
        return
    if not isinstance(layer.impl, MsaIreeImpl):
        return _VLLM["insert"](layer, k, v, index_k, slot_mapping, index_slot_mapping, key_cache, value_cache)
    layer.impl.insert_kv(layer, k, v, key_cache, value_cache)
    if index_k is not None and index_slot_mapping is not None:
        insert_index_key(layer.indexer, index_k, index_slot_mapping)


def insert_index_key(indexer, index_k, index_slot_mapping):
    """A layer's index keys [tokens, 128] into its indexer's side cache: msa-iree's insert over the
    index group's plan where msa-iree serves the indexer (its slots are the plan's), else as vLLM
    writes them (`minimax_m3_insert_index_cache` at index_slot_mapping)."""
    from .indexer import MsaIreeIndexerImpl

    if indexer.index_cache.kv_cache.numel() == 0:
        return
    impl = getattr(indexer, "impl", None)  # (vLLM's MSA indexer wrapper holds its impl)
    if isinstance(impl, MsaIreeIndexerImpl):
        impl.insert(index_k)
        return
    from vllm.models.minimax_m3.amd.ops.sparse_pa import minimax_m3_insert_index_cache

    minimax_m3_insert_index_cache(index_k, indexer.index_cache.kv_cache, index_slot_mapping)


def install():
    """Route vLLM's MiniMax-M3 selection through msa-iree: the attention selector where it is
    defined and where the ROCm model imported it by name, the table-emitting indexer's selector
    where the ROCm model and its MTP layer imported it (msa_iree.vllm.indexer), the model's page-16
    gate, and its K/V write."""
    from vllm.models.minimax_m3.amd import model as amd_model
    from vllm.models.minimax_m3.amd import mtp as amd_mtp

    from . import indexer

    if _VLLM:
        return
    _VLLM.update(select=_common.select_main_backend_and_impl_cls, gate=amd_model.minimax_m3_use_aiter_sparse_pa,
                 insert=amd_model.MiniMaxM3SparseAttention._insert_aiter_sparse_pa_kv,
                 select_indexer=amd_model.select_msa_indexer_impl_cls)

    _common.select_main_backend_and_impl_cls = select_main_backend_and_impl_cls
    amd_model.select_main_backend_and_impl_cls = select_main_backend_and_impl_cls
    amd_model.select_msa_indexer_impl_cls = indexer.select_msa_indexer_impl_cls
    amd_mtp.select_msa_indexer_impl_cls = indexer.select_msa_indexer_impl_cls
    amd_model.minimax_m3_use_aiter_sparse_pa = use_page16_path
    amd_mtp.minimax_m3_use_aiter_sparse_pa = use_page16_path
    amd_model.MiniMaxM3SparseAttention._insert_aiter_sparse_pa_kv = _insert_kv


def uninstall():
    """Put vLLM's own selection back (tests)."""
    from vllm.models.minimax_m3.amd import model as amd_model
    from vllm.models.minimax_m3.amd import mtp as amd_mtp

    if not _VLLM:
        return
    _common.select_main_backend_and_impl_cls = _VLLM["select"]
    amd_model.select_main_backend_and_impl_cls = _VLLM["select"]
    amd_model.select_msa_indexer_impl_cls = _VLLM["select_indexer"]
    amd_mtp.select_msa_indexer_impl_cls = _VLLM["select_indexer"]
    amd_mtp.minimax_m3_use_aiter_sparse_pa = _VLLM["gate"]
    _SELECTED.update(msa_iree=False, indexer=False)
    amd_model.minimax_m3_use_aiter_sparse_pa = _VLLM["gate"]
    amd_model.MiniMaxM3SparseAttention._insert_aiter_sparse_pa_kv = _VLLM["insert"]
    _VLLM.clear()
