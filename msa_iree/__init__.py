"""msa-iree: MiniMax-M3 block-sparse attention (MSA) as IREE-compiled kernels."""
from .config import MsaConfig

__version__ = "0.1.0"
__all__ = ["MsaConfig", "__version__"]
