"""When and where each split-pass program runs: start/end times (%globaltimer) and SM per program.

For each shape, plans the op (table or heuristic config, or --config overrides), launches the
split pass with a timeline buffer right after another launch of the same op on other pages (so
the GPU is busy as in a decode step), and prints: kernel span, the spread of program starts and
ends, how many programs were still running in the last microseconds, and the busy fraction
(sum of program durations / (span * programs resident at the start)). A long tail of few running
programs means the wave is unbalanced (DRAM serves programs unequally), not short of bandwidth.

--graph also replays the benchmark's CUDA graph (R calls over disjoint pages) with a timeline per
call and splits each call's period into the split pass and the gap to the next call's split pass
(merge kernel + kernel boundaries), with PDL on and off.

Usage: python scripts/timeline.py [--only B8_L8192] [--chunks 1,2,4] [--graph] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import tsdecode  # noqa: E402
from tsdecode.kernels.decode import launch_decode  # noqa: E402
from tuner.grids import ShapeSpec  # noqa: E402
from tuner.measure import make_inputs, num_copies  # noqa: E402


def shapes() -> list[ShapeSpec]:
    k = 1024
    return [ShapeSpec(batch_size=b, kv_len=l, num_qo_heads=hq, num_kv_heads=hkv)
            for b, l, hq, hkv in ((8, 8 * k, 32, 8), (32, k, 32, 8), (8, k, 32, 32), (1, 32 * k, 32, 8),
                                  (8, k, 32, 8), (1, 8 * k, 32, 8), (32, 8 * k, 32, 8))]


def plan(spec: ShapeSpec, s, config=None) -> tsdecode.BatchDecodePagedTSWrapper:
    w = tsdecode.BatchDecodePagedTSWrapper()
    w.plan(s.block_tables, s.seq_lens, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
           spec.page_size, q_data_type=s.q.dtype, kv_data_type=s.cache.dtype,
           o_data_type=s.out.dtype, config=config)
    return w


def timeline(spec: ShapeSpec, sets, config) -> tuple[torch.Tensor, object]:
    """int64 [programs, 4] (start ns, end ns, SM, chunks) of one launch, and the config used."""
    busy, probe = plan(spec, sets[0], config), plan(spec, sets[1], config)
    p = probe._plan
    cfg = p.selected.kernel_config
    g = p.geometry
    m_blocks = -(-(g.group_size * g.seq_len_q) // cfg.block_m)
    rec = torch.zeros(g.batch_size * g.num_kv_heads * m_blocks * cfg.num_kv_splits, 4,
                      dtype=torch.int64, device=sets[0].q.device)
    k, v = sets[1].cache[:, 0], sets[1].cache[:, 1]
    scale = spec.head_dim ** -0.5
    for _ in range(3):  # warm: compile, then the measured launch follows a busy one
        busy.run(sets[0].q, sets[0].cache, out=sets[0].out)
        launch_decode(sets[1].q, k, v, p.block_tables, p.seq_lens, p.qo_indptr, sets[1].out,
                      p.scratch, g, cfg, scale, 1.0, timeline=rec)
    torch.cuda.synchronize()
    return rec.cpu(), cfg


def graph_timeline(spec: ShapeSpec, sets, config) -> dict:
    """R back-to-back calls over disjoint pages captured in one CUDA graph (the benchmark's
    method), each recording its split pass; returns per-call medians: period (replay / R), split
    pass span (first program start to last end) and the gap from one call's last split program
    to the next call's first (the merge kernel plus two kernel boundaries)."""
    ws = [plan(spec, s, config) for s in sets]
    p0 = ws[0]._plan
    cfg, g = p0.selected.kernel_config, p0.geometry
    m_blocks = -(-(g.group_size * g.seq_len_q) // cfg.block_m)
    n = g.batch_size * g.num_kv_heads * m_blocks * cfg.num_kv_splits
    rec = torch.zeros(len(sets), n, 4, dtype=torch.int64, device=sets[0].q.device)
    scale = spec.head_dim ** -0.5

    def calls():
        for i, (w, s) in enumerate(zip(ws, sets)):
            p = w._plan
            launch_decode(s.q, s.cache[:, 0], s.cache[:, 1], p.block_tables, p.seq_lens, p.qo_indptr,
                          s.out, p.scratch, p.geometry, cfg, scale, 1.0, timeline=rec[i])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(sets))
    r = rec.cpu().double() / 1e3
    first, last = r[:, :, 0].min(dim=1).values, r[:, :, 1].max(dim=1).values
    span = (last - first)[1:-1]
    gap = (first[1:] - last[:-1])[1:]
    med = lambda x: float(x.median()) if x.numel() else float("nan")  # noqa: E731
    return dict(calls=len(sets), period_us=sorted(times)[len(times) // 2],
                span_us=med(span), gap_us=med(gap),
                start_spread_us=med((r[:, :, 0] - first[:, None]).max(dim=1).values))


def summarize(rec: torch.Tensor) -> dict:
    start, end = rec[:, 0].double() / 1e3, rec[:, 1].double() / 1e3  # us
    t0 = start.min()
    start, end = start - t0, end - t0
    span = end.max().item()
    dur = end - start
    q = lambda x, f: torch.quantile(x, f).item()  # noqa: E731
    # programs running at time t: start <= t < end
    def running(t):
        return int(((start <= t) & (end > t)).sum())
    peak = max(running(float(t)) for t in torch.linspace(0, span, 200))
    return dict(
        programs=rec.shape[0], span_us=span, start_p50=q(start, 0.5), start_max=start.max().item(),
        end_p10=q(end, 0.1), end_p50=q(end, 0.5), end_p90=q(end, 0.9), end_max=span,
        dur_mean=dur.mean().item(), dur_min=dur.min().item(), dur_max=dur.max().item(),
        dur_cv=(dur.std() / dur.mean()).item(), peak_running=peak,
        running_at_90pct=running(0.9 * span), running_at_p50_end=running(q(end, 0.5)),
        busy_fraction=(dur.sum() / (span * peak)).item(),
        sms=int(rec[:, 2].unique().numel()),
        chunks_mean=rec[:, 3].double().mean().item(), chunks_max=int(rec[:, 3].max()),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="comma-separated name parts")
    ap.add_argument("--chunks", default="1", help="kv_chunks_per_split values to compare")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--graph", action="store_true",
                    help="also split each call's period in a CUDA graph into split pass and gap, PDL on and off")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("timeline needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    rows = []
    print(f"{'shape':40s} {'config':34s} {'span':>6s} {'st50':>5s} {'stmax':>5s} {'end10':>6s} "
          f"{'end50':>6s} {'end90':>6s} {'durCV':>5s} {'run@90%':>7s} {'busy':>5s} {'chunks':>6s}")
    for spec in shapes():
        if args.only and not any(p and p in spec.name for p in args.only.split(",")):
            continue
        sets = make_inputs(spec, dev, copies=2, seed=1)
        base = plan(spec, sets[0]).config.kernel_config
        for c in (int(x) for x in args.chunks.split(",")):
            cfg = dataclasses.replace(base, kv_chunks_per_split=c)
            rec, used = timeline(spec, sets, cfg)
            r = summarize(rec)
            name = (f"n{used.block_n} s{used.num_kv_splits} w{used.num_warps} st{used.num_stages} "
                    f"c{used.kv_chunks_per_split}")
            print(f"{spec.name:40s} {name:34s} {r['span_us']:6.1f} {r['start_p50']:5.1f} "
                  f"{r['start_max']:5.1f} {r['end_p10']:6.1f} {r['end_p50']:6.1f} {r['end_p90']:6.1f} "
                  f"{r['dur_cv']:5.2f} {r['running_at_90pct']:7d} {r['busy_fraction']:5.2f} "
                  f"{r['chunks_mean']:6.2f}", flush=True)
            rows.append(dict(spec=spec.name, config=name, **r))
            if args.graph and c == 1:
                gsets = make_inputs(spec, dev, copies=max(5, num_copies(spec)), seed=2)
                for pdl in ("0", "1"):
                    os.environ["TSDECODE_DISABLE_PDL"] = pdl
                    gr = graph_timeline(spec, gsets, cfg)
                    print(f"{'':40s} graph, PDL {'off' if pdl == '1' else 'on '}: {gr['calls']} calls, "
                          f"period {gr['period_us']:.1f} us = split pass {gr['span_us']:.1f} + gap "
                          f"{gr['gap_us']:.1f} (programs start within {gr['start_spread_us']:.1f} us)",
                          flush=True)
                    rows.append(dict(spec=spec.name, config=name + f" graph pdl={'off' if pdl == '1' else 'on'}",
                                     span_us=gr["span_us"], gap_us=gr["gap_us"], period_us=gr["period_us"]))
                os.environ.pop("TSDECODE_DISABLE_PDL")
                del gsets
        del sets
        torch.cuda.empty_cache()
    if args.csv and rows:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
