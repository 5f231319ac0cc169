"""Host (CPU) time of eager plan / run / one-shot calls, against torch.add and an empty triton kernel.

Eager callers (no CUDA graph) pay this on every layer of every decode step; under a graph it is
gone. Each row times N back-to-back calls with ``time.perf_counter`` and synchronises only after
the loop, so with a tiny problem (B=1, Hq 32, Hkv 8, D 128, P 16, L 64: GPU time per call below
the host's) and N launches below the driver's queue depth the loop's time is the host's. The rows
of a group are timed in interleaved rounds (each round times every row once); median and minimum
over the rounds, us per call.

Rows (S = splits of the explicit config block_n 16, block_m 16, 1 warp, 3 stages):
  torch.add(out=)                 a small torch op (one launch from Python)
  triton empty kernel             a one-argument @triton.jit kernel launched as kernel[grid](x)
  GPU time a call                 the run's GPU time (20 calls in one CUDA graph): the host rows
                                  are the host's only while they exceed it
  run(validate=False, out=)       the plan owns the lengths: the call a CUDA graph captures
  run(validate=False, out=), run-owned lengths   the lengths tensor passed to every run
  run(validate=True, out=)        the same call checking the metadata (one small kernel and a
                                  device-to-host copy)
  run(validate=False), out=None   allocating the output
  ..., checks only                the same calls with the plan's launcher swapped for a no-op
  run, torch.compile              run(validate=False, out=) inside torch.compile(fullgraph=True)
  run_planned op, eager           the custom op torch.compile calls, called directly
  plan's DecodeLaunch             the launcher alone (compiled kernels launched directly)
  DecodeLaunch, triton dispatch   the same launches through kernel[grid](...) on every call
  plan / plan, run-owned lengths  plan(...) again for the same shape
  plan, new lengths               plan(...) cycling through four length lists (a new spread
                                  and max each call, as at every decode step)
  plan, not shared                plan(...) with the kernels plans share forgotten first
  plan, config selected           plan(...) with no explicit config, as an engine plans: the
                                  table search and the config model as well
  plan's compile step, shared / warmup   DecodeLaunch.compile alone, kernels shared or forgotten
  one-shot / one-shot, capturable   batch_decode_with_paged_kv_cache(..., out=) reading the
                                  lengths on the host / with workspace_buffer, max_kv_len and
                                  validate=False (reads nothing on the host)
  metadata read                   kernels.metadata.read_metadata (what validate=True adds) at
                                  three batch sizes

--other PATH loads another source tree's tsdecode as a package of its own (``ab_trees.py``'s
``load_other_tree``; the old call form ``plan(block_tables, seq_lens_kv, ...)`` / ``run(q,
cache, out=)`` or the FlashInfer one) and times its run, plan and one-shot rows in the same
rounds, printed beside this tree's (with its launcher swapped for a no-op too, where its plan is
the same kind of dataclass: the checks-only row); its run is set against this tree's
run(validate=False, out=).

--rows REGEX times only the rows whose name it finds. On the CPU the rows that launch kernels time
Triton's interpreter, but the plan rows (``--rows '^plan[ ,]'``) time the same Python path as on a
GPU host, less its CUDA calls (allocations, the compile step). --as-device TABLE.json describes the
device as that table's GPU (both trees), so a CPU run's plans choose configs and search the tables
as that GPU's do (its shipped table is found).

Usage: python scripts/host_overhead.py [--calls 300] [--repeats 9] [--other /path/to/tree]
                                       [--rows REGEX] [--as-device TABLE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

if not torch.cuda.is_available():  # before triton is imported: the kernels run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

import tsdecode  # noqa: E402
from tsdecode.kernels.launch import DecodeLaunch, allocate_partials, clear_compiled_cache  # noqa: E402
from tsdecode.kernels.metadata import read_metadata  # noqa: E402
from tuner.grids import ShapeSpec  # noqa: E402
from tuner.measure import graph_time_us, make_inputs  # noqa: E402

SPEC = ShapeSpec(batch_size=1, kv_len=64, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)


@triton.jit
def _empty_kernel(x_ptr):
    pass


def _config(module, splits: int):
    return module.KernelConfig(block_n=16, block_m=16, num_kv_splits=splits, num_warps=1, num_stages=3)


class Timer:
    """Host time per call of named rows, timed in interleaved rounds."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.repeats = repeats

    def rounds(self, rows: list[tuple[str, object, int]]) -> dict[str, tuple[float, float]]:
        """{name: (median, min)} us per call of each (name, fn, calls) row."""
        for _, fn, _ in rows:
            fn()
        self.sync()
        per_call: dict[str, list[float]] = {name: [] for name, _, _ in rows}
        for _ in range(self.repeats):
            for name, fn, calls in rows:
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                per_call[name].append((time.perf_counter() - start) / calls * 1e6)
                self.sync()
        return {name: (statistics.median(t), min(t)) for name, t in per_call.items()}


