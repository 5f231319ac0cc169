"""Tuned config tables, read at plan time: format, load, lookup by shape bucket.

One JSON file per GPU model (``NVIDIA_H200.json``) maps a problem class (dtypes, head dim, group
size, Hkv, page size, query mode, mask kind) and a (batch_size, kv_len) bucket (powers of two) to
the winning ``KernelConfig`` and what it measured against the heuristic (``table_format`` holds
the file format). The tuner writes them (``tuner/table_writer.py``); this module only reads.

Search order for a plan on a device: an explicit path (``config_dir`` argument, else
``set_config_path``, else ``$TSDECODE_CONFIG_DIR``), then the user cache folder (where
``tsdecode-tune`` writes), then the tables shipped in the package. A table matches a device by
name, or else by compute capability and SM count (with a warning). The first matching table
holding the shape's class and exact bucket wins; when no table holds that (class, bucket), the
first holding it for the float16/bfloat16 twin class wins (same kernel and configs). A missing,
corrupt or stale table logs one warning, with the tuner command that fits the device and the
file's folder (``tune_advice``), and never fails a plan.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import re
import shlex
import stat
import threading
import time
import tokenize
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping

import platformdirs

from ..device import DeviceProperties, device_properties
from .space import SPACE, KernelConfig, ProblemShape, next_power_of_2
from .table_format import TableEntry, check_tuned_batch_size, validate_table_data

CONFIG_DIR_ENV = "TSDECODE_CONFIG_DIR"
SQ_BUCKETS = (1, 2, 4, 8, 16)  # fixed SQ rounded up to one of these ("16+" above), or "packed"
KERNEL_SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "decode.py"

logger = logging.getLogger(__name__)


# --- keys ----------------------------------------------------------------------------------------

def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def query_mode(shape: ProblemShape) -> str:
    """The SQ bucket of a shape: "1", "2", "4", "8", "16+" or "packed"."""
    if shape.packed:
        return "packed"
    sq = next_power_of_2(shape.max_seq_len_q)
    return f"{SQ_BUCKETS[-1]}+" if sq >= SQ_BUCKETS[-1] else str(sq)


def problem_class_key(shape: ProblemShape) -> str:
    """E.g. ``"q=bfloat16,kv=bfloat16,o=bfloat16,d=128,g=4,hkv=8,p=16,sq=1,mask=dense"``."""
    return (f"q={dtype_name(shape.q_dtype)},kv={dtype_name(shape.kv_dtype)},o={dtype_name(shape.o_dtype)},"
            f"d={shape.head_dim},g={shape.group_size},hkv={shape.num_kv_heads},p={shape.page_size},"
            f"sq={query_mode(shape)},mask={shape.mask_kind}")


def twin_class_key(key: str) -> str | None:
    """The class key with float16 and bfloat16 swapped (None: no 16-bit dtype in it)."""
    swap = {"float16": "bfloat16", "bfloat16": "float16"}
    fields = [f.partition("=") for f in key.split(",")]
    if not any(name in ("q", "kv", "o") and value in swap for name, _, value in fields):
        return None
    return ",".join(f"{n}={swap.get(v, v) if n in ('q', 'kv', 'o') else v}" for n, _, v in fields)


def bucket_of(batch_size: int, kv_len: int) -> tuple[int, int]:
    """(batch_size, kv_len) rounded up to powers of two."""
    return next_power_of_2(batch_size), next_power_of_2(kv_len)


def table_filename(device_name: str) -> str:
    """``"NVIDIA H200"`` -> ``"NVIDIA_H200.json"``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name.strip()).strip("_") + ".json"


# --- tables --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Table:
    """A parsed table: entries[class key][(batch_size, kv_len)], only those valid in today's
    config space (skipped_entries[class key][bucket] says why each other one was dropped);
    ``stale`` lists provenance mismatches."""

    path: str
    device: DeviceProperties
    triton_version: str
    torch_version: str
    kernel_hash: str
    tuner_settings: Mapping[str, Any]
    created: str
    updated: str
    entries: Mapping[str, Mapping[tuple[int, int], TableEntry]]
    skipped_entries: Mapping[str, Mapping[tuple[int, int], str]]
    stale: tuple[str, ...] = ()

    @property
    def skipped(self) -> tuple[str, ...]:
        """One line per skipped entry: ``"<class key> bucket (b, n): <why>"``."""
        return tuple(f"{key} bucket {bucket}: {why}"
                     for key, reasons in self.skipped_entries.items() for bucket, why in reasons.items())


