"""Kernel time and % of the copy bandwidth of tsdecode's picks on benchmark suites (CUDA graphs).

Times ``BatchDecodePagedTSWrapper.run(validate=False)`` with the anchors' CUDA-graph method
(``tuner.measure``), each shape's config as the runtime picks it (tuned table or model).

Suites:
  llama    Llama-3-8B-like shapes (Hq=32, Hkv=8, D=128, bf16, P=16; B in {1,16,128};
           L in {1k, 8k, 32k}): time and fraction of the copy bandwidth measured in this run.
  targets  the H200 target table of the performance issue: measured value vs target per row.
  heldout  ten ragged llama3-8b shapes off the tuning grid: the table-selected config vs that
           shape's own best (a coordinate search over the config space), target within 5%.
Options: --sweep times a set of split counts / tiles / warps per shape and reports the best
(the config model's neighbourhood); --only picks shapes by name; --csv writes rows.

Usage: python scripts/bench_decode.py --suite llama [--sweep] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import tsdecode  # noqa: E402
from tsdecode.config.heuristic import heuristic_config  # noqa: E402
from tsdecode.config.space import KernelConfig, fit_config  # noqa: E402
from tsdecode.device import DeviceProperties, device_properties  # noqa: E402
from tsdecode.kernels.launch import DecodeLaunch, allocate_partials, pdl_supported  # noqa: E402
from tsdecode.reference import reference_decode  # noqa: E402
from tuner.grids import ShapeSpec  # noqa: E402
from tuner.measure import (  # noqa: E402
    bytes_moved, copy_bandwidth_gbs, decode_call, graph_time_us, input_q_lens, make_inputs, num_copies,
    plan_wrapper, relative_error,
)


@dataclasses.dataclass(frozen=True)
class Target:
    """A row of the target table: pass if the metric meets the bound."""

    regime: str
    spec: ShapeSpec
    metric: str  # "pct_copy" (>= bound) or "us" (<= bound)
    bound: float


def _s(b, l, hq=32, hkv=8, **kw) -> ShapeSpec:
    return ShapeSpec(batch_size=b, kv_len=l, num_qo_heads=hq, num_kv_heads=hkv, **kw)


def llama_suite() -> list[ShapeSpec]:
    return [_s(b, l) for b in (1, 16, 128) for l in (1024, 8192, 32768)]


def target_suite() -> list[Target]:
    k = 1024
    large = [_s(128, 8 * k), _s(128, 32 * k), _s(256, 4 * k), _s(32, 8 * k, 32, 32),
             _s(32, 32 * k, 32, 32), _s(128, 8 * k, 32, 32)]
    rows = [Target("large", s, "pct_copy", 100.0) for s in large]
    rows += [Target("mid batch GQA", _s(b, l, hq, 8), "pct_copy", 95.0)
             for hq in (32, 64) for b in (8, 32) for l in (8 * k, 32 * k)]
    rows += [Target("short context", s, "pct_copy", 90.0)
             for s in (_s(32, k), _s(128, k), _s(8, k, 32, 32))]
    rows += [Target("short small", _s(8, k), "us", 13.0)]
    rows += [Target("single long", _s(1, 128 * k), "pct_copy", 95.0),
             Target("single long", _s(1, 32 * k), "pct_copy", 88.0)]
    rows += [Target("single short", _s(1, k), "us", 4.5), Target("single short", _s(1, 8 * k), "us", 12.5)]
    rows += [Target("fp8 cache", dataclasses.replace(t.spec, kv_dtype="float8_e4m3fn"), "pct_copy", 95.0)
             for t in rows[:6]]
    # Geometry variants: within 10% of the P=16/D=128 bandwidth at the same bytes (B=32, 256 MiB+).
    base = _s(32, 32 * k)
    rows += [Target("geometry (vs P16/D128)", s, "rel_bw", 0.9) for s in (
        _s(32, 32 * k, 64, 4), _s(32, 64 * k, 32, 8, head_dim=64), _s(32, 16 * k, 32, 8, head_dim=256),
        _s(32, 32 * k, page_size=1), _s(32, 32 * k, page_size=32), _s(32, 32 * k, page_size=64),
    )]
    rows.insert(len(rows) - 6, Target("geometry base", base, "pct_copy", 0.0))
    return rows


def heldout_suite() -> list[ShapeSpec]:
    """Ten llama3-8b-class shapes off the tuning grid's (B, L) points, ragged lengths."""
    return [_s(b, l, ragged=True) for b, l in (
        (1, 60000), (2, 3000), (4, 20000), (12, 5000), (16, 2048),
        (24, 12000), (48, 6000), (64, 16384), (96, 3000), (200, 1500),
    )]


