#!/usr/bin/env python3
"""Summarise the two config sweeps this folder's first call ran on an H100 (run from the repository
root, or pass it as the first argument; prints Markdown, sweeps_summary.md).

sweep_cap.csv timed reports/nvidia-h200/2026-12-05/configs_twentyseventh_cap.csv: at 88 shapes of the
H200 timings, the model's pick ("picked" rows: the plan's own config) and the pick a cap of one
crossing one-warp program per warp scheduler gives (the general cap, every cache dtype and
spread). A move is a "count" move where the two configs share tile, warps and stages, else a
"form" move. The cap's narrower form (16-bit caches, equal lengths: spread < 1.1) that keeps only
count moves is the candidate branch d64-cap-chains.

sweep_d64.csv timed reports/nvidia-h200/2026-12-05/configs_twentyseventh_d64.csv: 0.85, 0.7 and 0.55
times the count beside the pick, at 60 equal-length D = 64 16-bit five-stage one-warp picks on
crossing pages.

A config's time: the median of its "final" (re-timed) rows, else of its "short" ones.
"""
import math
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
HERE = ROOT / "reports/nvidia-h100-80gb-hbm3/2026-12-05"
KEY = ["block_n", "num_warps", "num_stages", "num_kv_splits"]


def config_times(sweep: pd.DataFrame) -> pd.DataFrame:
    def one(g):
        final = g[g.kind == "final"]
        return (final if len(final) else g).time_us.median()
    timed = sweep[sweep.kind != "picked"]
    return timed.groupby(["shape"] + KEY).apply(one, include_groups=False).rename("t").reset_index()


def form(r) -> str:
    return f"{r.block_n}/{r.num_warps}/{r.num_stages}"


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def counts(rs) -> str:
    rs = list(rs)
    return (f"{len(rs)} | {geomean(rs):.3f} | {sum(r < 0.97 for r in rs)} | {sum(r > 1.03 for r in rs)} | "
            f"{min(rs):.3f}-{max(rs):.3f}" if rs else "0 | | | |")


def cap_section() -> list[str]:
    sweep = pd.read_csv(HERE / "sweep_cap.csv")
    times = config_times(sweep)
    picked = sweep[sweep.kind == "picked"].drop_duplicates("shape").set_index("shape")
    rows = []
    for shape, g in times.groupby("shape"):
        p = picked.loc[shape]
        is_pick = (g[KEY] == p[KEY].values).all(axis=1)
        for _, other in g[~is_pick].iterrows():
            rows.append(dict(shape=shape, fp8="float8" in shape, equal=p.spread < 1.1,
                             move="count" if form(other) == form(p) else "form",
                             pick=f"{form(p)}x{p.num_kv_splits}", cap=f"{form(other)}x{other.num_kv_splits}",
                             ratio=other.t / g[is_pick].t.iloc[0]))
    df = pd.DataFrame(rows)
    out = ["## The per-scheduler cap's moves (sweep_cap.csv)", "",
           "Cap's pick over the model's pick, same run (< 1: the cap faster).", "",
           "| moves | shapes | geomean | faster > 3% | slower > 3% | range |", "|---|---|---|---|---|---|"]
    narrow = df[~df.fp8 & df.equal]
    for label, part in [("all", df), ("16-bit, equal lengths (d64-scheduler-cap)", narrow),
                        ("16-bit, equal lengths, count moves only (d64-cap-chains)", narrow[narrow.move == "count"]),
                        ("16-bit, equal lengths, form moves", narrow[narrow.move == "form"]),
                        ("fp8 or ragged", df[df.fp8 | ~df.equal])]:
        out.append(f"| {label} | {counts(part.ratio)} |")
    out += ["", "Slower by more than 3%:", ""]
    out += [f"- {r.shape}: {r.pick} -> {r.cap} ({r.move}): {r.ratio:.3f}"
            for r in df[df.ratio > 1.03].sort_values("ratio").itertuples()]
    return out


def d64_section() -> list[str]:
    sweep = pd.read_csv(HERE / "sweep_d64.csv")
    times = config_times(sweep)
    picked = sweep[sweep.kind == "picked"].drop_duplicates("shape").set_index("shape")
    by_share = {0: [], 1: [], 2: []}
    few, many = [], []
    for shape, g in times.groupby("shape"):
        p = picked.loc[shape]
        t_pick = g[g.num_kv_splits == p.num_kv_splits].t.min()
        others = g[g.num_kv_splits != p.num_kv_splits].sort_values("num_kv_splits", ascending=False)
        ratios = [t / t_pick for t in others.t]
        for i, r in enumerate(ratios[:3]):
            by_share[i].append(r)
        (few if p.batch_size * p.num_kv_heads <= 8 else many).append(min(ratios))
    out = ["## Smaller counts of D = 64 crossing one-warp picks (sweep_d64.csv)", "",
           "Time at a smaller count over the pick's, same run.", "",
           "| count | shapes | geomean | faster > 3% | slower > 3% | range |", "|---|---|---|---|---|---|"]
    for i, share in enumerate(("0.85x", "0.7x", "0.55x")):
        out.append(f"| {share} | {counts(by_share[i])} |")
    out += ["", "| the best of the three | shapes | geomean | faster > 3% | slower > 3% | range |",
            "|---|---|---|---|---|---|",
            f"| at most 8 base programs | {counts(few)} |", f"| 9-64 base programs | {counts(many)} |"]
    return out


if __name__ == "__main__":
    print("\n".join(["# H100 config sweeps of 2026-12-05 (written by sweeps_summary.py)", ""]
                    + cap_section() + [""] + d64_section()))
