#!/usr/bin/env python3
"""The shapes of the pooled sets whose pick today differs from the one their A/B timed.

The pooled model-against-tune figure (``../2026-12-05/pooled_model_vs_tune.py``) takes each of
the twenty-two fresh sets from the latest A/B that measured it in full, and those A/Bs ran older
trees. This lists, per set, the shapes where this tree's plan on an H200 (the shipped H200 table,
else the model; lengths as ``scripts/ab_trees.py`` draws them) picks another config than the A/B's
B side did, so that only those need timing again against the set's tune:

    python3 scripts/ab_trees.py --other <any tree> --suites random --seed N --count 40 \\
        --tuned-table reports/nvidia-h200/<date>/tuned_seedN.json --only <names> --csv ...

Run from the repository root with no GPU; writes ``pooled_moved_shapes.csv`` beside this file
(seed, shape, the A/B's pick, today's pick, the A/B's ratio to the tune) and prints one line per
seed: its moved names, comma-separated, for ``--only`` (kept as ``pooled_moved_shapes.txt``).

``--pool DIR``: the pooled figure again, each moved shape's ratio taken from the
``ab_pooled_seed<N>.csv`` that loop wrote into DIR (the other 644 from the counted A/Bs), with
the moved shapes DIR lacks named.
"""
import csv
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import ab_trees  # noqa: E402
import model_scores  # noqa: E402
from tsdecode.config.select import select_config  # noqa: E402
from tuner.measure import seq_lens_for  # noqa: E402

spec = importlib.util.spec_from_file_location(
    "pooled", ROOT / "reports/nvidia-h200/2026-12-05/pooled_model_vs_tune.py")
pooled = importlib.util.module_from_spec(spec)
_argv, sys.argv = sys.argv, [sys.argv[0], str(ROOT)]
spec.loader.exec_module(pooled)
sys.argv = _argv


def config_text(config) -> str:
    return (f"KernelConfig(block_n={config.block_n}, block_m={config.block_m}, "
            f"num_kv_splits={config.num_kv_splits}, num_warps={config.num_warps}, num_stages={config.num_stages})")


def pool(folder: Path) -> int:
    """The pooled within-5% and within-10% counts with the moved shapes re-timed (``--pool``)."""
    with open(Path(__file__).with_name("pooled_moved_shapes.csv"), newline="") as f:
        moved = {(int(r["seed"]), r["shape"]) for r in csv.DictReader(f)}
    ratios, missing = [], []
    for seed, name in sorted(pooled.FILES.items()):
        with open(ROOT / "reports/nvidia-h200" / name, newline="") as f:
            counted = {r["shape"]: float(r["b_over_tuned"]) for r in csv.DictReader(f) if r["suite"] == "random"}
        path = folder / f"ab_pooled_seed{seed}.csv"
        again = {}
        if path.exists():
            with open(path, newline="") as f:
                again = {r["shape"]: float(r["b_over_tuned"]) for r in csv.DictReader(f) if r.get("b_over_tuned")}
        for shape, ratio in counted.items():
            if (seed, shape) in moved:
                if shape not in again:
                    missing.append(f"{seed}/{shape}")
                    continue
                ratio = again[shape]
            ratios.append(ratio)
    n = len(ratios)
    print(f"pooled over {n} shapes ({len(moved) - len(missing)} of {len(moved)} moved ones re-timed): "
          f"within 5% at {sum(r <= 1.05 for r in ratios)} ({100 * sum(r <= 1.05 for r in ratios) / n:.1f}%), "
          f"within 10% at {sum(r <= 1.10 for r in ratios)} ({100 * sum(r <= 1.10 for r in ratios) / n:.1f}%), "
          f"worst {max(ratios):.3f}")
    if missing:
        print(f"moved shapes not re-timed (left out): {', '.join(missing)}")
    return 0


def main() -> int:
    import dataclasses

    if len(sys.argv) > 2 and sys.argv[1] == "--pool":
        return pool(Path(sys.argv[2]))
    device = model_scores.h200()
    rows, moved_total, total = [], 0, 0
    for seed, name in sorted(pooled.FILES.items()):
        with open(ROOT / "reports/nvidia-h200" / name, newline="") as f:
            timed = {r["shape"]: r for r in csv.DictReader(f) if r["suite"] == "random"}
        moved = []
        for shape_spec in ab_trees.random_shapes(40, seed):
            r = timed.get(shape_spec.name)
            if r is None:
                continue
            lens = seq_lens_for(shape_spec, torch.Generator().manual_seed(1))
            shape = dataclasses.replace(shape_spec.to_problem_shape(),
                                        kv_len_spread=max(1.0, max(lens) * len(lens) / sum(lens)))
            now = config_text(select_config(shape, device).kernel_config)
            total += 1
            if now != r["b_config"]:
                moved.append(shape_spec.name)
                rows.append(dict(seed=seed, shape=shape_spec.name, ab_config=r["b_config"], today_config=now,
                                 ab_over_tuned=r["b_over_tuned"]))
        moved_total += len(moved)
        print(f"{seed} {','.join(moved)}")
    out = Path(__file__).with_name("pooled_moved_shapes.csv")
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["seed", "shape", "ab_config", "today_config", "ab_over_tuned"])
        w.writeheader()
        w.writerows(rows)
    print(f"# {moved_total} of {total} shapes pick another config today; {out.name} written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
