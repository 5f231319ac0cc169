"""The config space: ``KernelConfig`` (what may be tuned), ``ProblemShape`` (what selection may
look at), ``clamp_config`` (any config made valid for a shape) and ``fit_config`` (the config that
runs: clamped, without splits that would get no tile), each with the reasons.

Every config that passes ``KernelConfig.validate`` computes the same answer (up to
floating-point reassociation); the tuner searches exactly these sets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch

BLOCK_N_CHOICES = (16, 32, 64, 128, 256)  # K/V tokens per tile
BLOCK_M_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)  # packed query rows (G heads x SQ tokens) per program
NUM_WARPS_CHOICES = (1, 2, 4, 8)
NUM_STAGES_CHOICES = (1, 2, 3, 4, 5)
MAX_NUM_KV_SPLITS = 1024
# tl.dot needs 16 rows; below this block_m the kernel reduces with FMAs instead.
DOT_MIN_BLOCK_M = 16
# The FMA path materialises a [block_m, block_n, block_d] product: capped so it stays in registers.
FMA_MAX_TILE_ELEMENTS = 32768
# A shape's mask as a table's class key names it (``ProblemShape.mask_kind``).
MASK_KINDS = ("dense", "causal", "windowed")
# Lengths whose longest / mean reaches this are ragged: their programs end apart.
RAGGED_SPREAD = 1.1


@dataclass(frozen=True)
class KernelConfig:
    """Compile-time parameters of the split-KV decode kernel.

    block_n:       K/V tokens per tile.
    block_m:       packed query rows per program; rows are (query token, query head of one KV
                   head) pairs, G * SQ of them per request and KV head. block_m >= 16 uses tl.dot
                   (rows padded), smaller uses FMA reductions. If block_m < G * SQ the K/V of a
                   head is read ceil(G * SQ / block_m) times.
    num_kv_splits: programs that share one request's K/V sequence (split-KV / flash-decoding);
                   > 1 adds a merge kernel and fp32 partial outputs.
    num_warps:     warps per program.
    num_stages:    software-pipelining depth of the K/V loop: S - 1 tiles loading ahead, each in
                   flight about half the time (the config model counts (S - 1) / 2 tiles).
    """

    block_n: int = 64
    block_m: int = 16
    num_kv_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def validate(self) -> None:
        """Raise ValueError if a field lies outside the config space."""
        for name, choices in (("block_n", BLOCK_N_CHOICES), ("block_m", BLOCK_M_CHOICES),
                              ("num_warps", NUM_WARPS_CHOICES), ("num_stages", NUM_STAGES_CHOICES)):
            value = getattr(self, name)
            if type(value) is not int or value not in choices:
                raise ValueError(f"KernelConfig.{name} must be one of {choices}, got {value!r}")
        if type(self.num_kv_splits) is not int or not 1 <= self.num_kv_splits <= MAX_NUM_KV_SPLITS:
            raise ValueError(f"KernelConfig.num_kv_splits must be an int in [1, {MAX_NUM_KV_SPLITS}], "
                             f"got {self.num_kv_splits!r}")

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


# Every space definition a tuned table depends on (``tables.kernel_source_hash`` covers it).
SPACE = ([f.name for f in dataclasses.fields(KernelConfig)], BLOCK_N_CHOICES, BLOCK_M_CHOICES,
         NUM_WARPS_CHOICES, NUM_STAGES_CHOICES, MAX_NUM_KV_SPLITS, DOT_MIN_BLOCK_M, FMA_MAX_TILE_ELEMENTS)


@dataclass(frozen=True)
class ProblemShape:
    """One planned decode problem: what config selection and the launcher look at (host values,
    fixed at plan time).

    max_kv_len is the longest K/V length the plan covers; max_seq_len_q the query tokens per
    request (fixed SQ, or the packed capacity); window_left the sliding window (-1: none);
    kv_len_spread the longest over the mean K/V length when lengths are fixed at plan time (1.0
    when they change between runs).
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

    @property
    def causal(self) -> bool:
        return self.mask_kind != "dense"

    def programs(self, block_m: int) -> int:
        """Programs of one split: one a request, KV head and block_m packed query rows."""
        return self.batch_size * self.num_kv_heads * -(-self.rows_per_kv_head // block_m)

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


def num_kv_tiles(kv_len: int, block_n: int) -> int:
    return -(-kv_len // block_n)


def dot_block_m(rows: int) -> int:
    """Rows a tl.dot program holds: all G * SQ rows of a KV head, padded to 16, at most 64."""
    return min(64, max(DOT_MIN_BLOCK_M, next_power_of_2(rows)))


# The merge kernel slices the head dim, down to this many columns, until about two of its
# programs an SM share the partials: at small batch one program a query row would pull every
# split's partials through few SMs.
MERGE_MIN_BLOCK_D = 32


def merge_block_d(merge_rows: int, block_d: int, sm_count: int) -> int:
    """Head-dim columns of one merge program, for ``merge_rows`` query rows (tokens x heads)."""
    columns = block_d
    while columns > MERGE_MIN_BLOCK_D and merge_rows * (block_d // columns) < 2 * sm_count:
        columns //= 2
    return columns


# A merge program holds one [splits, columns] fp32 tile of partials in registers, at most this
# many elements (64 registers a thread at 4 warps): more splits take it further dependent passes.
MERGE_BLOCK_ELEMENTS = 8192


def merge_splits_per_pass(merge_rows: int, block_d: int, sm_count: int) -> int:
    """The most splits one merge program reads in one pass: MERGE_BLOCK_ELEMENTS over its columns."""
    return max(MERGE_BLOCK_ELEMENTS // merge_block_d(merge_rows, block_d, sm_count), 1)


def fit_config(config: KernelConfig, shape: ProblemShape) -> tuple[KernelConfig, tuple[str, ...]]:
    """Return the config that runs for ``shape``: ``clamp_config``'s, with num_kv_splits no more
    than the longest request's chains of tiles fill (a request's visible tiles are split
    ceil(tiles / splits) at a time, so more splits would only add programs that get no tile of it
    and partials to merge), and what was changed and why."""
    config, changes = clamp_config(config, shape)
    tiles = shape.max_visible_tiles(config.block_n)
    chain = -(-tiles // config.num_kv_splits)
    filled = -(-tiles // chain)
    if filled == config.num_kv_splits:
        return config, changes
    note = (f"num_kv_splits {config.num_kv_splits} -> {filled}: the longest request's {tiles} tiles "
            f"of {config.block_n}, split {chain} at a time, fill only {filled} splits")
    return dataclasses.replace(config, num_kv_splits=filled), (*changes, note)


def clamp_config(config: KernelConfig, shape: ProblemShape) -> tuple[KernelConfig, tuple[str, ...]]:
    """Return a config valid for ``shape`` close to ``config``, and what was changed and why.

    block_m no larger than the padded row count needs; the FMA path's tile within
    FMA_MAX_TILE_ELEMENTS; num_kv_splits no more than the tiles a program can walk (more splits
    would only add empty programs). The model's own picks are clamped, not fitted: ragged lengths
    scale their splits first (``select.scale_splits_to_raggedness``).
    """
    config.validate()
    changes: list[str] = []
    rows = shape.rows_per_kv_head
    block_m, block_n = config.block_m, config.block_n
    if block_m > DOT_MIN_BLOCK_M and block_m > next_power_of_2(rows):
        new = max(DOT_MIN_BLOCK_M, next_power_of_2(rows))
        changes.append(f"block_m {block_m} -> {new}: only {rows} query rows per KV head")
        block_m = new
    if block_m < DOT_MIN_BLOCK_M:
        while block_m > 1 and block_m * block_n * shape.block_d > FMA_MAX_TILE_ELEMENTS:
            block_m //= 2
        while block_m * block_n * shape.block_d > FMA_MAX_TILE_ELEMENTS and block_n > 16:
            block_n //= 2
        for name, old, new in (("block_m", config.block_m, block_m), ("block_n", config.block_n, block_n)):
            if new != old:
                changes.append(f"{name} {old} -> {new}: FMA tile block_m*block_n*block_d must stay "
                               f"<= {FMA_MAX_TILE_ELEMENTS}")
    max_splits = shape.max_visible_tiles(block_n)
    num_kv_splits = config.num_kv_splits
    if num_kv_splits > max_splits:
        if max_splits < num_kv_tiles(shape.max_kv_len, block_n):
            why = f"window_left {shape.window_left} leaves at most {max_splits} tiles of {block_n} visible"
        else:
            why = f"max_kv_len {shape.max_kv_len} has only {max_splits} tiles of {block_n}"
        changes.append(f"num_kv_splits {num_kv_splits} -> {max_splits}: {why}")
        num_kv_splits = max_splits
    fitted = dataclasses.replace(config, block_m=block_m, block_n=block_n, num_kv_splits=num_kv_splits)
    return fitted, tuple(changes)
