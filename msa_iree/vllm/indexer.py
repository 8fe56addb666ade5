"""msa-iree's MiniMax-M3 lightning indexer for vLLM 0.33.0 (see msa_iree.vllm).

vLLM's ROCm model asks one selector, once per model, for an indexer that emits the attend's page
table (`select_msa_indexer_impl_cls`, from `amd/indexer_msa.py`, imported by name into
`amd/model.py` and `amd/mtp.py`); in vLLM that is AITER's gfx950-only kernel. The plugin answers
with `MsaIreeIndexerImpl` where msa-iree serves the layer (its attention too), so that on gfx942
and CUDA the layer's indexer is msa-iree's:
- `MsaIreeIndexerMetadataBuilder.build`: vLLM's indexer metadata, then msa-iree's step plan of the
  index group (`MetadataBuilder.build` over the index cache's block table), once for all layers;
- `MsaIreeIndexerImpl.forward` (the signature vLLM's MSA indexer wrapper calls): the scores and
  top-k of the step's tokens into the model's shared top-k buffer, and the attend's page table
  for them into the layer's table buffers (`runtime.Indexer.topk_with_table`: on a GPU one launch
  of the hand-written kernel), through the attention group's plan; msa-iree's attend then reads
  that table and builds none;
- `MsaIreeIndexerImpl.insert`: the step's index keys into the index cache (`runtime.Indexer.insert`
  over the index group's plan: on a GPU the hand-written insert, padding skipped in the kernel),
  called by the layer's K/V write (msa_iree.vllm.backend) in place of vLLM's
  `minimax_m3_insert_index_cache`.
"""
from __future__ import annotations

import dataclasses

import torch

from vllm.config import get_current_vllm_config  # noqa: E402
from vllm.forward_context import get_forward_context  # noqa: E402
from vllm.logger import init_logger  # noqa: E402
from vllm.models.minimax_m3.common import indexer as _indexer  # noqa: E402

from ..layout import HEAD_DIM  # noqa: E402
from ..ops import IndexTopkGpuSpec  # noqa: E402
from ..runtime import Indexer, MetadataBuilder  # noqa: E402
from ..runtime.metadata import MsaMetadata  # noqa: E402
from . import backend  # noqa: E402

logger = init_logger(__name__)

# vLLM's indexer_kv_dtype -> the index cache's torch dtype (MiniMaxM3IndexerCache's)
INDEX_CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
INDEX_SUFFIX = ".index_cache"  # the index cache's layer name: the attention layer's + this


def indexer_unsupported_reason(*, topk_blocks, sparse_block_size, index_head_dim, indexer_kv_dtype,
                               score_type="max") -> str | None:
    """Why msa-iree's indexer does not serve this configuration, or None where it does."""
    if topk_blocks != backend.TOPK_BLOCKS:
        return f"topk_blocks={topk_blocks} is not built (msa-iree builds {backend.TOPK_BLOCKS})"
    if sparse_block_size != backend.SPARSE_BLOCK:
        return f"sparse_block_size={sparse_block_size} (msa-iree builds {backend.SPARSE_BLOCK})"
    if index_head_dim != HEAD_DIM:
        return f"index_head_dim={index_head_dim} (msa-iree builds {HEAD_DIM})"
    if indexer_kv_dtype not in INDEX_CACHE_DTYPES:
        return f"indexer_kv_dtype={indexer_kv_dtype!r} is not built (msa-iree builds {', '.join(INDEX_CACHE_DTYPES)})"
    if score_type != "max":
        return f"score_type={score_type!r} (msa-iree builds 'max')"
    return None


