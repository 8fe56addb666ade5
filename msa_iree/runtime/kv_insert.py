"""The KV insert: new tokens' K/V written into a layer's SHUFFLE page-16 views in place.

`insert_kv` checks everything on every call; `SparseAttention.insert_kv` binds a layer's later
calls to the launch (`_InsertLaunch`).
"""
from __future__ import annotations

import torch

from .. import checks
from ..config import MsaConfig, dtype_name
from ..layout import BLOCK_SIZE, PAGES_PER_BLOCK, block_page_stride, sides_are_packed
from ..ops import InsertKvGpuSpec, InsertKvSpec
from ..ops.fp8 import storage_dtype
from .binding import _contiguous_copies, _LayerBinding
from .library import KernelLibrary, _current_raw_stream, module_scale
from .metadata import MsaMetadata


def insert_kv(kernels: KernelLibrary, key, value, k_cache, v_cache, metadata_or_slots, k_scale=None, v_scale=None, *,
              kv_cache_dtype=None):
    """Write key/value [N, H, 128] into the SHUFFLE views in place through the compiled writer.

    metadata_or_slots: an MsaMetadata (its per-step compacted slots) or a [N] logical slot mapping.
    The views must be the layout's own: one buffer (interleaved) or two planes back to back.
    (SparseAttention.insert_kv: the same for one layer, its later calls bound to the launch.)
    """
    plan = _insert_plan(kernels, key, value, k_cache, v_cache, metadata_or_slots, k_scale, v_scale, kv_cache_dtype)
    if plan is not None:
        _run_insert(kernels, *plan[:2])


def _insert_plan(kernels, key, value, k_cache, v_cache, metadata_or_slots, k_scale, v_scale, kv_cache_dtype):
    """Every check of an insert; (spec, operands [cache buffer, key, value, token index, slots,
    k scale, v scale], capacity) to write, or None when there is nothing to write."""
    h = k_cache.shape[1]
    checks.check_kv_cache(k_cache, v_cache, h, kv_cache_dtype)
    checks.check_new_kv(key, value, h, (torch.bfloat16, torch.float16))
    stride = block_page_stride(k_cache, v_cache)
    capacity = k_cache.shape[0] // stride * BLOCK_SIZE
    checks.check_scale("k_scale", k_scale, k_cache.dtype, h, capacity)
    checks.check_scale("v_scale", v_scale, k_cache.dtype, h, capacity)
    gpu_writer = kernels.target in InsertKvGpuSpec.targets
    if isinstance(metadata_or_slots, MsaMetadata):
        md = metadata_or_slots
        if key.shape[0] < md.num_actual_tokens:
            raise ValueError(f"key: expected at least num_actual_tokens={md.num_actual_tokens} rows (the step's "
                             f"tokens), got {key.shape[0]}")
        md.check_cache_slots(capacity)  # the builder found the step's largest slot: no sync here
        token_index, slots = md.insert_token_index, md.insert_slots
        if not gpu_writer:  # the portable writer: written tokens only
            token_index, slots = drop_padding(token_index, slots)
    else:
        checks.check_shape("slot_mapping", metadata_or_slots, (key.shape[0],))
        token_index, slots = _written_tokens(metadata_or_slots)
        checks.check_ids_in_range("slot_mapping", slots, capacity)
    if slots.numel() == 0:
        return None
    cfg = MsaConfig(num_kv_heads=h, kv_dtype=dtype_name(k_cache.dtype), query_dtype=dtype_name(key.dtype))
    # no scale (16-bit caches): ones on the cache's device (a stream launch reads device memory)
    ks, vs = (kernels.unit_scale(h, k_cache.device) if s is None else module_scale(s, h) for s in (k_scale, v_scale))
    raw = _whole_buffer(k_cache, v_cache).view(storage_dtype(k_cache.dtype))
    spec_cls = InsertKvGpuSpec if gpu_writer else InsertKvSpec
    return spec_cls(cfg, stride), [raw, key, value, token_index, slots, ks, vs], capacity


