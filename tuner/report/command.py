"""Performance reports: benchmark a shape grid into ``results.csv`` and a self-contained
``report.html``; re-render from a CSV (``--from-csv``) or compare two CSVs (``--compare``).

Entry points: ``tsdecode-tune report ...`` and ``python -m tuner.report ...``. Without ``--out``
a report goes to ``<user cache>/reports/<device>/<UTC time>/``. See docs/reports.md. The work
lies in ``benchmark`` (timing), ``results`` (the CSV) and ``pages`` (the HTML).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Sequence

from ..arguments import Parser, UsageError, bounded, nonnegative_float, positive_int, replay_ms, seed_int
from ..files import atomic_write_text
from ..grids import add_grid_arguments
from . import impls as I
from .benchmark import run_benchmark
from .pages import GOOD_FRACTION, render_compare, render_html, summary
from .results import Table, default_report_dir, read_csv, write_csv


def help_description() -> str:
    """The module docstring's first paragraph as --help prints it (no reStructuredText)."""
    return " ".join(__doc__.split("\n\n")[0].replace("``", "").split())


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tsdecode-tune report`` (and ``python -m tuner.report``)."""
    add_grid_arguments(parser)
    g = parser.add_argument_group("report")
    g.add_argument("--out", default=None,
                   help="output folder (default: <user cache>/reports/<device>/<UTC time>/, compare: "
                        "<user cache>/reports/compare/<UTC time>/; --from-csv: the CSV's folder)")
    g.add_argument("--filter", default=None, metavar="REGEX", type=_regex,
                   help="keep only grid shapes whose name matches (re.search), e.g. 'B1_|L32768'")
    g.add_argument("--impls", default="all",
                   help="comma-separated implementations (default all): " + "; ".join(
                       f"{name}: {impl.description}" for name, impl in I.IMPLS.items()))
    g.add_argument("--device", default=None, help="cuda (default when available) or cpu (interpreter)")
    g.add_argument("--replay-ms", type=replay_ms, default=80.0,
                   help="CUDA-graph replay time per measurement (default %(default)s)")
    g.add_argument("--cpu-repeats", type=positive_int, default=1,
                   help="timed calls per case on CPU (default %(default)s)")
    g.add_argument("--check-requests", type=positive_int, default=2,
                   help="requests compared with the float64 reference per shape (the first N, at least 1; "
                        "default %(default)s)")
    g.add_argument("--copy-gib", type=bounded(float, 0, strict=True, maximum=1024), default=2.0,
                   help="buffer size of the copy-bandwidth test in GiB (default %(default)s)")
    g.add_argument("--budget-s", type=nonnegative_float, default=None, metavar="SECONDS",
                   help="start no new shape after this many seconds (the rest: skipped rows)")
    g.add_argument("--seed", type=seed_int, default=0, help="seed of the random inputs (default %(default)s)")
    g.add_argument("--title", default=None, help="page title")
    g.add_argument("--from-csv", default=None, metavar="RESULTS.csv",
                   help="re-render report.html from an existing results.csv (no benchmarking)")
    g.add_argument("--compare", nargs=2, default=None, metavar=("A.csv", "B.csv"),
                   help="render compare.html for the shapes two results.csv files share")


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression: {e}") from None
    return text


def run_report(args: argparse.Namespace) -> int:
    """Run what ``args`` asks: compare, re-render or benchmark. Returns a process exit code:
    0; 1 when a tsdecode row failed or exceeded the error tolerance; 2 for a usage error (bad
    grid, unreadable CSV, no device)."""
    try:
        return _run_report(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"tsdecode-tune report: error: {e}", file=sys.stderr)
        return 2


def _check_modes(args: argparse.Namespace) -> None:
    """--compare and --from-csv read CSVs: a grid or benchmark flag beside them would be ignored."""
    modes = [flag for flag, on in (("--compare", args.compare), ("--from-csv", args.from_csv)) if on]
    if len(modes) == 2:
        raise ValueError("--compare and --from-csv: give one of them")
    if modes:
        grid = [flag for flag, on in (("--preset", args.preset), ("--grid-file", args.grid_file),
                                      ("--batch-sizes", args.batch_sizes), ("--kv-lens", args.kv_lens),
                                      ("--filter", args.filter), ("--device", args.device)) if on]
        if grid:
            raise ValueError(f"{modes[0]} re-renders existing results: {', '.join(grid)} would be ignored")


def _run_report(args: argparse.Namespace) -> int:
    _check_modes(args)
    if args.compare:
        path_a, path_b = args.compare
        out = Path(args.out) if args.out else default_report_dir("compare")
        out.mkdir(parents=True, exist_ok=True)
        page = render_compare(read_csv(path_a), read_csv(path_b), *_labels(path_a, path_b), args.title)
        atomic_write_text(out / "compare.html", page)
        print(f"wrote {out / 'compare.html'}")
        return 0
    if args.from_csv:
        rows = read_csv(args.from_csv)
        out = Path(args.out) if args.out else Path(args.from_csv).parent
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "report.html", render_html(rows, args.title, source=str(args.from_csv)))
        print(f"wrote {out / 'report.html'}")
        return _exit_code(rows)
    rows, out = run_benchmark(args)
    write_csv(rows, out / "results.csv")
    atomic_write_text(out / "report.html", render_html(rows, args.title))
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
    parser = Parser(prog="python -m tuner.report", description=help_description())
    add_report_arguments(parser)
    try:
        return run_report(parser.parse_args(argv))
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
