"""Performance reports: benchmark a shape grid into ``results.csv`` and a self-contained
``report.html``; re-render from a CSV (``--from-csv``) or compare two CSVs (``--compare``).

Entry points: ``tsdecode-tune report ...`` and ``python -m tuner.report ...``. Without ``--out``
a report goes to ``<user cache>/reports/<device>/<UTC time>/``. See docs/reports.md.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as dt
import gc
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

import torch

from tsdecode import KernelConfig
from tsdecode.config.tables import user_config_dir
from tsdecode.device import DeviceProperties, device_properties
from tsdecode.device import INTERPRETER as INTERPRETER_ACTIVE

from . import html as H
from . import impls as I
from . import measure
from .arguments import Parser, UsageError, nonnegative_float, positive_float, positive_int
from .grids import ShapeSpec, add_grid_arguments, specs_from_args
from .measure import geomean
from .space import config_text

SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(ShapeSpec))
BASE_COLUMNS = (
    ("shape",) + SPEC_FIELDS + (
        "impl", "impl_kind", "status", "reason", "timing_method", "timing_note", "copies", "replays",
        "time_us_median", "time_us_min", "time_us_max", "bytes_moved", "achieved_gbs",
        "copy_bw_gbs", "frac_copy_bw", "speedup_vs_heuristic",
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
FLOAT_COLUMNS = {"time_us_median", "time_us_min", "time_us_max", "achieved_gbs", "copy_bw_gbs",
                 "frac_copy_bw", "rel_error", "tolerance"}
# What re-rendering, comparing and the exit code read from a CSV (the rest is optional). Cells
# of CELL_COLUMNS are never empty; the others are empty where a row did not run.
CELL_COLUMNS = ("shape",) + SPEC_FIELDS + ("impl", "impl_kind", "status")
REQUIRED_COLUMNS = CELL_COLUMNS + ("time_us_median", "time_us_min", "time_us_max", "achieved_gbs",
                                   "copy_bw_gbs", "frac_copy_bw")
TEXT_COLUMNS = ("reason", "timing_note", "config_note", "impl_note", "config_source")
# Columns of reports written before they took the names tsdecode.device uses.
RENAMED_COLUMNS = {"gpu": "device", "num_sms": "sm_count"}
CUDA_GRAPH = "cuda_graph"
CUDA_EAGER = "cuda_events_eager"
INTERPRETER = "wall_clock_interpreter"
MEANINGLESS = "TIMINGS ARE MEANINGLESS: wall clock of the Triton interpreter on CPU"
GOOD_FRACTION = 0.8  # "near the roofline": 80% of the measured copy bandwidth
RUNTIME = "tsdecode"  # per shape: the tuned row when it ran, else the heuristic row
IMPL_COLORS = {RUNTIME: "#4e79a7", "tuned": "#4e79a7", "heuristic": "#a0cbe8",
               "torch_sdpa": "#f28e2b", "flex_attention": "#59a14f", "flashinfer": "#e15759"}


# ---------------------------------------------------------------------------------------------
# Arguments


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tsdecode-tune report`` (and ``python -m tuner.report``)."""
    add_grid_arguments(parser)
    g = parser.add_argument_group("report")
    g.add_argument("--out", default=None,
                   help="output folder (default: <user cache>/reports/<device>/<UTC time>/, compare: "
                        "<user cache>/reports/compare/<UTC time>/; --from-csv: the CSV's folder)")
    g.add_argument("--filter", default=None, metavar="REGEX",
                   help="keep only grid shapes whose name matches (re.search), e.g. 'B1_|L32768'")
    g.add_argument("--impls", default="all",
                   help=f"comma-separated implementations (default all): {', '.join(I.IMPLS)}")
    g.add_argument("--device", default=None, help="cuda (default when available) or cpu (interpreter)")
    g.add_argument("--replay-ms", type=positive_float, default=80.0,
                   help="CUDA-graph replay time per measurement (default %(default)s)")
    g.add_argument("--cpu-repeats", type=positive_int, default=1,
                   help="timed calls per case on CPU (default %(default)s)")
    g.add_argument("--check-requests", type=positive_int, default=2,
                   help="requests compared with the float64 reference per shape (the first N, at least 1; "
                        "default %(default)s)")
    g.add_argument("--copy-gib", type=positive_float, default=2.0,
                   help="buffer size of the copy-bandwidth test in GiB (default %(default)s)")
    g.add_argument("--budget-s", type=nonnegative_float, default=None, metavar="SECONDS",
                   help="start no new shape after this many seconds (the rest: skipped rows)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default %(default)s)")
    g.add_argument("--title", default=None, help="page title")
    g.add_argument("--from-csv", default=None, metavar="RESULTS.csv",
                   help="re-render report.html from an existing results.csv (no benchmarking)")
    g.add_argument("--compare", nargs=2, default=None, metavar=("A.csv", "B.csv"),
                   help="render compare.html for the shapes two results.csv files share")


