#!/usr/bin/env bash
# One GPU session's checks: install any wheels in .whl/, then run the named steps in order; logs
# and CSVs go to $OUT if set, else ./gpu_out, and after each step into one archive there,
# results.tgz (a device call brings back only a few files). Usage: scripts/gpu_check.sh [STEP ...]
# (default: tests bench). Steps and the variables they read:
#   tests       the test suite (GPU tests included; 8 workers where pytest-xdist is installed)
#   bench       bench_decode.py --suite llama
#   sweep       the llama suite with a config sweep per shape
#   sweepsel    the targets suite's SWEEP_ONLY shapes (default B8_L8192_H32) with a sweep
#   sweepcfg    sweep_configs.py --configs for each list in SWEEP_CONFIGS (space-separated CSVs,
#               e.g. the committed configs_*.csv), into sweep_<list name>.csv / .log
#   targets     bench_decode.py --suite targets (BENCH_ONLY: comma-separated name filter)
#   heldout     bench_decode.py --suite heldout (BENCH_ONLY too)
#   pdl         ab_configs.py: each PDL_SHAPES shape's pick with and without programmatic
#               dependent launch (default: B=1, L 1k/8k/32k, llama3-8b heads)
#   ncu         Nsight Compute on the split pass of NCU_SHAPES (kv_dtype:B:L, default fp8 and
#               bf16 at B=128 L=8192), NCU_CONFIG an explicit config (block_n/splits/warps/stages)
#   occupancy   occupancy.py with OCC_ARGS (e.g. "--head-dims 64,128 --jobs 12")
#   host        host_overhead.py (HOST_ARGS; with AB_OTHER, that tree's rows beside this one's)
#   ab          ab_trees.py --other "$AB_OTHER" $AB_ARGS: this tree against another source tree
#               (a path on the device machine, e.g. an ignored folder carried with the call)
#   abpatch     ab_trees.py $AB_ARGS with this tree as the other side (A) and a copy of it with
#               the patch AB_PATCH applied as B (e.g. AB_PATCH=reports/candidates/NAME.patch)
#   modeltune   the model's pick against a short tune of a fresh random set: ab_trees.py --write-grid
#               for MODEL_SEED (default 227, 40 shapes), tsdecode-tune of that grid (16 trials a bucket,
#               MODEL_TUNE_BUDGET seconds, default 320), then ab_trees.py --tuned-table with that table,
#               A = AB_OTHER (default this tree); into grid_/tune_/tuned_/ab_model_vs_tune_seed<N>.*
#   transformers  bench_transformers.py (TRANSFORMERS_ARGS)
#   loop        examples/decode_loop.py (LOOP_ARGS)
#   tune        tsdecode-tune with TUNE_ARGS (default --preset llama3-8b) into TUNE_OUT (default
#               $OUT/tuned; TUNE_TAG suffixes its log's name); later steps of the call use the
#               user cache folder's table, not this one, unless TSDECODE_CONFIG_DIR points here
#   report      tsdecode-tune report with REPORT_ARGS (default --preset llama3-8b)
set -u
STEPS="tests bench sweep sweepsel sweepcfg targets heldout pdl ncu occupancy host ab abpatch modeltune transformers loop tune report"
case "${1:-}" in
  -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
for step in "$@"; do
  case " $STEPS " in *" $step "*) ;; *) echo "gpu_check.sh: unknown step '$step'; steps: $STEPS" >&2; exit 2 ;; esac
