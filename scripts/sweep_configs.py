"""Kernel time of a structured config sweep on random off-grid shapes: data for calibrating the config model.

For each shape (``ab_trees.random_shapes``: G 1-16, D 64/128/256, P 1-64, B 1-256, L 100-64k,
bf16 or fp8 cache, some ragged): tile families (block_n, num_warps, num_stages) x split counts that
span ~0.25 to ~48 programs per SM, compiled in parallel first (one process per CPU core, each
planning the configs, which compiles them), then timed with the anchors' CUDA-graph method (short
replays); the best few and the plan's own pick (tuned table or model) are re-timed at full length,
two rounds interleaved. Writes one CSV row per timing, with ``spread`` (longest / mean drawn
length) as ``tests/data/h200_timings.csv.xz`` records it. ``--tiles`` and ``--splits`` narrow the
sweep to given tiles (block_n/num_warps/num_stages) and split counts, e.g. one tile's split counts
around a model's pick. ``--configs CSV`` times exactly the (shape, config) rows of a CSV instead
(``model_scores.py --untimed`` writes one: the picks the committed timings lack), each shape's
lengths drawn as the source that recorded it drew them (the draw whose spread matches).

Usage: python scripts/sweep_configs.py --count 48 --seed 1 --csv sweep.csv
       python scripts/sweep_configs.py --suites random,heldout --seed 3 --count 40 \
           --only B43_L6752_H18x2_D128_P3_float8_e4m3fn,B2_L3000 --csv losers.csv
       python scripts/sweep_configs.py --seed 61 --only B34_L2836 --tiles 64/4/2 \
           --splits 1-16,24,32 --csv b34.csv
       python scripts/sweep_configs.py --configs untimed.csv --csv untimed_timed.csv
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from ab_trees import suite_shapes  # noqa: E402
from tsdecode import BatchDecodePagedTSWrapper  # noqa: E402
from tsdecode.config.space import MAX_NUM_KV_SPLITS, KernelConfig, dot_block_m, fit_config  # noqa: E402
from tsdecode.device import device_properties  # noqa: E402
from tuner.grids import ShapeSpec  # noqa: E402
from tuner.measure import (  # noqa: E402
    bytes_moved, copy_bandwidth_gbs, decode_call, graph_time_us, make_inputs, num_copies, plan_wrapper,
    seq_lens_for,
)

FAMILIES = ((16, 1, 3), (16, 1, 5), (32, 1, 5), (32, 2, 5), (64, 2, 5), (32, 4, 2), (64, 4, 2),
            (64, 4, 5), (128, 4, 2))
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def candidates(spec: ShapeSpec, num_sms: int, families=FAMILIES, splits=None) -> list[KernelConfig]:
    """Each family's configs at every split count from ~0.25 to ~48 programs per SM (fitted), or
    at the given ``splits`` (those a shape's tiles allow)."""
    shape = spec.to_problem_shape()
    block_m = dot_block_m(shape.rows_per_kv_head)
    base = spec.batch_size * spec.num_kv_heads * -(-shape.rows_per_kv_head // block_m)
    out = set()
    for bn, w, st in families:
        tiles = shape.max_visible_tiles(bn)
        for s in splits or SPLITS:
            if s > tiles or s > MAX_NUM_KV_SPLITS:
                continue
            if splits is None and ((s > 1 and base * s > 48 * num_sms) or (s > 1 and base * s < num_sms // 4)):
                continue
            out.add(fit_config(KernelConfig(block_n=bn, block_m=block_m, num_kv_splits=s, num_warps=w,
                                            num_stages=st), shape)[0])
    return sorted(out, key=lambda c: (c.block_n, c.num_warps, c.num_stages, c.num_kv_splits))


def precompile(spec: ShapeSpec, config: KernelConfig) -> str | None:
    """Plan ``config`` for ``spec`` (which compiles its kernels for the layout ``make_inputs``
    builds, into triton's on-disk cache); the error's text if that fails."""
    try:
        BatchDecodePagedTSWrapper().plan(
            "cuda", spec.batch_size, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size,
            spec.kv_len, q_data_type=getattr(torch, spec.q_dtype), kv_data_type=getattr(torch, spec.kv_dtype),
            o_data_type=getattr(torch, spec.o_dtype), config=config)
    except Exception as e:  # noqa: BLE001 - reported, the timing loop skips it too
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


def parse_counts(text: str) -> list[int]:
    """"1-4,8,12" -> [1, 2, 3, 4, 8, 12]."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))


def parse_tiles(text: str) -> tuple[tuple[int, int, int], ...]:
    """"64/4/2,32/1/5" -> ((64, 4, 2), (32, 1, 5)): block_n/num_warps/num_stages."""
    tiles = tuple(tuple(int(x) for x in part.split("/")) for part in text.split(","))
    if any(len(t) != 3 for t in tiles):
        raise argparse.ArgumentTypeError(f"--tiles wants block_n/num_warps/num_stages, got {text!r}")
    return tiles


# The seeds the tools draw ragged lengths with: the sweeps', the tuner's, ab_trees'.
LENGTH_SEEDS = (3, 0, 1)


def listed_configs(path: str) -> list[tuple[ShapeSpec, int, list[KernelConfig]]]:
    """(shape, lengths seed, configs) of a CSV with model_scores.py --untimed's columns: the shape
    as the timings record it, its lengths drawn with the seed whose spread matches ``spread`` (a
    shape none matches is reported and skipped)."""
    out: dict = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            spread = float(r["spread"])
            spec = ShapeSpec(batch_size=int(r["batch_size"]), kv_len=int(r["max_kv_len"]),
                             num_qo_heads=int(r["num_qo_heads"]), num_kv_heads=int(r["num_kv_heads"]),
                             head_dim=int(r["head_dim"]), page_size=int(r["page_size"]), kv_dtype=r["kv_dtype"],
                             mask_type="dense" if r["mask_kind"] == "dense" else "causal",
                             window_left=int(r["window_left"]), ragged=spread > 1)

            def spread_of(seed: int) -> float:
                lens = seq_lens_for(spec, torch.Generator().manual_seed(seed))
                return max(lens) * len(lens) / sum(lens)
            seed = min(LENGTH_SEEDS, key=lambda seed: abs(spread_of(seed) - spread))
            if abs(spread_of(seed) - spread) > 1e-3:  # drawn some other way: its timing would not match
                print(f"# {r['src']} {r['shape']}: no draw of {LENGTH_SEEDS} gives spread {spread}: skipped",
                      file=sys.stderr)
                continue
            config = KernelConfig(**{k: int(r[k]) for k in ("block_n", "block_m", "num_kv_splits", "num_warps",
                                                            "num_stages")})
            configs = out.setdefault((spec, seed), [])
            fitted = fit_config(config, spec.to_problem_shape())[0]
            if fitted not in configs:
                configs.append(fitted)
    return [(spec, seed, configs) for (spec, seed), configs in out.items()]


def time_config(spec, sets, config, replay_ms):
    ws = [plan_wrapper(spec, s, config) for s in sets]
    decode_call(ws[0], sets[0], validate=True)()
    calls = [decode_call(w, s) for w, s in zip(ws, sets)]
    return graph_time_us(calls, replay_ms, min_replays=3), ws[0].config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--suites", default="random", help="comma-separated: random, heldout, targets")
    ap.add_argument("--only", default=None, help="comma-separated prefixes of shape names to keep")
    ap.add_argument("--tiles", type=parse_tiles, default=FAMILIES,
                    help="comma-separated block_n/num_warps/num_stages (default: the families above)")
    ap.add_argument("--splits", type=parse_counts, default=None,
                    help="split counts, e.g. 1-16,24,32 (default: ~0.25 to ~48 programs per SM)")
    ap.add_argument("--configs", default=None, help="a CSV of shapes and configs to time instead (see above)")
    ap.add_argument("--csv", required=True)
    ap.add_argument("--replay-ms", type=float, default=8.0)
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_configs needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    num_sms = device_properties(dev).sm_count
    copy = copy_bandwidth_gbs(dev)
    if args.configs:
        listed = listed_configs(args.configs)
    else:
        shapes = [spec for _, spec in suite_shapes(args.suites.split(","), args.count, args.seed)]
        if args.only:
            shapes = [s for s in shapes if any(s.name.startswith(p) for p in args.only.split(","))]
        listed = [(s, 3, candidates(s, num_sms, args.tiles, args.splits)) for s in shapes]
    print(f"# {torch.cuda.get_device_name(dev)} copy {copy:.0f} GB/s; {len(listed)} shapes, "
          f"{sum(len(configs) for _, _, configs in listed)} configs", flush=True)
    t0 = time.time()
    jobs = []
    for spec, _, configs in listed:
        seen = set()
        for c in configs:
            key = (c.block_n, c.block_m, c.num_warps, c.num_stages, c.num_kv_splits == 1)
            if key not in seen:  # the split count is a runtime argument: one compile a variant
                seen.add(key)
                jobs.append((spec, c))
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        errors = list(pool.map(precompile, *zip(*jobs))) if jobs else []
    failed = sum(e is not None for e in errors)
    print(f"# compiled {len(jobs)} variants in {time.time() - t0:.0f} s ({failed} failed)", flush=True)
    rows = []
    out = open(args.csv, "w", newline="")
    writer = None
    for i, (spec, seed, configs) in enumerate(listed):
        sets = make_inputs(spec, dev, copies=num_copies(spec), seed=seed)
        lens = sets[0].seq_lens.tolist()
        nbytes = bytes_moved(spec, lens)
        common = dict(shape=spec.name, **dataclasses.asdict(spec), spread=max(lens) * len(lens) / sum(lens),
                      bytes=nbytes, copy_gbs=copy)
        short = {}
        for c in configs:
            try:
                short[c] = time_config(spec, sets, c, args.replay_ms)[0]
            except Exception as e:  # noqa: BLE001 - out of resources etc.: not a candidate
                print(f"#   {spec.name} {c}: {type(e).__name__}: {str(e)[:80]}")
        picked_us, picked = time_config(spec, sets, None, args.replay_ms)
        finalists = [picked.kernel_config] + [c for c in sorted(short, key=short.get)[:3]
                                              if c != picked.kernel_config]
        full = {c: math.inf for c in finalists}
        for _ in range(2):
            for c in finalists:
                full[c] = min(full[c], time_config(spec, sets, c, 40.0)[0])
        best = min(full, key=full.get)
        for c, us in short.items():
            rows.append(dict(common, **c.to_dict(), time_us=us, kind="short"))
        for c, us in full.items():
            rows.append(dict(common, **c.to_dict(), time_us=us,
                             kind="picked" if c == picked.kernel_config else "final", source=picked.source))
        if writer is None:
            writer = csv.DictWriter(out, fieldnames=sorted({k for r in rows for k in r} | {"source"}))
            writer.writeheader()
        writer.writerows(rows)
        out.flush()
        rows = []
        print(f"[{i + 1}/{len(listed)}] {spec.name}: picked {full[picked.kernel_config]:.1f} us "
              f"({picked.source}) best {full[best]:.1f} ratio {full[picked.kernel_config] / full[best]:.3f} "
              f"| {best}", flush=True)
        del sets
        torch.cuda.empty_cache()
    out.close()
    print(f"# done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
