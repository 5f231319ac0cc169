"""Measurement: random inputs for a ShapeSpec, a planned wrapper over them, bytes moved, CUDA-graph
timing, copy bandwidth.

The timing method is the one the peers' published decode numbers use, so numbers compare:
R back-to-back calls, each on its own inputs over disjoint pages of one pool
(R = ceil(256 MiB / K/V bytes read), at most 64), captured in one CUDA graph and replayed for about
80 ms; the reported time is the median replay time / R. This keeps K/V out of L2 and hides launch
gaps the way a graphed decode step does. Without CUDA (interpreter) times are wall-clock and
meaningless; callers must say so.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from tsdecode import BatchDecodePagedTSWrapper, KernelConfig

from .grids import DTYPES, ShapeSpec

L2_FLUSH_BYTES = 256 * 2**20
MAX_COPIES = 64
POOL_BUDGET_BYTES = 16 * 2**30  # whole caches of all copies (windowed shapes read part of each)


@dataclass
class DecodeInputs:
    """One input set: q, cache [num_pages, 2, Hkv, P, D], block_tables [B, C] (C padded to a
    multiple of 16, the row stride a plan compiles for), seq_lens [B], qo_indptr [B+1] (packed
    only) and a preallocated output."""

    q: torch.Tensor
    cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    qo_indptr: torch.Tensor | None
    out: torch.Tensor


def seq_lens_for(spec: ShapeSpec, generator: torch.Generator) -> list[int]:
    if not spec.ragged:
        return [spec.kv_len] * spec.batch_size
    lo = max(1, spec.kv_len // 2)
    lens = torch.randint(lo, spec.kv_len + 1, (spec.batch_size,), generator=generator).tolist()
    lens[int(torch.randint(0, spec.batch_size, (1,), generator=generator))] = spec.kv_len
    if spec.mask_type == "causal":
        lens = [max(n, spec.seq_len_q) for n in lens]
    return lens


def q_lens_for(spec: ShapeSpec, generator: torch.Generator) -> list[int]:
    if not spec.packed:
        return [spec.seq_len_q] * spec.batch_size
    return torch.randint(1, spec.seq_len_q + 1, (spec.batch_size,), generator=generator).tolist()


def visible_kv_len(spec: ShapeSpec, kv_len: int, q_len: int) -> int:
    """Keys a request's query rows can see (the op reads no others): all kv_len, or with a sliding
    window (causal) the last q_len + window_left of them."""
    if spec.window_left >= 0:
        return min(kv_len, q_len + spec.window_left)
    return kv_len


def kv_bytes(spec: ShapeSpec, seq_lens: Sequence[int] | None = None,
             q_lens: Sequence[int] | None = None) -> int:
    """K and V bytes read once: 2 * sum(visible L) * Hkv * D * element size.

    Visible L: ``visible_kv_len`` of each request, its query length from q_lens (packed; the
    capacity seq_len_q when q_lens is None) or seq_len_q (fixed).
    """
    lens = list(seq_lens) if seq_lens is not None else [spec.kv_len] * spec.batch_size
    sq = list(q_lens) if q_lens is not None else [spec.seq_len_q] * len(lens)
    total = sum(visible_kv_len(spec, n, q) for n, q in zip(lens, sq))
    elem = DTYPES[spec.kv_dtype].itemsize
    return 2 * total * spec.num_kv_heads * spec.head_dim * elem


def bytes_moved(spec: ShapeSpec, seq_lens: Sequence[int] | None = None, total_q: int | None = None,
                q_lens: Sequence[int] | None = None) -> int:
    """The floor's bytes: visible K/V read once plus q read and the output written once."""
    tq = total_q if total_q is not None else spec.batch_size * spec.seq_len_q
    qo = tq * spec.num_qo_heads * spec.head_dim * (DTYPES[spec.q_dtype].itemsize + DTYPES[spec.o_dtype].itemsize)
    return kv_bytes(spec, seq_lens, q_lens) + qo


def input_q_lens(inputs: "DecodeInputs") -> list[int] | None:
    """Per-request query lengths of a packed input set (from qo_indptr); None otherwise."""
    if inputs.qo_indptr is None:
        return None
    return torch.diff(inputs.qo_indptr.cpu()).tolist()


