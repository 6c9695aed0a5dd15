#!/usr/bin/env bash
# The GPU check: one prepared script for one short device loan (one H200, 15 minutes of device time
# in all, 10 a command, the machine's start included).
#
# On the machine that lends the GPU: `bash ../shared/gpu/fetch-wheels.sh` (hydra-core, omegaconf and
# antlr4 as wheels in .whl/: the GPU machine lacks them), then on the GPU machine, carrying `.whl`:
#
#   bash experiments/gpu_check.sh "$OUT"            # the check, on CUDA (a command timeout under 600 s)
#   bash experiments/gpu_check.sh --smoke [DIR]     # the same steps on the CPU with the tiny model (the tests run it)
#
# The results folder is the first argument, else $OUT, else experiments/gpu_check/results_h200 (a
# fresh temporary folder for --smoke). Only three files land there, whatever happens (the device
# brings back at most 8 files, 2 folders deep): table.txt and gpu_check.log, rewritten after every
# step, and results.tgz, every step's run directory and output, written at the end and on TERM/INT.
# The steps work in a temporary folder. Unpack the tarball into experiments/gpu_check/results_h200/.
#
# Cheap, risky checks first, studies last; every step under `timeout`, capped to an overall deadline
# (GPU_CHECK_DEADLINE_S, default 540 s); a step that cannot have its minimum is "skipped (deadline)".
# A failed step does not stop the next ones:
#   1. environment: PYTORCH_CUDA_ALLOC_CONF unset (recorded), compute mode and MIG (two processes must
#      share the GPU), versions; then a probe (10 s; 30 under --smoke) that a spawned child opens a CUDA tensor its parent
#      shares, the ipc transport's mechanism: without it the ipc steps read "skipped (no CUDA IPC: why)"
#      (GPU_CHECK_NO_IPC=why declares that without probing);
#   2. tiny model, 3 steps, update.verify=true, per transport (direct, ipc, broadcast); then the risky
#      options on tiny: update.source=host, rollout.release_level=2, the two-copy path
#      (update.flat_engine_weights=false), tiny_moe's per-expert views over ipc;
#   3. Qwen3-0.6B: the update bench per transport (verify on), source=host, rollout.release_level=2 and the
#      two-copy path in 3 runner steps, the offload bench;
#   2b. where vLLM imports: its reload path and its own transfer (vllm_ipc; --smoke: vllm_shm) with buckets far
#      smaller than a layer, and VLLM_RELOAD_MODE layerwise | direct on vLLM 0.34+ (else "unavailable (why)");
#   4. while the deadline has room: Qwen3-1.7B update and offload benches, the transports study and its report.
# The memory check is off (run.memory_check=false: the machine's RAM grows as it is used); each run's
# estimate is still recorded beside its measured peak in summary.json. W&B is disabled (not installed there).
# Exit 0 iff no step failed or timed out; 2 if the wheels do not make hydra, omegaconf and rlsync importable.
set -uo pipefail
cd "$(dirname "$0")/.."

smoke=0
if [[ "${1:-}" == "--smoke" ]]; then smoke=1; shift; fi
if [[ -n "${1:-}" ]]; then results="$1"
elif [[ -n "${OUT:-}" ]]; then results="$OUT"
elif (( smoke )); then results="$(mktemp -d -t rlsync_gpu_check.XXXXXX)"
else results=experiments/gpu_check/results_h200; fi
mkdir -p "$results" && results="$(cd "$results" && pwd)" || exit 2
work="$(mktemp -d -t rlsync_gpu_check_work.XXXXXX)" || exit 2
log="$results/gpu_check.log"
table="$results/table.txt"
: > "$log"
deadline_s="${GPU_CHECK_DEADLINE_S:-540}"
reserve_s=10  # kept back from the deadline for the last table and the tarball
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1  # a step killed after a hang keeps its output and its stacks
alloc_conf_was="${PYTORCH_CUDA_ALLOC_CONF-<unset>}"
# expandable segments share memory across processes through pidfd_getfd (which a sandbox may refuse),
# cudaMallocAsync not at all: either would fail every ipc step for a reason that is not rlsync's
unset PYTORCH_CUDA_ALLOC_CONF

say() { echo "$*" | tee -a "$log"; }

names=(); results_of=(); times=(); failed=0; current=""; current_pid=""; ended=""

