#!/usr/bin/env bash
# Multi-GPU tuning measurements (issues 31 and 32): wall time from start to table written, and the
# tables compared bucket by bucket. Each run tunes into a fresh folder (nothing is resumed).
#
#   scripts/multi_gpu_tuning.sh ab1   OUT   one GPU: today's single-process run vs --devices all
#   scripts/multi_gpu_tuning.sh scale OUT   several GPUs: --devices 0 vs --devices all
#   scripts/multi_gpu_tuning.sh hosts OUT   two "hosts": two `tsdecode-tune worker` processes, each on
#                                           half of the GPUs, on one PostgreSQL job on loopback, then
#                                           `export`; compared with scale's --devices all table
#   scripts/multi_gpu_tuning.sh all   OUT   scale, then hosts
#
# Environment: PRESETS (default "--preset llama3-8b --preset qwen2.5-7b"), TRIALS (48), SEED (0),
# EXTRA (more grid or search flags: the hosts step passes them to `create`, which refuses device
# and output flags). hosts needs PostgreSQL's server binaries (initdb, pg_ctl) and the psycopg
# wheels; without the binaries it says so and uses a shared journal file instead, with the
# two workers told apart as two hosts ($TSDECODE_TUNE_HOST).
set -uo pipefail
USAGE="usage: scripts/multi_gpu_tuning.sh ab1|scale|hosts|all OUT"
case "${1:-}" in
  -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  ab1|scale|hosts|all) ;;
  *) echo "multi_gpu_tuning.sh: unknown step '${1:-}'; $USAGE" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
STEP=$1
OUT=${2:?$USAGE}
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)" 2>/dev/null \
  || { echo "multi_gpu_tuning.sh needs CUDA GPUs (torch finds none here)" >&2; exit 2; }
mkdir -p "$OUT"
PRESETS=${PRESETS:---preset llama3-8b --preset qwen2.5-7b}
TRIALS=${TRIALS:-48}
SEED=${SEED:-0}
EXTRA=${EXTRA:-}
GRID="$PRESETS --trials $TRIALS --seed $SEED $EXTRA"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -m pip list 2>/dev/null | grep -E "^(torch|triton|optuna|SQLAlchemy|psycopg|psycopg-binary) " | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee -a "$OUT/versions.txt"

# run NAME CMD...: the command's wall time (s) into $OUT/NAME.wall, its output into $OUT/NAME.log
run() {
  local name=$1; shift
  local t0 t1
  t0=$(date +%s.%N)
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  t1=$(date +%s.%N)
  python3 -c "print(f'{$t1 - $t0:.1f}')" >"$OUT/$name.wall"
  echo "$name: exit $rc, $(cat "$OUT/$name.wall") s (log $OUT/$name.log)" | tee -a "$OUT/summary.txt"
  tail -3 "$OUT/$name.log"
}

# compare A B: the two runs' tables bucket by bucket: the same config, or times within the larger
# of the two re-timings' noise (their trials logs' final records), else a difference.
compare() {
  python3 - "$OUT/$1" "$OUT/$2" <<'EOF' | tee -a "$OUT/summary.txt"
import glob, json, sys
def load(d):
    (table,) = glob.glob(f"{d}/*.json")
    entries = {(k, e["batch_size"], e["kv_len"]): e for k, es in json.load(open(table))["entries"].items() for e in es}
    noise = {}
    for log in glob.glob(f"{d}/*_trials.jsonl"):
        for line in open(log):
            r = json.loads(line)
            if r.get("kind") == "final" and r.get("ok"):
                noise[(r["class_key"], *r["bucket"])] = r.get("noise") or 0.01
    return entries, noise
(a, na), (b, nb) = load(sys.argv[1]), load(sys.argv[2])
same = within = differ = 0
for key in sorted(a.keys() | b.keys()):
    if key not in a or key not in b:
        print(f"  {key}: only in {'A' if key in a else 'B'}"); differ += 1; continue
    ea, eb = a[key], b[key]
    if ea["kernel_config"] == eb["kernel_config"]:
        same += 1; continue
    ratio = ea["time_us"] / eb["time_us"]
    tol = max(na.get(key, 0.01), nb.get(key, 0.01), 0.01)
    ok = abs(ratio - 1) <= tol
    within += ok; differ += not ok
    print(f"  {key[1:]} {key[0][:40]}: A {ea['kernel_config']} {ea['time_us']:.1f} us, B {eb['kernel_config']} "
          f"{eb['time_us']:.1f} us, A/B {ratio:.3f} ({'within' if ok else 'OUTSIDE'} noise {100 * tol:.1f}%)")
print(f"{sys.argv[1]} vs {sys.argv[2]}: {same} buckets the same config, {within} another config within noise, "
      f"{differ} different")
EOF
}

