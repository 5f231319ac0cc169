#!/usr/bin/env bash
# Nineteenth lease's validation of two rule changes, one device call per step (~1 min each), on
# shapes off the A/B that set them (scripts/ab_fp8_split_cap.sh): the committed rule before them
# ("rule@.prev/configs.py") against today's ("rule") and 1-3 splits of the same lean tiles.
# Usage: scripts/ab_wave_rules_validation.sh [STEP ...]   steps (default: all three):
#   fp8       fp8 caches, K/V up to 4k, from 4 B*Hkv programs a SM, equal and ragged lengths
#             (the first form of ``configs._fp8_wave_splits``, before ragged B=192 L=3k and MHA
#             B=48 L=4k made it mend only a mostly empty last wave)
#   d64       D=64 past 4k tokens at 8-20 B*Hkv programs a SM (one split of lean tiles in one wave,
#             ``_batch_lean_splits``)
#   fp8check  the shipped fp8 rule on shapes neither earlier fp8 run used: where the previous
#             rule's count leaves a last wave under 60% full, and one control where it does not
# The previous rule (.prev/ is git-ignored): mkdir -p .prev && git show 83421f1:tsdecode/configs.py
# > .prev/configs.py && cp -r tsdecode/data .prev/ (and carry .prev in the device call).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD  # ab_configs.py needs torch and triton only
PREV=${PREV:-.prev/configs.py}
ab() {  # log name, configs, shapes
  python3 scripts/ab_configs.py --replay-ms 30 --configs "$2" --shapes "$3" 2>&1 | tee "$OUT/$1.txt"
}
for step in ${*:-fp8 d64 fp8check}; do
  case $step in
    fp8) ab ab_fp8_wave_rule_validation "rule@$PREV,rule,16/1/1/5,16/2/1/5,16/3/1/5" \
           112:2048:32:8:fp8,144:2048:32:8:fp8,160:3072:32:8:fp8,128:2048:64:8:fp8,48:4096:32:32:fp8,40:2048:32:32:fp8,224:4096:32:8:fp8,128:2048:32:8:r:fp8,192:3072:32:8:r:fp8,48:4096:32:32:r:fp8 ;;
    d64) ab ab_d64_one_wave_validation "rule@$PREV,rule,16/1/1/5,16/2/1/5" \
           144:12288:32:8:d64,224:5120:32:8:d64,300:4608:32:8:d64,100:8192:32:16:d64,160:8192:64:8:d64,200:32768:32:8:d64,256:8192:32:8:r:d64 ;;
    fp8check) ab ab_fp8_wave_rule_check "rule@$PREV,rule,16/1/1/5,16/2/1/5,16/3/1/5" \
           120:2048:32:8:fp8,36:2048:32:32:fp8,96:3072:64:8:fp8,176:4096:32:8:fp8,150:4096:32:8:fp8,128:2048:32:8:fp8:f16,120:2048:32:8:r:fp8,176:4096:32:8:r:fp8,200:2048:32:8:fp8 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