record() {  # record NAME RESULT SECONDS
  names+=("$1"); results_of+=("$2"); times+=("$3")
  case "$2" in passed|skipped*|unavailable*) ;; *) failed=$((failed + 1)) ;; esac
}

write_table() {  # write_table LAST_LINE
  {
    printf '%-34s %7s  %s\n' step seconds result
    for i in "${!names[@]}"; do printf '%-34s %7s  %s\n' "${names[$i]}" "${times[$i]}" "${results_of[$i]}"; done
    echo "$1"
  } > "$table.tmp" && mv "$table.tmp" "$table"
}

pack() {  # the whole work tree, the table and the log in one tarball (the device brings back few files)
  cp "$table" "$log" "$work/" 2>/dev/null
  tar -czf "$results/results.tgz.tmp" -C "$work" . 2>>"$log"
  if (( $(stat -c %s "$results/results.tgz.tmp" 2>/dev/null || echo 0) > 15 * 1024 * 1024 )); then
    say "gpu_check: results.tgz over 15 MiB: keeping text files only"
    (cd "$work" && find . -type f \( -name '*.txt' -o -name '*.json' -o -name '*.jsonl' -o -name '*.yaml' \
      -o -name '*.md' -o -name '*.log' -o -name '*.csv' \) -size -4M -print0 |
      tar -czf "$results/results.tgz.tmp" --null -T -) 2>>"$log"
  fi
  mv "$results/results.tgz.tmp" "$results/results.tgz"
}

finish() {
  [[ -n "$ended" ]] || ended="total: $SECONDS s; $failed step(s) failed or timed out; finished $(date -u +%FT%TZ)"
  write_table "$ended"
  tee -a "$log" < "$table" >/dev/null
  pack
  rm -rf "$work"
}

on_signal() {  # the device's limit (or a person) stops the check: keep what finished, say what was cut
  if [[ -n "$current_pid" ]]; then
    kill -TERM "$current_pid" 2>/dev/null  # `timeout` passes it to the step's process group
    wait "$current_pid" 2>/dev/null
    record "$current" "interrupted ($1)" "$((SECONDS - current_t0))"
  fi
  failed=$((failed + 1))
  ended="total: $SECONDS s; stopped by $1 during ${current:-the check}; $failed step(s) failed, timed out or cut"
  say "gpu_check: $1: $ended"
  exit 143
}
trap finish EXIT
trap 'on_signal SIGTERM' TERM
trap 'on_signal SIGINT' INT
write_table "running since $(date -u +%FT%TZ)"

if ! python3 -c "import hydra, omegaconf" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$HOME/site" .whl/*.whl >>"$log" 2>&1
    export PYTHONPATH="$HOME/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    ended="gpu_check: hydra-core missing and no .whl/ to install it from (bash ../shared/gpu/fetch-wheels.sh)"
    say "$ended"; exit 2
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, not an installed copy
missing="$(python3 -c '
import importlib
for name in ("hydra", "omegaconf", "rlsync"):
    try:
        importlib.import_module(name)
    except Exception as e:
        print(f"{name} ({type(e).__name__}: {e})".splitlines()[0])
        break
' 2>&1)"
if [[ -n "$missing" ]]; then
  ended="gpu_check: cannot import $missing (after installing .whl/ if there was one)"
  say "$ended"; exit 2
fi

common=(wandb.mode=disabled run.progress=false run.memory_check=false update.engine_timeout_s=60)
if (( smoke )); then
  device=cpu; small=tiny; large=tiny; small_step=small_tiny; large_step=large_tiny  # step names stay distinct
  kill_after_s=5
  t_env=60; t_probe=30; t_tiny=120; t_small=180; t_large=180; t_study=300    # each step's own limit
  m_env=10; m_tiny=20; m_small=25; m_large=25; m_study=40        # the least worth starting it with
  runs=(run.steps=3 run.warmup_steps=1 rollout.prompts_per_step=2 rollout.samples_per_prompt=2 rollout.max_response_len=8)
  bench=(bench.warmup=1 bench.repeats=2)
else
  device=cuda; small=qwen3_0p6b; large=qwen3_1p7b; small_step=$small; large_step=$large
  kill_after_s=10
  t_env=60; t_probe=10; t_tiny=90; t_small=120; t_large=150; t_study=240
  m_env=15; m_tiny=30; m_small=45; m_large=60; m_study=90
  runs=(run.steps=3 run.warmup_steps=1 rollout.prompts_per_step=4 rollout.samples_per_prompt=4 rollout.max_response_len=32)
  bench=(bench.warmup=2 bench.repeats=5)
