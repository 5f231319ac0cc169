"""Add a ``sweep_configs.py`` CSV, or the trials CSV of a ``tsdecode-tune --grid-file`` run, to the
H200 timings the config model's regression guard reads (``tests/data/h200_timings.csv.xz``), under
a source letter: one row per (shape, config), the full-length re-timing where the sweep made one
(a tune's: the median of its interleaved re-timing rounds), else the short one. Rows of a (source,
shape, config) the file has already are kept as they are; times are kept to four significant digits
(finer than the timings' noise), the file's old rows rewritten alike, and a (source, shape)'s
configs slower than KEEP_WITHIN x its fastest are dropped (no model picks them: the regression
guard's measured counts would show one that did), which keeps the file small. A tune's shapes are
read from their names (``B4_L1800_H112x16_D64_P2_float8_e4m3fn_ragged``: dense masks only, one
shape a bucket) and their length spread from the lengths the tuner drew
(``tuner.measure.seq_lens_for``, seed 0).

A sweep of a ``model_scores.py --untimed`` list (``sweep_configs.py --configs LIST``) takes its
sources from that list with ``--src-from LIST``: each row goes to every source the list names its
shape under, and a swept shape the list does not name is an error.

Usage: python scripts/add_timings.py --src D sweep.csv [more.csv ...]
       python scripts/add_timings.py --src J reports/.../tune_random_seed17_trials.csv.gz
       python scripts/add_timings.py --src-from configs_x.csv sweep_x.csv
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import lzma
import math
import re
import statistics
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "h200_timings.csv.xz"
SHAPE_FIELDS = {"batch_size": "batch_size", "max_kv_len": "kv_len", "num_qo_heads": "num_qo_heads",
                "num_kv_heads": "num_kv_heads", "head_dim": "head_dim", "page_size": "page_size",
                "kv_dtype": "kv_dtype", "window_left": "window_left", "mask_kind": "mask_type"}
CONFIG_FIELDS = ("block_n", "block_m", "num_kv_splits", "num_warps", "num_stages")
KEEP_WITHIN = 1.5  # rows slower than this x their shape's fastest are dropped
# xz at its strongest setting: the file is rewritten a few times a session and read by every test run.
XZ_PRESET = 9 | lzma.PRESET_EXTREME


def sweep_rows(path: str, src: str) -> list[dict]:
    """{(shape, config): row}: a final (full-length) timing wins over a short one."""
    best: dict[tuple, tuple[bool, dict]] = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            key = (r["shape"],) + tuple(r[k] for k in CONFIG_FIELDS)
            final = r["kind"] != "short"
            row = dict(src=src, shape=r["shape"], **{k: r[v] for k, v in SHAPE_FIELDS.items()},
                       spread=f"{float(r['spread']):.4g}", **{k: r[k] for k in CONFIG_FIELDS},
                       time_us=time_text(r["time_us"]))
            if key not in best or (final and not best[key][0]):
                best[key] = (final, row)
    return [row for _, row in best.values()]


def time_text(us) -> str:
    """A kernel time to four significant digits."""
    return f"{float(f'{float(us):.4g}'):g}"  # 12359.1 -> 12360, 8.820 -> 8.82


NAME = re.compile(r"B(\d+)_L(\d+)_H(\d+)x(\d+)_D(\d+)_P(\d+)_([a-z0-9_]+?)(_ragged)?$")


def tune_rows(path: str, src: str) -> list[dict]:
    """One row per (shape, config) of a tuner trials CSV: re-timed median, else the trial's time."""
    sys.path.insert(0, str(DATA.parents[2]))
    import torch

    from tuner.grids import ShapeSpec
    from tuner.measure import seq_lens_for

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        records = [r for r in csv.DictReader(f) if r["state"] in ("COMPLETE", "RETIME") and r["time_us"]]
    times: dict[tuple, tuple[bool, list[float]]] = {}
    for r in records:
        key = (r["specs"],) + tuple(r[k] for k in CONFIG_FIELDS)
        final = r["state"] == "RETIME"
        if key not in times or (final and not times[key][0]):
            times[key] = (final, [])
        if final == times[key][0]:
            times[key][1].append(float(r["time_us"]))
    rows, spreads = [], {}
    for (name, *config), (_, values) in times.items():
        m = NAME.match(name)
        if not m:
            raise SystemExit(f"{path}: shape {name!r} is not one dense shape of a grid-file tune")
        b, length, hq, hkv, d, page = map(int, m.groups()[:6])
        if name not in spreads:
            spec = ShapeSpec(batch_size=b, kv_len=length, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                             page_size=page, kv_dtype=m.group(7), ragged=bool(m.group(8)))
            lens = seq_lens_for(spec, torch.Generator().manual_seed(0))
            spreads[name] = max(lens) * len(lens) / sum(lens)
        rows.append(dict(src=src, shape=name, batch_size=b, max_kv_len=length, num_qo_heads=hq,
                         num_kv_heads=hkv, head_dim=d, page_size=page, kv_dtype=m.group(7), window_left=-1,
                         mask_kind="dense", spread=f"{spreads[name]:.4g}",
                         **dict(zip(CONFIG_FIELDS, config)), time_us=time_text(statistics.median(values))))
    return rows


