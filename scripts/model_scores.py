"""The config model's picks scored against the committed H200 timings, with no GPU.

Per source of ``tests/data/h200_timings.csv.xz``: how many of the model's picks were measured,
their geometric mean against each shape's best measured time, and the share within 5% and 10%
(what ``tests/test_heuristic.py`` pins). A pick counts as measured where a measured config has its
tile, warps and stages, a split count within SPLITS_TOLERANCE and as many waves of programs.

With ``--other TREE`` (another source tree, e.g. the previous main checked out or copied), the
same scores for that tree's model beside this one's, and every pick of the timings' shapes that
differs between the two with its measured ratio; with ``--suites`` as well, the picks that differ
on ``scripts/ab_trees.py``'s suites (the lengths its inputs draw), so an A/B's moved picks are
known before the GPU call. ``--misses R`` lists this tree's picks slower than R x the best.
``--untimed CSV`` writes this tree's unmeasured picks of the timings' shapes (with ``--other``,
those that differ from the other tree's, and its pick beside each), with their source (``src``),
for ``scripts/sweep_configs.py --configs`` to time in one device call; ``scripts/add_timings.py
--src-from`` that list adds the sweep's rows under their sources.

Usage: python scripts/model_scores.py
       python scripts/model_scores.py --misses 1.10 --src O,P
       python scripts/model_scores.py --other .prev --suites targets,heldout,random --seed 37
       python scripts/model_scores.py --other .prev --suites random --seed 79,83,89
       python scripts/model_scores.py --other .prev --untimed untimed.csv
"""

from __future__ import annotations

import argparse
import csv
import lzma
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "h200_timings.csv.xz"
CONFIG_FIELDS = ("block_n", "block_m", "num_kv_splits", "num_warps", "num_stages")
# The sweeps measured split counts about a factor 1.26 apart.
SPLITS_TOLERANCE = 1.26
H200 = dict(name="NVIDIA H200", sm_count=132, compute_capability=(9, 0), shared_memory_per_sm=233472)


def h200():
    from tsdecode.device import DeviceProperties

    return DeviceProperties(**H200)


def load_timings(path: Path = DATA) -> dict:
    """{(src, shape name): (ProblemShape, {config tuple: time_us})}, each measured config keyed by
    what it runs as today (``fit_config``; the least time where two now run alike)."""
    import torch

    from tsdecode.config.space import KernelConfig, ProblemShape, fit_config

    with lzma.open(path, "rt") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    groups: dict = {}
    for r in rows:
        key = (r["src"], r["shape"])
        if key not in groups:
            shape = ProblemShape(
                batch_size=int(r["batch_size"]), max_kv_len=int(r["max_kv_len"]),
                num_qo_heads=int(r["num_qo_heads"]), num_kv_heads=int(r["num_kv_heads"]),
                head_dim=int(r["head_dim"]), page_size=int(r["page_size"]),
                kv_dtype=getattr(torch, r["kv_dtype"]), window_left=int(r["window_left"]),
                mask_kind=r["mask_kind"], kv_len_spread=float(r["spread"]))
            groups[key] = (shape, {})
        config = fit_config(KernelConfig(**{k: int(r[k]) for k in CONFIG_FIELDS}), groups[key][0])[0]
        fields, time_us = tuple(getattr(config, k) for k in CONFIG_FIELDS), float(r["time_us"])
        times = groups[key][1]
        times[fields] = min(time_us, times.get(fields, time_us))
    return groups


def model_pick(shape):
    """What a plan without a table gets on the H200."""
    from tsdecode.config.heuristic import heuristic_config
    from tsdecode.config.select import scale_splits_to_raggedness
    from tsdecode.config.space import fit_config

    device = h200()
    config, _ = scale_splits_to_raggedness(heuristic_config(shape, device), shape, device)
    return fit_config(config, shape)[0]


