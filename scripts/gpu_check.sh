#!/usr/bin/env bash
# One GPU call: install carried wheels, run the GPU tests, then benchmarks (and optionally tuning
# and a report). Usage: scripts/gpu_check.sh [STEP ...]   steps: tests bench nopdl sweep sweepsel
# fp8bf16 targets heldout ncu occupancy host tune report.
# Default: tests bench. TUNE_ARGS / REPORT_ARGS override the tune / report grids and budgets
# (TUNE_TAG suffixes the tune log's name; TUNE_OUT is the tune's table folder, default $OUT/tuned:
# tuned_configs merges into the shipped table there, so later steps of the same call use it);
# BENCH_ONLY limits the targets step to shapes whose name contains one of its comma-separated
# texts (the heldout step too); SWEEP_ONLY picks the target shapes the sweepsel step sweeps;
# NCU_SHAPES the kv_dtype:B:L shapes the ncu step profiles (Nsight Compute, split pass only),
# NCU_CONFIG an explicit config for them (block_n/splits/warps/stages, e.g. 16/1/1/5); OCC_ARGS the
# occupancy step's arguments (scripts/occupancy.py: e.g. "--head-dims 64,128 --jobs 12").
# Logs and CSVs go to $OUT (the device tool's output folder) or ./gpu_out.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
. scripts/device_env.sh
python3 - <<'PY'
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
PY
steps=${*:-tests bench}
rc=0
for step in $steps; do
  echo "=== $step ==="
  case $step in
    tests)   workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
             python3 -m pytest tests -q -x $workers -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25; rc=$((rc | ${PIPESTATUS[0]})) ;;
    bench)   python3 scripts/bench_decode.py --suite llama --csv "$OUT/bench_llama.csv" 2>&1 | tee "$OUT/bench_llama.log" ;;
    nopdl)   TSDECODE_DISABLE_PDL=1 python3 scripts/bench_decode.py --suite llama --only B1_ 2>&1 | tee "$OUT/bench_nopdl.log" ;;
    sweep)   python3 scripts/bench_decode.py --suite llama --sweep --csv "$OUT/sweep_llama.csv" > "$OUT/sweep_llama.log" 2>&1; grep -v "^#   " "$OUT/sweep_llama.log" ;;
    sweepsel) python3 scripts/bench_decode.py --suite targets --sweep --only "${SWEEP_ONLY:-B8_L8192_H32}" --csv "$OUT/sweepsel.csv" > "$OUT/sweepsel.log" 2>&1; grep -v "^#   " "$OUT/sweepsel.log" ;;
    fp8bf16) TSDECODE_FP8_COMPUTE=bfloat16 python3 scripts/bench_decode.py --suite targets --only float8 2>&1 | tee "$OUT/targets_fp8_bf16.log" ;;
    targets) python3 scripts/bench_decode.py --suite targets ${BENCH_ONLY:+--only "$BENCH_ONLY"} --csv "$OUT/targets.csv" 2>&1 | tee "$OUT/targets.log" ;;
    ncu)     for a in ${NCU_SHAPES:-float8_e4m3fn:128:8192 bfloat16:128:8192}; do
               ncu --clock-control none -k regex:_split_kv_kernel --launch-skip 1 --launch-count 1 \
                 --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
                 --section WarpStateStats --section SchedulerStats --section InstructionStats --section Occupancy \
                 python3 scripts/ncu_probe.py --kv-dtype "${a%%:*}" ${NCU_CONFIG:+--config "$NCU_CONFIG"} "${a#*:}" 2>&1 | tee -a "$OUT/ncu.log" | grep -v "^==PROF==" | tail -150
             done ;;
    occupancy) python3 scripts/occupancy.py ${OCC_ARGS:-} --csv "$OUT/occupancy.csv" 2>&1 | tee "$OUT/occupancy.log" | tail -5 ;;
    host)    python3 scripts/host_overhead.py 2>&1 | tee "$OUT/host_overhead.txt" ;;
    heldout) python3 scripts/bench_decode.py --suite heldout ${BENCH_ONLY:+--only "$BENCH_ONLY"} --csv "$OUT/heldout.csv" 2>&1 | tee "$OUT/heldout.log" | grep -v "^#   " ;;
    tune)    python3 -m tuner ${TUNE_ARGS:---preset llama3-8b} --out "${TUNE_OUT:-$OUT/tuned}" 2>&1 | tee "$OUT/tune${TUNE_TAG:-}.log" | tail -40 ;;
    report)  python3 -m tuner report ${REPORT_ARGS:---preset llama3-8b} --out "$OUT/report" 2>&1 | tee "$OUT/report.log" | tail -30 ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
done
exit $rc
