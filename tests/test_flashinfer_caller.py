"""A FlashInfer-style caller, written only from the signatures of FlashInfer's PrimTS decode API
(v0.7.0.post1, "version A" in the spec): what an engine that uses PrimTS on Blackwell writes, run
unchanged against tsdecode.

The engine keeps a pool of pages, a block table padded with -1 past each request's live pages,
and lengths either owned by the plan (``plan(..., seq_lens=[...])``, ``run(q, cache, None,
block_tables)``) or passed to every run. Query layouts: [B, Hq, D] (SQ = 1), token-major
[B, SQ, Hq, D] and packed [total_q, Hq, D] with ``qo_indptr`` at run. Every output is written
into a NaN-poisoned ``out`` and compared with the float64 reference. On the GPU: ``run(...,
validate=False, out=...)``, the capturable one-shot and ``prims_ts_batch_decode_with_kv_cache``
captured in a CUDA graph, with lengths, pages and query offsets changed in place between replays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tsdecode import (BatchDecodePagedTSWrapper, batch_decode_with_paged_kv_cache,
                      get_prims_ts_batch_decode_workspace_size, prims_ts_batch_decode_with_kv_cache)
from tsdecode.reference import reference_decode

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn
BF16, FP16 = torch.bfloat16, torch.float16


@dataclass
class Batch:
    """One decode step of the engine: q, the page pool, the padded block table, lengths."""

    q: torch.Tensor
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    block_tables: torch.Tensor  # int32 [B, C], -1 past the live pages
    seq_lens: torch.Tensor  # int32 [B] on the device
    qo_indptr: torch.Tensor | None
    num_pages: int

    @property
    def host_lens(self) -> list[int]:
        return self.seq_lens.tolist()


def make_batch(lens, *, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, seq_len_q=1, q_lens=None,
               dtype=BF16, kv_dtype=None, columns=None, separate=False, seed=0, fill_all_columns=False) -> Batch:
    """Pages in random pool order; ``columns`` table columns (default: the longest request's
    pages + 2); every column past a request's pages is -1 unless ``fill_all_columns`` (an engine
    that reserves pages up to its capacity, so lengths may grow between graph replays)."""
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    pages = [math.ceil(n / page_size) for n in lens]
    columns = columns or max(pages) + 2
    num_pages = (len(lens) * columns if fill_all_columns else sum(pages)) + 4
    shape = (num_pages, num_kv_heads, page_size, head_dim)
    if separate:
        kv_cache = tuple(torch.randn(shape, generator=gen).to(kv_dtype).to(DEVICE) for _ in range(2))
    else:
        kv_cache = torch.randn((num_pages, 2, *shape[1:]), generator=gen).to(kv_dtype).to(DEVICE)
    pool = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((len(lens), columns), -1, dtype=torch.int32)
    for b, n in enumerate(pages):
        take = columns if fill_all_columns else n
        table[b, :take] = torch.tensor([pool.pop() for _ in range(take)], dtype=torch.int32)
    qo_indptr = None
    if q_lens is not None:
        qo_indptr = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        q_shape = (sum(q_lens), num_qo_heads, head_dim)
    elif seq_len_q == 1:
        q_shape = (len(lens), num_qo_heads, head_dim)
    else:
        q_shape = (len(lens), seq_len_q, num_qo_heads, head_dim)
    q = torch.randn(q_shape, generator=gen).to(dtype).to(DEVICE)
    return Batch(q, kv_cache, table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE), qo_indptr,
                 num_pages)


def reference(batch: Batch, *, mask_type="dense", window_left=-1, bmm1_scale=None, bmm2_scale=1.0) -> torch.Tensor:
    seq_len_q = batch.q.shape[1] if batch.q.dim() == 4 else 1
    return reference_decode(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, seq_len_q=seq_len_q,
                            qo_indptr=batch.qo_indptr, mask_type=mask_type, window_left=window_left,
                            bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale)


def poisoned(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(like.shape, float("nan"), dtype=torch.float32, device=like.device).to(dtype)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, rel_tol: float = 1.5e-2) -> None:
    o, r = out.double().cpu(), ref.double().cpu()
    assert o.shape == r.shape
    assert torch.isfinite(o).all(), "unwritten (NaN) output elements"
    rel = float((o - r).norm() / r.norm())
    assert rel < rel_tol, f"relative error {rel:.3e} (tolerance {rel_tol})"


# --- plan-owned and run-owned lengths, fixed and packed Q ----------------------------------------

def test_plan_owned_lengths_sq1_defaults():
    """The shortest FlashInfer call: fp16 (plan's default q_data_type), lengths given to plan,
    run(q, cache, None, block_tables); then the same wrapper re-planned for the next step."""
    w = BatchDecodePagedTSWrapper(kv_layout="HND")
    for step, lens in enumerate([(1, 17, 40), (2, 18, 41, 7)]):
        batch = make_batch(lens, dtype=FP16, seed=step)
        w.plan(DEVICE, len(lens), 8, 2, 64, 16, max(lens), seq_lens=list(lens))
        out = poisoned(batch.q, FP16)
        result = w.run(batch.q, batch.kv_cache, None, batch.block_tables, out=out)
        assert result is out
        assert_matches(out, reference(batch))
        allocated = w.run(batch.q, batch.kv_cache, None, batch.block_tables)  # out allocated
        assert allocated.dtype == FP16 and allocated.shape == batch.q.shape
        torch.testing.assert_close(allocated, out, rtol=0, atol=0)


@pytest.mark.parametrize("seq_lens_form", ["list", "cpu int32", "cpu int64"])
def test_plan_owned_lengths_forms(seq_lens_form):
    lens = (5, 64, 33)
    batch = make_batch(lens, separate=True)
    host = {"list": list(lens), "cpu int32": torch.tensor(lens, dtype=torch.int32),
            "cpu int64": torch.tensor(lens)}[seq_lens_form]
    w = BatchDecodePagedTSWrapper()
    w.plan(DEVICE, 3, 8, 2, 64, 16, 128, q_data_type=BF16, kv_data_type=BF16, o_data_type=BF16, seq_lens=host)
    out = poisoned(batch.q, BF16)
    w.run(batch.q, batch.kv_cache, None, batch.block_tables, bmm1_scale=0.1, bmm2_scale=0.5, out=out)
    assert_matches(out, reference(batch, bmm1_scale=0.1, bmm2_scale=0.5))


@pytest.mark.parametrize("validate", [True, False])
def test_run_owned_lengths_fixed_sq_token_major(validate):
    """Run-owned lengths (a device int32 tensor each run), token-major [B, SQ, Hq, D] queries with
    a causal mask and a window; two steps with new lengths in the same tensor."""
    lens = (4, 37, 70)
    batch = make_batch(lens, seq_len_q=4, columns=8)
    w = BatchDecodePagedTSWrapper()
    w.plan(DEVICE, 3, 8, 2, 64, 16, 128, max_seq_len_q=4, q_data_type=BF16, mask_type="causal", window_left=20)
    for new_lens in (lens, (9, 33, 64)):
        batch.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out = poisoned(batch.q, BF16)
        w.run(batch.q, batch.kv_cache, batch.seq_lens, batch.block_tables, out=out, validate=validate)
        assert_matches(out, reference(batch, mask_type="causal", window_left=20))


@pytest.mark.parametrize("lengths", ["plan", "run"])
def test_packed_queries(lengths):
    """packed_query=True: q is [total_q, Hq, D], qo_indptr goes to every run and is read there, so
    new offsets (same total) in the same tensor take effect on the next run."""
    lens, q_lens = (5, 40, 17), (1, 3, 2)
    batch = make_batch(lens, q_lens=q_lens)
    w = BatchDecodePagedTSWrapper()
    w.plan(DEVICE, 3, 8, 2, 64, 16, 64, max_seq_len_q=4, packed_query=True, q_data_type=BF16, mask_type="causal",
           seq_lens=list(lens) if lengths == "plan" else None)
    seq_lens = None if lengths == "plan" else batch.seq_lens
    for offsets in ([0, 1, 4, 6], [0, 3, 4, 6], [0, 2, 5, 6]):
        batch.qo_indptr.copy_(torch.tensor(offsets, dtype=torch.int32))
        out = poisoned(batch.q, BF16)
        w.run(batch.q, batch.kv_cache, seq_lens, batch.block_tables, qo_indptr=batch.qo_indptr, out=out)
        assert_matches(out, reference(batch, mask_type="causal"))


def test_padded_rows_with_minus_one_and_garbage_are_accepted():
    """Row-strided block tables (padding between rows) holding -1 or any value past the live
    pages: accepted by validated runs and by the one-shot, never read."""
    lens = (3, 50, 17)
    batch = make_batch(lens, columns=6)
    wide = torch.full((3, 11), -1, dtype=torch.int32, device=DEVICE)
    wide[:, :6] = batch.block_tables
    wide[0, 3:] = 2**31 - 1  # garbage past request 0's single page
    batch.block_tables = wide[:, :6]
    assert batch.block_tables.stride(0) == 11
    ref = reference(batch)
    w = BatchDecodePagedTSWrapper()
    w.plan(DEVICE, 3, 8, 2, 64, 16, 4096, q_data_type=BF16)  # capacity far beyond the table
    out = poisoned(batch.q, BF16)
    w.run(batch.q, batch.kv_cache, batch.seq_lens, batch.block_tables, out=out)
    assert_matches(out, ref)
    assert_matches(batch_decode_with_paged_kv_cache(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens), ref)


def test_fp8_query_and_cache():
    """FlashInfer's fp8 pair: fp8 q over an fp8 cache, fp16 output, scales folded into
    bmm1_scale / bmm2_scale."""
    lens = (9, 100)
    batch = make_batch(lens, dtype=FP8)
    w = BatchDecodePagedTSWrapper()
    w.plan(DEVICE, 2, 8, 2, 64, 16, 128, q_data_type=FP8, kv_data_type=FP8, o_data_type=FP16, seq_lens=list(lens))
    out = poisoned(batch.q, FP16)
    w.run(batch.q, batch.kv_cache, None, batch.block_tables, bmm1_scale=0.125 * 0.5, bmm2_scale=0.75, out=out)
    assert_matches(out, reference(batch, bmm1_scale=0.125 * 0.5, bmm2_scale=0.75), rel_tol=3e-2)


def test_workspace_sized_by_the_helper():
    """The caller sizes the workspace with A's helper for the plan's arguments and hands it to plan."""
    lens = (100, 300)
    batch = make_batch(lens)
    size = get_prims_ts_batch_decode_workspace_size(2, 8, 2, 64, 16, 512, q_dtype=BF16, kv_dtype=BF16,
                                                    out_dtype=BF16, device=DEVICE)
    workspace = torch.zeros(max(size, 1), dtype=torch.uint8, device=DEVICE)
    w = BatchDecodePagedTSWrapper()
    w.plan(DEVICE, 2, 8, 2, 64, 16, 512, q_data_type=BF16, workspace_buffer=workspace)
    out = poisoned(batch.q, BF16)
    w.run(batch.q, batch.kv_cache, batch.seq_lens, batch.block_tables, out=out)
    assert_matches(out, reference(batch))


@pytest.mark.parametrize("packed", [False, True])
def test_oneshot_default_and_capture_mode(packed):
    """The one-shot op with A's signature (host read of the lengths), and in B's capture mode
    (workspace_buffer + max_kv_len + out + validate=False, packed queries also max_seq_len_q):
    the same answer."""
    lens = (5, 40, 17)
    batch = make_batch(lens, q_lens=(1, 3, 2) if packed else None)
    ref = reference(batch)
    kw = dict(qo_indptr=batch.qo_indptr) if packed else {}
    assert_matches(batch_decode_with_paged_kv_cache(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, **kw),
                   ref)
    size = get_prims_ts_batch_decode_workspace_size(3, 8, 2, 64, 16, 64, q_dtype=BF16, device=DEVICE,
                                                    **(dict(qo_indptr=batch.qo_indptr, max_seq_len_q=4) if packed else {}))
    workspace = torch.zeros(max(size, 32), dtype=torch.uint8, device=DEVICE)
    out = poisoned(batch.q, BF16)
    result = batch_decode_with_paged_kv_cache(
        batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, out=out, workspace_buffer=workspace,
        max_kv_len=64, validate=False, **(dict(kw, max_seq_len_q=4) if packed else {}))
    assert result is out
    assert_matches(out, ref)


def test_capture_forms_read_nothing_on_the_host(monkeypatch):
    """What a CUDA graph captures reads no metadata on the host and calls no plan(): run(validate=
    False) and the capturable one-shot run while a capture is simulated and the metadata read
    raises; the default one-shot and plan() refuse the capture with a RuntimeError saying how to
    capture. (CPU stand-in for the GPU tests below.)"""
    from tsdecode import api, oneshot

    lens = (5, 40)
    batch = make_batch(lens)
    ref = reference(batch)
    w = BatchDecodePagedTSWrapper()
    w.plan(DEVICE, 2, 8, 2, 64, 16, 64, q_data_type=BF16)
    workspace = torch.zeros(1 << 16, dtype=torch.uint8, device=DEVICE)
    batch_decode_with_paged_kv_cache(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                     out=poisoned(batch.q, BF16), workspace_buffer=workspace, max_kv_len=64,
                                     validate=False)  # the call outside the capture

    def no_host_read(*args, **kw):
        raise AssertionError("metadata read on the host")

    for module in (api, oneshot):
        monkeypatch.setattr(module, "read_metadata", no_host_read)
    monkeypatch.setattr(api, "capturing", lambda device: True)
    out = poisoned(batch.q, BF16)
    w.run(batch.q, batch.kv_cache, batch.seq_lens, batch.block_tables, out=out, validate=False)
    assert_matches(out, ref)
    out = poisoned(batch.q, BF16)
    batch_decode_with_paged_kv_cache(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, out=out,
                                     workspace_buffer=workspace, max_kv_len=64, validate=False)
    assert_matches(out, ref)
    with pytest.raises(RuntimeError, match="validate=False") as info:
        batch_decode_with_paged_kv_cache(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens)
    assert "workspace_buffer" in str(info.value) and "max_kv_len" in str(info.value)
    with pytest.raises(RuntimeError, match="plan cannot run during CUDA graph capture"):
        w.plan(DEVICE, 2, 8, 2, 64, 16, 64, q_data_type=BF16)


# --- CUDA graphs (GPU) -----------------------------------------------------------------------------

def _capture(fn) -> torch.cuda.CUDAGraph:
    """One warm-up call on a side stream, then fn captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _next_step(batch: Batch, lens, q_offsets=None) -> None:
    """The engine's next step, in place: new lengths, two pages remapped to spare pool pages
    holding new K/V, new query offsets (same total), new q values."""
    batch.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    used = set(batch.block_tables.flatten().tolist())
    spare = [p for p in range(batch.num_pages) if p not in used]
    for (b, c), page in zip(((0, 0), (len(lens) - 1, 1)), spare):
        cache = batch.kv_cache if isinstance(batch.kv_cache, torch.Tensor) else batch.kv_cache[0]
        cache[page].copy_(torch.randn(cache[page].shape, device="cpu").to(cache.dtype))
        batch.block_tables[b, c] = page
    if q_offsets is not None:
        batch.qo_indptr.copy_(torch.tensor(q_offsets, dtype=torch.int32))
    batch.q.copy_(torch.randn(batch.q.shape, device="cpu").to(batch.q.dtype))


STEPS = [((700, 64, 333, 1), (0, 1, 3, 4, 5)), ((1, 700, 65, 129), (0, 2, 3, 4, 5)),
         ((300, 2, 700, 16), (0, 1, 2, 4, 5))]


@pytest.mark.gpu
@pytest.mark.parametrize("query", ["sq1", "packed", "fixed-sq2"])
def test_cuda_graph_of_run(query):
    """plan before the capture; capture run(..., validate=False, out=...) after one warm-up run;
    between replays change the run-owned lengths, re-map pages in the block table and change
    qo_indptr, all in place; every replay matches the reference."""
    packed, sq = query == "packed", 2 if query == "fixed-sq2" else 1
    batch = make_batch([max(n, sq) for n in STEPS[0][0]], num_qo_heads=32, num_kv_heads=8, head_dim=128,
                       page_size=16, columns=44, q_lens=(1, 2, 1, 1) if packed else None, seq_len_q=sq,
                       fill_all_columns=True)
    mask = "causal" if sq > 1 else "dense"
    w = BatchDecodePagedTSWrapper()
    w.plan(DEVICE, 4, 32, 8, 128, 16, 700, max_seq_len_q=2 if packed else sq, packed_query=packed,
           q_data_type=BF16, mask_type=mask)
    out = poisoned(batch.q, BF16)
    graph = _capture(lambda: w.run(batch.q, batch.kv_cache, batch.seq_lens, batch.block_tables,
                                   qo_indptr=batch.qo_indptr, out=out, validate=False))
    for step, (lens, offsets) in enumerate(STEPS):
        if step:
            _next_step(batch, [max(n, sq) for n in lens], offsets if packed else None)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, reference(batch, mask_type=mask))