def _parse_impls(text: str) -> list[I.Impl]:
    if text.strip() in ("", "all"):
        return list(I.IMPLS.values())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in I.IMPLS]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; registered: {list(I.IMPLS)}")
    return [I.IMPLS[n] for n in names]


# ---------------------------------------------------------------------------------------------
# Environment


def environment(device: torch.device) -> dict:
    """The columns every row of a run shares: the device (``tsdecode.device``) and the versions."""
    import triton

    import tsdecode

    props = device_properties(device)
    driver = "n/a"
    if device.type == "cuda":
        driver = _driver_version(device) or (f"CUDA {torch.version.cuda}" if torch.version.cuda else "n/a")
    return {
        "device": props.name, "sm_count": props.sm_count,
        "compute_capability": "{}.{}".format(*props.compute_capability), "driver": driver,
        "torch_version": torch.__version__, "triton_version": triton.__version__,
        "tsdecode_version": getattr(tsdecode, "__version__", "?"), "cuda_version": torch.version.cuda or "n/a",
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
    }


def describe_device(meta: dict) -> str:
    """A run's device as ``DeviceProperties.describe`` words it (CPU cores or SMs)."""
    try:
        major, minor = (int(x) for x in str(meta.get("compute_capability")).split("."))
        return DeviceProperties(meta["device"], int(meta["sm_count"]), (major, minor)).describe()
    except (TypeError, ValueError, KeyError):  # a CSV without these columns
        return str(meta.get("device") or "unknown device")


def _driver_version(device: torch.device) -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(index)],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip()
    return text if out.returncode == 0 and text else None


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def default_report_dir(kind: str) -> Path:
    """A new folder ``<user cache>/reports/<kind>/<UTC time>/`` (never the working directory: a
    report run from a checkout must not write into it)."""
    root = user_config_dir().parent / "reports" / kind
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    out, n = root / stamp, 1
    while out.exists():
        n += 1
        out = root / f"{stamp}-{n}"
    return out




# ---------------------------------------------------------------------------------------------
# Benchmarking


@dataclasses.dataclass
class Options:
    device: torch.device
    replay_ms: float = 80.0
    cpu_repeats: int = 1
    check_requests: int = 2
    seed: int = 0


def _time(calls: Sequence, opts: Options) -> tuple[list[float], str, str]:
    """(per-call times in us, timing_method, timing_note)."""
    if opts.device.type != "cuda":
        return measure.wall_times_us(calls[0], max(1, opts.cpu_repeats)), INTERPRETER, MEANINGLESS
    try:
        return measure.graph_times_us(calls, replay_ms=opts.replay_ms), CUDA_GRAPH, ""
    except Exception as e:  # not capturable: time eagerly, launch gaps included
        torch.cuda.synchronize()
        note = f"CUDA-graph capture failed ({type(e).__name__}: {_first_line(e)}); eager timing"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times: list[float] = []
        deadline = time.perf_counter() + opts.replay_ms / 1e3
        while len(times) < 5 or time.perf_counter() < deadline:
            start.record()
            for call in calls:
                call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / len(calls))
        return times, CUDA_EAGER, note


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:limit]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except RuntimeError:  # a broken context: the next launch fails and is recorded
            pass


def benchmark_shape(spec: ShapeSpec, impls: Sequence[I.Impl], opts: Options, env: dict,
                    copy_bw: float, log=print) -> list[dict]:
    """One row per implementation for ``spec`` (speedup columns filled by ``add_speedups``)."""
    cuda = opts.device.type == "cuda"
    copies = measure.num_copies(spec) if cuda else 1
    inputs = measure.make_inputs(spec, opts.device, copies=copies, seed=opts.seed)
    first = inputs[0]
    total_q = first.q.shape[0] if spec.packed else spec.batch_size * spec.seq_len_q
    nbytes = measure.bytes_moved(spec, first.seq_lens.tolist(), total_q, measure.input_q_lens(first))
    ref, stop, checked = measure.reference_rows(spec, first, opts.check_requests)
    tol = measure.tolerance(spec)
    rows = []
    no_table = None
    for impl in impls:
        row = {"shape": spec.name, **spec.to_dict(), "impl": impl.name, "impl_kind": impl.kind,
               "copies": copies, "bytes_moved": nbytes, "copy_bw_gbs": copy_bw, "tolerance": tol,
               "checked_requests": checked, **env,
               "timing_method": CUDA_GRAPH if cuda else INTERPRETER,
               "timing_note": "" if cuda else MEANINGLESS}
        t0 = time.perf_counter()
        calls = None
        try:
            calls = [impl.factory(spec, inp) for inp in inputs]
            for inp in inputs:
                inp.out.fill_(float("nan"))  # a call that writes nothing fails the check
            times, method, note = _time(calls, opts)
            err = measure.relative_error(first.out[:stop], ref)
            row.update(
                status="ok", timing_method=method, timing_note=note, replays=len(times),
                time_us_median=statistics.median(times), time_us_min=min(times),
                time_us_max=max(times), rel_error=err, error_ok=bool(err <= tol),
            )
            t = row["time_us_median"]
            row["achieved_gbs"] = nbytes / (t * 1e-6) / 1e9
            row["frac_copy_bw"] = row["achieved_gbs"] / copy_bw
            c = calls[0]
            if getattr(c, "config", None) is not None:
                row["config"] = json.dumps(c.config, sort_keys=True)
            row["config_source"] = getattr(c, "config_source", "")
            row["config_note"] = getattr(c, "config_note", "")
            row["impl_note"] = getattr(c, "note", "")
            msg = (f"{t:10.1f} us {row['achieved_gbs']:8.0f} GB/s {100 * row['frac_copy_bw']:5.1f}% "
                   f"err {err:.1e}{'' if row['error_ok'] else ' (ABOVE TOLERANCE)'}")
        except I.NoTableEntry as e:
            row.update(status="skipped", reason=str(e))
            no_table = row
            msg = "no tuned table entry: the runtime uses the heuristic"
        except I.Unsupported as e:
            row.update(status="skipped", reason=str(e))
            msg = f"skipped: {e}"
        except Exception as e:  # keep going: one broken implementation must not end the report
            row.update(status="failed", reason=f"{type(e).__name__}: {_first_line(e)}")
            msg = f"FAILED: {row['reason']}"
        del calls
        _free(opts.device)
        rows.append(row)
        log(f"    {impl.name:<15} {msg}  [{time.perf_counter() - t0:.1f}s]")
    heuristic = next((r for r in rows if r["impl"] == "heuristic"), None)
    if no_table is not None and heuristic is not None:
        # No separate tuned row: it would time the heuristic config again. Say so on that row.
        rows.remove(no_table)
        note = "runtime default here (no tuned table entry for this shape)"
        heuristic["config_note"] = "; ".join(x for x in (note, heuristic.get("config_note")) if x)
    del inputs, first, ref
    I.release()
    _free(opts.device)
    return rows


