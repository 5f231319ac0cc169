"""Step 3 of the config model (``heuristic``): the split count (``num_kv_splits``), from one
wave rule, in named steps:

- Short-family programs take one tile a split, or one split where a tile holds the request or
  ``_short_one_load`` times one split as one load of a four-warp fp8 whole-request tile.
- ``_one_wave_of_target``: split each request until its programs reach the target in one wave
  (page-crossing fp8 ones the issue target), no further than their partial outputs are worth
  for one-warp tiles inside pages (``partials.partials_bound``), with no more fp8 one-warp
  programs on an SM's busiest scheduler than the issue target needs (``_within_schedulers``);
  never into a second wave, unless the count that fits one leaves it barely used.
- ``_deeper_one_split_reaches_target``: one split where step 4's deeper pipeline for one-split
  programs (``programs.one_split_depth``) keeps the target's bytes in flight without the splits.
- ``_long_request_splits``: requests whose one-split programs already reach a share of the
  target (``long_split_limits``: half; a quarter for ragged lengths, whose short requests idle
  SMs at a wave's end; an eighth for one-warp fp8 programs, which run out of issue first) split
  further, into about FULL_WAVES waves, which balance the SMs; a barely used last wave goes, and
  for ragged one-warp fp8 programs only it (``_keeps_full_waves``).
- ``_fullest_waves``: one-split programs past a wave, and counts that would leave a wave barely
  used, take the count whose waves cost least (a last wave costs at least WAVE_SATURATION of a
  full one); not 16-bit one-split lean programs that step 4's smaller tile holds in one wave
  (``_one_wave_at_smaller_tile``): they keep one split and take that tile.
- ``_wide_count``: four-warp programs of a wide tile end together, so of the count so far,
  whole waves, one tile a program (ragged lengths) and one split, the least time wins.
- ``_least_time_count``: a one-warp count above one must save more time than its merge pass and
  partial outputs cost.
- ``_even_chains``: lean programs of about equal lengths take the fewest splits that leave the
  same chains of tiles.

The clock the steps compare counts with is ``_time``: each wave lasts the longer of a
program's chain of tiles and its busiest SM's K/V bytes; ragged programs past a wave overlap
their waves; a split count adds its merge pass and partials (``partials.merge_cost``).
"""

from __future__ import annotations

import math

from ..device import DeviceProperties
from .family import IN_FLIGHT_BYTES_PER_SM, Occupancy
from .partials import merge_cost, merge_read_bytes, partials_bound
from .programs import (SCHEDULERS_PER_SM, TWO_TILE_MIN_ROWS, one_split_depth, one_split_whole_tile,
                       short_whole_tile, smaller_tile_fits_one_wave)
from .space import MAX_NUM_KV_SPLITS, RAGGED_SPREAD, KernelConfig, ProblemShape

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
SPLIT_COST = 0.03
# ``_fullest_waves`` weighs split counts up to this many (a request's tiles, if fewer).
FULLEST_WAVES_MAX_SPLITS = 64
# One-warp fp8 programs are busy issuing, so an SM lasts as long as its busiest scheduler's warps
# take; fewer splits that keep it at the issue target must cut its tiles to this share (they also
# keep fewer loads in flight).
SCHEDULER_GAIN = 0.9
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
    """The one wave rule's count (step 3 in the module docstring), in its named steps."""
    sms = device.sm_count
    tiles = shape.max_visible_tiles(occ.config.block_n)
    if occ.family == "short":  # one tile a split, or one split when a tile holds it all
        return 1 if tiles == 1 or _short_one_load(shape, occ, tiles, sms) else tiles
    splits = _one_wave_of_target(shape, occ, tiles, sms)
    if splits > 1 and _deeper_one_split_reaches_target(shape, occ, splits, device):
        splits = 1
    splits, balanced = _long_request_splits(shape, occ, splits, sms)
    if (splits == 1 and occ.base_programs > occ.resident_one_split * sms
            and not _one_wave_at_smaller_tile(shape, occ, device)):
        splits = _fullest_waves(occ.base_programs, occ, tiles, sms)
    splits = min(splits, MAX_NUM_KV_SPLITS)
    if occ.family == "wide":
        return _wide_count(shape, occ, splits, balanced, tiles, sms)
    if splits > 1 and occ.config.num_warps == 1 and not balanced:
        return _least_time_count(shape, occ, splits, device)
    return splits