def own_best_search(spec: ShapeSpec, sets, start: KernelConfig, device: DeviceProperties | int | None = None,
                    replay_ms: float = 10.0):
    """Coordinate search for the best config of one exact shape (what the table is judged against).

    Round 1: every split count with the start config's tile; round 2: block_n x num_warps x
    num_stages at the best split count and at double it; round 3: split counts again at the
    best tile. Short timings (replay_ms) rank; the caller re-times the top ones at full length.
    ``device``: the properties the model's pick (also timed) is made for (None: the inputs'
    device; an int: that device with this SM count). Returns [(us, config)] sorted, failed
    configs left out.
    """
    shape = spec.to_problem_shape(sets[0].seq_lens.tolist())
    props = _device_props(device, sets[0].q.device)
    timed: dict[KernelConfig, float] = {}

    def run(configs):
        for c in configs:
            c = fit_config(c, shape)[0]
            if c in timed:
                continue
            try:
                timed[c] = time_config(spec, sets, c, replay_ms)[0]
            except Exception as exc:  # out of shared memory etc.: not a candidate
                print(f"#   {c}: failed: {type(exc).__name__}: {str(exc)[:100]}")

    split_set = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
    h = heuristic_config(shape, props)
    run([start, h])
    run([dataclasses.replace(start, num_kv_splits=n) for n in split_set])
    best = min(timed, key=timed.get)
    tiles = [(bn, w, st) for bn in (16, 32, 64, 128) for w in (1, 2, 4) for st in (2, 3, 5)]
    around = {best.num_kv_splits, best.num_kv_splits * 2}
    run([dataclasses.replace(best, block_n=bn, num_warps=w, num_stages=st, num_kv_splits=n)
         for bn, w, st in tiles for n in sorted(around)])
    best = min(timed, key=timed.get)
    run([dataclasses.replace(best, num_kv_splits=n) for n in split_set])
    return sorted(((us, c) for c, us in timed.items()), key=lambda t: t[0])


def _device_props(device: DeviceProperties | int | None, fallback: torch.device) -> DeviceProperties:
    """Properties from a DeviceProperties, an SM count (the fallback device's, with that count) or
    None (the fallback device's)."""
    if isinstance(device, DeviceProperties):
        return device
    props = device_properties(fallback)
    return props if device is None else dataclasses.replace(props, sm_count=int(device))


def run_heldout(args, dev, copy_gbs: float, props: DeviceProperties) -> list[dict]:
    """Table-selected config vs each held-out shape's own best, timed in the same run.

    Returns one row per shape (kind "heldout") and one per config the search timed (kind
    "heldout_search")."""
    rows, search_rows = [], []
    print(f"{'shape':44s} {'table us':>9s} {'best us':>9s} {'ratio':>6s} {'ok':>4s}  selected | own best")
    for spec in heldout_suite():
        if not selected_by(args.only, spec.name):
            continue
        sets = make_inputs(spec, dev, copies=num_copies(spec), seed=2)
        selected = time_config(spec, sets, None)[1]
        ranked = own_best_search(spec, sets, selected.kernel_config, props)
        # Re-time the table's config and the search's top three at full length, two rounds in
        # turn; each config's better round counts (same treatment for all).
        finalists = [selected.kernel_config] + [c for _, c in ranked[:3] if c != selected.kernel_config]
        full = {c: math.inf for c in finalists}
        for _ in range(2):
            for c in finalists:
                full[c] = min(full[c], time_config(spec, sets, c)[0])
        table_us = full[selected.kernel_config]
        best_cfg = min(full, key=full.get)
        best_us = full[best_cfg]
        ratio = table_us / best_us
        ok = "yes" if ratio <= 1.05 else "NO"
        err = check_correct(spec, sets[0], None)
        line = (f"{spec.name:44s} {table_us:9.1f} {best_us:9.1f} {ratio:6.3f} {ok:>4s}  {selected} | "
                f"{best_cfg} ({len(ranked)} configs searched)")
        if err > 2e-2:
            line += f"  WRONG (rel err {err:.2e})"
        print(line, flush=True)
        rows.append(dict(regime="held-out", spec=spec.name, us=table_us, best_us=best_us, ratio=ratio,
                         ok=ok, config=str(selected.kernel_config), source=selected.source,
                         best_config=str(best_cfg), searched=len(ranked), rel_err=err,
                         pct_copy=100 * set_bytes(spec, sets[0]) / (table_us * 1e-6) / 1e9 / copy_gbs,
                         copy_gbs=copy_gbs, kind="heldout"))
        # Every config the search timed (short replays), for looking at a miss afterwards.
        search_rows += [dict(regime="held-out search", spec=spec.name, us=us, config=str(c),
                             kind="heldout_search") for us, c in ranked]
        del sets
        torch.cuda.empty_cache()
    n_ok = sum(r["ok"] == "yes" for r in rows)
    print(f"# held-out: {n_ok} of {len(rows)} shapes within 5% of their own best")
    return rows + search_rows