def _fail(message: str) -> None:
    print(f"add_timings.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


SWEEP_COLUMNS = ("shape", "kind", "spread", "time_us", *SHAPE_FIELDS.values(), *CONFIG_FIELDS)
TUNE_COLUMNS = ("specs", "state", "time_us", *CONFIG_FIELDS)


def read_rows(path: str, src: str) -> list[dict]:
    """The rows of a sweep or a tune's trials CSV; SystemExit naming the file where it is neither."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", newline="") as f:
            header = f.readline().strip().split(",")
    except OSError as e:
        _fail(f"{path}: cannot be read ({e.strerror or e})")
    tune = "specs" in header
    missing = [c for c in (TUNE_COLUMNS if tune else SWEEP_COLUMNS) if c not in header]
    if missing:
        _fail(f"{path}: not a sweep_configs.py CSV nor a tuner trials CSV (columns {missing} missing)")
    return tune_rows(path, src) if tune else sweep_rows(path, src)


def sources_by_shape(path: str) -> dict[str, list[str]]:
    """{shape: its sources} of a ``model_scores.py --untimed`` list (its ``src`` and ``shape``)."""
    out: dict[str, list[str]] = {}
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if not {"src", "shape"} <= set(reader.fieldnames or ()):
                _fail(f"--src-from {path}: not a model_scores.py --untimed list (columns src and shape)")
            for r in reader:
                if r["src"] not in out.setdefault(r["shape"], []):
                    out[r["shape"]].append(r["src"])
    except OSError as e:
        _fail(f"--src-from {path}: cannot be read ({e.strerror or e})")
    return out


def listed_rows(paths: list[str], listing: str) -> list[dict]:
    """The rows of sweeps of a configs list, each under every source the list names its shape."""
    sources = sources_by_shape(listing)
    rows = [r for path in paths for r in read_rows(path, "")]
    unlisted = sorted({r["shape"] for r in rows} - set(sources))
    if unlisted:
        _fail(f"--src-from {listing} names no source for the swept shapes {unlisted}")
    return [dict(r, src=src) for r in rows for src in sources[r["shape"]]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--src", help="the source letter of the new rows")
    source.add_argument("--src-from", metavar="LIST",
                        help="the model_scores.py --untimed list the sweeps timed: each row under its shape's sources")
    ap.add_argument("csv", nargs="+")
    args = ap.parse_args(argv)
    with lzma.open(DATA, "rt") as f:
        lines = f.read().splitlines(keepends=True)
    comments = [line for line in lines if line.startswith("#")]
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    fields = list(rows[0])
    have = {(r["src"], r["shape"]) + tuple(r[k] for k in CONFIG_FIELDS) for r in rows}
    read = listed_rows(args.csv, args.src_from) if args.src_from else [r for path in args.csv
                                                                       for r in read_rows(path, args.src)]
    new = [r for r in read if (r["src"], r["shape"]) + tuple(r[k] for k in CONFIG_FIELDS) not in have]
    fastest: dict[tuple, float] = {}
    for r in rows + new:
        key = (r["src"], r["shape"])
        fastest[key] = min(fastest.get(key, math.inf), float(r["time_us"]))
    kept = [r for r in rows + new if float(r["time_us"]) <= KEEP_WITHIN * fastest[(r["src"], r["shape"])]]
    out = io.StringIO()
    out.writelines(comments)
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(dict(r, time_us=time_text(r["time_us"])) for r in kept)
    DATA.write_bytes(lzma.compress(out.getvalue().encode(), preset=XZ_PRESET))  # the same rows, the same bytes
    added = args.src or "/".join(sorted({r["src"] for r in new})) or "(none)"
    print(f"{len(new)} rows of {len({r['shape'] for r in new})} shapes added to {DATA} as source {added}; "
          f"{len(rows) + len(new) - len(kept)} rows slower than {KEEP_WITHIN:g}x their shape's fastest dropped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
