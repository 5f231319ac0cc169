"""Same-run A/B of two source trees of tsdecode (e.g. the previous main against this one).

Both trees are imported into one process (the other tree as the package ``tsdecode_other``), so
every shape's inputs are made once and the two trees' picks (tuned table or heuristic, no explicit
config) are timed in interleaved rounds with the anchors' CUDA-graph method. The other tree may
use the old call form (``plan(block_tables, seq_lens_kv, ...)``, ``run(q, cache, out=)``) or the
FlashInfer one (``plan(device, batch_size, ...)``, ``run(q, cache, seq_lens, block_tables, ...)``):
a small adapter tells them apart. ``--tuned-table`` adds a third column: the entry of that table
for the shape's exact bucket, run as an explicit config (a short ``tsdecode-tune`` of the same
shapes), so the pick can be compared with a tuned best in the same call; where the tune's trials
CSV lies beside the table, each shape's count of timed configs too, and the comparison again over
the shapes the tune searched (a time budget that ran out leaves a shape at the model's own pick).
``--control`` adds this tree a second time ("B2"): its ratio to B is the method's own noise floor.
``--moved-only`` times only the shapes whose two picks differ (each tree plans the shape's lengths
first, with no tensors): with several seeds (``--seed 300-339``), an A/B of a config-model change
over the few shapes of many random sets that it moves. A plan on a GPU takes milliseconds, so
over thousands of shapes name the moved ones with ``--only`` as well (``model_scores.py
--suites`` lists them with no GPU). ``--only`` keeps the shapes whose name (``seedN/<shape>``
with several seeds) contains one of its comma-separated texts.

Timing: each round times every side once (one CUDA-graph replay window each), the order rotated
from round to round, so each side goes first equally often; a ratio is the geometric mean over
rounds of the two sides' times within a round. The order matters because a GPU at its power limit (the
H200's 700 W, reached by fp8 caches) lowers its clock while a replay runs: a fixed order hands the
first side the coolest clock. The mean SM clock of each side's windows is reported beside it.

Suites: targets and heldout (``scripts/bench_decode.py``'s), ``random``: COUNT shapes drawn
with each SEED (named ``seedN/...`` where there are several; G 1-16, D 64/128/256, P 1-64,
B 1-256, L 100-64k, bf16 or fp8 cache, some ragged), and ``preset:NAME``: a ``tsdecode-tune``
preset's grid (e.g. ``preset:mistral-7b``, sliding-window shapes; ``preset:fp8``, bf16 queries
over fp8 caches: the shipped table's classes).

Usage: python scripts/ab_trees.py --other /path/to/old/tree --suites targets,heldout,random
       [--count 40 --seed 2] [--tuned-table DIR/NVIDIA_H200.json] [--csv out.csv]
       python scripts/ab_trees.py --other /path/to/old/tree --suites random --seed 300-379 --moved-only \
           --only seed303/B200_L1141,seed316/B102_L1493
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import os
import random
import statistics
import sys
import types
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import bench_decode  # noqa: E402
import tsdecode  # noqa: E402
from tsdecode.config import tables  # noqa: E402
from tuner.grids import DTYPES, PRESETS, ShapeSpec  # noqa: E402
from tuner.measure import (  # noqa: E402
    bytes_moved, copy_bandwidth_gbs, graph_time_us, make_inputs, num_copies, seq_lens_for, sm_clock_mhz,
)

PAGE_SIZES = (1, 2, 3, 4, 8, 12, 16, 16, 24, 32, 48, 64)
MAX_KV_BYTES = 4 << 30


def load_other_tree(root: str):
    """The tsdecode package of another source tree, as ``tsdecode_other`` (its torch ops are not
    registered: the op names are this tree's)."""
    pkg_dir = os.path.join(root, "tsdecode")
    sys.modules["tsdecode_other.torch_ops"] = types.ModuleType("tsdecode_other.torch_ops")
    spec = importlib.util.spec_from_file_location("tsdecode_other", os.path.join(pkg_dir, "__init__.py"),
                                                  submodule_search_locations=[pkg_dir])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tsdecode_other"] = module
    spec.loader.exec_module(module)
    return module


def random_shapes(count: int, seed: int) -> list[ShapeSpec]:
    rng = random.Random(seed)
    shapes = []
    while len(shapes) < count:
        g, hkv = rng.randint(1, 16), rng.choice((1, 2, 4, 8, 8, 16))
        d, p = rng.choice((64, 128, 128, 256)), rng.choice(PAGE_SIZES)
        b = max(1, round(math.exp(rng.uniform(0, math.log(256)))))
        length = max(100, round(math.exp(rng.uniform(math.log(100), math.log(65536)))))
        kv = "float8_e4m3fn" if rng.random() < 0.3 else "bfloat16"
        spec = ShapeSpec(batch_size=b, kv_len=length, num_qo_heads=g * hkv, num_kv_heads=hkv, head_dim=d,
                         page_size=p, kv_dtype=kv, ragged=rng.random() < 0.3 and b > 1)
        if 2 * b * length * hkv * d * (1 if kv != "bfloat16" else 2) <= MAX_KV_BYTES and g * hkv <= 128:
            shapes.append(spec)
    return shapes


def write_grid(shapes: list[ShapeSpec], path: str) -> None:
    """The shapes as [[grid]] tables of a ``tsdecode-tune --grid-file``."""
    with open(path, "w") as f:
        for s in shapes:
            f.write(f"[[grid]]\nbatch_sizes = [{s.batch_size}]\nkv_lens = [{s.kv_len}]\n"
                    f"heads = \"{s.num_qo_heads}:{s.num_kv_heads}\"\nhead_dim = {s.head_dim}\n"
                    f"page_sizes = [{s.page_size}]\nkv_dtypes = [\"{s.kv_dtype}\"]\n"
                    f"ragged = {str(s.ragged).lower()}\n\n")


def parse_seeds(text: str) -> list[int]:
    """``--seed``'s seeds: integers, comma-separated, or ranges ``FIRST-LAST`` (both included)."""
    seeds = []
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            seeds += range(int(first), int(last or first) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed wants integers or ranges, comma-separated (e.g. 79,83 or "
                                         f"300-339), got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"--seed {text!r} names no seed (a range's first seed is its lowest)")
    return seeds


def suite_shapes(names: list[str], count: int, seed: int) -> list[tuple[str, ShapeSpec]]:
    out = []
    for name in names:
        if name == "targets":
            out += [("targets", t.spec) for t in bench_decode.target_suite()]
        elif name == "heldout":
            out += [("heldout", s) for s in bench_decode.heldout_suite()]
        elif name == "random":
            out += [("random", s) for s in random_shapes(count, seed)]
        elif name.startswith("preset:") and name[len("preset:"):] in PRESETS:
            out += [(name, s) for s in PRESETS[name[len("preset:"):]]]
        else:
            raise SystemExit(f"unknown suite {name!r}: expected targets, heldout, random or preset:NAME, NAME one of "
                             f"{', '.join(PRESETS)}")
    return out


def plan_calls(module, spec: ShapeSpec, sets, config=None):
    """Zero-argument calls running ``module``'s wrapper on each input set, and its pick."""
    calls, picked = [], None
    for s in sets:
        w = module.BatchDecodePagedTSWrapper()
        kw = dict(q_data_type=s.q.dtype, kv_data_type=s.cache.dtype, o_data_type=s.out.dtype,
                  mask_type=spec.mask_type, window_left=spec.window_left)
        lens = s.seq_lens.tolist()
        if "device" in module.BatchDecodePagedTSWrapper.plan.__code__.co_varnames[:2]:  # FlashInfer form
            if config is not None:
                kw["config"] = module.KernelConfig(**config.to_dict())
            w.plan(s.q.device, spec.batch_size, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                   spec.page_size, max(lens), seq_lens=lens, max_seq_len_q=spec.seq_len_q, **kw)
            calls.append(lambda w=w, s=s: w.run(s.q, s.cache, None, s.block_tables, out=s.out, validate=False))
        else:  # the call form before: metadata bound at plan
            if config is not None:
                kw["config"] = module.KernelConfig(**config.to_dict())
            w.plan(s.block_tables, s.seq_lens, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                   spec.page_size, seq_len_q=spec.seq_len_q, **kw)
            calls.append(lambda w=w, s=s: w.run(s.q, s.cache, out=s.out))
        picked = w.config
    return calls, picked


def named_shapes(names: list[str], count: int, seeds: list[int]) -> list[tuple[str, str, ShapeSpec]]:
    """(suite, name, shape) of the named suites: the random suite once per seed, its shapes named
    ``seedN/<shape>`` where there are several seeds."""
    out = []
    for suite in names:
        for seed in seeds if suite == "random" else seeds[:1]:
            out += [(suite, f"seed{seed}/{spec.name}" if suite == "random" and len(seeds) > 1 else spec.name, spec)
                    for _, spec in suite_shapes([suite], count, seed)]
    return out


def metadata_pick(module, spec: ShapeSpec, device: torch.device):
    """``module``'s pick for the lengths ``make_inputs(seed=1)`` draws, planned from metadata alone
    (the FlashInfer call form, no tensors): what ``plan_calls`` would run, without the inputs."""
    if "device" not in module.BatchDecodePagedTSWrapper.plan.__code__.co_varnames[:2]:
        raise SystemExit("--moved-only needs both trees' plan in the FlashInfer call form "
                         "(plan(device, batch_size, ...)); the other tree has the older one")
    lens = seq_lens_for(spec, torch.Generator().manual_seed(1))
    w = module.BatchDecodePagedTSWrapper()
    w.plan(device, spec.batch_size, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size,
           max(lens), seq_lens=lens, max_seq_len_q=spec.seq_len_q, q_data_type=DTYPES[spec.q_dtype],
           kv_data_type=DTYPES[spec.kv_dtype], o_data_type=DTYPES[spec.o_dtype],
           mask_type=spec.mask_type, window_left=spec.window_left)
    return w.config.kernel_config.to_dict()


def tune_trials(table_path: str | None) -> dict:
    """{(class key, bucket): configs the tune timed}, from the trials CSV the tuner writes beside
    its table ({} where there is none): a bucket whose time budget ran out after one or two trials
    holds little more than the model's own pick, so it says nothing about the model."""
    if not table_path:
        return {}
    trials = Path(table_path).with_name(Path(table_path).stem + "_trials.csv")
    if not trials.exists():
        return {}
    counts: dict = {}
    with open(trials, newline="") as f:
        for r in csv.DictReader(f):
            if r["kind"] == "trial" and r["state"] == "COMPLETE":
                key = (r["class_key"], (int(r["bucket_batch_size"]), int(r["bucket_kv_len"])))
                counts[key] = counts.get(key, 0) + 1
    return counts


def tuned_entry(table_path: str | None, spec: ShapeSpec):
    if not table_path:
        return None
    table = tables.load_table(table_path)
    if table is None:
        return None
    entry = table.entries.get(tables.problem_class_key(spec.to_problem_shape()), {}).get(
        tables.bucket_of(spec.batch_size, spec.kv_len))
    return None if entry is None else entry.kernel_config


# A tune that timed fewer configs of a shape than this ran out of time there.
SEARCHED_TRIALS = 8


def tuned_summary(ratios: list[float]) -> str:
    return (f"within 5% at {sum(t <= 1.05 for t in ratios)} of {len(ratios)}, within 10% at "
            f"{sum(t <= 1.10 for t in ratios)}, worst {max(ratios):.3f}, median {statistics.median(ratios):.3f}")


RETIME_BELOW = 0.97  # A/B time ratio under which a shape gets more rounds
RETIME_CYCLES = 2  # full rotations of the order added then: each side still leads equally often


def time_rounds(sides: dict, times: dict, clocks: dict, rounds: int, replay_ms: float) -> None:
    """``rounds`` more rounds: every side once, in an order rotated by the round's index."""
    names = list(sides)
    for _ in range(rounds):
        r = len(times[names[0]])
        for k in names[r % len(names):] + names[:r % len(names)]:
            times[k].append(graph_time_us(sides[k][0], replay_ms))
            clocks[k].append(sm_clock_mhz())


def paired_ratio(times: dict, a: str, b: str) -> tuple[float, float]:
    """Geometric mean over rounds of a's time over b's in the same round (a drift of the clock
    cancels over a full rotation of the order), and the spread of those ratios ((max - min) /
    mean)."""
    ratios = [x / y for x, y in zip(times[a], times[b])]
    mean = math.exp(statistics.fmean(map(math.log, ratios)))
    return mean, (max(ratios) - min(ratios)) / mean


def mean_clock(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", default=None, help="root of the other source tree (the A side)")
    ap.add_argument("--suites", default="targets,heldout,random")
    ap.add_argument("--count", type=int, default=40)
    ap.add_argument("--seed", type=parse_seeds, default=[2],
                    help="the random suite's seeds: N, N,M or FIRST-LAST (default 2)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per shape (default: one per side, at least 2)")
    ap.add_argument("--replay-ms", type=float, default=60.0)
    ap.add_argument("--tuned-table", default=None)
    ap.add_argument("--control", action="store_true", help="time this tree twice (B and B2): the noise floor")
    ap.add_argument("--only", default=None,
                    help="time only shapes whose name contains one of these comma-separated texts")
    ap.add_argument("--moved-only", action="store_true",
                    help="time only the shapes whose two picks differ (both trees in the FlashInfer call form)")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--write-grid", default=None,
                    help="write the random suite as a tsdecode-tune --grid-file (TOML) and exit")
    args = ap.parse_args()
    if args.write_grid:
        write_grid([s for n in args.seed for s in random_shapes(args.count, n)], args.write_grid)
        return 0
    if not args.other:
        ap.error("--other is required")
    if args.tuned_table and tables.load_table(args.tuned_table) is None:
        # Without it the run would time two columns, not three, and print no comparison with a tune.
        ap.error(f"--tuned-table {args.tuned_table}: no readable config table there")
    if not torch.cuda.is_available():
        print("ab_trees needs a CUDA GPU (only --write-grid runs without one)", file=sys.stderr)
        return 2
    other = load_other_tree(args.other)
    dev = torch.device("cuda")
    copy = copy_bandwidth_gbs(dev)
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, copy {copy:.0f} GB/s; "
          f"A = {args.other}, B = this tree", flush=True)
    rows, searched = [], tune_trials(args.tuned_table)
    skipped = 0
    for suite, name, spec in named_shapes(args.suites.split(","), args.count, args.seed):
        if not bench_decode.selected_by(args.only, name):
            continue
        if args.moved_only and metadata_pick(other, spec, dev) == metadata_pick(tsdecode, spec, dev):
            skipped += 1
            continue
        sets = make_inputs(spec, dev, copies=num_copies(spec), seed=1)
        nbytes = bytes_moved(spec, sets[0].seq_lens.tolist())
        sides = {"A": plan_calls(other, spec, sets), "B": plan_calls(tsdecode, spec, sets)}
        tuned = tuned_entry(args.tuned_table, spec)
        if tuned is not None:
            sides["tuned"] = plan_calls(tsdecode, spec, sets, tuned)
        if args.control:
            sides["B2"] = plan_calls(tsdecode, spec, sets)
        times, clocks = {k: [] for k in sides}, {k: [] for k in sides}
        time_rounds(sides, times, clocks, args.rounds or max(2, len(sides)), args.replay_ms)
        retimed = paired_ratio(times, "A", "B")[0] < RETIME_BELOW
        if retimed:  # a slower B gets more rounds before it counts
            time_rounds(sides, times, clocks, RETIME_CYCLES * len(sides), args.replay_ms)
        a_over_b, noise = paired_ratio(times, "A", "B")
        med = {k: statistics.median(v) for k, v in times.items()}
        row = dict(suite=suite, shape=name, a_us=med["A"], b_us=med["B"], a_over_b=a_over_b,
                   noise=noise, rounds=len(times["A"]), retimed=retimed,
                   a_mhz=mean_clock(clocks["A"]), b_mhz=mean_clock(clocks["B"]),
                   a_config=str(sides["A"][1].kernel_config), a_source=sides["A"][1].source,
                   b_config=str(sides["B"][1].kernel_config), b_source=sides["B"][1].source,
                   pct_copy_b=100 * nbytes / (med["B"] * 1e-6) / 1e9 / copy)
        clock = "" if row["a_mhz"] is None else f", {row['a_mhz']:.0f}/{row['b_mhz']:.0f} MHz"
        line = (f"{suite:8s} {name:48s} A {med['A']:9.1f} B {med['B']:9.1f} A/B {a_over_b:6.3f} "
                f"(noise {noise:.3f}{', re-timed' if retimed else ''}{clock})")
        if tuned is not None:
            b_over_tuned = paired_ratio(times, "B", "tuned")[0]
            trials = searched.get((tables.problem_class_key(spec.to_problem_shape()),
                                   tables.bucket_of(spec.batch_size, spec.kv_len)))
            row.update(tuned_us=med["tuned"], b_over_tuned=b_over_tuned, tuned_config=str(tuned),
                       tune_trials=trials)
            line += f" tuned {med['tuned']:9.1f} B/tuned {b_over_tuned:6.3f}"
            if trials is not None:
                line += f" ({trials} trials)"
        if args.control:
            row["b2_over_b"] = paired_ratio(times, "B2", "B")[0]
            line += f" B2/B {row['b2_over_b']:6.3f}"
        print(line + f" | B {row['b_source']} {row['b_config']}", flush=True)
        rows.append(row)
        if args.csv:  # rewritten after every shape, so a run cut short keeps what it measured
            bench_decode.write_csv(args.csv, rows)
        del sets, sides
        torch.cuda.empty_cache()
    if args.moved_only:
        print(f"# --moved-only: {len(rows)} shapes timed, {skipped} skipped (both trees pick the same config)")
    for suite in sorted({r["suite"] for r in rows}):
        r = [x for x in rows if x["suite"] == suite]
        ratios = [x["a_over_b"] for x in r]
        geo = math.exp(statistics.fmean(map(math.log, ratios)))
        worst = min(r, key=lambda x: x["a_over_b"])
        print(f"# {suite}: {len(r)} shapes, geomean A/B time {geo:.3f} (>1: B faster), slowest B "
              f"{worst['a_over_b']:.3f} at {worst['shape']} (noise {worst['noise']:.3f})")
        control = [x["b2_over_b"] for x in r if "b2_over_b" in x]
        if control:
            print(f"# {suite}: control B2/B (the same tree twice): geomean "
                  f"{math.exp(statistics.fmean(map(math.log, control))):.3f}, range {min(control):.3f}-{max(control):.3f}")
        tuned = [x["b_over_tuned"] for x in r if "b_over_tuned" in x]
        if tuned:
            print(f"# {suite}: B's pick vs the short tune's: {tuned_summary(tuned)}")
        full = [x["b_over_tuned"] for x in r if (x.get("tune_trials") or 0) >= SEARCHED_TRIALS]
        if searched and tuned:
            print(f"# {suite}: the same over the {len(full)} shapes the tune timed >= {SEARCHED_TRIALS} "
                  f"configs of: {tuned_summary(full) if full else '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