@pytest.mark.gpu
def test_cuda_graph_of_run_with_plan_owned_lengths():
    """Plan-owned lengths: the captured run replays with pages re-mapped and new q values."""
    lens = (100, 900, 17)
    batch = make_batch(lens, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    w = BatchDecodePagedTSWrapper()
    w.plan(DEVICE, 3, 32, 8, 128, 16, 900, q_data_type=BF16, seq_lens=list(lens))
    out = poisoned(batch.q, BF16)
    graph = _capture(lambda: w.run(batch.q, batch.kv_cache, None, batch.block_tables, out=out, validate=False))
    for step in range(2):
        if step:
            _next_step(batch, lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, reference(batch))


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_graph_of_the_capturable_oneshot(packed):
    """B's capture mode of the one-shot (workspace_buffer, max_kv_len, out, validate=False; packed
    also max_seq_len_q) captured after one call outside the capture; lengths, pages and offsets
    changed in place between replays."""
    batch = make_batch(STEPS[0][0], num_qo_heads=32, num_kv_heads=8, head_dim=128, columns=44,
                       q_lens=(1, 2, 1, 1) if packed else None, fill_all_columns=True)
    extra = dict(qo_indptr=batch.qo_indptr, max_seq_len_q=2) if packed else {}
    size = get_prims_ts_batch_decode_workspace_size(4, 32, 8, 128, 16, 700, q_dtype=BF16, device=DEVICE, **extra)
    workspace = torch.zeros(max(size, 32), dtype=torch.uint8, device=DEVICE)
    out = poisoned(batch.q, BF16)
    graph = _capture(lambda: batch_decode_with_paged_kv_cache(
        batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, out=out, workspace_buffer=workspace,
        max_kv_len=700, validate=False, **extra))
    for step, (lens, offsets) in enumerate(STEPS):
        if step:
            _next_step(batch, lens, offsets if packed else None)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, reference(batch))


