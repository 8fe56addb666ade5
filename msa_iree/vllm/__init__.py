"""msa-iree inside vLLM: MiniMax-M3's sparse attention served by msa-iree's compiled kernels.

An out-of-tree vLLM plugin (entry point group `vllm.general_plugins`, `msa_iree.vllm:register`;
install it with `pip install 'msa-iree[vllm]'`). vLLM's MiniMax-M3 model picks its sparse
attention backend itself, through `select_main_backend_and_impl_cls`, which its ROCm model module
imported by name; the plugin replaces it in both places. It is opt-in:

    MSA_IREE_VLLM=1                      serve MiniMax-M3's sparse layers with msa-iree
    MSA_IREE_VLLM_BUILD=build/gfx942     the kernels: `msa-iree compile --target gfx942
                                         --tensor-parallel-size 4 --kv-cache-dtype fp8
                                         [--num-speculative-tokens N] --out build/gfx942`

Without MSA_IREE_VLLM vLLM is left as it is. With it, configurations msa-iree builds (head size
128, 16 top-k blocks of 128 tokens, a bf16 or fp8 e4m3 KV cache) get msa-iree's backend,
metadata builder and impl (`msa_iree.vllm.backend`), the others vLLM's own choice. A vLLM other
than the one the classes were written against is refused. The K/V write of a served layer is
msa-iree's insert (vLLM's path calls AITER's `reshape_and_cache`, which needs AITER).

Importing msa_iree never imports vLLM; importing this module does not either (register does).
"""
from __future__ import annotations

import os

ENABLE = "MSA_IREE_VLLM"           # "1": serve MiniMax-M3's sparse attention with msa-iree
BUILD_DIR = "MSA_IREE_VLLM_BUILD"  # the build directory of the kernels it serves with
VLLM_VERSION = "0.33.0"            # the vLLM whose classes msa_iree.vllm.backend subclasses

_registered = False


def enabled() -> bool:
    return os.environ.get(ENABLE, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """The `vllm.general_plugins` entry point: with MSA_IREE_VLLM set, route MiniMax-M3's sparse
    attention selection through msa-iree (idempotent: vLLM loads plugins in every process)."""
    global _registered
    if _registered or not enabled():
        return
    from . import backend

    backend.check_vllm_version()
    backend.install()
    _registered = True
