#!/usr/bin/env bash
# Tune presets into a copy of this GPU's shipped table, in one device call:
#   PRESETS="qwen2.5-7b:170 llama3-70b-tp8:200" scripts/tune_presets.sh
# Each entry is preset:time-budget-seconds (TRIALS trials a bucket, default 64). The merged table
# ($OUT/tuned/<GPU>.json), each preset's log and its trials CSV (cumulative over the presets) land
# in $OUT; copy the table back to tuned_configs/ to ship it. Without a shipped table for this GPU
# the presets start a new one.
set -u
case "${1:-}" in
  -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
cd "$(dirname "$0")/.."
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)" 2>/dev/null \
  || { echo "tune_presets.sh needs a CUDA GPU (torch finds none here)" >&2; exit 2; }
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
. scripts/device_env.sh
table=$(python3 -c "import torch; from tsdecode.config.tables import table_filename; print(table_filename(torch.cuda.get_device_name()))") || exit 2
stem=${table%.json}
rc=0
dir="$OUT/tuned"; mkdir -p "$dir"
if [ -f "tuned_configs/$table" ]; then
  cp "tuned_configs/$table" "$dir/"   # each preset's buckets are merged into the shipped table
fi
for item in ${PRESETS:?set PRESETS to "preset:budget ..."}; do
  name=${item%%:*} budget=${item#*:}
  timeout $((budget + 100)) python3 -m tuner --preset "$name" --trials "${TRIALS:-64}" --time-budget "$budget" \
    --no-progress --out "$dir" > "$OUT/tune_$name.txt" 2>&1 || rc=1
  grep -A20 "^bucket (B,L)" "$OUT/tune_$name.txt" | tail -20
  cp "$dir/${stem}_trials.csv" "$OUT/tune_${name}_trials.csv" 2>/dev/null
done
# The study, its lock and the raw trial log stay on the device; the table and CSVs come back.
rm -f "$dir/${stem}_study.journal"*  "$dir/${stem}_trials.jsonl" "$dir/$table.lock"
exit $rc
