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
   to keep the schedulers converting).
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
from .family import Occupancy, occupancy, tile_family
from .programs import fit_programs_to_sms
from .space import KernelConfig, ProblemShape, clamp_config
from .splits import num_kv_splits


def heuristic_config(shape: ProblemShape, device: DeviceProperties) -> KernelConfig:
    """The model's config for ``shape`` on ``device``, clamped to the shape (``select_config``
    scales its splits to ragged lengths, then fits it)."""
    occ = occupancy(shape, device)
    config = dataclasses.replace(occ.config, num_kv_splits=num_kv_splits(shape, occ, device))
    return clamp_config(fit_programs_to_sms(config, shape, occ.family, device), shape)[0]


__all__ = ["Occupancy", "tile_family", "occupancy", "num_kv_splits", "heuristic_config"]
