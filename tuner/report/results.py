"""The format of a report's ``results.csv``: its columns, writing and reading it, and the
views of its rows (per shape and implementation) that the pages and the exit code share."""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import io
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

from tsdecode.config.tables import user_tables_dir
from tsdecode.device import DeviceProperties

from ..files import atomic_write_text
from ..grids import ShapeSpec
from . import impls as I

SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(ShapeSpec))
BASE_COLUMNS = (
    ("shape",) + SPEC_FIELDS + (
        "impl", "impl_kind", "status", "reason", "timing_method", "timing_note", "copies", "replays",
        "time_us_median", "time_us_min", "time_us_max", "sm_clock_mhz", "bytes_moved", "bandwidth_gbs",
        "copy_bandwidth_gbs", "fraction_of_copy", "speedup_vs_heuristic",
    )
)
TAIL_COLUMNS = (
    "rel_error", "tolerance", "error_ok", "checked_requests", "config", "config_source",
    "config_note", "impl_note", "device", "sm_count", "compute_capability", "driver", "cuda_version",
    "torch_version",
    "triton_version", "tsdecode_version", "date",
)
INT_COLUMNS = {"batch_size", "kv_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
               "seq_len_q", "window_left", "copies", "replays", "bytes_moved", "checked_requests",
               "sm_count"}
BOOL_COLUMNS = {"packed", "ragged", "error_ok"}
FLOAT_COLUMNS = {"time_us_median", "time_us_min", "time_us_max", "sm_clock_mhz", "bandwidth_gbs",
                 "copy_bandwidth_gbs", "fraction_of_copy", "rel_error", "tolerance"}
# What re-rendering, comparing and the exit code read from a CSV (the rest is optional). Cells
# of CELL_COLUMNS are never empty; the others are empty where a row did not run.
CELL_COLUMNS = ("shape",) + SPEC_FIELDS + ("impl", "impl_kind", "status")
REQUIRED_COLUMNS = CELL_COLUMNS + ("time_us_median", "time_us_min", "time_us_max", "bandwidth_gbs",
                                   "copy_bandwidth_gbs", "fraction_of_copy")
TEXT_COLUMNS = ("reason", "timing_note", "config_note", "impl_note", "config_source")
# Columns of reports written before they took the names tsdecode.device and the tables use.
RENAMED_COLUMNS = {"gpu": "device", "num_sms": "sm_count", "achieved_gbs": "bandwidth_gbs",
                   "frac_copy_bw": "fraction_of_copy", "copy_bw_gbs": "copy_bandwidth_gbs"}
CUDA_GRAPH = "cuda_graph"
CUDA_EAGER = "cuda_events_eager"
INTERPRETER = "wall_clock_interpreter"
MEANINGLESS = "TIMINGS ARE MEANINGLESS: wall clock of the Triton interpreter on CPU"
RUNTIME = "tsdecode"  # per shape: the tuned row when it ran, else the heuristic row


def describe_device(meta: dict) -> str:
    """A run's device as ``DeviceProperties.describe`` words it (CPU cores or SMs)."""
    try:
        major, minor = (int(x) for x in str(meta.get("compute_capability")).split("."))
        return DeviceProperties(meta["device"], int(meta["sm_count"]), (major, minor)).describe()
    except (TypeError, ValueError, KeyError):  # a CSV without these columns
        return str(meta.get("device") or "unknown device")


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def default_report_dir(kind: str) -> Path:
    """A new folder ``<user cache>/reports/<kind>/<UTC time>/`` (never the working directory: a
    report run from a checkout must not write into it)."""
    root = user_tables_dir().parent / "reports" / kind
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    out, n = root / stamp, 1
    while out.exists():
        n += 1
        out = root / f"{stamp}-{n}"
    return out


def _impl_order(names: Iterable[str]) -> list[str]:
    """Registry order first, then unknown names (from a CSV) in first-seen order."""
    known = list(I.IMPLS)
    seen = list(dict.fromkeys(names))
    return sorted(seen, key=lambda n: (known.index(n) if n in known else len(known), seen.index(n)))


