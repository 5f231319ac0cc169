#!/usr/bin/env bash
# Tenth lease's A/B, one device call (~1 min): (1) fp8 caches below 4 B*Hkv programs per SM: the
# heuristic ("rule"; when this ran, the rule it replaced: 64-token tiles at 4 warps), the table
# ("heur") and lean 16-token 1-warp families at 4, 8 and 12 programs per SM with 2, 3 and 5
# stages, on the fp8 preset's small buckets and off-grid shapes; (2) split partials stored in the
# output dtype (":h") against fp32 on the bf16 rows with many splits.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD  # ab_configs.py needs torch and triton only
python3 scripts/ab_configs.py --replay-ms 30 \
  --configs rule,heur,16/p8/1/5,16/p8/1/3,16/p4/1/5,16/p12/1/5,16/p12/1/2 \
  --shapes 1:1024:32:8:fp8,1:8192:32:8:fp8,1:32768:32:8:fp8,1:131072:32:8:fp8,2:4096:32:8:fp8,4:16384:32:8:fp8,8:1024:32:8:fp8,8:8192:32:8:fp8,8:32768:32:8:fp8,16:2048:32:8:fp8,16:16384:32:8:fp8,32:1024:32:8:fp8,32:8192:32:8:fp8,32:32768:32:8:fp8,48:4096:32:8:fp8,64:8192:32:8:fp8,1:8192:32:32:fp8,4:4096:32:32:fp8,8:8192:32:32:fp8,16:2048:32:32:fp8 \
  2>&1 | tee "$OUT/ab_fp8_small_batch_rule.txt"
python3 scripts/ab_configs.py --replay-ms 30 --configs heur,heur:h,16/p16/1/5,16/p16/1/5:h \
  --shapes 1:1024:32:8,1:8192:32:8,1:32768:32:8,8:1024:32:8,8:8192:32:8,32:1024:32:8,8:1024:32:32 \
  2>&1 | tee "$OUT/ab_half_partials.txt"
