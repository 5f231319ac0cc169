#!/usr/bin/env bash
# Nineteenth lease's validation, one device call (~2 min), on shapes off the A/B that set the two
# rule changes (scripts/ab_fp8_split_cap.sh): the committed rule before them ("rule@.prev/...":
# copy that revision's tsdecode/configs.py and data/ to .prev/ first) against today's ("rule") and
# 1-3 splits of the same lean tiles. (1) fp8 caches, K/V up to 4k, from 4 B*Hkv programs a SM
# (``_fp8_wave_splits``), equal and ragged lengths; (2) D=64 past 4k tokens at 8-20 B*Hkv programs
# a SM (one split of lean tiles in one wave, ``_batch_lean_splits``).
# The previous rule (.prev/ is git-ignored): mkdir -p .prev && git show 83421f1:tsdecode/configs.py
# > .prev/configs.py && cp -r tsdecode/data .prev/ (and carry .prev in the device call).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD  # ab_configs.py needs torch and triton only
PREV=${PREV:-.prev/configs.py}
python3 scripts/ab_configs.py --replay-ms 30 \
  --configs "rule@$PREV,rule,16/1/1/5,16/2/1/5,16/3/1/5" \
  --shapes 112:2048:32:8:fp8,144:2048:32:8:fp8,160:3072:32:8:fp8,128:2048:64:8:fp8,48:4096:32:32:fp8,40:2048:32:32:fp8,224:4096:32:8:fp8,128:2048:32:8:r:fp8,192:3072:32:8:r:fp8,48:4096:32:32:r:fp8 \
  2>&1 | tee "$OUT/ab_fp8_wave_rule_validation.txt"
python3 scripts/ab_configs.py --replay-ms 30 \
  --configs "rule@$PREV,rule,16/1/1/5,16/2/1/5" \
  --shapes 144:12288:32:8:d64,224:5120:32:8:d64,300:4608:32:8:d64,100:8192:32:16:d64,160:8192:64:8:d64,200:32768:32:8:d64,256:8192:32:8:r:d64 \
  2>&1 | tee "$OUT/ab_d64_one_wave_validation.txt"
