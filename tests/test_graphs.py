"""tsdecode.graphs.DecodeGraphs: one planned wrapper (and CUDA graph) per padded batch size.

Batches of changing size and changing pages go through the padded sizes and match the float64
reference; padding rows are reset between steps. CPU: the wrappers run without graphs (Triton's
interpreter); GPU-marked: captured graphs replayed with new lengths and re-mapped pages.
"""

from __future__ import annotations

import pytest
import torch

from tsdecode.graphs import DecodeGraphs
from tsdecode.reference import reference_decode

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HQ, HKV, D, P, NUM_PAGES, MAX_KV_LEN = 4, 2, 64, 4, 40, 24


def _cache(separate: bool):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(NUM_PAGES, 2, HKV, P, D, generator=g).to(DEVICE, torch.bfloat16)
    return (kv[:, 0], kv[:, 1]) if separate else kv


def _step(lens: list[int], seed: int):
    """q, lengths and a block table of distinct random pages (page 0 kept for padding)."""
    g = torch.Generator().manual_seed(seed)
    pages = (torch.randperm(NUM_PAGES - 1, generator=g) + 1)[:len(lens) * (MAX_KV_LEN // P)]
    table = pages.view(len(lens), -1).to(torch.int32)
    q = torch.randn(len(lens), HQ, D, generator=g).to(torch.bfloat16)
    return q.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE), table.to(DEVICE)


def _check(out, q, cache, lens, table):
    """The repo's bf16 bounds (tests/cases.py): relative L2 error < 1.2e-2, max abs error < 0.05."""
    ref = reference_decode(q, cache, table, lens)
    err = out.double() - ref
    assert float(err.norm() / ref.norm()) < 1.2e-2 and float(err.abs().max()) < 0.05


# Batches grow and shrink (requests joining and leaving) across the padded sizes 1, 2, 4.
STEPS = [[5], [5, 17], [6, 18, 1], [7, 19, 2, 24], [20, 3], [1]]


@pytest.mark.parametrize("separate", [False, True], ids=["combined", "separate"])
def test_changing_batches_match_reference(separate):
    cache = _cache(separate)
    graphs = DecodeGraphs(cache, HQ, MAX_KV_LEN, batch_sizes=(1, 2, 4), capture=False)
    for seed, lens in enumerate(STEPS):
        q, seq_lens, table = _step(lens, seed)
        out = graphs(q, seq_lens, table)
        assert out.shape == q.shape
        _check(out, q, cache, seq_lens, table)
    assert sorted(graphs._static) == [1, 2, 4]


def test_max_kv_len_not_a_multiple_of_the_page_size():
    """max_kv_len 23 over 4-token pages: a request of 21-23 tokens needs a sixth, partly filled
    page, so the static block table must have six columns."""
    cache = _cache(False)
    graphs = DecodeGraphs(cache, HQ, 23, batch_sizes=(1, 2, 4), capture=False)
    for seed, lens in enumerate([[23], [21, 5], [22, 1, 23]]):
        g = torch.Generator().manual_seed(100 + seed)
        pages = (torch.randperm(NUM_PAGES - 1, generator=g) + 1)[:len(lens) * 6]
        table = pages.view(len(lens), 6).to(torch.int32).to(DEVICE)
        q = torch.randn(len(lens), HQ, D, generator=g).to(torch.bfloat16).to(DEVICE)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        _check(graphs(q, seq_lens, table), q, cache, seq_lens, table)


def test_padding_rows_are_reset():
    graphs = DecodeGraphs(_cache(False), HQ, MAX_KV_LEN, batch_sizes=(4,), pad_page=3, capture=False)
    graphs(*_step([9, 10, 11], 0))
    static = graphs.stage(*_step([12], 1))
    assert static.seq_lens.tolist() == [12, 1, 1, 1]
    assert static.block_tables[1:, 0].tolist() == [3, 3, 3]


def test_batch_sizes_and_limits():
    graphs = DecodeGraphs(_cache(False), HQ, MAX_KV_LEN, batch_sizes=(8, 1, 2), capture=False)
    assert [graphs.padded_batch_size(b) for b in (1, 2, 3, 8)] == [1, 2, 8, 8]
    with pytest.raises(ValueError, match="exceeds the largest captured batch size 8"):
        graphs.padded_batch_size(9)
    q, lens, table = _step([5], 0)
    with pytest.raises(ValueError, match="allows 6"):
        graphs(q, lens, torch.zeros(1, 7, dtype=torch.int32, device=DEVICE))


@pytest.mark.gpu
def test_graph_replay_with_new_lengths_and_pages():
    cache = _cache(False)
    graphs = DecodeGraphs(cache, HQ, MAX_KV_LEN, batch_sizes=(1, 2, 4))
    graphs.capture_all()
    captured = {size: static.graph for size, static in graphs._static.items()}
    assert all(g is not None for g in captured.values())
    for seed, lens in enumerate(STEPS * 2):
        q, seq_lens, table = _step(lens, seed)
        out = graphs(q, seq_lens, table)
        _check(out, q, cache, seq_lens, table)
        cache[table[0, 0].long(), 0, 0, 0, 0] += 1.0  # the cache changes in place between replays
    assert {size: static.graph for size, static in graphs._static.items()} == captured  # no re-capture


def test_a_step_of_the_wrong_shape_or_dtype_is_refused():
    """copy_ into the static tensors would broadcast or cast these silently."""
    graphs = DecodeGraphs(_cache(False), HQ, MAX_KV_LEN, batch_sizes=(4,), capture=False)
    q, lens, table = _step([5, 9, 13], 0)
    cases = [
        ((q[:, :1], lens, table), ValueError, r"q must be \[B, Hq, D\] = \[3, 4, 64\]"),
        ((q[..., :1], lens, table), ValueError, r"q must be \[B, Hq, D\]"),
        ((q[0], lens, table), ValueError, "with B >= 1"),
        ((q[:0], lens[:0], table[:0]), ValueError, "with B >= 1"),  # no request: an empty output, silently
        ((q.half(), lens, table), TypeError, r"q dtype must be torch.bfloat16 \(DecodeGraphs' q_data_type\)"),
        ((q.to("meta"), lens, table), ValueError, rf"q must be on {DEVICE} \(the cache's device\), got meta"),
        ((q, lens[:1], table), ValueError, r"seq_lens must have shape \[B\]=\[3\]"),
        ((q, lens.long(), table), TypeError, "seq_lens must be int32"),
        ((q, lens, table[:1]), ValueError, r"block_tables must have one row per request \(B=3\)"),
        ((q, lens, table.long()), TypeError, "block_tables must be int32"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            graphs(*args)
    for pad_page in (NUM_PAGES, -1):
        with pytest.raises(ValueError, match=rf"pad_page={pad_page} must be a page ID of the cache, in \[0, 40\)"):
            DecodeGraphs(_cache(False), HQ, MAX_KV_LEN, pad_page=pad_page)


def test_validate_checks_lengths_and_page_ids():
    graphs = DecodeGraphs(_cache(False), HQ, MAX_KV_LEN, batch_sizes=(4,), capture=False)
    q, lens, table = _step([5, 9, 13], 0)
    _check(graphs(q, lens, table, validate=True), q, _cache(False), lens, table)
    narrow = table[:, :2].contiguous()  # 2 columns of 4-token pages hold 8 tokens
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=9 needs 3 pages but block_tables has C=2 columns"):
        graphs(q, lens, narrow, validate=True)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=25 must be in \[1, max_kv_len=24\]"):
        graphs(q, torch.tensor([25, 9, 13], dtype=torch.int32, device=DEVICE), table, validate=True)
    bad = table.clone()
    bad[2, 3] = NUM_PAGES
    with pytest.raises(ValueError, match="page ID 40 among the live pages but paged_kv_cache has only 40 pages"):
        graphs(q, lens, bad, validate=True)


def test_a_narrower_table_leaves_no_earlier_page_ids():
    graphs = DecodeGraphs(_cache(False), HQ, MAX_KV_LEN, batch_sizes=(4,), pad_page=3, capture=False)
    graphs(*_step([20, 21], 0))  # six columns
    q, lens, table = _step([6, 7], 1)
    static = graphs.stage(q, lens, table[:, :2].contiguous())
    assert static.block_tables[:2, 2:].unique().tolist() == [3]
    assert static.block_tables[:2, :2].tolist() == table[:, :2].tolist()
    graphs(*_step([20, 21], 2))  # six columns again
    static = graphs.stage(q, lens, table[:, :5].contiguous())  # one column short of max_kv_len's six
    assert static.block_tables[:2, 5].tolist() == [3, 3]


def test_q_dtype_defaults_to_a_16_bit_caches_dtype():
    cache = _cache(False).half()
    graphs = DecodeGraphs(cache, HQ, MAX_KV_LEN, batch_sizes=(2,), capture=False)
    q, lens, table = _step([5, 11], 0)
    out = graphs(q.half(), lens, table)
    assert out.dtype == torch.float16  # o_data_type defaults to q_data_type
    _check(out, q.half(), cache, lens, table)
    fp8 = DecodeGraphs(cache.to(torch.float8_e4m3fn), HQ, MAX_KV_LEN, batch_sizes=(2,), capture=False)
    assert (fp8.q_dtype, fp8.o_dtype) == (torch.bfloat16, torch.bfloat16)  # an fp8 cache: a bf16 q
