"""Offline (no GPU): the model's picks on an H100 that reports no bandwidth (64 KiB in flight an SM,
today's main) and on one that reports its 3.35 TB/s (the bandwidth-in-flight candidate's 44 KiB),
each looked up in the H100 random sets' own tune trials (committed beside this file and in
../2026-12-05, ../2026-12-06) as scripts/model_scores.py looks up the H200 timings.

Usage, from a tree with reports/candidates/bandwidth-in-flight.patch applied:
    python reports/nvidia-h100-80gb-hbm3/2026-12-07/bandwidth_in_flight_offline.py
"""
import csv, dataclasses, glob, gzip, math, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts")); sys.path.insert(0, str(ROOT))
import model_scores as MS
from tsdecode.device import DeviceProperties
from tsdecode.config.heuristic import heuristic_config
from tsdecode.config.select import scale_splits_to_raggedness

H100_64 = DeviceProperties(**{**MS.H200, "name": "NVIDIA H100 80GB HBM3"})
H100_BW = dataclasses.replace(H100_64, memory_bandwidth=3.35e12)

def pick(shape, dev):
    c, _ = scale_splits_to_raggedness(heuristic_config(shape, dev), shape, dev)
    return c

files = sorted(glob.glob(str(ROOT / "reports/nvidia-h100-80gb-hbm3/*/tune*_seed*_trials.csv.gz")))
tot = dict(both=0, moved=0, a5=0, b5=0, a10=0, b10=0, n=0)
rows = []
for f in files:
    seed = int(f.split("seed")[1].split("_")[0])
    times = {}
    for r in csv.DictReader(gzip.open(f, "rt")):
        if r["kind"] not in ("trial", "retime") or not r["time_us"]:
            continue
        if r["kind"] == "trial" and r["measured"] != "True":
            continue
        key = (int(r["block_n"]), int(r["block_m"]), int(r["num_kv_splits"]), int(r["num_warps"]), int(r["num_stages"]))
        d = times.setdefault(r["specs"], {})
        d[key] = min(d.get(key, 1e30), float(r["time_us"]))
    for name, shape in MS.suite_shapes("random", 40, [seed]):
        name = name.split("/")[-1]
        t = times.get(name)
        if not t:
            continue
        a, b = pick(shape, H100_64), pick(shape, H100_BW)
        ta, tb = MS.measured_time(a, t, shape), MS.measured_time(b, t, shape)
        best = min(t.values())
        if a != b:
            tot["moved"] += 1
            rows.append((seed, name, a, b, None if ta is None else ta / best, None if tb is None else tb / best))
        if ta is not None and tb is not None:
            tot["both"] += 1
            tot["a5"] += ta / best <= 1.05; tot["b5"] += tb / best <= 1.05
            tot["a10"] += ta / best <= 1.10; tot["b10"] += tb / best <= 1.10
        tot["n"] += 1
f = lambda c: f"n{c.block_n} s{c.num_kv_splits} w{c.num_warps} st{c.num_stages}"
g = lambda x: "untimed" if x is None else f"{x:.3f}"
for seed, name, a, b, ra, rb in rows:
    print(f"seed{seed} {name:<48} {f(a):<18} {g(ra):>7} -> {f(b):<18} {g(rb):>7}")
print(f"{tot['n']} shapes of {len(files)} sets; {tot['moved']} picks move; both picks timed at {tot['both']}: "
      f"within 5% main {tot['a5']}, candidate {tot['b5']}; within 10% main {tot['a10']}, candidate {tot['b10']}")
both = [(ra, rb) for *_, ra, rb in rows if ra is not None and rb is not None]
if both:
    gm = math.exp(sum(math.log(ra / rb) for ra, rb in both) / len(both))
    print(f"moved and both timed: {len(both)}, geomean main/candidate {gm:.3f}, candidate faster {sum(ra > rb for ra, rb in both)}, slower {sum(ra < rb for ra, rb in both)}")
