"""The tuned tables' file format (version ``FORMAT_VERSION``): one bucket's entry
(``TableEntry``) and the checks a decoded table must pass (``validate_table_data``), each failure
a ``TableFormatError`` naming the field. ``tables`` reads files with them; the tuner's writer
checks what it writes with them."""

from __future__ import annotations

import datetime
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .space import MASK_KINDS, KernelConfig

FORMAT_VERSION = 1

_CLASS_KEY_RE = re.compile(
    r"q=[a-z0-9_]+,kv=[a-z0-9_]+,o=[a-z0-9_]+,d=[1-9][0-9]*,g=[1-9][0-9]*,hkv=[1-9][0-9]*,"
    r"p=[1-9][0-9]*,sq=(1|2|4|8|16\+|packed),mask=(" + "|".join(MASK_KINDS) + ")")


# --- entries -------------------------------------------------------------------------------------

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