def _plain_row(spec: ShapeSpec, impl: I.Impl, env: dict, copy_bw: float, status: str, reason: str) -> dict:
    return {"shape": spec.name, **spec.to_dict(), "impl": impl.name, "impl_kind": impl.kind,
            "status": status, "reason": reason, "copy_bw_gbs": copy_bw, **env}


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


def run_benchmark(args: argparse.Namespace, log=print) -> tuple[list[dict], Path]:
    specs = specs_from_args(args)
    if args.filter:
        specs = [s for s in specs if re.search(args.filter, s.name)]
        if not specs:
            raise ValueError(f"--filter {args.filter!r} matches no shape of the grid")
    impls = _parse_impls(args.impls)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        if not INTERPRETER_ACTIVE:
            raise RuntimeError("no CUDA device: set TRITON_INTERPRET=1 (before Python starts) to "
                               "run the report on the CPU through Triton's interpreter")
    elif device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    opts = Options(device, args.replay_ms, args.cpu_repeats, args.check_requests, args.seed)
    env = environment(device)
    log(f"report: {len(specs)} shapes x {len(impls)} implementations on {describe_device(env)}")
    if device.type != "cuda":
        log(f"  !!! {MEANINGLESS} !!!")
    copy_bw = measure.copy_bandwidth_gbs(device, nbytes=int(args.copy_gib * 2**30))
    log(f"  copy bandwidth {copy_bw:.0f} GB/s")
    out = Path(args.out) if args.out else default_report_dir(_slug(env["device"]))
    out.mkdir(parents=True, exist_ok=True)
    log(f"  writing to {out}")
    rows: list[dict] = []
    start = time.perf_counter()
    for i, spec in enumerate(specs):
        elapsed = time.perf_counter() - start
        if args.budget_s is not None and elapsed > args.budget_s:
            log(f"[{i + 1}/{len(specs)}] {spec.name}  not run: --budget-s {args.budget_s:g} spent")
            rows += [_plain_row(spec, impl, env, copy_bw, "skipped", f"not run: time budget "
                                f"(--budget-s {args.budget_s:g}) spent") for impl in impls]
            continue
        log(f"[{i + 1}/{len(specs)}] {spec.name}  ({elapsed:.0f}s elapsed)")
        try:
            rows += benchmark_shape(spec, impls, opts, env, copy_bw, log)
        except Exception as e:  # inputs or reference failed (e.g. out of memory): record, go on
            reason = f"shape setup failed: {type(e).__name__}: {_first_line(e)}"
            log(f"    {reason}")
            rows += [_plain_row(spec, impl, env, copy_bw, "failed", reason) for impl in impls]
            I.release()
            _free(device)
        add_speedups(rows)
        write_csv(rows, out / "results.csv")  # after every shape: a killed run keeps its data
    return rows, out


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
    cols = columns_for(rows)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in rows:
            w.writerow([_csv_value(r.get(c)) for c in cols])


def _cell(k: str, v: str):
    """A CSV cell as its column's type; ValueError if it is not one."""
    try:
        if k in INT_COLUMNS:
            return int(v)
        if k in FLOAT_COLUMNS or k.startswith("speedup_vs_"):
            return float(v)
    except ValueError:
        raise ValueError(f"expected {'an integer' if k in INT_COLUMNS else 'a number'}, got "
                         f"{v!r}") from None
    if k in BOOL_COLUMNS:
        low = v.lower()
        if low not in ("true", "1", "yes", "false", "0", "no"):
            raise ValueError(f"expected true or false, got {v!r}")
        return low in ("true", "1", "yes")
    return v


