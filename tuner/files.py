"""Writing files so that a killed process never leaves a partial one (stdlib only: the report
uses it without the ``tune`` extra)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path


def _aside(path: Path, tag: str) -> Path:
    """``<name>.<tag>-<UTC time>`` beside ``path``, numbered if taken."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = path.with_name(f"{path.name}.{tag}-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{tag}-{stamp}-{n}")
    return target


def move_aside(path: Path, tag: str) -> Path:
    """Rename ``path`` to ``<name>.<tag>-<UTC time>`` (numbered if taken); returns the new path."""
    target = _aside(path, tag)
    os.replace(path, target)
    return target


def copy_aside(path: Path, tag: str) -> Path:
    """Copy ``path`` to ``<name>.<tag>-<UTC time>`` (numbered if taken), atomically; returns it."""
    target = _aside(path, tag)
    atomic_write_text(target, path.read_text(encoding="utf-8"))
    return target


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temp file in the same folder, fsync, then os.replace: readers see the old file
    or the new one, never a partial one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a table should be readable like any file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