# --- provenance ----------------------------------------------------------------------------------

def code_without_comments(source: str) -> str:
    """Python source without comments, docstrings, blank lines and trailing spaces (so editing
    those, or a CRLF checkout, keeps tables current)."""
    skip = {tokenize.NL, tokenize.COMMENT}
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    spans = []
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            spans.append((tok.start, tok.end))
        elif tok.type == tokenize.STRING:
            prev = next((t for t in reversed(tokens[:i]) if t.type not in skip), None)
            nxt = next((t for t in tokens[i + 1:] if t.type not in skip), None)
            alone = prev is None or prev.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                                  tokenize.ENCODING)
            if alone and nxt is not None and nxt.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                spans.append((tok.start, tok.end))
    lines = source.splitlines()
    for (r0, c0), (r1, c1) in reversed(spans):
        lines[r0 - 1:r1] = [lines[r0 - 1][:c0] + lines[r1 - 1][c1:]]
    return "\n".join(line.rstrip() for line in lines if line.strip())


_hash: list[str] = []


def kernel_source_hash() -> str:
    """sha256 (16 hex) of the kernels' code (``kernels/decode.py`` without comments) and the
    config space: what a table's timings depend on. (Triton's own ``JITFunction.cache_key`` would
    also change with every comment and line moved, and with the triton version.)"""
    if not _hash:
        h = hashlib.sha256(code_without_comments(KERNEL_SOURCE.read_text(encoding="utf-8")).encode())
        h.update(b"\0" + repr(SPACE).encode())
        _hash.append(h.hexdigest()[:16])
    return _hash[0]


def _triton_version() -> str:
    import triton

    return triton.__version__


def parse_table(path: str, data: object) -> Table:
    """A validated Table from decoded JSON (TableFormatError if the format is violated)."""
    validate_table_data(data)
    entries: dict[str, dict[tuple[int, int], TableEntry]] = {}
    skipped: dict[str, dict[tuple[int, int], str]] = {}
    for key, records in data["entries"].items():
        for record in records:
            bucket = (record["batch_size"], record["kv_len"])
            try:
                entry = TableEntry.from_dict(record)
                check_tuned_batch_size(bucket, entry)
                entries.setdefault(key, {})[bucket] = entry
            except (ValueError, TypeError) as e:
                skipped.setdefault(key, {})[bucket] = str(e)
    stale = []
    if data["kernel_hash"] != kernel_source_hash():
        stale.append(f"kernel hash differs (table {data['kernel_hash']}, running {kernel_source_hash()})")
    if data["triton_version"].split(".")[0] != _triton_version().split(".")[0]:
        stale.append(f"tuned with triton {data['triton_version']}, running triton {_triton_version()}")
    return Table(path, DeviceProperties.from_dict(data["device"]), data["triton_version"],
                 data["torch_version"], data["kernel_hash"], data["tuner_settings"], data["created"],
                 data["updated"], entries, skipped, tuple(stale))


# --- loading -------------------------------------------------------------------------------------

_lock = threading.Lock()
_tables: dict[str, tuple[tuple, tuple[Table | None, str | None]]] = {}  # path -> (file key, _read's answer)
_listings: dict[str, tuple[tuple, list[str]]] = {}  # folder -> (folder key, its table file names)
_warned: set = set()
_config_path: str | None = None
_RACY_NS = 1_000_000_000


def _settled(st: os.stat_result) -> bool:
    """Changed over a second ago (ctime too: ``cp -p`` puts an old mtime on a fresh change), so no
    later change can keep its key under coarse timestamps: else it is not cached (git's "racy" rule)."""
    return time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) >= _RACY_NS


def warn_once(key: object, message: str | Callable[[], str]) -> None:
    """Log ``message`` (or what the callable returns, built only to be logged) once per key."""
    if not logger.isEnabledFor(logging.WARNING):
        return
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message() if callable(message) else message)


