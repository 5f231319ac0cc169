"""How many split-kernel programs fit one SM at once (measured resources, counted as CUDA does),
and the K/V bytes they keep loading.

Registers and shared memory per config come from ``data/split_kernel_resources.csv`` (measured
from compiled kernels; ``scripts/occupancy.py --resources`` writes it). The page size is compiled
into the kernel and decides how a tile finds its pages, so the table holds each config at the page
sizes it was measured at, and a shape takes the nearest of them that finds pages the same way: one
page-ID load a tile (pages a multiple of the tile), one a token (pages of one token), or one a
token with a division (tiles that cross pages). The count is CUDA's occupancy calculation with
this GPU's shared memory and registers: registers go to warps in allocation units within each of
the SM's register sub-partitions, shared memory per program plus a reserve, and hardware caps on
warps and programs per SM.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from importlib import resources

import torch

from ..device import DeviceProperties
from .space import KernelConfig, ProblemShape

REGISTER_SUB_PARTITIONS = 4  # an SM's register files, one per warp scheduler (sm_70 to sm_90)
REGISTER_ALLOCATION_UNIT = 256  # registers per warp are allocated in these units
MAX_WARPS_PER_SM = 64
MAX_PROGRAMS_PER_SM = 32  # thread blocks per SM
SHARED_MEMORY_RESERVED_PER_PROGRAM = 1024  # the driver's reserve per thread block
RESOURCES_FILE = "split_kernel_resources.csv"
REFERENCE_PAGE_SIZE = 16  # every config of the table was measured at pages of this many tokens

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _resource_table() -> dict[tuple[int, ...], dict[int, list[tuple[int, int, int]]]]:
    """The CSV as {(kv_bytes, block_d, block_m, block_n, num_warps, num_stages, direct_out):
    {page_size: [(group_size, registers, shared_bytes), ...] sorted by group size}}; empty, with
    one warning, if it cannot be read (every config then takes the conservative bound)."""
    table: dict[tuple[int, ...], dict[int, list[tuple[int, int, int]]]] = {}
    try:
        # the package's own data, also where it is imported under another name (a second source tree
        # that a comparison script loads beside this one)
        text = resources.files(__name__.split(".")[0]).joinpath("data", RESOURCES_FILE).read_text()
        lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
        header = lines[0].strip().split(",")
        for line in lines[1:]:
            row = dict(zip(header, map(int, line.split(","))))
            key = (row["kv_bytes"], row["block_d"], row["block_m"], row["block_n"], row["num_warps"],
                   row["num_stages"], row["direct_out"])
            pages = table.setdefault(key, {}).setdefault(row["page_size"], [])
            pages.append((row["group_size"], row["registers"], row["shared_bytes"]))
        if not table:
            raise ValueError("no rows")
    except (OSError, IndexError, KeyError, ValueError) as exc:
        logger.warning("cannot read tsdecode/data/%s (%s: %s); residency per SM falls back to a "
                       "conservative bound", RESOURCES_FILE, type(exc).__name__, exc)
        return {}
    for by_page in table.values():
        for measured in by_page.values():
            measured.sort()
    return table


def page_path(page_size: int, block_n: int) -> str:
    """How a tile of ``block_n`` tokens finds its pages: "tile" (one page-ID load, pages a multiple
    of the tile), "token" (one load a token of a one-token page) or "divided" (one load a token,
    its page and offset divided out of the token index)."""
    if page_size % block_n == 0:
        return "tile"
    return "token" if page_size == 1 else "divided"


def measured_page_size(measured: dict[int, list], page_size: int, block_n: int) -> int:
    """Of the page sizes a config was measured at, the nearest to ``page_size`` (by ratio; of two
    as near, the smaller) whose tiles find their pages the same way, else the nearest."""
    path = page_path(page_size, block_n)
    same = [p for p in measured if page_path(p, block_n) == path] or list(measured)
    return min(same, key=lambda p: (abs(math.log(p / page_size)), p))


def split_kernel_resources(config: KernelConfig, shape: ProblemShape) -> tuple[int, int]:
    """(registers a thread, shared memory bytes) of the split kernel for ``config`` on ``shape``:
    the measured ones (``measured_resources``), else 255 registers and more shared memory than any
    measured config of its tile, so that a config outside the table never fits more programs than
    it can."""
    measured = measured_resources(config, shape)
    if measured:
        return measured
    block_d = max(64, shape.block_d)
    buffers = 2 if config.num_stages >= 5 else 1  # K/V tile buffers (one K and one V tile each)
    shared = (4096 + max(16, config.block_m) * block_d * 6
              + buffers * 2 * config.block_n * block_d * shape.kv_dtype.itemsize)
    return 255, shared


def measured_resources(config: KernelConfig, shape: ProblemShape) -> tuple[int, int] | None:
    """(registers a thread, shared memory bytes) as measured at this K/V byte width, block_d
    (D <= 64 counts as 64), block_m, block_n, warps, one split (the direct-output kernel) or more,
    and the nearest measured page size whose tiles find their pages as the shape's do, else the
    nearest (``measured_page_size``), at the nearest measured group size at or above the shape's
    rows (else the largest); never less than the same at REFERENCE_PAGE_SIZE. 4 stages take the
    3-stage entry and 1 stage the 2-stage one where unmeasured (their kernels match closely). None
    where the table has no such config.
    """
    table = _resource_table()
    direct = int(config.num_kv_splits == 1)
    stand_in = {4: 3, 1: 2}.get(config.num_stages)
    for stages in (config.num_stages,) + ((stand_in,) if stand_in else ()):
        by_page = table.get((shape.kv_dtype.itemsize, max(64, shape.block_d), config.block_m, config.block_n,
                             config.num_warps, stages, direct))
        if by_page:
            # the shape's own page path, and never less than at 16-token pages (where every config
            # was measured): counting a program too many spills a wave, one too few only thins it
            pages = {measured_page_size(by_page, shape.page_size, config.block_n),
                     measured_page_size(by_page, REFERENCE_PAGE_SIZE, config.block_n)}
            at_rows = [next((m for m in by_page[page] if m[0] >= shape.rows_per_kv_head), by_page[page][-1])
                       for page in pages]
            return max(m[1] for m in at_rows), max(m[2] for m in at_rows)
    return None


def fits_an_sm(config: KernelConfig, shape: ProblemShape, device: DeviceProperties) -> bool:
    """Whether a split program of ``config`` was measured and its shared memory fits an SM."""
    split = dataclasses.replace(config, num_kv_splits=max(2, config.num_kv_splits))
    measured = measured_resources(split, shape)
    reserve = SHARED_MEMORY_RESERVED_PER_PROGRAM
    return measured is not None and measured[1] + reserve <= device.shared_memory_per_sm


def resident_programs_per_sm(config: KernelConfig, shape: ProblemShape, device: DeviceProperties,
                             one_split: bool | None = None) -> int:
    """Split-kernel programs of ``config`` that fit one SM of ``device`` at once (at least 1).

    Depends on num_kv_splits only through one split (the direct-output kernel) or more;
    ``one_split`` picks that kernel instead of config's own count.
    """
    if one_split is None:
        one_split = config.num_kv_splits == 1
    return _resident(shape.kv_dtype.itemsize, max(64, shape.block_d), shape.rows_per_kv_head,
                     shape.page_size, config.block_m, config.block_n, config.num_warps, config.num_stages,
                     one_split, device.shared_memory_per_sm, device.registers_per_sm)


@functools.lru_cache(maxsize=4096)
def _resident(kv_bytes: int, block_d: int, rows: int, page_size: int, block_m: int, block_n: int,
              num_warps: int, num_stages: int, one_split: bool, shared_per_sm: int,
              registers_per_sm: int) -> int:
    config = KernelConfig(block_n=block_n, block_m=block_m, num_kv_splits=1 if one_split else 2,
                          num_warps=num_warps, num_stages=num_stages)
    shape = ProblemShape(batch_size=1, num_qo_heads=rows, num_kv_heads=1, head_dim=block_d,
                         page_size=page_size, max_kv_len=block_n,
                         kv_dtype=torch.float8_e4m3fn if kv_bytes == 1 else torch.bfloat16)
    registers, shared = split_kernel_resources(config, shape)
    per_warp = -(-max(1, registers) * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    warps = REGISTER_SUB_PARTITIONS * ((registers_per_sm // REGISTER_SUB_PARTITIONS) // per_warp)
    by_registers = min(warps, MAX_WARPS_PER_SM) // num_warps
    by_shared = shared_per_sm // (shared + SHARED_MEMORY_RESERVED_PER_PROGRAM)
    return max(1, min(by_registers, by_shared, MAX_PROGRAMS_PER_SM))


def loads_in_flight(config: KernelConfig, shape: ProblemShape, device: DeviceProperties) -> float:
    """K/V bytes an SM keeps loading with as many split programs of ``config`` as fit: each keeps
    (stages - 1) / 2 tiles in flight."""
    tile_bytes = 2 * config.block_n * shape.block_d * shape.kv_dtype.itemsize
    fits = resident_programs_per_sm(config, shape, device, one_split=False)
    return fits * (config.num_stages - 1) / 2 * tile_bytes
