#!/usr/bin/env bash
# Sizing: does the planner, calibrated on this machine with models no larger than Qwen3-0.6B, predict
# the measured update time of bigger models within 25 %?
#
#   bash experiments/sizing/run.sh                 # everything: calibrate, plan, bench, compare (~25 min on 2 cores)
#   bash experiments/sizing/run.sh --smoke DIR     # the same steps on tiny models, 1 repeat (a minute or two)
#
# Steps (each one command you can run alone):
#   1. calibrate: python -m rlsync.plan plan.calibrate=true (tiny, deep, wide, qwen3_0p6b; direct and ipc;
#      bucketed and per_tensor), coefficients into $OUT/calibration.json;
#   2. plan: python -m rlsync.plan model=M for qwen3_1p7b, qwen3_4b (and tiny_moe where the preset exists),
#      plan.json in $OUT/plans/M;
#   3. bench: python -m rlsync.bench, one process per job, over direct,ipc x bucketed,per_tensor for 1.7B
#      and 4B; ipc bucketed and per_tensor for tiny_moe; summaries in $OUT/bench*/<job>/;
#   4. compare: python -m rlsync.plan.compare $OUT --out $OUT/comparison.md (predicted vs measured median).
# trainer.dtype and rollout.dtype bfloat16 throughout, so that 4B (trainer + engine 15 GiB) fits in 24 GiB.
# Writes into $OUT (default experiments/sizing/results_<date>); the load average goes beside the table.
set -euo pipefail
cd "$(dirname "$0")/../.."
SMOKE=0
if [[ "${1:-}" == "--smoke" ]]; then SMOKE=1; OUT=${2:?--smoke needs an output dir}; else OUT=${1:-experiments/sizing/results_$(date +%Y-%m-%d)}; fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python}
DT="trainer.dtype=bfloat16 rollout.dtype=bfloat16 wandb.mode=disabled"
CAL="plan.calibration=$OUT/calibration.json"
if (( SMOKE )); then
  MODELS="tiny"; MOE=""; REPEATS=1; CAL_EXTRA="plan.calibrate_quick=true plan.calibrate_repeats=1"
else
  MODELS="qwen3_1p7b qwen3_4b"; REPEATS=${REPEATS:-5}; CAL_EXTRA="plan.calibrate_repeats=${CAL_REPEATS:-3}"
  MOE=$([[ -f rlsync/conf/model/tiny_moe.yaml ]] && echo tiny_moe || echo "")
fi
load() { echo "$(date -u +%FT%TZ) $1: $(cut -d' ' -f1-3 /proc/loadavg) (load average 1, 5, 15 min; $(nproc) cores)" | tee -a "$OUT/load.txt"; }

load "start"
$PY -m rlsync.plan plan.calibrate=true $CAL_EXTRA $DT "$CAL" hydra.run.dir="$OUT/calibrate" | tee "$OUT/calibrate.txt"
load "calibrated"
for m in $MODELS $MOE; do
  $PY -m rlsync.plan model=$m $DT "$CAL" hydra.run.dir="$OUT/plans/$m" > "$OUT/plans_$m.txt"
done
BENCH="bench.repeats=$REPEATS bench.warmup=1 $DT"
# One process per job, not one Hydra multirun: jobs in one process share its heap and page state, and
# in runs 6-8 the first job of a bigger model after smaller ones ran 1.5-2.4x slow, speeding up over
# its repeats. A fresh process starts each job from the same state, as the calibration's jobs start.
bench_job() {  # bench_job DIR MODEL TRANSPORT STRATEGY: one rlsync.bench run into DIR, its output into DIR.txt
  local dir=$1 model=$2 transport=$3 strategy=$4
  mkdir -p "$(dirname "$dir")"
  $PY -m rlsync.bench model=$model update.transport=$transport update.strategy=$strategy $BENCH \
    hydra.run.dir="$dir" > "$dir.txt" 2>&1 || echo "bench job failed: $dir.txt" | tee -a "$OUT/load.txt"
}
for m in $MODELS; do for t in direct ipc; do for s in bucketed per_tensor; do
  bench_job "$OUT/bench/${m}_${t}_${s}" $m $t $s
done; done; done
if [[ -n "$MOE" ]]; then
  for s in bucketed per_tensor; do bench_job "$OUT/bench_moe/${MOE}_ipc_${s}" $MOE ipc $s; done
else
  (( SMOKE )) || echo "tiny_moe: no preset on this branch (it comes with the models branch): skipped" | tee -a "$OUT/load.txt"
fi
load "benched"
# the bigger models only: the calibration's own runs (under calibrate/) are fitted, not predicted
$PY -m rlsync.plan.compare "$OUT/plans" "$OUT/bench" $([[ -n "$MOE" ]] && echo "$OUT/bench_moe") \
  --out "$OUT/comparison.md" | tee "$OUT/compare.txt"
{ echo; echo "Load (uptime) while it ran:"; echo; sed 's/^/    /' "$OUT/load.txt"; } >> "$OUT/comparison.md"
