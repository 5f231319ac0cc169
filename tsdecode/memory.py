"""Where a tensor's elements lie in memory, and the checks that the kernels' outputs share none of
it with what they read: ``out`` with itself or any input, the split partials with any input."""

from __future__ import annotations

from typing import Sequence

import torch


def element_extent(t: torch.Tensor) -> int:
    """How many elements past its first a tensor's last element lies (0 when empty)."""
    numel = t.numel()
    if not numel:
        return 0
    if t.is_contiguous():  # dims of size 1, whatever their strides, add nothing
        return numel - 1
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, last byte] a tensor's elements occupy; None for an empty tensor."""
    if t.numel() == 0:
        return None
    start = t.data_ptr()
    return start, start + (element_extent(t) + 1) * t.element_size() - 1


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (a stride-0 or interleaved view); from shape
    and strides only (exotic non-overlapping interleavings also count as overlap)."""
    if t.numel() == 0 or t.is_contiguous():
        return False
    reach = 0
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def byte_spans(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[int, int]]]:
    """(name, ``byte_span``) of each non-empty tensor: what ``validate_out`` and
    ``validate_workspace_apart`` compare against."""
    spans = []
    for name, t in tensors:
        span = byte_span(t)
        if span is not None:
            spans.append((name, span))
    return spans


def validate_out(out: torch.Tensor, spans: Sequence[tuple[str, tuple[int, int]]]) -> None:
    """out shares no memory with itself (elements) or with any input (``byte_spans``)."""
    if overlaps_itself(out):
        raise ValueError(f"out must not overlap itself (a stride-0 or interleaved view would have "
                         f"requests or heads overwrite each other), got shape {list(out.shape)} strides {out.stride()}")
    span = byte_span(out)
    if span is None:
        return
    lo, hi = span
    for name, (first, last) in spans:
        if lo <= last and first <= hi:
            raise ValueError(f"out must not alias {name} (their memory overlaps)")


def validate_workspace_apart(partials: tuple[int, int] | None, spans: Sequence[tuple[str, tuple[int, int]]]) -> None:
    """The split partials (the ``byte_span`` of the bytes of the plan's workspace_buffer the run
    writes; None when it writes none) share no byte with a tensor the kernels read (``byte_spans``)."""
    if partials is None:
        return
    lo, hi = partials
    for name, (first, last) in spans:
        if lo <= last and first <= hi:
            raise ValueError(f"workspace_buffer must not overlap {name}: the split partials the run writes "
                             f"there would overwrite it")
