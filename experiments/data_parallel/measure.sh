#!/usr/bin/env bash
# Data parallel on this machine: the update gathered from FSDP2 shards and the per-rank offload, against
# their floors measured in the same runs (issue 27's goals). One process, then 2 ranks under fsdp2, for
# tiny and for Qwen3-0.6B in bf16 (fp32 over 2 ranks does not fit 24 GiB: the memory check refuses it).
#   bash experiments/data_parallel/measure.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-outputs/data_parallel}
mkdir -p "$out"
export WANDB_MODE=disabled
two() { torchrun --nproc_per_node 2 -m rlsync "$@"; }
python -m rlsync run.progress=false "hydra.run.dir=$out/tiny_1" > "$out/tiny_1.log" 2>&1
two run.progress=false trainer.parallel=fsdp2 "hydra.run.dir=$out/tiny_fsdp2" > "$out/tiny_fsdp2.log" 2>&1
two run.progress=false trainer.parallel=fsdp2 update.gather=all_at_once "hydra.run.dir=$out/tiny_fsdp2_all" > "$out/tiny_fsdp2_all.log" 2>&1
big=(model=qwen3_0p6b trainer.dtype=bfloat16 run.steps=4 run.warmup_steps=1 run.progress=false)
python -m rlsync "${big[@]}" "hydra.run.dir=$out/0p6b_1" > "$out/0p6b_1.log" 2>&1
two "${big[@]}" trainer.parallel=fsdp2 "hydra.run.dir=$out/0p6b_fsdp2" > "$out/0p6b_fsdp2.log" 2>&1
python - "$out" <<'PY'
import json, sys
from pathlib import Path
def med(m, k):
    return m[k]["median"] if k in m else None
print("| run | update | gather (floor, eff.) | copy eff. | update eff. | offload bytes | offload (floor, eff.) | onload eff. | peak RSS, largest rank |")
print("|---|---|---|---|---|---|---|---|---|")
for name in ("tiny_1", "tiny_fsdp2", "tiny_fsdp2_all", "0p6b_1", "0p6b_fsdp2"):
    s = json.loads((Path(sys.argv[1]) / name / "summary.json").read_text())
    m = s["metrics"]
    g = med(m, "perf/update_weights_gather_time")
    gather = f"{g:.3f} s ({med(m, 'perf/update_weights_gather_limit_time'):.3f} s, {med(m, 'perf/update_weights_gather_efficiency'):.2f})" if g else "-"
    copy = med(m, "perf/update_weights_copy_efficiency")
    mem = s["memory"]["measured"]
    peak = mem.get("largest_rank_peak_rss_bytes", mem["peak_rss_bytes"]) / 2**30
    print(f"| {name} | {med(m, 'perf/update_weights_time'):.3f} s | {gather} | {copy:.2f} | {med(m, 'perf/update_weights_efficiency'):.2f} |"
          f" {med(m, 'perf/sleep_bytes') / 1e9:.2f} GB | {med(m, 'perf/sleep_time'):.3f} s ({med(m, 'perf/sleep_limit_time'):.3f} s, {med(m, 'perf/sleep_efficiency'):.2f}) |"
          f" {med(m, 'perf/wake_up_efficiency'):.2f} | {peak:.2f} GiB (estimate {s['memory']['estimate']['host_bytes'] / 2**30:.2f} GiB all ranks) |" if copy else
          f"| {name} | {med(m, 'perf/update_weights_time'):.3f} s | - | - | {med(m, 'perf/update_weights_efficiency'):.2f} | {med(m, 'perf/sleep_bytes') / 1e9:.2f} GB |"
          f" {med(m, 'perf/sleep_time'):.3f} s ({med(m, 'perf/sleep_limit_time'):.3f} s, {med(m, 'perf/sleep_efficiency'):.2f}) | {med(m, 'perf/wake_up_efficiency'):.2f} | {peak:.2f} GiB (estimate {s['memory']['estimate']['host_bytes'] / 2**30:.2f} GiB) |")
PY
