#!/usr/bin/env bash
# Tenth lease: the fp8 small-batch rule (lean, 5 stages, ~8 programs per SM) on shapes it covers
# but was not chosen on (G=8, G=16, D=64, ragged lengths), against the rule it replaced
# (64-token tiles, 4 warps, 2 stages, splits for ~4 programs per SM). One device call, ~1 min.
# When this ran, "rule" was heuristic_config at equal lengths (no ragged scaling) on every row.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
ab() { python3 scripts/ab_configs.py --replay-ms 30 --configs "$2" --shapes "$1" 2>&1 | grep -v "^# copy" ; }
{
  python3 -c "import torch; print('#', torch.cuda.get_device_name(0), torch.__version__)"
  ab 8:8192:64:8:fp8 rule,heur,64/8/4/2
  ab 2:32768:64:8:fp8 rule,heur,64/33/4/2
  ab 4:8192:64:4:fp8 rule,heur,64/33/4/2
  ab 8:16384:32:8:fp8:d64 rule,heur,64/8/4/2
  ab 1:65536:32:8:fp8:d64 rule,heur,64/66/4/2
  ab 16:16384:32:8:r:fp8 rule,heur,64/4/4/2
  ab 8:8192:32:32:r:fp8 rule,heur,64/2/4/2
} | tee "$OUT/ab_fp8_small_batch_general.txt"