def sweep_configs(spec: ShapeSpec, props: DeviceProperties, seq_lens=None) -> list[KernelConfig]:
    """The model's pick and its tile with block_n 32-128, 2 or 4 warps and 1-128 splits."""
    shape = spec.to_problem_shape(seq_lens)
    h = heuristic_config(shape, props)
    configs = {h}
    for block_n in (32, 64, 128):
        for splits in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128):
            for warps in (2, 4):
                c = dataclasses.replace(h, block_n=block_n, num_kv_splits=splits, num_warps=warps)
                configs.add(fit_config(c, shape)[0])
    return sorted(configs, key=lambda c: (c.block_n, c.num_warps, c.num_kv_splits))


def time_config(spec: ShapeSpec, sets, config: KernelConfig | None, replay_ms: float = 80.0,
                launch: dict | None = None) -> tuple[float, tsdecode.SelectedConfig]:
    """Median time of one call (us) of ``config`` (None: the runtime's pick), one planned wrapper
    per input set, ``run(validate=False)`` as a graph captures it (the first set's metadata
    checked once with ``validate=True``), and the planned SelectedConfig. ``launch``: keyword
    arguments of ``relaunch`` (another launcher or explicit launch arguments)."""
    wrappers = [plan_wrapper(spec, s, config) for s in sets]
    if launch:
        wrappers = [relaunch(w, **launch) for w in wrappers]
    decode_call(wrappers[0], sets[0], validate=True)()
    calls = [decode_call(w, s) for w, s in zip(wrappers, sets)]
    return graph_time_us(calls, replay_ms), wrappers[0].config


def relaunch(w: tsdecode.BatchDecodePagedTSWrapper, launch_type: type = DecodeLaunch,
             **options) -> tsdecode.BatchDecodePagedTSWrapper:
    """``w`` with its plan's launcher replaced by ``launch_type(..., **options)`` (e.g.
    ``transposed=`` or ``pdl=``: explicit launch arguments for an A/B) over split partials of its
    own, compiled as ``plan`` compiles it."""
    plan = w._plan
    config = plan.selected.kernel_config
    if options.get("transposed") and not config.uses_dot:
        raise ValueError(f"the transposed product form needs tl.dot (block_m >= 16), got {config}")
    partials = allocate_partials(plan.shape, config, plan.query_capacity, plan.device)
    launch = launch_type(plan.shape, config, plan.query_capacity, plan.device, partials, **options)
    if plan.device.type == "cuda":
        with torch.cuda.device(plan.device):
            launch.compile(plan.q_shape(plan.query_capacity))
    w._plan = dataclasses.replace(plan, launch=launch)
    return w


