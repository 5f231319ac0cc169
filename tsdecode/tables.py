"""Tuned config tables (placeholder interface; the table issue implements lookup)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .configs import KernelConfig, ProblemShape


@dataclass(frozen=True)
class TableHit:
    kernel_config: KernelConfig
    table_path: str
    bucket: tuple[int, int]
    notes: tuple[str, ...] = ()


def lookup(shape: ProblemShape, device: torch.device) -> TableHit | None:
    return None
