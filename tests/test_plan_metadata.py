"""The plan's metadata kernel (``kernels/plan_metadata.py``) against plain Python on random tables.

CPU: the kernel in Triton's interpreter; GPU: also its direct launches, one compiled variant
reused across batch sizes, widths and page-ID ranges (its integer arguments are unspecialised).
"""

import random

import pytest
import torch

from tsdecode.kernels import plan_metadata
from tsdecode.kernels.plan_metadata import BLOCK_COLS, BLOCK_LENS, BLOCK_ROWS, read_plan_metadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def expected(table: list[list[int]], lens: list[int], indptr, page_size: int, mode: str, max_kv_len):
    """(lens, indptr, min, max) over each row's covered columns, in plain Python."""
    cols = len(table[0])
    if mode == "unbound":
        covered = [min(cols, max(n, 0) // page_size + (max(n, 0) % page_size > 0)) for n in lens]
    else:
        limit = min(max_kv_len, cols * page_size) if mode == "bound" else max(max(lens), 0)
        covered = [min(cols, -(-limit // page_size))] * len(lens)
    ids = [i for row, n in zip(table, covered) for i in row[:n]]
    return lens, indptr, min(ids, default=2**31 - 1), max(ids, default=-(2**31))


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
    monkeypatch.setattr(plan_metadata, "_output_buffer", poisoned_buffer)


@pytest.mark.parametrize("mode", ["unbound", "bound", "bound, longest"])
@pytest.mark.parametrize("batch, cols, page_size", [
    (1, 1, 16), (3, 5, 16), (BLOCK_ROWS + 3, 2 * BLOCK_COLS + 7, 1), (2 * BLOCK_ROWS, 40, 64)])
@pytest.mark.parametrize("packed", [False, True])
def test_matches_python(poisoned, mode, batch, cols, page_size, packed):
    rng = random.Random(hash((mode, batch, cols, page_size, packed)) % 2**32)
    rows, lens, table, seq_lens, indptr = random_inputs(
        rng, batch, cols, page_size, row_pad=rng.choice([0, 3]), lens_stride=1 if mode != "unbound" else 2,
        packed=packed)
    max_kv_len = rng.randint(max(lens), cols * page_size) if mode == "bound" else None
    covered = -(-max_kv_len // page_size) if mode == "bound" else None
    got = read_plan_metadata(table, seq_lens, indptr, page_size, covered, mode != "unbound")
    want = expected(rows, lens, None if indptr is None else indptr.tolist(), page_size, mode, max_kv_len)
    assert got == want


@pytest.mark.parametrize("mode", ["unbound", "bound, longest"])
def test_out_of_range_lengths_cover_what_they_can(poisoned, mode):
    """Lengths <= 0 cover no column, lengths past C*P every column (plan refuses both after the
    read; the read itself must stay inside the table)."""
    rows = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    table = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    lens = [0, -4, 999] if mode == "unbound" else [-3, 0, -1]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = read_plan_metadata(table, seq_lens, None, 16, None, mode != "unbound")
    assert got == expected(rows, lens, None, 16, mode, None)


def test_longest_length_over_several_blocks(poisoned):
    """Bound lengths without max_kv_len: the longest length taken over more than one block of
    BLOCK_LENS lengths, the longest in the last block."""
    rng = random.Random(5)
    batch = BLOCK_LENS + 9
    rows = [[rng.randrange(0, 1000) for _ in range(4)] for _ in range(batch)]
    lens = [1] * batch
    lens[-2] = 33  # P=16: 3 columns in every row
    table = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = read_plan_metadata(table, seq_lens, None, 16, None, True)
    assert got == expected(rows, lens, None, 16, "bound, longest", None)


@pytest.mark.gpu
def test_one_compiled_variant_serves_every_size(poisoned):
    """After the first launch, the kept compiled kernel is launched directly for other batch
    sizes, widths, strides and lengths, and gives the right answer each time."""
    plan_metadata._COMPILED.clear()
    rng = random.Random(11)
    for batch, cols in [(1, 1), (1, 3000), (37, 700), (BLOCK_LENS + 1, 9), (4, 2)]:
        for mode in ("unbound", "bound", "bound, longest"):
            rows, lens, table, seq_lens, indptr = random_inputs(
                rng, batch, cols, 16, row_pad=rng.choice([0, 5]), lens_stride=1 if mode != "unbound" else 3,
                packed=batch % 2 == 1)
            max_kv_len = cols * 16 if mode == "bound" else None
            covered = cols if mode == "bound" else None
            got = read_plan_metadata(table, seq_lens, indptr, 16, covered, mode != "unbound")
            want = expected(rows, lens, None if indptr is None else indptr.tolist(), 16, mode, max_kv_len)
            assert got == want, (batch, cols, mode)
    # One variant per (constexprs, pointer alignments): 3 modes x with/without offsets, at most.
    assert 0 < len(plan_metadata._COMPILED) <= 6