fi
tiny_runs=(model=tiny run.steps=3 run.warmup_steps=1 rollout.prompts_per_step=2 rollout.samples_per_prompt=2
           rollout.max_response_len=8)

# step NAME LIMIT_S MIN_S CMD...: CMD under timeout (capped to the deadline), its output in
# WORK/NAME/output.txt, its line in the table. Run in the background so that a TERM is handled at once.
step() {
  local name="$1" limit="$2" minimum="$3"; shift 3
  local left=$((deadline_s - SECONDS - reserve_s - kill_after_s)) capped=""
  if (( left < minimum )); then
    record "$name" "skipped (deadline)" 0; write_table "running: $SECONDS s of the ${deadline_s} s deadline used"
    say "== $name skipped: $SECONDS s of the ${deadline_s} s deadline used, it needs at least ${minimum} s"
    return
  fi
  if (( limit > left )); then limit=$left; capped=" (deadline)"; fi
  mkdir -p "$work/$name"
  say "== $name (timeout ${limit} s${capped}): $*"
  current="$name"; current_t0=$SECONDS
  timeout --signal=TERM --kill-after="$kill_after_s" "$limit" "$@" >"$work/$name/output.txt" 2>&1 </dev/null &
  current_pid=$!
  wait "$current_pid"
  local rc=$? status=passed
  current=""; current_pid=""
  if (( rc == 124 || rc == 137 )); then status="timed out$capped"; elif (( rc != 0 )); then status="failed (exit $rc)"; fi
  tail -n 25 "$work/$name/output.txt" >>"$log"
  record "$name" "$status" "$((SECONDS - current_t0))"
  write_table "running: $SECONDS s of the ${deadline_s} s deadline used"
  say "   $status in $((SECONDS - current_t0)) s"
}

# on_gpu NAME ...: a step that --smoke leaves out (named in the table), because on the CPU with the
# tiny model it repeats a tiny_* step or another transport's bench step exactly, or a run the test
# suite makes already: tiny_moe over ipc (tests/unit/test_models_from_config.py), released engine weights
# (tests/unit/test_engine_memory.py), two-copy updates (tests/unit/test_transports.py), a direct bench
# (tests/unit/test_bench.py), the update from the offloaded host copy (tests/unit/test_offload.py: on a CPU
# the host copy is the same memory, only a GPU's link makes it another path).
on_gpu() {
  if (( smoke )); then
    record "$1" "skipped (smoke)" 0
    say "== $1 skipped: --smoke runs it as a tiny_* step already"
    return
  fi
  step "$@"
}

# over_ipc STEP_FN NAME ...: a step that needs CUDA IPC (the ipc transport), skipped where the probe failed.
over_ipc() {
  local run="$1"; shift
  if [[ -n "$no_ipc" ]]; then
    record "$1" "skipped (no CUDA IPC: $no_ipc)" 0
    say "== $1 skipped: no CUDA IPC ($no_ipc)"
    return
  fi
  "$run" "$@"
}

runner=(python3 -m rlsync "${common[@]}" run.device="$device")
benchmark=(python3 -m rlsync.bench "${common[@]}" run.device="$device" "${bench[@]}")

