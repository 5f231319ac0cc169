"""Kernel configurations: the tunable space, its validity rules and the heuristic default.

A ``KernelConfig`` fixes every compile-time choice of the split-KV decode kernel that does not
change its answer. ``ProblemShape`` is everything config selection may look at. The runtime picks
a config in ``select_config`` (explicit config, then tuned tables, then ``heuristic_config``);
``fit_config`` makes any config valid for a shape (clamping, never failing) and records why.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

# The config space. Every combination that passes ``KernelConfig.validate`` gives the same answer
# (up to floating-point reassociation); the tuner searches exactly these sets.
BLOCK_N_CHOICES = (16, 32, 64, 128, 256)  # K/V tokens per tile
BLOCK_M_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)  # packed query rows (G heads x SQ tokens) per program
NUM_WARPS_CHOICES = (1, 2, 4, 8)
# Through the page table, triton (3.6, sm90) gives the K/V tiles one shared-memory buffer at 2-4
# stages (one tile per program in flight) and two at 5 (scripts/sass_count.py; docs/perf-notes.md,
# "Sixth lease").
NUM_STAGES_CHOICES = (1, 2, 3, 4, 5)
MAX_NUM_KV_SPLITS = 1024
# block_m below this uses FMA reductions instead of tl.dot (tl.dot needs M >= 16).
DOT_MIN_BLOCK_M = 16
# heuristic_config's lean family (16-token K/V tiles, 1 warp) below this many B*Hkv programs per SM,
# with splits for about LEAN_PROGRAMS_PER_SM programs per SM (H200 sweeps, docs/perf-notes.md).
LEAN_MAX_PROGRAMS_PER_SM = 3
LEAN_PROGRAMS_PER_SM = 8
# ... and from LEAN_DEEP_MIN_ROWS query rows a KV head (of the 16 a lean program holds), 5 stages
# with splits for about LEAN_DEEP_PROGRAMS_PER_SM programs per SM.
LEAN_DEEP_MIN_ROWS = 5
LEAN_DEEP_PROGRAMS_PER_SM = 4
# ... and at head dims up to LEAN_SMALL_HEAD_DIM, 16-token tiles (2 KiB at D = 64) with 5 stages at
# about LEAN_PROGRAMS_PER_SM programs per SM for every row count (at D = 64 the same ~64 KiB of K/V
# buffers per SM as the two rules above at D = 128: one buffer below 5 stages, two from 5).
LEAN_SMALL_HEAD_DIM = 64
# From LEAN_MAX_PROGRAMS_PER_SM B*Hkv programs per SM with K/V of at most BATCH_LEAN_MAX_KV_LEN
# tokens (16-bit cache, up to 16 rows, D <= 128): one split of 16-token tiles, 1 warp, 5 stages,
# where the programs fit one wave (all resident at once) or, at D > LEAN_SMALL_HEAD_DIM, up to
# BATCH_LEAN_MAX_WAVES waves whose last is at least BATCH_LEAN_MIN_LAST_WAVE_FILL full. At head
# dims up to LEAN_SMALL_HEAD_DIM past BATCH_LEAN_MAX_KV_LEN, in one wave too: up to
# BATCH_LEAN_SPLIT_MAX_PROGRAMS_PER_SM with splits for at least LEAN_PROGRAMS_PER_SM programs per
# SM (no more than fit an SM), one split above.
BATCH_LEAN_SPLIT_MAX_PROGRAMS_PER_SM = 8
BATCH_LEAN_MAX_WAVES = 4
BATCH_LEAN_MIN_LAST_WAVE_FILL = 0.875
BATCH_LEAN_MAX_KV_LEN = 4096
# fp8 caches from 4 B*Hkv programs per SM with K/V of at most BATCH_LEAN_MAX_KV_LEN tokens
# (``_fp8_wave_splits``): where the ~46-a-SM rule's split count leaves a last wave of lean programs
# under FP8_WAVE_SATURATION of what fits the SMs at once, the count that fills its waves best, a
# wave filled to less than that counted as that full (7 of the 12 that fit an H200 SM keep DRAM
# busy) and each split past the first FP8_SPLIT_COST dearer (H200 A/B, 2026-12-01).
FP8_WAVE_SATURATION = 0.6
FP8_SPLIT_COST = 0.03
# 17-32 query rows a KV head (block_m = 32), 16-bit cache: 1-warp programs of 16-token tiles with
# 5 stages where each split walks more than the 4 tiles such a pipeline holds in flight.
WIDE_ROWS_BLOCK_M = 32
WIDE_ROWS_MIN_TILES_PER_SPLIT = 5
# Ragged fixed lengths (``scale_splits_to_raggedness``): splits grow by longest / mean, at most
# MAX_RAGGED_SPLIT_FACTOR x and to no fewer than RAGGED_MIN_TILES_PER_SPLIT tiles a split, while the
# programs fit one wave; programs past one wave but short of FULL_WAVES waves step to FULL_WAVES.
MAX_RAGGED_SPLIT_FACTOR = 4.0
RAGGED_MIN_TILES_PER_SPLIT = 8
# ... and the step to FULL_WAVES waves keeps at least this many tokens of the mean request a split
# (12 of the 64-token tiles it was measured with; one split of 16-token tiles stepped to 4 of
# ~280 tokens ran 1.04x one split and 1.05x the shape's own best, H200: docs/perf-notes.md,
# "Eighteenth lease").
RAGGED_MULTIWAVE_MIN_TOKENS_PER_SPLIT = 768
# Programs of the split kernel resident per SM at once (``resident_programs_per_sm``), counted as
# CUDA's occupancy calculator does: registers go to warps in REGISTER_ALLOCATION_UNIT units within
# each of the SM's REGISTER_SUB_PARTITIONS register files (65536 / 4 registers each; sm_70 to
# sm_90), so 1-warp programs at 182 registers a thread fit 2 a sub-partition, 8 a SM, not
# 65536 // 5888 = 11; shared memory per program plus SHARED_MEMORY_RESERVED_PER_PROGRAM; at most
# MAX_WARPS_PER_SM warps and MAX_PROGRAMS_PER_SM programs. The registers and shared memory of each
# config come from data/split_kernel_resources.csv (measured on the H200 with triton 3.6; that
# count matched the CUDA driver's at all 3,012 kernels measured:
# reports/nvidia-h200/2026-11-30/occupancy_driver*.csv).
REGISTERS_PER_SM = 65536
REGISTER_SUB_PARTITIONS = 4
REGISTER_ALLOCATION_UNIT = 256
MAX_WARPS_PER_SM = 64
MAX_PROGRAMS_PER_SM = 32
# Shared memory a program may use per SM (H100/H200: 227 KiB + 1 KiB reserved per program; the
# default of every function taking shared_memory_per_sm, and the value for CPU runs; a GPU's own
# comes from ``device_shared_memory_per_sm``).
SHARED_MEMORY_PER_SM = 233472
SHARED_MEMORY_RESERVED_PER_PROGRAM = 1024
# heuristic_config's multi-wave rule (16-bit caches, K/V shorter than 8k, at least 4 B*Hkv programs
# per SM): splits are added until the last wave is at least MIN_LAST_WAVE_FILL full or there are
# FULL_WAVES waves, keeping at least MULTIWAVE_MIN_TILES_PER_SPLIT tiles of the mean request per
# split.
FULL_WAVES = 4
MIN_LAST_WAVE_FILL = 2 / 3
MULTIWAVE_MIN_TILES_PER_SPLIT = 12
# The FMA path materialises a [block_m, block_n, block_d] product; cap it so it stays in registers.
FMA_MAX_TILE_ELEMENTS = 32768


@dataclass(frozen=True)
class KernelConfig:
    """Compile-time parameters of the split-KV decode kernel.

    block_n:       K/V tokens per tile (power of two, 16..256).
    block_m:       packed query rows per program; rows are (query token, query head of one KV
                   head) pairs, G * SQ of them per request and KV head. block_m >= 16 uses tl.dot
                   (rows padded), smaller uses FMA reductions. If block_m < G * SQ the K/V of a
                   head is read ceil(G * SQ / block_m) times.
    num_kv_splits: programs that share one request's K/V sequence (split-KV / flash-decoding);
                   > 1 adds a merge kernel and fp32 scratch of num_kv_splits partial outputs.
    num_warps:     warps per program.
    num_stages:    software-pipelining depth of the K/V loop (through the page table, triton
                   3.6 keeps one K/V tile per program in flight at 2-4 stages, two at 5).
    """

    block_n: int = 64
    block_m: int = 16
    num_kv_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def validate(self) -> None:
        """Raise ValueError if a field lies outside the config space."""
        for name, choices in (
            ("block_n", BLOCK_N_CHOICES),
            ("block_m", BLOCK_M_CHOICES),
            ("num_warps", NUM_WARPS_CHOICES),
            ("num_stages", NUM_STAGES_CHOICES),
        ):
            value = getattr(self, name)
            if type(value) is not int or value not in choices:
                raise ValueError(f"KernelConfig.{name} must be one of {choices}, got {value!r}")
        if type(self.num_kv_splits) is not int or not 1 <= self.num_kv_splits <= MAX_NUM_KV_SPLITS:
            raise ValueError(
                f"KernelConfig.num_kv_splits must be an int in [1, {MAX_NUM_KV_SPLITS}], "
                f"got {self.num_kv_splits!r}"
            )

    @property
    def uses_dot(self) -> bool:
        return self.block_m >= DOT_MIN_BLOCK_M

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KernelConfig":
        """Build and validate a config from a mapping with exactly the dataclass fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, Mapping) or set(data) != names:
            raise ValueError(f"a KernelConfig needs exactly the keys {sorted(names)}, got {data!r}")
        config = cls(**{k: data[k] for k in names})
        config.validate()
        return config


