"""Config selection for a plan: an explicit config, else the tuned table's entry, else the model."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ..device import DeviceProperties
from . import tables
from .heuristic import heuristic_config
from .partials import partials_bound
from .residency import resident_programs_per_sm
from .space import MAX_NUM_KV_SPLITS, RAGGED_SPREAD, KernelConfig, ProblemShape, fit_config


@dataclass(frozen=True)
class SelectedConfig:
    """The config a plan uses and where it came from.

    source: "explicit" (``plan(config=...)``), "table" (a tuned entry) or "heuristic".
    table_path / bucket: the table file and (batch_size, kv_len) bucket of a table entry.
    adjustments: what was changed to fit this shape (splits scaled to the batch size or to
    ragged lengths, ``fit_config``'s clamps) and notes on the table used.
    """

    kernel_config: KernelConfig
    source: str
    table_path: str | None = None
    bucket: tuple[int, int] | None = None
    adjustments: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = self.source
        if self.table_path:
            where += f" {self.table_path} bucket(batch_size, kv_len)={self.bucket}"
        extra = f"; adjusted: {'; '.join(self.adjustments)}" if self.adjustments else ""
        return f"{self.kernel_config} from {where}{extra}"


def select_config(shape: ProblemShape, device: DeviceProperties, explicit: KernelConfig | None = None,
                  *, config_dir: str | os.PathLike | None = None,
                  trace: list[str] | None = None) -> SelectedConfig:
    """Explicit config, else the tuned table entry for this GPU and shape, else the heuristic.

    A table entry's splits are scaled to the batch size it was timed at and to ragged lengths;
    the heuristic's to ragged lengths; every config is then fitted to the shape.
    """
    if explicit is not None:
        if not isinstance(explicit, KernelConfig):
            raise TypeError(f"config must be a tsdecode.KernelConfig, got {type(explicit).__name__}")
        fitted, changes = fit_config(explicit, shape)
        return SelectedConfig(fitted, "explicit", adjustments=changes)
    hit = tables.lookup(shape, device, config_dir=config_dir, trace=trace)
    if hit is not None:
        config, scaled = scale_splits_to_batch(hit.kernel_config,
                                               hit.entry.tuned_batch_size or hit.bucket[0], shape.batch_size)
        config, ragged = scale_splits_to_raggedness(config, shape, device)
        fitted, changes = fit_config(config, shape)
        return SelectedConfig(fitted, "table", hit.table_path, hit.bucket, hit.notes + scaled + ragged + changes)
    config, ragged = scale_splits_to_raggedness(heuristic_config(shape, device), shape, device)
    fitted, changes = fit_config(config, shape)
    return SelectedConfig(fitted, "heuristic", adjustments=ragged + changes)


def scale_splits_to_batch(config: KernelConfig, tuned_batch_size: int,
                          batch_size: int) -> tuple[KernelConfig, tuple[str, ...]]:
    """Keep the program count of a config tuned at another batch size of its bucket."""
    if tuned_batch_size == batch_size:
        return config, ()
    splits = max(1, min(MAX_NUM_KV_SPLITS, round(config.num_kv_splits * tuned_batch_size / batch_size)))
    if splits == config.num_kv_splits:
        return config, ()
    note = (f"num_kv_splits {config.num_kv_splits} -> {splits}: entry tuned at batch size "
            f"{tuned_batch_size}, scaled to keep its program count at batch size {batch_size}")
    return dataclasses.replace(config, num_kv_splits=splits), (note,)


def scale_splits_to_raggedness(config: KernelConfig, shape: ProblemShape,
                               device: DeviceProperties) -> tuple[KernelConfig, tuple[str, ...]]:
    """More splits for ragged fixed lengths (longest / mean = shape.kv_len_spread >= 1.1): in one
    wave the kernel lasts as long as the longest request's split while the bytes are the mean's,
    so splits grow by the spread (at most 4x) while the programs stay within one wave, where that
    shortens the longest request's split (a request's tiles are split ceil(tiles / S) at a time:
    past that, more splits only add programs and partials) and stays within ``partials_bound``."""
    factor = min(shape.kv_len_spread, 4.0)
    if factor < RAGGED_SPREAD:
        return config, ()
    base = shape.batch_size * shape.num_kv_heads * -(-shape.rows_per_kv_head // config.block_m)
    wave = resident_programs_per_sm(config, shape, device, one_split=False) * device.sm_count
    splits = min(MAX_NUM_KV_SPLITS, round(config.num_kv_splits * factor))
    tiles = shape.max_visible_tiles(config.block_n)
    if base * config.num_kv_splits * factor > wave or -(-tiles // splits) >= -(-tiles // config.num_kv_splits):
        return config, ()
    if splits > partials_bound(shape, splits):  # the added partials cost more than the tail saves
        return config, ()
    note = (f"num_kv_splits {config.num_kv_splits} -> {splits}: ragged lengths (longest / mean "
            f"= {shape.kv_len_spread:.2f}) in one wave of {wave} programs")
    return dataclasses.replace(config, num_kv_splits=splits), (note,)
