"""Offline (no GPU): two trees' model picks on the H100 random sets (the tune trials committed beside
this file and in ../2026-12-05, ../2026-12-06), each pick looked up in its set's own tune trials as
scripts/model_scores.py looks up the H200 timings; the model runs with the H200's properties under
the H100's name (the model reads the same SMs, shared memory and registers).

Usage (the forty-eighth part: main at e928c1b against main + reports/candidates/paired-fp8-warps.patch):
    python reports/nvidia-h100-80gb-hbm3/2026-12-07/paired_fp8_warps_offline.py MAIN_TREE CANDIDATE_TREE
"""
import csv, glob, gzip, json, math, os, subprocess, sys
from pathlib import Path

REPORTS = Path(__file__).resolve().parents[1]
FILES = sorted(glob.glob(str(REPORTS / "*/tune*_seed*_trials.csv.gz")))

def dump(tree):
    sys.path[:0] = [tree, str(Path(tree) / "scripts")]
    import model_scores as MS
    from tsdecode.device import DeviceProperties
    from tsdecode.config.heuristic import heuristic_config
    from tsdecode.config.select import scale_splits_to_raggedness
    dev = DeviceProperties(**{**MS.H200, "name": "NVIDIA H100 80GB HBM3"})
    out = {}
    for f in FILES:
        seed = int(f.split("seed")[1].split("_")[0])
        for name, shape in MS.suite_shapes("random", 40, [seed]):
            c, _ = scale_splits_to_raggedness(heuristic_config(shape, dev), shape, dev)
            out[f"{seed}|{name.split('/')[-1]}"] = [c.block_n, c.block_m, c.num_kv_splits, c.num_warps, c.num_stages]
    json.dump(out, sys.stdout)

if len(sys.argv) > 2 and sys.argv[1] == "--dump":
    dump(sys.argv[2]); sys.exit(0)

main_tree, cand_tree = sys.argv[1], sys.argv[2]
def picks(tree):
    r = subprocess.run([sys.executable, __file__, "--dump", tree], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=tree), cwd=tree)
    if r.returncode: raise SystemExit(r.stderr)
    return json.loads(r.stdout)
A, B = picks(main_tree), picks(cand_tree)
sys.path[:0] = [main_tree, main_tree + "/scripts"]
import model_scores as MS
from tsdecode.config.space import KernelConfig
tot = dict(both=0, moved=0, a5=0, b5=0, a10=0, b10=0, n=0)
rows = []; allratios = []
for f in FILES:
    seed = int(f.split("seed")[1].split("_")[0])
    times = {}
    for r in csv.DictReader(gzip.open(f, "rt")):
        if r["kind"] not in ("trial", "retime") or not r["time_us"]: continue
        if r["kind"] == "trial" and r["measured"] != "True": continue
        key = tuple(int(r[k]) for k in ("block_n", "block_m", "num_kv_splits", "num_warps", "num_stages"))
        d = times.setdefault(r["specs"], {}); d[key] = min(d.get(key, 1e30), float(r["time_us"]))
    for name, shape in MS.suite_shapes("random", 40, [seed]):
        name = name.split("/")[-1]; t = times.get(name)
        if not t: continue
        a = KernelConfig(*A[f"{seed}|{name}"]); b = KernelConfig(*B[f"{seed}|{name}"])
        ta, tb = MS.measured_time(a, t, shape), MS.measured_time(b, t, shape)
        best = min(t.values()); bestc = min(t, key=t.get)
        if a != b:
            tot["moved"] += 1
            rows.append((seed, name, a, b, None if ta is None else ta / best, None if tb is None else tb / best, bestc))
        if ta is not None and tb is not None:
            tot["both"] += 1
            tot["a5"] += ta / best <= 1.05; tot["b5"] += tb / best <= 1.05
            tot["a10"] += ta / best <= 1.10; tot["b10"] += tb / best <= 1.10
        tot["n"] += 1
fm = lambda c: f"n{c.block_n} s{c.num_kv_splits} w{c.num_warps} st{c.num_stages}"
g = lambda x: "untimed" if x is None else f"{x:.3f}"
for seed, name, a, b, ra, rb, bc in rows:
    print(f"seed{seed} {name:<48} {fm(a):<18} {g(ra):>7} -> {fm(b):<18} {g(rb):>7}   best n{bc[0]} s{bc[2]} w{bc[3]} st{bc[4]}")
print(f"{tot['n']} shapes of {len(FILES)} sets; {tot['moved']} picks move; both picks timed at {tot['both']}: "
      f"within 5% main {tot['a5']}, candidate {tot['b5']}; within 10% main {tot['a10']}, candidate {tot['b10']}")
both = [(ra, rb) for *_, ra, rb, _ in rows if ra is not None and rb is not None]
if both:
    gm = math.exp(sum(math.log(ra / rb) for ra, rb in both) / len(both))
    print(f"moved and both timed: {len(both)}, geomean main/candidate {gm:.3f}, candidate faster {sum(ra > rb for ra, rb in both)}, slower {sum(ra < rb for ra, rb in both)}")
