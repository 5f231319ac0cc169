"""Writing tuned config tables (the runtime only reads them: ``tsdecode.config.tables``).

``merge_entries`` merges a tuner run's entries into a device's table file with these guarantees:

- readers never see a partial file: the new table goes to a temporary file in the same folder,
  is fsynced, then ``os.replace``-d over the old one;
- writers in several processes lose nothing: the read-merge-write runs under a ``filelock`` on
  ``<table>.lock`` (the lock file stays: deleting it would let two writers lock different files);
- a table of another device is refused with a ValueError naming both;
- a file the runtime would not use (corrupt, or tuned for another kernel source or triton major
  version) is moved aside to ``<name>.corrupt-<time>`` / ``<name>.stale-<time>``, with a warning;
- nothing is written that ``table_format.validate_table_data`` / ``tables.parse_table`` would reject.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

import filelock
import torch

from tsdecode.config import tables
from tsdecode.config.table_format import FORMAT_VERSION, TableEntry
from tsdecode.device import DeviceProperties

from .files import atomic_write_text, copy_aside, move_aside

logger = logging.getLogger(__name__)

Entries = Mapping[str, Mapping[tuple[int, int], TableEntry]]


def table_path(device: DeviceProperties, folder: str | os.PathLike | None = None) -> Path:
    """Where a device's table goes: ``folder`` (default: the user cache folder, which plans search
    after $TSDECODE_CONFIG_DIR) / ``tables.table_filename(device.name)``."""
    return Path(folder if folder is not None else tables.user_tables_dir()) / tables.table_filename(device.name)


# What reading a table can raise. ValueError: JSON, UTF-8, the format; ArithmeticError: a number
# no float can hold.
UNREADABLE = (OSError, ValueError, RecursionError, ArithmeticError)


def _parsed(path: Path) -> tables.Table:
    """The table at ``path`` as the runtime parses it, without the runtime's warnings."""
    if not path.is_file():  # a FIFO would hang the read
        raise OSError(f"{path} is not a regular file")
    return tables.parse_table(str(path), json.loads(path.read_bytes()))


def readable_table(path: Path) -> tables.Table | None:
    """The table at ``path``, or None where there is none the runtime could use; quiet (the merge
    that writes the table says what happens to an unusable file, once)."""
    if not path.is_file():
        return None
    try:
        return _parsed(path)
    except UNREADABLE:
        return None


def check_target(path: Path, device: DeviceProperties) -> None:
    """ValueError, before any tuning, when ``path`` holds another device's table: the merge at the
    end would refuse it. A file the runtime cannot use is no obstacle (it is moved aside then)."""
    table = readable_table(path)
    if table is not None and table.device.name != device.name:
        raise ValueError(f"{path} holds the table of '{table.device.name}', not of '{device.name}': the "
                         f"tuned entries could not be merged into it; move it away or pass another --out")


def _existing(path: Path, device: DeviceProperties) -> tuple[dict, str | None]:
    """(entries, created) of the table at ``path`` to merge into; a file the runtime would not
    use is moved aside and written afresh."""
    if not path.exists():
        return {}, None
    try:
        table = _parsed(path)
    except UNREADABLE as e:
        moved = move_aside(path, "corrupt")
        logger.warning(f"tuned config table {path} is unusable ({e}); moved aside to {moved} and written afresh")
        return {}, None
    if table.device.name != device.name:
        raise ValueError(f"{path} holds the table of '{table.device.name}', not of '{device.name}': "
                         f"refusing to merge (a device's table is {tables.table_filename(device.name)})")
    if table.stale:
        moved = move_aside(path, "stale")
        logger.warning(f"tuned config table {path}: {'; '.join(table.stale)}; its entries are not merged "
                       f"(moved aside to {moved})")
        return {}, None
    if table.skipped:  # entries of another config space (e.g. another tsdecode sharing the folder)
        kept = copy_aside(path, "skipped")
        logger.warning(f"tuned config table {path}: the entries this tsdecode skips ({len(table.skipped)}) are "
                       f"not merged ({table.skipped[0]}{'; ...' if len(table.skipped) > 1 else ''}); the table as it "
                       f"was is kept as {kept}")
    return {k: dict(v) for k, v in table.entries.items()}, table.created


# What ``provenance`` may set instead of this process's values: the versions and kernel the
# entries were measured with, when the table is written on another machine (``tsdecode-tune export``).
PROVENANCE_FIELDS = ("triton_version", "torch_version", "kernel_hash")


def table_data(device: DeviceProperties, entries: Entries, tuner_settings: Mapping[str, Any],
               created: str | None = None, provenance: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A table as JSON data, checked as the runtime will read it (ValueError naming the entry or
    field otherwise)."""
    import triton

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    records: dict[str, list] = {}
    for key in sorted(entries):
        for bucket, entry in sorted(entries[key].items()):
            if not isinstance(entry, TableEntry):
                raise TypeError(f"{key} {bucket}: expected a TableEntry, got {type(entry).__name__}")
            if not (isinstance(bucket, tuple) and len(bucket) == 2):
                raise ValueError(f"{key}: a bucket is (batch_size, kv_len) (see tables.bucket_of), got {bucket!r}")
            batch_size, kv_len = bucket
            records.setdefault(key, []).append({"batch_size": batch_size, "kv_len": kv_len, **entry.to_dict()})
    data = {
        "format_version": FORMAT_VERSION, "device": device.to_dict(), "triton_version": triton.__version__,
        "torch_version": torch.__version__, "kernel_hash": tables.kernel_source_hash(),
        "tuner_settings": dict(tuner_settings), "created": created or now, "updated": now, "entries": records,
    }
    for key, value in (provenance or {}).items():
        if key not in PROVENANCE_FIELDS:
            raise ValueError(f"provenance: {key!r} is not one of {PROVENANCE_FIELDS}")
        data[key] = value
    data = json.loads(json.dumps(data))  # what a reader gets back (tuples become lists)
    parsed = tables.parse_table("<new table>", data)  # TableFormatError names the field
    if parsed.skipped:
        raise ValueError(f"refusing to write an entry the runtime would skip: {parsed.skipped[0]}")
    return data


def merge_entries(path: str | os.PathLike, device: DeviceProperties, entries: Entries,
                  tuner_settings: Mapping[str, Any], provenance: Mapping[str, str] | None = None) -> None:
    """Merge tuned entries into the table at ``path`` (created with its folder if missing).

    Parameters
    ----------
    path : the table file, normally ``table_path(device)``.
    device : the device the entries were measured on (``tsdecode.device.device_properties``).
    entries : problem class key -> {``tables.bucket_of(batch_size, kv_len)``: TableEntry}; each
        replaces the existing entry of the same class and bucket, all others are kept.
    tuner_settings : JSON-serialisable settings of this run (the table's ``tuner_settings``,
        replacing the previous run's).
    provenance : ``triton_version``, ``torch_version`` and ``kernel_hash`` of the process that
        measured the entries, when another process writes them (default: this process's).
    """
    if not isinstance(device, DeviceProperties):
        raise TypeError(f"device must be a tsdecode.device.DeviceProperties, got {type(device).__name__}")
    table_data(device, entries, tuner_settings, provenance=provenance)  # refuse bad entries before touching the file
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(f"{path}.lock"):
        merged, created = _existing(path, device)
        for key, buckets in entries.items():
            merged.setdefault(key, {}).update(buckets)
        data = table_data(device, merged, tuner_settings, created, provenance)
        atomic_write_text(path, json.dumps(data, indent=1) + "\n")
