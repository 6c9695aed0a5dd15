#!/usr/bin/env bash
# The tiny default run's step times with each CPU thread choice, on the machine as it is and beside a
# CPU-heavy second process (a 2-thread matmul loop), one run each way. Prints one line per run.
#   bash experiments/cpu_threads/measure.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-outputs/cpu_threads}
mkdir -p "$out"
export WANDB_MODE=disabled
run() {  # name, overrides...
  local name=$1; shift
  python -m rlsync run.progress=false "hydra.run.dir=$out/$name" "$@" > "$out/$name.log" 2>&1
}
for load in quiet loaded; do
  hog=""
  if [ "$load" = loaded ]; then
    python -c "import torch; torch.set_num_threads(2); a = torch.randn(800, 800)
while True: a @ a" & hog=$!
    sleep 2
  fi
  for threads in 1 2 auto; do
    if [ "$threads" = auto ]; then run "${load}_auto"; else run "${load}_${threads}" "run.cpu_threads=$threads"; fi
  done
  [ -n "$hog" ] && kill "$hog"
done
python - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
for d in sorted(p for p in Path(sys.argv[1]).iterdir() if p.is_dir()):
    s = json.loads((d / "summary.json").read_text())
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= s["warmup_steps"]]
    def cell(key):
        v = [r[key] for r in rows]
        return f"{statistics.median(v):.2f} ({min(v):.2f} to {max(v):.2f})"
    cpu = s["cpu"]
    print(f"| {d.name} | {cpu['threads']} ({cpu['why']}) | {cell('perf/step_time')} | {cell('perf/rollout_time')} | "
          f"{cell('perf/train_time')} | {cpu['others_busy_cores_during_run']:.1f} |")
PY
