"""The metadata kernel behind validated runs (``kernels/metadata.py``) against plain Python on
random tables.

A validated run reads the lengths, the packed offsets and the page IDs of each request's live
pages (the first ceil(len / P) columns of its row, at most C) in one launch and one copy. CPU: the
kernel in Triton's interpreter; GPU: also its direct launches, one compiled variant reused across
batch sizes, widths and page-ID ranges (its integer arguments are unspecialised).
"""

import random

import pytest
import torch

from tsdecode.kernels import metadata
from tsdecode.kernels.metadata import BLOCK_COLS, BLOCK_ROWS, INT32_MAX, INT32_MIN, read_metadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def expected(table: list[list[int]], lens: list[int], indptr, page_size: int):
    """(lens, indptr, min, max) over each row's live columns, in plain Python."""
    cols = len(table[0])
    live = [min(cols, -(-max(n, 0) // page_size)) for n in lens]
    ids = [i for row, n in zip(table, live) for i in row[:n]]
    return lens, indptr, min(ids, default=INT32_MAX), max(ids, default=INT32_MIN)


def random_inputs(rng: random.Random, batch: int, cols: int, page_size: int, row_pad: int,
                  lens_stride: int, packed: bool):
    """A padded block table of random (also negative and huge) IDs, strided lengths, offsets."""
    rows = [[rng.randrange(-5, 2**31 - 1) if rng.random() < 0.02 else rng.randrange(0, 10**6)
             for _ in range(cols)] for _ in range(batch)]
    lens = [rng.randint(1, cols * page_size) for _ in range(batch)]
    storage = torch.full((batch, cols + row_pad), -7, dtype=torch.int32)
    storage[:, :cols] = torch.tensor(rows, dtype=torch.int32)
    table = storage.to(DEVICE)[:, :cols]
    holder = torch.full((batch * lens_stride,), 10**7, dtype=torch.int32, device=DEVICE)
    holder[::lens_stride] = torch.tensor(lens, dtype=torch.int32)
    indptr = None
    if packed:
        offsets = [0]
        for _ in range(batch):
            offsets.append(offsets[-1] + rng.randint(1, 5))
        indptr = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    return rows, lens, table, holder[::lens_stride], indptr


@pytest.fixture
def poisoned(monkeypatch):
    """Every output buffer starts as a value no element may keep."""
    def poisoned_buffer(numel, device):
        return torch.full((numel,), 123456789, dtype=torch.int32, device=device)
    monkeypatch.setattr(metadata, "_output_buffer", poisoned_buffer)


@pytest.mark.parametrize("lens_stride", [1, 2])
@pytest.mark.parametrize("batch, cols, page_size", [
    (1, 1, 16), (3, 5, 16), (BLOCK_ROWS + 3, 2 * BLOCK_COLS + 7, 1), (2 * BLOCK_ROWS, 40, 64)])
@pytest.mark.parametrize("packed", [False, True])
def test_matches_python(poisoned, lens_stride, batch, cols, page_size, packed):
    """Live pages only, whatever the columns past them hold (the table is random everywhere)."""
    rng = random.Random(hash((lens_stride, batch, cols, page_size, packed)) % 2**32)
    rows, lens, table, seq_lens, indptr = random_inputs(
        rng, batch, cols, page_size, row_pad=rng.choice([0, 3]), lens_stride=lens_stride, packed=packed)
    got = read_metadata(table, seq_lens, indptr, page_size)
    want = expected(rows, lens, None if indptr is None else indptr.tolist(), page_size)
    assert got == want


def test_columns_past_the_live_pages_are_never_read(poisoned):
    """A short request's row may be padded with -1 or anything: the range covers its live pages."""
    table = torch.tensor([[3, -1, -1, -1], [4, 5, 10**9, -(2**31)], [6, 7, 8, 9]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([16, 17, 64], dtype=torch.int32, device=DEVICE)
    assert read_metadata(table, seq_lens, None, 16) == ([16, 17, 64], None, 3, 9)
    seq_lens = torch.tensor([17, 17, 64], dtype=torch.int32, device=DEVICE)  # row 0 reaches its -1
    assert read_metadata(table, seq_lens, None, 16)[2] == -1


def test_out_of_range_lengths_cover_what_they_can(poisoned):
    """Lengths <= 0 cover no column, lengths past C*P every column (a validated run refuses both
    after the read; the read itself must stay inside the table)."""
    rows = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    table = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    for lens in ([0, -4, 999], [-3, 0, -1]):
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        assert read_metadata(table, seq_lens, None, 16) == expected(rows, lens, None, 16)


def test_extremes_in_the_last_of_several_programs(poisoned):
    """Rows spread over several programs (BLOCK_ROWS rows each): the smallest and largest live
    page IDs sit in the last, partly filled program; the host reduces the per-program values.
    (Replaces the bound-lengths test of the longest length over several blocks: bound lengths
    and their max_kv_len-wide check are gone.)"""
    rng = random.Random(5)
    batch = 3 * BLOCK_ROWS + 5
    rows = [[rng.randrange(100, 1000) for _ in range(4)] for _ in range(batch)]
    lens = [1] * batch
    lens[-2] = 40  # P=16: 3 live columns
    rows[-2][2], rows[-2][3] = 7, 10**8  # the minimum (live) and a larger ID past the live pages
    rows[-1][0] = 5000
    table = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = read_metadata(table, seq_lens, None, 16)
    assert got == expected(rows, lens, None, 16)
    assert got[2:] == (7, 5000)


@pytest.mark.gpu
def test_one_compiled_variant_serves_every_size(poisoned):
    """After the first launch, the kept compiled kernel is launched directly for other batch
    sizes, widths, strides and lengths, and gives the right answer each time."""
    metadata._COMPILED.clear()
    rng = random.Random(11)
    for batch, cols in [(1, 1), (1, 3000), (37, 700), (3 * BLOCK_ROWS + 1, 9), (4, 2)]:
        for lens_stride in (1, 3):
            rows, lens, table, seq_lens, indptr = random_inputs(
                rng, batch, cols, 16, row_pad=rng.choice([0, 5]), lens_stride=lens_stride,
                packed=batch % 2 == 1)
            got = read_metadata(table, seq_lens, indptr, 16)
            want = expected(rows, lens, None if indptr is None else indptr.tolist(), 16)
            assert got == want, (batch, cols, lens_stride)
    # One variant per (constexprs, pointer alignments): with and without offsets, a few alignments.
    assert 0 < len(metadata._COMPILED) <= 4
