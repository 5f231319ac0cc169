"""Tuned config tables: the best ``KernelConfig`` the tuner measured, per GPU and shape bucket.

One JSON file per GPU model (``tuned_configs/NVIDIA_H200.json``) maps a problem class (dtypes,
head_dim, group size, Hkv, page size, query mode, mask kind) and a (batch_size, kv_len) bucket
(powers of two) to the winning config and what it measured against the heuristic default.

``configs.select_config`` calls ``lookup`` once per plan; ``run`` never looks anything up.
Lookup is cheap (a few ``os.stat`` calls and dict lookups: tables are parsed once per process
and re-read only when a file's inode, mtime or size changes) and never fails: a missing,
corrupt or stale table logs one warning (logger ``tsdecode.tables``) and the plan falls back to
the next table or to the heuristic. The config a table gives is still clamped to the shape by
``configs.fit_config`` in the caller. See docs/config-tables.md.

Search order (first table that matches the device and has an entry for the problem class wins):

1. an explicit path (a table file or a folder of tables): the ``config_dir`` argument, else
   ``set_config_path``, else ``$TSDECODE_CONFIG_DIR``;
2. the user's cache, ``$XDG_CACHE_HOME/tsdecode/tuned_configs`` (``tsdecode-tune`` writes here);
3. the tables shipped in the package (``tsdecode.tuned_configs``).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib.resources
import importlib.util
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from .configs import (
    KernelConfig, ProblemShape, config_from_table_hit, device_num_sms, device_shared_memory_per_sm,
    next_power_of_2,
)

try:  # POSIX; without it merges are not serialised between processes (atomic replace still holds)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = [
    "FORMAT_VERSION", "CONFIG_DIR_ENV", "TUNE_COMMAND", "DeviceInfo", "TableEntry", "Table",
    "TableHit", "TableFormatError", "problem_class_key", "query_mode", "bucket_of",
    "table_filename", "user_config_dir", "shipped_config_dir", "kernel_source_hash",
    "validate_table_data", "load_table", "merge_entries", "lookup", "explain", "set_config_path",
    "set_device_info_override", "clear_cache", "bench_lookup",
]

FORMAT_VERSION = 1
CONFIG_DIR_ENV = "TSDECODE_CONFIG_DIR"
TUNE_COMMAND = "tsdecode-tune --preset llama3-8b"
SHIPPED_PACKAGE = "tsdecode.tuned_configs"
# Query-mode buckets of the problem class: fixed SQ rounded up to one of these ("16+" above),
# or "packed" (ragged qo_indptr).
SQ_BUCKETS = (1, 2, 4, 8, 16)

logger = logging.getLogger(__name__)

_CLASS_KEY_RE = re.compile(
    r"q=[a-z0-9_]+,kv=[a-z0-9_]+,o=[a-z0-9_]+,d=[1-9][0-9]*,g=[1-9][0-9]*,hkv=[1-9][0-9]*,"
    r"p=[1-9][0-9]*,sq=(1|2|4|8|16\+|packed),mask=(dense|causal|windowed)"
)
_HASH_RE = re.compile(r"[0-9a-f]{8,64}")


# ---------------------------------------------------------------------------------------------
# Device identity, problem classes and buckets
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceInfo:
    """What table matching looks at: the GPU's name, SM count, compute capability and memory."""

    name: str
    sm_count: int
    compute_capability: tuple[int, int]
    total_memory: int  # bytes

    @classmethod
    def from_torch(cls, device: torch.device | str | int) -> "DeviceInfo":
        """Properties of a CUDA device (cached per device index)."""
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"DeviceInfo.from_torch needs a CUDA device, got {device}")
        index = torch.cuda.current_device() if device.index is None else device.index
        info = _device_infos.get(index)
        if info is None:
            p = torch.cuda.get_device_properties(index)
            info = cls(p.name, p.multi_processor_count, (p.major, p.minor), p.total_memory)
            _device_infos[index] = info
        return info

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "sm_count": self.sm_count,
            "compute_capability": list(self.compute_capability), "total_memory": self.total_memory,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DeviceInfo":
        _check_device(data, "device")
        cc = data["compute_capability"]
        return cls(data["name"], data["sm_count"], (cc[0], cc[1]), data["total_memory"])

    def describe(self) -> str:
        major, minor = self.compute_capability
        return f"'{self.name}' (compute capability {major}.{minor}, {self.sm_count} SMs)"


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def query_mode(shape: ProblemShape) -> str:
    """The SQ bucket of a shape: "1", "2", "4", "8", "16+" or "packed"."""
    if shape.packed:
        return "packed"
    sq = next_power_of_2(shape.max_seq_len_q)
    return f"{SQ_BUCKETS[-1]}+" if sq >= SQ_BUCKETS[-1] else str(sq)


def problem_class_key(shape: ProblemShape) -> str:
    """The table key of everything that fixes the kernel's code path (not B or L).

    E.g. ``"q=bfloat16,kv=bfloat16,o=bfloat16,d=128,g=4,hkv=8,p=16,sq=1,mask=dense"``.
    """
    return (
        f"q={_dtype_name(shape.q_dtype)},kv={_dtype_name(shape.kv_dtype)},"
        f"o={_dtype_name(shape.o_dtype)},d={shape.head_dim},g={shape.group_size},"
        f"hkv={shape.num_kv_heads},p={shape.page_size},sq={query_mode(shape)},"
        f"mask={shape.mask_kind}"
    )


_SIBLING_16BIT = {"float16": "bfloat16", "bfloat16": "float16"}


def sibling_class_key(key: str) -> str | None:
    """The class key with float16 and bfloat16 swapped in every dtype field (None: no 16-bit
    dtype in it). Both run the same kernel code, loads and config space (only the dot's operand
    type differs), so a class tuned in one dtype is the nearest entry for the other."""
    fields = []
    swapped = False
    for field_ in key.split(","):
        name, _, value = field_.partition("=")
        if name in ("q", "kv", "o") and value in _SIBLING_16BIT:
            value, swapped = _SIBLING_16BIT[value], True
        fields.append(f"{name}={value}")
    return ",".join(fields) if swapped else None


