"""Step 4 of the config model (``heuristic``): the tile, warps and stages of a family's programs
once their split count is known, against the SMs that run them.

- Lean programs of one split and equal lengths that spill past one wave take smaller tiles (or
  fewer stages) where those keep them in one wave (``_fit_one_wave``); those of 16-bit tiles
  inside pages and fewer than five query rows take five stages where that takes no more waves
  (``_one_split_depth``); those of short requests that fill more than half a wave take smaller
  tiles where those fill no more than half of theirs, or, at the smallest tile already, fewer
  stages where one tile in flight keeps an SM's loads (``_half_wave_tiles``).
- Short-family programs of an fp8 cache that step 3 leaves one split take the whole-request tile
  their four warps hold in registers (``_short_whole_tile``).
- One-warp programs left two tiles each take four warps and one larger tile (``_two_tile_programs``).
- One-warp programs no more than the SMs take four warps, and one tile a program where a tile
  held in registers makes it one, or where they leave many SMs idle (``_spread_warps``).
- One-split one-warp fp8 programs more than the SMs but at most two an SM take two warps, a warp
  on each scheduler (``_paired_fp8_warps``).
- One-warp programs of many query rows that leave each warp scheduler one warp or none take four
  warps and one larger tile a program: fp8 caches (for equal lengths, where those programs fit
  one wave), and 16-bit ones at D = 128 whose programs run one tile already
  (``_programs_short_of_warps``); so do one-warp programs of one page-gathering tile each at
  MANY_SPLITS or more splits, or of more splits than one merge pass reads
  (``_many_one_tile_splits``).
- A one-warp program of one tile takes the fewest stages (``_one_tile_stages``).
- Four-warp fp8 programs of large tiles, or of one tile that gathers several pages, load them
  straight to registers where that takes no more waves (``_direct_fp8_loads``).
- Four-warp programs of one tile inside a page, no more than the SMs, take two stages
  (``_lone_tile_stages``).
"""

from __future__ import annotations

import dataclasses

from ..device import DeviceProperties
from .family import IN_FLIGHT_BYTES_PER_SM, LEAN_DEEP_MIN_ROWS, holds_lean_rows
from .residency import REGISTER_SUB_PARTITIONS, resident_programs_per_sm
from .space import (BLOCK_N_CHOICES, MAX_NUM_KV_SPLITS, RAGGED_SPREAD, KernelConfig, ProblemShape,
                    merge_splits_per_pass)