def clear_cache() -> None:
    """Forget parsed tables, folder listings, warnings given and the kernel hash (tests)."""
    with _lock:
        _tables.clear()
        _listings.clear()
        _warned.clear()
        _hash.clear()


def set_config_path(path: str | os.PathLike | None) -> None:
    """Search this table file or folder first (before $TSDECODE_CONFIG_DIR); None unsets."""
    global _config_path
    _config_path = None if path is None else os.fspath(path)


# What platformdirs reads to place the user cache folder (Linux, macOS, Windows): the folder is
# cached per value of these, since every plan asks for it.
_USER_DIR_ENV = ("XDG_CACHE_HOME", "HOME", "LOCALAPPDATA", "WIN_PD_OVERRIDE_LOCAL_APPDATA", "USERPROFILE")


def user_tables_dir() -> Path:
    """Where ``tsdecode-tune`` writes and plans look second (the user cache folder)."""
    return _user_tables_dir(tuple(os.environ.get(name) for name in _USER_DIR_ENV))


@functools.lru_cache(maxsize=8)
def _user_tables_dir(_env: tuple) -> Path:
    return Path(platformdirs.user_cache_dir("tsdecode")) / "tuned_configs"


@functools.cache
def shipped_config_dir() -> Path | None:
    """The tables shipped in the package (``tsdecode/tuned_configs/`` of an installed wheel), or
    the source tree's ``tuned_configs/`` when run from it (an editable install). Found once: the
    package does not move while it runs."""
    installed = Path(str(resources.files(__name__.split(".")[0]).joinpath("tuned_configs")))
    source_tree = Path(__file__).resolve().parent.parent.parent / "tuned_configs"
    return next((folder for folder in (installed, source_tree) if folder.is_dir()), None)


def tune_advice(device: DeviceProperties, path: str | os.PathLike | None = None) -> str:
    """The tuner command that (re)writes ``device``'s table where plans find it, for a warning about
    the table file ``path`` (None: no table): the preset that fits the device (``smoke`` under the
    interpreter) and, for a file outside the user cache folder, ``--out`` its folder, so the table
    is rewritten where it lies. The shipped tables are left alone: the user cache shadows them.
    The file written is named unless it is ``path``."""
    command = f"tsdecode-tune --preset {'llama3-8b' if device.is_gpu else 'smoke'}"
    folder = user_tables_dir()
    if path is not None and os.path.realpath(Path(path).parent) not in {
            os.path.realpath(f) for f in (folder, shipped_config_dir()) if f is not None}:
        folder = Path(path).parent
        command += f" --out {shlex.quote(str(folder))}"
    target = folder / table_filename(device.name)
    same = path is not None and os.path.realpath(path) == os.path.realpath(target)
    return f"`{command}`" + ("" if same else f" (writes {target})")


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((name for is_kind, name in kinds if is_kind(mode)), "a device file")


def _nonblocking(path: str, flags: int) -> int:
    # A FIFO swapped in after the stat would block open() and read(): without blocking it reads empty.
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0))


# How a table file starts (table_writer writes format_version first): a file cut short still does.
_TABLE_START = re.compile(rb'\s*\{\s*"format_version"\s*:')


