#!/usr/bin/env bash
# The split kernel's two product forms (decode.transposed_products): GPU tests with the transposed
# form forced on every dtype, then a same-run A/B of the plan's config in both forms (standard :s,
# transposed :t) on the missed target shapes and a control per dtype. One device call, ~2 min.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
. scripts/device_env.sh
TSDECODE_TRANSPOSED=1 timeout 240 python3 -m pytest tests/test_gpu.py -q -x -n 8 -p no:cacheprovider 2>&1 | tail -6 | tee "$OUT/gpu_tests_transposed.log"
python3 scripts/ab_configs.py --replay-ms 30 --configs heur:s,heur:t \
  --shapes 8:8192:32:8,8:8192:64:8,32:1024:32:8,8:1024:32:32,8:1024:32:8,1:32768:32:8,1:8192:32:8,1:1024:32:8,128:8192:32:8 \
  2>&1 | tee "$OUT/ab_transposed_bf16.txt"
python3 scripts/ab_configs.py --replay-ms 30 --configs heur:s,heur:t \
  --shapes 128:8192:32:8:fp8,256:4096:32:8:fp8,32:8192:32:32:fp8,32:32768:32:32:fp8,128:32768:32:8:fp8 \
  2>&1 | tee "$OUT/ab_transposed_fp8.txt"
