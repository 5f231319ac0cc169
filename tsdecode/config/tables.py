"""Tuned config tables, read at plan time: format, load, lookup by shape bucket.

One JSON file per GPU model (``NVIDIA_H200.json``) maps a problem class (dtypes, head dim, group
size, Hkv, page size, query mode, mask kind) and a (batch_size, kv_len) bucket (powers of two) to
the winning ``KernelConfig`` and what it measured against the heuristic. The tuner writes them
(``tuner/table_writer.py``); this module only reads.

Search order for a plan on a device: an explicit path (``config_dir`` argument, else
``set_config_path``, else ``$TSDECODE_CONFIG_DIR``), then the user cache folder (where
``tsdecode-tune`` writes), then the tables shipped in the package. A table matches a device by
name, or else by compute capability and SM count (with a warning). The first matching table
holding the shape's class and exact bucket wins; when no table holds that (class, bucket), the
first holding it for the float16/bfloat16 twin class wins (same kernel and configs). A missing,
corrupt or stale table logs one warning and never fails a plan.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import logging
import math
import os
import re
import threading
import time
import tokenize
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import platformdirs

from ..device import DeviceProperties
from .space import SPACE, KernelConfig, ProblemShape, next_power_of_2

FORMAT_VERSION = 1
CONFIG_DIR_ENV = "TSDECODE_CONFIG_DIR"
TUNE_COMMAND = "tsdecode-tune --preset llama3-8b"
SQ_BUCKETS = (1, 2, 4, 8, 16)  # fixed SQ rounded up to one of these ("16+" above), or "packed"
KERNEL_SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "decode.py"

logger = logging.getLogger(__name__)

_CLASS_KEY_RE = re.compile(
    r"q=[a-z0-9_]+,kv=[a-z0-9_]+,o=[a-z0-9_]+,d=[1-9][0-9]*,g=[1-9][0-9]*,hkv=[1-9][0-9]*,"
    r"p=[1-9][0-9]*,sq=(1|2|4|8|16\+|packed),mask=(dense|causal|windowed)")


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


def sibling_class_key(key: str) -> str | None:
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


# --- entries and tables --------------------------------------------------------------------------

@dataclass(frozen=True)
class TableEntry:
    """One bucket's winner and the heuristic default it was timed against (us, GB/s)."""

    kernel_config: KernelConfig
    time_us: float
    bandwidth_gbs: float
    fraction_of_copy: float | None  # of a device-to-device copy's bandwidth
    default_config: KernelConfig
    default_time_us: float
    default_bandwidth_gbs: float
    tuned_batch_size: int | None = None  # the batch size timed (None: the bucket's)

    @property
    def speedup(self) -> float:
        return self.default_time_us / self.time_us

    def to_dict(self) -> dict[str, Any]:
        data = {"kernel_config": self.kernel_config.to_dict(), "time_us": self.time_us,
                "bandwidth_gbs": self.bandwidth_gbs, "fraction_of_copy": self.fraction_of_copy,
                "default_config": self.default_config.to_dict(), "default_time_us": self.default_time_us,
                "default_bandwidth_gbs": self.default_bandwidth_gbs}
        if self.tuned_batch_size is not None:
            data["tuned_batch_size"] = self.tuned_batch_size
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TableEntry":
        """ValueError for a config outside today's space (the format is checked before)."""
        return cls(KernelConfig.from_dict(data["kernel_config"]), float(data["time_us"]),
                   float(data["bandwidth_gbs"]),
                   None if data["fraction_of_copy"] is None else float(data["fraction_of_copy"]),
                   KernelConfig.from_dict(data["default_config"]), float(data["default_time_us"]),
                   float(data["default_bandwidth_gbs"]), data.get("tuned_batch_size"))


@dataclass(frozen=True)
class Table:
    """A parsed table: entries[class key][(batch_size, kv_len)], only those valid in today's
    config space (``skipped`` says which were dropped); ``stale`` lists provenance mismatches."""

    path: str
    device: DeviceProperties
    triton_version: str
    torch_version: str
    kernel_hash: str
    tuner_settings: Mapping[str, Any]
    created: str
    updated: str
    entries: Mapping[str, Mapping[tuple[int, int], TableEntry]]
    skipped: tuple[str, ...] = ()
    stale: tuple[str, ...] = ()


class TableFormatError(ValueError):
    """A table file that does not follow the format (the message names the field)."""


# --- format --------------------------------------------------------------------------------------

