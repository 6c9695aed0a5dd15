#!/usr/bin/env bash
# The engine's idle time per step at each rollout.release_level, tiny and Qwen3-0.6B, two passes (the
# second in reverse level order), one run at a time. Keeps each run's summary.json and metrics.jsonl.
#   bash experiments/sleep/measure.sh [results dir, default experiments/sleep/results_cpu]
#   PASSES=3 MODELS=qwen3_0p6b bash experiments/sleep/measure.sh   # one more pass of one model
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-experiments/sleep/results_cpu}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(run.limit_probe=start run.progress=false wandb.mode=disabled)  # the floors once: no probe in the idle
tiny=(run.steps=8 run.warmup_steps=2)
small=(model=qwen3_0p6b run.steps=6 run.warmup_steps=2 rollout.prompts_per_step=1 rollout.samples_per_prompt=2
  rollout.max_response_len=16)  # short steps, as experiments/step_share ran
for pass in ${PASSES:-1 2}; do
  levels=(0 1 2); (( pass % 2 == 0 )) && levels=(2 1 0)  # even passes in reverse order
  for model in ${MODELS:-tiny qwen3_0p6b}; do
    for level in "${levels[@]}"; do
      name=${model}_level${level}_pass${pass}
      if [[ $model == tiny ]]; then args=("${tiny[@]}"); else args=("${small[@]}"); fi
      echo "== $name"
      python -m rlsync "${args[@]}" "${common[@]}" rollout.release_level=$level "hydra.run.dir=$work/$name" | tail -4
      mkdir -p "$out/$name"
      cp "$work/$name/summary.json" "$work/$name/metrics.jsonl" "$out/$name/"
    done
  done
done