def read_csv(path: str | Path) -> list[dict]:
    """Rows of a results.csv with typed values (None for empty cells).

    Raises ValueError for a file that is not a report CSV: missing REQUIRED_COLUMNS (all named),
    an empty cell of CELL_COLUMNS or a cell not of its column's type (line and column named).
    An empty or absent error_ok is derived as rel_error <= tolerance, as the benchmark does
    (None when either is unknown).
    """
    rows = []
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
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
                    if v is None or v == "":
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
                    spec_of(row)
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
                if row.get("error_ok") is None:
                    err, tol = row.get("rel_error"), row.get("tolerance")
                    row["error_ok"] = None if err is None or tol is None else bool(err <= tol)
                rows.append(row)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text CSV ({e})") from None
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


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _positive(v: object) -> bool:
    return _finite(v) and v > 0


def ok(row: dict | None) -> bool:
    """The row ran and has a usable time (a positive finite median: a CSV may hold nan, inf or
    worse, which plots cannot show; such rows are listed under "Not run" as not plotted)."""
    return bool(row) and row.get("status") == "ok" and _positive(row.get("time_us_median"))


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
                                                "copy_bw_gbs")}
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


def _color(impl: str, i: int) -> str:
    return IMPL_COLORS.get(impl, H.PALETTE[(i + 4) % len(H.PALETTE)])


# ---------------------------------------------------------------------------------------------
# HTML: one run


def _meta_html(t: Table, extra: Sequence[tuple[str, str]] = ()) -> str:
    m = t.meta
    items = [("device", m["description"]), ("driver", m["driver"]), ("CUDA (torch build)", m["cuda_version"]),
             ("torch", m["torch_version"]), ("triton", m["triton_version"]),
             ("tsdecode", m["tsdecode_version"]), ("date (UTC)", m["date"]),
             ("copy bandwidth", f"{H.fmt_num(m['copy_bw_gbs'])} GB/s (device-to-device, read + write)"),
             ("timing", ", ".join(sorted({r.get('timing_method') or '' for r in t.rows} - {''})) or "n/a"),
             *extra]
    return '<div class="meta">' + "".join(f"<div><b>{H.esc(k)}:</b> {H.esc(v)}</div>" for k, v in items) + "</div>"


def _banner(interpreter: bool) -> str:
    if not interpreter:
        return ""
    return (f'<div class="banner">{H.esc(MEANINGLESS)}. This report only shows that the pipeline and '
            f"the correctness checks work; run it on a GPU for numbers.</div>")


def _card(value: str, label: str, bad: bool = False) -> str:
    return (f'<div class="card{" bad" if bad else ""}"><div class="v">{H.esc(value)}</div>'
            f'<div class="l">{H.esc(label)}</div></div>')


def summary(t: Table) -> dict:
    """Headline numbers: geomean speedups, bandwidth share, correctness."""
    shapes = list(t.specs)
    tuned_pairs = [t.time(s, "heuristic") / t.time(s, "tuned") for s in shapes
                   if t.time(s, "tuned") and t.time(s, "heuristic")]
    out = {"shapes": len(shapes), "tuned_shapes": len(tuned_pairs),
           "tuned_vs_heuristic": geomean(tuned_pairs), "vs": {}}
    for b in t.baselines:
        pairs = [t.time(s, b) / t.time(s, RUNTIME) for s in shapes if t.time(s, b) and t.time(s, RUNTIME)]
        out["vs"][b] = (geomean(pairs), len(pairs))
    fracs = [t.runtime(s).get("frac_copy_bw") for s in shapes if t.runtime(s)]
    fracs = [f for f in fracs if _finite(f)]
    out["above"] = sum(1 for f in fracs if f >= GOOD_FRACTION)
    out["measured"] = len(fracs)
    checked = [r for r in t.rows if ok(r)]
    out["checked"] = len(checked)
    out["wrong"] = [r for r in checked if r.get("error_ok") is False]  # None: not checked
    out["wrong_tsdecode"] = [r for r in out["wrong"] if r.get("impl_kind") == "tsdecode"]
    out["failed"] = [r for r in t.rows if r.get("status") == "failed"]
    errs = [r["rel_error"] for r in checked if r.get("impl_kind") == "tsdecode" and r.get("rel_error") is not None]
    out["max_err_tsdecode"] = max(errs) if errs else None
    return out


