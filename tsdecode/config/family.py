"""Steps 1 and 2 of the config model (``heuristic``): the tile family of a shape, what fits an
SM of it, and how many programs an SM needs to keep its loads in flight.

1. Tile family (``tile_family``):
   - "lean": one-warp programs of small K/V tiles, for head dims up to 128 and up to 32 query
     rows a KV head, and for larger head dims where 16-token tiles stay inside a page and 16 rows
     hold a KV head's queries;
   - "wide": four-warp programs of ~16 KiB tiles otherwise. The tile doubles (up to
     WIDE_MAX_TILE_ELEMENTS, twice that where a program holds LARGE_WIDE_TILE_MIN_ROWS query rows
     and the larger tile barely pads the mean request, while it fits an SM) as long as the
     programs of it that fit an SM keep less than the loads in flight of step 2 and the doubled
     tile's keep more (``_fill_loads_in_flight``);
   - "short": programs of one short tile each where the whole problem has too few tiles to
     occupy the GPU with the family's programs and one wave holds them (four-warp 32-token tiles;
     a whole request's where a lean program's rows hold a KV head's and one tile of at most
     SHORT_WHOLE_TILE_BYTES of K holds the request, four warps for each WIDE_MAX_TILE_ELEMENTS of
     it); lean requests of more than SHORT_WHOLE_MIN_TOKENS whose whole-request tiles keep every
     K/V byte of the problem in flight within IN_FLIGHT_BYTES_PER_SM an SM take those too.
2. Residency and target (``occupancy``): the programs of the family that fit an SM (measured
   registers and shared memory against this GPU's), the K/V bytes each keeps in flight (a
   pipeline of S stages: S - 1 tiles loading, each about half the time), and the target programs
   per SM:
   - IN_FLIGHT_BYTES_PER_SM of loads in flight per SM;
   - at least FP8_MIN_WARPS_PER_SM one-warp programs of an fp8 cache whose tiles stay inside
     pages (their conversion keeps them issuing); page-crossing ones have that as a separate
     issue target;
   - at most the programs that fit (half of them when one-warp tiles cross pages: each token's
     page ID is then a dependent load that no other warp of the program hides, and such a tile
     counts as one in flight);
   - for one-warp programs of a 16-bit cache whose tiles cross pages, of equal lengths, at most
     GATHER_WARPS_PER_SCHEDULER a warp scheduler (``capped_at_schedulers``): each token of such a
     tile is a gather its one warp issues, so past one such warp a scheduler an SM gains no loads.
     The heuristic takes the capped count only where the uncapped count's programs walk at most
     GATHER_MAX_CHAIN_TILES tiles and step 4 keeps the programs' form under it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..device import DeviceProperties
from .residency import REGISTER_SUB_PARTITIONS, fits_an_sm, loads_in_flight, resident_programs_per_sm
from .space import RAGGED_SPREAD, KernelConfig, ProblemShape, dot_block_m

# Loads in flight per SM that keep its share of DRAM bandwidth busy (bandwidth x latency).
IN_FLIGHT_BYTES_PER_SM = 64 * 1024
# Lean tiles: 32 tokens of a 16-bit cache, 2 KiB of an fp8 one (whose conversion cost grows with
# the tile) where that stays inside a page, else 32 tokens; 16 tokens of a 16-bit cache where
# that keeps a tile inside one page and 32 would not.
LEAN_TOKENS = 32
LEAN_FP8_TILE_BYTES = 2048
LEAN_MAX_HEAD_DIM = 128
LEAN_MAX_ROWS = 32
# Head dims above 128 take lean tiles too where 16-token tiles stay inside a page and one 16-row
# block holds the query rows: a tile is then one page-ID load and a contiguous block, and a warp's
# 16 x D accumulators still fit its registers; page-crossing tiles of such heads go wide.
LEAN_WIDE_HEAD_TOKENS = 16
LEAN_WIDE_HEAD_MAX_ROWS = 16
# Below this many query rows a page-aligned 16-bit lean tile keeps one tile in flight (3 stages):
# a second pays only where each tile carries more rows' math.
LEAN_DEEP_MIN_ROWS = 5
WIDE_TILE_BYTES = 16 * 1024
# Four-warp programs are few an SM: where those that fit keep too few bytes loading, their tile
# doubles, to at most this many K (and V) elements, which the program holds in registers in the
# products' dtype (an fp8 D = 256 cache's 64-token tile already does).
WIDE_MAX_TILE_ELEMENTS = 64 * 256
# A tile of twice that (an fp8 D = 256 cache's 128-token tile) takes every register a thread may
# hold; it still pays where a program holds at least this many query rows, whose per-tile work
# (the scores' max and sum, the accumulator's rescaling) a tile twice as long halves ...
LARGE_WIDE_TILE_MIN_ROWS = 5
# ... unless it pads the mean request by more than this share of its tokens beyond what the
# smaller tile pads: a short request's programs run a tile or two, and a half-empty last tile of
# the register-bound size costs nearly a full one.
LARGE_WIDE_TILE_MAX_PADDING = 1 / 16
# A one-warp program of an fp8 cache converts every K/V element before its products, so its
# warp is busy issuing rather than waiting on loads: an SM needs this many such warps (two per
# scheduler) whatever bytes each keeps in flight.
FP8_MIN_WARPS_PER_SM = 8
# A one-warp program of a 16-bit cache whose tile crosses pages issues a gather for each token of
# the tile, its page ID first: past this many such warps a scheduler, an SM issues no more loads.
GATHER_WARPS_PER_SCHEDULER = 1
# That holds while such a program walks at most this many tiles (at the uncapped count): its
# pipeline's prologue (four tiles at five stages) issues most of its gathers at once, so all its
# SM's warps issue together; a longer chain's warp mostly waits on its oldest tile, and a second
# warp on its scheduler issues meanwhile.
GATHER_MAX_CHAIN_TILES = 6
# "short": at most this many visible tokens, and fewer lean tiles (SHORT_BLOCK_N-token ones where
# the family is wide) in the whole problem than SHORT_TILES_PER_SM per SM. A program of no more
# rows than a lean one's (on any pages) takes a whole request in one SHORT_WHOLE_BLOCK_N-token tile
# where that holds it and its K tile is at most SHORT_WHOLE_TILE_BYTES (a 16-bit 128 x 128 tile's):
# the bytes, not the elements, set what one program's loads cost, so an fp8 D = 256 request's tile
# qualifies and a 16-bit one's (64 KiB) does not. Four warps hold WIDE_MAX_TILE_ELEMENTS of it in
# registers: a larger tile takes four more warps for each such share (eight for the fp8 128 x 256
# tile, which step 4 then loads straight to registers).
SHORT_MAX_TOKENS = 512
SHORT_TILES_PER_SM = 2
SHORT_BLOCK_N = 32
SHORT_WHOLE_BLOCK_N = 128
SHORT_WHOLE_TILE_BYTES = 32 * 1024
# Lean requests too many for the short family take its whole-request tiles too where those
# programs keep every K/V byte of the problem in flight at once within IN_FLIGHT_BYTES_PER_SM an
# SM (one round trip loads it all), for requests of more than this many tokens: a shorter request
# leaves more than half of the tile's registers and products idle.
SHORT_WHOLE_MIN_TOKENS = SHORT_WHOLE_BLOCK_N // 2


@dataclass(frozen=True)
class Occupancy:
    """A tile family on one shape and GPU."""

    config: KernelConfig  # num_kv_splits not chosen yet
    family: str  # "lean", "wide" or "short"
    base_programs: int  # programs of one split: B * Hkv * row blocks
    resident_one_split: int  # programs per SM that fit at once, direct-output kernel
    resident: int  # the same for the split kernel
    target: float  # programs per SM that keep the loads in flight
    tiles_in_flight: float  # K/V tiles a program keeps loading
    bytes_target: float  # programs per SM whose loads alone keep IN_FLIGHT_BYTES_PER_SM in flight
    issue_target: float  # programs per SM that keep the schedulers issuing (fp8 one-warp), else target


def tile_family(shape: ProblemShape, device: DeviceProperties) -> tuple[KernelConfig, str]:
    """Step 1: the family's tile, warps and stages (num_kv_splits left at 1)."""
    block_m = dot_block_m(shape.rows_per_kv_head)
    kv_bytes, block_d = shape.kv_dtype.itemsize, shape.block_d
    page = shape.page_size
    lean = lean_rows = holds_lean_rows(shape)
    if block_d > LEAN_MAX_HEAD_DIM:
        lean = lean_rows and page % LEAN_WIDE_HEAD_TOKENS == 0
    short_tile = KernelConfig(block_n=SHORT_BLOCK_N, block_m=block_m, num_warps=4, num_stages=2)
    # A whole request's tile gathers its pages whatever their size, so the rows, not the pages,
    # decide whether a program holds one.
    whole = _whole_request_tile(shape, block_m) if lean_rows else None
    if not lean:  # a larger one-tile program holds more registers than its one tile pays for
        short = _short_config(shape, SHORT_BLOCK_N, whole or short_tile, device, all_in_flight=False)
        if short is not None:
            return short, "short"
        block_n = min(64 if block_d <= LEAN_MAX_HEAD_DIM else 128,
                      max(16, WIDE_TILE_BYTES // (block_d * kv_bytes)))
        wide = KernelConfig(block_n=block_n, block_m=block_m, num_warps=4, num_stages=2)
        return _fill_loads_in_flight(wide, shape, device), "wide"
    if block_d > LEAN_MAX_HEAD_DIM:
        block_n, stages = LEAN_WIDE_HEAD_TOKENS, 5
    elif kv_bytes == 1:
        block_n, stages = max(16, LEAN_FP8_TILE_BYTES // block_d), 5
        if page % block_n:  # crossing pages: page-ID loads, not the conversion, set a tile's cost
            block_n = LEAN_TOKENS
    else:
        block_n = 16 if page % 16 == 0 and page % LEAN_TOKENS else LEAN_TOKENS
        aligned = page % block_n == 0
        stages = 3 if aligned and shape.rows_per_kv_head < LEAN_DEEP_MIN_ROWS else 5
    all_in_flight = whole is not None and _whole_tiles_in_flight(shape, whole, device)
    short = _short_config(shape, block_n, whole or short_tile, device, all_in_flight)
    if short is not None:
        return short, "short"
    return KernelConfig(block_n=block_n, block_m=block_m, num_warps=1, num_stages=stages), "lean"


def holds_lean_rows(shape: ProblemShape) -> bool:
    """Whether a lean program's rows hold a KV head's query rows: LEAN_MAX_ROWS, or
    LEAN_WIDE_HEAD_MAX_ROWS above LEAN_MAX_HEAD_DIM."""
    rows = LEAN_WIDE_HEAD_MAX_ROWS if shape.block_d > LEAN_MAX_HEAD_DIM else LEAN_MAX_ROWS
    return shape.rows_per_kv_head <= rows


def _whole_request_tile(shape: ProblemShape, block_m: int) -> KernelConfig | None:
    """The short family's SHORT_WHOLE_BLOCK_N-token tile where it holds the whole request within
    SHORT_WHOLE_TILE_BYTES of K, at four warps for each WIDE_MAX_TILE_ELEMENTS of it; else None."""
    elements = SHORT_WHOLE_BLOCK_N * shape.block_d
    if (shape.max_visible_tiles(1) > SHORT_WHOLE_BLOCK_N
            or elements * shape.kv_dtype.itemsize > SHORT_WHOLE_TILE_BYTES):
        return None
    warps = 4 * -(-elements // WIDE_MAX_TILE_ELEMENTS)
    return KernelConfig(block_n=SHORT_WHOLE_BLOCK_N, block_m=block_m, num_warps=warps, num_stages=2)


def _short_config(shape: ProblemShape, block_n: int, short: KernelConfig, device: DeviceProperties,
                  all_in_flight: bool) -> KernelConfig | None:
    """Programs of one ``short`` tile each, where the problem has at most SHORT_MAX_TOKENS visible
    tokens and fewer ``block_n``-token tiles than SHORT_TILES_PER_SM an SM (too few to occupy the
    GPU with the family's programs), or where ``all_in_flight`` (a lean problem's whole-request
    tiles keep every byte in flight, ``_whole_tiles_in_flight``), and they all fit one wave."""
    base, sms = shape.programs(short.block_m), device.sm_count
    few_tiles = (shape.max_visible_tiles(1) <= SHORT_MAX_TOKENS
                 and base * shape.max_visible_tiles(block_n) < SHORT_TILES_PER_SM * sms)
    if not few_tiles and not all_in_flight:
        return None
    one_wave = resident_programs_per_sm(short, shape, device, one_split=False) * sms
    return short if base * shape.max_visible_tiles(short.block_n) <= one_wave else None


def _whole_tiles_in_flight(shape: ProblemShape, whole: KernelConfig, device: DeviceProperties) -> bool:
    """Whether the programs of ``whole`` (a whole request's tile, ``_whole_request_tile``), one
    tile each, for requests of more than SHORT_WHOLE_MIN_TOKENS, load every K/V byte of the
    problem (the mean request's tokens) within IN_FLIGHT_BYTES_PER_SM an SM: those loads are then
    all in flight at once, where the lean family's programs would keep only part of them loading.
    A window that ends inside a second tile is not one load, and keeps the lean family."""
    tokens = shape.max_visible_tiles(1)
    if tokens <= SHORT_WHOLE_MIN_TOKENS or shape.max_visible_tiles(whole.block_n) > 1:
        return False
    mean_tokens = tokens / max(1.0, shape.kv_len_spread)
    request_bytes = 2 * mean_tokens * shape.head_dim * shape.kv_dtype.itemsize  # its K and V
    return shape.programs(whole.block_m) * request_bytes <= IN_FLIGHT_BYTES_PER_SM * device.sm_count


def _fill_loads_in_flight(config: KernelConfig, shape: ProblemShape,
                          device: DeviceProperties) -> KernelConfig:
    """A wide tile doubles, to at most WIDE_MAX_TILE_ELEMENTS (twice that for
    LARGE_WIDE_TILE_MIN_ROWS query rows a KV head and a mean request that the larger tile pads by
    at most LARGE_WIDE_TILE_MAX_PADDING more) and while the doubled tile fits an SM, as long as
    the programs of it that fit an SM keep less than IN_FLIGHT_BYTES_PER_SM loading and the
    doubled tile's programs keep more: four-warp programs are few an SM, so their tile, not their
    count, sets the bytes in flight."""
    max_elements = WIDE_MAX_TILE_ELEMENTS
    if shape.rows_per_kv_head >= LARGE_WIDE_TILE_MIN_ROWS:
        mean_tokens = shape.max_visible_tiles(1) / max(1.0, shape.kv_len_spread)
        tokens = max_elements // shape.block_d
        padding = _padded(mean_tokens, 2 * tokens) - _padded(mean_tokens, tokens)
        if padding <= LARGE_WIDE_TILE_MAX_PADDING * mean_tokens:
            max_elements *= 2
    while 2 * config.block_n * shape.block_d <= max_elements:
        in_flight = loads_in_flight(config, shape, device)
        larger = dataclasses.replace(config, block_n=2 * config.block_n)
        if (in_flight >= IN_FLIGHT_BYTES_PER_SM or not fits_an_sm(larger, shape, device)
                or loads_in_flight(larger, shape, device) <= in_flight):
            break
        config = larger
    return config


def _padded(tokens: float, block_n: int) -> int:
    """The tokens of ``block_n``-token tiles that hold ``tokens``."""
    return math.ceil(tokens / block_n) * block_n


def occupancy(shape: ProblemShape, device: DeviceProperties) -> Occupancy:
    """Steps 1 and 2: the family, what fits an SM, and the target programs per SM."""
    config, family = tile_family(shape, device)
    resident = resident_programs_per_sm(config, shape, device, one_split=False)
    one_split = resident_programs_per_sm(config, shape, device, one_split=True)
    aligned = shape.page_size % config.block_n == 0
    hidden = aligned or config.num_warps > 1  # page-ID loads of crossing tiles: other warps cover them
    # A pipeline of S stages keeps S - 1 tiles loading, each in flight about half the time the
    # program spends on a tile; a crossing one-warp tile waits on its page IDs first: one.
    tiles_in_flight = (config.num_stages - 1) / 2 if hidden else 1
    tile_bytes = 2 * config.block_n * shape.block_d * shape.kv_dtype.itemsize  # a K and a V tile
    wanted = IN_FLIGHT_BYTES_PER_SM / (tiles_in_flight * tile_bytes)
    fits = resident if hidden else resident / 2
    bytes_target = max(1.0, min(wanted, fits))
    fp8_one_warp = shape.kv_dtype.itemsize == 1 and config.num_warps == 1
    if fp8_one_warp and hidden:
        wanted = max(wanted, FP8_MIN_WARPS_PER_SM)  # conversion issue, not bytes, sets the count
    target = max(1.0, min(wanted, fits))
    issue_target = max(target, min(FP8_MIN_WARPS_PER_SM, resident)) if fp8_one_warp else target
    return Occupancy(config, family, shape.programs(config.block_m), one_split, resident, target,
                     tiles_in_flight, bytes_target, issue_target)


def capped_at_schedulers(shape: ProblemShape, occ: Occupancy) -> Occupancy | None:
    """``occ`` with its target capped at GATHER_WARPS_PER_SCHEDULER programs a warp scheduler, for
    one-warp programs of a 16-bit cache whose tiles cross pages and equal lengths, where that lowers
    the target; else None. Each token of such a tile is a gather that its one warp issues, so past
    one such warp a scheduler an SM gains no loads; programs of ragged lengths end apart, and an fp8
    cache's warps have their own issue target."""
    crossing = shape.page_size % occ.config.block_n != 0
    if (occ.config.num_warps != 1 or not crossing or shape.kv_dtype.itemsize == 1
            or shape.kv_len_spread >= RAGGED_SPREAD):
        return None
    cap = GATHER_WARPS_PER_SCHEDULER * REGISTER_SUB_PARTITIONS  # one warp scheduler a sub-partition
    if occ.target <= cap:
        return None
    return dataclasses.replace(occ, target=float(cap), issue_target=float(cap))


__all__ = ["Occupancy", "tile_family", "occupancy", "capped_at_schedulers", "IN_FLIGHT_BYTES_PER_SM",
           "GATHER_MAX_CHAIN_TILES"]
