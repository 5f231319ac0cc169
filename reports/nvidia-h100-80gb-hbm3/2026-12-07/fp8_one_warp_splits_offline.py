"""Offline (no GPU): the H100 random sets' fp8 one-warp picks against the split counts of the same
tile (block_n, block_m, warps, stages) that their tune trials timed: which count ran fastest, and
the pick's time over it. The picks are a tree's model with the H200's properties under the H100's
name, as paired_fp8_warps_offline.py makes them (its --dump).

Usage (the fifty-third part: main at 0264b3c):
    python reports/nvidia-h100-80gb-hbm3/2026-12-07/fp8_one_warp_splits_offline.py TREE
"""
import csv, glob, gzip, json, math, os, subprocess, sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = sorted(glob.glob(str(HERE.parent / "*/tune*_seed*_trials.csv.gz")))
tree = os.path.abspath(sys.argv[1])
dump = subprocess.run([sys.executable, str(HERE / "paired_fp8_warps_offline.py"), "--dump", tree],
                      capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=tree), cwd=tree)
if dump.returncode:
    raise SystemExit(dump.stderr)
picks = json.loads(dump.stdout)
sys.path[:0] = [tree, tree + "/scripts"]
import model_scores as MS  # noqa: E402

rows = []
for f in FILES:
    seed = int(f.split("seed")[1].split("_")[0])
    times = {}
    for r in csv.DictReader(gzip.open(f, "rt")):
        if r["kind"] not in ("trial", "retime") or not r["time_us"]:
            continue
        if r["kind"] == "trial" and r["measured"] != "True":
            continue
        key = tuple(int(r[k]) for k in ("block_n", "block_m", "num_kv_splits", "num_warps", "num_stages"))
        d = times.setdefault(r["specs"], {})
        d[key] = min(d.get(key, 1e30), float(r["time_us"]))
    for name, shape in MS.suite_shapes("random", 40, [seed]):
        name = name.split("/")[-1]
        t = times.get(name)
        c = picks[f"{seed}|{name}"]
        if not t or shape.kv_dtype.itemsize != 1 or c[3] != 1:
            continue
        same = {k[2]: v for k, v in t.items() if (k[0], k[1], k[3], k[4]) == (c[0], c[1], c[3], c[4])}
        if c[2] not in same or len(same) < 2:
            continue
        best = min(same, key=same.get)
        rows.append((best / c[2], seed, name, c, best, same[c[2]] / same[best], shape, sorted(same)))
rows.sort(key=lambda r: r[0])
for ratio, seed, name, c, best, slower, shape, timed in rows:
    chain = math.ceil(shape.max_kv_len / c[2] / c[0])
    print(f"seed{seed} {name:<50} n{c[0]} s{c[2]:<4} best s{best:<4} ({ratio:.2f}x the count) pick {slower:.3f}x"
          f" of it; tiles a split {chain}, programs before splitting {shape.programs(c[1])}, timed {timed}")
fewer = [r for r in rows if r[0] < 1]
print(f"{len(rows)} fp8 one-warp picks with two or more counts of their tile timed: fastest at fewer splits "
      f"{len(fewer)} ({sum(r[5] >= 1.05 for r in fewer)} of them by 5% or more; D = 128 "
      f"{sum(r[6].head_dim == 128 for r in fewer)}), at the pick's {sum(r[0] == 1 for r in rows)}, "
      f"at more {sum(r[0] > 1 for r in rows)}")