def _summary_html(t: Table) -> str:
    s = summary(t)
    cards = []
    if s["tuned_vs_heuristic"] is not None:
        cards.append(_card(f"{s['tuned_vs_heuristic']:.2f}×",
                           f"tuned vs heuristic, geomean over {s['tuned_shapes']} of {s['shapes']} "
                           "shapes with a table entry"))
    else:
        cards.append(_card("no table", f"no shape has a tuned table entry: all {s['shapes']} "
                                        "use the heuristic config"))
    for b, (g, n) in s["vs"].items():
        if g is not None:
            cards.append(_card(f"{g:.2f}×", f"tsdecode vs {b}, geomean over {n} shapes (>1: tsdecode faster)"))
        else:
            cards.append(_card("n/a", f"{b}: did not run on any shape"))
    if s["measured"]:
        share = s["above"] / s["measured"]
        cards.append(_card(f"{100 * share:.0f}%", f"of shapes ({s['above']}/{s['measured']}) above "
                           f"{100 * GOOD_FRACTION:.0f}% of copy bandwidth"))
    bad = s["wrong_tsdecode"]
    err = s["max_err_tsdecode"]
    cards.append(_card("FAIL" if bad else "pass",
                       f"tsdecode correctness: {len(bad)} rows above tolerance" if bad else
                       f"tsdecode correctness: max rel. error {err:.1e}" if err is not None else "no tsdecode rows ran",
                       bad=bool(bad)))
    html = f'<div class="cards">{"".join(cards)}</div>'
    html += ('<p class="note">"tsdecode" = what the runtime runs for each shape: the tuned-table config '
             'where a table entry exists, else the heuristic. Speedup = other time / tsdecode time. '
             'Times: median per call; bandwidth = bytes moved (K/V read once + q + output) / time.</p>')
    notes = defaultdict(list)
    for r in t.rows:
        if r.get("status") in ("skipped", "failed"):
            notes[(r["impl"], r["status"], r.get("reason") or "")].append(r["shape"])
        elif r.get("status") == "ok" and not ok(r):
            why = f"time_us_median {r.get('time_us_median')} is not a positive finite number"
            notes[(r["impl"], "not plotted", why)].append(r["shape"])
    if notes:
        items = []
        for (impl, status, reason), shapes in notes.items():
            where = "all shapes" if len(shapes) == len(t.specs) else f"{len(shapes)} shape(s)"
            items.append(f"<li><b>{H.esc(impl)}</b> {status} on {where}: {H.esc(reason)}</li>")
        html += f'<h3>Not run</h3><ul class="skips">{"".join(items)}</ul>'
    return html


def _bw_chart(t: Table, shapes: Sequence[str], title: str, y_max: float | None = None) -> str:
    by_batch: dict[int, list] = defaultdict(list)
    for s in shapes:
        r = t.runtime(s)
        if r and _positive(r.get("achieved_gbs")):
            by_batch[t.specs[s].batch_size].append((t.specs[s].kv_len, r["achieved_gbs"], s, r))
    series = []
    for i, (b, pts) in enumerate(sorted(by_batch.items())):
        tips = []
        for _, _, s, r in pts:
            frac = r.get("frac_copy_bw")
            copy = f", {100 * frac:.0f}% of copy" if _finite(frac) else ""
            tips.append(f"{s} ({r['impl']}): {r['achieved_gbs']:.0f} GB/s{copy}, "
                        f"{r['time_us_median']:.1f} us")
        series.append(H.Series(f"B={b}", [(x, y) for x, y, _, _ in pts], H.PALETTE[i % len(H.PALETTE)],
                               tooltips=tips))
    peak = t.meta["copy_bw_gbs"]
    hlines = [H.HLine(peak, f"copy bandwidth {H.fmt_num(peak)} GB/s"),
              H.HLine(GOOD_FRACTION * peak, f"{100 * GOOD_FRACTION:.0f}%", color="#888", dash="2 3")
              ] if _positive(peak) else []
    return H.line_chart(series, title=title, x_label="K/V length per request (tokens, log2 scale)",
                        y_label="achieved bandwidth (GB/s)", hlines=hlines, legend_title="batch size",
                        y_max=y_max)


def _grid_axes(t: Table, shapes: Sequence[str]) -> tuple[list[int], list[int]]:
    batches = sorted({t.specs[s].batch_size for s in shapes})
    lens = sorted({t.specs[s].kv_len for s in shapes})
    return batches, lens


def _heatmap(t: Table, shapes: Sequence[str], title: str, cell_fn, legend: str) -> str:
    batches, lens = _grid_axes(t, shapes)
    cells = {}
    for s in shapes:
        spec = t.specs[s]
        cell = cell_fn(s)
        if cell is not None:
            cells[(batches.index(spec.batch_size), lens.index(spec.kv_len))] = cell
    return H.heatmap([f"B={b}" for b in batches], [H.fmt_tokens(n) for n in lens], cells, title=title,
                     row_title="batch size", col_title="K/V length (tokens)", legend=legend)


def _tuned_cell(t: Table, s: str) -> H.Cell | None:
    tuned, heur = t.time(s, "tuned"), t.time(s, "heuristic")
    if tuned and heur:
        r = heur / tuned
        return H.Cell(H.diverging_color(r), f"{r:.2f}×", f"{s}: heuristic {heur:.1f} us, tuned {tuned:.1f} us")
    if heur:
        return H.Cell("", "no entry", f"{s}: no tuned table entry (the runtime uses the heuristic)")
    return H.Cell("", "n/a", f"{s}: tsdecode did not run")