def _number(v: object, positive: bool = False) -> bool:
    if type(v) not in (int, float):
        return False
    try:
        return math.isfinite(v) and (v > 0 if positive else v >= 0)
    except OverflowError:  # an int no float holds
        return False


def _int(v: object, minimum: int = 0) -> bool:
    return type(v) is int and v >= minimum


def _date(v: object) -> bool:
    try:
        datetime.datetime.fromisoformat(v)
    except (TypeError, ValueError):
        return False
    return True


def _config(v: object) -> bool:  # structure only: from_dict judges the values, entry by entry
    return isinstance(v, dict) and all(isinstance(k, str) and type(x) is int for k, x in v.items())


_ENTRY = {
    "kernel_config": (_config, "an object of int fields"),
    "time_us": (lambda v: _number(v, True), "a finite number > 0"),
    "bandwidth_gbs": (_number, "a finite number >= 0"),
    "fraction_of_copy": (lambda v: v is None or _number(v), "null or a finite number >= 0"),
    "default_config": (_config, "an object of int fields"),
    "default_time_us": (lambda v: _number(v, True), "a finite number > 0"),
    "default_bandwidth_gbs": (_number, "a finite number >= 0"),
}
_ENTRY_OPTIONAL = {"tuned_batch_size": (lambda v: _int(v, 1), "an int >= 1")}
_POW2 = (lambda v: _int(v, 1) and v & (v - 1) == 0, "a power of two >= 1")
_BUCKET = {"batch_size": _POW2, "kv_len": _POW2, **_ENTRY}
_DEVICE = {
    "name": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "sm_count": (lambda v: _int(v, 1), "an int >= 1"),
    "compute_capability": (lambda v: isinstance(v, list) and len(v) == 2 and all(map(_int, v)),
                           "[major, minor] ints"),
    "total_memory": (_int, "an int >= 0 (bytes)"),
}
_TOP = {
    "format_version": (lambda v: type(v) is int and v == FORMAT_VERSION, str(FORMAT_VERSION)),
    "device": (lambda v: isinstance(v, dict), "an object"),
    "triton_version": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "torch_version": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "kernel_hash": (lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{8,64}", v), "lowercase hex"),
    "tuner_settings": (lambda v: isinstance(v, dict), "an object"),
    "created": (_date, "an ISO 8601 date"),
    "updated": (_date, "an ISO 8601 date"),
    "entries": (lambda v: isinstance(v, dict), "an object"),
}


def _check(data: object, where: str, fields: Mapping, optional: Mapping = {}) -> None:
    if not isinstance(data, Mapping):
        raise TableFormatError(f"{where}: expected an object, got {type(data).__name__}")
    missing = [k for k in fields if k not in data]
    unknown = [k for k in data if k not in fields and k not in optional]
    if missing or unknown:
        raise TableFormatError(f"{where}: " + "; ".join(
            m for m in (missing and f"missing field(s) {missing}", unknown and f"unknown field(s) {unknown}") if m))
    for name, (ok, what) in {**fields, **{k: v for k, v in optional.items() if k in data}}.items():
        if not ok(data[name]):
            raise TableFormatError(f"{where}.{name}: expected {what}, got {_shown(data[name])}")


def _shown(value: object) -> str:
    """repr, shortened to keep a warning readable (a file may hold a 400-digit number)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"


def validate_table_data(data: object) -> None:
    """Check a decoded table against format ``FORMAT_VERSION``; raise TableFormatError naming the
    field (configs only for structure: whether they lie in today's space is decided per entry)."""
    if not isinstance(data, dict):
        raise TableFormatError(f"table: expected a JSON object, got {type(data).__name__}")
    if type(data.get("format_version")) is not int or data["format_version"] != FORMAT_VERSION:
        raise TableFormatError(f"format_version is {data.get('format_version')!r}, this tsdecode "
                               f"reads {FORMAT_VERSION}")
    _check(data, "table", _TOP)
    _check(data["device"], "device", _DEVICE)
    for key, records in data["entries"].items():
        where = f"entries[{key!r}]"
        if not _CLASS_KEY_RE.fullmatch(key):
            raise TableFormatError(f"{where}: not a problem class key (see tables.problem_class_key)")
        if not isinstance(records, list) or not records:
            raise TableFormatError(f"{where}: expected a non-empty list of buckets")
        seen = set()
        for i, record in enumerate(records):
            _check(record, f"{where}[{i}]", _BUCKET, _ENTRY_OPTIONAL)
            bucket = (record["batch_size"], record["kv_len"])
            if bucket in seen:
                raise TableFormatError(f"{where}[{i}]: duplicate bucket {bucket}")
            seen.add(bucket)


def check_tuned_batch_size(bucket: tuple[int, int], entry: TableEntry) -> None:
    """ValueError unless tuned_batch_size (if any) lies in the bucket: b/2 < B <= b."""
    b = entry.tuned_batch_size
    if b is not None and not bucket[0] // 2 < b <= bucket[0]:
        raise ValueError(f"tuned_batch_size {_shown(b)} is not a batch size of bucket {bucket} "
                         f"(expected {bucket[0] // 2} < tuned_batch_size <= {bucket[0]})")


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
    skipped = []
    for key, records in data["entries"].items():
        for record in records:
            bucket = (record["batch_size"], record["kv_len"])
            try:
                entry = TableEntry.from_dict(record)
                check_tuned_batch_size(bucket, entry)
                entries.setdefault(key, {})[bucket] = entry
            except (ValueError, TypeError) as e:
                skipped.append(f"{key} bucket {bucket}: {e}")
    stale = []
    if data["kernel_hash"] != kernel_source_hash():
        stale.append(f"kernel hash differs (table {data['kernel_hash']}, running {kernel_source_hash()})")
    if data["triton_version"].split(".")[0] != _triton_version().split(".")[0]:
        stale.append(f"tuned with triton {data['triton_version']}, running triton {_triton_version()}")
    return Table(path, DeviceProperties.from_dict(data["device"]), data["triton_version"],
                 data["torch_version"], data["kernel_hash"], data["tuner_settings"], data["created"],
                 data["updated"], entries, tuple(skipped), tuple(stale))


# --- loading -------------------------------------------------------------------------------------

_lock = threading.Lock()
_tables: dict[str, tuple[tuple, Table | None]] = {}  # path -> (file key, table or None = unusable)
_warned: set = set()
_config_path: str | None = None
_RACY_NS = 1_000_000_000


def warn_once(key: object, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message)


def clear_cache() -> None:
    """Forget parsed tables, warnings given and the kernel hash (tests)."""
    with _lock:
        _tables.clear()
        _warned.clear()
        _hash.clear()


def set_config_path(path: str | os.PathLike | None) -> None:
    """Search this table file or folder first (before $TSDECODE_CONFIG_DIR); None unsets."""
    global _config_path
    _config_path = None if path is None else os.fspath(path)


def user_config_dir() -> Path:
    """Where ``tsdecode-tune`` writes and plans look second (the user cache folder)."""
    return Path(platformdirs.user_cache_dir("tsdecode")) / "tuned_configs"


def shipped_config_dir() -> Path | None:
    """The tables shipped in the package (``tsdecode/tuned_configs/`` of an installed wheel), or
    the source tree's ``tuned_configs/`` when run from it (an editable install)."""
    installed = Path(str(resources.files(__name__.split(".")[0]).joinpath("tuned_configs")))
    source_tree = Path(__file__).resolve().parent.parent.parent / "tuned_configs"
    return next((folder for folder in (installed, source_tree) if folder.is_dir()), None)


def load_table(path: str | os.PathLike) -> Table | None:
    """The table at ``path`` (parsed once, re-read when the file changes), or None if it is
    missing or unusable; an unusable file logs one warning per file and cause."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
    cached = _tables.get(path)
    if cached is not None and cached[0] == key:
        return cached[1]
    # A file changed within the filesystem's timestamp resolution of now could change again
    # under the same key: such a read is not cached (as git treats a "racily clean" index).
    racy = time.time_ns() - st.st_mtime_ns < _RACY_NS
    table = None
    try:
        with open(path, "rb") as f:
            table = parse_table(path, json.loads(f.read()))
    except OSError as e:
        warn_once(("unreadable", path), f"tuned config table {path} cannot be read ({e}); ignored")
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, format
        warn_once(("unusable", path), f"tuned config table {path} is unusable ({e}); ignored "
                                      f"(re-tune with `{TUNE_COMMAND}`)")
    except Exception as e:  # noqa: BLE001 - a table must never break a plan
        warn_once(("error", path), f"tuned config table {path} cannot be used ({e!r}); ignored")
    if table is not None and table.skipped:
        warn_once(("skipped", path), f"tuned config table {path}: {len(table.skipped)} entries are "
                                     f"not valid today and are ignored (first: {table.skipped[0]})")
    if not racy:
        with _lock:
            _tables[path] = (key, table)
    return table


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
    out.append(("user cache", str(user_config_dir()), False))
    shipped = shipped_config_dir()
    if shipped is not None:
        out.append(("shipped", str(shipped), False))
    return out


def _tables_for(origin: str, source: str, explicit: bool, device: DeviceProperties, trace: list | None):
    """(table, notes) of one source that match the device: exact name first, then same compute
    capability and SM count. An unusable file that may have been this device's table (its file
    name, or a file given explicitly) yields (None, ()): it has warned already."""
    if os.path.isdir(source):
        try:
            names = sorted(n for n in os.listdir(source) if n.endswith(".json") and not n.startswith("."))
        except OSError as e:  # e.g. a folder without read permission: skip it, never fail a plan
            warn_once(("unreadable folder", source), f"tsdecode: cannot list tuned-config folder "
                      f"{source} ({origin}): {e}; skipping it")
            return []
        files = [os.path.join(source, n) for n in names]
        own = os.path.join(source, table_filename(device.name))
        files.sort(key=lambda f: f != own)
    elif os.path.exists(source):
        files = [source]
    else:
        if explicit:
            warn_once(("no path", source), f"tuned config path {source} (from {origin}) does not exist; "
                                           f"no table read from it")
        if trace is not None:
            trace.append(f"    {source}: does not exist")
        return
    variants = []
    for path in files:
        table = load_table(path)
        if table is None:
            if trace is not None:
                trace.append(f"    {path}: unusable (see the warning)")
            if path == source or os.path.basename(path) == table_filename(device.name):
                yield None, ()
        elif table.device.name == device.name:
            yield table, ()
        elif (table.device.compute_capability, table.device.sm_count) == (device.compute_capability,
                                                                          device.sm_count):
            variants.append(table)
        elif trace is not None:
            trace.append(f"    {path}: for {table.device.describe()}, not this device")
    for table in variants:
        note = (f"table for '{table.device.name}' used for '{device.name}' (same compute capability "
                f"and SM count)")
        warn_once(("variant", table.path, device.name), f"tuned config table {table.path}: {note}")
        yield table, (note,)


def lookup(shape: ProblemShape, device: DeviceProperties, *, config_dir: str | os.PathLike | None = None,
           trace: list[str] | None = None) -> TableHit | None:
    """The tuned entry for ``shape`` on ``device``: the first matching table holding the shape's
    class (or its float16/bfloat16 twin) and exact bucket; None means the heuristic. ``trace``
    collects what was searched, for ``explain``."""
    key, bucket = problem_class_key(shape), bucket_of(shape.batch_size, shape.max_kv_len)
    twin = sibling_class_key(key)
    found_any = False
    matched = []
    for origin, source, explicit in _sources(config_dir):
        if trace is not None:
            trace.append(f"  {origin}: {source}")
        for table, notes in _tables_for(origin, source, explicit, device, trace):
            found_any = True
            if table is None:
                continue
            for note in table.stale:
                warn_once(("stale", table.path, note.split(" (")[0]),
                          f"tuned config table {table.path}: {note}; re-tune with `{TUNE_COMMAND}`")
            entry = table.entries.get(key, {}).get(bucket)
            if entry is not None:
                if trace is not None:
                    trace.append(f"    {table.path}: {key} bucket {bucket} -> hit")
                return TableHit(entry.kernel_config, table.path, bucket, entry, notes + table.stale)
            if trace is not None:
                trace.append(f"    {table.path}: no entry for this class and bucket")
            matched.append((table, notes))
    # No table holds the class itself: the first holding its float16/bfloat16 twin.
    for table, notes in matched if twin else ():
        entry = table.entries.get(twin, {}).get(bucket)
        if entry is not None:
            if trace is not None:
                trace.append(f"    {table.path}: {twin} bucket {bucket} -> hit (the 16-bit twin class)")
            extra = (f"entries of class {twin} (float16 and bfloat16 share kernel and configs)",)
            return TableHit(entry.kernel_config, table.path, bucket, entry, extra + notes + table.stale)
    if not found_any:
        command = TUNE_COMMAND if device.is_gpu else "tsdecode-tune --preset smoke"
        warn_once(("missing", device.name),
                  f"no tuned config table for {device.describe()}; using the heuristic. Tune with "
                  f"`{command}` (writes {user_config_dir() / table_filename(device.name)})")
    return None
