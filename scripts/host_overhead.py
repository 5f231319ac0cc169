"""Host (CPU) time of one eager call: where ``run`` spends it, against torch and bare triton.

Eager callers (no CUDA graph) pay this on every layer of every decode step; under a graph it is
gone. Each row times N back-to-back calls with ``time.perf_counter`` and synchronises only after
the loop, so with a tiny problem (GPU time per call below the host's) and N launches below the
driver's queue depth the loop's time is the host's. Median and minimum over repeats, us per call.

Rows:
  torch.add(out=)            a small torch op (reference for "one launch from Python")
  triton empty kernel        a one-argument @triton.jit kernel launched as kernel[grid](x)
  GPU time a call            the same call's GPU time (20 calls in one CUDA graph, replayed):
                             the host rows below are the host's only while they exceed it
  run (splits S)             BatchDecodePagedTSWrapper.run(q, cache, out=out), the public call
  run, out=None              the same, allocating the output
  run, torch.compile         run(q, cache, out=out) inside torch.compile(fullgraph=True) (inductor,
                             default mode): the compiled graph's call of torch.ops.tsdecode.run_planned
  run_planned op, eager      that op called directly (the dispatcher's cost on top of run)
  run, validation only       the same with the plan's launches replaced by nothing
  plan's DecodeLaunch        the plan's launcher alone (both kernels when S > 1): compiled kernels
                             launched directly after the first call
  launch_decode              the same launches through triton's dispatch (kernel[grid](...)) on
                             every call, as ``run`` launched before the plan kept a launcher
  plan                       BatchDecodePagedTSWrapper.plan(...) again for the same shape (fixed
                             lengths: one host read, so this row includes a synchronisation)
  plan, no warm-up           the same with the compile step (``_warm_up``) skipped
  plan, new lengths          plan(...) cycling through four lengths tensors (longest 64, 50, 33,
                             17): a new max_kv_len every call, as at every decode step
  plan, not shared           plan(...) with the kernels plans share forgotten before each call
                             (``clear_compiled_cache``): the warm-up goes through triton's warmup
  plan's compile step        DecodeLaunch.compile alone (plan's last step, no device work), with
                             the kernels plans share ("shared") or forgotten first ("warmup")
  one-shot op                batch_decode_with_paged_kv_cache(q, cache, ..., out=out)
  metadata read, kernel      plan's read of the lengths and page-ID range (api._plan_host_values:
                             one triton kernel, launched directly, and the device-to-host copy) at
                             B=1 L=64, B=32 L=8k and B=256 L=4k (P=16, fixed lengths)
  metadata read, torch ops   the same read as the tree before the kernel did it (8 device
                             operations, ``_torch_ops_metadata`` below), in the same call

Rows that need the plan's launcher are left out when the script runs against an older tree
(copy it into that tree's scripts/ folder and run it from there).

Usage: python scripts/host_overhead.py [--calls 300] [--repeats 9]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

import tsdecode  # noqa: E402
from tsdecode import api as api_module  # noqa: E402
from tuner.measure import graph_time_us  # noqa: E402
from tsdecode.kernels import decode as decode_module  # noqa: E402


@triton.jit
def _empty_kernel(x_ptr):
    pass


def _host_us(fn, calls: int, repeats: int) -> tuple[float, float]:
    """(median, min) host time per call (us) of ``fn`` over ``repeats`` loops of ``calls`` calls
    (the minimum is the call's own cost with the least of the machine's noise)."""
    fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call), min(per_call)


def _plan_args(num_kv_splits: int):
    dev = torch.device("cuda")
    batch, hq, hkv, d, p, kv_len = 1, 32, 8, 128, 16, 64
    pages = batch * kv_len // p
    block_tables = torch.arange(pages, device=dev, dtype=torch.int32).reshape(batch, -1)
    seq_lens = torch.full((batch,), kv_len, device=dev, dtype=torch.int32)
    config = tsdecode.KernelConfig(block_n=16, block_m=16, num_kv_splits=num_kv_splits, num_warps=1,
                                   num_stages=3)
    return (block_tables, seq_lens, hq, hkv, d, p), dict(q_data_type=torch.bfloat16, config=config)


def _planned(num_kv_splits: int):
    plan_args, plan_kw = _plan_args(num_kv_splits)
    block_tables, _, hq, hkv, d, p = plan_args
    cache = torch.randn(block_tables.numel(), 2, hkv, p, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(block_tables.shape[0], hq, d, device="cuda", dtype=torch.bfloat16)
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(*plan_args, **plan_kw)
    return w, q, cache, torch.empty_like(q)


def _torch_ops_metadata(block_tables, seq_lens, qo_indptr, page_size, max_kv_len, bind_seq_lens):
    """The plan's metadata read as torch operations (the tree before plan_metadata.py), timed
    beside the kernel."""
    cols = block_tables.shape[1]
    if bind_seq_lens:
        if max_kv_len is None:
            pages = (seq_lens.max() + (page_size - 1)) // page_size
        else:
            pages = -(-min(max_kv_len, cols * page_size) // page_size)
        live = torch.arange(cols, device=block_tables.device) < pages
    else:
        pages_per_row = (seq_lens + (page_size - 1)) // page_size
        live = torch.arange(cols, device=block_tables.device)[None, :] < pages_per_row[:, None]
    lo, hi = torch.aminmax(torch.where(live, block_tables, block_tables[:, :1]))
    parts = [seq_lens, lo.reshape(1), hi.reshape(1)]
    if qo_indptr is not None:
        parts.append(qo_indptr)
    host = torch.cat(parts).tolist()
    batch = seq_lens.shape[0]
    return host[:batch], host[batch + 2:] if qo_indptr is not None else None, host[batch], host[batch + 1]


def _metadata_rows(n: int, r: int) -> list:
    """Host time of the plan's metadata read, kernel vs torch ops, interleaved per shape."""
    read = getattr(api_module, "_plan_host_values", None)
    if read is None:
        return []
    rows = []
    for batch, kv_len in ((1, 64), (32, 8192), (256, 4096)):
        pages = kv_len // 16
        perm = torch.randperm(batch * pages, device="cuda").to(torch.int32)
        block_tables = perm.reshape(batch, pages)
        seq_lens = torch.full((batch,), kv_len, device="cuda", dtype=torch.int32)
        args = (block_tables, seq_lens, None, 16, None, False)
        assert read(*args) == _torch_ops_metadata(*args), "kernel and torch ops disagree"
        for name, fn in (("kernel", read), ("torch ops", _torch_ops_metadata)):
            rows.append((f"metadata read, {name} (B={batch} L={kv_len})",
                         _host_us(lambda fn=fn: fn(*args), max(20, n // 10), r)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    n, r = args.calls, args.repeats
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"python {sys.version.split()[0]}; {n} calls x {r} repeats, host us per call: median (min)")
    a = torch.randn(4096, device="cuda")
    b = torch.randn_like(a)
    c = torch.empty_like(a)
    rows = [("torch.add(out=)", _host_us(lambda: torch.add(a, b, out=c), n, r)),
            ("triton empty kernel", _host_us(lambda: _empty_kernel[(1,)](a), n, r))]
    for splits in (1, 4):
        w, q, cache, out = _planned(splits)
        plan = w._plan
        gpu_us = graph_time_us([lambda: w.run(q, cache, out=out)] * 20, replay_ms=30)
        rows.append((f"GPU time a call, graph of 20 (splits {splits})", (gpu_us, None)))
        rows.append((f"run (splits {splits})", _host_us(lambda: w.run(q, cache, out=out), n, r)))
        rows.append((f"run, out=None (splits {splits})", _host_us(lambda: w.run(q, cache), n, r)))
        if hasattr(w, "_handle"):  # trees with the torch.compile ops
            compiled = torch.compile(lambda q_, c_, o_: w.run(q_, c_, out=o_), fullgraph=True)
            compiled(q, cache, out)
            ref = w.run(q, cache).clone()
            out.fill_(float("nan"))
            compiled(q, cache, out)
            torch.cuda.synchronize()
            assert torch.equal(ref, out), "compiled and eager run disagree"
            rows.append((f"run, torch.compile (splits {splits})", _host_us(lambda: compiled(q, cache, out), n, r)))
            rows.append((f"run_planned op, eager (splits {splits})", _host_us(
                lambda: torch.ops.tsdecode.run_planned(w._handle, q, cache, None, w._plan.block_tables,
                                                       w._plan.seq_lens, out, None, 1.0), n, r)))
        plan_args, plan_kw = _plan_args(splits)
        plan_calls = max(20, n // 10)
        rows.append((f"plan (splits {splits})", _host_us(lambda: w.plan(*plan_args, **plan_kw), plan_calls, r)))
        lens_cycle = [torch.full_like(plan_args[1], n) for n in (64, 50, 33, 17)]

        def plan_new_lengths():
            lens_cycle.append(lens_cycle.pop(0))
            w.plan(plan_args[0], lens_cycle[0], *plan_args[2:], **plan_kw)

        rows.append((f"plan, new lengths (splits {splits})", _host_us(plan_new_lengths, plan_calls, r)))
        clear = getattr(decode_module, "clear_compiled_cache", lambda: None)  # older trees: none

        def plan_not_shared():
            clear()
            w.plan(*plan_args, **plan_kw)

        rows.append((f"plan, not shared (splits {splits})", _host_us(plan_not_shared, plan_calls, r)))
        if splits == 1:  # the one-shot op picks its config itself; one row is enough
            rows.append(("one-shot op", _host_us(
                lambda: tsdecode.batch_decode_with_paged_kv_cache(q, cache, plan_args[0], plan_args[1], out=out),
                plan_calls, r)))
        real_warm_up = api_module._warm_up
        api_module._warm_up = lambda plan_: None
        try:
            rows.append((f"plan, no warm-up (splits {splits})",
                         _host_us(lambda: w.plan(*plan_args, **plan_kw), plan_calls, r)))
        finally:
            api_module._warm_up = real_warm_up
        w.plan(*plan_args, **plan_kw)
        plan = w._plan
        if not hasattr(plan, "launch"):  # an older tree: only the public rows
            continue
        w._plan = dataclasses.replace(plan, launch=lambda *a_: None)
        rows.append((f"run, validation only (splits {splits})", _host_us(lambda: w.run(q, cache, out=out), n, r)))
        w._plan = plan
        k, v = cache[:, 0], cache[:, 1]
        g, cfg = plan.geometry, plan.selected.kernel_config
        scale = g.head_dim ** -0.5
        rows.append((f"plan's DecodeLaunch (splits {splits})",
                     _host_us(lambda: plan.launch(q, cache, out, scale, 1.0), n, r)))

        compile_args = (plan.q_shape, plan.q_dtype, plan.kv_dtype, plan.o_dtype)
        rows.append((f"plan's compile step, shared (splits {splits})",
                     _host_us(lambda: plan.launch.compile(*compile_args), n, r)))

        def compile_through_warmup():
            clear()
            plan.launch.compile(*compile_args)

        rows.append((f"plan's compile step, warmup (splits {splits})", _host_us(compile_through_warmup, n, r)))

        def launch():
            decode_module.launch_decode(q, k, v, plan.block_tables, plan.seq_lens, plan.qo_indptr, out,
                                        plan.scratch, g, cfg, scale, 1.0)

        rows.append((f"launch_decode (splits {splits})", _host_us(launch, n, r)))
        ref = w.run(q, cache).clone()
        out.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        assert torch.equal(ref, out), "launch_decode and run disagree"  # the rows timed one op
    rows += _metadata_rows(n, r)
    width = max(len(name) for name, _ in rows)
    for name, (median, least) in rows:
        print(f"  {name:<{width}}  {median:7.2f} us" + (f" ({least:7.2f})" if least is not None else ""))


if __name__ == "__main__":
    main()
