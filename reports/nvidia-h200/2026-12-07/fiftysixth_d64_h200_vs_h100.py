"""Offline (no GPU): the D = 64 two-split list timed on both GPUs, shape by shape.

Each of the 48 equal-length 16-bit D = 64 shapes of
``reports/nvidia-h100-80gb-hbm3/2026-12-07/configs_fiftyfourth_d64_two_splits.csv`` (where the
model picks two one-warp splits) was timed at two splits and at one split of the same tile: on
the H100 in the fifty-fifth part (``sweep_fiftyfifth_d64_two_splits.csv``) and on the H200 in the
fifty-sixth (``sweep_fiftysixth_d64_two_splits.csv``, beside this file). Printed per shape: the
tiles a program walks unsplit, the programs an SM at one split, the two/one time on each GPU.

Usage (the fifty-sixth part: main at 7ae525f):
    python reports/nvidia-h200/2026-12-07/fiftysixth_d64_h200_vs_h100.py TREE
"""
import sys
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
H100 = HERE.parents[1] / "nvidia-h100-80gb-hbm3" / "2026-12-07"
tree = str(Path(sys.argv[1]).resolve())
sys.path[:0] = [tree, tree + "/scripts"]
import model_scores as MS  # noqa: E402
from tsdecode.config.family import occupancy  # noqa: E402
from tsdecode.device import DeviceProperties  # noqa: E402

dev = DeviceProperties(**MS.H200)


def gm(x):
    return float(np.exp(np.log(np.asarray(x)).mean()))


def two_over_one(path):
    sweep = pd.read_csv(path)
    sweep = sweep[sweep.kind == "short"]
    out = {}
    for name, g in sweep.groupby("shape"):
        t = {int(r.num_kv_splits): r.time_us for r in g.itertuples()}
        out[name] = (t[2] / t[1], t[1])
    return out


cfg = pd.read_csv(H100 / "configs_fiftyfourth_d64_two_splits.csv")
h100 = two_over_one(H100 / "sweep_fiftyfifth_d64_two_splits.csv")
h200 = two_over_one(HERE / "sweep_fiftysixth_d64_two_splits.csv")
shapes = {}
for seed in sorted({int(s[4:]) for s in cfg.src}):
    for name, shape in MS.suite_shapes("random", 40, [seed]):
        shapes[name.split("/")[-1]] = shape
rows = []
for name in sorted(set(cfg["shape"])):
    shape = shapes[name]
    occ = occupancy(shape, dev)
    rows.append((occ.base_programs / dev.sm_count, shape.max_visible_tiles(occ.config.block_n), name,
                 occ.config.num_stages, h100[name][0], h200[name][0], h200[name][1]))
rows.sort()
print(f"{'shape':<40} {'programs an SM':>14} {'tiles':>6} {'stages':>6}  two/one: H100   H200  (H200 one split, us)")
for per_sm, tiles, name, stages, a, b, one in rows:
    print(f"{name:<40} {per_sm:14.2f} {tiles:6d} {stages:6d}          {a:6.3f} {b:6.3f}  ({one:.1f})")


def classes(sel, label):
    a = np.array([r[4] for r in sel])
    b = np.array([r[5] for r in sel])
    def one(r):
        return (f"one split faster by 5% or more at {(r >= 1.05).sum()}, two at {(r <= 1 / 1.05).sum()}, "
                f"geomean two/one {gm(r):.3f}")
    agree = ((a >= 1.05) == (b >= 1.05)) & ((a <= 1 / 1.05) == (b <= 1 / 1.05))
    print(f"{label} ({len(sel)} shapes): H100 {one(a)}; H200 {one(b)}; same class on both at {agree.sum()}")


print()
classes([r for r in rows if r[1] <= 100], "tiles unsplit at most 100")
classes([r for r in rows if r[1] > 100], "tiles unsplit past 100")
classes([r for r in rows if r[0] < 3], "below three programs an SM")
classes([r for r in rows if r[0] >= 3], "three programs an SM or more")
both = np.array([[r[4], r[5]] for r in rows])
print(f"all 48: geomean two/one H100 {gm(both[:, 0]):.3f}, H200 {gm(both[:, 1]):.3f}; "
      f"correlation of log ratios {np.corrcoef(np.log(both.T))[0, 1]:.2f}")