speedup() {
  python3 -c "a, b = float(open('$OUT/$1.wall').read()), float(open('$OUT/$2.wall').read()); \
print(f'$1 {a:.0f} s / $2 {b:.0f} s = {a / b:.2f}x on $NGPU GPUs')" | tee -a "$OUT/summary.txt"
}

ab1() {
  # Today's path (one process, its measuring worker) vs --devices all on the same one GPU.
  run single python3 -m tuner $GRID --no-progress --out "$OUT/single"
  run devices_all python3 -m tuner $GRID --no-progress --out "$OUT/devices_all" --devices all
  run single_again python3 -m tuner $GRID --no-progress --out "$OUT/single_again"
  compare single devices_all
  compare single single_again  # the run-to-run noise of the same command
  speedup single devices_all
}

scale() {
  run devices_0 python3 -m tuner $GRID --out "$OUT/devices_0" --devices 0
  run devices_all python3 -m tuner $GRID --out "$OUT/devices_all" --devices all
  compare devices_0 devices_all
  speedup devices_0 devices_all
}

hosts() {
  local half=$((NGPU / 2)) first second storage job=hosts-$SEED pg=""
  [ "$half" -ge 1 ] || { echo "hosts: needs at least 2 GPUs ($NGPU)"; return 1; }
  first=$(seq -s, 0 $((half - 1))); second=$(seq -s, "$half" $((NGPU - 1)))
  local initdb pg_ctl
  initdb=$(command -v initdb || ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -1)
  pg_ctl=$(command -v pg_ctl || ls /usr/lib/postgresql/*/bin/pg_ctl 2>/dev/null | sort -V | tail -1)
  if [ -n "$initdb" ] && [ -n "$pg_ctl" ] && python3 -c "import psycopg" 2>/dev/null; then
    pg=$(mktemp -d /tmp/tsdecode-pg-XXXXXX)
    local as=() port
    port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    if [ "$(id -u)" = 0 ]; then chown postgres:postgres "$pg"; as=(runuser -u postgres --); fi
    "${as[@]}" "$initdb" -D "$pg/db" -U tsdecode --auth=trust >/dev/null
    "${as[@]}" "$pg_ctl" -D "$pg/db" -l "$pg/log" -w -o "-c listen_addresses=127.0.0.1 -p $port -k $pg" start >/dev/null
    storage="postgresql://tsdecode@127.0.0.1:$port/postgres"
    echo "hosts: PostgreSQL on 127.0.0.1:$port" | tee -a "$OUT/summary.txt"
  else
    storage="$OUT/hosts/study.journal"
    echo "hosts: no PostgreSQL server binaries or psycopg here: a shared journal file instead" | tee -a "$OUT/summary.txt"
  fi
  mkdir -p "$OUT/hosts"
  python3 -m tuner create --storage "$storage" --job "$job" $GRID >"$OUT/hosts/create.log" 2>&1 || { cat "$OUT/hosts/create.log"; return 1; }
  local t0 t1
  t0=$(date +%s.%N)
  TSDECODE_TUNE_HOST=host-a python3 -m tuner worker --storage "$storage" --job "$job" --devices "$first" \
    --out "$OUT/hosts/a" >"$OUT/hosts/a.log" 2>&1 &
  local a=$!
  TSDECODE_TUNE_HOST=host-b python3 -m tuner worker --storage "$storage" --job "$job" --devices "$second" \
    --out "$OUT/hosts/b" >"$OUT/hosts/b.log" 2>&1 &
  local b=$!
  wait $a; local ra=$?
  wait $b; local rb=$?
  python3 -m tuner export --storage "$storage" --job "$job" --out "$OUT/hosts" >"$OUT/hosts/export.log" 2>&1
  local re=$?
  t1=$(date +%s.%N)
  python3 -c "print(f'{$t1 - $t0:.1f}')" >"$OUT/hosts.wall"
  echo "hosts: workers exit $ra $rb, export exit $re, $(cat "$OUT/hosts.wall") s (GPUs $first | $second)" | tee -a "$OUT/summary.txt"
  cat "$OUT/hosts/a/"*_trials.jsonl "$OUT/hosts/b/"*_trials.jsonl >"$OUT/hosts/all_trials.jsonl" 2>/dev/null
  [ -d "$OUT/devices_all" ] && compare devices_all hosts
  if [ -n "$pg" ]; then
    local as=()
    [ "$(id -u)" = 0 ] && as=(runuser -u postgres --)
    "${as[@]}" "$pg_ctl" -D "$pg/db" -m immediate stop >/dev/null 2>&1
    rm -rf "$pg"
  fi
}

case "$STEP" in
  ab1) ab1 ;;
  scale) scale ;;
  hosts) hosts ;;
  all) scale; hosts ;;
  *) echo "unknown step $STEP"; exit 2 ;;
esac
echo "summary: $OUT/summary.txt"
