"""Offline (no GPU): the H100 random sets' picks of two splits of one-warp programs against one
split of the same tile (block_n, block_m, warps, stages), where their tune trials timed both, with
the programs an SM before splitting and the tiles one split's programs walk. The picks are a
tree's model with the H200's properties under the H100's name, as paired_fp8_warps_offline.py
makes them (its --dump).

Usage (the fifty-fourth part: main at e26c949):
    python reports/nvidia-h100-80gb-hbm3/2026-12-07/two_splits_offline.py TREE
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
        t, c = times.get(name, {}), picks[f"{seed}|{name}"]
        if c[2] != 2 or c[3] != 1:
            continue
        one = t.get((c[0], c[1], 1, c[3], c[4]))
        if one is None or tuple(c) not in t:
            continue
        chain = math.ceil(shape.max_kv_len / c[0])
        rows.append((shape.head_dim, chain, t[tuple(c)] / one, seed, name, c, shape.programs(c[1]) / 132))
rows.sort()
for d, chain, ratio, seed, name, c, per_sm in rows:
    print(f"seed{seed} {name:<50} n{c[0]} st{c[4]} two/one split {ratio:.3f}; "
          f"programs an SM at one split {per_sm:.2f}, tiles a program at one split {chain}")
print(f"{len(rows)} one-warp two-split picks with one split of their tile timed: one split faster by 5% "
      f"or more at {sum(r[2] >= 1.05 for r in rows)}, two splits faster by 5% or more at "
      f"{sum(r[2] <= 1 / 1.05 for r in rows)}")
