#!/usr/bin/env bash
# Tenth lease, one device call (~3 min): (1) fp8 caches, ragged lengths in [L/2, L] below 4 B*Hkv
# programs per SM: what the plan picks without a table ("rule": the lean rule's ~8 programs per
# SM scaled by scale_splits_to_raggedness) against fixed 8, 12 and 16 programs per SM (the
# held-out suite's B, L); (2) 16-bit caches at 3-4 B*Hkv programs per SM, where the heuristic
# leaves the lean family for 64-token tiles at 4 warps: the rule against lean configs.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 scripts/ab_configs.py --replay-ms 30 --configs rule,16/p8/1/5,16/p12/1/5,16/p16/1/5 \
  --shapes 1:60000:32:8:r:fp8,2:3000:32:8:r:fp8,4:20000:32:8:r:fp8,16:16384:32:8:r:fp8,24:12000:32:8:r:fp8,48:6000:32:8:r:fp8,8:8192:32:32:r:fp8 \
  2>&1 | tee "$OUT/ab_fp8_ragged_small_batch.txt"
python3 scripts/ab_configs.py --replay-ms 30 --configs rule,16/p8/1/3,16/p8/1/5,16/p12/1/3,32/p8/1/3 \
  --shapes 40:8192:32:8,60:8192:32:8,64:4096:32:8,64:16384:32:8,64:16384:32:8:r,16:2048:32:32,16:8192:32:32 \
  2>&1 | tee "$OUT/ab_bf16_lean_edge.txt"
