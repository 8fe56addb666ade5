"""msa-iree: MiniMax-M3 block-sparse attention (MSA) as IREE-compiled kernels."""
import pathlib

__version__ = "0.1.0"
# the hand-written MLIR templates (rendered by kernels.py, part of compile.py's source digest)
KERNELS_MLIR = pathlib.Path(__file__).resolve().parent.parent / "kernels_mlir"
__all__ = ["MsaConfig", "__version__"]


def __getattr__(name):  # torch is imported only when something needs it (fast no-op CLI runs)
    if name == "MsaConfig":
        from .config import MsaConfig

        return MsaConfig
    raise AttributeError(name)
