"""Per-step metadata: what every sparse layer of one step shares, built once by `MetadataBuilder`.

The builder does, once per step, everything that needs the host or the step's values: the
decode-first split, the checks of every id against what it indexes (so that no layer has to sync
with the host), per-token positions, the page-16 rebase, the insert's slots. It writes the step's
tensors into buffers it keeps at stable addresses, so that a layer's bound launch (and a captured
CUDA graph) reads the next step's values from the same memory. A layer's calls read the plain
`MsaMetadata` it returns (docs/SPEC.md, "Per-step metadata").
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .. import checks
from ..layout import BLOCK_SIZE
from ..ops import InsertKvGpuSpec
from .library import KernelLibrary


@dataclasses.dataclass
class DecodeMetadata:
    """The decode requests of a step (the first num_decodes), each with decode_query_len tokens."""

    block_table: torch.Tensor          # [num_decodes, cols] int32 cache block ids, unrebased
    seq_lens: torch.Tensor             # [num_decodes] int32, the new tokens included
    decode_query_len: int              # L: 1, or 1 + speculative tokens
    page16_block_table: torch.Tensor   # [num_decodes, cols] int32: block_table * 2 (vLLM's page16 view)


@dataclasses.dataclass
class PrefillMetadata:
    """The (chunked) prefill requests of a step, their request ids relative to the prefills."""

    block_table: torch.Tensor          # [num_prefills, cols] int32
    cu_seqlens_q: torch.Tensor         # [num_prefills + 1] int32, from 0
    seq_lens: torch.Tensor             # [num_prefills] int32
    context_lens: torch.Tensor         # [num_prefills] int32: tokens computed before this step
    query_req_id: torch.Tensor         # [num_prefill_tokens] int32
    query_abs_pos: torch.Tensor        # [num_prefill_tokens] int32
    page16_block_table: torch.Tensor   # [num_prefills, cols] int32


@dataclasses.dataclass
class MsaMetadata:
    """One step, as every layer's `forward` and `insert_kv` read it. The tensors are views of the
    builder's buffers (stable addresses); the ints were checked by the builder."""

    num_actual_tokens: int             # the step's tokens (decode first); rows past it are not touched
    num_decodes: int
    num_decode_tokens: int             # num_decodes * decode_query_len (padding requests included)
    num_prefills: int
    num_prefill_tokens: int
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None
    slot_mapping: torch.Tensor         # [num_actual_tokens] int32 logical slots, < 0 = not written
    page16_slot_mapping: torch.Tensor  # [num_actual_tokens] int32 the slots rebased for an interleaved cache
    insert_token_index: torch.Tensor   # [M] int32 rows of key/value the insert writes ...
    insert_slots: torch.Tensor         # [M] int32 ... at these slots (the GPU writer: every token, < 0 skipped)
    max_block_id: int                  # the largest cache block id the step's requests reference (-1: none)
    max_slot: int                      # the largest slot the step writes (-1: none)
    # where and how big the step's tensors are: two steps with one key have their tensors at the
    # same addresses in the same shapes, so a launch bound for one serves the other
    step_key: tuple = ()

    def check_cache_blocks(self, num_blocks: int, what="k_cache"):
        """Refuse a cache with fewer blocks than the step references (no sync: ints)."""
        if self.max_block_id >= num_blocks:
            raise IndexError(f"block_table: expected cache block ids below {what}'s {num_blocks} blocks, "
                             f"got {self.max_block_id} (out of range)")

    def check_cache_slots(self, capacity: int, what="k_cache"):
        if self.max_slot >= capacity:
            raise IndexError(f"slot_mapping: expected slots below {what}'s {capacity} tokens, got {self.max_slot} "
                             "(out of range)")


