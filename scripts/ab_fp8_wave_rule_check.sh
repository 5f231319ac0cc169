#!/usr/bin/env bash
# Nineteenth lease's second check of the fp8 wave rule (``configs._fp8_wave_splits``) as shipped,
# one device call (~1 min), on shapes neither earlier A/B used (scripts/ab_fp8_split_cap.sh,
# scripts/ab_wave_rules_validation.sh): where the previous rule's count leaves a last wave under
# 60% full, and one control where it does not; "rule@.prev/configs.py" is the previous revision's
# tsdecode/configs.py with its data/ folder copied to .prev/.
# The previous rule (.prev/ is git-ignored): mkdir -p .prev && git show 83421f1:tsdecode/configs.py
# > .prev/configs.py && cp -r tsdecode/data .prev/ (and carry .prev in the device call).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD  # ab_configs.py needs torch and triton only
PREV=${PREV:-.prev/configs.py}
python3 scripts/ab_configs.py --replay-ms 30 \
  --configs "rule@$PREV,rule,16/1/1/5,16/2/1/5,16/3/1/5" \
  --shapes 120:2048:32:8:fp8,36:2048:32:32:fp8,96:3072:64:8:fp8,176:4096:32:8:fp8,150:4096:32:8:fp8,128:2048:32:8:fp8:f16,120:2048:32:8:r:fp8,176:4096:32:8:r:fp8,200:2048:32:8:fp8 \
  2>&1 | tee "$OUT/ab_fp8_wave_rule_check.txt"