def num_copies(spec: ShapeSpec) -> int:
    """Input sets to rotate through so K/V stays out of L2 (R above): enough that the
    calls of one replay read L2_FLUSH_BYTES of visible K/V, at most MAX_COPIES, and no more than
    fit POOL_BUDGET_BYTES of whole caches (a sliding window reads a small part of each)."""
    visible = max(1, kv_bytes(spec))
    whole = 2 * spec.batch_size * -(-spec.kv_len // spec.page_size) * spec.page_size \
        * spec.num_kv_heads * spec.head_dim * DTYPES[spec.kv_dtype].itemsize
    fit = max(1, POOL_BUDGET_BYTES // max(1, whole))
    return max(1, min(MAX_COPIES, math.ceil(L2_FLUSH_BYTES / visible), fit))


def make_inputs(spec: ShapeSpec, device: torch.device | str, copies: int = 1, seed: int = 0) -> list[DecodeInputs]:
    """``copies`` input sets over disjoint, randomly permuted pages of one cache pool.

    Data is random normal (never zeros); all sets share the lengths drawn for the spec.
    """
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    lens = seq_lens_for(spec, gen)
    q_lens = q_lens_for(spec, gen)
    p = spec.page_size
    pages = [-(-n // p) for n in lens]
    cols = -(-max(pages) // 16) * 16
    per_copy = sum(pages)
    pool_pages = per_copy * copies
    kv_dtype = DTYPES[spec.kv_dtype]
    cache = torch.empty((pool_pages, 2, spec.num_kv_heads, p, spec.head_dim), dtype=kv_dtype, device=device)
    # Fill in chunks so the fp32 temporary stays small for large pools.
    chunk = max(1, (64 * 2**20) // max(1, cache[0].numel() * 4))
    for start in range(0, pool_pages, chunk):
        stop = min(pool_pages, start + chunk)
        cache[start:stop] = torch.randn(cache[start:stop].shape, device=device, dtype=torch.float32).to(kv_dtype)
    perm = torch.randperm(pool_pages, generator=gen).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    total_q = sum(q_lens)
    q_dtype, o_dtype = DTYPES[spec.q_dtype], DTYPES[spec.o_dtype]
    if spec.packed:
        q_shape = (total_q, spec.num_qo_heads, spec.head_dim)
        indptr = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    elif spec.seq_len_q == 1:
        q_shape, indptr = (spec.batch_size, spec.num_qo_heads, spec.head_dim), None
    else:
        q_shape, indptr = (spec.batch_size, spec.seq_len_q, spec.num_qo_heads, spec.head_dim), None
    sets = []
    for c in range(copies):
        ids = perm[c * per_copy : (c + 1) * per_copy].tolist()
        table = torch.zeros((spec.batch_size, cols), dtype=torch.int32)
        at = 0
        for b, n in enumerate(pages):
            table[b, :n] = torch.tensor(ids[at : at + n], dtype=torch.int32)
            at += n
        q = torch.randn(q_shape, generator=gen).to(q_dtype).to(device)
        sets.append(DecodeInputs(
            q=q, cache=cache, block_tables=table.to(device), seq_lens=seq_lens,
            qo_indptr=indptr, out=torch.empty(q_shape, dtype=o_dtype, device=device),
        ))
    return sets


def plan_wrapper(spec: ShapeSpec, inputs: DecodeInputs,
                 config: KernelConfig | None = None) -> BatchDecodePagedTSWrapper:
    """A wrapper planned for ``inputs`` (config None: what the runtime picks). The plan owns the
    drawn lengths, so it sees their spread as a serving engine's plan would."""
    w = BatchDecodePagedTSWrapper()
    w.plan(inputs.q.device, spec.batch_size, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
           spec.page_size, spec.kv_len, max_seq_len_q=spec.seq_len_q, packed_query=spec.packed,
           q_data_type=DTYPES[spec.q_dtype], kv_data_type=DTYPES[spec.kv_dtype],
           o_data_type=DTYPES[spec.o_dtype], mask_type=spec.mask_type, window_left=spec.window_left,
           seq_lens=inputs.seq_lens.tolist(), config=config)
    return w


def decode_call(w: BatchDecodePagedTSWrapper, inputs: DecodeInputs,
                validate: bool = False) -> Callable[[], torch.Tensor]:
    """``w.run`` on ``inputs`` into ``inputs.out``; without validation by default, as a CUDA graph
    captures it (check the metadata once with ``validate=True`` first)."""
    return lambda: w.run(inputs.q, inputs.cache, None, inputs.block_tables, qo_indptr=inputs.qo_indptr,
                         out=inputs.out, validate=validate)


def geomean(values: Iterable[float]) -> float | None:
    """Geometric mean of the positive finite values (None if there are none)."""
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def graph_time_us(calls: Sequence[Callable[[], object]], replay_ms: float = 80.0, min_replays: int = 5) -> float:
    """Median time of one call (us): the median of ``graph_times_us``."""
    return statistics.median(graph_times_us(calls, replay_ms, min_replays))


def copy_bandwidth_gbs(device: torch.device | str = "cuda", nbytes: int = 2 * 2**30, repeats: int = 20) -> float:
    """Copy bandwidth in GB/s (1e9 B/s), counting bytes read plus written: device-to-device on a
    GPU, timed eagerly with events (a ~1 ms copy hides launch overhead; a graphed copy becomes a
    copy-engine memcpy node and measures lower); host memory on the CPU (at most 64 MiB,
    wall-clock: the CPU mode's stand-in)."""
    device = torch.device(device)
    if device.type != "cuda":
        return _host_copy_bandwidth_gbs(min(nbytes, 64 * 2**20))
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    return 2 * nbytes / (statistics.median(times) * 1e-3) / 1e9


def _host_copy_bandwidth_gbs(nbytes: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    us = statistics.median(wall_times_us(lambda: dst.copy_(src), repeats=5))
    return 2 * src.numel() * 4 / (us * 1e-6) / 1e9


def reference_rows(spec: ShapeSpec, inputs: DecodeInputs, count: int) -> tuple[torch.Tensor, int, int]:
    """The float64 reference of the first ``count`` requests (at least one, at most B), the
    output rows they fill (the first ``stop``) and how many requests that is."""
    from tsdecode.reference import reference_decode

    k = max(1, min(count, spec.batch_size))
    stop = int(inputs.qo_indptr[k]) if inputs.qo_indptr is not None else k
    with torch.no_grad():
        ref = reference_decode(
            inputs.q[:stop], inputs.cache, inputs.block_tables[:k], inputs.seq_lens[:k], seq_len_q=spec.seq_len_q,
            qo_indptr=None if inputs.qo_indptr is None else inputs.qo_indptr[: k + 1], mask_type=spec.mask_type,
            window_left=spec.window_left, compute_dtype=torch.float64)
    return ref, stop, k


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN/inf anywhere gives inf."""
    o = out.to(torch.float64).cpu()
    r = ref.to(torch.float64).cpu()
    if not torch.isfinite(o).all():
        return math.inf
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def tolerance(spec: ShapeSpec) -> float:
    """Acceptable relative error vs the float64 reference for the spec's dtypes."""
    if "float8_e4m3fn" in (spec.q_dtype, spec.o_dtype):
        return 6e-2
    return 2e-2


def graph_times_us(calls: Sequence[Callable[[], object]], replay_ms: float = 80.0, min_replays: int = 5) -> list[float]:
    """Per-replay times of one call (us), same method as ``graph_time_us``: all ``calls`` captured
    back to back in one CUDA graph (warmed first), replayed for about ``replay_ms``; each entry is
    one replay's time / len(calls). Its median is what ``graph_time_us`` reports."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    one_ms = max(start.elapsed_time(end), 1e-3)
    replays = max(min_replays, int(replay_ms / one_ms))
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(calls))
    del graph
    return times


def sm_clock_mhz() -> float | None:
    """The current GPU's SM clock now, MHz (NVML's reading through torch; None where NVML is
    missing): read after a timing window, it tells a window run at a lowered clock."""
    try:
        return float(torch.cuda.clock_rate())
    except Exception:  # no pynvml / amdsmi: the clock is not reported
        return None


def wall_times_us(call: Callable[[], object], repeats: int = 1) -> list[float]:
    """Wall-clock time of each of ``repeats`` calls (us); CPU/interpreter runs, meaningless."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e6)
    return times