MASK_KINDS = ("dense", "causal", "windowed")


@dataclass(frozen=True)
class ProblemShape:
    """What config selection may look at (host values only; fixed at plan time).

    max_kv_len is the longest K/V length the plan covers (tokens); max_seq_len_q the query
    tokens per request (fixed SQ, or the packed capacity); window_left the sliding window (-1:
    none), of which mask_kind records only whether there is one.
    """

    batch_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_kv_len: int
    max_seq_len_q: int = 1
    packed: bool = False
    mask_kind: str = "dense"
    q_dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype = torch.bfloat16
    o_dtype: torch.dtype = torch.bfloat16
    # Longest over mean K/V length of the plan's requests when lengths are fixed at plan time
    # (1.0 for bound lengths, unknown until run): how ragged the batch is.
    kv_len_spread: float = 1.0
    window_left: int = -1

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def rows_per_kv_head(self) -> int:
        """Packed query rows one request and KV head contributes: G * SQ."""
        return self.group_size * self.max_seq_len_q

    @property
    def block_d(self) -> int:
        return next_power_of_2(self.head_dim)

    def max_visible_tiles(self, block_n: int) -> int:
        """K/V tiles of block_n tokens a program can walk: those of the longest request, or with a
        sliding window those holding its last max_seq_len_q + window_left keys (one more where
        that range starts inside a tile)."""
        tiles = num_kv_tiles(self.max_kv_len, block_n)
        if self.window_left >= 0:
            tiles = min(tiles, num_kv_tiles(self.max_seq_len_q + self.window_left, block_n) + 1)
        return tiles


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def num_kv_tiles(max_kv_len: int, block_n: int) -> int:
    return -(-max_kv_len // block_n)


def fit_config(config: KernelConfig, shape: ProblemShape) -> tuple[KernelConfig, tuple[str, ...]]:
    """Return a config valid for ``shape`` close to ``config``, and what was changed and why.

    Validity per shape: block_m no larger than the padded row count needs; the FMA path's tile
    fits FMA_MAX_TILE_ELEMENTS; num_kv_splits no larger than the K/V tiles a program can walk
    (``ProblemShape.max_visible_tiles``: more splits would only add empty programs).
    """
    config.validate()
    changes: list[str] = []
    rows = shape.rows_per_kv_head
    block_m = config.block_m
    if block_m > DOT_MIN_BLOCK_M and block_m > next_power_of_2(rows):
        new = max(DOT_MIN_BLOCK_M, next_power_of_2(rows))
        changes.append(f"block_m {block_m} -> {new}: only {rows} query rows per KV head")
        block_m = new
    if block_m < DOT_MIN_BLOCK_M:
        while block_m > 1 and block_m * config.block_n * shape.block_d > FMA_MAX_TILE_ELEMENTS:
            block_m //= 2
        if block_m != config.block_m:
            changes.append(
                f"block_m {config.block_m} -> {block_m}: FMA tile block_m*block_n*block_d "
                f"must stay <= {FMA_MAX_TILE_ELEMENTS}"
            )
    block_n = config.block_n
    if block_m < DOT_MIN_BLOCK_M:
        while block_m * block_n * shape.block_d > FMA_MAX_TILE_ELEMENTS and block_n > 16:
            block_n //= 2
        if block_n != config.block_n:
            changes.append(
                f"block_n {config.block_n} -> {block_n}: FMA tile block_m*block_n*block_d "
                f"must stay <= {FMA_MAX_TILE_ELEMENTS}"
            )
    max_splits = shape.max_visible_tiles(block_n)
    num_kv_splits = config.num_kv_splits
    if num_kv_splits > max_splits:
        if max_splits < num_kv_tiles(shape.max_kv_len, block_n):
            why = f"window_left {shape.window_left} leaves at most {max_splits} tiles of {block_n} visible"
        else:
            why = f"max_kv_len {shape.max_kv_len} has only {max_splits} tiles of {block_n}"
        changes.append(f"num_kv_splits {num_kv_splits} -> {max_splits}: {why}")
        num_kv_splits = max_splits
    fitted = dataclasses.replace(
        config, block_m=block_m, block_n=block_n, num_kv_splits=num_kv_splits
    )
    return fitted, tuple(changes)


def heuristic_config(
    shape: ProblemShape, num_sms: int, shared_memory_per_sm: int = SHARED_MEMORY_PER_SM
) -> KernelConfig:
    """A good default from SM count, B*Hkv, L, G and D (no measurement).

    Calibrated on H200 sweeps (docs/perf-notes.md). Rows: all G*SQ query rows of a KV head in
    one program (K/V read once), padded to at least 16 for tl.dot: the FMA path is far slower even
    for a single row. Few B*Hkv programs (< 3 per SM) with 16 rows or fewer, D <= 128 and a
    16-bit cache: lean programs (16-token tiles, 4 KiB at D = 128; 1 warp; 3 stages) and splits
    for about 8 of them per SM; from 5 rows, 5 stages and about 4 per SM; at D <= 64, 5 stages
    and about 8 per SM at any row count. From 3 B*Hkv programs per SM with K/V of at most 4k
    tokens (same cache, rows and D): one split of 16-token tiles, 1 warp, 5 stages, in one wave
    (8 a SM at D = 128 on an H200, 20 at D = 64) or at D = 128 in up to 4 waves whose last is at
    least 7/8 full; at D <= 64 past 4k tokens in one wave too, with splits for about 8 per SM up
    to 8 B*Hkv programs per SM and one split above (``_batch_lean_splits``).
    Otherwise splits fill about 4 programs per SM when B*Hkv programs cannot, down to one
    64-token tile per split; at large batch with long K/V, a few splits of narrower tiles
    (block_n=32) still help (shorter dependent chains, better tail balance); at large batch
    with shorter K/V, splits only where they fill a mostly empty last wave
    (``splits_for_full_waves``). fp8 caches: lean programs with 5 stages (two K/V
    tiles in flight per program), splits for about 8 per SM below 4 B*Hkv programs per SM (16
    rows or fewer, D <= 128) and for about 46 per SM from 4 B*Hkv programs per SM, at most one a
    1k tokens, up to 4k tokens fewer where that count leaves a mostly empty last wave
    (``_fp8_wave_splits``). The ~8 per SM
    of both lean rules are capped at what fits an SM at once (``resident_programs_per_sm``:
    measured registers and shared memory per config, with this GPU's shared memory: 7 of the
    16-bit lean programs at D = 128 on GPUs with 100 KiB a SM), so they never spill a few
    programs into a second wave. 17-32 rows with a 16-bit cache (D <= 128): the split count of
    the rules above, on lean tiles with 5 stages where a split walks more than 4 of them
    (``_wide_rows_lean``).
    """
    rows = shape.rows_per_kv_head
    block_m = min(64, max(DOT_MIN_BLOCK_M, next_power_of_2(rows)))
    block_n = 64 if shape.head_dim <= 128 else 32
    m_blocks = -(-rows // block_m)
    base_programs = shape.batch_size * shape.num_kv_heads * m_blocks
    target_programs = 4 * max(1, num_sms)
    num_kv_splits = 1
    num_warps = 4
    num_stages = 2
    fp8 = shape.kv_dtype == torch.float8_e4m3fn
    if (base_programs < target_programs and fp8 and block_m == DOT_MIN_BLOCK_M
            and shape.head_dim <= 128):
        # fp8 caches with few programs: lean programs with two K/V tiles in flight, splits for
        # about 8 per SM (12 fit an H200 SM at 5 stages, so rounding never spills into a second
        # wave; ``_lean_splits`` takes fewer where fewer fit). H200, same run, 20 shapes at
        # B*Hkv < 4 per SM: 0.66-0.91x the time of 64-token tiles at 4 warps (the previous rule;
        # B=8 L=8k 40.4 vs 57.0 us, B=1 L=128k 75.8 vs 110.1), within 2.5% of the best of 4, 8
        # and 12 per SM and 2, 3 and 5 stages at 16 of them and within 10% at all
        # (reports/nvidia-h200/2026-11-29/ab_fp8_small_batch_rule.txt; docs/perf-notes.md,
        # "Tenth lease").
        block_n, num_warps, num_stages = max(16, 2048 // shape.block_d), 1, 5
        num_kv_splits = _lean_splits(shape, block_n, num_stages, base_programs, num_sms,
                                     shared_memory_per_sm)
    elif (base_programs < LEAN_MAX_PROGRAMS_PER_SM * max(1, num_sms) and block_m == DOT_MIN_BLOCK_M
            and shape.head_dim <= 128 and not fp8):
        # Lean programs: the best tile family in 8 of 9 shapes at B*Hkv <= 256 in one H200 sweep
        # (B=1 L=8k 14.3 vs 15.9 us for 64-token tiles at 4 warps, B=8 L=8k 71.6 vs 72.2 us,
        # B=32 L=1k 39.2 vs 41.0 us; reports/nvidia-h200/2026-11-29/merge_fused_ab.txt, separate
        # merge column).
        # 16 tokens at D = 128: 4 KiB K/V tiles (D = 65-127 pad to 128; D <= 64: below).
        # 5-16 rows: 5 stages and half the programs (H200, same run, 14 shapes off the tuning
        # grid: 0.87-1.00x the time of 3 stages at ~8 per SM where G >= 7, equal at G=4;
        # reports/nvidia-h200/2026-11-30/ab_lean_stages_splits.txt, docs/perf-notes.md,
        # "Fourteenth lease").
        # D <= 64: 16-token (2 KiB) tiles, 5 stages, ~8 per SM at every row count (H200, same
        # runs, 14 shapes off the tuning grid: 0.89-0.95x the time of the previous rule's 32-token
        # tiles at 2-4 rows, 0.98-1.00x at 7-8 rows; reports/nvidia-h200/2026-11-30/
        # ab_d64_lean.txt, ab_rule_validation.txt; docs/perf-notes.md, "Seventeenth lease").
        small_head = shape.block_d <= LEAN_SMALL_HEAD_DIM
        deep = shape.rows_per_kv_head >= LEAN_DEEP_MIN_ROWS and not small_head
        block_n = 16 if small_head else max(16, 2048 // shape.block_d)
        num_warps, num_stages = 1, 5 if deep or small_head else 3
        num_kv_splits = _lean_splits(
            shape, block_n, num_stages, base_programs, num_sms, shared_memory_per_sm,
            LEAN_DEEP_PROGRAMS_PER_SM if deep else LEAN_PROGRAMS_PER_SM,
        )
    elif (lean_splits := _batch_lean_splits(shape, base_programs, block_m, num_sms,
                                            shared_memory_per_sm)):
        block_n, num_warps, num_stages, num_kv_splits = 16, 1, 5, lean_splits
    elif base_programs < target_programs:
        num_kv_splits = max(1, target_programs // base_programs)
        num_kv_splits = min(num_kv_splits, max(1, shape.max_kv_len // 64))
    elif fp8:
        # fp8 caches: converting K/V costs more instructions per byte than the bf16 path, and
        # many lean programs hide it best: 16-token tiles at D = 128, 1 warp, splits for ~46
        # programs per SM of >= 1k tokens. H200, same run: B=128 L=8k G=4 586 us vs 651 for
        # 64-token tiles at 2 warps (the previous rule), MHA B=32 L=8k 611 vs 639; in the fp8
        # tuning trials this family was fastest at ~46 programs per SM at B*Hkv = 1024 and 2048
        # (docs/perf-notes.md, "Fifth lease"). 5 stages (two K/V tiles in flight instead of
        # one): 1.05-1.17x faster than 3 on all six fp8 target shapes ("Sixth lease").
        block_n, num_warps, num_stages = max(16, 2048 // shape.block_d), 1, 5
        num_kv_splits = max(1, min(round(46 * num_sms / base_programs), shape.max_kv_len // 1024))
        if shape.max_kv_len <= BATCH_LEAN_MAX_KV_LEN:
            num_kv_splits = _fp8_wave_splits(
                shape, KernelConfig(block_n=block_n, block_m=block_m, num_warps=num_warps,
                                    num_stages=num_stages),
                base_programs, num_kv_splits, num_sms, shared_memory_per_sm)
    elif shape.max_kv_len >= 8192:
        block_n = 32
        num_kv_splits = min(8, shape.max_kv_len // 4096)
    else:
        num_kv_splits = splits_for_full_waves(
            shape, KernelConfig(block_n=block_n, block_m=block_m, num_warps=num_warps,
                                num_stages=num_stages), base_programs, num_sms, shared_memory_per_sm)
    if _wide_rows_lean(shape, num_kv_splits):
        block_n, num_warps, num_stages = max(16, 2048 // shape.block_d), 1, 5
    # The rules above count programs per SM: one KV head of one request (B*Hkv = 1, e.g. an MQA
    # model at batch size 1) asks for ~8 * SMs splits, past the config space's bound on a GPU
    # with more than 128 SMs.
    config = KernelConfig(
        block_n=block_n, block_m=block_m, num_kv_splits=min(num_kv_splits, MAX_NUM_KV_SPLITS),
        num_warps=num_warps, num_stages=num_stages,
    )
    return fit_config(config, shape)[0]


def _wide_rows_lean(shape: ProblemShape, num_kv_splits: int) -> bool:
    """Whether a 16-bit cache with 17-32 query rows a KV head (block_m = 32, D <= 128) takes lean
    tiles (1 warp, 16 tokens at D = 128, 5 stages) with the split count already chosen.

    Twice the rows of the lean rule's programs double each tile's math, and 4-warp programs with
    one 64-token tile in flight then fall behind: the G=32 preset (Hq=64, Hkv=2) tuned on the H200
    (reports/nvidia-h200/2026-11-30/tune_g32_trials.csv) ran 1.17-1.65x slower on the previous
    rule at the 9 buckets whose splits walk more than 4 such tiles, where this family was within
    2.5% of the best at 7 (B=8 L=8k 5%, B=128 L=1k 29% off it); at 4 tiles or fewer it was no
    faster.
    """
    if shape.kv_dtype not in (torch.float16, torch.bfloat16) or shape.head_dim > 128:
        return False
    if min(64, max(DOT_MIN_BLOCK_M, next_power_of_2(shape.rows_per_kv_head))) != WIDE_ROWS_BLOCK_M:
        return False
    block_n = max(16, 2048 // shape.block_d)
    tokens_per_split = -(-shape.max_kv_len // num_kv_splits)
    return tokens_per_split > (WIDE_ROWS_MIN_TILES_PER_SPLIT - 1) * block_n


def _batch_lean_splits(shape: ProblemShape, base_programs: int, block_m: int, num_sms: int,
                       shared_memory_per_sm: int) -> int | None:
    """The split count when B*Hkv programs of at least LEAN_MAX_PROGRAMS_PER_SM per SM take lean
    tiles (16 tokens, 1 warp, 5 stages: two K/V tiles in flight) instead of 64-token tiles at 4
    warps; None where they do not. 16-bit cache, up to 16 rows, D <= 128, and: up to
    BATCH_LEAN_MAX_KV_LEN tokens one split where the programs fit one wave (a wave: what fits the
    SMs at once, ``resident_programs_per_sm``; 8 a SM at D = 128 on an H200, 20 at D = 64) or, at
    D > 64, 2 to BATCH_LEAN_MAX_WAVES waves with the last at least BATCH_LEAN_MIN_LAST_WAVE_FILL
    full; at D <= 64 past BATCH_LEAN_MAX_KV_LEN, in one wave too: at most
    BATCH_LEAN_SPLIT_MAX_PROGRAMS_PER_SM per SM with splits for at least LEAN_PROGRAMS_PER_SM
    programs per SM, as many as fit, one split above.

    H200, same runs, shapes off the tuning grid (reports/nvidia-h200/2026-11-30/
    ab_large_lean.txt, ab_rule_validation.txt, ab_wave_lean.txt, ab_d64_batch.txt,
    ab_two_wave_lean.txt, ab_waves.txt; docs/perf-notes.md, "Seventeenth lease" and "Eighteenth
    lease"). K/V up to 4k in one wave (3.9-7.8 programs per SM at D = 128, 9.7-19.4 at D = 64):
    0.87-1.00x the time of the previous rule (64-token tiles, 4 warps) at all 17. D = 128 past one
    wave, by the last wave's fill: 0.88-1.00 full, 0.91-0.99x at 11 of 11 (up to 4 waves); 0.45-0.82
    full, 0.99-1.01x; 0.09-0.33 full, 1.03-1.18x. D = 64 past one wave: 0.99-1.00x at 0.88-1.00
    full, 1.13x at 0.55 (not taken). D = 64 past 4k: 0.77-0.90x with 2-4 splits at 3.0-5.8 per SM
    and 0.83x with one or two at 6.8; one split at 8.7-18.2 per SM, 0.81-0.99x the previous rule
    (32- or 64-token tiles at 4 warps) at all 11 shapes (4.6-32k tokens, G = 2-8, two ragged), and
    1.01x at 31 per SM, past one wave (not taken; reports/nvidia-h200/2026-12-01/
    ab_d64_past_4k_wide.txt, ab_d64_one_wave_validation.txt).
    """
    if (shape.kv_dtype not in (torch.float16, torch.bfloat16) or shape.head_dim > 128
            or block_m != DOT_MIN_BLOCK_M):
        return None
    lean = KernelConfig(block_n=16, block_m=DOT_MIN_BLOCK_M, num_warps=1, num_stages=5)
    wave = resident_programs_per_sm(lean, shape, shared_memory_per_sm) * max(1, num_sms)
    if shape.block_d <= LEAN_SMALL_HEAD_DIM:
        if base_programs > wave:
            return None
        if (shape.max_kv_len <= BATCH_LEAN_MAX_KV_LEN
                or base_programs > BATCH_LEAN_SPLIT_MAX_PROGRAMS_PER_SM * max(1, num_sms)):
            return 1
        splits = -(-LEAN_PROGRAMS_PER_SM * max(1, num_sms) // base_programs)
        split_wave = resident_programs_per_sm(lean, shape, shared_memory_per_sm,
                                              one_split=False) * max(1, num_sms)
        return max(1, min(splits, split_wave // base_programs))  # all resident at once
    if shape.max_kv_len > BATCH_LEAN_MAX_KV_LEN:
        return None
    waves = base_programs / wave
    if waves <= 1 or (waves <= BATCH_LEAN_MAX_WAVES
                      and waves - (math.ceil(waves) - 1) >= BATCH_LEAN_MIN_LAST_WAVE_FILL):
        return 1
    return None


def _fp8_wave_splits(shape: ProblemShape, config: KernelConfig, base_programs: int, most: int,
                     num_sms: int, shared_memory_per_sm: int) -> int:
    """Splits for fp8 lean programs of K/V up to BATCH_LEAN_MAX_KV_LEN tokens: ``most`` (the
    ~46-a-SM rule's count, capped at one split a 1k tokens) unless its programs pass one wave
    (``resident_programs_per_sm`` x SMs) with a last wave under FP8_WAVE_SATURATION full; then the
    count in [1, most] of lowest cost in this model: a wave takes as long as a full one down to
    FP8_WAVE_SATURATION of it (fewer programs do not keep DRAM busy), so S splits cost (waves S
    starts, each counted at least that full) / (S * base_programs / wave) of the ideal, and every
    split past the first FP8_SPLIT_COST more (its partials and the merge); ties go to fewer splits.

    H200, three same-run A/Bs (reports/nvidia-h200/2026-12-01/ab_fp8_split_cap.txt,
    ab_fp8_wave_rule_validation.txt, and ab_fp8_wave_rule_check.txt on shapes neither used;
    scripts/ab_fp8_split_cap.sh, ab_wave_rules_validation.sh): at
    the 16 shapes where the model changes the rule's count (one split at 0.57-0.89 of a wave, or 2
    instead of 3 splits, against 2-4 splits at 1.13-3.56 waves; 4 ragged) it ran 0.78-1.03x the
    rule's time, geomean 0.91, 15 of 16 at or under 1.006x (B=150 L=4k 1.03x, where 2-3 splits ran
    0.97x). Where the rule's waves were full enough, fewer splits gained at equal lengths
    (0.92-0.99x) but lost at ragged ones (1.03-1.05x), so those keep the rule.
    """
    def waves(splits: int) -> float:
        resident = resident_programs_per_sm(dataclasses.replace(config, num_kv_splits=splits), shape,
                                            shared_memory_per_sm)
        return base_programs * splits / (resident * max(1, num_sms))

    def last_wave(w: float) -> float:
        return w - math.ceil(w) + 1

    w = waves(most)
    if w <= 1 or last_wave(w) >= FP8_WAVE_SATURATION:
        return most
    best, best_cost = most, float("inf")
    for splits in range(1, most + 1):
        w = waves(splits)
        started = math.ceil(w) - 1 + max(last_wave(w), FP8_WAVE_SATURATION)
        cost = started / w * (1.0 + FP8_SPLIT_COST * (splits - 1))
        if cost < best_cost - 1e-9:
            best, best_cost = splits, cost
    return best


def _lean_splits(shape: ProblemShape, block_n: int, num_stages: int, base_programs: int,
                 num_sms: int, shared_memory_per_sm: int,
                 programs_per_sm: int = LEAN_PROGRAMS_PER_SM) -> int:
    """Splits for about ``programs_per_sm`` lean (1-warp) programs per SM; where fewer fit an SM
    at once, as many as fit (rounded down, so no program waits for a second wave)."""
    lean = KernelConfig(block_n=block_n, block_m=DOT_MIN_BLOCK_M, num_warps=1, num_stages=num_stages)
    # The split kernel's count (registers differ at one split, which these rules rarely pick).
    resident = resident_programs_per_sm(lean, shape, shared_memory_per_sm, one_split=False)
    if resident >= programs_per_sm:
        return max(1, round(programs_per_sm * max(1, num_sms) / base_programs))
    return max(1, resident * max(1, num_sms) // base_programs)


_RESOURCES_CSV = Path(__file__).with_name("data") / "split_kernel_resources.csv"


@functools.lru_cache(maxsize=1)
def _resource_table() -> dict[tuple[int, ...], list[tuple[int, int, int]]]:
    """data/split_kernel_resources.csv as {(kv_bytes, block_d, block_m, block_n, num_warps,
    num_stages, direct_out): [(group_size, registers, shared_bytes), ...] by group_size}; empty,
    with one warning, if the file cannot be read (every config then takes the conservative
    estimate of ``split_kernel_resources``)."""
    table: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}
    try:
        with open(_RESOURCES_CSV) as f:
            lines = [line for line in f if line.strip() and not line.startswith("#")]
        header = lines[0].strip().split(",")
        for line in lines[1:]:
            row = dict(zip(header, map(int, line.split(","))))
            key = (row["kv_bytes"], row["block_d"], row["block_m"], row["block_n"], row["num_warps"],
                   row["num_stages"], row["direct_out"])
            table.setdefault(key, []).append((row["group_size"], row["registers"], row["shared_bytes"]))
        if not table:
            raise ValueError("no rows")
    except (OSError, IndexError, KeyError, ValueError) as exc:
        warnings.warn(f"tsdecode: cannot read {_RESOURCES_CSV} ({type(exc).__name__}: {exc}); "
                      "residency per SM falls back to a conservative estimate", RuntimeWarning,
                      stacklevel=2)
        return {}
    for measured in table.values():
        measured.sort()
    return table


def split_kernel_resources(config: KernelConfig, shape: ProblemShape) -> tuple[int, int]:
    """(registers a thread, shared memory bytes) of the split kernel for ``config`` on ``shape``.

    Measured (``_resource_table``) at K/V of this byte width, block_d (D <= 64 counts as 64: no
    fewer registers than it needs), this block_m, block_n, warps and one split (the kernel that
    writes the output directly) or more, and the nearest measured G: the smallest at or above the
    shape's query rows per KV head, else the largest (rows 1-16 measured at G = 1, 4, 8, 16; 32 and
    64 rows at G = 32, 64). 4 stages take the 3-stage entry and 1 stage the 2-stage one where
    unmeasured (their kernels match those closely). A config outside the table (block_n = 256,
    block_m < 16 or > 64) takes 255 registers and 4 KiB plus 6 bytes a row and head-dim element
    (a bf16 Q tile and an fp32 one) plus its K/V buffers (one K and one V tile a buffer; one buffer
    below 5 stages, two from 5) of shared memory: at least what every measured config uses
    (1.03-8x), so it fits no more programs than it can.
    """
    table = _resource_table()
    block_d = max(64, shape.block_d)
    direct = int(config.num_kv_splits == 1)
    stand_in = {4: 3, 1: 2}.get(config.num_stages)
    for stages in (config.num_stages,) + ((stand_in,) if stand_in else ()):
        measured = table.get((shape.kv_dtype.itemsize, block_d, config.block_m, config.block_n,
                              config.num_warps, stages, direct))
        if measured:
            rows = shape.rows_per_kv_head
            _, registers, shared = next((m for m in measured if m[0] >= rows), measured[-1])
            return registers, shared
    buffers = 2 if config.num_stages >= 5 else 1
    shared = (4096 + max(16, config.block_m) * block_d * 6
              + buffers * 2 * config.block_n * block_d * shape.kv_dtype.itemsize)
    return 255, shared


def programs_per_sm_by_registers(registers: int, num_warps: int) -> int:
    """Programs of ``num_warps`` warps at ``registers`` a thread that one SM's register files hold
    (per-warp allocation within each sub-partition, as CUDA's occupancy calculator counts)."""
    per_warp = -(-max(1, registers) * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    warps = REGISTER_SUB_PARTITIONS * ((REGISTERS_PER_SM // REGISTER_SUB_PARTITIONS) // per_warp)
    return min(warps, MAX_WARPS_PER_SM) // num_warps


def resident_programs_per_sm(
    config: KernelConfig, shape: ProblemShape, shared_memory_per_sm: int = SHARED_MEMORY_PER_SM,
    one_split: bool | None = None,
) -> int:
    """Split-kernel programs of ``config`` that fit one SM at once (a model, not a query; at
    least 1): the fewest of the register files' count (``programs_per_sm_by_registers``), the
    shared memory's (``shared_memory_per_sm`` over the program's shared memory plus 1 KiB
    reserved) and MAX_PROGRAMS_PER_SM, with the registers and shared memory of
    ``split_kernel_resources``. The count depends on num_kv_splits only through one split (the
    direct-output kernel) or more; ``one_split`` picks that kernel instead of config's own count.
    """
    if one_split is None:
        one_split = config.num_kv_splits == 1
    return _resident_programs_per_sm(
        shape.kv_dtype.itemsize, max(64, shape.block_d), shape.rows_per_kv_head, config.block_m,
        config.block_n, config.num_warps, config.num_stages, one_split, shared_memory_per_sm)


@functools.lru_cache(maxsize=4096)
def _resident_programs_per_sm(kv_bytes: int, block_d: int, rows: int, block_m: int, block_n: int,
                              num_warps: int, num_stages: int, one_split: bool,
                              shared_memory_per_sm: int) -> int:
    """``resident_programs_per_sm`` on the values it depends on (cached: plan() asks often)."""
    config = KernelConfig(block_n=block_n, block_m=block_m, num_kv_splits=1 if one_split else 2,
                          num_warps=num_warps, num_stages=num_stages)
    kv_dtype = torch.float8_e4m3fn if kv_bytes == 1 else torch.bfloat16
    shape = ProblemShape(batch_size=1, num_qo_heads=rows, num_kv_heads=1, head_dim=block_d,
                         page_size=16, max_kv_len=block_n, kv_dtype=kv_dtype)
    registers, shared = split_kernel_resources(config, shape)
    by_shared = shared_memory_per_sm // (shared + SHARED_MEMORY_RESERVED_PER_PROGRAM)
    return max(1, min(programs_per_sm_by_registers(registers, num_warps), by_shared,
                      MAX_PROGRAMS_PER_SM))


def splits_for_full_waves(shape: ProblemShape, config: KernelConfig, base_programs: int, num_sms: int,
                          shared_memory_per_sm: int = SHARED_MEMORY_PER_SM) -> int:
    """Splits that avoid a mostly empty last wave when B*Hkv programs already fill the GPU.

    Waves = base_programs * S / (resident programs per SM * SMs). S grows from 1 until the last
    wave is at least MIN_LAST_WAVE_FILL full or there are FULL_WAVES waves, but each split keeps
    at least MULTIWAVE_MIN_TILES_PER_SPLIT tiles of the mean request (mean = max_kv_len /
    kv_len_spread). H200, 64-token tiles at 4 warps (5 a SM): B=96 ragged L <= 3000 (768
    programs, 1.16 waves) 236 us at S=1, 219 at S=2, 214 at S=4; B=256 L=4k 1009 us at S=1, 987
    at S=2; at L=1k (16 tiles) S=2 was slower than S=1 (B=128: 149 vs 138 us), hence the tile
    floor (docs/perf-notes.md).
    """
    waves_of = {  # programs in one wave: one split (direct output) and more
        one: resident_programs_per_sm(config, shape, shared_memory_per_sm, one_split=one)
        * max(1, num_sms) for one in (True, False)}
    mean_tiles = shape.max_kv_len / max(1.0, shape.kv_len_spread) / config.block_n
    max_splits = max(1, int(mean_tiles // MULTIWAVE_MIN_TILES_PER_SPLIT))
    splits = 1
    while splits < max_splits:
        waves = base_programs * splits / waves_of[splits == 1]
        if waves >= FULL_WAVES or waves - (math.ceil(waves) - 1) >= MIN_LAST_WAVE_FILL:
            break
        splits += 1
    return splits


def scale_splits_to_batch(
    config: KernelConfig, tuned_batch_size: int, batch_size: int
) -> tuple[KernelConfig, tuple[str, ...]]:
    """Keep the program count of a config tuned at another batch size.

    The split count that wins fills the GPU with B * Hkv * num_kv_splits programs, so an entry
    tuned for batch size tuned_batch_size scales its splits by tuned_batch_size / batch_size
    (measured on an H200: B=16 with the B=32 entry's 2 splits ran 168 us, with 4 splits 135 us).
    """
    if tuned_batch_size == batch_size:
        return config, ()
    splits = max(1, min(MAX_NUM_KV_SPLITS, round(config.num_kv_splits * tuned_batch_size / batch_size)))
    if splits == config.num_kv_splits:
        return config, ()
    note = (f"num_kv_splits {config.num_kv_splits} -> {splits}: entry tuned at batch size "
            f"{tuned_batch_size}, scaled to keep its program count at batch size {batch_size}")
    return dataclasses.replace(config, num_kv_splits=splits), (note,)


def scale_splits_to_raggedness(
    config: KernelConfig, shape: ProblemShape, num_sms: int,
    shared_memory_per_sm: int = SHARED_MEMORY_PER_SM,
) -> tuple[KernelConfig, tuple[str, ...]]:
    """More splits for a ragged batch (fixed lengths, longest / mean = shape.kv_len_spread > 1.1).

    One wave (every program resident at once; ``resident_programs_per_sm`` of this config with
    more than one split): the
    kernel lasts as long as the longest request's split (longest / S tokens) while the bytes are
    those of the mean length, so num_kv_splits grows by the spread, at most 4x, while the programs
    stay within one wave, and not below RAGGED_MIN_TILES_PER_SPLIT tiles a split (H200, B=2 L=3k
    ragged: 11.4 us at 66 splits of ~3 tiles, 12.7 us at 88). Tables are tuned on equal lengths;
    H200 held-out ragged shapes (lengths uniform in [L/2, L]) ran best with ~1.3x the
    equal-length split count (docs/perf-notes.md). Programs that would pass one wave but make
    fewer than FULL_WAVES waves step to FULL_WAVES waves, where finishing programs make room for
    the rest, if each split keeps RAGGED_MULTIWAVE_MIN_TOKENS_PER_SPLIT tokens of the mean request
    (H200, B=64 L=16k ragged, 64-token tiles at 4 warps, one run: 792.6 us at 1 split (0.78
    waves), 761.4 at 4 (3.1), 751.6 at 6 (4.7); 2 splits (1.55 waves) were slower than 1 in another
    run; one split of 16-token tiles at B=200 L=1.5k ragged 0.96x the step's 4 splits); else,
    and from FULL_WAVES waves on, no change.
    """
    factor = min(shape.kv_len_spread, MAX_RAGGED_SPLIT_FACTOR)
    if factor < 1.1:
        return config, ()
    base = shape.batch_size * shape.num_kv_heads * -(-shape.rows_per_kv_head // config.block_m)
    wave = resident_programs_per_sm(config, shape, shared_memory_per_sm,
                                    one_split=False) * max(1, num_sms)
    programs = base * config.num_kv_splits
    if programs * factor <= wave:
        # Splits of fewer than RAGGED_MIN_TILES_PER_SPLIT tiles are dominated by each program's
        # fixed cost: never shorten the longest request's splits below that.
        tiles = num_kv_tiles(shape.max_kv_len, config.block_n)
        splits = min(MAX_NUM_KV_SPLITS, round(config.num_kv_splits * factor),
                     max(config.num_kv_splits, tiles // RAGGED_MIN_TILES_PER_SPLIT))
        why = ("in one wave of programs" if base * splits <= wave else
               f"the spread rounded: {base * splits / wave:.2f} waves of {wave} programs")
    elif programs < FULL_WAVES * wave:
        mean_tokens = shape.max_kv_len / shape.kv_len_spread
        splits = min(MAX_NUM_KV_SPLITS, -(-FULL_WAVES * wave // base))
        if mean_tokens / splits < RAGGED_MULTIWAVE_MIN_TOKENS_PER_SPLIT:
            return config, ()
        own_wave = resident_programs_per_sm(config, shape, shared_memory_per_sm) * max(1, num_sms)
        why = (f"in {base * splits / wave:.1f} waves of {wave} programs instead of "
               f"{programs / own_wave:.2f} of {own_wave}")
    else:
        return config, ()
    if splits == config.num_kv_splits:
        return config, ()
    note = (f"num_kv_splits {config.num_kv_splits} -> {splits}: ragged lengths (longest / mean "
            f"= {shape.kv_len_spread:.2f}) {why}")
    return dataclasses.replace(config, num_kv_splits=splits), (note,)


@dataclass(frozen=True)
class SelectedConfig:
    """The config a plan uses and where it came from.

    source: "explicit" (plan(config=...)), "table" (a tuned table entry) or "heuristic".
    table_path / bucket: the table file and (batch_size, kv_len) bucket for source "table".
    adjustments: what ``fit_config`` changed to make the config valid for this shape, and any
    note on why a table was not used.
    """

    kernel_config: KernelConfig
    source: str
    table_path: str | None = None
    bucket: tuple[int, int] | None = None
    adjustments: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = self.source
        if self.table_path:
            where += f" {self.table_path} bucket(batch_size, kv_len)={self.bucket}"
        extra = f"; adjusted: {'; '.join(self.adjustments)}" if self.adjustments else ""
        return f"{self.kernel_config} from {where}{extra}"


def device_num_sms(device: torch.device) -> int:
    """SM count of a CUDA device; a nominal 132 (H100/H200) for CPU/interpreter runs."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def device_shared_memory_per_sm(device: torch.device) -> int:
    """Shared memory per SM in bytes of a CUDA device (H100/H200 233472, A100 167936, L40S and
    RTX 4090 102400); SHARED_MEMORY_PER_SM (H100/H200) for CPU/interpreter runs."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "shared_memory_per_multiprocessor", SHARED_MEMORY_PER_SM))
    return SHARED_MEMORY_PER_SM


def select_config(
    shape: ProblemShape, device: torch.device, explicit: KernelConfig | None = None
) -> SelectedConfig:
    """Explicit config, else the tuned table entry for this GPU and shape, else the heuristic."""
    if explicit is not None:
        if not isinstance(explicit, KernelConfig):
            raise TypeError(f"config must be a tsdecode.KernelConfig, got {type(explicit).__name__}")
        fitted, changes = fit_config(explicit, shape)
        return SelectedConfig(fitted, "explicit", adjustments=changes)
    from . import tables  # local import: tables imports this module

    return config_from_table_hit(shape, tables.lookup(shape, device), device_num_sms(device),
                                 device_shared_memory_per_sm(device))


def config_from_table_hit(shape: ProblemShape, hit, num_sms: int,
                          shared_memory_per_sm: int = SHARED_MEMORY_PER_SM) -> SelectedConfig:
    """The config a plan uses given ``tables.lookup``'s result (a TableHit, or None).

    A hit's splits are scaled to the batch size it was tuned at and to ragged lengths, then
    fitted; a tuned winner of another bucket is not used (``_is_off_bucket_winner``); no usable
    hit: the heuristic, scaled to ragged lengths and fitted. ``tables.explain`` shows the same.
    """
    from .tables import bucket_of  # local import: tables imports this module

    off_bucket_winner: tuple[str, ...] = ()
    if hit is not None and _is_off_bucket_winner(hit, shape, bucket_of):
        # A tuned winner beat the heuristic at its own bucket's shape only; H200 held-out shapes
        # in other buckets ran 1.04-1.11x slower than their best with such entries and within
        # 1.00-1.03x with the heuristic (docs/perf-notes.md), so off its bucket it is not used.
        off_bucket_winner = hit.notes + (
            f"bucket {hit.bucket} holds a tuned winner ({hit.kernel_config}) that beat the "
            f"heuristic at that bucket only; shapes outside it use the heuristic",
        )
        hit = None
    if hit is not None:
        tuned_batch = (hit.entry.tuned_batch_size if hit.entry and hit.entry.tuned_batch_size
                       else hit.bucket[0])
        config, scaled = scale_splits_to_batch(hit.kernel_config, tuned_batch, shape.batch_size)
        config, ragged = scale_splits_to_raggedness(config, shape, num_sms, shared_memory_per_sm)
        fitted, changes = fit_config(config, shape)
        changes = scaled + ragged + changes
        return SelectedConfig(
            fitted, "table", table_path=hit.table_path, bucket=hit.bucket,
            adjustments=hit.notes + changes,
        )
    config, ragged = scale_splits_to_raggedness(
        heuristic_config(shape, num_sms, shared_memory_per_sm), shape, num_sms, shared_memory_per_sm)
    fitted, changes = fit_config(config, shape)
    return SelectedConfig(fitted, "heuristic", adjustments=off_bucket_winner + ragged + changes)


def _is_off_bucket_winner(hit, shape: ProblemShape, bucket_of) -> bool:
    """The table hit is another bucket's entry whose config differs from the heuristic default
    it was measured against."""
    if hit.bucket == bucket_of(shape.batch_size, shape.max_kv_len):
        return False
    return hit.entry is not None and hit.entry.kernel_config != hit.entry.default_config