# Warp schedulers of an SM, one a register sub-partition: one-warp programs that have an SM each
# leave all but one idle.
SCHEDULERS_PER_SM = REGISTER_SUB_PARTITIONS
# The lean tile of requests whose one-split programs fit one wave only with tiles this small, and
# the stages of such a tile that fits it only with fewer buffers.
LEAN_FIT_TOKENS = 16
LEAN_FIT_STAGES = 3
# Requests of at most this many tokens whose one-split 16-bit lean programs of HALF_WAVE_STAGES
# stages (two tiles in flight) fill more than half a wave take LEAN_FIT_TOKENS-token tiles where
# those programs fill no more than half of theirs.
HALF_WAVE_MAX_TOKENS = 512
HALF_WAVE_STAGES = 5
# One-split 16-bit lean programs of tiles inside pages that step 1 gives three stages (fewer than
# family.LEAN_DEEP_MIN_ROWS query rows) take this many (two tiles in flight) where that takes no
# more waves.
ONE_SPLIT_STAGES = 5
# The stages of a one-warp program of one tile: the fewest buffers where the tile lies inside a
# page, no pipeline where it gathers several.
ONE_TILE_STAGES_INSIDE_PAGES = 2
ONE_TILE_STAGES_CROSSING = 1
# One-warp programs of two tiles take four warps and one tile of this many K elements (64 tokens
# at D = 128, 128 at D = 64), where a KV head has at least TWO_TILE_MIN_ROWS query rows (fewer
# leave the warp waiting on loads rather than on the two tiles' products) and D is at most
# TWO_TILE_MAX_HEAD_DIM (lean programs above it take 16-token tiles inside pages).
TWO_TILE_ELEMENTS = 8 * 1024
TWO_TILE_MIN_ROWS = 5
TWO_TILE_MAX_HEAD_DIM = 128
# Four-warp fp8 tiles of at least this many K elements load straight to registers (from
# ONE_TILE_DIRECT_MIN_ELEMENTS where a program runs one tile that gathers several pages); a tile of
# more than REGISTER_BOUND_TILE_ELEMENTS (the 128 x 256 one, every register a thread may hold) only
# where a program runs at most DIRECT_MAX_CHAIN_TILES of them.
DIRECT_MIN_TILE_ELEMENTS = 8 * 1024
ONE_TILE_DIRECT_MIN_ELEMENTS = 4 * 1024
REGISTER_BOUND_TILE_ELEMENTS = 64 * 256
DIRECT_MAX_CHAIN_TILES = 3
# Split one-warp programs with at least SHORT_OF_WARPS_MIN_ROWS query rows a KV head, no more
# than SCHEDULERS_PER_SM an SM, take four warps and one tile a program; for an fp8 cache the
# largest of at most FP8_FOUR_WARP_MAX_TILE_ELEMENTS (halving down to TWO_TILE_ELEMENTS) whose
# programs still cover the SMs. Fewer rows write partials too small for the fewer splits to save
# much.
SHORT_OF_WARPS_MIN_ROWS = 10
FP8_FOUR_WARP_MAX_TILE_ELEMENTS = 2 * REGISTER_BOUND_TILE_ELEMENTS
# One-split one-warp fp8 programs of at most this many an SM (more than one: one takes four warps)
# take two warps, so that each SM's programs put a warp on each of its schedulers.
PAIRED_WARPS_PER_SM = 2
# 16-bit caches: only one-warp programs of one tile each, at this head dim, take four warps and one
# TWO_TILE_ELEMENTS tile a program (at D = 64, and for longer chains, four warps measured slower).
SIXTEEN_BIT_ONE_TILE_HEAD_DIM = 128
# One-warp programs of one tile each, whatever their rows and count: from MANY_SPLITS splits of a
# request, whose merge pass reads each query row's partials from every split, they take four warps
# and one TWO_TILE_ELEMENTS tile a program where the cache is fp8, or the tile gathers pages and
# holds at least MANY_SPLITS_MIN_BLOCK_N tokens.
MANY_SPLITS = 64
MANY_SPLITS_MIN_BLOCK_N = 32
# Four-warp programs left a chain of tiles that no register-held tile removes, where they cover at
# most FEW_PROGRAMS_SHARE of the SMs (the fill under which a wave costs as much as one that full,
# splits.WAVE_SATURATION), split into one SPREAD_TILE_TOKENS-token tile a program: 16 of a
# tile's tokens for each of the four warps.
FEW_PROGRAMS_SHARE = 0.6
SPREAD_TILE_TOKENS = 64
# Eight-warp programs of one register-held tile of a 16-bit cache that cover at most this share of
# the SMs stage the tile (two stages) rather than load it straight to registers: so few programs
# leave DRAM short of work, and each busy SM's own load path sets the time, which the staged
# tile's asynchronous copies of its K and V keep fuller than its warps' register loads do. With
# more programs DRAM's bandwidth bounds them and staging's round trip through shared memory
# costs more than it saves; the share is where the two cross in the H200 timings (docs/design.md).
STAGED_EIGHT_WARP_MAX_SHARE = 0.4