def this_tree_rows(s, splits: int, dev, n: int, plan_n: int, compiled: bool) -> tuple[list, dict]:
    """This tree's rows for one split count, and the calls the other tree's rows pair with."""
    B, hq, hkv, d, p, L = (SPEC.batch_size, SPEC.num_qo_heads, SPEC.num_kv_heads, SPEC.head_dim,
                           SPEC.page_size, SPEC.kv_len)
    cfg = _config(tsdecode, splits)
    lens = s.seq_lens.tolist()
    q, cache, bt, seq_lens, out = s.q, s.cache, s.block_tables, s.seq_lens, s.out
    plan_kw = dict(q_data_type=q.dtype, config=cfg)

    # The run rows' wrappers are planned once; the plan rows re-plan wrappers of their own.
    w, w_lens, w_plan = (tsdecode.BatchDecodePagedTSWrapper() for _ in range(3))
    w.plan(dev, B, hq, hkv, d, p, L, seq_lens=lens, **plan_kw)
    w_lens.plan(dev, B, hq, hkv, d, p, L, **plan_kw)

    def plan_owned():
        w_plan.plan(dev, B, hq, hkv, d, p, L, seq_lens=lens, **plan_kw)

    def plan_run_owned():
        w_plan.plan(dev, B, hq, hkv, d, p, L, **plan_kw)
    run = lambda: w.run(q, cache, None, bt, out=out, validate=False)  # noqa: E731
    run_checked = lambda: w.run(q, cache, None, bt, out=out, validate=True)  # noqa: E731
    rows = [
        (f"run(validate=False, out=) (S={splits})", run, n),
        (f"run(validate=False, out=), run-owned lengths (S={splits})",
         lambda: w_lens.run(q, cache, seq_lens, bt, out=out, validate=False), n),
        (f"run(validate=True, out=) (S={splits})", run_checked, n),
        (f"run(validate=False), out=None (S={splits})", lambda: w.run(q, cache, None, bt, validate=False), n),
    ]
    # The same calls with the launcher swapped for a no-op: what the checks alone cost.
    unlaunched = tsdecode.BatchDecodePagedTSWrapper()
    unlaunched.plan(dev, B, hq, hkv, d, p, L, seq_lens=lens, **plan_kw)
    unlaunched._plan = dataclasses.replace(unlaunched._plan, launch=lambda *args: None)
    rows += [(f"run(validate=False, out=), checks only (S={splits})",
              lambda: unlaunched.run(q, cache, None, bt, out=out, validate=False), n),
             (f"run(validate=True, out=), checks only (S={splits})",
              lambda: unlaunched.run(q, cache, None, bt, out=out, validate=True), n)]
    if compiled:
        fn = torch.compile(lambda q_, c_, o_: w.run(q_, c_, None, bt, out=o_, validate=False), fullgraph=True)
        fn(q, cache, out)
        ref = run_checked().clone()
        out.fill_(float("nan"))
        fn(q, cache, out)
        assert torch.equal(ref, out), "compiled and eager run disagree"
        rows.append((f"run, torch.compile (S={splits})", lambda: fn(q, cache, out), n))
        rows.append((f"run_planned op, eager (S={splits})", lambda: torch.ops.tsdecode.run_planned(
            w._handle, q, cache, None, w._plan.seq_lens, bt, None, out, None, 1.0, False), n))
    plan = w._plan
    scale = d ** -0.5
    rows.append((f"plan's DecodeLaunch (S={splits})",
                 lambda: plan.launch(q, cache, out, bt, plan.seq_lens, None, scale, 1.0), n))
    # A launcher of the same plan that never keeps compiled kernels: triton's dispatch every call.
    dispatch = DecodeLaunch(plan.shape, plan.selected.kernel_config, plan.query_capacity, plan.device,
                            allocate_partials(plan.shape, plan.selected.kernel_config, plan.query_capacity,
                                             plan.device))
    if hasattr(dispatch, "_direct_broken"):
        dispatch._direct_broken = True
        ref = run_checked().clone()
        out.fill_(float("nan"))
        dispatch(q, cache, out, bt, plan.seq_lens, None, scale, 1.0)
        assert torch.equal(ref, out), "triton's dispatch and run disagree"
        rows.append((f"DecodeLaunch, triton dispatch (S={splits})",
                     lambda: dispatch(q, cache, out, bt, plan.seq_lens, None, scale, 1.0), n))
    cycle = [[n_] for n_ in (64, 50, 33, 17)]

    def plan_new_lengths():
        cycle.append(cycle.pop(0))
        w_plan.plan(dev, B, hq, hkv, d, p, L, seq_lens=cycle[0], **plan_kw)

    def plan_not_shared():
        clear_compiled_cache()
        plan_owned()

    q_shape = plan.q_shape(plan.query_capacity)

    def compile_warmup():
        clear_compiled_cache()
        plan.launch.compile(q_shape)

    rows += [(f"plan (S={splits})", plan_owned, plan_n),
             (f"plan, run-owned lengths (S={splits})", plan_run_owned, plan_n),
             (f"plan, new lengths (S={splits})", plan_new_lengths, plan_n)]
    if dev.type == "cuda":  # the compile step does nothing in the interpreter
        rows += [(f"plan, not shared (S={splits})", plan_not_shared, plan_n),
                 (f"plan's compile step, shared (S={splits})", lambda: plan.launch.compile(q_shape), plan_n),
                 (f"plan's compile step, warmup (S={splits})", compile_warmup, plan_n)]
    pairs = {"run": rows[0][0], "run_checked": rows[2][0], "plan": f"plan (S={splits})",
             "checks": f"run(validate=False, out=), checks only (S={splits})"}
    return rows, pairs