def _model_reason(vllm_config) -> str | None:
    """What of the model's configuration keeps the layer's attention or indexer from msa-iree."""
    if getattr(vllm_config.attention_config, "minimax_m3_indexer_cp", False):
        return "attention_config.minimax_m3_indexer_cp (msa-iree's indexer is not context-parallel)"
    from vllm.distributed import get_tensor_model_parallel_world_size

    text = vllm_config.model_config.hf_text_config
    tp = get_tensor_model_parallel_world_size()
    kv_heads = max(1, text.num_key_value_heads // tp)
    index_heads = max(1, text.sparse_attention_config["sparse_num_index_heads"] // tp)
    if index_heads != kv_heads:
        return f"{index_heads} index heads but {kv_heads} KV heads a rank (the emitted table needs them 1:1)"
    if index_heads not in IndexTopkGpuSpec.INDEX_HEADS:
        return f"{index_heads} index heads a rank (msa-iree builds {IndexTopkGpuSpec.INDEX_HEADS})"
    return backend.unsupported_reason(backend.TOPK_BLOCKS, vllm_config.cache_config.cache_dtype, kv_heads)


class MsaIreeIndexerBackend(_indexer.MiniMaxM3IndexerBackend):
    """The index cache's backend: vLLM's, with msa-iree's metadata builder."""

    @staticmethod
    def get_name() -> str:
        return "MSA_IREE_INDEXER"

    @staticmethod
    def get_impl_cls():
        return MsaIreeIndexerImpl

    @staticmethod
    def get_builder_cls():
        return MsaIreeIndexerMetadataBuilder


@dataclasses.dataclass
class MsaIreeIndexerMetadata(_indexer.MiniMaxM3IndexerMetadata):
    """vLLM's indexer metadata and the index group's msa-iree plan."""

    msa: MsaMetadata | None = None


class MsaIreeIndexerMetadataBuilder(_indexer.MiniMaxM3IndexerTritonMetadataBuilder):
    """Per step: vLLM's indexer metadata (its own builder), then the index group's plan (the
    checks, its block table and every token's request and position in stable buffers)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        scheduler = vllm_config.scheduler_config
        self.plan_builder = MetadataBuilder(scheduler.max_num_seqs, vllm_config.model_config.max_model_len,
                                            max_num_tokens=scheduler.max_num_batched_tokens,
                                            kernels=backend.kernel_library(), device=device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cm = common_attn_metadata
        md = super().build(common_prefix_len, cm, fast_build)
        L = md.decode.decode_query_len if md.decode is not None else 1
        plan = self.plan_builder.build(cm.block_table_tensor, cm.seq_lens, cm.query_start_loc,
                                       cm.compute_num_computed_tokens(), L, md.num_decodes,
                                       slot_mapping=cm.slot_mapping, num_actual_tokens=md.num_actual_tokens,
                                       max_seq_len=cm.max_seq_len)
        return MsaIreeIndexerMetadata(**{f.name: getattr(md, f.name) for f in dataclasses.fields(md)}, msa=plan)


class MsaIreeIndexerImpl(_indexer.MiniMaxM3IndexerImpl):
    """The layer's indexer on msa-iree's kernels: the step's top-k into the shared buffer and
    the attend's page table into the layer's table buffers (set by vLLM's MSA indexer wrapper)."""

    indexer_backend_cls = MsaIreeIndexerBackend

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        reason = indexer_unsupported_reason(topk_blocks=self.topk_blocks, sparse_block_size=self.block_size,
                                            index_head_dim=self.index_head_dim,
                                            indexer_kv_dtype=self.indexer_kv_dtype, score_type=self.score_type)
        if reason is None and self.num_index_heads != self.num_kv_heads:
            reason = f"{self.num_index_heads} index heads but {self.num_kv_heads} KV heads a rank"
        if reason is not None:
            raise ValueError(f"MiniMax-M3 msa-iree indexer: {reason}")
        # vLLM's model writes the index queries in the index cache's dtype (e4m3fn for an fp8 cache)
        cache_dtype = INDEX_CACHE_DTYPES[self.indexer_kv_dtype]
        self.indexer = Indexer(self.num_index_heads, cache_dtype, init_blocks=self.init_blocks,
                               local_blocks=self.local_blocks, query_dtype=cache_dtype,
                               kernels=backend.kernel_library())
        self.sparse_bt_buffer: torch.Tensor | None = None   # [tokens * H, 128], set by vLLM's wrapper
        self.sparse_ctx_buffer: torch.Tensor | None = None  # [tokens * H]
        self.indexer_cp = False

    def insert(self, index_k) -> None:
        """index_k [>= tokens, 128] (the model's bf16) into the index cache at the index group's
        slots (the plan's: vLLM's index slot mapping for the step)."""
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return  # a profiling run: caches unbound
        md = self._metadata(attn_metadata)
        self.indexer.insert(index_k, self.index_cache.kv_cache, md.msa)

    def _metadata(self, attn_metadata) -> MsaIreeIndexerMetadata:
        md = attn_metadata[self.index_cache.prefix]
        if not isinstance(md, MsaIreeIndexerMetadata) or md.msa is None:
            raise TypeError(f"MiniMax-M3 msa-iree indexer: expected the metadata of MsaIreeIndexerMetadataBuilder "
                            f"for {self.index_cache.prefix}, got {type(md).__name__}")
        return md

    def init_cp(self) -> None:
        raise ValueError("MiniMax-M3 msa-iree indexer: expected no indexer context parallelism "
                         "(attention_config.minimax_m3_indexer_cp), got it enabled")

    def forward(self, index_query, *, decode_page16_block_table=None, prefill_page16_block_table=None):
        """index_query [>= tokens, H * 128] in the index cache's dtype (bf16, or e4m3fn for an fp8
        cache, as vLLM's model writes it) -> (decode_topk, prefill_topk): views of the shared top-k
        buffer [H, tokens, 16], decode rows first (None where the step has none); the table into
        the layer's buffers. The page-16 block tables vLLM passes are not needed: the table is
        built through the attention group's plan."""
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return None, None  # a profiling run: caches unbound
        prefix = self.index_cache.prefix
        md, attend = self._metadata(attn_metadata), attn_metadata.get(prefix[:-len(INDEX_SUFFIX)])
        if not isinstance(attend, backend.MsaIreeMetadata) or attend.msa is None:
            raise TypeError(f"MiniMax-M3 msa-iree indexer: expected msa-iree's attention metadata for "
                            f"{prefix[:-len(INDEX_SUFFIX)]} (the emitted table addresses its cache), got "
                            f"{type(attend).__name__}")
        n, nd, h = md.num_actual_tokens, md.num_decode_tokens, self.num_index_heads
        iq = index_query[:n].view(-1, h, self.index_head_dim)
        table_out = None
        if self.sparse_bt_buffer is not None:
            table_out = (self.sparse_bt_buffer.view(-1, h, self.sparse_bt_buffer.shape[-1]),
                         self.sparse_ctx_buffer.view(-1, h))
        topk, _, _ = self.indexer.topk_with_table(iq, self.index_cache.kv_cache, md.msa, attend.msa,
                                                  out=self.topk_indices_buffer, table_out=table_out)
        return (topk[:, :nd] if nd else None), (topk[:, nd:n] if n > nd else None)


def select_msa_indexer_impl_cls(*, topk_blocks, sparse_block_size, index_head_dim, indexer_kv_dtype,
                                score_type="max"):
    """vLLM's MSA indexer selector, msa-iree first: its impl where it serves the layer (the
    indexer and, through the same configuration, the attention), else vLLM's answer."""
    reason = indexer_unsupported_reason(topk_blocks=topk_blocks, sparse_block_size=sparse_block_size,
                                        index_head_dim=index_head_dim, indexer_kv_dtype=indexer_kv_dtype,
                                        score_type=score_type) or _model_reason(get_current_vllm_config())
    backend._SELECTED["indexer"] = reason is None
    if reason is None:
        logger.info_once("MiniMax M3 indexer: selected MSA_IREE (indexer_kv_dtype=%s)", indexer_kv_dtype)
        return MsaIreeIndexerImpl
    logger.info_once("MiniMax M3 indexer: msa-iree does not serve this configuration (%s); vLLM's own selection",
                     reason)
    return backend._VLLM["select_indexer"](topk_blocks=topk_blocks, sparse_block_size=sparse_block_size,
                                           index_head_dim=index_head_dim, indexer_kv_dtype=indexer_kv_dtype,
                                           score_type=score_type)
