"""How far the op is from no-math floors, and how much of a measured call is the timing method.

For each shape it times, in one run and with the anchors' R (disjoint inputs per call, one CUDA
graph of R calls):
  ours      the op as shipped (table / model config),
  split pass only   the same plans launching the split kernel alone (``SplitPassOnly``: the merge
            kernel is not launched, the output not written); in parentheses also with PDL off,
  PDL off   the op with programmatic dependent launch off (``DecodeLaunch(pdl=False)``),
  gather    a paged-gather floor (this script's kernel): the op's grid (requests x KV heads x
            splits, its block_n and warps), page-ID loads and K/V tile loads, the math replaced
            by a sum; launched plainly and, in parentheses, with programmatic dependent launch as
            the op's split kernel is,
  contig    a contiguous read of the same K/V bytes (a read-reduce over one buffer per call),
each two ways:
  sync      one replay at a time, synchronised after each (``tuner.measure.graph_times_us``, the
            method of every committed report): a replay's time includes the graph's launch
            from an idle GPU,
  stream    replays queued back to back, an event between each, one synchronise at the end: the
            GPU never idles, so a replay's time is its kernels plus the boundary between graphs.
The contiguous-read column under each method, against the anchors' "contiguous read" column
(same bytes, same R), says which method the anchors' floors were measured with.

--sweep instead times the gather floor over block_n x warps x stages x split counts (2-16
programs per SM) and prints the best: what the same loads reach with any grid, no math, no merge.

--fp8 takes the fp8-cache target rows (float8_e4m3fn K/V, bytes counted as fp8) instead.

Usage: python scripts/method_probe.py [--only B8_L8192] [--replay-ms 80] [--sweep] [--fp8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_decode import relaunch  # noqa: E402
from tsdecode.device import device_properties  # noqa: E402
from tsdecode.kernels.launch import DecodeLaunch  # noqa: E402
from tuner.grids import ShapeSpec  # noqa: E402
from tuner.measure import (  # noqa: E402
    bytes_moved, copy_bandwidth_gbs, decode_call, graph_times_us, make_inputs, num_copies, plan_wrapper,
)

# The anchors' published H200 floors (contiguous read, paged gather; copy 4295 GB/s in that run): KV MiB
# (contiguous) or shape (gather) -> us.
ANCHOR_CONTIG_US = {4: 3.6, 32: 9.85, 128: 32.7, 256: 62.6}
ANCHOR_GATHER_US = {"B1_L1024": 3.4, "B1_L8192": 12.1, "B8_L1024": 12.1, "B1_L32768": 35.6, "B8_L8192": 65.5}


class SplitPassOnly(DecodeLaunch):
    """A plan's launcher that launches the split kernel alone: the merge kernel is left out (its
    grid unset), so with more than one split the partials are written and the output is not."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._merge_grid = None