def _short_one_load(shape: ProblemShape, occ: Occupancy, tiles: int, sms: int) -> bool:
    """Whether one split of short-family programs, which step 4 runs as one whole-request tile a
    program where four warps hold it in registers (``programs.short_whole_tile``), takes less time
    as that one load (``_one_load_time``) than one tile a split with its merge pass (``_time``)."""
    return (short_whole_tile(shape) is not None
            and _one_load_time(shape, occ, sms) < _time(shape, occ, tiles, sms))


def _one_wave_at_smaller_tile(shape: ProblemShape, occ: Occupancy, device: DeviceProperties) -> bool:
    """Whether one-split lean programs of a 16-bit cache that spill past one wave fit it with step
    4's smaller tile (``programs.smaller_tile_fits_one_wave``): the one wave rule then holds at one
    split, and step 4 takes that tile, so the waves ``_fullest_waves`` would balance never run. An
    fp8 cache's one-warp programs keep their waves, which keep the schedulers converting (as the
    long rule's FP8_LONG_TARGET_DIVISOR)."""
    return (occ.family == "lean" and shape.kv_dtype.itemsize > 1
            and smaller_tile_fits_one_wave(occ.config, shape, device))


def _deeper_one_split_reaches_target(shape: ProblemShape, occ: Occupancy, splits: int,
                                     device: DeviceProperties) -> bool:
    """Whether one split's lean programs, at the deeper pipeline step 4 gives them
    (``programs.one_split_depth``), reach the target that depth's tiles in flight ask, put a warp
    on each of an SM's SCHEDULERS_PER_SM schedulers (fewer one-warp programs leave schedulers idle
    that the split's programs would fill) and leave their busiest SM no more tiles than ``splits``
    does: they then keep as many bytes loading on every SM as the split count at the family's
    depth, without its merge pass and partials."""
    deeper = one_split_depth(occ.config, shape, device)
    if occ.family != "lean" or deeper.num_stages <= occ.config.num_stages:
        return False
    tile_bytes = 2 * deeper.block_n * shape.block_d * shape.kv_dtype.itemsize
    wanted = IN_FLIGHT_BYTES_PER_SM / ((deeper.num_stages - 1) / 2 * tile_bytes)  # as step 2 counts it
    sms = device.sm_count
    return (math.floor(wanted * sms / occ.base_programs + 0.5) <= 1
            and occ.base_programs >= SCHEDULERS_PER_SM * sms
            and _busiest_tiles(occ, shape, 1, sms) <= _busiest_tiles(occ, shape, splits, sms))


