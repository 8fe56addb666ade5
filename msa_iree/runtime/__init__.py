"""The runtime on torch tensors: compiled kernels (`KernelLibrary`), per-step metadata
(`MetadataBuilder`), a layer's attend and KV insert (`SparseAttention`, `insert_kv`), its
indexer (`Indexer`)."""
from .attention import SparseAttention
from .indexer import Indexer
from .kv_insert import insert_kv
from .library import BuildMismatchError, KernelLibrary
from .metadata import DecodeMetadata, MetadataBuilder, MsaMetadata, PrefillMetadata

__all__ = ["BuildMismatchError", "DecodeMetadata", "Indexer", "KernelLibrary", "MetadataBuilder", "MsaMetadata",
           "PrefillMetadata", "SparseAttention", "insert_kv"]