done
cd "$(dirname "$0")/.."
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)" 2>/dev/null \
  || { echo "gpu_check.sh needs a CUDA GPU (torch finds none here)" >&2; exit 2; }
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
. scripts/device_env.sh
python3 - <<'PY'
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
PY
steps=${*:-tests bench}
# A GPU machine without a package index lacks what this tree imports unless its wheels are carried
# (.whl/, installed by device_env.sh): name what is missing once, before any step fails on it.
missing=$(python3 - $steps <<'PY'
import importlib.util, re, sys, tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
need = [re.split(r"[\[<>=!~ ;]", d)[0] for d in project["dependencies"]]  # the runtime's own
if {"tests", "tune", "modeltune", "report"} & set(sys.argv[1:]):
    need += ["optuna", "filelock", "pandas"]  # the tuner's (its PostgreSQL driver is optional)
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
[ -z "$missing" ] || { echo "gpu_check.sh: not importable here: $missing (copy their wheels into .whl/)" >&2; exit 2; }
rc=0
# A device call returns only a few files: after each step everything in $OUT is packed into one
# archive as well (results.tgz), so a call cut short still brings back the steps it finished.
pack() { (cd "$OUT" && tar czf /tmp/gpu_check_results.tgz --exclude=results.tgz . && mv /tmp/gpu_check_results.tgz results.tgz); }
for step in $steps; do
  echo "=== $step ==="
  case $step in
    tests)   workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
             python3 -m pytest tests -q -x $workers -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25; rc=$((rc | ${PIPESTATUS[0]})) ;;
    bench)   python3 scripts/bench_decode.py --suite llama --csv "$OUT/bench_llama.csv" 2>&1 | tee "$OUT/bench_llama.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    sweep)   python3 scripts/bench_decode.py --suite llama --sweep --csv "$OUT/sweep_llama.csv" > "$OUT/sweep_llama.log" 2>&1 || rc=1; grep -v "^#   " "$OUT/sweep_llama.log" ;;
    sweepsel) python3 scripts/bench_decode.py --suite targets --sweep --only "${SWEEP_ONLY:-B8_L8192_H32}" --csv "$OUT/sweepsel.csv" > "$OUT/sweepsel.log" 2>&1 || rc=1; grep -v "^#   " "$OUT/sweepsel.log" ;;
    sweepcfg) for list in ${SWEEP_CONFIGS:-}; do
               name=$(basename "$list" .csv); name=${name#configs_}
               python3 scripts/sweep_configs.py --configs "$list" --csv "$OUT/sweep_$name.csv" > "$OUT/sweep_$name.log" 2>&1 || rc=1
               tail -3 "$OUT/sweep_$name.log"
             done
             [ -n "${SWEEP_CONFIGS:-}" ] || { echo "the sweepcfg step needs SWEEP_CONFIGS: config lists to time"; rc=2; } ;;
    targets) python3 scripts/bench_decode.py --suite targets ${BENCH_ONLY:+--only "$BENCH_ONLY"} --csv "$OUT/targets.csv" 2>&1 | tee "$OUT/targets.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    heldout) python3 scripts/bench_decode.py --suite heldout ${BENCH_ONLY:+--only "$BENCH_ONLY"} --csv "$OUT/heldout.csv" 2>&1 | tee "$OUT/heldout.log" | grep -v "^#   "; rc=$((rc | ${PIPESTATUS[0]})) ;;
    pdl)     python3 scripts/ab_configs.py --shapes "${PDL_SHAPES:-1:1024:32:8,1:8192:32:8,1:32768:32:8}" --configs heur,heur:p 2>&1 | tee "$OUT/ab_pdl.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    ncu)     for a in ${NCU_SHAPES:-float8_e4m3fn:128:8192 bfloat16:128:8192}; do
               ncu --clock-control none -k regex:_split_kv_kernel --launch-skip 1 --launch-count 1 \
                 --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
                 --section WarpStateStats --section SchedulerStats --section InstructionStats --section Occupancy \
                 python3 scripts/ncu_probe.py --kv-dtype "${a%%:*}" ${NCU_CONFIG:+--config "$NCU_CONFIG"} "${a#*:}" 2>&1 | tee -a "$OUT/ncu.log" | grep -v "^==PROF==" | tail -150
             done ;;
    occupancy) python3 scripts/occupancy.py ${OCC_ARGS:-} --csv "$OUT/occupancy.csv" 2>&1 | tee "$OUT/occupancy.log" | tail -5; rc=$((rc | ${PIPESTATUS[0]})) ;;
    host)    python3 scripts/host_overhead.py ${AB_OTHER:+--other "$AB_OTHER"} ${HOST_ARGS:-} 2>&1 | tee "$OUT/host_overhead.txt"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    ab)      if [ -z "${AB_OTHER:-}" ]; then echo "the ab step needs AB_OTHER: the root of the other source tree"; rc=2
             else python3 scripts/ab_trees.py --other "$AB_OTHER" ${AB_ARGS:-} --csv "$OUT/ab_trees.csv" 2>&1 \
                    | tee "$OUT/ab_trees.log"; rc=$((rc | ${PIPESTATUS[0]})); fi ;;
    abpatch) if [ -z "${AB_PATCH:-}" ]; then echo "the abpatch step needs AB_PATCH: a patch against this tree"; rc=2
             else root=$PWD patch_file=$(realpath "$AB_PATCH") patched=$(mktemp -d)
                  cp -r tsdecode tuner scripts tuned_configs tests examples docs pyproject.toml "$patched"/
                  if (cd "$patched" && { git apply "$patch_file" 2>/dev/null || patch -s -p1 < "$patch_file"; }); then
                    (cd "$patched" && PYTHONPATH="$patched:$PYTHONPATH" python3 scripts/ab_trees.py --other "$root" ${AB_ARGS:-} \
                       --csv "$OUT/ab_patch.csv") 2>&1 | tee "$OUT/ab_patch.log"; rc=$((rc | ${PIPESTATUS[0]}))
                  else echo "AB_PATCH $AB_PATCH does not apply to this tree"; rc=2; fi
             fi ;;
    modeltune) seed=${MODEL_SEED:-227} dir="$OUT/tuned_seed${MODEL_SEED:-227}"
             table=$(python3 -c "import torch; from tsdecode.config.tables import table_filename; print(table_filename(torch.cuda.get_device_name()))")
             python3 scripts/ab_trees.py --count 40 --seed "$seed" --write-grid "$OUT/grid_seed$seed.toml" || rc=1
             python3 -m tuner --grid-file "$OUT/grid_seed$seed.toml" --trials 16 --time-budget "${MODEL_TUNE_BUDGET:-320}" \
               --top-k 2 --retime-rounds 3 --no-progress --out "$dir" > "$OUT/tune_seed$seed.txt" 2>&1 || rc=1
             tail -3 "$OUT/tune_seed$seed.txt"
             rm -f "$dir/${table%.json}_study.journal"* "$dir/${table%.json}_trials.jsonl" "$dir/$table.lock"
             python3 scripts/ab_trees.py --other "${AB_OTHER:-$PWD}" --suites random --seed "$seed" --count 40 \
               --tuned-table "$dir/$table" --csv "$OUT/ab_model_vs_tune_seed$seed.csv" 2>&1 \
               | tee "$OUT/ab_model_vs_tune_seed$seed.log" | grep "^#"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    transformers) python3 scripts/bench_transformers.py --csv "$OUT/transformers.csv" ${TRANSFORMERS_ARGS:-} 2>&1 | tee "$OUT/transformers.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    loop)    python3 examples/decode_loop.py ${LOOP_ARGS:-} 2>&1 | tee "$OUT/decode_loop.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    tune)    python3 -m tuner ${TUNE_ARGS:---preset llama3-8b} --out "${TUNE_OUT:-$OUT/tuned}" 2>&1 | tee "$OUT/tune${TUNE_TAG:-}.log" | tail -40; rc=$((rc | ${PIPESTATUS[0]})) ;;
    report)  python3 -m tuner report ${REPORT_ARGS:---preset llama3-8b} --out "$OUT/report" 2>&1 | tee "$OUT/report.log" | tail -30; rc=$((rc | ${PIPESTATUS[0]})) ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  pack
done
exit $rc