def oneshot_rows(s, dev, plan_n: int) -> list:
    q, cache, bt, seq_lens, out = s.q, s.cache, s.block_tables, s.seq_lens, s.out
    size = tsdecode.get_prims_ts_batch_decode_workspace_size(
        SPEC.batch_size, SPEC.num_qo_heads, SPEC.num_kv_heads, SPEC.head_dim, SPEC.page_size, SPEC.kv_len,
        q_dtype=q.dtype, device=dev)
    workspace = torch.empty(max(size, 256), dtype=torch.uint8, device=dev)
    w = tsdecode.BatchDecodePagedTSWrapper()
    lens = seq_lens.tolist()
    return [("plan, config selected", lambda: w.plan(dev, SPEC.batch_size, SPEC.num_qo_heads, SPEC.num_kv_heads,
                                                     SPEC.head_dim, SPEC.page_size, SPEC.kv_len, seq_lens=lens,
                                                     q_data_type=q.dtype), plan_n),
            ("one-shot", lambda: tsdecode.batch_decode_with_paged_kv_cache(q, cache, bt, seq_lens, out=out), plan_n),
            ("one-shot, capturable", lambda: tsdecode.batch_decode_with_paged_kv_cache(
                q, cache, bt, seq_lens, out=out, workspace_buffer=workspace, max_kv_len=SPEC.kv_len,
                validate=False), plan_n)]


