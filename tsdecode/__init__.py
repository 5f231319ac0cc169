"""tsdecode: paged-KV decode attention in Triton with FlashInfer's PrimTS API."""

from . import torch_ops  # noqa: F401  (registers torch.ops.tsdecode.*: the torch.compile path)
from .api import BatchDecodePagedTSWrapper, get_prims_ts_batch_decode_workspace_size
from .oneshot import batch_decode_with_paged_kv_cache, prims_ts_batch_decode_with_kv_cache
from .config import KernelConfig, SelectedConfig
from .explain import explain

__all__ = [
    "BatchDecodePagedTSWrapper",
    "KernelConfig",
    "SelectedConfig",
    "batch_decode_with_paged_kv_cache",
    "explain",
    "get_prims_ts_batch_decode_workspace_size",
    "prims_ts_batch_decode_with_kv_cache",
]
__version__ = "0.2.0"
