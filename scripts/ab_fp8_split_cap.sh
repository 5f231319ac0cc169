#!/usr/bin/env bash
# Nineteenth lease's A/B, one device call (~2 min): (1) fp8 caches from 4 B*Hkv programs per SM
# with K/V of 1-6k tokens, where the ~46-a-SM rule's cap of one split a 1k tokens decides the
# count: the rule against 1-4 splits and ~23 / ~46 programs a SM of the same lean tiles (16
# tokens, 1 warp, 5 stages); (2) D=64 past 4k tokens above 8 B*Hkv programs a SM (Next steps 0
# (b)): the rule against lean tiles with 1-2 splits and 32-token tiles at 4 warps.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD  # ab_configs.py needs torch and triton only
python3 scripts/ab_configs.py --replay-ms 30 \
  --configs rule,16/1/1/5,16/2/1/5,16/3/1/5,16/4/1/5,16/p23/1/5,16/p46/1/5 \
  --shapes 128:1024:32:8:fp8,128:2048:32:8:fp8,256:2048:32:8:fp8,512:2048:32:8:fp8,192:3072:32:8:fp8,128:4096:32:8:fp8,256:6144:32:8:fp8,96:2048:32:8:r:fp8,64:2048:32:32:fp8,32:4096:32:32:fp8,128:3072:32:32:fp8,32:2048:64:4:fp8 \
  2>&1 | tee "$OUT/ab_fp8_split_cap.txt"
python3 scripts/ab_configs.py --replay-ms 30 \
  --configs rule,16/1/1/5,16/2/1/5,16/p8/1/5,32/1/4/2,32/2/4/2 \
  --shapes 192:8192:32:8:d64,256:6144:32:8:d64,160:16384:32:8:d64,512:5120:32:8:d64,192:8192:32:8:r:d64 \
  2>&1 | tee "$OUT/ab_d64_past_4k_wide.txt"
