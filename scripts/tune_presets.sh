#!/usr/bin/env bash
# Tune presets into a copy of the shipped H200 table, one device call:
#   PRESETS="qwen2.5-7b:170 llama3-70b-tp8:200" scripts/tune_presets.sh
# Each entry is preset:time-budget-seconds (64 trials a bucket). The merged table ($OUT/tuned),
# each preset's log and the trials CSV (cumulative over the presets) land in $OUT; copy the
# table back to tuned_configs/ to ship it.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
. scripts/device_env.sh
rc=0
dir="$OUT/tuned"; mkdir -p "$dir"
cp tuned_configs/NVIDIA_H200.json "$dir/"   # each preset's buckets are merged into the shipped table
for item in ${PRESETS:?set PRESETS to "preset:budget ..."}; do
  name=${item%%:*} budget=${item#*:}
  timeout $((budget + 100)) python3 -m tuner --preset "$name" --trials 64 --time-budget "$budget" \
    --no-progress --out "$dir" > "$OUT/tune_$name.txt" 2>&1 || rc=1
  grep -A20 "^bucket (B,L)" "$OUT/tune_$name.txt" | tail -20
  cp "$dir/NVIDIA_H200_trials.csv" "$OUT/tune_${name}_trials.csv" 2>/dev/null
done
rm -f "$dir/NVIDIA_H200_study.db" "$dir/NVIDIA_H200_study.db.tuner.lock" "$dir/NVIDIA_H200_trials.jsonl" "$dir/NVIDIA_H200.json.lock"
exit $rc