def bucket_of(batch_size: int, kv_len: int) -> tuple[int, int]:
    """(batch_size, kv_len) rounded up to powers of two: the table bucket a plan falls into."""
    return next_power_of_2(batch_size), next_power_of_2(kv_len)


def table_filename(device_name: str) -> str:
    """``"NVIDIA H200"`` -> ``"NVIDIA_H200.json"`` (every non-alphanumeric becomes ``_``)."""
    return re.sub(r"[^A-Za-z0-9]", "_", device_name.strip()) + ".json"


# ---------------------------------------------------------------------------------------------
# Entries and tables
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TableEntry:
    """One bucket's winner and the heuristic default it was measured against.

    Times are microseconds per call, bandwidths GB/s of K/V (+ Q/O) bytes moved;
    fraction_of_copy is the winner's bandwidth over a device-to-device copy's (None if unknown).
    """

    kernel_config: KernelConfig
    time_us: float
    bandwidth_gbs: float
    fraction_of_copy: float | None
    default_config: KernelConfig
    default_time_us: float
    default_bandwidth_gbs: float
    # Batch size of the shape the entry was measured at (the bucket's largest); None (tables
    # written before the field existed): the bucket's batch size.
    tuned_batch_size: int | None = None

    @property
    def speedup(self) -> float:
        """default_time_us / time_us: what tuning bought for this bucket."""
        return self.default_time_us / self.time_us

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel_config": self.kernel_config.to_dict(),
            "time_us": self.time_us,
            "bandwidth_gbs": self.bandwidth_gbs,
            "fraction_of_copy": self.fraction_of_copy,
            "default_config": self.default_config.to_dict(),
            "default_time_us": self.default_time_us,
            "default_bandwidth_gbs": self.default_bandwidth_gbs,
            **({} if self.tuned_batch_size is None
               else {"tuned_batch_size": self.tuned_batch_size}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TableEntry":
        """Validate and build; raises TableFormatError (structure) or ValueError (a config
        outside today's config space)."""
        _check_fields(data, "entry", _ENTRY_FIELDS, _ENTRY_OPTIONAL_FIELDS)
        return cls(
            kernel_config=KernelConfig.from_dict(data["kernel_config"]),
            time_us=float(data["time_us"]),
            bandwidth_gbs=float(data["bandwidth_gbs"]),
            fraction_of_copy=(
                None if data["fraction_of_copy"] is None else float(data["fraction_of_copy"])
            ),
            default_config=KernelConfig.from_dict(data["default_config"]),
            default_time_us=float(data["default_time_us"]),
            default_bandwidth_gbs=float(data["default_bandwidth_gbs"]),
            tuned_batch_size=data.get("tuned_batch_size"),
        )


@dataclass(frozen=True)
class Table:
    """A parsed, validated table file.

    entries: problem class key -> {(batch_size, kv_len) bucket: TableEntry}, holding only entries
    valid in today's config space; ``skipped`` says which were dropped and why. ``stale`` lists
    provenance mismatches (kernel source hash, triton major version) with the running code.
    """

    path: str
    device: DeviceInfo
    triton_version: str
    torch_version: str
    kernel_hash: str
    tuner_settings: Mapping[str, Any]
    created: str
    updated: str
    entries: Mapping[str, Mapping[tuple[int, int], TableEntry]]
    skipped: tuple[str, ...] = ()
    stale: tuple[str, ...] = ()
    # (class key, bucket) -> nearest bucket; the table is immutable, so this memo never goes stale
    _nearest: dict = field(default_factory=dict, compare=False, repr=False)

    def nearest_bucket(self, key: str, bucket: tuple[int, int]) -> tuple[int, int] | None:
        """The bucket of class ``key`` closest to ``bucket``: log2 distance over batch size plus
        K/V length (ties: closer length, then the larger bucket); None if the class is absent."""
        buckets = self.entries.get(key)
        if not buckets:
            return None
        if bucket in buckets:
            return bucket
        memo_key = (key, bucket)
        best = self._nearest.get(memo_key)
        if best is None:
            lb, ll = bucket[0].bit_length(), bucket[1].bit_length()

            def rank(b: tuple[int, int]) -> tuple[int, int, int, int]:
                db, dl = abs(b[0].bit_length() - lb), abs(b[1].bit_length() - ll)
                return db + dl, dl, -b[1], -b[0]

            best = self._nearest[memo_key] = min(buckets, key=rank)
        return best


@dataclass(frozen=True)
class TableHit:
    """What ``lookup`` found: the table's config (not yet fitted to the shape), where from, and
    notes for ``SelectedConfig.adjustments`` (nearest bucket, device variant, stale table)."""

    kernel_config: KernelConfig
    table_path: str
    bucket: tuple[int, int]
    notes: tuple[str, ...] = ()
    entry: TableEntry | None = None


class TableFormatError(ValueError):
    """A table file that does not follow the format (the message names the offending field)."""


class _VersionError(TableFormatError):
    pass


# ---------------------------------------------------------------------------------------------
# Schema check. Hand-written rather than jsonschema: the format is small, the runtime must not
# grow a dependency for it, and the messages name the exact field ("entries[...][3].time_us").
# ---------------------------------------------------------------------------------------------


def _fail(where: str, message: str) -> None:
    raise TableFormatError(f"{where}: {message}")


def _is_int(v: object, minimum: int = 0) -> bool:
    return type(v) is int and v >= minimum


def _is_number(v: object, positive: bool = False) -> bool:
    if type(v) not in (int, float):
        return False
    try:
        ok = math.isfinite(v)
    except OverflowError:  # an int too large for a float (e.g. 1 followed by 400 zeros)
        return False
    return ok and (v > 0 if positive else v >= 0)


def _is_pow2(v: object) -> bool:
    return _is_int(v, 1) and v & (v - 1) == 0


def _is_config_mapping(v: object) -> bool:
    # Structure only: KernelConfig.from_dict decides whether the values are in today's space, so
    # an entry from an older config space is skipped rather than failing the whole file.
    return isinstance(v, dict) and all(isinstance(k, str) and type(x) is int for k, x in v.items())


def _is_text(v: object) -> bool:
    return isinstance(v, str) and v != ""


def _is_date(v: object) -> bool:
    if not isinstance(v, str):
        return False
    try:
        datetime.datetime.fromisoformat(v)
    except ValueError:
        return False
    return True


# field -> (check, description of what it must be)
_ENTRY_FIELDS: dict[str, tuple[Any, str]] = {
    "kernel_config": (_is_config_mapping, "an object of int fields"),
    "time_us": (lambda v: _is_number(v, positive=True), "a finite number > 0"),
    "bandwidth_gbs": (_is_number, "a finite number >= 0"),
    "fraction_of_copy": (lambda v: v is None or _is_number(v), "null or a finite number >= 0"),
    "default_config": (_is_config_mapping, "an object of int fields"),
    "default_time_us": (lambda v: _is_number(v, positive=True), "a finite number > 0"),
    "default_bandwidth_gbs": (_is_number, "a finite number >= 0"),
}
_ENTRY_OPTIONAL_FIELDS: dict[str, tuple[Any, str]] = {
    "tuned_batch_size": (lambda v: _is_int(v, 1), "an int >= 1"),
}
_BUCKET_FIELDS = {
    "batch_size": (_is_pow2, "a power of two >= 1"),
    "kv_len": (_is_pow2, "a power of two >= 1"),
    **_ENTRY_FIELDS,
}
_DEVICE_FIELDS = {
    "name": (_is_text, "a non-empty string"),
    "sm_count": (lambda v: _is_int(v, 1), "an int >= 1"),
    "compute_capability": (
        lambda v: isinstance(v, list) and len(v) == 2 and all(_is_int(x) for x in v),
        "[major, minor] ints",
    ),
    "total_memory": (_is_int, "an int >= 0 (bytes)"),
}
_TOP_FIELDS = {
    "format_version": (lambda v: type(v) is int and v == FORMAT_VERSION, f"{FORMAT_VERSION}"),
    "device": (lambda v: isinstance(v, dict), "an object"),
    "triton_version": (_is_text, "a non-empty string"),
    "torch_version": (_is_text, "a non-empty string"),
    "kernel_hash": (lambda v: isinstance(v, str) and _HASH_RE.fullmatch(v), "lowercase hex"),
    "tuner_settings": (lambda v: isinstance(v, dict), "an object"),
    "created": (_is_date, "an ISO 8601 date"),
    "updated": (_is_date, "an ISO 8601 date"),
    "entries": (lambda v: isinstance(v, dict), "an object"),
}


def _check_fields(
    data: object, where: str, fields: Mapping[str, tuple[Any, str]],
    optional: Mapping[str, tuple[Any, str]] | None = None,
) -> None:
    """Required ``fields`` present, no others than them and ``optional``; every value checked."""
    optional = optional or {}
    if not isinstance(data, Mapping):
        _fail(where, f"expected an object, got {type(data).__name__}")
    missing = [k for k in fields if k not in data]
    if missing:
        _fail(where, f"missing field(s) {missing}")
    unknown = [k for k in data if k not in fields and k not in optional]
    if unknown:
        _fail(where, f"unknown field(s) {unknown}")
    present = {k: v for k, v in optional.items() if k in data}
    for name, (check, what) in {**fields, **present}.items():
        if not check(data[name]):
            _fail(f"{where}.{name}", f"expected {what}, got {_brief(data[name])}")


def _check_device(data: object, where: str) -> None:
    _check_fields(data, where, _DEVICE_FIELDS)


def _brief(value: object) -> str:
    """repr, shortened (a 400-digit number is named, not printed)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"


def _check_tuned_batch_size(bucket: tuple[int, int], entry: TableEntry) -> None:
    """ValueError unless the entry's tuned_batch_size (if any) falls in its bucket:
    ``bucket_of`` rounds B up to a power of two, so bucket b holds b/2 < B <= b."""
    b = entry.tuned_batch_size
    if b is not None and not bucket[0] // 2 < b <= bucket[0]:
        raise ValueError(
            f"tuned_batch_size {_brief(b)} is not a batch size of bucket {bucket} (expected "
            f"{bucket[0] // 2} < tuned_batch_size <= {bucket[0]})"
        )


def validate_table_data(data: object) -> None:
    """Check a decoded table file against format ``FORMAT_VERSION``; raise TableFormatError.

    Kernel configs are only checked for shape (an object of ints): whether they lie in today's
    config space is ``KernelConfig.from_dict``'s call, entry by entry, when the table is parsed.
    """
    if not isinstance(data, dict):
        _fail("table", f"expected a JSON object, got {type(data).__name__}")
    version = data.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:  # not 1.0 or true
        raise _VersionError(
            f"format_version is {version!r}, this tsdecode reads {FORMAT_VERSION}"
        )
    _check_fields(data, "table", _TOP_FIELDS)
    _check_device(data["device"], "device")
    for key, records in data["entries"].items():
        where = f"entries[{key!r}]"
        if not _CLASS_KEY_RE.fullmatch(key):
            _fail(where, "not a problem class key (see tables.problem_class_key)")
        if not isinstance(records, list) or not records:
            _fail(where, "expected a non-empty list of buckets")
        seen = set()
        for i, record in enumerate(records):
            _check_fields(record, f"{where}[{i}]", _BUCKET_FIELDS, _ENTRY_OPTIONAL_FIELDS)
            bucket = (record["batch_size"], record["kv_len"])
            if bucket in seen:
                _fail(f"{where}[{i}]", f"duplicate bucket {bucket}")
            seen.add(bucket)


# ---------------------------------------------------------------------------------------------
# Provenance: the kernel source and compiler the configs were tuned for
# ---------------------------------------------------------------------------------------------

_hash_cache: list[str] = []


def code_without_comments(source: str) -> str:
    """Python source with comments, docstrings, blank lines and trailing spaces removed.

    Spans come from ``tokenize`` (COMMENT tokens, and STRING tokens that form a statement of their
    own), so the result does not depend on the Python version's tokenizer details elsewhere.
    """
    import io
    import tokenize

    skip = {tokenize.NL, tokenize.COMMENT}
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    spans = []
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            spans.append((tok.start, tok.end))
        elif tok.type == tokenize.STRING:
            prev = next((t for t in reversed(tokens[:i]) if t.type not in skip), None)
            nxt = next((t for t in tokens[i + 1:] if t.type not in skip), None)
            starts_statement = prev is None or prev.type in (
                tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)
            if starts_statement and nxt is not None and nxt.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                spans.append((tok.start, tok.end))
    lines = source.splitlines()
    for (r0, c0), (r1, c1) in reversed(spans):  # 1-based rows, 0-based columns
        head, tail = lines[r0 - 1][:c0], lines[r1 - 1][c1:]
        lines[r0 - 1:r1] = [head + tail]
    return "\n".join(line.rstrip() for line in lines if line.strip())


def kernel_source_hash() -> str:
    """sha256 (first 16 hex) of the kernel code and the config space it is tuned over.

    Covers the code of tsdecode/kernels/decode.py (``code_without_comments``: editing a comment
    or a docstring, or a CRLF checkout, keeps tables current) and the config-space definition
    (KernelConfig's fields and the choice constants), not the rest of configs.py: editing the
    heuristic must not mark every tuned table stale.
    """
    if not _hash_cache:
        import dataclasses

        from . import configs

        root = Path(__file__).resolve().parent
        h = hashlib.sha256()
        source = (root / "kernels" / "decode.py").read_text(encoding="utf-8")
        h.update(code_without_comments(source).encode("utf-8"))
        h.update(b"\0")
        space = (
            [f.name for f in dataclasses.fields(configs.KernelConfig)],
            configs.BLOCK_N_CHOICES, configs.BLOCK_M_CHOICES, configs.NUM_WARPS_CHOICES,
            configs.NUM_STAGES_CHOICES, configs.MAX_NUM_KV_SPLITS, configs.DOT_MIN_BLOCK_M,
            configs.FMA_MAX_TILE_ELEMENTS,
        )
        h.update(repr(space).encode("utf-8"))
        _hash_cache.append(h.hexdigest()[:16])
    return _hash_cache[0]


def _triton_version() -> str:
    import triton

    return triton.__version__


def _major(version: str) -> str:
    return version.split(".", 1)[0]


# ---------------------------------------------------------------------------------------------
# Process state: parsed tables, warn-once, overrides
# ---------------------------------------------------------------------------------------------

_lock = threading.Lock()
# path -> ((inode, mtime_ns, ctime_ns, size), Table | None, trusted): None caches "unusable"
# too, so a broken file costs one stat per lookup, not a parse.
_tables: dict[str, tuple[tuple[int, int, int, int], Table | None, bool]] = {}
_warned: set[tuple] = set()
_device_infos: dict[int, DeviceInfo] = {}
_shipped: list[Path | None] = []
_user_dirs: dict[tuple[str, str], str] = {}
_filenames: dict[str, str] = {}
_config_path: str | None = None
_device_override: DeviceInfo | None = None


def _warn_once(key: tuple, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message)


def clear_cache() -> None:
    """Forget parsed tables, device properties, the shipped-dir location, the kernel hash and
    which warnings were given (tests; a long-lived process never needs it)."""
    with _lock:
        _tables.clear()
        _warned.clear()
        _device_infos.clear()
        _shipped.clear()
        _user_dirs.clear()
        _hash_cache.clear()


def set_config_path(path: str | os.PathLike | None) -> None:
    """Search this table file or folder first (before $TSDECODE_CONFIG_DIR); None unsets."""
    global _config_path
    _config_path = None if path is None else os.fspath(path)


def set_device_info_override(info: DeviceInfo | None) -> None:
    """Match tables as if running on ``info`` (any device, CPU included); None unsets.

    For tests and for planning on a machine other than the target; lookup's ``device_info``
    argument overrides it for one call.
    """
    if info is not None and not isinstance(info, DeviceInfo):
        raise TypeError(f"expected a tables.DeviceInfo or None, got {type(info).__name__}")
    global _device_override
    _device_override = info


def user_config_dir() -> Path:
    """``$XDG_CACHE_HOME/tsdecode/tuned_configs`` (``~/.cache/...`` when unset or relative)."""
    return Path(_user_config_dir())


def _user_config_dir() -> str:
    env = (os.environ.get("XDG_CACHE_HOME", ""), os.environ.get("HOME", ""))
    folder = _user_dirs.get(env)
    if folder is None:  # expanduser + joins cost more than the rest of a lookup: memoise
        base = env[0]
        if not os.path.isabs(base):  # the XDG spec says to ignore relative paths
            base = os.path.join(os.path.expanduser("~"), ".cache")
        folder = _user_dirs[env] = os.path.join(base, "tsdecode", "tuned_configs")
    return folder


def shipped_config_dir() -> Path | None:
    """The folder of tables shipped in the package, or None if there is none.

    Installed: the ``tsdecode.tuned_configs`` package data (pyproject maps the top-level
    ``tuned_configs/`` folder there; it has no ``__init__.py``, so it imports as a namespace
    package). Source tree: ``<repo>/tuned_configs``.
    """
    if not _shipped:
        _shipped.append(_find_shipped_dir())
    return _shipped[0]


def _find_shipped_dir() -> Path | None:
    try:
        root = importlib.resources.files(SHIPPED_PACKAGE)
    except (ImportError, TypeError, ValueError):
        root = None
    if isinstance(root, Path) and root.is_dir():
        return root
    if root is not None:  # a namespace package's MultiplexedPath: ask the import system
        spec = importlib.util.find_spec(SHIPPED_PACKAGE)
        for location in (spec.submodule_search_locations or []) if spec else []:
            if os.path.isdir(location):
                return Path(location)
    source_tree = Path(__file__).resolve().parent.parent / "tuned_configs"
    return source_tree if source_tree.is_dir() else None


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _file_key(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size


# File timestamps are coarse (a kernel tick; seconds on some filesystems) and a freed inode
# number is soon reused, so a file rewritten within one tick of our read could keep its key. As
# git does with its index, a file modified this close to the read is re-read until it is older.
_RACY_NS = 1_000_000_000


def load_table(path: str | os.PathLike) -> Table | None:
    """The validated table at ``path``, parsed once per process (re-read when the file's inode,
    mtime or size changes, e.g. after an atomic replace). None if the file is missing or
    unusable; an unusable file (unreadable, not JSON, wrong format version, schema violation)
    logs one warning per file and cause."""
    return _load(os.fspath(path))[0]


def _load(path: str) -> tuple[Table | None, bool]:
    """(load_table's result, whether a file is there that could not be used: it was warned
    about, so lookup's "no table" warning would be a second one for the same cause)."""
    try:
        st = os.stat(path)
    except OSError:
        return None, False
    cached = _tables.get(path)
    if cached is not None and cached[2] and cached[0] == _file_key(st):
        return cached[1], cached[1] is None
    with _lock:  # one parse even when many threads miss at once
        cached = _tables.get(path)
        if cached is not None and cached[2] and cached[0] == _file_key(st):
            return cached[1], cached[1] is None
        key, table, trusted = _read_table(path)
        if key is not None:
            _tables[path] = (key, table, trusted)
    if table is not None and table.skipped:
        _warn_once(
            ("skipped", path),
            f"tuned config table {path}: {len(table.skipped)} entries are not valid today and "
            f"are ignored (first: {table.skipped[0]})",
        )
    return table, table is None


def _read_table(path: str) -> tuple[tuple[int, int, int, int] | None, Table | None, bool]:
    """(the key of the file actually read, its table or None, whether the key can be trusted).
    Called with _lock held, so it warns through _warn_locked."""
    started = time.time_ns()
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())  # the key of what we read, not of a later file
            raw = f.read()
    except OSError as e:
        _warn_locked(
            ("unreadable", path), f"tuned config table {path} cannot be read ({e}); ignored"
        )
        return None, None, False
    key = _file_key(st)
    trusted = st.st_mtime_ns < started - _RACY_NS
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, deep nesting
        _warn_locked(
            ("corrupt", path),
            f"tuned config table {path} is not valid JSON (corrupt or truncated: {e}); ignored",
        )
        return key, None, trusted
    try:
        return key, _table_from_data(path, data), trusted
    except _VersionError as e:
        _warn_locked(
            ("version", path),
            f"tuned config table {path}: {e}; ignored (re-tune with `{TUNE_COMMAND}` or "
            f"upgrade tsdecode)",
        )
    except TableFormatError as e:
        _warn_locked(
            ("schema", path), f"tuned config table {path} violates the format: {e}; ignored"
        )
    except Exception as e:  # noqa: BLE001 - a table must never break a plan
        _warn_locked(
            ("error", path), f"tuned config table {path} cannot be used ({e!r}); ignored"
        )
    return key, None, trusted


def _warn_locked(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _table_from_data(path: str, data: object) -> Table:
    validate_table_data(data)
    entries: dict[str, dict[tuple[int, int], TableEntry]] = {}
    skipped = []
    for key, records in data["entries"].items():
        buckets = {}
        for record in records:
            bucket = (record["batch_size"], record["kv_len"])
            fields = {k: v for k, v in record.items() if k not in ("batch_size", "kv_len")}
            try:
                entry = TableEntry.from_dict(fields)
                _check_tuned_batch_size(bucket, entry)
                buckets[bucket] = entry
            except (ValueError, TypeError) as e:
                skipped.append(f"{key} bucket {bucket}: {e}")
        if buckets:
            entries[key] = buckets
    stale = []
    current_hash = kernel_source_hash()
    if data["kernel_hash"] != current_hash:
        stale.append(
            f"table kernel hash differs (table {data['kernel_hash']}, current {current_hash})"
        )
    current_triton = _triton_version()
    if _major(data["triton_version"]) != _major(current_triton):
        stale.append(
            f"table tuned with triton {data['triton_version']}, running triton {current_triton}"
        )
    return Table(
        path=path,
        device=DeviceInfo.from_dict(data["device"]),
        triton_version=data["triton_version"],
        torch_version=data["torch_version"],
        kernel_hash=data["kernel_hash"],
        tuner_settings=data["tuner_settings"],
        created=data["created"],
        updated=data["updated"],
        entries=entries,
        skipped=tuple(skipped),
        stale=tuple(stale),
    )


# ---------------------------------------------------------------------------------------------
# Lookup
# ---------------------------------------------------------------------------------------------


def _explicit_path(config_dir: str | os.PathLike | None) -> tuple[str | None, str]:
    if config_dir is not None:
        return os.fspath(config_dir), "config_dir argument"
    if _config_path is not None:
        return _config_path, "set_config_path"
    env = os.environ.get(CONFIG_DIR_ENV)
    if env:
        return env, f"${CONFIG_DIR_ENV}"
    return None, ""


def _json_files(folder: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    # Only *.json: lock files, temp files (".name.xxx.tmp") and moved-aside "*.corrupt-<time>"
    # files live beside the tables.
    return [os.path.join(folder, n) for n in sorted(names) if n.endswith(".json") and n[0] != "."]


def _conventional_file(folder: str, name: str) -> str:
    filename = _filenames.get(name)
    if filename is None:
        filename = _filenames[name] = table_filename(name)
    return os.path.join(folder, filename)


def _candidates(
    source: str, origin: str, explicit: bool, info: DeviceInfo | None, trace: list[str] | None,
    warned: list[str],
) -> Iterator[tuple[Table, tuple[str, ...]]]:
    """Tables of one source that match the device, best first, with the notes of the match.

    Known device: exact name (the conventional file name first), then same compute capability
    and SM count (sorted by file name). Unknown device (no CUDA properties; explicit path only):
    every table. An explicit source may be a single file; one that does not exist is warned
    about once. Paths warned about (unusable files, a missing explicit path) go to ``warned``.
    """
    if explicit and not os.path.isdir(source):
        if not os.path.exists(source):
            _warn_once(("no path", source),
                       f"tuned config path {source} ({origin}) does not exist; no table read "
                       "from it")
            warned.append(source)
            if trace is not None:
                trace.append(f"    {source}: does not exist")
            return
        first, files = None, [source]
    else:
        first = _conventional_file(source, info.name) if info is not None else None
        files = None  # listed only if the conventional file does not settle it
    if first is not None:
        table, unusable = _load(first)
        if unusable:
            warned.append(first)
        if table is not None and table.device.name == info.name:
            yield table, _exact_notes(table, info)
        elif trace is not None:
            trace.append(f"    {first}: " + ("absent" if table is None else "another device"))
    if files is None:
        files = [f for f in _json_files(source) if f != first]
    exact, variants = [], []
    for path in files:
        table, unusable = _load(path)
        if unusable:
            warned.append(path)
        if table is None:
            if trace is not None:
                trace.append(f"    {path}: missing or unusable (see warnings)")
        elif info is None:
            exact.append((table, ("device properties unknown: table used without device match",)))
        elif table.device.name == info.name:
            exact.append((table, _exact_notes(table, info)))
        elif (table.device.compute_capability, table.device.sm_count) == (
            info.compute_capability, info.sm_count
        ):
            major, minor = info.compute_capability
            note = (
                f"table for '{table.device.name}' used for '{info.name}' (same compute "
                f"capability {major}.{minor} and {info.sm_count} SMs)"
            )
            variants.append((table, (note,)))
        elif trace is not None:
            trace.append(f"    {path}: for {table.device.describe()}, not this device")
    yield from exact
    for table, notes in variants:
        _warn_once(("variant", table.path, info.name),
                   f"tuned config table {table.path}: {notes[0]}")
        yield table, notes


def _exact_notes(table: Table, info: DeviceInfo) -> tuple[str, ...]:
    if table.device.sm_count == info.sm_count:
        return ()
    note = f"table tuned on {table.device.sm_count} SMs, this '{info.name}' has {info.sm_count}"
    _warn_once(("sm_count", table.path, info.sm_count), f"tuned config table {table.path}: {note}")
    return (note,)


def _sources(explicit: str | None, origin: str, info: DeviceInfo | None) -> Iterator[tuple]:
    """(origin, path, is_explicit) in search order; lazy, so a hit skips the later ones."""
    if explicit is not None:
        yield origin, explicit, True
    if info is not None:  # an unknown device only ever uses tables it was pointed at
        yield "user cache", _user_config_dir(), False
        shipped = shipped_config_dir()
        if shipped is not None:
            yield "shipped", str(shipped), False


def _resolve(
    shape: ProblemShape, device: torch.device | None, config_dir, device_info: DeviceInfo | None,
    trace: list[str] | None,
) -> TableHit | None:
    explicit, origin = _explicit_path(config_dir)
    info = device_info if device_info is not None else _device_override
    if info is None and device is not None and device.type == "cuda":
        info = DeviceInfo.from_torch(device)
    if info is None and explicit is None:
        if trace is not None:
            trace.append(f"  device {device} has no CUDA properties and no config path was "
                         "given: no table searched")
        return None
    key = problem_class_key(shape)
    bucket = bucket_of(shape.batch_size, shape.max_kv_len)
    where = f"({shape.batch_size}, {shape.max_kv_len})"
    matched = False
    searched: list[str] = []
    warned: list[str] = []
    without_class: list[tuple[Table, tuple[str, ...]]] = []
    for origin, source, is_explicit in _sources(explicit, origin, info):
        searched.append(source)
        if trace is not None:
            trace.append(f"  {origin}: {source}")
        for table, match_notes in _candidates(source, origin, is_explicit, info, trace, warned):
            matched = True
            for note in table.stale:
                _warn_once(
                    ("stale", table.path, note.split(" (")[0]),
                    f"tuned config table {table.path}: {note}; re-tune with `{TUNE_COMMAND}`",
                )
            hit = _hit(table, key, bucket, where, match_notes, trace)
            if hit is not None:
                return hit
            if trace is not None:
                trace.append(f"    {table.path}: matches the device, no entry for this class")
            without_class.append((table, match_notes))
    sibling = sibling_class_key(key)
    if sibling and without_class and trace is not None:
        trace.append(f"  no matching table holds this class; its float16/bfloat16 sibling {sibling}:")
    for table, match_notes in without_class if sibling else ():
        # Every matching table lacks the class itself: the other 16-bit dtype's entries.
        note = f"entries of class {sibling} (float16 and bfloat16 share kernel and configs)"
        hit = _hit(table, sibling, bucket, where, (note,) + match_notes, trace)
        if hit is not None:
            return hit
    if not matched and not warned:  # else the cause has had its one warning
        if info is not None:
            _warn_once(
                ("missing", info.name),
                f"no tuned config table for GPU {info.describe()} in {', '.join(searched)}; "
                f"using the heuristic config. Tune it with `{TUNE_COMMAND}` (writes "
                f"{_conventional_file(_user_config_dir(), info.name)})",
            )
        else:
            _warn_once(("missing", explicit),
                       f"no usable tuned config table in {explicit}; using the heuristic config")
    return None


def _hit(table: Table, key: str, bucket: tuple[int, int], where: str, notes: tuple[str, ...],
         trace: list[str] | None) -> TableHit | None:
    """``table``'s entry of class ``key`` nearest to ``bucket`` (None: no entry of the class)."""
    best = table.nearest_bucket(key, bucket)
    if best is None:
        return None
    notes = notes + table.stale
    if best != bucket:
        notes = (f"nearest bucket {best} for {where}",) + notes
    entry = table.entries[key][best]
    if trace is not None:
        trace.append(f"    {table.path}: {key} bucket {best} -> hit")
    return TableHit(entry.kernel_config, table.path, best, notes, entry)


def lookup(
    shape: ProblemShape,
    device: torch.device | str | None,
    *,
    config_dir: str | os.PathLike | None = None,
    device_info: DeviceInfo | None = None,
) -> TableHit | None:
    """The tuned table entry for ``shape`` on ``device``, or None (use the heuristic).

    Parameters
    ----------
    shape : the plan's ProblemShape.
    device : the execution device. A CUDA device is matched by its properties; any other device
        (CPU / Triton interpreter) has none, so without ``device_info`` (or
        ``set_device_info_override``) only an explicit path is searched and every table in it
        matches.
    config_dir : a table file or folder searched first; overrides ``set_config_path`` and
        ``$TSDECODE_CONFIG_DIR``.
    device_info : match tables as if on this device.

    The returned config is not fitted to the shape: ``configs.select_config`` applies
    ``fit_config`` and reports ``notes`` plus its changes as ``SelectedConfig.adjustments``.
    Never raises for a missing or bad table; each cause logs one warning per process.
    """
    if device is not None and not isinstance(device, torch.device):
        device = torch.device(device)
    return _resolve(shape, device, config_dir, device_info, None)


# ---------------------------------------------------------------------------------------------
# Writing (the tuner)
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive flock on ``<path>.lock``: serialises read-merge-write between processes. The
    lock file is never deleted (deleting it would let two writers lock different inodes)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(f"{path}.lock", "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _move_aside(path: Path, tag: str) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = path.with_name(f"{path.name}.{tag}-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{tag}-{stamp}-{n}")
    os.replace(path, target)
    return target


def _atomic_write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write to a temp file in the same folder, fsync, then os.replace: readers see the old file
    or the new one, never a partial one."""
    text = json.dumps(data, indent=1) + "\n"
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


def _check_new_entries(entries: Mapping[str, Mapping[tuple[int, int], TableEntry]]) -> None:
    for key, buckets in entries.items():
        if not isinstance(key, str) or not _CLASS_KEY_RE.fullmatch(key):
            raise ValueError(f"not a problem class key (see tables.problem_class_key): {key!r}")
        for bucket, entry in buckets.items():
            if not (isinstance(bucket, tuple) and len(bucket) == 2 and all(map(_is_pow2, bucket))):
                raise ValueError(f"{key}: bucket must be (batch_size, kv_len) powers of two "
                                 f"(see tables.bucket_of), got {bucket!r}")
            if not isinstance(entry, TableEntry):
                raise TypeError(
                    f"{key} {bucket}: expected a TableEntry, got {type(entry).__name__}"
                )
            try:
                _check_tuned_batch_size(bucket, entry)
            except ValueError as e:
                raise ValueError(f"{key} {bucket}: {e}") from None


def _existing_for_merge(path: Path, device: DeviceInfo) -> tuple[dict, str | None]:
    """(entries, created) of the table at ``path`` to merge into; an unusable file is moved
    aside, a table tuned for another kernel or triton major is moved aside as stale."""
    if not path.exists():
        return {}, None
    try:
        data = json.loads(path.read_bytes())
        table = _table_from_data(str(path), data)
    # ValueError: JSON, UTF-8, the format; ArithmeticError: a number no float can hold
    except (OSError, ValueError, RecursionError, ArithmeticError) as e:
        moved = _move_aside(path, "corrupt")
        logger.warning(f"tuned config table {path} is unusable ({e}); moved aside to {moved} "
                       "and written afresh")
        return {}, None
    if table.device.name != device.name:
        raise ValueError(f"{path} holds the table of '{table.device.name}', not of "
                         f"'{device.name}': refusing to merge (use tables.table_filename)")
    if table.stale:
        moved = _move_aside(path, "stale")
        logger.warning(f"tuned config table {path}: {'; '.join(table.stale)}; its entries are "
                       f"not merged (moved aside to {moved})")
        return {}, None
    entries = {k: dict(v) for k, v in table.entries.items()}
    return entries, table.created


def merge_entries(
    path: str | os.PathLike,
    device: DeviceInfo,
    entries: Mapping[str, Mapping[tuple[int, int], TableEntry]],
    tuner_settings: Mapping[str, Any],
) -> None:
    """Merge tuned entries into the table at ``path`` (created if missing).

    Parameters
    ----------
    path : the table file, normally ``user_config_dir() / table_filename(device.name)``.
    device : the GPU the entries were measured on.
    entries : problem class key -> {bucket_of(batch_size, kv_len): TableEntry}; each replaces
        the existing entry of the same class and bucket, all others are kept.
    tuner_settings : JSON-serialisable settings of this tuner run (stored as the table's
        ``tuner_settings``, replacing the previous run's).

    Holds an exclusive lock on ``<path>.lock`` for the read-merge-write, so concurrent tuner
    processes lose nothing, and replaces the file atomically, so readers never see a partial
    table. An existing file that is unusable is moved to ``<name>.corrupt-<time>``; one tuned
    for another kernel source or triton major version to ``<name>.stale-<time>`` (its entries
    are dropped, with a warning). Raises ValueError if the file belongs to another GPU.
    """
    if not isinstance(device, DeviceInfo):
        raise TypeError(f"device must be a tables.DeviceInfo, got {type(device).__name__}")
    _check_new_entries(entries)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path):
        merged, created = _existing_for_merge(path, device)
        for key, buckets in entries.items():
            merged.setdefault(key, {}).update(buckets)
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        data = {
            "format_version": FORMAT_VERSION,
            "device": device.to_dict(),
            "triton_version": _triton_version(),
            "torch_version": torch.__version__,
            "kernel_hash": kernel_source_hash(),
            "tuner_settings": dict(tuner_settings),
            "created": created or now,
            "updated": now,
            "entries": {
                key: [
                    {"batch_size": b, "kv_len": n, **merged[key][(b, n)].to_dict()}
                    for b, n in sorted(merged[key])
                ]
                for key in sorted(merged)
            },
        }
        validate_table_data(json.loads(json.dumps(data)))  # never write what load would reject
        _atomic_write_json(path, data)


# ---------------------------------------------------------------------------------------------
# explain and the lookup benchmark
# ---------------------------------------------------------------------------------------------


def explain(
    batch_size: int,
    kv_len: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int = 16,
    *,
    seq_len_q: int = 1,
    packed: bool = False,
    mask_type: str = "dense",
    window_left: int = -1,
    q_dtype: torch.dtype = torch.bfloat16,
    kv_dtype: torch.dtype | None = None,
    o_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    config_dir: str | os.PathLike | None = None,
    device_info: DeviceInfo | None = None,
) -> str:
    """Which table file, bucket and config a plan of this shape gets, and why (a report string).

    Follows exactly the selection ``plan`` makes without an explicit config and with equal (or
    bound) lengths: ``lookup`` (tables searched, in order, and why each was passed over), then
    ``configs.config_from_table_hit`` (split scaling, off-bucket winners, ``fit_config``).
    ``seq_len_q`` is the fixed SQ, or the packed capacity (max_seq_len_q) when ``packed``.
    """
    from . import validation as V

    V.validate_heads(num_qo_heads, num_kv_heads, head_dim, page_size)
    for name, value in (("batch_size", batch_size), ("kv_len", kv_len), ("seq_len_q", seq_len_q)):
        V.require_int(name, value, minimum=1)
    q_dtype, kv_dtype, o_dtype = V.resolve_dtypes(q_dtype, kv_dtype, o_dtype)
    mask_kind = "windowed" if window_left >= 0 else mask_type
    if mask_kind not in ("dense", "causal", "windowed"):
        raise ValueError(f"mask_type must be 'dense' or 'causal', got {mask_type!r}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    shape = ProblemShape(
        batch_size=batch_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, max_kv_len=kv_len, max_seq_len_q=seq_len_q,
        packed=packed, mask_kind=mask_kind, q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
        window_left=window_left,
    )
    trace: list[str] = []
    hit = _resolve(shape, device, config_dir, device_info, trace)
    info = device_info or _device_override
    if info is None and device.type == "cuda":
        info = DeviceInfo.from_torch(device)
    lines = [
        f"shape: batch_size={batch_size} kv_len={kv_len} Hq={num_qo_heads} Hkv={num_kv_heads} "
        f"D={head_dim} P={page_size} SQ={seq_len_q}{' packed' if packed else ''} {mask_kind}",
        f"class: {problem_class_key(shape)}",
        f"bucket: {bucket_of(batch_size, kv_len)}",
        f"device: {device}" + (f" = {info.describe()}" if info else " (no device properties)"),
        "search:",
        *trace,
    ]
    selected = config_from_table_hit(shape, hit, device_num_sms(device),
                                     device_shared_memory_per_sm(device))
    if selected.source == "table":
        e = hit.entry
        lines.append(f"source: table {hit.table_path} bucket {hit.bucket}")
        if e is not None:
            copy = f", {e.fraction_of_copy:.0%} of copy" if e.fraction_of_copy is not None else ""
            lines.append(
                f"measured: {e.time_us:.2f} us, {e.bandwidth_gbs:.0f} GB/s{copy}; heuristic "
                f"default {e.default_config} {e.default_time_us:.2f} us, "
                f"{e.default_bandwidth_gbs:.0f} GB/s ({e.speedup:.2f}x)"
            )
    elif hit is not None:
        lines.append(f"source: heuristic (the table entry of bucket {hit.bucket} is not used here)")
    else:
        lines.append("source: heuristic (no table entry found)")
    lines.append(f"config: {selected.kernel_config}")
    lines.extend(f"note: {n}" for n in selected.adjustments)
    return "\n".join(lines)


def bench_lookup(iterations: int = 20000, *, verbose: bool = True) -> dict[str, float]:
    """Microseconds per ``lookup`` call: exact bucket hit, nearest-bucket hit and a miss (class
    absent: every source searched, heuristic next), against a 16-class x 64-bucket table in a
    temporary folder; and a CPU lookup with no path (the default when there is no GPU)."""
    info = DeviceInfo("Bench GPU", 132, (9, 0), 141 << 30)
    cfg = KernelConfig()
    entry = TableEntry(cfg, 10.0, 3000.0, 0.7, cfg, 12.0, 2500.0)
    base = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    entries = {}
    for d in (64, 128):
        for p in (16, 32):
            for mask in ("dense", "causal"):
                for sq in (1, 4):
                    s = ProblemShape(batch_size=1, max_kv_len=1, **{**base, "head_dim": d,
                                     "page_size": p}, max_seq_len_q=sq, mask_kind=mask)
                    entries[problem_class_key(s)] = {
                        (1 << i, 1 << (6 + j)): entry for i in range(8) for j in range(8)
                    }
    shapes = {
        "exact": ProblemShape(batch_size=64, max_kv_len=4096, **base),
        "nearest": ProblemShape(batch_size=1000, max_kv_len=100000, **base),
        "miss": ProblemShape(batch_size=64, max_kv_len=4096, **{**base, "head_dim": 256}),
    }
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / table_filename(info.name)
        merge_entries(path, info, entries, {"bench": True})
        past = time.time() - 60  # a table written a while ago (a fresh one is re-read: _RACY_NS)
        os.utime(path, (past, past))
        for name, shape in shapes.items():
            lookup(shape, None, config_dir=folder, device_info=info)  # parse + warn outside timing
            t0 = time.perf_counter()
            for _ in range(iterations):
                lookup(shape, None, config_dir=folder, device_info=info)
            results[name] = (time.perf_counter() - t0) / iterations * 1e6
    cpu, shape = torch.device("cpu"), shapes["exact"]
    if _config_path is None and not os.environ.get(CONFIG_DIR_ENV) and _device_override is None:
        t0 = time.perf_counter()
        for _ in range(iterations):
            lookup(shape, cpu)
        results["cpu_no_path"] = (time.perf_counter() - t0) / iterations * 1e6
    if verbose:
        print("lookup us/call: " + ", ".join(f"{k} {v:.1f}" for k, v in results.items()))
    return results
