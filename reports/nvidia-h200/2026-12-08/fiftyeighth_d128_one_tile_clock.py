"""Offline (no GPU): why crossing-chain-overlap moved eleven 16-bit D = 128 shapes of its H100 A/B
(../../nvidia-h100-80gb-hbm3/2026-12-07/ab_fiftyseventh_crossing_chain_overlap_moved.csv) to one whole-request tile.
For seven of them (equal lengths as written here): the family's occupancy, step 3's count, the clock's
time of one to five splits (KiB an SM streams), the pick, and what step 4 makes of one split.
Run under each tree: PYTHONPATH=<tree> python fiftyeighth_d128_one_tile_clock.py
"""
import dataclasses, sys, torch
from tsdecode.config.space import ProblemShape, clamp_config
from tsdecode.config import splits as S, family as F, heuristic as Hm
from tsdecode.config.programs import fit_programs_to_sms
from tsdecode.device import DeviceProperties
H200 = DeviceProperties(name="NVIDIA H200", sm_count=132, compute_capability=(9, 0), shared_memory_per_sm=233472)
for b, l, hq, hk, p in [(25,181,12,4,24),(18,155,28,4,12),(15,133,32,4,3),(16,203,40,8,12),(57,326,28,2,2),(58,266,28,2,2),(10,227,128,8,3)]:
    shape = ProblemShape(batch_size=b, max_kv_len=l, num_qo_heads=hq, num_kv_heads=hk, head_dim=128, page_size=p)
    occ = F.occupancy(shape, H200)
    ts = {s: round(S._time(shape, occ, s, 132)/1024, 1) for s in range(1, 6)}
    n = S.num_kv_splits(shape, occ, H200)
    c1 = dataclasses.replace(occ.config, num_kv_splits=1)
    f1 = clamp_config(fit_programs_to_sms(c1, shape, occ.family, H200), shape)[0]
    print(f"B{b} L{l} H{hq}x{hk} P{p}: {occ.family} n{occ.config.block_n} w{occ.config.num_warps} st{occ.config.num_stages} target {occ.target} progs {occ.base_programs}; splits {n}; time KiB {ts}; pick {Hm.heuristic_config(shape, H200)}; one split -> {f1}")