def _frac_cell(t: Table, s: str) -> H.Cell | None:
    r = t.runtime(s)
    if not r:
        return H.Cell("", "n/a", f"{s}: tsdecode did not run")
    f = r.get("frac_copy_bw")
    if not (_finite(f) and _finite(r.get("achieved_gbs"))):
        return H.Cell("", "n/a", f"{s}: no bandwidth recorded ({r['impl']})")
    return H.Cell(H.sequential_color(f), f"{100 * f:.0f}%",
                  f"{s}: {r['achieved_gbs']:.0f} GB/s, {r['time_us_median']:.1f} us ({r['impl']})")


def _latency_chart(t: Table, shapes: Sequence[str], title: str) -> str:
    order = sorted(shapes, key=lambda s: (t.specs[s].batch_size, t.specs[s].kv_len))
    labels = {s: f"B={t.specs[s].batch_size}  L={H.fmt_tokens(t.specs[s].kv_len)}" for s in order}
    # The heuristic gets its own bar only where a tuned entry replaced it.
    values = {(labels[s], n): t.time(s, n) for s in order for n in [RUNTIME] + t.baselines if t.time(s, n)}
    values.update({(labels[s], "heuristic"): t.time(s, "heuristic") for s in order if t.time(s, "tuned")
                   and t.time(s, "heuristic")})
    names = [n for n in [RUNTIME, "heuristic"] + t.baselines if any(k[1] == n for k in values)]
    series = [(n, _color(n, i)) for i, n in enumerate(names)]
    series = [("tsdecode (runtime)" if n == RUNTIME else n, c) for n, c in series]
    values = {(g, "tsdecode (runtime)" if n == RUNTIME else n): v for (g, n), v in values.items()}
    return H.hbar_chart([labels[s] for s in order], series, values, title=title,
                        x_label="time per call (µs, log scale; shorter is better)",
                        value_fmt=lambda v: f"{H.fmt_num(v)} µs")


def _fmt_f(digits: int, suffix: str = "", scale: float = 1.0):
    def f(v):
        return "" if v is None else f"{v * scale:.{digits}f}{suffix}"
    return f


def _fmt_err(v):
    return "" if v is None else f"{v:.1e}"


def _config_cell(v) -> str:
    """A row's config JSON in KernelConfig's field names, as the tuner prints configs."""
    if not v:
        return ""
    try:
        return config_text(KernelConfig.from_dict(json.loads(v)))
    except (TypeError, ValueError):
        return str(v)


def _table_html(t: Table) -> str:
    rows = []
    for r in t.rows:
        row = dict(r)
        lo, hi = r.get("time_us_min"), r.get("time_us_max")
        row["range"] = f"{lo:.1f}–{hi:.1f}" if ok(r) and _finite(lo) and _finite(hi) else ""
        row["cfg"] = _config_cell(r.get("config"))
        row["why"] = r.get("reason") or r.get("impl_note") or r.get("config_note") or ""
        rows.append(row)
    cols = [
        H.Column("shape", "shape"), H.Column("impl", "impl"), H.Column("status", "status"),
        H.Column("time_us_median", "median µs", True, _fmt_f(1)),
        H.Column("range", "min–max µs"),
        H.Column("achieved_gbs", "GB/s", True, _fmt_f(0)),
        H.Column("frac_copy_bw", "% copy", True, _fmt_f(1, "%", 100.0)),
        H.Column("speedup_vs_heuristic", "× heuristic", True, _fmt_f(2, "×"),
                 "heuristic time / this time"),
    ] + [H.Column(f"speedup_vs_{b}", f"× {b}", True, _fmt_f(2, "×"), f"{b} time / this time")
         for b in t.baselines] + [
        H.Column("rel_error", "rel. error", True, _fmt_err, "vs float64 reference, first requests"),
        H.Column("config_source", "config source"), H.Column("cfg", "config"),
        H.Column("why", "notes"),
    ]

    def cls(r):
        if r.get("status") != "ok":
            return r.get("status") or ""
        return "wrong" if r.get("error_ok") is False else ""

    return H.table(cols, rows, row_class=cls)


def render_html(rows: Sequence[dict], title: str | None = None, source: str = "") -> str:
    t = Table(rows)
    title = title or f"tsdecode decode attention: {t.meta['device']}"
    parts = [f"<h1>{H.esc(title)}</h1>", _banner(t.interpreter),
             _meta_html(t, [("shapes", len(t.specs)), ("implementations", ", ".join(t.impls))]
                        + ([("source", source)] if source else [])),
             "<h2>Summary</h2>", _summary_html(t)]
    fams = t.families()
    parts.append("<h2>Bandwidth</h2><div class='charts'>")
    for fam, shapes in fams.items():
        parts.append(_bw_chart(t, shapes, f"tsdecode bandwidth, {fam}"))
        parts.append(_heatmap(t, shapes, f"% of copy bandwidth, {fam}", lambda s: _frac_cell(t, s),
                              "tsdecode (runtime config) achieved GB/s / copy GB/s"))
    parts.append("</div><h2>Tuned vs heuristic</h2><div class='charts'>")
    for fam, shapes in fams.items():
        parts.append(_heatmap(t, shapes, f"tuned speedup over heuristic, {fam}", lambda s: _tuned_cell(t, s),
                              "heuristic time / tuned time; green: tuned faster, red: slower; grey: no table entry"))
    parts.append("</div><h2>Latency vs baselines</h2><div class='charts'>")
    for fam, shapes in fams.items():
        parts.append(_latency_chart(t, shapes, f"time per call, {fam}"))
    parts.append("</div><h2>All results</h2>")
    parts.append('<p class="note">Click a column header to sort. Red rows: failed or above the '
                 "error tolerance; grey rows: skipped (reason in notes).</p>")
    parts.append(_table_html(t))
    return H.page(title, "".join(parts))