def drop_padding(token_index, slots):
    """(token_index, slots) [M] without the rows whose slot is padding (< 0), for a portable
    writer (a masked scatter is beyond IREE's GPU codegen): a host sync, and the tensors
    themselves where nothing is padding."""
    if slots.numel() and bool((slots < 0).any()):
        keep = (slots >= 0).nonzero().reshape(-1)
        return token_index[keep], slots[keep]
    return token_index, slots


def _written_tokens(slot_mapping):
    """(token index, slot) int32 of the tokens whose slot is not padding (< 0): a host sync."""
    keep = (slot_mapping >= 0).nonzero().reshape(-1)
    return keep.int(), slot_mapping[keep].int()


def _run_insert(kernels, spec, operands):
    if isinstance(spec, InsertKvGpuSpec):  # in place: the module writes into the cache's own memory
        kernels.run(spec, *operands, out_dtypes=())
        return
    raw = operands[0]
    (updated,) = kernels.run(spec, *operands, out_dtypes=[raw.dtype])
    raw.copy_(updated)  # host CPU: the portable module returns the updated buffer


class _InsertLaunch(_LayerBinding):
    """A layer's KV insert bound to its stream launch: made after a fully checked insert of a
    step's metadata, it serves later calls with the same caches and scales and metadata of the
    same step key (the builder keeps a step shape's token index and slots at one address from
    step to step, so a new step of the same shape is served too), checking only the step's largest
    slot against the cache (an int) and key and value (shape, dtype, device, contiguous) before it
    queues the writer; any other call takes the checked path."""

    @classmethod
    def bind(cls, kernels, spec, metadata, layer_tensors, operands, capacity):
        """None unless the insert is a stream launch of builder-checked slots from contiguous key/value."""
        sk = kernels.stream_kernel(spec) if kernels.stream_launch else None
        key, value, token_index, slots = operands[1:5]
        if (sk is None or not isinstance(metadata, MsaMetadata)
                or not all(t.is_contiguous() for t in (key, value, token_index, slots))):
            return None
        self = cls()
        self.capacity = capacity
        self.key_shape, self.key_dtype, self.device_index = key.shape, key.dtype, key.get_device()
        # a strided scale (one scale over 2+ KV heads) through a contiguous copy refreshed per call
        tensors, refresh = _contiguous_copies(operands)
        self._hold(metadata.step_key, layer_tensors, refresh)
        self.launch = sk.bind(list(tensors), variable=(1, 2))
        return self

    def __call__(self, metadata, key, value, k_cache, v_cache, k_scale, v_scale) -> bool:
        """Queue the insert if this call is one the binding serves (True); else False, nothing done."""
        if (type(metadata) is not MsaMetadata or not self._serves(metadata, k_cache, v_cache, k_scale, v_scale)
                or metadata.max_slot >= self.capacity):
            return False
        shape, dtype, index = self.key_shape, self.key_dtype, self.device_index
        if not (key.shape == shape and value.shape == shape and key.dtype == dtype and value.dtype == dtype
                and key.get_device() == index and value.get_device() == index
                and key.is_contiguous() and value.is_contiguous()):
            return False
        if self.refresh:
            self._refresh()
        self.launch(_current_raw_stream(index), key.data_ptr(), value.data_ptr())
        return True


def _whole_buffer(k_cache, v_cache):
    """The single buffer both views live in, as [pages, H*16*128] (K at row P, V after it)."""
    row = k_cache[0].numel()
    esize = k_cache.element_size()
    if sides_are_packed(k_cache, v_cache):
        ok = v_cache.data_ptr() == k_cache.data_ptr() + PAGES_PER_BLOCK * row * esize
        pages = k_cache.shape[0]
    else:
        ok = v_cache.data_ptr() == k_cache.data_ptr() + k_cache.shape[0] * row * esize
        pages = 2 * k_cache.shape[0]
    if not (ok and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache, v_cache: expected the views of one SHUFFLE buffer (layout.allocate_kv_cache: "
                         "V 8 pages after K when interleaved, the V plane right after the K plane), got unrelated tensors")
    return torch.as_strided(k_cache, (pages, row), (row, 1))
