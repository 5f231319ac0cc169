"""Offline (no GPU): the fifty-fifth part's two H100 sweeps, read against a tree's config model.

- D = 64 two splits (``sweep_fiftyfifth_d64_two_splits.csv``): each of the 48 shapes of
  ``configs_fiftyfourth_d64_two_splits.csv`` timed at its one-warp pick of two splits and at one
  split of the same tile; printed with the tiles a program walks unsplit and the model clock's
  two/one ratio (``splits._time``, the H200's properties under the H100's name, as
  paired_fp8_warps_offline.py makes the picks).
- fp8 one-warp counts at half (``sweep_fiftyfifth_fp8_half_splits.csv``): the 185 shapes of
  ``configs_fiftyfourth_fp8_half_splits.csv`` timed at the pick's count and at half of it.

Usage (the fifty-fifth part: main at 3eb519a):
    python reports/nvidia-h100-80gb-hbm3/2026-12-07/fiftyfifth_sweeps_offline.py TREE
"""
import math, sys
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
tree = str(Path(sys.argv[1]).resolve())
sys.path[:0] = [tree, tree + "/scripts"]
import model_scores as MS  # noqa: E402
from tsdecode.config import splits as SP  # noqa: E402
from tsdecode.config.family import occupancy  # noqa: E402
from tsdecode.config.heuristic import heuristic_config  # noqa: E402
from tsdecode.device import DeviceProperties  # noqa: E402

dev = DeviceProperties(**{**MS.H200, "name": "NVIDIA H100 80GB HBM3"})


def gm(x):
    return float(np.exp(np.log(np.asarray(x)).mean()))


def split_classes(ratios, label):
    r = np.asarray(ratios)
    return (f"{len(r)} shapes: {label[0]} faster by 5% or more at {(r >= 1.05).sum()}, {label[1]} at "
            f"{(r <= 1 / 1.05).sum()}, within 5% at {((r < 1.05) & (r > 1 / 1.05)).sum()}; "
            f"geomean {label[1]}/{label[0]} time {gm(r):.3f}, range {r.min():.3f}-{r.max():.3f}")


print("== D = 64: two one-warp splits against one split of the same tile (H100 timings) ==")
cfg = pd.read_csv(HERE / "configs_fiftyfourth_d64_two_splits.csv")
sweep = pd.read_csv(HERE / "sweep_fiftyfifth_d64_two_splits.csv")
sweep = sweep[sweep.kind == "short"]
shapes = {}
for seed in sorted({int(s[4:]) for s in cfg.src}):
    for name, shape in MS.suite_shapes("random", 40, [seed]):
        shapes[(seed, name.split("/")[-1])] = shape
rows = []
for (src, name), _ in cfg.groupby(["src", "shape"]):
    shape = shapes[(int(src[4:]), name)]
    occ = occupancy(shape, dev)
    pick = heuristic_config(shape, dev)
    t = {int(r.num_kv_splits): r.time_us for r in sweep[sweep["shape"] == name].itertuples()}
    clock = SP._time(shape, occ, 2, dev.sm_count) / SP._time(shape, occ, 1, dev.sm_count)
    tiles = shape.max_visible_tiles(occ.config.block_n)
    rows.append((tiles, name, occ.config.block_n, pick.num_kv_splits, occ.tiles_in_flight,
                 occ.base_programs / dev.sm_count, clock, t[2] / t[1], t[1]))
rows.sort()
for tiles, name, n, pick, tif, per_sm, clock, measured, one in rows:
    print(f"{name:<40} n{n} pick {pick} tiles unsplit {tiles:5d} programs an SM {per_sm:5.2f} "
          f"tiles in flight {tif:.1f}  two/one: clock {clock:.3f} measured {measured:.3f} (one split {one:.1f} us)")
for lo, hi in ((0, 100), (100, 10 ** 9)):
    part = [r for r in rows if lo < r[0] <= hi]
    print(f"tiles unsplit {lo + 1}-{hi if hi < 10 ** 9 else 'up'}: "
          + split_classes([r[7] for r in part], ("one split", "two splits"))
          + f"; the clock's two/one {min(r[6] for r in part):.3f}-{max(r[6] for r in part):.3f}")

print("\n== fp8 one-warp counts: half against the pick's count (H100 timings) ==")
half = pd.read_csv(HERE / "sweep_fiftyfifth_fp8_half_splits.csv")
half = half[half.kind == "short"]
out = []
for name, g in half.groupby("shape", sort=False):
    t = {int(r.num_kv_splits): r.time_us for r in g.itertuples()}
    fewer, count = sorted(t)  # ragged shapes' counts as scaled to their lengths
    r = g.iloc[0]
    out.append(dict(shape=name, head_dim=r.head_dim, ragged=r.ragged, count=count, half=fewer,
                    ratio=t[fewer] / t[count]))
out = pd.DataFrame(out)
print("all " + split_classes(out.ratio, ("the count", "half")))
for d, g in out.groupby("head_dim"):
    print(f"D = {d}: " + split_classes(g.ratio, ("the count", "half")))
for flag, g in out.groupby("ragged"):
    print(f"{'ragged' if flag else 'equal lengths'}: " + split_classes(g.ratio, ("the count", "half")))
print("half faster by 5% or more:")
print(out[out.ratio <= 1 / 1.05].sort_values("ratio").to_string(index=False))

print("\n== the H200 timings' pairs of the same class (tests/data/h200_timings.csv.xz) ==")
print("equal lengths, 16-bit D = 64, 32-token one-warp five-stage tiles timed at two splits and one")
pairs = []
for (src, name), (shape, t) in MS.load_timings().items():
    if shape.head_dim != 64 or shape.kv_dtype.itemsize != 2 or shape.kv_len_spread >= SP.RAGGED_SPREAD:
        continue
    for c, two in t.items():
        if c[0] == 32 and c[2] == 2 and c[3] == 1 and c[4] == 5 and (32, c[1], 1, 1, 5) in t:
            pairs.append((shape.programs(c[1]) / dev.sm_count, math.ceil(shape.max_kv_len / 32), src, name,
                          two / t[(32, c[1], 1, 1, 5)]))
for per_sm, tiles, src, name, ratio in sorted(pairs):
    print(f"{src:<3} {name:<40} programs an SM {per_sm:5.2f} tiles unsplit {tiles:5d} two/one measured {ratio:.3f}")