# ---------------------------------------------------------------------------------------------
# HTML: comparison of two CSVs


def _key(row: dict) -> tuple:
    return tuple(row[f] for f in SPEC_FIELDS)


def render_compare(rows_a: Sequence[dict], rows_b: Sequence[dict], label_a: str, label_b: str,
                   title: str | None = None) -> str:
    a, b = Table(rows_a), Table(rows_b)
    key_a = {_key(r): r["shape"] for r in a.rows}
    key_b = {_key(r): r["shape"] for r in b.rows}
    common = [k for k in key_a if k in key_b]
    shapes = [key_a[k] for k in common]  # shape names are derived from the key, so equal in both
    impls = [RUNTIME] + [n for n in a.impls if n in b.impls]
    title = title or f"tsdecode comparison: {a.meta['device']} ({label_a}) vs {b.meta['device']} ({label_b})"

    def meta_line(t: Table, label: str) -> str:
        m = t.meta
        return (f"<div><b>{H.esc(label)}:</b> {H.esc(m['description'])}, {H.esc(m['date'])}, torch {H.esc(m['torch_version'])}, "
                f"triton {H.esc(m['triton_version'])}, copy {H.fmt_num(m['copy_bw_gbs'])} GB/s</div>")

    parts = [f"<h1>{H.esc(title)}</h1>", _banner(a.interpreter or b.interpreter),
             f'<div class="meta" style="grid-template-columns: 1fr">{meta_line(a, "A " + label_a)}'
             f'{meta_line(b, "B " + label_b)}</div>',
             "<h2>Summary</h2>"]
    cards = []
    for n in impls:
        pairs = [a.time(s, n) / b.time(s, n) for s in shapes if a.time(s, n) and b.time(s, n)]
        g = geomean(pairs)
        if g is not None:
            cards.append(_card(f"{g:.2f}×", f"{n}: B speedup over A (time A / time B), geomean over "
                                            f"{len(pairs)} shapes"))
    only_a, only_b = len(key_a) - len(common), len(key_b) - len(common)
    cards.append(_card(str(len(common)), f"matching shapes ({only_a} only in A, {only_b} only in B)"))
    parts.append(f'<div class="cards">{"".join(cards)}</div>')
    parts.append('<p class="note">Ratio = time A / time B: above 1 means B is faster. "tsdecode" = '
                 "the runtime's config (tuned entry, else heuristic) in each run.</p>")

    fams: dict[str, list[str]] = defaultdict(list)
    for s in shapes:
        fams[family_of(a.specs[s])].append(s)
    parts.append("<h2>Bandwidth, side by side</h2>")
    for fam, fs in fams.items():
        tops = [v for v in [a.meta["copy_bw_gbs"], b.meta["copy_bw_gbs"]]
                + [t.runtime(s).get("achieved_gbs") for t in (a, b) for s in fs if t.runtime(s)]
                if _positive(v)]
        top = max(tops) * 1.08 if tops else None
        parts.append("<div class='charts'>")
        parts.append(_bw_chart(a, fs, f"A ({label_a}), {fam}", y_max=top))
        parts.append(_bw_chart(b, fs, f"B ({label_b}), {fam}", y_max=top))
        parts.append("</div>")
    parts.append("<h2>Time ratio A / B (tsdecode)</h2><div class='charts'>")
    for fam, fs in fams.items():
        def cell(s, fam=fam):
            ta, tb = a.time(s, RUNTIME), b.time(s, RUNTIME)
            if not (ta and tb):
                return H.Cell("", "n/a", f"{s}: missing in one run")
            r = ta / tb
            return H.Cell(H.diverging_color(r), f"{r:.2f}×", f"{s}: A {ta:.1f} us, B {tb:.1f} us")
        parts.append(_heatmap(a, fs, f"time A / time B, {fam}", cell,
                              "green: B faster, red: B slower"))
    parts.append("</div><h2>All matching rows</h2>")
    rows = []
    for s in shapes:
        for n in impls:
            ra = a.runtime(s) if n == RUNTIME else a.by[s].get(n)
            rb = b.runtime(s) if n == RUNTIME else b.by[s].get(n)
            if not (ra or rb):
                continue
            ta, tb = a.time(s, n), b.time(s, n)
            rows.append({
                "shape": s, "impl": "tsdecode (runtime)" if n == RUNTIME else n, "time_a": ta, "time_b": tb,
                "ratio": ta / tb if ta and tb else None,
                "gbs_a": ra.get("achieved_gbs") if ok(ra) else None,
                "gbs_b": rb.get("achieved_gbs") if ok(rb) else None,
                "frac_a": ra.get("frac_copy_bw") if ok(ra) else None,
                "frac_b": rb.get("frac_copy_bw") if ok(rb) else None,
                "status": f"{(ra or {}).get('status', '—')} / {(rb or {}).get('status', '—')}",
            })
    cols = [H.Column("shape", "shape"), H.Column("impl", "impl"), H.Column("status", "status A / B"),
            H.Column("time_a", "µs A", True, _fmt_f(1)), H.Column("time_b", "µs B", True, _fmt_f(1)),
            H.Column("ratio", "A / B", True, _fmt_f(2, "×"), "time A / time B: >1 means B faster"),
            H.Column("gbs_a", "GB/s A", True, _fmt_f(0)), H.Column("gbs_b", "GB/s B", True, _fmt_f(0)),
            H.Column("frac_a", "% copy A", True, _fmt_f(1, "%", 100.0)),
            H.Column("frac_b", "% copy B", True, _fmt_f(1, "%", 100.0))]
    parts.append(H.table(cols, rows))
    return H.page(title, "".join(parts))


