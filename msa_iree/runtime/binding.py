"""A layer's bound launches (the attend's and the insert's): what they share.

A binding is made by a fully checked call and serves the layer's later calls with the same layer
tensors (caches, scales), checking only what a call brings of its own before it launches.
"""
from __future__ import annotations


class _LayerBinding:
    """What a layer's bound launches share (_StepLaunch, _InsertLaunch): the step shape and
    the layer tensors a binding was made for, served only while a step of that key and the same
    tensor objects at the same addresses come back (the binding keeps them alive until the next
    one), and the contiguous copies of strided operands refreshed before a launch."""

    def _hold(self, step_key, layer_tensors, refresh):
        """step_key: the metadata's (MsaMetadata.step_key) whose step buffers the binding reads;
        layer_tensors: (k_cache, v_cache, k_scale, v_scale); refresh: (copy, strided) pairs."""
        self.step_key, self.layer_tensors, self.refresh = step_key, layer_tensors, refresh
        self.k_cache, self.v_cache, self.k_scale, self.v_scale = layer_tensors
        self.k_address, self.v_address = (t.data_ptr() for t in layer_tensors[:2])

    def _serves(self, metadata, k_cache, v_cache, k_scale, v_scale) -> bool:
        """The call's step and layer tensors are the ones bound (the key is usually the same object)."""
        key = metadata.step_key
        return ((key is self.step_key or key == self.step_key) and k_cache is self.k_cache and v_cache is self.v_cache
                and k_scale is self.k_scale and v_scale is self.v_scale and k_cache.data_ptr() == self.k_address
                and v_cache.data_ptr() == self.v_address)

    def _refresh(self):
        _refresh_copies(self.refresh)


def _contiguous_copies(tensors):
    """(the tensors, each strided one replaced by a contiguous copy; the (copy, strided) pairs to
    refresh before each launch, so that a strided operand changed in place is seen)."""
    copies = tuple(t.contiguous() for t in tensors)
    return copies, tuple((c, t) for c, t in zip(copies, tensors) if c is not t)


def _refresh_copies(refresh):
    """Copy each strided operand into its contiguous copy (_contiguous_copies' pairs)."""
    for copy, strided in refresh:
        copy.copy_(strided)