def baseline_names(rows: Iterable[dict]) -> list[str]:
    """Non-tsdecode implementations (each gets a speedup_vs_<name> column)."""
    return _impl_order(r["impl"] for r in rows if r.get("impl_kind") != "tsdecode")


def add_speedups(rows: list[dict]) -> list[str]:
    """Fill speedup_vs_heuristic and speedup_vs_<baseline> (= that impl's time / this row's time)
    for rows that ran; returns the speedup column names."""
    baselines = baseline_names(rows)
    by_shape: dict[str, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r.get("status") == "ok":
            by_shape[r["shape"]][r["impl"]] = r["time_us_median"]
    cols = ["speedup_vs_heuristic"] + [f"speedup_vs_{b}" for b in baselines]
    for r in rows:
        times = by_shape.get(r["shape"], {})
        mine = r.get("time_us_median") if r.get("status") == "ok" else None
        for name, col in zip(["heuristic"] + baselines, cols):
            other = times.get(name)
            r[col] = other / mine if mine and other else None
    return cols


# ---------------------------------------------------------------------------------------------
# CSV


def columns_for(rows: Sequence[dict]) -> list[str]:
    speedups = [f"speedup_vs_{b}" for b in baseline_names(rows)]
    return list(BASE_COLUMNS) + speedups + list(TAIL_COLUMNS)


def _csv_value(v: object) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else ("nan" if math.isnan(v) else f"{v:.9g}")
    return str(v)


def write_csv(rows: Sequence[dict], path: Path) -> None:
    """Write ``rows`` atomically: a run killed while writing leaves the previous file whole."""
    cols = columns_for(rows)
    text = io.StringIO(newline="")
    w = csv.writer(text)
    w.writerow(cols)
    for r in rows:
        w.writerow([_csv_value(r.get(c)) for c in cols])
    atomic_write_text(Path(path), text.getvalue())


STATUSES = ("ok", "skipped", "failed")
INTEGER = re.compile(r"-?[0-9]+")
NUMBER = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?|[-+]?(inf|nan)", re.IGNORECASE)


def _cell(k: str, v: str):
    """A CSV cell as its column's type, written as write_csv writes it; ValueError otherwise
    (Python's int() and float() would also take '1_0' and ' 8 ')."""
    if k in INT_COLUMNS:
        if not INTEGER.fullmatch(v):
            raise ValueError(f"expected an integer, got {v!r}")
        return int(v)
    if k in FLOAT_COLUMNS or k.startswith("speedup_vs_"):
        if not NUMBER.fullmatch(v):
            raise ValueError(f"expected a number, got {v!r}")
        return float(v)
    if k == "status" and v not in STATUSES:
        raise ValueError(f"expected one of {list(STATUSES)}, got {v!r}")
    if k == "impl_kind" and v not in I.KINDS:
        raise ValueError(f"expected one of {list(I.KINDS)}, got {v!r}")
    if k in BOOL_COLUMNS:
        low = v.lower()
        if low not in ("true", "1", "yes", "false", "0", "no"):
            raise ValueError(f"expected true or false, got {v!r}")
        return low in ("true", "1", "yes")
    return v


def read_csv(path: str | Path) -> list[dict]:
    """Rows of a results.csv with typed values (None for empty cells).

    Raises ValueError for a file that is not a report CSV: missing REQUIRED_COLUMNS (all named),
    a row with more or fewer cells than columns, an empty cell of CELL_COLUMNS, a cell not of its
    column's type or values, a shape cell its fields do not name, or a (shape, impl) pair twice
    (line and column named).
    An empty or absent error_ok is derived as rel_error <= tolerance, as the benchmark does
    (None when either is unknown).
    """
    rows = []
    seen: dict[tuple[str, str], int] = {}
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a BOM, as spreadsheets write
            reader = csv.DictReader(f)
            header = [RENAMED_COLUMNS.get(c, c) for c in reader.fieldnames or []]
            if not header:
                raise ValueError(f"{path}: empty file, not a report CSV")
            missing = [c for c in REQUIRED_COLUMNS if c not in header]
            if missing:
                raise ValueError(f"{path}: not a report CSV (missing column(s) {missing})")
            for raw in reader:
                where = f"{path}, line {reader.line_num}"
                row: dict = {}
                for k, v in raw.items():
                    if k is None:  # more cells than the header has columns
                        raise ValueError(f"{where}: more cells than columns")
                    k = RENAMED_COLUMNS.get(k, k)
                    if v is None:  # fewer cells than the header has columns
                        raise ValueError(f"{where}: fewer cells than columns (a file cut short?)")
                    if v == "":
                        row[k] = "" if k in TEXT_COLUMNS else None
                        continue
                    try:
                        row[k] = _cell(k, v)
                    except ValueError as e:
                        raise ValueError(f"{where}: column {k}: {e}") from None
                empty = [c for c in CELL_COLUMNS if row.get(c) is None]
                if empty:
                    raise ValueError(f"{where}: empty cell(s) in column(s) {empty}")
                try:
                    name = spec_of(row).name
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
                if name != row["shape"]:
                    raise ValueError(f"{where}: the shape cell {row['shape']!r} disagrees with the row's fields, "
                                     f"which name {name!r}")
                first = seen.setdefault((row["shape"], row["impl"]), reader.line_num)
                if first != reader.line_num:
                    raise ValueError(f"{where}: {row['shape']} {row['impl']} again (first on line {first})")
                if row.get("error_ok") is None:
                    err, tol = row.get("rel_error"), row.get("tolerance")
                    row["error_ok"] = None if err is None or tol is None else bool(err <= tol)
                rows.append(row)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text CSV ({e})") from None
    except csv.Error as e:  # e.g. a quote never closed: a field past the csv module's limit
        raise ValueError(f"{path}: not a report CSV ({e})") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: a folder, not a report CSV") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


# ---------------------------------------------------------------------------------------------
# Views of the rows


def spec_of(row: dict) -> ShapeSpec:
    return ShapeSpec(**{f: row[f] for f in SPEC_FIELDS})


def family_of(spec: ShapeSpec) -> str:
    """Everything but batch size and K/V length, as words: 'H32x8 D128 P16 bfloat16'."""
    return " ".join(spec.name.split("_")[2:])


def finite(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def positive(v: object) -> bool:
    return finite(v) and v > 0


def ok(row: dict | None) -> bool:
    """The row ran and has a usable time (a positive finite median: a CSV may hold nan, inf or
    worse, which plots cannot show; such rows are listed under "Not run" as not plotted)."""
    return bool(row) and row.get("status") == "ok" and positive(row.get("time_us_median"))


class Table:
    """Rows indexed by shape and implementation, with the 'tsdecode' (runtime) view."""

    def __init__(self, rows: Sequence[dict]) -> None:
        self.rows = list(rows)
        self.by: dict[str, dict[str, dict]] = defaultdict(dict)
        self.specs: dict[str, ShapeSpec] = {}
        for r in self.rows:
            self.by[r["shape"]][r["impl"]] = r
            self.specs.setdefault(r["shape"], spec_of(r))
        self.impls = _impl_order(r["impl"] for r in self.rows)
        self.baselines = baseline_names(self.rows)
        first = self.rows[0]
        self.meta = {k: first.get(k) for k in ("device", "sm_count", "compute_capability", "driver", "cuda_version",
                                                "torch_version", "triton_version", "tsdecode_version", "date",
                                                "copy_bandwidth_gbs")}
        self.meta["description"] = describe_device(self.meta)
        self.interpreter = any(r.get("timing_method") == INTERPRETER for r in self.rows)

    def runtime(self, shape: str) -> dict | None:
        """What the runtime runs: the tuned row if it ran (table entry), else the heuristic row."""
        impls = self.by[shape]
        for name in ("tuned", "heuristic"):
            if ok(impls.get(name)):
                return impls[name]
        return None

    def families(self) -> dict[str, list[str]]:
        fams: dict[str, list[str]] = defaultdict(list)
        for shape, spec in self.specs.items():
            fams[family_of(spec)].append(shape)
        return fams

    def time(self, shape: str, impl: str) -> float | None:
        r = self.runtime(shape) if impl == RUNTIME else self.by[shape].get(impl)
        return r["time_us_median"] if ok(r) else None
