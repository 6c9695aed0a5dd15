#!/usr/bin/env bash
# The GPU check: the weight_update_table and transports studies plus the update and offload
# benchmarks for Qwen3-0.6B and 1.7B on one GPU, everything under one output folder, with a report
# per study. Budget: under 8 minutes on one H200.
#
#   bash experiments/gpu_check.sh [OUT_DIR]            # on a GPU machine (default OUT_DIR: outputs/gpu_check)
#   bash experiments/gpu_check.sh --smoke [OUT_DIR]    # the same commands, tiny model on the CPU (CI runs this)
#
# A machine without hydra-core/omegaconf (the lent GPU machine) installs them from .whl/ if present
# (bash ../shared/gpu/fetch-wheels.sh puts them there). W&B is disabled: the GPU machine lacks it.
set -euo pipefail
cd "$(dirname "$0")/.."

smoke=0
if [[ "${1:-}" == "--smoke" ]]; then smoke=1; shift; fi
out="${1:-outputs/gpu_check}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

if ! python3 -c "import hydra, omegaconf" 2>/dev/null; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu_check: hydra-core missing and no .whl/ to install it from" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$HOME/site" .whl/*.whl
  export PYTHONPATH="$HOME/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

common=(wandb.mode=disabled run.progress=false)
if (( smoke )); then
  models=tiny
  runner=(run.device=cpu run.steps=3 run.warmup_steps=1 rollout.prompts_per_step=2 rollout.samples_per_prompt=2 rollout.max_response_len=8)
  bench=(run.device=cpu bench.warmup=1 bench.repeats=2)
else
  models=qwen3_0p6b,qwen3_1p7b
  runner=(run.device=cuda)
  bench=(run.device=cuda bench.warmup=3 bench.repeats=10)
fi

{
  echo "started: $(date -u +%FT%TZ)"
  echo "host: $(uname -a)"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
} > "$out/machine.txt"

step() { echo "== $1"; local t0=$SECONDS; shift; "$@"; echo "   ($((SECONDS - t0)) s)"; }

# The reference table: the whole step, 4 steps, answers cut at 256 tokens (8 in --smoke), bucket 512 MiB.
step "weight_update_table" python3 -m rlsync -m experiment=weight_update_table "model=$models" "${common[@]}" "${runner[@]}" \
  "hydra.sweep.dir=$out/weight_update_table"
# direct / ipc / broadcast, the update alone, against the copy limit.
step "transports" python3 -m rlsync.bench -m experiment=transports "model=$models" "${common[@]}" "${bench[@]}" \
  "hydra.sweep.dir=$out/transports"
# per_tensor and update.source=host beside them.
step "strategies" python3 -m rlsync.bench -m "model=$models" update.strategy=bucketed,per_tensor update.source=device,host \
  "${common[@]}" "${bench[@]}" "hydra.sweep.dir=$out/strategies"
# The trainer's offload and onload alone, against the host-link limit.
step "offload" python3 -m rlsync.bench -m bench.target=offload "model=$models" "${common[@]}" "${bench[@]}" \
  "hydra.sweep.dir=$out/offload"

for study in weight_update_table transports strategies offload; do
  python3 -m rlsync.report "$out/$study" --no-wandb > "$out/$study/report.txt" 2>&1 || echo "report for $study failed (see $out/$study/report.txt)"
done
echo "finished: $(date -u +%FT%TZ)" >> "$out/machine.txt"
echo "gpu_check: results under $out"