@triton.jit
def _read_sum_kernel(src_ptr, out_ptr, n_per_program, BLOCK: tl.constexpr):
    """Each program sums its contiguous n_per_program int32 words (a multiple of BLOCK)."""
    pid = tl.program_id(0)
    base = src_ptr + pid.to(tl.int64) * n_per_program
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n_per_program, BLOCK):
        acc += tl.load(base + start + tl.arange(0, BLOCK), cache_modifier=".cg")
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _gather_sum_kernel(cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
                       stride_page, stride_kv, stride_head, stride_tok, bt_stride, num_kv_heads,
                       num_splits, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                       NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    """One program per (request, KV head, split): page IDs, K and V tiles, summed (no math).
    USE_PDL: wait for the previous grid and let the next launch, as the op's split kernel does."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    split = pid % num_splits
    head = (pid // num_splits) % num_kv_heads
    req = pid // (num_splits * num_kv_heads)
    seq_len = tl.load(seq_lens_ptr + req)
    tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits)
    t0 = split * per_split
    t1 = tl.minimum(t0 + per_split, tiles)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for t in tl.range(t0, t1, num_stages=NUM_STAGES):
        tok = t * BLOCK_N + offs_n
        if PAGE_SIZE % BLOCK_N == 0:  # one page-ID load per tile, as the op does
            page = tl.load(block_tables_ptr + req * bt_stride + (t * BLOCK_N) // PAGE_SIZE).to(tl.int64)
        else:
            page = tl.load(block_tables_ptr + req * bt_stride + tok // PAGE_SIZE, mask=tok < seq_len,
                           other=0).to(tl.int64)
        row = page * stride_page + head * stride_head + (tok % PAGE_SIZE) * stride_tok
        ptrs = cache_ptr + row[:, None] + offs_d[None, :]
        mask = (tok < seq_len)[:, None]
        k = tl.load(ptrs, mask=mask, other=0.0)
        v = tl.load(ptrs + stride_kv, mask=mask, other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def stream_times_us(calls, replay_ms: float = 80.0) -> list[float]:
    """Per-replay times of one call (us) with replays queued back to back (no sync between)."""
    graph_times_us(calls, replay_ms=1.0)  # warm up and compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    one = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    one[0].record()
    graph.replay()
    one[1].record()
    one[1].synchronize()
    n = max(5, int(replay_ms / max(one[0].elapsed_time(one[1]), 1e-3)))
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    events[0].record()
    for i in range(n):
        graph.replay()
        events[i + 1].record()
    events[-1].synchronize()
    del graph
    # Skip the first replays: the GPU may catch up with the host there.
    times = [events[i].elapsed_time(events[i + 1]) * 1000.0 / len(calls) for i in range(n)]
    return times[min(3, n - 1):]


def gather_calls(spec: ShapeSpec, sets, block_n: int, splits: int, warps: int, stages: int, dev,
                 pdl: bool = False):
    """One paged-gather-floor launch per input set, over the given grid and tile; each launch writes
    one partial sum per program into the returned sink."""
    cache = sets[0].cache
    grid = spec.batch_size * spec.num_kv_heads * splits
    sink = torch.empty(grid, dtype=torch.float32, device=dev)

    def gather(s):
        _gather_sum_kernel[(grid,)](
            cache, s.block_tables, s.seq_lens, sink, cache.stride(0), cache.stride(1), cache.stride(2),
            cache.stride(3), s.block_tables.stride(0), spec.num_kv_heads, splits,
            PAGE_SIZE=spec.page_size, BLOCK_N=block_n, HEAD_DIM=spec.head_dim, NUM_STAGES=stages, USE_PDL=pdl,
            num_warps=warps, **({"launch_pdl": True} if pdl else {}))
    return [lambda s=s: gather(s) for s in sets], sink


def sweep_gather(spec: ShapeSpec, dev, copy_gbs: float, replay_ms: float) -> str:
    """Best paged-gather floor over tiles, warps, stages and split counts (sync method)."""
    sets = make_inputs(spec, dev, copies=num_copies(spec), seed=1)
    nbytes = bytes_moved(spec, sets[0].seq_lens.tolist())
    results = []
    base = spec.batch_size * spec.num_kv_heads
    sms = device_properties(dev).sm_count
    for block_n, warps in ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4), (128, 4), (128, 8)):
        tiles = -(-spec.kv_len // block_n)
        for per_sm in (2, 4, 8, 12, 16):
            splits = max(1, min(tiles, round(per_sm * sms / base)))
            for stages in (2, 3, 5):
                try:
                    us = statistics.median(graph_times_us(
                        gather_calls(spec, sets, block_n, splits, warps, stages, dev)[0], replay_ms))
                except Exception as exc:  # out of shared memory etc.: skip the point
                    print(f"#   n{block_n} w{warps} s{splits} st{stages}: {type(exc).__name__}")
                    continue
                results.append((us, f"n{block_n} s{splits} w{warps} st{stages}"))
    results.sort()
    del sets
    torch.cuda.empty_cache()
    # The contiguous read of the same bytes, over read tiles, warps and programs per SM.
    copies = num_copies(spec)
    words = (nbytes - nbytes % 4) // 4
    contig = []
    for block, warps in ((2048, 8), (8192, 8), (4096, 4), (8192, 16)):
        for per_sm in (1, 2, 4, 8):
            programs = sms * per_sm
            per_program = max(block, (words // programs) // block * block)
            programs = words // per_program
            bufs = [torch.randint(0, 7, (programs * per_program,), dtype=torch.int32, device=dev)
                    for _ in range(copies)]
            sink = torch.empty(programs, dtype=torch.int32, device=dev)
            calls = [lambda b=b, o=sink, n=per_program, p=programs, blk=block, w=warps:
                     _read_sum_kernel[(p,)](b, o, n, BLOCK=blk, num_warps=w) for b in bufs]
            us = statistics.median(graph_times_us(calls, replay_ms))
            contig.append((us, f"{block} words x {warps} warps, {programs} programs"))
            del bufs
    bufs = [torch.randint(0, 7, (words,), dtype=torch.int32, device=dev) for _ in range(copies)]
    total = torch.empty((), dtype=torch.int64, device=dev)
    us = statistics.median(graph_times_us([lambda b=b: torch.sum(b, dim=0, out=total) for b in bufs], replay_ms))
    contig.append((us, "torch.sum"))
    del bufs
    contig.sort()
    torch.cuda.empty_cache()

    def pct(us):
        return 100 * nbytes / (us * 1e-6) / 1e9 / copy_gbs
    top = ", ".join(f"{us:.1f} us {name}" for us, name in results[:4])
    best, best_c = results[0][0], contig[0][0]
    return (f"{spec.name:34s} gather floor, best of {len(results)}: {best:.1f} us ({pct(best):.1f}% copy); "
            f"top: {top}\n{'':34s} contiguous read, best of {len(contig)}: {best_c:.1f} us ({pct(best_c):.1f}% "
            f"copy), {contig[0][1]}")


def read_ceiling(dev, copy_gbs: float, nbytes: int = 4 * 2**30) -> str:
    """The read-only bandwidth of ``_read_sum_kernel`` over one 4 GiB buffer (the anchors' read
    ceiling was measured over 4 GiB), best of a few tiles."""
    words = nbytes // 4
    buf = torch.randint(0, 7, (words,), dtype=torch.int32, device=dev)
    best = None
    for block, warps, per_sm in ((8192, 8, 8), (8192, 16, 2), (2048, 8, 8), (4096, 4, 16)):
        programs = device_properties(dev).sm_count * per_sm
        per_program = (words // programs) // block * block
        programs = words // per_program
        sink = torch.empty(programs, dtype=torch.int32, device=dev)
        us = statistics.median(graph_times_us(
            [lambda b=buf, o=sink, p=programs, n=per_program, blk=block, w=warps:
             _read_sum_kernel[(p,)](b, o, n, BLOCK=blk, num_warps=w)], 200.0))
        best = us if best is None else min(best, us)
    del buf
    torch.cuda.empty_cache()
    gbs = nbytes / (best * 1e-6) / 1e9
    return f"# read ceiling: 4 GiB read in {best:.0f} us = {gbs:.0f} GB/s ({100 * gbs / copy_gbs:.1f}% of copy)"


def both(calls, replay_ms: float) -> tuple[float, float]:
    sync = statistics.median(graph_times_us(calls, replay_ms))
    stream = statistics.median(stream_times_us(calls, replay_ms))
    return sync, stream


def probe(spec: ShapeSpec, dev, replay_ms: float, copy_gbs: float) -> str:
    copies = num_copies(spec)
    sets = make_inputs(spec, dev, copies=copies, seed=1)
    nbytes = bytes_moved(spec, sets[0].seq_lens.tolist())
    wrappers = [plan_wrapper(spec, s) for s in sets]
    cfg = wrappers[0].config.kernel_config
    decode_call(wrappers[0], sets[0], validate=True)()  # the metadata checked once

    def timed(launch_type=DecodeLaunch, **options):
        """Both methods' times of the plans' calls, their launchers rebuilt with these arguments."""
        ws = wrappers
        if options or launch_type is not DecodeLaunch:
            ws = [relaunch(plan_wrapper(spec, s), launch_type, **options) for s in sets]
        return both([decode_call(w, s) for w, s in zip(ws, sets)], replay_ms)

    ours = timed()
    no_pdl = timed(pdl=False)
    split_only = timed(SplitPassOnly)
    split_only_plain = timed(SplitPassOnly, pdl=False)

    gath = both(gather_calls(spec, sets, cfg.block_n, cfg.num_kv_splits, cfg.num_warps, cfg.num_stages, dev)[0],
                replay_ms)
    gath_pdl = both(gather_calls(spec, sets, cfg.block_n, cfg.num_kv_splits, cfg.num_warps, cfg.num_stages, dev,
                                 pdl=True)[0], replay_ms)

    words = (nbytes - nbytes % 4) // 4
    block = 2048
    programs = device_properties(dev).sm_count * 8
    per_program = max(block, (words // programs) // block * block)
    programs = words // per_program
    bufs = [torch.randint(0, 7, (programs * per_program,), dtype=torch.int32, device=dev) for _ in range(copies)]
    rsink = torch.empty(programs, dtype=torch.int32, device=dev)
    contig = both([lambda b=b: _read_sum_kernel[(programs,)](b, rsink, per_program, BLOCK=block, num_warps=8)
                   for b in bufs], replay_ms)
    del bufs
    sets.clear()  # the inputs' memory goes back before the next shape (timed() reads these lists)
    wrappers.clear()
    torch.cuda.empty_cache()

    def pct(us):
        return 100 * nbytes / (us * 1e-6) / 1e9 / copy_gbs
    mib = round(nbytes / 2**20)
    key = spec.name.split("_H")[0]
    anchor_c = ANCHOR_CONTIG_US.get(mib)
    anchor_g = ANCHOR_GATHER_US.get(key) if spec.num_qo_heads == 32 and spec.num_kv_heads == 8 else None
    anchors = (f"anchors: contig {anchor_c} gather {anchor_g}" if anchor_c or anchor_g else "")
    return (f"{spec.name:34s} R={copies:<3d} {mib:5d} MiB  ours {ours[0]:8.1f} / {ours[1]:8.1f} us "
            f"({pct(ours[0]):5.1f} / {pct(ours[1]):5.1f}%)  split pass only {split_only[0]:8.1f} / "
            f"{split_only[1]:8.1f} (PDL off {split_only_plain[0]:8.1f} / {split_only_plain[1]:8.1f})  PDL off {no_pdl[0]:8.1f} / {no_pdl[1]:8.1f}  gather {gath[0]:8.1f} / {gath[1]:8.1f} "
            f"(with PDL {gath_pdl[0]:8.1f} / {gath_pdl[1]:8.1f})  "
            f"contig {contig[0]:8.1f} / {contig[1]:8.1f} ({pct(contig[0]):5.1f} / {pct(contig[1]):5.1f}%)  "
            f"{anchors}  [{cfg}]")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="comma-separated name fragments")
    ap.add_argument("--replay-ms", type=float, default=80.0)
    ap.add_argument("--fp8", action="store_true", help="the fp8-cache target rows instead")
    ap.add_argument("--sweep", action="store_true",
                    help="instead: the best paged-gather floor over tiles, warps, stages and splits")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("method_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    copy_gbs = copy_bandwidth_gbs(dev)
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {copy_gbs:.0f} GB/s; times sync / stream (us), % of copy")
    k = 1024
    shapes = [ShapeSpec(batch_size=b, kv_len=l, num_qo_heads=hq, num_kv_heads=hkv) for b, l, hq, hkv in (
        (1, k, 32, 8), (1, 8 * k, 32, 8), (8, k, 32, 8), (1, 32 * k, 32, 8), (8, 8 * k, 32, 8),
        (8, 8 * k, 64, 8), (32, k, 32, 8), (8, k, 32, 32), (32, 8 * k, 32, 8), (128, 8 * k, 32, 8))]
    if args.fp8:  # the fp8 target rows ("large" shapes with float8_e4m3fn K/V)
        shapes = [ShapeSpec(batch_size=b, kv_len=l, num_qo_heads=hq, num_kv_heads=hkv, kv_dtype="float8_e4m3fn")
                  for b, l, hq, hkv in ((128, 8 * k, 32, 8), (128, 32 * k, 32, 8), (256, 4 * k, 32, 8),
                                        (32, 8 * k, 32, 32), (32, 32 * k, 32, 32), (128, 8 * k, 32, 32))]
    sweep_header = False
    for spec in shapes:
        if args.only and not any(p and p in spec.name for p in args.only.split(",")):
            continue
        if args.sweep:
            if not sweep_header:
                sweep_header = True
                print(read_ceiling(dev, copy_gbs), flush=True)
            print(sweep_gather(spec, dev, copy_gbs, min(args.replay_ms, 20.0)), flush=True)
        else:
            print(probe(spec, dev, args.replay_ms, copy_gbs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