# ---------------------------------------------------------------------------------------------
# Entry point


def run_report(args: argparse.Namespace) -> int:
    """Run what ``args`` asks: compare, re-render or benchmark. Returns a process exit code:
    0; 1 when a tsdecode row failed or exceeded the error tolerance; 2 for a usage error (bad
    grid, unreadable CSV, no device)."""
    try:
        return _run_report(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"tsdecode-tune report: error: {e}", file=sys.stderr)
        return 2


def _run_report(args: argparse.Namespace) -> int:
    if args.compare:
        path_a, path_b = args.compare
        out = Path(args.out) if args.out else default_report_dir("compare")
        out.mkdir(parents=True, exist_ok=True)
        page = render_compare(read_csv(path_a), read_csv(path_b), *_labels(path_a, path_b), args.title)
        (out / "compare.html").write_text(page, encoding="utf-8")
        print(f"wrote {out / 'compare.html'}")
        return 0
    if args.from_csv:
        rows = read_csv(args.from_csv)
        out = Path(args.out) if args.out else Path(args.from_csv).parent
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.html").write_text(render_html(rows, args.title, source=str(args.from_csv)), encoding="utf-8")
        print(f"wrote {out / 'report.html'}")
        return _exit_code(rows)
    rows, out = run_benchmark(args)
    write_csv(rows, out / "results.csv")
    (out / "report.html").write_text(render_html(rows, args.title), encoding="utf-8")
    s = summary(Table(rows))
    print(f"wrote {out / 'results.csv'} and {out / 'report.html'}")
    if s["tuned_vs_heuristic"] is not None:
        print(f"  tuned vs heuristic: {s['tuned_vs_heuristic']:.2f}x over {s['tuned_shapes']} shapes")
    for b, (g, n) in s["vs"].items():
        if g is not None:
            print(f"  tsdecode vs {b}: {g:.2f}x geomean over {n} shapes")
    if s["measured"]:
        print(f"  above {100 * GOOD_FRACTION:.0f}% of copy bandwidth: {s['above']}/{s['measured']} shapes")
    return _exit_code(rows)


def _labels(path_a: str, path_b: str) -> tuple[str, str]:
    """Short names for two CSVs: '<device>/<time>' for <...>/<device>/<time>/results.csv, the
    file names when those agree."""
    def folder(p: Path) -> str:
        p = p.resolve()
        return f"{p.parent.parent.name}/{p.parent.name}".strip("/")

    a, b = Path(path_a), Path(path_b)
    if folder(a) != folder(b):
        return folder(a), folder(b)
    if a.name != b.name:
        return a.name, b.name
    return str(path_a), str(path_b)


def _exit_code(rows: Sequence[dict]) -> int:
    """1 if a tsdecode row failed or is above the error tolerance (error_ok false; unknown,
    e.g. never checked, is no problem), each printed; else 0."""
    bad = 0
    for r in rows:
        if r.get("impl_kind") != "tsdecode":
            continue
        if r.get("status") == "failed":
            what = r.get("reason") or "failed (no reason recorded)"
        elif r.get("status") == "ok" and r.get("error_ok") is False:
            err, tol = r.get("rel_error"), r.get("tolerance")
            what = (f"rel_error {err:.2e} above {tol:.0e}" if err is not None and tol is not None
                    else "error_ok is false")
        else:
            continue
        bad += 1
        print(f"tsdecode problem: {r['shape']} {r['impl']}: {what}", file=sys.stderr)
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m tuner.report", description=__doc__.splitlines()[0])
    add_report_arguments(parser)
    try:
        return run_report(parser.parse_args(argv))
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