def fit_programs_to_sms(config: KernelConfig, shape: ProblemShape, family: str,
                        device: DeviceProperties) -> KernelConfig:
    """Step 4 for ``config`` of ``family`` ("lean", "wide" or "short"), its split count chosen."""
    if family == "lean" and config.num_kv_splits == 1:
        config = _half_wave_tiles(one_split_depth(config, shape, device), shape, device)
    if family == "short" and config.num_kv_splits == 1:
        config = _short_whole_tile(config, shape)
    config = _spread_warps(_two_tile_programs(config, shape), shape, device)
    config = _many_one_tile_splits(_programs_short_of_warps(config, shape, device), shape, device)
    config = _paired_fp8_warps(_one_tile_stages(config, shape), shape, device)
    config = _lone_tile_stages(_direct_fp8_loads(config, shape, device), shape, device)
    return _few_staged_eight_warp_tiles(config, shape, device)


def _fit_one_wave(config: KernelConfig, shape: ProblemShape, device: DeviceProperties) -> KernelConfig:
    """Requests of equal lengths whose one-split programs spill past one wave but fit it with
    LEAN_FIT_TOKENS-token tiles (LEAN_FIT_STAGES stages where the tile is that already) take those:
    their programs end together, so the spilled ones would run a second wave of their own (ragged
    ones end apart, and later programs fill the gaps)."""
    if shape.kv_len_spread >= RAGGED_SPREAD:
        return config

    def one_wave(candidate: KernelConfig) -> bool:
        fits = resident_programs_per_sm(candidate, shape, device, one_split=True)
        return shape.programs(candidate.block_m) <= fits * device.sm_count

    if one_wave(config):
        return config
    if config.block_n > LEAN_FIT_TOKENS:
        smaller = dataclasses.replace(config, block_n=LEAN_FIT_TOKENS)
    else:  # the tile is already the smallest: fewer buffers of it
        smaller = dataclasses.replace(config, num_stages=min(config.num_stages, LEAN_FIT_STAGES))
    return smaller if one_wave(smaller) else config


def smaller_tile_fits_one_wave(config: KernelConfig, shape: ProblemShape, device: DeviceProperties) -> bool:
    """Whether ``_fit_one_wave`` gives one split's programs of ``config`` (past one wave) the
    LEAN_FIT_TOKENS-token tile, which holds them in one wave."""
    return _fit_one_wave(config, shape, device).block_n < config.block_n


def one_split_whole_tile(config: KernelConfig, shape: ProblemShape, device: DeviceProperties) -> bool:
    """Whether ``_spread_warps`` gives one split's one-warp programs of ``config`` one whole
    request's tile each: a program is then one load, its chain of tiles gone."""
    if config.num_warps != 1:
        return False
    spread = _spread_warps(dataclasses.replace(config, num_kv_splits=1), shape, device)
    return spread.num_warps > 1 and spread.num_kv_splits == 1 and shape.max_visible_tiles(spread.block_n) == 1


def short_whole_tile(shape: ProblemShape) -> int | None:
    """The tile (``block_n``) that holds a whole request of an fp8 cache in one load its short
    family's four warps hold in registers (at most REGISTER_BOUND_TILE_ELEMENTS), for a program of
    no more rows than a lean one's (as step 1's whole-request tile); else None. Step 3 times one
    split of it as one load (``splits._one_load_time``); a 16-bit cache's tile (twice the bytes), or
    one that takes more warps, keeps the short family's one tile a split."""
    block_n = next((n for n in BLOCK_N_CHOICES if shape.max_visible_tiles(n) == 1), None)
    if (block_n is None or shape.kv_dtype.itemsize != 1 or not holds_lean_rows(shape)
            or block_n * shape.block_d > REGISTER_BOUND_TILE_ELEMENTS):
        return None
    return block_n


def _short_whole_tile(config: KernelConfig, shape: ProblemShape) -> KernelConfig:
    """Short-family programs that step 3 leaves one split of a request longer than their tile take
    the whole-request tile it timed (``short_whole_tile``), loaded straight to registers."""
    block_n = short_whole_tile(shape)
    if block_n is None or shape.max_visible_tiles(config.block_n) == 1:
        return config
    return _one_tile_a_program(config, shape, block_n)


