"""Benchmark a shape grid: time every implementation at every shape (CUDA graphs on a GPU, the
wall clock of Triton's interpreter on a CPU), check it against the float64 reference, and write
the rows to ``results.csv`` after each shape."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Sequence

import torch

from tsdecode.device import INTERPRETER as INTERPRETER_ACTIVE
from tsdecode.device import device_properties

from .. import measure
from ..grids import ShapeSpec, specs_from_args
from . import impls as I
from .results import (
    CUDA_EAGER, CUDA_GRAPH, INTERPRETER, MEANINGLESS, add_speedups, default_report_dir, describe_device, slug, write_csv,
)


def _parse_impls(text: str) -> list[I.Impl]:
    if text.strip() == "all":
        return list(I.IMPLS.values())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in I.IMPLS]
    if unknown or not names:
        raise ValueError(f"--impls {text!r}: unknown implementation(s) {unknown}; registered: {list(I.IMPLS)}"
                         if unknown else f"--impls {text!r} names no implementation; registered: {list(I.IMPLS)}")
    return [I.IMPLS[n] for n in names]


def environment(device: torch.device) -> dict:
    """The columns every row of a run shares: the device (``tsdecode.device``) and the versions."""
    import triton

    import tsdecode

    props = device_properties(device)
    driver = "n/a"
    if device.type == "cuda":
        driver = _driver_version(device) or (f"CUDA {torch.version.cuda}" if torch.version.cuda else "n/a")
    return {
        "device": props.name, "sm_count": props.sm_count,
        "compute_capability": "{}.{}".format(*props.compute_capability), "driver": driver,
        "torch_version": torch.__version__, "triton_version": triton.__version__,
        "tsdecode_version": getattr(tsdecode, "__version__", "?"), "cuda_version": torch.version.cuda or "n/a",
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
    }


def _driver_version(device: torch.device) -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(index)],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip()
    return text if out.returncode == 0 and text else None


@dataclasses.dataclass
class Options:
    device: torch.device
    replay_ms: float = 80.0
    cpu_repeats: int = 1
    check_requests: int = 2
    seed: int = 0


def _time(calls: Sequence, opts: Options, warm_up: bool = False) -> tuple[list[float], str, str]:
    """(per-call times in us, timing_method, timing_note). ``warm_up``: replay one window first and
    discard it (a shape's first timing: the GPU's clock is still where the previous shape's kernels
    left it, lowered after a heavy one)."""
    if opts.device.type != "cuda":
        return measure.wall_times_us(calls[0], max(1, opts.cpu_repeats)), INTERPRETER, MEANINGLESS
    try:
        if warm_up:
            measure.graph_times_us(calls, replay_ms=opts.replay_ms)
        return measure.graph_times_us(calls, replay_ms=opts.replay_ms), CUDA_GRAPH, ""
    except Exception as e:  # not capturable: time eagerly, launch gaps included
        torch.cuda.synchronize()
        note = f"CUDA-graph capture failed ({type(e).__name__}: {_first_line(e)}); eager timing"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times: list[float] = []
        deadline = time.perf_counter() + opts.replay_ms / 1e3
        while len(times) < 5 or time.perf_counter() < deadline:
            start.record()
            for call in calls:
                call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / len(calls))
        return times, CUDA_EAGER, note


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:limit]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except RuntimeError:  # a broken context: the next launch fails and is recorded
            pass


def benchmark_shape(spec: ShapeSpec, impls: Sequence[I.Impl], opts: Options, env: dict,
                    copy_bw: float, log=print) -> list[dict]:
    """One row per implementation for ``spec`` (speedup columns filled by ``add_speedups``)."""
    cuda = opts.device.type == "cuda"
    copies = measure.num_copies(spec) if cuda else 1
    inputs = measure.make_inputs(spec, opts.device, copies=copies, seed=opts.seed)
    first = inputs[0]
    total_q = first.q.shape[0] if spec.packed else spec.batch_size * spec.seq_len_q
    nbytes = measure.bytes_moved(spec, first.seq_lens.tolist(), total_q, measure.input_q_lens(first))
    ref, stop, checked = measure.reference_rows(spec, first, opts.check_requests)
    tol = measure.tolerance(spec)
    rows = []
    no_table = None
    warmed = False  # the shape's first timed implementation replays a discarded window first
    for impl in impls:
        row = {"shape": spec.name, **spec.to_dict(), "impl": impl.name, "impl_kind": impl.kind,
               "copies": copies, "bytes_moved": nbytes, "copy_bandwidth_gbs": copy_bw, "tolerance": tol,
               "checked_requests": checked, **env,
               "timing_method": CUDA_GRAPH if cuda else INTERPRETER,
               "timing_note": "" if cuda else MEANINGLESS}
        t0 = time.perf_counter()
        calls = None
        try:
            calls = [impl.factory(spec, inp) for inp in inputs]
            for inp in inputs:
                inp.out.fill_(float("nan"))  # a call that writes nothing fails the check
            times, method, note = _time(calls, opts, warm_up=not warmed)
            warmed = True
            row["sm_clock_mhz"] = measure.sm_clock_mhz() if cuda else None
            err = measure.relative_error(first.out[:stop], ref)
            row.update(
                status="ok", timing_method=method, timing_note=note, replays=len(times),
                time_us_median=statistics.median(times), time_us_min=min(times),
                time_us_max=max(times), rel_error=err, error_ok=bool(err <= tol),
            )
            t = row["time_us_median"]
            row["bandwidth_gbs"] = nbytes / (t * 1e-6) / 1e9
            row["fraction_of_copy"] = row["bandwidth_gbs"] / copy_bw
            c = calls[0]
            if getattr(c, "config", None) is not None:
                row["config"] = json.dumps(c.config, sort_keys=True)
            row["config_source"] = getattr(c, "config_source", "")
            row["config_note"] = getattr(c, "config_note", "")
            row["impl_note"] = getattr(c, "note", "")
            msg = (f"{t:10.1f} us {row['bandwidth_gbs']:8.0f} GB/s {100 * row['fraction_of_copy']:5.1f}% "
                   f"err {err:.1e}{'' if row['error_ok'] else ' (ABOVE TOLERANCE)'}")
        except I.NoTableEntry as e:
            row.update(status="skipped", reason=str(e))
            no_table = row
            msg = "no tuned table entry: the runtime uses the heuristic"
        except I.Unsupported as e:
            row.update(status="skipped", reason=str(e))
            msg = f"skipped: {e}"
        except Exception as e:  # keep going: one broken implementation must not end the report
            row.update(status="failed", reason=f"{type(e).__name__}: {_first_line(e)}")
            msg = f"FAILED: {row['reason']}"
        del calls
        _free(opts.device)
        rows.append(row)
        log(f"    {impl.name:<15} {msg}  [{time.perf_counter() - t0:.1f}s]")
    heuristic = next((r for r in rows if r["impl"] == "heuristic"), None)
    if no_table is not None and heuristic is not None:
        # No separate tuned row: it would time the heuristic config again. Say so on that row.
        rows.remove(no_table)
        note = "runtime default here (no tuned table entry for this shape)"
        heuristic["config_note"] = "; ".join(x for x in (note, heuristic.get("config_note")) if x)
    del inputs, first, ref
    I.release()
    _free(opts.device)
    return rows


def timing_order(impls: Sequence[I.Impl], shape_index: int) -> list[I.Impl]:
    """The order in which the ``shape_index``-th shape times ``impls``: rotated by one a shape, so
    that no implementation always runs first. A shape's first timing runs at the clock and power
    state the previous shape's kernels left (a GPU at its power limit lowers its clock under load),
    and a fixed order would hand that state to the same implementation every time. The rows keep
    the listed order."""
    start = shape_index % len(impls) if impls else 0
    return list(impls[start:]) + list(impls[:start])


def _plain_row(spec: ShapeSpec, impl: I.Impl, env: dict, copy_bw: float, status: str, reason: str) -> dict:
    return {"shape": spec.name, **spec.to_dict(), "impl": impl.name, "impl_kind": impl.kind,
            "status": status, "reason": reason, "copy_bandwidth_gbs": copy_bw, **env}


def run_benchmark(args: argparse.Namespace, log=print) -> tuple[list[dict], Path]:
    specs = specs_from_args(args)
    if args.filter:
        specs = [s for s in specs if re.search(args.filter, s.name)]
        if not specs:
            raise ValueError(f"--filter {args.filter!r} matches no shape of the grid")
    impls = _parse_impls(args.impls)
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise ValueError(f"--device {args.device}: expected cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {args.device}: torch finds no CUDA GPU here")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: expected cuda, cuda:N or cpu")
    if device.type == "cpu":
        if not INTERPRETER_ACTIVE:
            raise RuntimeError("no CUDA device: set TRITON_INTERPRET=1 (before Python starts) to "
                               "run the report on the CPU through Triton's interpreter")
    elif device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    opts = Options(device, args.replay_ms, args.cpu_repeats, args.check_requests, args.seed)
    env = environment(device)
    log(f"report: {len(specs)} shapes x {len(impls)} implementations on {describe_device(env)}")
    if device.type != "cuda":
        log(f"  !!! {MEANINGLESS} !!!")
    copy_bw = measure.copy_bandwidth_gbs(device, nbytes=int(args.copy_gib * 2**30))
    log(f"  copy bandwidth {copy_bw:.0f} GB/s")
    out = Path(args.out) if args.out else default_report_dir(slug(env["device"]))
    out.mkdir(parents=True, exist_ok=True)
    log(f"  writing to {out}")
    rows: list[dict] = []
    start = time.perf_counter()
    for i, spec in enumerate(specs):
        elapsed = time.perf_counter() - start
        if args.budget_s is not None and elapsed > args.budget_s:
            log(f"[{i + 1}/{len(specs)}] {spec.name}  not run: --budget-s {args.budget_s:g} spent")
            rows += [_plain_row(spec, impl, env, copy_bw, "skipped", f"not run: time budget "
                                f"(--budget-s {args.budget_s:g}) spent") for impl in impls]
            continue
        log(f"[{i + 1}/{len(specs)}] {spec.name}  ({elapsed:.0f}s elapsed)")
        try:
            shape_rows = benchmark_shape(spec, timing_order(impls, i), opts, env, copy_bw, log)
            rows += sorted(shape_rows, key=lambda r: [impl.name for impl in impls].index(r["impl"]))
        except Exception as e:  # inputs or reference failed (e.g. out of memory): record, go on
            reason = f"shape setup failed: {type(e).__name__}: {_first_line(e)}"
            log(f"    {reason}")
            rows += [_plain_row(spec, impl, env, copy_bw, "failed", reason) for impl in impls]
            I.release()
            _free(device)
        add_speedups(rows)
        write_csv(rows, out / "results.csv")  # after every shape: a killed run keeps its data
    return rows, out