def other_tree_rows(module, s, splits: int, dev, n: int, plan_n: int) -> dict[str, tuple[str, object, int]]:
    """The other tree's run, plan and one-shot rows in its own call form, keyed by the row of this
    tree they pair with ("run", "run_checked", "checks", "plan", "plan-selected", "one-shot")."""
    B, hq, hkv, d, p, L = (SPEC.batch_size, SPEC.num_qo_heads, SPEC.num_kv_heads, SPEC.head_dim,
                           SPEC.page_size, SPEC.kv_len)
    q, cache, bt, seq_lens, out = s.q, s.cache, s.block_tables, s.seq_lens, s.out
    plan_kw = dict(q_data_type=q.dtype, config=_config(module, splits))
    w, w_plan = module.BatchDecodePagedTSWrapper(), module.BatchDecodePagedTSWrapper()
    rows = {}
    if "device" in module.BatchDecodePagedTSWrapper.plan.__code__.co_varnames[:2]:  # FlashInfer form
        def plan(wrapper=w_plan, kw=plan_kw):
            wrapper.plan(dev, B, hq, hkv, d, p, L, seq_lens=s.seq_lens.tolist(), **kw)
        plan(w)
        rows["run"] = ("run(validate=False, out=)", lambda: w.run(q, cache, None, bt, out=out, validate=False), n)
        rows["run_checked"] = ("run(validate=True, out=)",
                               lambda: w.run(q, cache, None, bt, out=out, validate=True), n)
        if dataclasses.is_dataclass(getattr(w, "_plan", None)) and hasattr(w._plan, "launch"):
            unlaunched = module.BatchDecodePagedTSWrapper()  # its launcher swapped for a no-op, as here
            plan(unlaunched)
            unlaunched._plan = dataclasses.replace(unlaunched._plan, launch=lambda *args: None)
            rows["checks"] = ("run(validate=False, out=), checks only",
                              lambda: unlaunched.run(q, cache, None, bt, out=out, validate=False), n)
    else:  # the call form before: metadata bound at plan
        def plan(wrapper=w_plan, kw=plan_kw):
            wrapper.plan(bt, seq_lens, hq, hkv, d, p, **kw)
        plan(w)
        rows["run"] = ("run(q, cache, out=)", lambda: w.run(q, cache, out=out), n)
    rows["plan"] = ("plan", plan, plan_n)
    if splits == 1:
        selected_kw = {k: v for k, v in plan_kw.items() if k != "config"}
        rows["plan-selected"] = ("plan, config selected", functools.partial(plan, w_plan, selected_kw), plan_n)
        rows["one-shot"] = ("one-shot", lambda: module.batch_decode_with_paged_kv_cache(
            q, cache, bt, seq_lens, out=out), plan_n)
    return {key: (f"{name} (S={splits})", fn, calls) for key, (name, fn, calls) in rows.items()}


