"""The search space of one bucket: KernelConfig's fields narrowed to values that can be valid for
the shape, with num_kv_splits from powers of two, 3 x powers of two, whole SM waves and the
heuristic default's own value; and the configs a new study measures first."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from tsdecode.config.residency import MAX_PROGRAMS_PER_SM
from tsdecode.config.space import (
    BLOCK_M_CHOICES, BLOCK_N_CHOICES, DOT_MIN_BLOCK_M, MAX_NUM_KV_SPLITS, NUM_STAGES_CHOICES, NUM_WARPS_CHOICES,
    KernelConfig, ProblemShape, next_power_of_2, num_kv_tiles,
)

SPACE_FIELDS = ("block_n", "block_m", "num_kv_splits", "num_warps", "num_stages")
# More splits are not searched past two waves of the most programs an SM can hold.
SEARCH_MAX_PROGRAMS_PER_SM = 2 * MAX_PROGRAMS_PER_SM
# Programs per SM whose split counts are always candidates (whole waves).
WAVES = (1, 2, 3, 4, 6, 8)
# block_m below DOT_MIN_BLOCK_M (FMA reductions) is searched by default only at this many query
# rows a KV head or fewer: above it tl.dot tiles win (docs/tuning.md). --block-m still searches
# them anywhere.
FMA_MAX_ROWS = 2
# The lean family's split counts seeded whatever the default's regime: about 8 programs per SM
# (16-bit caches) and 46 (fp8 caches), where tuned lean winners cluster.
LEAN_SEED_PROGRAMS_PER_SM = (8, 46)


@dataclass(frozen=True)
class SpaceLimits:
    """Restrictions of the config space from the command line (None: automatic)."""

    block_n: tuple[int, ...] = BLOCK_N_CHOICES
    block_m: tuple[int, ...] | None = None  # None: BLOCK_M_CHOICES, FMA ones up to FMA_MAX_ROWS
    num_kv_splits: tuple[int, ...] | None = None
    num_warps: tuple[int, ...] = NUM_WARPS_CHOICES
    num_stages: tuple[int, ...] = NUM_STAGES_CHOICES

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if v is not None else None) for k, v in asdict(self).items()}


def config_text(config: KernelConfig | None) -> str:
    """A config by its field names, ``block_n=64 block_m=16 num_kv_splits=8 num_warps=4
    num_stages=2``: how the tuner prints, logs and keys configs."""
    if config is None:
        return "-"
    return " ".join(f"{k}={v}" for k, v in config.to_dict().items())


def base_programs(shape: ProblemShape, block_m: int) -> int:
    """Split-kernel programs at one split: B * Hkv * row blocks."""
    return shape.batch_size * shape.num_kv_heads * -(-shape.rows_per_kv_head // block_m)


def split_choices(shape: ProblemShape, sm_count: int, block_n_choices: Sequence[int],
                  block_m_choices: Sequence[int]) -> list[int]:
    """Candidate num_kv_splits: 1, powers of two and 3 x powers of two, and the counts that fill
    whole WAVES, up to the K/V tile count at the smallest block_n and SEARCH_MAX_PROGRAMS_PER_SM."""
    tiles = num_kv_tiles(shape.max_kv_len, min(block_n_choices))
    base = min(base_programs(shape, bm) for bm in block_m_choices)
    cap = max(1, min(MAX_NUM_KV_SPLITS, tiles, (SEARCH_MAX_PROGRAMS_PER_SM * sm_count) // base))
    values = {1}
    p = 1
    while p <= cap:
        values.update(v for v in (p, 3 * p) if v <= cap)
        p *= 2
    values.update(s for s in ((w * sm_count) // base for w in WAVES) if 1 <= s <= cap)
    return sorted(values)


def build_space(shape: ProblemShape, sm_count: int, limits: SpaceLimits,
                default: KernelConfig) -> dict[str, tuple[int, ...]]:
    """The categorical choices of each field for this shape (always holding the heuristic
    default's values, so the default is a point of the space)."""
    rows = shape.rows_per_kv_head
    m_cap = max(DOT_MIN_BLOCK_M, next_power_of_2(rows))  # larger block_m is always fitted down
    if limits.block_m is None:
        block_m = [m for m in BLOCK_M_CHOICES if m <= m_cap and (m >= DOT_MIN_BLOCK_M or rows <= FMA_MAX_ROWS)]
    else:
        block_m = [m for m in limits.block_m if m <= m_cap] or [min(limits.block_m)]
    block_n = list(limits.block_n)
    if limits.num_kv_splits is not None:
        tiles = num_kv_tiles(shape.max_kv_len, min(block_n))
        splits = sorted({min(s, tiles) for s in limits.num_kv_splits})
    else:
        splits = split_choices(shape, sm_count, block_n, block_m)
    space = {"block_n": block_n, "block_m": block_m, "num_kv_splits": splits,
             "num_warps": list(limits.num_warps), "num_stages": list(limits.num_stages)}
    return {name: tuple(sorted(set(space[name]) | {getattr(default, name)})) for name in SPACE_FIELDS}


def space_size(space: dict[str, Sequence[int]]) -> int:
    return math.prod(len(v) for v in space.values())


def seed_configs(default: KernelConfig, space: dict[str, Sequence[int]],
                 base: int | None = None, sm_count: int | None = None) -> list[KernelConfig]:
    """The first trials of a new TPE study, in order: the default; the default at 2x, 1/2x and 4x
    its splits (the knob that matters most for decode); the "lean" family (smallest block_n, 1
    warp, 3 stages) at 1x, 2x and 4x the default's splits, and with the space's deepest pipeline
    at 1x and 1/2x; given ``base`` (programs at one split) and ``sm_count``, both lean families at
    LEAN_SEED_PROGRAMS_PER_SM. TPE with a few dozen trials rarely reaches the lean family on its
    own, and it wins often."""
    splits = space["num_kv_splits"]
    s = default.num_kv_splits

    def near(values, target):
        return min(values, key=lambda v: abs(v - target))

    lean = {"block_n": min(space["block_n"]), "num_warps": near(space["num_warps"], 1),
            "num_stages": near(space["num_stages"], 3)}
    deep = {**lean, "num_stages": max(space["num_stages"])}
    changes = [{"num_kv_splits": near(splits, c)} for c in (2 * s, max(1, s // 2), 4 * s)]
    changes += [{**lean, "num_kv_splits": near(splits, c)} for c in (s, 2 * s, 4 * s)]
    changes += [{**deep, "num_kv_splits": near(splits, c)} for c in (s, max(1, s // 2))]
    if base and sm_count:
        for per_sm in LEAN_SEED_PROGRAMS_PER_SM:
            target = near(splits, max(1, round(per_sm * sm_count / base)))
            changes += [{**lean, "num_kv_splits": target}, {**deep, "num_kv_splits": target}]
    out = [default]
    for change in changes:
        config = KernelConfig(**{**default.to_dict(), **change})
        if config not in out:
            out.append(config)
    return out
