"""tsdecode: paged-KV decode attention in Triton with FlashInfer's PrimTS API."""

from . import torch_ops  # noqa: F401  (registers torch.ops.tsdecode.*: the torch.compile path)
from .api import BatchDecodePagedTSWrapper, batch_decode_with_paged_kv_cache
from .configs import KernelConfig, SelectedConfig
from .tables import explain

__all__ = [
    "BatchDecodePagedTSWrapper",
    "KernelConfig",
    "SelectedConfig",
    "batch_decode_with_paged_kv_cache",
    "explain",
]
__version__ = "0.1.0"