@pytest.mark.gpu
@pytest.mark.parametrize("query", ["sq1", "packed", "fixed-sq2"])
def test_cuda_graph_of_prims_ts_batch_decode_with_kv_cache(query):
    """A's capture call (workspace_buffer and max_seq_len positional, out given; packed queries
    also max_seq_len_q) captured after one call outside the capture; lengths, pages and offsets
    changed in place between replays. Eager calls with out given allocate nothing."""
    packed, sq = query == "packed", 2 if query == "fixed-sq2" else 1
    batch = make_batch([max(n, sq) for n in STEPS[0][0]], num_qo_heads=32, num_kv_heads=8, head_dim=128,
                       columns=44, q_lens=(1, 2, 1, 1) if packed else None, seq_len_q=sq, fill_all_columns=True)
    mask = "causal" if sq > 1 else "dense"
    extra = dict(qo_indptr=batch.qo_indptr, max_seq_len_q=2) if packed else dict(seq_len_q=sq)
    size = get_prims_ts_batch_decode_workspace_size(4, 32, 8, 128, 16, 700, q_dtype=BF16, mask_type=mask,
                                                    device=DEVICE, **extra)
    workspace = torch.zeros(max(size, 32), dtype=torch.uint8, device=DEVICE)
    out = poisoned(batch.q, BF16)

    def step():
        return prims_ts_batch_decode_with_kv_cache(batch.q, batch.kv_cache, workspace, batch.block_tables,
                                                   batch.seq_lens, 700, out=out, mask_type=mask, **extra)

    graph = _capture(step)
    for i, (lens, offsets) in enumerate(STEPS):
        if i:
            _next_step(batch, [max(n, sq) for n in lens], offsets if packed else None)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, reference(batch, mask_type=mask))
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    out.fill_(float("nan"))
    assert step() is out
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    assert_matches(out, reference(batch, mask_type=mask))


@pytest.mark.gpu
def test_default_oneshot_refuses_capture_and_says_how():
    batch = make_batch((10, 20))
    batch_decode_with_paged_kv_cache(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError) as info:
            with torch.cuda.graph(graph):
                batch_decode_with_paged_kv_cache(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens)
    msg = str(info.value)
    assert "capture" in msg and "workspace_buffer" in msg and "validate=False" in msg, msg


@pytest.mark.gpu
def test_unvalidated_run_allocates_nothing_when_out_is_given():
    """run(validate=False, out=...) makes no device allocation (and no host sync to catch)."""
    lens = (100, 900, 17)
    batch = make_batch(lens, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    w = BatchDecodePagedTSWrapper()
    w.plan(DEVICE, 3, 32, 8, 128, 16, 1024, q_data_type=BF16)
    out = poisoned(batch.q, BF16)
    w.run(batch.q, batch.kv_cache, batch.seq_lens, batch.block_tables, out=out, validate=False)  # warm-up
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(3):
        w.run(batch.q, batch.kv_cache, batch.seq_lens, batch.block_tables, out=out, validate=False)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    assert_matches(out, reference(batch))