def check_correct(spec: ShapeSpec, s, config, launch: dict | None = None) -> float:
    """Relative error of the first two requests vs the float64 reference (``launch``: as in
    ``time_config``)."""
    w = plan_wrapper(spec, s, config)
    if launch:
        w = relaunch(w, **launch)
    s.out.fill_(float("nan"))
    decode_call(w, s, validate=True)()
    n = min(2, spec.batch_size)
    stop = int(s.qo_indptr[n]) if s.qo_indptr is not None else n  # output rows of those requests
    ref = reference_decode(s.q[:stop], s.cache, s.block_tables[:n], s.seq_lens[:n],
                           seq_len_q=spec.seq_len_q, mask_type=spec.mask_type, window_left=spec.window_left,
                           qo_indptr=None if s.qo_indptr is None else s.qo_indptr[:n + 1])
    return relative_error(s.out[:stop], ref)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=("llama", "targets", "heldout"), default="llama")
    ap.add_argument("--sweep", action="store_true", help="also time a config sweep per shape")
    ap.add_argument("--csv", default=None, help="write one row per (shape, config) here")
    ap.add_argument("--only", default=None, help="run only shapes whose name contains one of these comma-separated texts")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU (timings in the interpreter mean nothing)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    props = device_properties(dev)
    import triton

    copy_gbs = copy_bandwidth_gbs(dev)
    src = torch.empty(2**29, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    graph_copy_gbs = 2 * src.numel() * 4 / (graph_time_us([lambda d=dst, s=src: d.copy_(s)]) * 1e-6) / 1e9
    del src, dst
    print(f"# {props.name}, {props.sm_count} SMs, torch {torch.__version__}, triton {triton.__version__}, "
          f"PDL {'on' if pdl_supported(dev) else 'off'}")
    print(f"# copy bandwidth (read+write) measured in this run: {copy_gbs:.0f} GB/s "
          f"(eager; the same copy captured in a CUDA graph: {graph_copy_gbs:.0f} GB/s)")
    if args.suite == "heldout":
        rows = run_heldout(args, dev, copy_gbs, props)
        write_csv(args.csv, rows)
        return 0
    if args.suite == "llama":
        targets = [Target("llama3-8b", s, "pct_copy", 0.0) for s in llama_suite()]
    else:
        targets = target_suite()
    rows = []
    base_bw = None
    header = f"{'regime':24s} {'shape':40s} {'us':>9s} {'GB/s':>7s} {'%copy':>6s} {'target':>8s} {'ok':>4s}  config"
    print(header)
    for t in targets:
        spec = t.spec
        if not selected_by(args.only, spec.name) and t.regime != "geometry base":
            continue
        sets = make_inputs(spec, dev, copies=num_copies(spec), seed=1)
        nbytes = set_bytes(spec, sets[0])
        us, selected = time_config(spec, sets, None)
        err = check_correct(spec, sets[0], None)
        gbs = nbytes / (us * 1e-6) / 1e9
        pct = 100 * gbs / copy_gbs
        best = (us, selected.kernel_config)
        if args.sweep and t.regime != "geometry base":
            for cfg in sweep_configs(spec, props, sets[0].seq_lens.tolist()):
                try:
                    us_c, _ = time_config(spec, sets, cfg, replay_ms=20.0)
                except Exception as exc:  # a config that fails to compile/launch is reported, not fatal
                    print(f"#   {cfg}: failed: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                rows.append(dict(spec=spec.name, config=str(cfg), us=us_c, pct_copy=100 * nbytes / (us_c * 1e-6) / 1e9 / copy_gbs, kind="sweep"))
                if us_c < best[0]:
                    best = (us_c, cfg)
        if t.regime == "geometry base":
            base_bw = gbs
        if t.metric == "pct_copy":
            ok = pct >= t.bound
            target = f">={t.bound:.0f}%"
        elif t.metric == "us":
            ok = us <= t.bound
            target = f"<={t.bound}us"
        else:
            rel = gbs / base_bw if base_bw else math.nan
            ok = rel >= t.bound
            target = f"{rel:.2f}x"
        ok_s = "-" if t.bound == 0 else ("yes" if ok else "NO")
        line = f"{t.regime:24s} {spec.name:40s} {us:9.1f} {gbs:7.0f} {pct:6.1f} {target:>8s} {ok_s:>4s}  {selected}"
        if err > 2e-2:
            line += f"  WRONG (rel err {err:.2e})"
        if args.sweep and t.regime != "geometry base":
            line += f"\n{'':24s} best of sweep: {best[0]:.1f} us ({100 * nbytes / (best[0] * 1e-6) / 1e9 / copy_gbs:.1f}%) {best[1]}"
        print(line, flush=True)
        rows.append(dict(regime=t.regime, spec=spec.name, us=us, gbs=gbs, pct_copy=pct, target=target,
                         ok=ok_s, rel_err=err, config=str(selected.kernel_config), source=selected.source,
                         kind="default", copy_gbs=copy_gbs, best_us=best[0], best_config=str(best[1])))
        del sets
        torch.cuda.empty_cache()
    write_csv(args.csv, rows)
    return 0


def set_bytes(spec: ShapeSpec, inputs) -> int:
    """Bytes the floor moves for one input set: its actual (possibly ragged) lengths."""
    return bytes_moved(spec, inputs.seq_lens.tolist(), int(inputs.q.shape[0]) if spec.packed else None,
                       input_q_lens(inputs))


def selected_by(only: str | None, name: str) -> bool:
    return not only or any(part and part in name for part in only.split(","))


def write_csv(path: str | None, rows: list[dict]) -> None:
    if path:
        keys = sorted({k for r in rows for k in r})
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    raise SystemExit(main())