def measured_time(config, timings: dict, shape) -> float | None:
    """The time of the measured config nearest ``config``: its tile, warps and stages, a split
    count within SPLITS_TOLERANCE and the same number of waves (a neighbour that spills into
    another wave stands in for nothing)."""
    from tsdecode.config.residency import resident_programs_per_sm

    device = h200()
    wave = resident_programs_per_sm(config, shape, device) * device.sm_count
    base = shape.batch_size * shape.num_kv_heads * -(-shape.rows_per_kv_head // config.block_m)
    waves = -(-base * config.num_kv_splits // wave)
    near = [(abs(math.log(c[2] / config.num_kv_splits)), t) for c, t in timings.items()
            if (c[0], c[1], c[3], c[4]) == (config.block_n, config.block_m, config.num_warps, config.num_stages)
            and abs(math.log(c[2] / config.num_kv_splits)) <= math.log(SPLITS_TOLERANCE)
            and (c[2] == 1) == (config.num_kv_splits == 1) and -(-base * c[2] // wave) == waves]
    return min(near)[1] if near else None


def ratios(groups: dict, picks: dict) -> dict:
    """{(src, shape name): measured pick / best, or None where the pick was not measured}."""
    out = {}
    for key, (shape, timings) in groups.items():
        t = measured_time(_config(picks[key]), timings, shape)
        out[key] = None if t is None else t / min(timings.values())
    return out


def scores(groups: dict, picks: dict | None = None) -> dict[str, dict[str, float]]:
    """Per source: measured picks, geometric mean of pick / best, shares within 5% and 10%."""
    picks = picks if picks is not None else {key: _fields(model_pick(shape)) for key, (shape, _) in groups.items()}
    by_src: dict[str, list[float]] = {}
    for (src, _), r in ratios(groups, picks).items():
        by_src.setdefault(src, [])
        if r is not None:
            by_src[src].append(r)
    nan = float("nan")  # a source none of whose picks was measured
    return {src: dict(measured=len(r), geomean=math.exp(sum(map(math.log, r)) / len(r)) if r else nan,
                      within5=sum(x <= 1.05 for x in r) / len(r) if r else nan,
                      within10=sum(x <= 1.10 for x in r) / len(r) if r else nan)
            for src, r in by_src.items()}


def suite_shapes(suites: str, count: int, seeds: list[int]) -> list[tuple[str, object]]:
    """(name, ProblemShape) of ab_trees.py's suites, with the spread of the lengths its inputs draw;
    the random suite once per seed (named ``random/seedN/...`` where there are several)."""
    import dataclasses

    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from ab_trees import suite_shapes as ab_suite_shapes
    from tuner.measure import seq_lens_for

    out = {}
    for seed in seeds:
        for suite, spec in ab_suite_shapes(suites.split(","), count, seed):
            lens = seq_lens_for(spec, torch.Generator().manual_seed(1))  # make_inputs(seed=1)'s draw
            spread = max(1.0, max(lens) * len(lens) / sum(lens))
            name = f"{suite}/seed{seed}/{spec.name}" if suite == "random" and len(seeds) > 1 else f"{suite}/{spec.name}"
            out[name] = dataclasses.replace(spec.to_problem_shape(), kv_len_spread=spread)
    return list(out.items())


def _fields(config) -> list[int]:
    return [getattr(config, k) for k in CONFIG_FIELDS]


def _config(fields):
    from tsdecode.config.space import KernelConfig

    return KernelConfig(**dict(zip(CONFIG_FIELDS, fields)))


def _picks(args) -> dict[str, list[int]]:
    """This tree's picks, keyed "src|shape" for the timings and "suite/shape" for --suites."""
    picks = {f"{src}|{name}": _fields(model_pick(shape)) for (src, name), (shape, _) in load_timings().items()}
    if args.suites:
        picks.update({name: _fields(model_pick(shape)) for name, shape in suite_shapes(args.suites, args.count, args.seed)})
    return picks


def _other_picks(args) -> dict[str, list[int]]:
    """The other tree's picks: this script in a subprocess with that tree first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(args.other).resolve()), str(ROOT)]))
    cmd = [sys.executable, __file__, "--tree", str(Path(args.other).resolve()), "--dump-picks"]
    if args.suites:
        cmd += ["--suites", args.suites, "--count", str(args.count), "--seed", ",".join(map(str, args.seed))]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the other tree's model failed ({args.other}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


SHAPE_FIELDS = ("batch_size", "max_kv_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "kv_dtype",
                "window_left", "mask_kind", "spread")


def write_untimed(path: str, groups: dict, ratios_now: dict, mine: dict, theirs: dict | None) -> int:
    """One row per (source, shape, config) to time: this tree's unmeasured picks (with ``theirs``,
    those that differ from the other tree's, and its pick beside each); the shape as the timings
    record it. Returns the rows written."""
    rows = []
    for (src, name), r in sorted(ratios_now.items()):
        if r is not None or (theirs and theirs[f"{src}|{name}"] == mine[f"{src}|{name}"]):
            continue
        shape = groups[(src, name)][0]
        fields = dict(src=src, shape=name, batch_size=shape.batch_size, max_kv_len=shape.max_kv_len,
                      num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                      page_size=shape.page_size, kv_dtype=str(shape.kv_dtype).removeprefix("torch."),
                      window_left=shape.window_left, mask_kind=shape.mask_kind, spread=shape.kv_len_spread)
        configs = [mine[f"{src}|{name}"]] + ([theirs[f"{src}|{name}"]] if theirs else [])
        for config in dict.fromkeys(map(tuple, configs)):
            rows.append(dict(fields, **dict(zip(CONFIG_FIELDS, config))))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["src", "shape", *SHAPE_FIELDS, *CONFIG_FIELDS])
        writer.writeheader()
        writer.writerows(rows)
    return len(rows)


def _row(s: dict) -> str:
    return f"{s['measured']:>4} {s['geomean']:.4f} {s['within5']:6.1%} {s['within10']:6.1%}"


def _short(fields) -> str:
    return "n{} m{} s{} w{} st{}".format(*fields)


def _ratio(x: float | None) -> str:
    return "untimed" if x is None else f"{x:.3f}"


def _seeds(text: str) -> list[int]:
    try:
        return [int(seed) for seed in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed wants integers, comma-separated (e.g. 79,83), got {text!r}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", default=None, help="root of another source tree to compare with")
    ap.add_argument("--suites", default=None, help="with --other: ab_trees.py suites (targets, heldout, random)")
    ap.add_argument("--count", type=int, default=40)
    ap.add_argument("--seed", type=_seeds, default=[2], help="the random suite's seed, or several, comma-separated")
    ap.add_argument("--src", default=None, help="comma-separated sources to list (--misses, differing picks)")
    ap.add_argument("--misses", type=float, default=None, help="list this tree's picks slower than this x best")
    ap.add_argument("--untimed", default=None, help="write this tree's unmeasured picks (CSV) to time")
    ap.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dump-picks", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, args.tree or str(ROOT))
    if args.dump_picks:
        json.dump(_picks(args), sys.stdout)
        return 0
    if args.suites and not args.other:
        ap.error("--suites compares picks: give --other TREE")
    keep = set(args.src.split(",")) if args.src else None
    groups = load_timings()
    timed = {f"{src}|{name}": (src, name) for src, name in groups}
    mine = _picks(args)
    mine_r = ratios(groups, {key: mine[name] for name, key in timed.items()})
    now = scores(groups, {key: mine[name] for name, key in timed.items()})
    theirs = _other_picks(args) if args.other else None
    print("src  measured geomean within5 within10" + ("   (other tree)" if theirs else ""))
    if theirs:
        theirs_r = ratios(groups, {key: theirs[name] for name, key in timed.items()})
        then = scores(groups, {key: theirs[name] for name, key in timed.items()})
    for src in sorted(now, key=lambda s: (s != "T", s)):
        print(f"{src:<4} {_row(now[src])}" + (f"   {_row(then[src])}" if theirs else ""))
    if theirs:
        print("\npicks that differ (other tree -> this one; measured pick / best):")
        for name in sorted(mine):
            if mine[name] == theirs[name] or (keep and name in timed and timed[name][0] not in keep):
                continue
            extra = f"  {_ratio(theirs_r[timed[name]])} -> {_ratio(mine_r[timed[name]])}" if name in timed else ""
            print(f"  {name}: {_short(theirs[name])} -> {_short(mine[name])}{extra}")
    if args.untimed:
        count = write_untimed(args.untimed, groups, mine_r, mine, theirs)
        print(f"\n{count} configs to time written to {args.untimed}")
    if args.misses:
        print(f"\nthis tree's picks slower than {args.misses} x the best measured:")
        for key, x in sorted(mine_r.items()):
            if (keep is None or key[0] in keep) and (x is None or x > args.misses):
                timings = groups[key][1]
                best = min(timings, key=timings.get)
                print(f"  {key[0]} {key[1]}: {_short(mine['|'.join(key)])} {_ratio(x)}, "
                      f"best {_short(best)} {timings[best]:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