def _not_a_table(raw: bytes) -> str | None:
    """Why ``raw``, which is no valid table, is not meant to be one either (None: it is: a JSON
    object with a format_version, or, not JSON, a file that starts as a table does, e.g. cut short)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return None if _TABLE_START.match(raw) else f"not JSON: {e}"
    return None if isinstance(data, dict) and "format_version" in data else "JSON without a format_version"


def _unusable(path: str, reason: str, device: DeviceProperties | None, replace: bool = True,
              table_like: bool = True) -> str:
    """Warn once that the file at ``path`` is unusable; ``replace``: re-tuning would replace it;
    ``table_like``: it is meant to be a table (else it is no business of tsdecode's, e.g. another
    tool's JSON file or a device given as the path: it is only said to be ignored)."""
    def message() -> str:
        dev = device or device_properties()
        if replace and os.path.basename(path) == table_filename(dev.name):
            return f"tuned config table {path} is unusable ({reason}); ignored. Re-tune with {tune_advice(dev, path)}"
        if table_like:
            return (f"tuned config table {path} is unusable ({reason}); ignored. Delete it; this device's table "
                    f"comes from {tune_advice(dev, path)}")
        return (f"{path} is not a tsdecode config table ({reason}); ignored. This device's table comes from "
                f"{tune_advice(dev)}")
    warn_once(("unusable", path, reason), message)
    return reason


def _read(path: str, device: DeviceProperties | None) -> tuple[Table | None, str | None]:
    """(table, None), or (None, why it is unusable: one warning), or (None, None): no such file."""
    try:
        st = os.stat(path)
    except OSError:
        return None, None
    key = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
    cached = _tables.get(path)
    if cached is not None and cached[0] == key:
        return cached[1]
    settled = _settled(st)
    table, problem, raw = None, None, b""
    try:
        if not stat.S_ISREG(st.st_mode):  # reading a FIFO or a device could block every plan
            problem = _unusable(path, f"not a regular file but {_file_kind(st.st_mode)}", device, replace=False,
                                table_like=False)
        else:
            with open(path, "rb", opener=_nonblocking) as f:
                raw = f.read()
            table = parse_table(path, json.loads(raw))
    except OSError as e:
        problem = f"cannot be read: {e}"
        warn_once(("unusable", path, problem), f"tuned config table {path} cannot be read ({e}); ignored")
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, format
        other = _not_a_table(raw)  # e.g. another tool's JSON file in the folder
        problem = _unusable(path, other or str(e), device, table_like=other is None)
    except Exception as e:  # noqa: BLE001 - a table must never break a plan
        other = _not_a_table(raw)
        problem = _unusable(path, other or repr(e), device, table_like=other is None)
    if settled:
        with _lock:
            _tables[path] = (key, (table, problem))
    return table, problem


def load_table(path: str | os.PathLike, device: DeviceProperties | None = None) -> Table | None:
    """The table at ``path`` (parsed once, re-read when the file changes), or None if it is
    missing or unusable. An unusable file (not a regular file, unreadable, not a valid table) logs
    one warning, its advice fitting ``device``, the device whose plan reads it (default: this
    process's default device). Whether a table is stale or has skipped entries is warned about
    by ``lookup``, for a table it uses."""
    return _read(os.fspath(path), device)[0]


# --- lookup --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TableHit:
    """The entry a plan takes: its config (not yet fitted), file, bucket, and notes."""

    kernel_config: KernelConfig
    table_path: str
    bucket: tuple[int, int]
    entry: TableEntry
    notes: tuple[str, ...] = ()


def _sources(config_dir) -> list[tuple[str, str, bool]]:
    """(origin, path, explicit) in search order."""
    out = []
    if config_dir is not None:
        out.append(("config_dir argument", os.fspath(config_dir), True))
    elif _config_path is not None:
        out.append(("set_config_path", _config_path, True))
    elif os.environ.get(CONFIG_DIR_ENV):
        out.append((f"${CONFIG_DIR_ENV}", os.environ[CONFIG_DIR_ENV], True))
    out.append(("user cache", str(user_tables_dir()), False))
    shipped = shipped_config_dir()
    return out + ([("shipped", str(shipped), False)] if shipped is not None else [])


def _table_names(folder: str, st: os.stat_result) -> list[str]:
    """The ``*.json`` names in ``folder`` (not hidden), sorted; listed again only when the folder
    changes (a file added, removed or renamed changes its times), once ``_settled``."""
    key = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
    cached = _listings.get(folder)
    if cached is not None and cached[0] == key:
        return cached[1]
    names = sorted(n for n in os.listdir(folder) if n.endswith(".json") and not n.startswith("."))
    if _settled(st):
        with _lock:
            _listings[folder] = (key, names)
    return names


def _tables_for(origin: str, source: str, explicit: bool, device: DeviceProperties, trace: list | None):
    """(table, notes) of one source that match the device: exact name first, then same compute
    capability and SM count. An unusable file yields (None, ()): it has warned already."""
    try:
        st = os.stat(source)
    except OSError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        try:
            names = _table_names(source, st)
        except OSError as e:  # e.g. a folder without read permission: skip it, never fail a plan
            warn_once(("unreadable folder", source), f"tsdecode: cannot list tuned-config folder "
                      f"{source} ({origin}): {e}; skipping it")
            if trace is not None:
                trace.append(f"    {source}: cannot be listed ({e})")
            return
        files = [os.path.join(source, n) for n in names]
        own = os.path.join(source, table_filename(device.name))
        files.sort(key=lambda f: f != own)
    elif st is not None:
        files = [source]
    else:
        if explicit:
            warn_once(("no path", source), lambda: f"tuned config path {source} (from {origin}) does not exist; "
                                                   f"no table read from it")
        if trace is not None:
            trace.append(f"    {source}: does not exist")
        return
    variants = []
    for path in files:
        table, problem = _read(path, device)
        if table is None:
            if trace is not None:
                trace.append(f"    {path}: unusable ({problem})" if problem else f"    {path}: does not exist")
            if problem:
                yield None, ()
        elif table.device.name == device.name:
            yield table, ()
        elif (table.device.compute_capability, table.device.sm_count) == (device.compute_capability,
                                                                          device.sm_count):
            variants.append(table)
        elif trace is not None:
            trace.append(f"    {path}: for {table.device.describe()}, not this device")
    for table in variants:
        yield table, (f"table for '{table.device.name}' used for '{device.name}' (same compute "
                      f"capability and SM count)",)


def _warn_about(table: Table, notes: tuple[str, ...], device: DeviceProperties, used: bool) -> None:
    """One warning per table the search reaches, naming all its causes: used for a device variant,
    stale, entries skipped; a variant's (another GPU's) only once an entry of it is ``used``."""
    if notes and not used:
        return
    causes = notes + table.stale
    if table.skipped:
        n = len(table.skipped)
        causes += (f"{n} {'entry is' if n == 1 else 'entries are'} not valid today and ignored "
                   f"(first: {table.skipped[0]})",)
    if not causes:
        return
    def message() -> str:
        advice = f". Re-tune with {tune_advice(device, table.path)}" if table.stale or table.skipped else ""
        return f"tuned config table {table.path}: {'; '.join(causes)}{advice}"
    warn_once(("table", table.path, causes), message)


def lookup(shape: ProblemShape, device: DeviceProperties, *, config_dir: str | os.PathLike | None = None,
           trace: list[str] | None = None) -> TableHit | None:
    """The tuned entry for ``shape`` on ``device``: the first matching table holding the shape's
    class (or its float16/bfloat16 twin) and exact bucket; None means the heuristic. ``trace``
    collects what was searched, for ``explain``."""
    key, bucket = problem_class_key(shape), bucket_of(shape.batch_size, shape.max_kv_len)
    twin = twin_class_key(key)
    found_any = False
    matched = []
    for origin, source, explicit in _sources(config_dir):
        if trace is not None:
            trace.append(f"  {origin}: {source}")
        for table, notes in _tables_for(origin, source, explicit, device, trace):
            found_any = True
            if table is None:
                continue
            entry = table.entries.get(key, {}).get(bucket)
            _warn_about(table, notes, device, used=entry is not None)
            if entry is not None:
                if trace is not None:
                    trace.append(f"    {table.path}: {key} bucket {bucket} -> hit")
                return TableHit(entry.kernel_config, table.path, bucket, entry, notes + table.stale)
            if trace is not None:
                skipped = table.skipped_entries.get(key, {}).get(bucket)
                trace.append(f"    {table.path}: " + (f"entry skipped: {skipped}" if skipped else
                                                      "no entry for this class and bucket"))
            matched.append((table, notes))
    # No table holds the class itself: the first holding its float16/bfloat16 twin.
    for table, notes in matched if twin else ():
        entry = table.entries.get(twin, {}).get(bucket)
        if entry is not None:
            _warn_about(table, notes, device, used=True)
            if trace is not None:
                trace.append(f"    {table.path}: {twin} bucket {bucket} -> hit (the 16-bit twin class)")
            extra = (f"entries of class {twin} (float16 and bfloat16 share kernel and configs)",)
            return TableHit(entry.kernel_config, table.path, bucket, entry, extra + notes + table.stale)
    if not found_any:  # an unusable file found has warned already
        warn_once(("missing", device.name), lambda: f"no tuned config table for {device.describe()}; using "
                                                    f"the heuristic. Tune with {tune_advice(device)}")
    return None
