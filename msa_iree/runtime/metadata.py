"""Per-step metadata: what every sparse layer of one step shares, built once by `MetadataBuilder`.

The builder does everything that needs the host once per step (the decode-first split, per-token
positions, the page-16 rebase into its stable buffer, range checks, the insert's slot compaction);
a layer's calls read the plain `MsaMetadata` it returns.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import checks
from ..config import MsaConfig
from ..layout import BLOCK_SIZE
from ..ops import InsertKvGpuSpec, RebaseBlockTableSpec
from ..reference import query_token_positions
from .library import KernelLibrary


def _written_tokens(slot_mapping):
    """(token index, slot) int32 of the tokens whose slot is not padding (-1): a host sync."""
    keep = (slot_mapping >= 0).nonzero().reshape(-1)
    return keep.int(), slot_mapping[keep].int()


@dataclasses.dataclass
class DecodeMetadata:
    block_table: torch.Tensor          # [num_decodes, cols] int32, unrebased
    seq_lens: torch.Tensor             # [num_decodes] int32
    decode_query_len: int
    page16_block_table: torch.Tensor   # view of the builder's stable buffer


@dataclasses.dataclass
class PrefillMetadata:
    block_table: torch.Tensor          # [num_prefills, cols], request ids relative to the prefills
    cu_seqlens_q: torch.Tensor         # [num_prefills + 1] int32, from 0
    seq_lens: torch.Tensor
    context_lens: torch.Tensor         # prefix already computed
    query_req_id: torch.Tensor         # [num_prefill_tokens] int32
    query_abs_pos: torch.Tensor
    page16_block_table: torch.Tensor


@dataclasses.dataclass
class MsaMetadata:
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None
    slot_mapping: torch.Tensor              # [num_tokens] logical slots, -1 = padding
    insert_token_index: torch.Tensor        # [M] int32 tokens to write (see insert_slots)
    insert_slots: torch.Tensor              # [M] int32 their logical slots: padding dropped, or (the
                                            # GPU writer, slot_capacity set) every token's, -1 = skip, at
                                            # addresses kept across steps
    slot_capacity: int | None = None        # the builder checked every slot below this many tokens


class MetadataBuilder:
    """Builds per-step metadata once for all sparse layers (docs/SPEC.md, the metadata).

    page16_block_table_buffer: [max_num_seqs, cdiv(max_model_len, 128)] int32, allocated here and
    kept at one address across steps (a captured decode replays through it).

    With num_cache_blocks and a library whose KV insert is the GPU writer (which skips slot -1),
    the step's slots are range-checked here, once, and passed to `insert_kv` whole (padding
    included) from buffers kept at one address: its per-layer calls then neither sync with the
    host nor change shape between steps of one size, so a decode step with its inserts can be
    captured in a CUDA graph.
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, *, num_cache_blocks: int | None = None,
                 kernels: KernelLibrary | None = None, device="cpu"):
        self.kernels = kernels
        self.num_cache_blocks = num_cache_blocks
        cols = -(-max_model_len // BLOCK_SIZE)
        self.page16_block_table_buffer = torch.zeros(max_num_seqs, cols, dtype=torch.int32, device=device)
        self._insert_buffers = None  # (token index 0..n-1, slots) int32, grown to the largest step

    def build(self, block_table, seq_lens, query_start_loc, num_computed_tokens, decode_query_len: int,
              num_decodes: int, slot_mapping=None) -> MsaMetadata:
        """block_table [reqs, cols] int32; seq_lens, num_computed_tokens [reqs]; query_start_loc [reqs+1]."""
        num_reqs = seq_lens.shape[0]
        checks.check_dtype("block_table", block_table, torch.int32)
        checks.check_shape("block_table", block_table, (num_reqs, None))
        checks.check_shape("query_start_loc", query_start_loc, (num_reqs + 1,))
        checks.check_shape("num_computed_tokens", num_computed_tokens, (num_reqs,))
        if decode_query_len <= 0:
            raise ValueError(f"decode_query_len: expected > 0, got {decode_query_len}")
        if not 0 <= num_decodes <= num_reqs:
            raise ValueError(f"num_decodes: expected 0..num_reqs={num_reqs}, got {num_decodes}")
        qlens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
        bad = [q for q in qlens[:num_decodes] if q not in (decode_query_len, 0)]
        if bad:
            raise ValueError(f"decode query lengths: expected {decode_query_len} or 0 (graph padding) for the first "
                             f"num_decodes={num_decodes} requests, got {bad}")
        num_decode_tokens = num_decodes * decode_query_len
        num_tokens = int(query_start_loc[-1])
        if int(query_start_loc[num_decodes]) != num_decode_tokens:
            raise ValueError(f"num_decode_tokens: expected num_decodes * decode_query_len = {num_decode_tokens}, "
                             f"got {int(query_start_loc[num_decodes])} decode tokens in query_start_loc")
        buf = self.page16_block_table_buffer
        if num_reqs > buf.shape[0] or block_table.shape[1] > buf.shape[1]:
            raise ValueError(f"block table {(num_reqs, block_table.shape[1])} exceeds the page-16 rebase buffer "
                             f"{tuple(buf.shape)}")
        if self.num_cache_blocks is not None:
            checks.check_ids_in_range("block_table", block_table[block_table >= 0], self.num_cache_blocks)
        page16 = buf[:num_reqs, :block_table.shape[1]]
        page16.copy_(self._rebase(block_table))

        decode = prefill = None
        if num_decodes:
            decode = DecodeMetadata(block_table[:num_decodes], seq_lens[:num_decodes].int(), decode_query_len,
                                    page16[:num_decodes])
        if num_decodes < num_reqs:
            cu = (query_start_loc[num_decodes:] - query_start_loc[num_decodes]).int()
            ctx = num_computed_tokens[num_decodes:].int()
            req, pos = query_token_positions(cu, ctx, num_tokens - num_decode_tokens)
            prefill = PrefillMetadata(block_table[num_decodes:], cu, seq_lens[num_decodes:].int(), ctx, req, pos,
                                      page16[num_decodes:])
        if slot_mapping is None:
            slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int32)
        checks.check_shape("slot_mapping", slot_mapping, (None,))
        if slot_mapping.shape[0] < num_tokens:
            raise ValueError(f"slot_mapping: expected at least num_tokens={num_tokens} entries, "
                             f"got {slot_mapping.shape[0]}")
        slot_mapping = slot_mapping[:num_tokens]  # past the step's tokens: graph padding
        capacity = None
        if self.num_cache_blocks is not None:  # once per step, so that insert_kv need not per layer
            capacity = self.num_cache_blocks * BLOCK_SIZE
            checks.check_ids_in_range("slot_mapping", slot_mapping[slot_mapping >= 0], capacity)
        if capacity is not None and self.kernels is not None and self.kernels.target in InsertKvGpuSpec.targets:
            token_index, slots = self._stable_insert_buffers(slot_mapping)  # whole: the GPU writer skips -1
        else:
            token_index, slots = _written_tokens(slot_mapping)
        return MsaMetadata(num_tokens, num_decodes, num_decode_tokens, num_reqs - num_decodes,
                           num_tokens - num_decode_tokens, decode, prefill, slot_mapping, token_index, slots,
                           capacity)

    def _stable_insert_buffers(self, slot_mapping):
        """(0..n-1, the slots) as int32 views of buffers kept across steps (reallocated only for a
        larger step or another device), the slots copied in."""
        n, device = slot_mapping.shape[0], slot_mapping.device
        bufs = self._insert_buffers
        if bufs is None or bufs[0].shape[0] < n or bufs[0].device != device:
            size = max(n, 1)
            bufs = self._insert_buffers = (torch.arange(size, dtype=torch.int32, device=device),
                                           torch.empty(size, dtype=torch.int32, device=device))
        slots = bufs[1][:n]
        slots.copy_(slot_mapping)
        return bufs[0][:n], slots

    def _rebase(self, block_table):
        if self.kernels is None or block_table.numel() == 0:
            return block_table * 2
        (out,) = self.kernels.run(RebaseBlockTableSpec(MsaConfig()), block_table, out_dtypes=[torch.int32])
        return out
