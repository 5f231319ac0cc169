"""The heuristic: a default ``KernelConfig`` for any shape, from the GPU's own properties.

Decode is bandwidth-bound, so the config's job is to keep enough K/V bytes in flight on every SM
without splitting a request's work more than that needs. The model, in four steps:

1. Tile family (``tile_family``). One-warp programs of small K/V tiles ("lean") for head dims up
   to 128 and up to 32 query rows a KV head, and for larger head dims where 16-token tiles stay
   inside a page and 16 rows hold a KV head's queries; four-warp programs of ~16 KiB tiles
   ("wide") otherwise; four-warp programs of one short tile each ("short") where the whole
   problem has too few tiles to occupy the GPU with the family's programs and one wave holds
   them (32-token tiles; a whole request's where the family is lean and one tile of at most
   WIDE_MAX_TILE_ELEMENTS holds it). A wide tile doubles (up to WIDE_MAX_TILE_ELEMENTS, twice
   that where a program holds LARGE_WIDE_TILE_MIN_ROWS query rows and the larger tile barely pads
   the mean request, while it fits an SM) as long as the programs of it that fit an SM keep less
   than the loads in flight below and the doubled tile's keep more.
2. Residency and target (``occupancy``). Programs of the family that fit an SM (measured
   registers and shared memory against this GPU's), the K/V bytes each keeps in flight (a
   pipeline of S stages: S - 1 tiles loading, each about half the time), and the target:
   IN_FLIGHT_BYTES_PER_SM of loads in flight per SM, at least FP8_MIN_WARPS_PER_SM one-warp
   programs of an fp8 cache whose tiles stay inside pages (their conversion keeps them issuing),
   at most the programs that fit (half of them when one-warp tiles cross pages: each token's page
   ID is then a dependent load that no other warp of the program hides, and such a tile counts
   as one in flight). Page-crossing fp8 programs also have an issue target, the
   FP8_MIN_WARPS_PER_SM that keep the schedulers converting.
3. Splits (``num_kv_splits``), one wave rule: split each request until its programs reach the
   target in one wave (page-crossing fp8 ones the issue target, as far as their partial outputs are
   worth), an fp8 cache's one-warp tiles inside pages no further than their partial outputs are
   worth (``partials_bound``); long requests that already reach half of it (a quarter for ragged
   lengths, whose short requests idle SMs at a wave's end; an eighth for one-warp programs of an
   fp8 cache, whose conversion the schedulers run out on first) split further, into about FULL_WAVES
   waves, which balance the SMs (one-warp programs of equal lengths of a 16-bit cache that reach
   the target unsplit only where that takes less time than one split: DRAM bounds them); no count leaves a last wave that few programs use (under
   WAVE_SATURATION full); one-warp fp8 programs of equal lengths, busy issuing, take fewer splits
   where the count puts more of them on an SM's busiest scheduler than the issue target and fewer
   leave that scheduler less work (``_within_schedulers``). One-split programs past a wave, and
   counts that spill where the count fitting one wave would leave it barely used, take the count
   whose waves cost least: a last wave costs at least WAVE_SATURATION of a full one, or the
   target's share of what fits where that is less (a wave holding the target's programs keeps the
   loads in flight). Last, a one-warp count above one, other than the long requests', must save
   more time than its merge pass and partial outputs cost; where the fp8 minimum raised the
   target, the count from the loads' own target up that takes least time wins, and where the
   merge pass's busiest SM would read more partials than the split pass's reads K/V bytes (few
   query rows meeting many splits), any count up to the target's (``_time``: each wave lasts the
   longer of a program's chain of tiles and its busiest SM's K/V bytes; programs of ragged
   lengths past a wave do not end together, so their waves overlap; a split count adds the merge
   pass and the partials its busiest SMs write and read). Four-warp programs of a wide tile end
   together, so a partly filled last wave idles whole SMs: their count is the one so far, a
   larger one that fills whole waves (up to WIDE_MAX_WAVES), one tile a program for ragged
   lengths (whose programs end apart) or one split, where a wave holds its programs (of a 16-bit
   cache on pages of more than one token) or they fill more than two waves, whichever takes least
   time. Last, lean programs of about equal lengths take the fewest splits that leave the same
   chains of tiles (``_even_chains``).
4. Programs against SMs (``programs.fit_programs_to_sms``): the tile, warps and stages of the
   programs once their count is known: smaller lean tiles where they keep one wave or, for short
   requests, half of one, four warps where one-warp programs are left two tiles each or no more
   than the SMs (the latter one tile a program where a tile held in registers makes it one, eight
   warps for a tile twice the size, or one 64-token tile a program where they leave many SMs idle),
   four warps and one larger tile a program where programs of many query rows leave each warp
   scheduler one warp or none or where one-tile programs of an fp8 cache or gathering pages run
   many splits, the fewest stages for a program of one tile, and no pipeline for four-warp fp8
   programs of large tiles.

Where a shape needs a config this model does not give, that belongs in a tuned table entry.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..device import DeviceProperties
from .partials import merge_cost, merge_read_bytes, partials_bound
from .programs import SCHEDULERS_PER_SM, fit_programs_to_sms
from .residency import fits_an_sm, loads_in_flight, resident_programs_per_sm
from .space import MAX_NUM_KV_SPLITS, RAGGED_SPREAD, KernelConfig, ProblemShape, dot_block_m, fit_config

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
# "short": at most this many visible tokens, and fewer lean tiles (SHORT_BLOCK_N-token ones where
# the family is wide) in the whole problem than SHORT_TILES_PER_SM per SM. A program takes a whole
# request in one SHORT_WHOLE_BLOCK_N-token tile where that holds it and stays within
# WIDE_MAX_TILE_ELEMENTS (a four-warp program holds its tile in registers).
SHORT_MAX_TOKENS = 512
SHORT_TILES_PER_SM = 2
SHORT_BLOCK_N = 32
SHORT_WHOLE_BLOCK_N = 128
# Long requests: about FULL_WAVES waves of splits of at least MIN_TOKENS_PER_LONG_SPLIT tokens
# of the mean request, once one split's programs reach 1 / LONG_TARGET_DIVISOR of the target.
# Ragged batches (longest / mean >= RAGGED_SPREAD) take them from a quarter of the target and
# down to RAGGED_MIN_TOKENS_PER_LONG_SPLIT: their short requests leave SMs idle at the end of a
# wave, which later waves fill.
FULL_WAVES = 4
MIN_TOKENS_PER_LONG_SPLIT = 1024
LONG_TARGET_DIVISOR = 2
RAGGED_MIN_TOKENS_PER_LONG_SPLIT = 256
RAGGED_LONG_TARGET_DIVISOR = 4
# One-warp programs of an fp8 cache convert every K/V element, so their SMs' schedulers, not the
# loads, run out first: the more waves of them that balance the SMs pay from an eighth of the
# target. Not on one-token pages, where every token is a gather of its own and the long split's
# extra programs measured slower.
FP8_LONG_TARGET_DIVISOR = 8
# Programs past one wave: a wave less than WAVE_SATURATION full costs as much as one that full
# (less where the target is a smaller share of the programs that fit, ``_saturation``), and
# each split past the first costs SPLIT_COST more (partials and the merge).
WAVE_SATURATION = 0.6
# One-warp fp8 programs are busy issuing, so an SM lasts as long as its busiest scheduler's warps
# take; fewer splits that keep it at the issue target must cut its tiles to this share (they also
# keep fewer loads in flight).
SCHEDULER_GAIN = 0.9
SPLIT_COST = 0.03
MAX_MEND_SPLITS = 64
# Four-warp programs of a wide tile end together, so a partly filled last wave idles whole SMs:
# their count may grow to one that fills up to this many whole waves, where ``_time`` says so.
WIDE_MAX_WAVES = 8
# Programs of ragged lengths do not end together: past one wave, each SM starts the next program
# as one ends, so the waves overlap and the kernel lasts the mean program's chain a wave plus this
# share of the longest program's chain (the programs still running at the end).
RAGGED_TAIL = 0.3
# Each such program's start (its query rows, the lengths, the first page IDs) and end (its
# outputs) cost about this share of one tile's load latency on top of its chain.
PROGRAM_EDGES_TILES = 0.5


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
    if block_d > LEAN_MAX_HEAD_DIM:
        lean = shape.rows_per_kv_head <= LEAN_WIDE_HEAD_MAX_ROWS and page % LEAN_WIDE_HEAD_TOKENS == 0
    else:
        lean = shape.rows_per_kv_head <= LEAN_MAX_ROWS
    if not lean:  # a larger one-tile program holds more registers than its one tile pays for
        short = _short_config(shape, block_m, SHORT_BLOCK_N, SHORT_BLOCK_N, device)
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
    whole = (shape.max_visible_tiles(1) <= SHORT_WHOLE_BLOCK_N
             and SHORT_WHOLE_BLOCK_N * block_d <= WIDE_MAX_TILE_ELEMENTS)
    short_block_n = SHORT_WHOLE_BLOCK_N if whole else SHORT_BLOCK_N
    short = _short_config(shape, block_m, block_n, short_block_n, device)
    if short is not None:
        return short, "short"
    return KernelConfig(block_n=block_n, block_m=block_m, num_warps=1, num_stages=stages), "lean"


def _short_config(shape: ProblemShape, block_m: int, block_n: int, short_block_n: int,
                  device: DeviceProperties) -> KernelConfig | None:
    """Four-warp programs of one ``short_block_n``-token tile each, where the problem has at most
    SHORT_MAX_TOKENS visible tokens and fewer ``block_n``-token tiles than SHORT_TILES_PER_SM an
    SM (too few to occupy the GPU with the family's programs) and they all fit one wave."""
    base, sms = shape.programs(block_m), device.sm_count
    if (shape.max_visible_tiles(1) > SHORT_MAX_TOKENS
            or base * shape.max_visible_tiles(block_n) >= SHORT_TILES_PER_SM * sms):
        return None
    short = KernelConfig(block_n=short_block_n, block_m=block_m, num_warps=4, num_stages=2)
    one_wave = resident_programs_per_sm(short, shape, device, one_split=False) * sms
    return short if base * shape.max_visible_tiles(short_block_n) <= one_wave else None


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


def num_kv_splits(shape: ProblemShape, occ: Occupancy, device: DeviceProperties) -> int:
    """Step 3: the split count (before ``select.scale_splits_to_raggedness``)."""
    splits = _wave_splits(shape, occ, device)
    return _even_chains(shape, occ.config.block_n, splits) if occ.family == "lean" else splits


def _even_chains(shape: ProblemShape, block_n: int, splits: int) -> int:
    """The fewest splits that leave the longest request's programs the chain of tiles ``splits``
    leaves them (and the mean request's, where lengths differ a little): the same critical path
    in fewer programs, with fewer partial outputs to merge. Ragged lengths keep ``splits``."""
    longest = shape.max_visible_tiles(block_n)
    if splits >= longest or shape.kv_len_spread >= RAGGED_SPREAD:
        return splits
    mean = math.ceil(longest / max(1.0, shape.kv_len_spread))
    fewer = -(-longest // -(-longest // splits))
    return fewer if -(-mean // fewer) == -(-mean // splits) else splits


def _wave_splits(shape: ProblemShape, occ: Occupancy, device: DeviceProperties) -> int:
    """The one wave rule's count (step 3 in the module docstring)."""
    sms = device.sm_count
    base, resident = occ.base_programs, occ.resident
    tiles = shape.max_visible_tiles(occ.config.block_n)
    if occ.family == "short":  # one tile a split, or one split when a tile holds it all
        return 1 if tiles == 1 else tiles
    splits = max(1, math.floor(occ.target * sms / base + 0.5))
    if occ.issue_target > occ.target:  # page-crossing fp8: the schedulers' warps, where partials allow
        issuing = max(1, math.floor(occ.issue_target * sms / base + 0.5))
        splits = max(splits, min(issuing, partials_bound(shape, issuing)))
    inside_pages = occ.config.num_warps == 1 and shape.page_size % occ.config.block_n == 0
    if inside_pages and splits <= tiles:  # the target fits the tiles: no more than partials are worth
        splits = min(splits, partials_bound(shape, splits))
    splits = _within_schedulers(shape, occ, min(splits, tiles), tiles, sms)
    if splits > 1 and base * splits > resident * sms:  # never spill into a second wave
        splits = max(1, resident * sms // base)
        if base * splits < WAVE_SATURATION * resident * sms:  # unless that leaves it barely used
            splits = _fullest_waves(base, occ, tiles, sms)
    divisor, min_tokens = long_split_limits(shape, occ.config)
    balanced = False  # split into waves that balance the SMs, which _time does not count
    if base >= occ.target * sms / divisor:
        mean_tokens = shape.max_visible_tiles(1) / max(1.0, shape.kv_len_spread)
        long_splits = min(math.ceil(FULL_WAVES * resident * sms / base), int(mean_tokens // min_tokens))
        while long_splits > 1 and _last_wave(base * long_splits / (resident * sms)) < WAVE_SATURATION:
            long_splits -= 1  # a last wave that few programs use costs a whole wave
        balanced = long_splits > splits
        splits = max(splits, long_splits)
        if (balanced and occ.family == "lean" and base >= occ.target * sms
                and shape.kv_len_spread < RAGGED_SPREAD and shape.kv_dtype.itemsize > 1):
            # One-warp programs of equal lengths of a 16-bit cache that reach the target unsplit
            # end together, and DRAM, not an SM, bounds their waves: the balance buys nothing
            # unless the count takes less time than one split.
            if _time(shape, occ, 1, sms) <= _time(shape, occ, splits, sms):
                splits, balanced = 1, False
    if splits == 1 and base > occ.resident_one_split * sms:
        splits = _fullest_waves(base, occ, tiles, sms)
    splits = min(splits, MAX_NUM_KV_SPLITS)
    if occ.family == "wide":  # the count so far, whole waves, one tile each (ragged) or one: least time
        fills = (waves * resident * sms // base for waves in range(1, WIDE_MAX_WAVES + 1))
        counts = [splits, *(count for count in fills if splits < count <= min(tiles, MAX_NUM_KV_SPLITS))]
        if shape.kv_len_spread >= RAGGED_SPREAD and splits < tiles <= MAX_NUM_KV_SPLITS:
            counts.append(tiles)  # ragged programs end apart: one tile each, past whole waves
        # One split where one wave holds its programs, of a 16-bit cache on pages longer than a
        # token (an fp8 tile's chain is its conversion and products, a one-token page tile's its
        # tokens' page-ID loads, longer than the load latency _time counts), or where they fill
        # more than two waves (a partly filled last wave is then a small share of the time).
        one_wave = base <= occ.resident_one_split * sms
        if not balanced and (base > 2 * occ.resident_one_split * sms
                             or one_wave and shape.kv_dtype.itemsize > 1 and shape.page_size > 1):
            counts.append(1)
        return min(counts, key=lambda count: _time(shape, occ, count, sms))
    one_warp = occ.config.num_warps == 1  # _time's chain: four warps overlap their tiles' loads
    if splits > 1 and one_warp and not balanced:
        # One split (no merge pass) or, where the fp8 minimum raised the target, any count from the
        # loads' own, or any count at all where the merge pass's partials outweigh the K/V bytes:
        # the least time, the fewest splits on a tie.
        fewest = splits
        if occ.target > occ.bytes_target:
            fewest = min(splits, max(1, math.floor(occ.bytes_target * sms / base + 0.5)))
        if _merge_bound(shape, occ, splits, sms):
            fewest = 1
        counts = [1, *range(fewest, splits + 1)]
        splits = min(counts, key=lambda count: _time(shape, occ, count, sms))
    return splits


def _within_schedulers(shape: ProblemShape, occ: Occupancy, splits: int, tiles: int, sms: int) -> int:
    """``splits``, or for one-warp programs of an fp8 cache (busy issuing their conversion) and
    equal lengths the largest count that puts no more of them on an SM's busiest scheduler than
    the issue target does, where that leaves the busiest scheduler SCHEDULER_GAIN of the tiles or
    fewer: the SM's other schedulers would wait for it (ragged programs end apart anyway)."""
    if shape.kv_dtype.itemsize != 1 or occ.config.num_warps != 1 or shape.kv_len_spread >= RAGGED_SPREAD:
        return splits
    target_warps = -(-math.ceil(occ.issue_target) // SCHEDULERS_PER_SM)  # on the busiest scheduler
    fewer = max(1, min(splits, target_warps * SCHEDULERS_PER_SM * sms // occ.base_programs))

    def busiest(count: int) -> int:  # the busiest scheduler's warps times the tiles of each
        programs_per_sm = -(-occ.base_programs * count // sms)
        return -(-programs_per_sm // SCHEDULERS_PER_SM) * -(-tiles // count)
    return fewer if busiest(fewer) <= SCHEDULER_GAIN * busiest(splits) else splits


def _merge_bound(shape: ProblemShape, occ: Occupancy, splits: int, sms: int) -> bool:
    """Whether the merge pass's busiest SM reads more partial bytes than the split pass's busiest SM
    reads K/V bytes, at ``splits`` splits (few query rows meeting many splits: a long request of
    few heads)."""
    tiles = shape.max_visible_tiles(occ.config.block_n)
    tile_bytes = 2 * occ.config.block_n * shape.block_d * shape.kv_dtype.itemsize
    kv_bytes = -(-occ.base_programs * splits // sms) * -(-tiles // splits) * tile_bytes
    return merge_read_bytes(shape, splits, sms) > kv_bytes


def long_split_limits(shape: ProblemShape, config: KernelConfig) -> tuple[int, int]:
    """Where the long-request split of ``config``'s programs starts (programs of one split >=
    target / divisor) and the fewest tokens of the mean request it leaves a split:
    (divisor, min_tokens)."""
    if shape.kv_len_spread >= RAGGED_SPREAD:
        divisor, min_tokens = RAGGED_LONG_TARGET_DIVISOR, RAGGED_MIN_TOKENS_PER_LONG_SPLIT
    else:
        divisor, min_tokens = LONG_TARGET_DIVISOR, MIN_TOKENS_PER_LONG_SPLIT
    if shape.kv_dtype.itemsize == 1 and config.num_warps == 1 and shape.page_size > 1:
        divisor = max(divisor, FP8_LONG_TARGET_DIVISOR)
    return divisor, min_tokens


def _time(shape: ProblemShape, occ: Occupancy, splits: int, sms: int) -> float:
    """The kernel time of ``splits`` splits, in bytes an SM streams meanwhile. Each wave lasts the
    longer of a program's chain of the longest request's tiles (a tile takes a load latency,
    IN_FLIGHT_BYTES_PER_SM, over the tiles the program keeps in flight) and its busiest SM's K/V
    bytes of the mean request; programs of ragged lengths past one wave overlap their waves
    instead, each lasting the mean request's chain and its program's edges, with a tail of the
    longest chain (RAGGED_TAIL, PROGRAM_EDGES_TILES). A split count adds its partial outputs and
    merge pass (``partials.merge_cost``)."""
    config = occ.config
    tiles = shape.max_visible_tiles(config.block_n)
    tile_bytes = 2 * config.block_n * shape.block_d * shape.kv_dtype.itemsize
    spread = max(1.0, shape.kv_len_spread)
    split_bytes = math.ceil(tiles / spread / splits) * tile_bytes
    latency = IN_FLIGHT_BYTES_PER_SM / occ.tiles_in_flight  # one tile of a program's chain
    chain = -(-tiles // splits) * latency
    per_wave = (occ.resident_one_split if splits == 1 else occ.resident) * sms
    programs = occ.base_programs * splits
    if spread >= RAGGED_SPREAD and programs > per_wave:  # ragged programs end apart
        mean_chain = (tiles / spread / splits + PROGRAM_EDGES_TILES) * latency
        waves = programs / per_wave
        time = max(chain, waves * max(mean_chain, per_wave // sms * split_bytes) + RAGGED_TAIL * chain)
    else:
        full_waves, last = divmod(programs, per_wave)
        time = full_waves * max(chain, per_wave // sms * split_bytes)
        if last:
            time += max(chain, -(-last // sms) * split_bytes)
    return time if splits == 1 else time + merge_cost(shape, programs, splits, sms)


def _last_wave(waves: float) -> float:
    """How full the last of ``waves`` waves is (1.0 within one wave)."""
    return 1.0 if waves <= 1 else waves - math.ceil(waves) + 1


def _saturation(occ: Occupancy, splits: int) -> float:
    """The fill from which a wave costs in proportion to its programs: WAVE_SATURATION, or the
    target's share of the programs that fit where that is less (a wave that holds the target's
    programs keeps the loads in flight)."""
    resident = occ.resident_one_split if splits == 1 else occ.resident
    return min(WAVE_SATURATION, occ.target / resident)


def _fullest_waves(base: int, occ: Occupancy, tiles: int, sms: int) -> int:
    """The split count of lowest cost for programs past one wave: waves started over waves of
    work, the last counted at least ``_saturation`` full, times SPLIT_COST per extra split."""
    best, best_cost = 1, math.inf
    for splits in range(1, min(tiles, MAX_MEND_SPLITS) + 1):
        per_wave = (occ.resident_one_split if splits == 1 else occ.resident) * sms
        waves = base * splits / per_wave
        started = math.ceil(waves) - 1 + max(_last_wave(waves), _saturation(occ, splits))
        cost = started / waves * (1 + SPLIT_COST * (splits - 1))
        if cost < best_cost - 1e-9:
            best, best_cost = splits, cost
    return best


def heuristic_config(shape: ProblemShape, device: DeviceProperties) -> KernelConfig:
    """The model's config for ``shape`` on ``device``, fitted to the shape."""
    occ = occupancy(shape, device)
    config = dataclasses.replace(occ.config, num_kv_splits=num_kv_splits(shape, occ, device))
    return fit_config(fit_programs_to_sms(config, shape, occ.family, device), shape)[0]


__all__ = ["Occupancy", "tile_family", "occupancy", "num_kv_splits", "heuristic_config"]