def _one_wave_of_target(shape: ProblemShape, occ: Occupancy, tiles: int, sms: int) -> int:
    """Split each request until its programs reach the target in one wave: page-crossing fp8
    programs the issue target, as far as their partial outputs are worth; one-warp tiles inside
    pages no further than their partials are worth; fp8 one-warp programs no more on the busiest
    scheduler than the issue target needs (``_within_schedulers``). Never into a second wave,
    unless the count that fits one would leave it barely used (``_fullest_waves``)."""
    base = occ.base_programs
    splits = max(1, math.floor(occ.target * sms / base + 0.5))
    if occ.issue_target > occ.target:  # page-crossing fp8: the schedulers' warps, where partials allow
        issuing = max(1, math.floor(occ.issue_target * sms / base + 0.5))
        splits = max(splits, min(issuing, partials_bound(shape, issuing)))
    inside_pages = occ.config.num_warps == 1 and shape.page_size % occ.config.block_n == 0
    if inside_pages and splits <= tiles:  # the target fits the tiles: no more than partials are worth
        splits = min(splits, partials_bound(shape, splits))
    splits = _within_schedulers(shape, occ, min(splits, tiles), tiles, sms)
    if splits > 1 and base * splits > occ.resident * sms:  # never spill into a second wave
        splits = max(1, occ.resident * sms // base)
        if base * splits < WAVE_SATURATION * occ.resident * sms:  # unless that leaves it barely used
            splits = _fullest_waves(base, occ, tiles, sms)
    return splits


def _long_request_splits(shape: ProblemShape, occ: Occupancy, splits: int, sms: int) -> tuple[int, bool]:
    """Requests whose one-split programs already reach a share of the target (``long_split_limits``)
    split further, into about FULL_WAVES waves of at least the limit's tokens, which balance the
    SMs; no count leaves a last wave under WAVE_SATURATION full (ragged fp8 one-warp programs that
    fit one wave unsplit drop only that last wave, ``_keeps_full_waves``). Returns the count and whether the
    balance set it (``_time`` does not count the balance, so later steps leave such a count)."""
    base = occ.base_programs
    divisor, min_tokens = long_split_limits(shape, occ.config)
    if base < occ.target * sms / divisor:
        return splits, False
    mean_tokens = shape.max_visible_tiles(1) / max(1.0, shape.kv_len_spread)
    long_splits = min(math.ceil(FULL_WAVES * occ.resident * sms / base), int(mean_tokens // min_tokens))
    def waves(count: int) -> float:
        return base * count / (occ.resident * sms)
    started = math.ceil(waves(long_splits))
    while long_splits > 1 and _last_wave(waves(long_splits)) < WAVE_SATURATION:
        if _keeps_full_waves(shape, occ, sms) and math.ceil(waves(long_splits - 1)) < started - 1:
            break  # the partly used last wave is gone: the full waves before it balance the SMs
        long_splits -= 1  # a last wave that few programs use costs a whole wave
    # Unsplit lean programs of equal lengths: where the long count leaves the busiest SM no fewer
    # tiles than one split does, it balances nothing, and the clock (``_time``) weighs it against
    # one split as any count (``_least_time_count``; ``_wide_count`` weighs wide tiles' waves itself).
    balanced = long_splits > splits and not (
        splits == 1 and occ.family == "lean" and shape.kv_len_spread < RAGGED_SPREAD
        and _busiest_tiles(occ, shape, long_splits, sms) >= _busiest_tiles(occ, shape, 1, sms))
    splits = max(splits, long_splits)
    if (balanced and occ.family == "lean" and shape.kv_dtype.itemsize > 1
            and _unsplit_reaches_target(shape, occ, sms)):
        # One-warp programs of a 16-bit cache that unsplit already reach the target
        # (``_unsplit_reaches_target``): DRAM, not an SM, bounds their waves, so the balance buys
        # nothing unless the count takes less time than one split.
        if _time(shape, occ, 1, sms) <= _time(shape, occ, splits, sms):
            return 1, False
    return splits, balanced


def _keeps_full_waves(shape: ProblemShape, occ: Occupancy, sms: int) -> bool:
    """Whether the long count, cutting a barely used last wave, keeps the full waves before it:
    ragged one-warp programs of an fp8 cache, whose balance pays from an eighth of the target
    (``fp8_long_balance``) and whose waves overlap (programs end apart), so a count one wave short
    only lengthens every request's chain and the longest one's tail; where one split's programs
    fit one wave (past it, one split runs in waves already, which ``_fullest_waves`` weighs)."""
    return (shape.kv_len_spread >= RAGGED_SPREAD and fp8_long_balance(shape, occ.config)
            and occ.base_programs <= occ.resident * sms)


def _unsplit_reaches_target(shape: ProblemShape, occ: Occupancy, sms: int) -> bool:
    """Whether one split's programs already reach the target: of equal lengths (which end together)
    on the busiest SM, its ceil of the programs an SM; of ragged lengths on every SM, or one
    program short of it where the least busy SM's programs still keep WAVE_SATURATION of the
    target's loads (DRAM, which all SMs share, then misses little of the target's bytes in flight),
    where a program holds at least TWO_TILE_MIN_ROWS query rows (as step 4's two-tile rule, from
    which a warp waits on its rows' work rather than its loads): the long count's partial outputs
    and merge rows (rows x D x 4 bytes a split) grow with the rows, while what its balance saves,
    the idle tail of a wave whose short requests end first, does not."""
    if shape.kv_len_spread < RAGGED_SPREAD:
        return math.ceil(occ.base_programs / sms) >= occ.target
    least_busy = occ.base_programs // sms
    return (shape.rows_per_kv_head >= TWO_TILE_MIN_ROWS and least_busy >= occ.target - 1
            and least_busy >= WAVE_SATURATION * occ.target)


def _busiest_tiles(occ: Occupancy, shape: ProblemShape, splits: int, sms: int) -> int:
    """The tiles the busiest SM walks at ``splits`` splits of equal-length requests: its programs
    (the ceil of the programs an SM) times each one's chain."""
    return -(-occ.base_programs * splits // sms) * -(-shape.max_visible_tiles(occ.config.block_n) // splits)


def _wide_count(shape: ProblemShape, occ: Occupancy, splits: int, balanced: bool, tiles: int, sms: int) -> int:
    """Four-warp programs of a wide tile end together, so a partly filled last wave idles whole
    SMs: of the count so far, larger ones that fill whole waves (up to WIDE_MAX_WAVES), one tile a
    program (ragged lengths, whose programs end apart) and one split, the one ``_time`` says takes
    least time."""
    base = occ.base_programs
    fills = (waves * occ.resident * sms // base for waves in range(1, WIDE_MAX_WAVES + 1))
    counts = [splits, *(count for count in fills if splits < count <= min(tiles, MAX_NUM_KV_SPLITS))]
    if shape.kv_len_spread >= RAGGED_SPREAD and splits < tiles <= MAX_NUM_KV_SPLITS:
        counts.append(tiles)  # ragged programs end apart: one tile each, past whole waves
    # One split where one wave holds its programs, of a 16-bit cache on pages longer than a token
    # (an fp8 tile's chain is its conversion and products, a one-token page tile's its tokens'
    # page-ID loads, longer than the load latency _time counts), or where they fill more than two
    # waves (a partly filled last wave is then a small share of the time).
    one_wave = base <= occ.resident_one_split * sms
    if not balanced and (base > 2 * occ.resident_one_split * sms
                         or one_wave and shape.kv_dtype.itemsize > 1 and shape.page_size > 1):
        counts.append(1)
    return min(counts, key=lambda count: _time(shape, occ, count, sms))


def _least_time_count(shape: ProblemShape, occ: Occupancy, splits: int, device: DeviceProperties) -> int:
    """A one-warp count above one must save more time than its merge pass and partial outputs
    cost (``_time``): of one split and the counts up to ``splits`` from the loads' own target
    (where the fp8 minimum raised the target) or from one (where the merge pass's partials
    outweigh the K/V bytes, ``_merge_bound``), the least time, the fewest splits on a tie.
    One split of an fp8 cache's programs of at least TWO_TILE_MIN_ROWS query rows is timed as
    step 4 runs it: where that gives each program one whole request's tile
    (``programs.one_split_whole_tile``), a program is one load (``_one_load_time``), not the chain
    of one-warp tiles ``_time`` counts, provided those programs keep at least one warp scheduler
    busy for each SM (programs x SCHEDULERS_PER_SM >= SMs): fewer whole-request programs do every
    request's conversion and products on a few SMs while the rest idle, so one SM's work, which
    the clock does not count, sets their time, where the split's one-warp programs reach every
    SM. Fewer rows leave a warp waiting on its loads rather than on
    its products and conversion, and write little partial output (as ``programs._two_tile_programs``);
    a 16-bit cache's one-warp programs mostly measured no faster for four warps
    (``programs._programs_short_of_warps``)."""
    sms = device.sm_count
    fewest = splits
    if occ.target > occ.bytes_target:
        fewest = min(splits, max(1, math.floor(occ.bytes_target * sms / occ.base_programs + 0.5)))
    if _merge_bound(shape, occ, splits, sms):
        fewest = 1
    counts = [1, *range(fewest, splits + 1)]
    whole = (shape.kv_dtype.itemsize == 1 and shape.rows_per_kv_head >= TWO_TILE_MIN_ROWS
             and occ.base_programs * SCHEDULERS_PER_SM >= sms  # a scheduler busy for each SM
             and one_split_whole_tile(occ.config, shape, device))

    def time(count: int) -> float:
        return _one_load_time(shape, occ, sms) if count == 1 and whole else _time(shape, occ, count, sms)
    return min(counts, key=time)


def _one_load_time(shape: ProblemShape, occ: Occupancy, sms: int) -> float:
    """``_time`` of one split whose programs load a whole request in one tile: one load latency
    (IN_FLIGHT_BYTES_PER_SM, the tile in flight at once), or the busiest SM's K/V bytes of the mean
    request where those take longer."""
    mean_tokens = shape.max_visible_tiles(1) / max(1.0, shape.kv_len_spread)
    request_bytes = 2 * math.ceil(mean_tokens) * shape.block_d * shape.kv_dtype.itemsize
    return max(IN_FLIGHT_BYTES_PER_SM, -(-occ.base_programs // sms) * request_bytes)


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
    if fp8_long_balance(shape, config):
        divisor = max(divisor, FP8_LONG_TARGET_DIVISOR)
    return divisor, min_tokens


def fp8_long_balance(shape: ProblemShape, config: KernelConfig) -> bool:
    """Whether ``config``'s programs are one-warp programs of an fp8 cache on pages longer than a
    token, whose long split pays from 1 / FP8_LONG_TARGET_DIVISOR of the target."""
    return shape.kv_dtype.itemsize == 1 and config.num_warps == 1 and shape.page_size > 1


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
    for splits in range(1, min(tiles, FULLEST_WAVES_MAX_SPLITS) + 1):
        per_wave = (occ.resident_one_split if splits == 1 else occ.resident) * sms
        waves = base * splits / per_wave
        started = math.ceil(waves) - 1 + max(_last_wave(waves), _saturation(occ, splits))
        cost = started / waves * (1 + SPLIT_COST * (splits - 1))
        if cost < best_cost - 1e-9:
            best, best_cost = splits, cost
    return best


__all__ = ["num_kv_splits", "long_split_limits"]