def metadata_rows(dev, calls: int) -> list:
    rows = []
    for batch, kv_len in ((1, 64), (32, 8192), (256, 4096)):
        pages = kv_len // 16
        block_tables = torch.randperm(batch * pages, device=dev).to(torch.int32).reshape(batch, pages)
        seq_lens = torch.full((batch,), kv_len, device=dev, dtype=torch.int32)
        rows.append((f"metadata read (B={batch} L={kv_len})",
                     lambda bt=block_tables, sl=seq_lens: read_metadata(bt, sl, None, 16), calls))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300, help="calls a loop (plans: a tenth, at least 20)")
    ap.add_argument("--repeats", type=int, default=9, help="interleaved rounds")
    ap.add_argument("--other", default=None, metavar="PATH", help="root of another source tree of tsdecode")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (default where there is one) or cpu (the interpreter: only the plan rows time "
                         "the host path)")
    ap.add_argument("--as-device", default=None, metavar="TABLE.json",
                    help="describe the device as the GPU of this table's `device` field (both trees' "
                         "tsdecode.device.set_override), so plans choose configs and search tables as there")
    ap.add_argument("--rows", default=None, metavar="REGEX",
                    help="only the rows whose name this regular expression finds (e.g. '^plan[ ,]')")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)

    def keep(rows):
        return [row for row in rows if args.rows is None or re.search(args.rows, row[0])]
    other = None
    if args.other:
        from ab_trees import load_other_tree

        other = load_other_tree(args.other)
    if args.as_device:
        with open(args.as_device, encoding="utf-8") as f:
            gpu = json.load(f)["device"]
        for module in (tsdecode, other) if other else (tsdecode,):
            device_module = importlib.import_module(module.__name__ + ".device")
            device_module.set_override(device_module.DeviceProperties.from_dict(gpu))
    n, r = args.calls, args.repeats
    plan_n = max(20, n // 10) if dev.type == "cuda" else max(1, n // 10)
    name = (torch.cuda.get_device_name(dev) if dev.type == "cuda" else
            "cpu (Triton interpreter: rows that launch kernels time it; plan rows time the host path)")
    if args.as_device:
        name += f", described as {gpu['name']} ({gpu['sm_count']} SMs, from {args.as_device})"
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}, python "
          f"{sys.version.split()[0]}; {n} calls x {r} rounds, host us per call: median (min)"
          + (f"; other tree: {args.other}" if other else ""))
    timer = Timer(dev, r)
    s = make_inputs(SPEC, dev, copies=1, seed=1)[0]
    a = torch.randn(4096, device=dev)
    b, c = torch.randn_like(a), torch.empty_like(a)
    results: list[tuple[str, tuple[float, float] | None, tuple[str, tuple[float, float]] | None]] = []
    base = timer.rounds(keep([("torch.add(out=)", lambda: torch.add(a, b, out=c), n),
                              ("triton empty kernel", lambda: _empty_kernel[(1,)](a), n)]))
    results += [(k, v, None) for k, v in base.items()]
    verdicts = []
    for splits in (1, 4):
        rows, pairs = this_tree_rows(s, splits, dev, n, plan_n, compiled=dev.type == "cuda")
        if splits == 1:
            rows += oneshot_rows(s, dev, plan_n)
            pairs.update({"one-shot": "one-shot", "plan-selected": "plan, config selected"})
        run_row = next((row for row in rows if row[0] == pairs["run"]), None)
        rows = keep(rows)
        theirs = other_tree_rows(other, s, splits, dev, n, plan_n) if other else {}
        theirs = {key: row for key, row in theirs.items() if keep([row]) and pairs[key] in {r[0] for r in rows}}
        named = {f"other: {row[0]}": (row[0], row[1], row[2]) for row in theirs.values()}
        times = timer.rounds(rows + [(key, fn, calls) for key, (_, fn, calls) in named.items()])
        if dev.type == "cuda" and run_row in rows:
            results.append((f"GPU time a call, graph of 20 (S={splits})",
                            (graph_time_us([run_row[1]] * 20, replay_ms=30), None), None))
        paired = {pairs[k]: (f"other: {row[0]}", times[f"other: {row[0]}"]) for k, row in theirs.items()}
        results += [(row[0], times[row[0]], paired.get(row[0])) for row in rows]
        if "run" in theirs:
            mine, their = times[pairs["run"]][0], times[f"other: {theirs['run'][0]}"][0]
            verdicts.append(f"# S={splits}: run(validate=False, out=) {mine:.2f} us, the other tree's "
                            f"{theirs['run'][0]} {their:.2f} us: {mine / their:.3f}x (median of {r} rounds)")
    results += [(k, v, None) for k, v in timer.rounds(keep(metadata_rows(dev, max(20, n // 10)))).items()]
    width = max(len(row[0]) for row in results)
    other_width = max([len(row[2][0]) for row in results if row[2]] + [0])
    for row_name, (median, least), pair in results:
        line = f"  {row_name:<{width}}  {median:8.2f} us" + (f" ({least:8.2f})" if least is not None else " " * 11)
        if pair:
            line += f"   {pair[0]:<{other_width}}  {pair[1][0]:8.2f} us ({pair[1][1]:8.2f})"
        print(line)
    for line in verdicts:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
