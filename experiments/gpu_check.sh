#!/usr/bin/env bash
# The GPU check: one prepared script for one short device loan (~5 minutes on one H200).
#
#   bash experiments/gpu_check.sh [OUT_DIR]           # on the GPU (default OUT_DIR: experiments/gpu_check/results_h200)
#   bash experiments/gpu_check.sh --smoke [OUT_DIR]   # the same steps: tiny model, CPU, smaller timeouts (the tests run it)
#
# Cheap, risky checks first, studies last. Every step runs under `timeout` (a gloo or CUDA IPC hang
# costs its step, not the loan), engines answer within update.engine_timeout_s=60, a failed step does
# not stop the next ones, and a final table says what passed, failed, timed out or was skipped:
#   1. environment: compute mode and MIG (two processes must share the GPU), PYTORCH_CUDA_ALLOC_CONF, versions;
#   2. tiny model, 3 steps, update.verify=true, per transport (direct, ipc, broadcast);
#      then the risky options on tiny: update.source=host, rollout.release_weights, the two-copy path
#      (update.flat_engine_weights=false: the default is one copy into flat engine weights), and
#      tiny_moe's 3,219 per-expert views over ipc (CUDA IPC handles of views into fused experts);
#   3. Qwen3-0.6B: the update bench per transport (verify on), source=host, release_weights and
#      the two-copy path in 3 runner steps, the offload bench;
#   4. only while the time budget (GPU_CHECK_BUDGET_S, default 300 s) has room for them: Qwen3-1.7B
#      update and offload benches, then the transports study with its report.
# Writes OUT_DIR/gpu_check.log (everything), OUT_DIR/table.txt (the final table), OUT_DIR/<step>/ (each
# step's run directory and output). Exit 0 iff no step failed or timed out.
#
# The GPU machine lacks hydra-core/omegaconf/antlr4 and wandb: with a .whl/ folder (bash
# ../shared/gpu/fetch-wheels.sh) they are installed from it without a network; W&B is disabled.
set -uo pipefail
cd "$(dirname "$0")/.."

smoke=0
if [[ "${1:-}" == "--smoke" ]]; then smoke=1; shift; fi
if (( smoke )); then out="${1:-$(mktemp -d -t rlsync_gpu_check.XXXXXX)}"; else out="${1:-experiments/gpu_check/results_h200}"; fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
log="$out/gpu_check.log"
: > "$log"
budget_s="${GPU_CHECK_BUDGET_S:-300}"
started=$SECONDS

say() { echo "$*" | tee -a "$log"; }

if ! python3 -c "import hydra, omegaconf" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$HOME/site" .whl/*.whl >>"$log" 2>&1
    export PYTHONPATH="$HOME/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    say "gpu_check: hydra-core missing and no .whl/ to install it from (bash ../shared/gpu/fetch-wheels.sh)"
    exit 2
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, not an installed copy

common=(wandb.mode=disabled run.progress=false update.engine_timeout_s=60)
if (( smoke )); then
  device=cpu; small=tiny; large=tiny; small_step=small_tiny; large_step=large_tiny  # step names stay distinct
  t_env=60; t_tiny=120; t_small=180; t_large=180; t_study=300
  runs=(run.steps=3 run.warmup_steps=1 rollout.prompts_per_step=2 rollout.samples_per_prompt=2 rollout.max_response_len=8)
  bench=(bench.warmup=1 bench.repeats=2)
else
  device=cuda; small=qwen3_0p6b; large=qwen3_1p7b; small_step=$small; large_step=$large
  t_env=60; t_tiny=90; t_small=120; t_large=150; t_study=240
  runs=(run.steps=3 run.warmup_steps=1 rollout.prompts_per_step=4 rollout.samples_per_prompt=4 rollout.max_response_len=32)
  bench=(bench.warmup=2 bench.repeats=5)
fi
tiny_runs=(model=tiny run.steps=3 run.warmup_steps=1 rollout.prompts_per_step=2 rollout.samples_per_prompt=2
           rollout.max_response_len=8)

names=(); results=(); times=()

# step NAME TIMEOUT_S CMD...: run CMD under timeout, its output in OUT/NAME/output.txt, its line in the table.
step() {
  local name="$1" limit="$2"; shift 2
  mkdir -p "$out/$name"
  say "== $name (timeout ${limit} s): $*"
  local t0=$SECONDS rc
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$out/$name/output.txt" 2>&1
  rc=$?
  local status=passed
  if (( rc == 124 || rc == 137 )); then status="timed out"; elif (( rc != 0 )); then status="failed (exit $rc)"; fi
  tail -n 25 "$out/$name/output.txt" >>"$log"
  names+=("$name"); results+=("$status"); times+=("$((SECONDS - t0))")
  say "   $status in $((SECONDS - t0)) s"
}

# on_gpu NAME TIMEOUT_S CMD...: a step that --smoke leaves out (named in the table), because on the CPU
# with the tiny model it repeats a tiny_* step or another transport's bench step exactly, or (tiny_moe
# over ipc) a run the test suite makes already (tests/test_models_from_config.py).
on_gpu() {
  if (( smoke )); then
    names+=("$1"); results+=("skipped (smoke)"); times+=(0)
    say "== $1 skipped: --smoke runs it as a tiny_* step already"
    return
  fi
  step "$@"
}

# optional NAME TIMEOUT_S CMD...: a step that runs only if the budget still has its timeout's room.
optional() {
  local name="$1" limit="$2"
  if (( SECONDS - started + limit > budget_s )); then
    names+=("$name"); results+=("skipped (budget)"); times+=(0)
    say "== $name skipped: $((SECONDS - started)) s of the ${budget_s} s budget used, it may take ${limit} s"
    return
  fi
  step "$@"
}