def _one_split_depth(config: KernelConfig, shape: ProblemShape, device: DeviceProperties) -> KernelConfig:
    """One-split programs of 16-bit one-warp tiles inside pages with fewer than LEAN_DEEP_MIN_ROWS
    query rows (three stages from step 1, one tile in flight) take ONE_SPLIT_STAGES where their
    programs then need no more waves: a split program's count is raised to the target by its
    splits, but a one-split program's count is the problem's own, so the pipeline's depth is its
    one lever on the loads in flight. Applied after ``_fit_one_wave``, so a tile or depth that
    fits one wave stays, and before ``_half_wave_tiles``, whose five-stage programs these become."""
    if (config.num_warps != 1 or config.num_stages >= ONE_SPLIT_STAGES or shape.kv_dtype.itemsize == 1
            or shape.page_size % config.block_n != 0 or shape.rows_per_kv_head >= LEAN_DEEP_MIN_ROWS):
        return config
    deeper = dataclasses.replace(config, num_stages=ONE_SPLIT_STAGES)
    programs = shape.programs(config.block_m)

    def waves(candidate: KernelConfig) -> int:
        room = resident_programs_per_sm(candidate, shape, device, one_split=True) * device.sm_count
        return -(-programs // room)
    return deeper if waves(deeper) <= waves(config) else config


def one_split_depth(config: KernelConfig, shape: ProblemShape, device: DeviceProperties) -> KernelConfig:
    """``config``'s programs at one split as step 4 deepens them (``_one_split_depth``), for step 3."""
    return _one_split_depth(_fit_one_wave(config, shape, device), shape, device)


def _half_wave_tiles(config: KernelConfig, shape: ProblemShape, device: DeviceProperties) -> KernelConfig:
    """Short requests (at most HALF_WAVE_MAX_TOKENS) of equal lengths whose one-split 16-bit
    programs of HALF_WAVE_STAGES stages fill more than half the SMs' room for them, but no more
    than half the room for LEAN_FIT_TOKENS-token tiles, take those tiles: their SMs then hold at
    most half the programs that fit, which measured faster where each program runs a chain of a
    few tiles (a program of fewer stages, one tile in flight, loses more by the smaller tile).
    Where the tile is LEAN_FIT_TOKENS tokens already, the smaller footprint is LEAN_FIT_STAGES
    stages (as in ``_fit_one_wave``), taken only where an SM's programs (ceil(programs / SMs))
    keep IN_FLIGHT_BYTES_PER_SM loading at the one tile in flight each of those stages: a second
    tile in flight then buys nothing."""
    if (config.num_stages != HALF_WAVE_STAGES
            or shape.kv_dtype.itemsize == 1 or shape.kv_len_spread >= RAGGED_SPREAD
            or shape.max_visible_tiles(1) > HALF_WAVE_MAX_TOKENS):
        return config
    programs = shape.programs(config.block_m)
    if config.block_n > LEAN_FIT_TOKENS:
        smaller = dataclasses.replace(config, block_n=LEAN_FIT_TOKENS)
    else:  # the smallest tile already: fewer buffers, where one tile in flight a program keeps the loads
        tile_bytes = 2 * config.block_n * shape.block_d * shape.kv_dtype.itemsize  # a K and a V tile
        in_flight = -(-programs // device.sm_count) * (LEAN_FIT_STAGES - 1) / 2 * tile_bytes
        if in_flight < IN_FLIGHT_BYTES_PER_SM:
            return config
        smaller = dataclasses.replace(config, num_stages=LEAN_FIT_STAGES)

    def room(candidate: KernelConfig) -> int:  # the programs one wave holds
        return resident_programs_per_sm(candidate, shape, device, one_split=True) * device.sm_count
    return smaller if room(config) < 2 * programs <= room(smaller) else config


def _two_tile_programs(config: KernelConfig, shape: ProblemShape) -> KernelConfig:
    """One-warp programs that the split count leaves two tiles each take SCHEDULERS_PER_SM warps
    and one tile of TWO_TILE_ELEMENTS a program, loaded straight to registers (one stage): such a
    chain is too short for a pipeline to hide its loads, and one warp works through both tiles'
    products alone, where four share them. Not on one-token pages, whose every token the larger
    tile would gather."""
    if (config.num_warps != 1 or config.num_kv_splits == 1 or shape.block_d > TWO_TILE_MAX_HEAD_DIM
            or shape.page_size == 1 or shape.rows_per_kv_head < TWO_TILE_MIN_ROWS):
        return config
    if -(-shape.max_visible_tiles(config.block_n) // config.num_kv_splits) != 2:
        return config
    return _one_tile_a_program(config, shape, TWO_TILE_ELEMENTS // shape.block_d)


def _one_tile_a_program(config: KernelConfig, shape: ProblemShape, block_n: int) -> KernelConfig:
    """SCHEDULERS_PER_SM warps, one ``block_n``-token tile a program, loaded straight to registers."""
    splits = min(shape.max_visible_tiles(block_n), MAX_NUM_KV_SPLITS)
    return dataclasses.replace(config, block_n=block_n, num_kv_splits=splits, num_warps=SCHEDULERS_PER_SM,
                               num_stages=1)


def _spread_warps(config: KernelConfig, shape: ProblemShape, device: DeviceProperties) -> KernelConfig:
    """One-warp programs no more than the SMs each have an SM to themselves, whose other warp
    schedulers would idle: they take SCHEDULERS_PER_SM warps, which share each tile's loads and
    products. A program of several tiles takes the smallest tile that leaves it one (no more
    programs) where its warps hold that tile in registers: its chain of dependent tiles becomes
    one load. Four warps hold REGISTER_BOUND_TILE_ELEMENTS; a tile of up to twice that takes twice
    the warps, loaded straight to registers (one stage), since staging a tile that large through
    shared memory costs more than it saves. A program of one tile has nothing to prefetch: two
    stages, the fewest buffers. Where no such tile holds a request and the programs leave more
    than 1 - FEW_PROGRAMS_SHARE of the SMs idle, the chain splits instead, into one
    SPREAD_TILE_TOKENS-token tile a program: the idle SMs take the extra programs."""
    if config.num_warps != 1 or shape.programs(config.block_m) * config.num_kv_splits > device.sm_count:
        return config
    config = dataclasses.replace(config, num_warps=SCHEDULERS_PER_SM)
    whole = next((block_n for block_n in BLOCK_N_CHOICES
                  if shape.max_visible_tiles(block_n) <= config.num_kv_splits), None)
    if whole is None or max(whole, config.block_n) * shape.block_d > 2 * REGISTER_BOUND_TILE_ELEMENTS:
        if shape.programs(config.block_m) * config.num_kv_splits > FEW_PROGRAMS_SHARE * device.sm_count:
            return config
        return _one_tile_a_program(config, shape, SPREAD_TILE_TOKENS)
    block_n = max(whole, config.block_n)
    elements = block_n * shape.block_d
    config = dataclasses.replace(config, block_n=block_n, num_kv_splits=shape.max_visible_tiles(block_n))
    if elements > REGISTER_BOUND_TILE_ELEMENTS:
        return dataclasses.replace(config, num_warps=2 * SCHEDULERS_PER_SM, num_stages=1)
    return dataclasses.replace(config, num_stages=2)


def _paired_fp8_warps(config: KernelConfig, shape: ProblemShape, device: DeviceProperties) -> KernelConfig:
    """One-split one-warp programs of an fp8 cache, more than the SMs (fewer take four warps,
    ``_spread_warps``) but at most PAIRED_WARPS_PER_SM an SM, take SCHEDULERS_PER_SM //
    PAIRED_WARPS_PER_SM warps: each warp is busy issuing its tiles' conversion (as
    family.FP8_MIN_WARPS_PER_SM), and an SM's one or two one-warp programs leave at least half its
    warp schedulers idle, where two warps a program put a warp on each. Only at one split: a split
    program's count is raised to the target by its splits, but a one-split program's count is the
    problem's own, so its warps are the lever left (as the pipeline's depth in ``_one_split_depth``)."""
    programs = shape.programs(config.block_m) * config.num_kv_splits
    if (config.num_warps != 1 or config.num_kv_splits != 1 or shape.kv_dtype.itemsize != 1
            or not device.sm_count < programs <= PAIRED_WARPS_PER_SM * device.sm_count):
        return config
    return dataclasses.replace(config, num_warps=SCHEDULERS_PER_SM // PAIRED_WARPS_PER_SM)


def _programs_short_of_warps(config: KernelConfig, shape: ProblemShape,
                             device: DeviceProperties) -> KernelConfig:
    """Split one-warp programs with at least SHORT_OF_WARPS_MIN_ROWS query rows a KV head, no more
    than SCHEDULERS_PER_SM an SM, leave each warp scheduler one warp or none, which works through
    every tile's products (and, for an fp8 cache, its conversion) alone. They take
    SCHEDULERS_PER_SM warps, which share each tile's work, and one tile a program, loaded straight
    to registers; the fewer splits write fewer partial outputs, which many rows make large.
    - fp8 caches: the largest tile of at most FP8_FOUR_WARP_MAX_TILE_ELEMENTS whose programs still
      cover the SMs (halving down to TWO_TILE_ELEMENTS), where that takes no more splits than the
      one-warp programs had and, for requests of equal lengths, its programs fit one wave: a
      register-held tile has no pipeline, so a program past those an SM holds waits for an earlier
      one's whole load and products (ragged requests' programs end apart, and later ones fill
      the gaps).
    - 16-bit caches, which cost a warp no conversion: only programs of one tile already, at
      D = SIXTEEN_BIT_ONE_TILE_HEAD_DIM, take one TWO_TILE_ELEMENTS tile each.
    Not on one-token pages nor D > TWO_TILE_MAX_HEAD_DIM, as ``_two_tile_programs``."""
    if (config.num_warps != 1 or config.num_kv_splits == 1 or shape.block_d > TWO_TILE_MAX_HEAD_DIM
            or shape.page_size == 1 or shape.rows_per_kv_head < SHORT_OF_WARPS_MIN_ROWS):
        return config
    base = shape.programs(config.block_m)
    if base * config.num_kv_splits > SCHEDULERS_PER_SM * device.sm_count:
        return config
    if shape.kv_dtype.itemsize > 1:  # 16-bit: one-tile programs at D = 128 only, one 8K-element tile
        one_tile = shape.max_visible_tiles(config.block_n) <= config.num_kv_splits
        if not one_tile or shape.block_d != SIXTEEN_BIT_ONE_TILE_HEAD_DIM:
            return config
        return _one_tile_a_program(config, shape, TWO_TILE_ELEMENTS // shape.block_d)

    def programs(elements: int) -> int:  # one tile of that many K elements a program
        return base * min(shape.max_visible_tiles(elements // shape.block_d), MAX_NUM_KV_SPLITS)

    elements = min(FP8_FOUR_WARP_MAX_TILE_ELEMENTS, max(BLOCK_N_CHOICES) * shape.block_d)
    while elements > TWO_TILE_ELEMENTS and programs(elements) < device.sm_count:
        elements //= 2
    block_n = elements // shape.block_d
    if shape.max_visible_tiles(block_n) > config.num_kv_splits:  # long chains: not one tile a program
        return config
    one_tile = _one_tile_a_program(config, shape, block_n)
    wave = resident_programs_per_sm(one_tile, shape, device) * device.sm_count
    if shape.kv_len_spread < RAGGED_SPREAD and programs(elements) > wave:
        return config
    return one_tile


def _many_one_tile_splits(config: KernelConfig, shape: ProblemShape,
                          device: DeviceProperties) -> KernelConfig:
    """One-warp programs of one tile each at MANY_SPLITS or more splits (a long request of few KV
    heads) take SCHEDULERS_PER_SM warps and one TWO_TILE_ELEMENTS tile a program where each one
    warp waits on more than its loads: an fp8 tile's conversion, which one warp works through
    alone, or the page IDs of a tile that gathers several pages, a dependent step that four warps
    take once for a larger tile. Fewer, larger splits also write fewer partials, which the merge
    pass reads back split by split for each query row. A 16-bit tile inside a page or of fewer
    than MANY_SPLITS_MIN_BLOCK_N tokens keeps one warp (four measured no faster there), unless its
    splits are more than one merge pass reads (``_merge_passes``); not on one-token pages nor
    D > TWO_TILE_MAX_HEAD_DIM, as ``_two_tile_programs``."""
    if (config.num_warps != 1 or config.num_kv_splits < MANY_SPLITS
            or shape.block_d > TWO_TILE_MAX_HEAD_DIM or shape.page_size == 1):
        return config
    gathers = shape.page_size % config.block_n != 0 and config.block_n >= MANY_SPLITS_MIN_BLOCK_N
    if shape.kv_dtype.itemsize > 1 and not gathers and _merge_passes(config, shape, device) == 1:
        return config
    block_n = TWO_TILE_ELEMENTS // shape.block_d
    if shape.max_visible_tiles(config.block_n) > config.num_kv_splits or block_n <= config.block_n:
        return config
    return _one_tile_a_program(config, shape, block_n)


def _merge_passes(config: KernelConfig, shape: ProblemShape, device: DeviceProperties) -> int:
    """The passes each merge program takes over ``config``'s splits: it holds at most
    ``space.merge_splits_per_pass`` splits' partials in registers, and each further pass is another
    dependent round trip over them, on the few SMs that a long request's few query rows occupy."""
    rows = shape.batch_size * shape.max_seq_len_q * shape.num_qo_heads
    return -(-config.num_kv_splits // merge_splits_per_pass(rows, shape.block_d, device.sm_count))


def _one_tile_stages(config: KernelConfig, shape: ProblemShape) -> KernelConfig:
    """A one-warp program of one tile has nothing to prefetch, and a pipeline's buffers only add
    a round trip through shared memory: ONE_TILE_STAGES_INSIDE_PAGES stages where the tile lies
    inside a page, ONE_TILE_STAGES_CROSSING (its loads straight to registers) where it gathers
    several pages. One-token pages keep the pipeline, which orders their per-token gathers."""
    one_tile = shape.max_visible_tiles(config.block_n) <= config.num_kv_splits
    if config.num_warps != 1 or not one_tile or shape.page_size == 1:
        return config
    crossing = shape.page_size % config.block_n != 0
    stages = ONE_TILE_STAGES_CROSSING if crossing else ONE_TILE_STAGES_INSIDE_PAGES
    return dataclasses.replace(config, num_stages=stages)


def _direct_fp8_loads(config: KernelConfig, shape: ProblemShape, device: DeviceProperties) -> KernelConfig:
    """Four-warp programs of an fp8 cache whose K tile holds at least DIRECT_MIN_TILE_ELEMENTS load
    it straight to registers (one stage), where a pipeline would stage it through shared memory and
    convert it from there: for such a tile that round trip costs more than the prefetch saves. A
    tile of more than REGISTER_BOUND_TILE_ELEMENTS keeps its prefetch where a program runs more
    than DIRECT_MAX_CHAIN_TILES of them. A program of one tile that gathers several pages has
    nothing to prefetch: it loads the tile straight to registers from ONE_TILE_DIRECT_MIN_ELEMENTS
    (a 32-token tile at D = 128; at D = 64 the staged tile measured faster). One-token pages keep
    the pipeline, as in ``_one_tile_stages``. Neither loads straight to registers where that
    kernel's registers fit fewer programs on an SM than the staged one's and its programs then take
    more waves (the one-split kernel of a 64 x 256 tile for one query row a KV head): each wave
    runs a program's whole chain of tiles."""
    elements = config.block_n * shape.block_d
    if shape.kv_dtype.itemsize != 1 or config.num_warps < 4:
        return config
    chain = -(-shape.max_visible_tiles(config.block_n) // config.num_kv_splits)
    gathers = shape.page_size > 1 and shape.page_size % config.block_n != 0
    least = ONE_TILE_DIRECT_MIN_ELEMENTS if chain == 1 and gathers else DIRECT_MIN_TILE_ELEMENTS
    if elements < least:
        return config
    if elements > REGISTER_BOUND_TILE_ELEMENTS and chain > DIRECT_MAX_CHAIN_TILES:
        return config
    direct = dataclasses.replace(config, num_stages=1)
    programs = shape.programs(config.block_m) * config.num_kv_splits
    if _waves(programs, direct, shape, device) > _waves(programs, config, shape, device):
        return config
    return direct


def _waves(programs: int, config: KernelConfig, shape: ProblemShape, device: DeviceProperties) -> int:
    """The waves ``programs`` programs of ``config`` take on ``device``'s SMs."""
    return -(-programs // (resident_programs_per_sm(config, shape, device) * device.sm_count))


def _lone_tile_stages(config: KernelConfig, shape: ProblemShape, device: DeviceProperties) -> KernelConfig:
    """Four-warp programs of one tile inside a page, no more than the SMs (an SM's only program),
    take ONE_TILE_STAGES_INSIDE_PAGES stages, as a one-warp program of one such tile does
    (``_one_tile_stages``): the staged tile's K and V loads are issued together before its first
    product, and no other program on the SM covers the wait a load straight to registers leaves."""
    if config.num_warps != SCHEDULERS_PER_SM or config.num_stages != 1 or shape.page_size == 1:
        return config
    one_tile = shape.max_visible_tiles(config.block_n) <= config.num_kv_splits
    inside = shape.page_size % config.block_n == 0
    if not one_tile or not inside or shape.programs(config.block_m) * config.num_kv_splits > device.sm_count:
        return config
    return dataclasses.replace(config, num_stages=ONE_TILE_STAGES_INSIDE_PAGES)


def _few_staged_eight_warp_tiles(config: KernelConfig, shape: ProblemShape,
                                 device: DeviceProperties) -> KernelConfig:
    """Eight-warp programs of one 16-bit tile each (``_spread_warps``' whole-request tile, loaded
    straight to registers) that cover at most STAGED_EIGHT_WARP_MAX_SHARE of the SMs take
    ONE_TILE_STAGES_INSIDE_PAGES stages: with so few programs each busy SM's own loads, not DRAM,
    set the time, and the staged tile's asynchronous copies stream its K and V faster than the
    warps' register loads. An fp8 tile keeps its direct loads (``_direct_fp8_loads``); one-token
    pages keep their stages, as in ``_one_tile_stages``."""
    if (config.num_warps != 2 * SCHEDULERS_PER_SM or config.num_stages != 1
            or shape.kv_dtype.itemsize == 1 or shape.page_size == 1):
        return config
    one_tile = shape.max_visible_tiles(config.block_n) <= config.num_kv_splits
    programs = shape.programs(config.block_m) * config.num_kv_splits
    if not one_tile or programs > STAGED_EIGHT_WARP_MAX_SHARE * device.sm_count:
        return config
    return dataclasses.replace(config, num_stages=ONE_TILE_STAGES_INSIDE_PAGES)


__all__ = ["fit_programs_to_sms"]