def _cdiv(a, b):
    return -(-a // b)


class _Buffer:
    """An int32 buffer kept at one address, grown (reallocated) only for a larger step; `arange`
    holds 0, 1, 2, ... (the token index of a step that writes every token)."""

    def __init__(self, size, device, arange=False):
        self.device, self.arange = device, arange
        self.t = self._new(max(size, 1))

    def _new(self, n):
        return (torch.arange if self.arange else torch.empty)(n, dtype=torch.int32, device=self.device)

    def view(self, *shape):
        n = 1
        for s in shape:
            n *= s
        if n > self.t.shape[0]:
            self.t = self._new(n)
        return self.t[:n].view(*shape)


class MetadataBuilder:
    """Builds a step's metadata once for all sparse layers.

    max_num_seqs, max_model_len: the engine's limits (vLLM's scheduler and model config); a step
    beyond them is refused. max_num_tokens: the most tokens a step holds (vLLM's
    max_num_batched_tokens), which sizes the per-token buffers; a larger step reallocates them
    (their addresses change: a graph captured before must be captured again). num_cache_blocks:
    the KV cache's blocks, so that an out-of-range block id or slot is refused here rather than
    by each layer (each layer checks its own cache's size against the step's largest id, without
    a sync, either way). kernels: the library whose KV writer decides the insert's slot form (the
    builder itself runs torch operations only: one host transfer and a few copies a step).
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, *, max_num_tokens: int | None = None,
                 num_cache_blocks: int | None = None, kernels: KernelLibrary | None = None, device="cpu"):
        if max_num_seqs < 1 or max_model_len < 1:
            raise ValueError(f"max_num_seqs, max_model_len: expected >= 1, got {max_num_seqs}, {max_model_len}")
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.num_cache_blocks = num_cache_blocks
        self.kernels = kernels
        self.device = torch.device(device)
        self.max_cols = _cdiv(max_model_len, BLOCK_SIZE)
        tokens = max_num_tokens or max_num_seqs * 8
        # vLLM's page-16 buffer: [max_num_seqs, cdiv(max_model_len, 128)], a step's table its [:reqs, :cols]
        self.page16_block_table_buffer = torch.zeros(max_num_seqs, self.max_cols, dtype=torch.int32, device=device)
        # the step's inputs as given, [qsl | seq_lens | computed | block table | slots], one copy in
        self._inputs = _Buffer(max_num_seqs * (self.max_cols + 3) + 1 + tokens, self.device)
        # what the builder derives on the host, [page16 slots | slots | cu_seqlens_q | context_lens |
        # query_req_id | query_abs_pos], one copy in
        self._derived = _Buffer(4 * tokens + 2 * max_num_seqs + 1, self.device)
        self._token_index = _Buffer(tokens, self.device, arange=True)

    # ---- the step's checks (host values, once per step) ----

    def _stage_inputs(self, query_start_loc, seq_lens, num_computed_tokens, block_table, slot_mapping):
        """The step's inputs copied into one device buffer and brought to the host in one
        transfer: (the buffer, qsl, seq_lens and computed as lists, the block table [reqs, cols]
        and the slots as int32 arrays)."""
        parts = [t.reshape(-1) for t in (query_start_loc, seq_lens, num_computed_tokens, block_table)]
        if slot_mapping is not None:
            parts.append(slot_mapping)
        stage = self._inputs.view(sum(t.shape[0] for t in parts))
        if block_table.device == stage.device:
            torch.cat(parts, out=stage)
        else:
            stage.copy_(torch.cat(parts))
        host = stage.cpu().numpy()
        b, n = seq_lens.shape[0], block_table.numel()
        lists = host[:3 * b + 1].tolist()
        return (stage, lists[:b + 1], lists[b + 1:2 * b + 1], lists[2 * b + 1:],
                host[3 * b + 1:3 * b + 1 + n].reshape(block_table.shape), host[3 * b + 1 + n:])

    def _split(self, qsl, seq, computed, decode_query_len, num_decodes, num_actual_tokens):
        """(num_decode_tokens, num_tokens) after checking the decode-first split: every decode
        request has L tokens, except trailing padding requests of length 0 and seq_len 0 (vLLM's
        padded uniform decode batch, whose L tokens count in num_actual_tokens)."""
        num_reqs, L = len(seq), decode_query_len
        qlens = [qsl[i + 1] - qsl[i] for i in range(num_reqs)]
        if qsl[0] != 0 or any(q < 0 for q in qlens):
            raise ValueError(f"query_start_loc: expected non-decreasing offsets from 0, got {qsl}")
        real = next((i for i in range(num_decodes) if qlens[i] == 0), num_decodes)  # the first padding request
        bad = [(i, q) for i, q in enumerate(qlens[:real]) if q != L]
        if bad:
            raise ValueError(f"decode query lengths: expected decode_query_len={L} for each of the first "
                             f"num_decodes={num_decodes} requests, got {bad[0][1]} for request {bad[0][0]}")
        for i in range(real, num_decodes):
            if qlens[i] != 0 or seq[i] != 0:
                raise ValueError(f"decode padding: expected the padding requests of a decode batch (query length 0) "
                                 f"at its end with seq_len 0, got query length {qlens[i]} and seq_len {seq[i]} for "
                                 f"request {i} after padding request {real}")
        num_decode_tokens = num_decodes * L
        num_tokens = qsl[-1] if num_actual_tokens is None else num_actual_tokens
        if real < num_decodes:  # a padded batch: decodes only, num_actual_tokens counting the padding
            if num_decodes != num_reqs or num_tokens != num_decode_tokens:
                raise ValueError(f"num_actual_tokens: expected num_decodes * decode_query_len = {num_decode_tokens} "
                                 f"for a decode batch padded with {num_decodes - real} requests of length 0 (and no "
                                 f"prefills), got {num_tokens} tokens and {num_reqs - num_decodes} prefill requests")
        elif qsl[num_decodes] != num_decode_tokens:
            raise ValueError(f"num_decode_tokens: expected num_decodes * decode_query_len = {num_decode_tokens}, "
                             f"got {qsl[num_decodes]} decode tokens in query_start_loc")
        elif num_tokens != qsl[-1]:
            raise ValueError(f"num_actual_tokens: expected query_start_loc[-1] = {qsl[-1]} (padding tokens only "
                             f"in a padded decode batch), got {num_tokens}")
        for r in range(num_reqs):
            if seq[r] > self.max_model_len:
                raise ValueError(f"seq_lens: expected at most max_model_len={self.max_model_len} tokens a request, "
                                 f"got {seq[r]} for request {r}")
            if seq[r] != computed[r] + qlens[r]:
                raise ValueError(f"seq_lens: expected num_computed_tokens + query length = {computed[r] + qlens[r]} "
                                 f"for request {r}, got {seq[r]}")
        return num_decode_tokens, num_tokens

    def _check_ids(self, block_table, seq, slots, num_tokens):
        """(max_block_id, max_slot) of the step (host values: block_table [reqs, cols] and slots
        int32 arrays), after checking that every block a request's context spans has a column and
        a block id >= 0 (and < num_cache_blocks), and every slot written is in range: what a
        layer's attend and insert would otherwise clamp."""
        cols = block_table.shape[1]
        need = np.array([_cdiv(s, BLOCK_SIZE) for s in seq], dtype=np.int64)
        short = np.flatnonzero(need > cols)
        if short.size:
            r = int(short[0])
            raise IndexError(f"block_table: expected at least cdiv(seq_len, 128) = {need[r]} columns for request {r} "
                             f"(seq_len {seq[r]}), got {cols} columns")
        used = np.arange(cols)[None, :] < need[:, None]
        ids = block_table[used]
        max_block = int(ids.max()) if ids.size else -1
        if ids.size and int(ids.min()) < 0:
            r, c = (int(i) for i in np.argwhere(used & (block_table < 0))[0])
            raise IndexError(f"block_table: expected a cache block id >= 0 for every block of a request's context, "
                             f"got {int(block_table[r, c])} at request {r}, column {c} (seq_len {seq[r]})")
        written = slots[:num_tokens]
        max_slot = max(int(written.max()), -1) if written.size else -1
        if self.num_cache_blocks is not None:
            if max_block >= self.num_cache_blocks:
                raise IndexError(f"block_table: expected ids in [0, {self.num_cache_blocks}) (num_cache_blocks), "
                                 f"got {max_block} (out of range)")
            if max_slot >= self.num_cache_blocks * BLOCK_SIZE:
                raise IndexError(f"slot_mapping: expected ids in [0, {self.num_cache_blocks * BLOCK_SIZE}) "
                                 f"(num_cache_blocks * 128), got {max_slot} (out of range)")
        return max_block, max_slot

    # ---- the step ----

    def build(self, block_table, seq_lens, query_start_loc, num_computed_tokens, decode_query_len: int,
              num_decodes: int, slot_mapping=None, *, num_actual_tokens: int | None = None) -> MsaMetadata:
        """One step's metadata (vLLM's CommonAttentionMetadata, decode-first).

        block_table [reqs, cols] int32 cache block ids (128-token blocks); seq_lens [reqs] int32
        (the step's tokens included); query_start_loc [reqs + 1] int32; num_computed_tokens [reqs]
        int32 (seq_lens - query lengths); decode_query_len L; num_decodes: the first requests,
        each L tokens (a padded batch ends in requests of length 0 and seq_len 0, counted in
        num_actual_tokens); slot_mapping [>= tokens] int32 logical slots (< 0: not written).
        """
        num_reqs = seq_lens.shape[0]
        checks.check_dtype("block_table", block_table, torch.int32)
        checks.check_shape("block_table", block_table, (num_reqs, None))
        for name, t, shape in (("seq_lens", seq_lens, (num_reqs,)), ("query_start_loc", query_start_loc, (num_reqs + 1,)),
                               ("num_computed_tokens", num_computed_tokens, (num_reqs,))):
            checks.check_dtype(name, t, (torch.int32, torch.int64))
            checks.check_shape(name, t, shape)
        if decode_query_len <= 0:
            raise ValueError(f"decode_query_len: expected > 0, got {decode_query_len}")
        if not 0 <= num_decodes <= num_reqs:
            raise ValueError(f"num_decodes: expected 0..num_reqs={num_reqs}, got {num_decodes}")
        if num_reqs > self.max_num_seqs or block_table.shape[1] > self.max_cols:
            raise ValueError(f"block table {(num_reqs, block_table.shape[1])} exceeds the page-16 rebase buffer "
                             f"{tuple(self.page16_block_table_buffer.shape)}")
        if slot_mapping is not None:
            checks.check_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
            checks.check_shape("slot_mapping", slot_mapping, (None,))
        named = {"seq_lens": seq_lens, "query_start_loc": query_start_loc, "num_computed_tokens": num_computed_tokens,
                 "slot_mapping": slot_mapping}
        for name, t in named.items():
            if t is not None and t.device != block_table.device:
                raise ValueError(f"{name}: expected the block table's device {block_table.device}, got {t.device}")
        stage, qsl, seq, computed, host_bt, host_slots = self._stage_inputs(
            query_start_loc, seq_lens, num_computed_tokens, block_table, slot_mapping)
        num_decode_tokens, num_tokens = self._split(qsl, seq, computed, decode_query_len, num_decodes,
                                                    num_actual_tokens)
        if slot_mapping is not None and slot_mapping.shape[0] < num_tokens:
            raise ValueError(f"slot_mapping: expected at least num_tokens={num_tokens} entries, "
                             f"got {slot_mapping.shape[0]}")
        max_block, max_slot = self._check_ids(host_bt, seq, host_slots, num_tokens)

        # the step's tensors: views of the two buffers (stable addresses for a step of the same
        # shape), the block-table rebase in place on the device, the rest derived on the host and
        # copied in at once
        cols = block_table.shape[1]
        b, n_bt = num_reqs, num_reqs * cols
        seqs = stage[b + 1:2 * b + 1]
        bt = stage[3 * b + 1:3 * b + 1 + n_bt].view(num_reqs, cols)
        page16 = self.page16_block_table_buffer[:num_reqs, :cols]
        torch.mul(bt, 2, out=page16)  # reference.rebase_block_table_to_page16
        host_slots = host_slots[:num_tokens] if slot_mapping is not None else np.full(num_tokens, -1, np.int32)
        # reference.rebase_slots_to_page16: slot + its block's first slot (block * 128), < 0 kept
        host_page16_slots = host_slots + (np.maximum(host_slots, 0) & -BLOCK_SIZE)
        num_prefills, n = num_reqs - num_decodes, num_tokens - num_decode_tokens
        derived = [host_page16_slots, host_slots]
        if num_prefills:
            qlens = np.diff(np.asarray(qsl[num_decodes:], dtype=np.int64))
            cu = np.concatenate([[0], np.cumsum(qlens)])
            ctx = np.asarray(computed[num_decodes:], dtype=np.int64)
            req = np.repeat(np.arange(num_prefills), qlens)  # reference.query_token_positions
            derived += [cu, ctx, req, ctx[req] + np.arange(n) - cu[req]]
        sizes = [len(x) for x in derived]
        dev = self._derived.view(sum(sizes))
        dev.copy_(torch.from_numpy(np.concatenate(derived).astype(np.int32)))
        views = torch.split(dev, sizes)
        page16_slots, slots = views[0], views[1]

        decode = prefill = None
        if num_decodes:
            decode = DecodeMetadata(bt[:num_decodes], seqs[:num_decodes], decode_query_len, page16[:num_decodes])
        if num_prefills:
            cu, ctx, query_req_id, query_abs_pos = views[2:]
            prefill = PrefillMetadata(bt[num_decodes:], cu, seqs[num_decodes:], ctx, query_req_id, query_abs_pos,
                                      page16[num_decodes:])
        if self.kernels is not None and self.kernels.target in InsertKvGpuSpec.targets:
            token_index, insert_slots = self._token_index.view(num_tokens), slots  # the GPU writer skips < 0
        else:
            keep = (slots >= 0).nonzero().reshape(-1)  # the portable writer takes written tokens only
            token_index, insert_slots = keep.int(), slots[keep]
        step = [t for t in (bt, seqs, slots, token_index, insert_slots) if t is not None]
        if prefill is not None:
            step += [prefill.cu_seqlens_q, prefill.context_lens, prefill.query_req_id, prefill.query_abs_pos]
        step_key = (num_tokens, num_decodes, decode_query_len, *((s.data_ptr(), tuple(s.shape)) for s in step))
        return MsaMetadata(num_tokens, num_decodes, num_decode_tokens, num_reqs - num_decodes,
                           num_tokens - num_decode_tokens, decode, prefill, slots, page16_slots, token_index,
                           insert_slots, max_block, max_slot, step_key)
