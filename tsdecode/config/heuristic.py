"""The heuristic: a default ``KernelConfig`` for any shape, from the GPU's own properties.

Decode is bandwidth-bound, so the config's job is to keep enough K/V bytes in flight on every SM
without splitting a request's work more than that needs. The model, in four steps, a module each:

1. Tile family (``family.tile_family``): one-warp programs of small tiles ("lean"), four-warp
   programs of ~16 KiB tiles ("wide"), or programs of one short tile each ("short") where the
   whole problem is too small to occupy the GPU otherwise, or its requests' whole tiles keep every
   K/V byte in flight at once.
2. Residency and target (``family.occupancy``): how many of the family's programs fit an SM
   (measured registers and shared memory against this GPU's), and how many an SM needs to keep
   IN_FLIGHT_BYTES_PER_SM of K/V loads in flight (an fp8 cache's one-warp programs: enough warps
   to keep the schedulers converting; a 16-bit cache's one-warp programs of page-crossing tiles
   and equal lengths: at most one a warp scheduler, ``family.capped_at_schedulers``, taken only
   where the uncapped count's programs walk at most ``family.GATHER_MAX_CHAIN_TILES`` tiles and
   step 4 keeps the programs' form under it).
3. Splits (``splits.num_kv_splits``): split each request until its programs reach the target in
   one wave; long requests further, into waves that balance the SMs; each count weighed against
   its merge pass by one clock (``splits._time``).
4. Programs against SMs (``programs.fit_programs_to_sms``): with the count known, the programs'
   tile, warps and stages against the SMs that run them.

Where a shape needs a config this model does not give, that belongs in a tuned table entry.
"""

from __future__ import annotations

import dataclasses

from ..device import DeviceProperties
from .family import GATHER_MAX_CHAIN_TILES, Occupancy, capped_at_schedulers, occupancy, tile_family
from .programs import fit_programs_to_sms
from .space import KernelConfig, ProblemShape, clamp_config
from .splits import num_kv_splits


def heuristic_config(shape: ProblemShape, device: DeviceProperties) -> KernelConfig:
    """The model's config for ``shape`` on ``device``, clamped to the shape (``select_config``
    scales its splits to ragged lengths, then fits it). Where step 2 caps the target at one
    gathering warp a scheduler, the capped count is taken only where the uncapped count's programs
    walk at most GATHER_MAX_CHAIN_TILES tiles (a longer chain's warps wait on their loads, which a
    second warp a scheduler issues past) and step 4 leaves the capped count's programs the form
    (tile, warps, stages) it gives the uncapped count: the cap counts one-warp gathering programs,
    and where step 4 turns either count into programs of another form its reason no longer holds."""
    occ = occupancy(shape, device)
    config = _steps_3_and_4(shape, occ, device)
    capped = capped_at_schedulers(shape, occ)
    if capped is None or _chain_tiles(config, shape) > GATHER_MAX_CHAIN_TILES:
        return config
    fewer = _steps_3_and_4(shape, capped, device)
    return fewer if _form(fewer) == _form(config) else config


def _steps_3_and_4(shape: ProblemShape, occ: Occupancy, device: DeviceProperties) -> KernelConfig:
    """The split count of ``occ``'s target, then its programs against the SMs, clamped to the shape."""
    config = dataclasses.replace(occ.config, num_kv_splits=num_kv_splits(shape, occ, device))
    return clamp_config(fit_programs_to_sms(config, shape, occ.family, device), shape)[0]


def _chain_tiles(config: KernelConfig, shape: ProblemShape) -> int:
    """The tiles the longest request's programs walk under ``config``'s split count."""
    return -(-shape.max_visible_tiles(config.block_n) // config.num_kv_splits)


def _form(config: KernelConfig) -> KernelConfig:
    """A config's programs without their split count."""
    return dataclasses.replace(config, num_kv_splits=1)


__all__ = ["Occupancy", "tile_family", "occupancy", "num_kv_splits", "heuristic_config"]
