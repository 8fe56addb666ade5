"""msa-iree: MiniMax-M3 block-sparse attention (MSA) as IREE-compiled kernels."""

__version__ = "0.1.0"
__all__ = ["MsaConfig", "__version__"]


def __getattr__(name):  # torch is imported only when something needs it (fast no-op CLI runs)
    if name == "MsaConfig":
        from .config import MsaConfig

        return MsaConfig
    raise AttributeError(name)