runner=(python3 -m rlsync "${common[@]}" run.device="$device")
benchmark=(python3 -m rlsync.bench "${common[@]}" run.device="$device" "${bench[@]}")

environment() {
  echo "command: $0 $* (smoke=$smoke)"
  echo "started: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "host: $(uname -a)"
  echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-<unset>}  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-<unset>}"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,memory.used,compute_mode,mig.mode.current,driver_version --format=csv || return 1
    # ipc and broadcast put a second process (the engine) on the GPU: an exclusive compute mode refuses it
    if nvidia-smi --query-gpu=compute_mode --format=csv,noheader | grep -qi exclusive; then
      echo "compute mode is exclusive: the engine process cannot open the GPU (ipc, broadcast will fail)"; return 1
    fi
  fi
  python3 - "$device" <<'PY'
import sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
for mod in ("transformers", "hydra", "omegaconf", "wandb"):
    try:
        print(mod, __import__(mod).__version__)
    except ImportError:
        print(mod, "not installed")
if sys.argv[1] == "cuda":
    assert torch.cuda.is_available(), "no CUDA device visible to torch"
    free, total = torch.cuda.mem_get_info()
    print(torch.cuda.get_device_name(0), f"free {free / 1e9:.1f} of {total / 1e9:.1f} GB",
          "capability", torch.cuda.get_device_capability(0))
PY
}

export -f environment  # `timeout` runs programs: the step runs it in a child bash
export device smoke
say "gpu_check: results under $out (smoke=$smoke, budget ${budget_s} s)"
step environment "$t_env" bash -c 'environment "$@"' "$0" "$@"
# 2. tiny: every transport lands the trainer's weights, three steps each (verify raises on a mismatch)
for transport in direct ipc broadcast; do
  step "tiny_$transport" "$t_tiny" "${runner[@]}" "${tiny_runs[@]}" update.transport=$transport update.verify=true \
    "hydra.run.dir=$out/tiny_$transport/run"
done
step tiny_ipc_source_host "$t_tiny" "${runner[@]}" "${tiny_runs[@]}" update.transport=ipc update.source=host update.verify=true \
  "hydra.run.dir=$out/tiny_ipc_source_host/run"
step tiny_release_weights "$t_tiny" "${runner[@]}" "${tiny_runs[@]}" rollout.release_weights=true update.verify=true \
  "hydra.run.dir=$out/tiny_release_weights/run"
step tiny_two_copy "$t_tiny" "${runner[@]}" "${tiny_runs[@]}" update.flat_engine_weights=false update.verify=true \
  "hydra.run.dir=$out/tiny_two_copy/run"
on_gpu tiny_moe_ipc "$t_tiny" "${runner[@]}" model=tiny_moe "${tiny_runs[@]:1}" update.transport=ipc update.verify=true \
  "hydra.run.dir=$out/tiny_moe_ipc/run"
# 3. Qwen3-0.6B
for transport in direct ipc broadcast; do
  run_step=on_gpu; [[ $transport == ipc ]] && run_step=step  # --smoke: the bench entry once, over ipc
  $run_step "${small_step}_bench_$transport" "$t_small" "${benchmark[@]}" model=$small update.transport=$transport update.verify=true \
    "hydra.run.dir=$out/${small_step}_bench_$transport/run"
done
step "${small_step}_bench_source_host" "$t_small" "${benchmark[@]}" model=$small update.source=host update.verify=true \
  "hydra.run.dir=$out/${small_step}_bench_source_host/run"
on_gpu "${small_step}_release_weights" "$t_small" "${runner[@]}" model=$small "${runs[@]}" rollout.release_weights=true update.verify=true \
  "hydra.run.dir=$out/${small_step}_release_weights/run"
on_gpu "${small_step}_two_copy" "$t_small" "${runner[@]}" model=$small "${runs[@]}" update.flat_engine_weights=false \
  update.verify=true "hydra.run.dir=$out/${small_step}_two_copy/run"
step "${small_step}_offload" "$t_small" "${benchmark[@]}" model=$small bench.target=offload "hydra.run.dir=$out/${small_step}_offload/run"
# 4. if time is left: Qwen3-1.7B, then a study with its report
optional "${large_step}_bench_direct" "$t_large" "${benchmark[@]}" model=$large update.verify=true "hydra.run.dir=$out/${large_step}_bench_direct/run"
optional "${large_step}_offload" "$t_large" "${benchmark[@]}" model=$large bench.target=offload "hydra.run.dir=$out/${large_step}_offload/run"
optional study_transports "$t_study" bash -c 'python3 -m rlsync.bench -m experiment=transports "$@" && \
  python3 -m rlsync.report "$0/study_transports/sweep" --no-wandb' "$out" model=$small "${common[@]}" \
  run.device=$device "${bench[@]}" "hydra.sweep.dir=$out/study_transports/sweep"

failed=0
{
  echo
  printf '%-34s %-18s %s\n' step result seconds
  for i in "${!names[@]}"; do
    printf '%-34s %-18s %s\n' "${names[$i]}" "${results[$i]}" "${times[$i]}"
    case "${results[$i]}" in passed|skipped*) ;; *) failed=$((failed + 1)) ;; esac
  done
  echo "total: $((SECONDS - started)) s; $failed step(s) failed or timed out; finished $(date -u +%FT%TZ)"
} > "$out/table.txt"
tee -a "$log" < "$out/table.txt"
(( failed == 0 ))