environment() {
  echo "command: $0 $* (smoke=$smoke)"
  echo "started: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "host: $(uname -a); cores: $(nproc); $(free -g 2>/dev/null | awk '/^Mem/ {print "RAM GiB total " $2 ", available " $7}')"
  echo "PYTORCH_CUDA_ALLOC_CONF was ${alloc_conf_was} (unset for the check)  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-<unset>}"
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
for mod in ("transformers", "accelerate", "hydra", "omegaconf", "wandb"):
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

# The ipc transport's mechanism alone: the parent shares a tensor on the device with a spawned child,
# the child writes it, the parent reads the write (CPU shared memory under --smoke).
cat > "$work/ipc_probe.py" <<'PY'
import sys

import torch
import torch.multiprocessing as mp


def child(shared, answers):
    try:
        shared.add_(1)
        if shared.is_cuda:
            torch.cuda.synchronize()
        answers.put("ok")
    except Exception as e:  # the reason goes to the parent's one line
        answers.put(f"{type(e).__name__}: {e}".splitlines()[0])


if __name__ == "__main__":
    shared = torch.zeros(4, device=sys.argv[1])
    if not shared.is_cuda:
        shared.share_memory_()
    context = mp.get_context("spawn")
    answers = context.Queue()
    proc = context.Process(target=child, args=(shared, answers), daemon=True)
    proc.start()
    try:
        answer = answers.get(timeout=8)
    except Exception:
        answer = f"the child did not answer in 8 s (exit code {proc.exitcode})"
    proc.join(1)
    if answer == "ok" and shared.sum().item() != 4:
        answer = "the child's write did not reach the parent"
    print("cuda ipc: ok" if answer == "ok" else f"cuda ipc: {answer}")
    sys.exit(0 if answer == "ok" else 1)
PY

export -f environment  # `timeout` runs programs: the step runs it in a child bash
export device smoke alloc_conf_was
say "gpu_check: results in $results, steps in $work (smoke=$smoke, deadline ${deadline_s} s)"
step environment "$t_env" "$m_env" bash -c 'environment "$@"' "$0" "$@"
no_ipc="${GPU_CHECK_NO_IPC:-}"
if [[ -n "$no_ipc" ]]; then
  record cuda_ipc_probe "unavailable (declared: $no_ipc)" 0
else
  step cuda_ipc_probe "$t_probe" 5 python3 "$work/ipc_probe.py" "$device"
  if [[ "${results_of[-1]}" != passed ]]; then
    no_ipc="$(tail -n 1 "$work/cuda_ipc_probe/output.txt" 2>/dev/null | sed 's/^cuda ipc: //' | cut -c1-120)"
    no_ipc="${no_ipc:-${results_of[-1]}}"
    results_of[-1]="unavailable ($no_ipc)"; failed=$((failed - 1))  # the machine's, not rlsync's
    write_table "running: $SECONDS s of the ${deadline_s} s deadline used"
  fi
fi
# 2. tiny: every transport lands the trainer's weights, three steps each (verify raises on a mismatch)
step tiny_direct "$t_tiny" "$m_tiny" "${runner[@]}" "${tiny_runs[@]}" update.transport=direct update.verify=true \
  "hydra.run.dir=$work/tiny_direct/run"
over_ipc step tiny_ipc "$t_tiny" "$m_tiny" "${runner[@]}" "${tiny_runs[@]}" update.transport=ipc update.verify=true \
  "hydra.run.dir=$work/tiny_ipc/run"
step tiny_broadcast "$t_tiny" "$m_tiny" "${runner[@]}" "${tiny_runs[@]}" update.transport=broadcast update.verify=true \
  "hydra.run.dir=$work/tiny_broadcast/run"
over_ipc on_gpu tiny_ipc_source_host "$t_tiny" "$m_tiny" "${runner[@]}" "${tiny_runs[@]}" update.transport=ipc \
  update.source=host update.verify=true "hydra.run.dir=$work/tiny_ipc_source_host/run"
on_gpu tiny_sleep_level2 "$t_tiny" "$m_tiny" "${runner[@]}" "${tiny_runs[@]}" rollout.release_level=2 update.verify=true \
  "hydra.run.dir=$work/tiny_sleep_level2/run"
on_gpu tiny_two_copy "$t_tiny" "$m_tiny" "${runner[@]}" "${tiny_runs[@]}" update.flat_engine_weights=false update.verify=true \
  "hydra.run.dir=$work/tiny_two_copy/run"
over_ipc on_gpu tiny_moe_ipc "$t_tiny" "$m_tiny" "${runner[@]}" model=tiny_moe "${tiny_runs[@]:1}" update.transport=ipc \
  update.verify=true "hydra.run.dir=$work/tiny_moe_ipc/run"
# 2b. vLLM where it imports (GPU_CHECK_VLLM=0 leaves it out; --smoke leaves it out unless GPU_CHECK_VLLM=1):
# its reload path and its own four-phase transfer with buckets far smaller than a layer (update.verify checks
# what its loaders read), and on vLLM 0.34+ VLLM_RELOAD_MODE layerwise against direct, each a row.
# The NCCL engine's use_load_plan has no row: a colocated run has one GPU, where NCCL's two ranks cannot meet.
run_vllm="${GPU_CHECK_VLLM:-$(( smoke ? 0 : 1 ))}"  # --smoke: the suite runs these paths (tests/unit/test_vllm.py)
vllm_version="$(python3 -c 'from rlsync.engines.vllm_api import installed_version as v; print(v() or "")' 2>/dev/null)"
no_vllm=""
if (( run_vllm )) && ! python3 -c "import vllm" >/dev/null 2>&1; then no_vllm="vllm not importable${vllm_version:+ ($vllm_version)}"; fi
with_vllm() {  # with_vllm NAME ...: a step that needs vLLM, "unavailable (why)" where it cannot run; no row when off
  if (( ! run_vllm )); then say "== $1 left out (GPU_CHECK_VLLM=0)"; return; fi
  if [[ -n "$no_vllm" ]]; then record "$1" "unavailable ($no_vllm)" 0; say "== $1 skipped: $no_vllm"; return; fi
  step "$@"
}
own=vllm_ipc; own_verify=false; (( smoke )) && own=vllm_shm && own_verify=true  # vllm_ipc records no reads
vllm_runs=(model=$small "${runs[@]}" rollout.engine=vllm update.bucket_mb=0.05)
with_vllm vllm_reload_small_buckets "$t_small" "$m_small" "${runner[@]}" "${vllm_runs[@]}" update.verify=true \
  "hydra.run.dir=$work/vllm_reload_small_buckets/run"
with_vllm "${own}_small_buckets" "$t_small" "$m_small" "${runner[@]}" "${vllm_runs[@]}" update.strategy=$own \
  update.verify=$own_verify "hydra.run.dir=$work/${own}_small_buckets/run"
reload_modes="$(python3 -c 'from rlsync.engines.vllm_api import installed_version as v, reload_mode_refusal as r
print(r(v(), "direct") or "")' 2>/dev/null)"
for mode in layerwise direct; do
  if (( run_vllm )) && [[ -z "$no_vllm" && -n "$reload_modes" ]]; then
    record "vllm_reload_$mode" "unavailable ($reload_modes)" 0; continue
  fi
  with_vllm "vllm_reload_$mode" "$t_small" "$m_small" "${runner[@]}" "${vllm_runs[@]}" rollout.vllm_reload_mode=$mode \
    update.verify=true "hydra.run.dir=$work/vllm_reload_$mode/run"
done
# 3. Qwen3-0.6B
for transport in direct ipc broadcast; do
  run_step=on_gpu; [[ $transport == ipc ]] && run_step="over_ipc step"  # --smoke: the bench entry once, over ipc
  $run_step "${small_step}_bench_$transport" "$t_small" "$m_small" "${benchmark[@]}" model=$small \
    update.transport=$transport update.verify=true "hydra.run.dir=$work/${small_step}_bench_$transport/run"
done
on_gpu "${small_step}_bench_source_host" "$t_small" "$m_small" "${benchmark[@]}" model=$small update.source=host update.verify=true \
  "hydra.run.dir=$work/${small_step}_bench_source_host/run"
on_gpu "${small_step}_sleep_level2" "$t_small" "$m_small" "${runner[@]}" model=$small "${runs[@]}" rollout.release_level=2 \
  update.verify=true "hydra.run.dir=$work/${small_step}_sleep_level2/run"
on_gpu "${small_step}_two_copy" "$t_small" "$m_small" "${runner[@]}" model=$small "${runs[@]}" update.flat_engine_weights=false \
  update.verify=true "hydra.run.dir=$work/${small_step}_two_copy/run"
step "${small_step}_offload" "$t_small" "$m_small" "${benchmark[@]}" model=$small bench.target=offload \
  "hydra.run.dir=$work/${small_step}_offload/run"
# 4. while the deadline has room: Qwen3-1.7B, then a study with its report
on_gpu "${large_step}_bench_direct" "$t_large" "$m_large" "${benchmark[@]}" model=$large update.verify=true \
  "hydra.run.dir=$work/${large_step}_bench_direct/run"
on_gpu "${large_step}_offload" "$t_large" "$m_large" "${benchmark[@]}" model=$large bench.target=offload \
  "hydra.run.dir=$work/${large_step}_offload/run"
over_ipc step study_transports "$t_study" "$m_study" bash -c 'python3 -m rlsync.bench -m experiment=transports "$@" && \
  python3 -m rlsync.report "$0/study_transports/sweep" --no-wandb' "$work" model=$small "${common[@]}" \
  run.device=$device "${bench[@]}" "hydra.sweep.dir=$work/study_transports/sweep"

(( failed == 0 ))
