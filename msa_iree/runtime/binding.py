"""A layer's bound launches (the attend's and the insert's): what they share.

A binding is made by a fully checked call and serves the layer's later calls with the same layer
tensors (caches, scales), checking only what a call brings of its own before it launches.
"""
from __future__ import annotations


class _LayerBinding:
    """What a layer's bound launches share (_DecodeLaunch, _InsertLaunch): the layer tensors a
    binding was made for, served only while the same objects at the same addresses come back (one
    changed by set_ or resize_ keeps its identity and is not seen; the binding keeps them alive
    until the next one), and the contiguous copies of strided operands refreshed before a launch."""

    def _hold(self, layer_tensors, refresh):
        """layer_tensors: (k_cache, v_cache, k_scale, v_scale); refresh: (copy, strided) pairs."""
        self.layer_tensors, self.refresh = layer_tensors, refresh
        self.cache_addresses = tuple(t.data_ptr() for t in layer_tensors[:2])

    def _same_layer(self, k_cache, v_cache, k_scale, v_scale) -> bool:
        k, v, ks, vs = self.layer_tensors
        return (k_cache is k and v_cache is v and k_scale is ks and v_scale is vs
                and (k_cache.data_ptr(), v_cache.data_ptr()) == self.cache_addresses)

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
