#!/usr/bin/env bash
# The schemes study: each framework's update scheme (rlsync/conf/scheme/) on this machine, side by side.
#
#   bash experiments/schemes/run.sh                       # the whole study, into experiments/schemes/results_<tag>/
#   bash experiments/schemes/run.sh --smoke /tmp/schemes  # the same steps on the tiny model, 1 repeat (a check that it runs)
#
# Environment: MODELS (default qwen3_0p6b,qwen3_1p7b, plus tiny_moe where rlsync/conf/model/tiny_moe.yaml
# exists), VLLM_MODELS (default qwen3_0p6b; empty skips vLLM), REPEATS (5), WARMUP (2), TAG (cpu).
# Steps, each a sweep of its own (a failed job does not stop the others; the report lists it):
#   1. hf:   every scheme x MODELS with the HF engine (rollout.engine=hf);
#   2. vllm: every scheme x VLLM_MODELS with vLLM (rollout.engine=vllm; its own load path);
#   3. side_by_side: vLLM's reload_weights per bucket beside rlsync's vLLM update and the trl scheme
#      (experiments/schemes/vllm_side_by_side.py), one process, the ways taking turns;
#   4. default: the default update (scheme rlsync, one copy) over direct and ipc for DEFAULT_MODELS
#      (default qwen3_0p6b,qwen3_1p7b): its efficiency against the copy floor.
# Run it on a quiet machine: `uptime` is recorded beside each step (load.txt).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true

SCHEMES=rlsync,miles,verl,trl,nemo_rl,checkpoint_engine
REPEATS=${REPEATS:-5} WARMUP=${WARMUP:-2} TAG=${TAG:-cpu}
MODELS=${MODELS:-qwen3_0p6b,qwen3_1p7b}
[ -f rlsync/conf/model/tiny_moe.yaml ] && [[ ",$MODELS," != *",tiny_moe,"* ]] && MODELS="$MODELS,tiny_moe"
VLLM_MODELS=${VLLM_MODELS-qwen3_0p6b}
DEFAULT_MODELS=${DEFAULT_MODELS:-qwen3_0p6b,qwen3_1p7b}
OUT=experiments/schemes/results_$TAG
SIDE_ARGS=(--model qwen3_0p6b --repeats "$REPEATS")
if [ "${1:-}" = "--smoke" ]; then
  OUT=${2:-/tmp/rlsync_schemes_smoke} MODELS=tiny VLLM_MODELS=tiny DEFAULT_MODELS=tiny REPEATS=1 WARMUP=0
  SIDE_ARGS=(--model tiny --repeats 1)
fi
mkdir -p "$OUT"
python -c "import vllm" 2>/dev/null || { echo "vllm not importable: the vllm steps are skipped"; VLLM_MODELS=; }

status=0
note() { echo "[$(date -u +%H:%M:%S)] $1: $(uptime | sed 's/.*load average/load average/')" | tee -a "$OUT/load.txt"; }
bench() {  # bench NAME OVERRIDES...
  local name=$1; shift
  note "$name start"
  python -m rlsync.bench -m "scheme=$SCHEMES" "bench.repeats=$REPEATS" "bench.warmup=$WARMUP" \
    "hydra.sweep.dir=$OUT/$name" "$@" 2>&1 | tee "$OUT/$name.log" | grep -E "^(rlsync report|\| [0-9]+: |best:|error)" || true
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  note "$name end"
}

bench hf "model=$MODELS" rollout.engine=hf
if [ -n "$VLLM_MODELS" ]; then
  bench vllm "model=$VLLM_MODELS" rollout.engine=vllm
  note "side_by_side start"
  python experiments/schemes/vllm_side_by_side.py "${SIDE_ARGS[@]}" --out "$OUT/side_by_side" > "$OUT/side_by_side.log" 2>&1 || status=1
  sed -n '/^| way/,$p' "$OUT/side_by_side.log"
  note "side_by_side end"
fi
note "default start"
python -m rlsync.bench -m "model=$DEFAULT_MODELS" update.transport=direct,ipc "bench.repeats=$REPEATS" "bench.warmup=$WARMUP" \
  "hydra.sweep.dir=$OUT/default" 2>&1 | tee "$OUT/default.log" | grep -E "^(rlsync report|\| [0-9]+: |best:|error)" || true
[ "${PIPESTATUS[0]}" = 0 ] || status=1
note "default end"
echo "results: $OUT (each sweep's report.md; side_by_side/side_by_side.json)"
exit $status
