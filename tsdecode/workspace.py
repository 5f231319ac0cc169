"""The workspace: where a plan keeps its split partials (FlashInfer's ``workspace_buffer``).

Layout: the partial outputs [B*SQ, Hq, S, D] then their log2-sum-exps [B*SQ, Hq, S], float32,
each section starting at a multiple of WORKSPACE_SECTION_ALIGNMENT bytes; a plan with one split
needs none.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from . import memory as M
from . import validation as V
from .config.select import SelectedConfig
from .config.space import ProblemShape, fit_config
from .kernels.launch import partials_shape

WORKSPACE_SECTION_ALIGNMENT = 256  # bytes; each section of the workspace starts at a multiple
WORKSPACE_BASE_ALIGNMENT = 32  # bytes; a caller's workspace_buffer must start at a multiple


def workspace_bytes(shape: ProblemShape, num_kv_splits: int) -> int:
    """Bytes of the split partials (0 with one split), each section 256-byte aligned."""
    if num_kv_splits == 1:
        return 0
    align = WORKSPACE_SECTION_ALIGNMENT
    o_shape, lse_shape = partials_shape(shape.batch_size * shape.max_seq_len_q, shape.num_qo_heads,
                                        num_kv_splits, shape.head_dim)
    return sum(-(-4 * _numel(s) // align) * align for s in (o_shape, lse_shape))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def partials_views(workspace: torch.Tensor, shape: ProblemShape,
                   num_kv_splits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The partials' float32 views into ``workspace`` (None with one split)."""
    if num_kv_splits == 1:
        return None
    o_shape, lse_shape = partials_shape(shape.batch_size * shape.max_seq_len_q, shape.num_qo_heads,
                                        num_kv_splits, shape.head_dim)
    align = WORKSPACE_SECTION_ALIGNMENT
    o_bytes = -(-4 * _numel(o_shape) // align) * align
    flat = workspace.view(torch.uint8).view(-1)  # any contiguous shape: its bytes in order
    partial_o = flat[:4 * _numel(o_shape)].view(torch.float32).view(o_shape)
    partial_lse = flat[o_bytes:o_bytes + 4 * _numel(lse_shape)].view(torch.float32).view(lse_shape)
    return partial_o, partial_lse


def workspace_memory(workspace: torch.Tensor, shape: ProblemShape,
                     num_kv_splits: int) -> tuple[int, list[tuple[str, tuple[int, int]]], tuple[int, int] | None]:
    """What a run checks against a plan's workspace, fixed when it is planned (the partials' views
    are): its storage's address (``_Plan.matches``), its ``byte_spans`` (out must not alias it) and
    the byte span of the split partials, None with one split (kept apart from the inputs)."""
    partials = workspace.view(torch.uint8).view(-1)[:workspace_bytes(shape, num_kv_splits)]
    return (workspace.untyped_storage().data_ptr(), M.byte_spans((("workspace_buffer", workspace),)),
            M.byte_span(partials))


def validate_workspace(workspace: object, device: torch.device, need: int) -> torch.Tensor:
    """A caller's ``workspace_buffer``: int8/uint8, on the plan's device, contiguous, aligned and
    at least ``need`` bytes."""
    workspace = V.require_tensor("workspace_buffer", workspace)
    if workspace.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"workspace_buffer must be int8 or uint8, got {workspace.dtype}")
    if workspace.device != device:
        raise ValueError(f"workspace_buffer must be on {device}, got {workspace.device}")
    if not workspace.is_contiguous():
        raise ValueError(f"workspace_buffer must be contiguous, got strides {workspace.stride()}")
    if workspace.numel() and workspace.data_ptr() % WORKSPACE_BASE_ALIGNMENT:
        raise ValueError(f"workspace_buffer must be {WORKSPACE_BASE_ALIGNMENT}-byte aligned, got address "
                         f"{workspace.data_ptr():#x}")
    if workspace.numel() < need:
        raise ValueError(f"workspace_buffer is too small: requires at least {need} bytes, got {workspace.numel()}")
    return workspace


def fit_to_workspace(shape: ProblemShape, selected: SelectedConfig, available: int) -> SelectedConfig:
    """The selected config with as many splits as a caller's workspace holds (at least one),
    fitted as every config a plan runs is (``fit_config``: no split that gets no tile)."""
    splits = selected.kernel_config.num_kv_splits
    while splits > 1 and workspace_bytes(shape, splits) > available:
        splits -= 1
    note = (f"num_kv_splits {selected.kernel_config.num_kv_splits} -> {splits}: what workspace_buffer "
            f"({available} bytes) holds")
    config, fitted = fit_config(dataclasses.replace(selected.kernel_config, num_kv_splits=splits), shape)
    return dataclasses.replace(selected, kernel_config=config, adjustments=selected.adjustments + (note, *fitted))
