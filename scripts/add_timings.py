"""Add a ``sweep_configs.py`` CSV to the H200 timings the config model's regression guard reads
(``tests/data/h200_timings.csv.gz``), under a source letter: one row per (shape, config), the
full-length re-timing where the sweep made one, else the short one. Rows of a (source, shape,
config) the file has already are kept as they are.

Usage: python scripts/add_timings.py --src D sweep.csv [more.csv ...]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "h200_timings.csv.gz"
SHAPE_FIELDS = {"batch_size": "batch_size", "max_kv_len": "kv_len", "num_qo_heads": "num_qo_heads",
                "num_kv_heads": "num_kv_heads", "head_dim": "head_dim", "page_size": "page_size",
                "kv_dtype": "kv_dtype", "window_left": "window_left", "mask_kind": "mask_type"}
CONFIG_FIELDS = ("block_n", "block_m", "num_kv_splits", "num_warps", "num_stages")


def sweep_rows(path: str, src: str) -> list[dict]:
    """{(shape, config): row}: a final (full-length) timing wins over a short one."""
    best: dict[tuple, tuple[bool, dict]] = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            key = (r["shape"],) + tuple(r[k] for k in CONFIG_FIELDS)
            final = r["kind"] != "short"
            row = dict(src=src, shape=r["shape"], **{k: r[v] for k, v in SHAPE_FIELDS.items()},
                       spread=f"{float(r['spread']):.4g}", **{k: r[k] for k in CONFIG_FIELDS},
                       time_us=f"{float(r['time_us']):.3f}")
            if key not in best or (final and not best[key][0]):
                best[key] = (final, row)
    return [row for _, row in best.values()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="the source letter of the new rows")
    ap.add_argument("csv", nargs="+")
    args = ap.parse_args(argv)
    with gzip.open(DATA, "rt") as f:
        lines = f.read().splitlines(keepends=True)
    comments = [line for line in lines if line.startswith("#")]
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    fields = list(rows[0])
    have = {(r["src"], r["shape"]) + tuple(r[k] for k in CONFIG_FIELDS) for r in rows}
    new = [r for path in args.csv for r in sweep_rows(path, args.src)
           if (r["src"], r["shape"]) + tuple(r[k] for k in CONFIG_FIELDS) not in have]
    out = io.StringIO()
    out.writelines(comments)
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows + new)
    with gzip.open(DATA, "wt") as f:
        f.write(out.getvalue())
    print(f"{len(new)} rows of {len({r['shape'] for r in new})} shapes added to {DATA} as source {args.src}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
