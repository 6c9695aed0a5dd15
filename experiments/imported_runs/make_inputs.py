"""Write two runs of other frameworks, each by that framework's own writer and in its key layout, for
`python -m rlsync.report` to answer beside rlsync's runs (README, "Other frameworks' runs").

The figures are set here, not measured: a Miles run logging to W&B offline (perf/* on rollout/step, its
model named in the config) and a verl run logging to TensorBoard (timing_s/*, steps from 1). Each has two
slow warm-up steps, which the report leaves out.

    python experiments/imported_runs/make_inputs.py DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MILES = {"update": 0.92, "step": 45.0, "offload": 1.5, "onload": 0.7}  # seconds per measured step
VERL = {"update": 2.4, "step": 21.0, "gen": 9.0, "update_actor": 7.5}
STEPS, WARMUP_UPDATE = 10, 8.0  # logged steps; a warm-up step's update (the first two)


def spread(value: float, i: int) -> float:
    """A small step-to-step spread, and the slow warm-up of the first two steps."""
    return value * (1 + 0.02 * (i % 3))


def miles_wandb(root: Path) -> Path:
    import wandb

    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    run = wandb.init(project="miles", dir=str(root), config={"hf_checkpoint": "Qwen/Qwen3-1.7B"})
    run.define_metric("rollout/step")
    run.define_metric("perf/*", step_metric="rollout/step")
    for i in range(STEPS):
        update = WARMUP_UPDATE if i < 2 else spread(MILES["update"], i)
        run.log({"rollout/step": i, "perf/update_weights_time": update, "perf/step_time": spread(MILES["step"], i)})
        run.log({"rollout/step": i, "perf/sleep_time": MILES["offload"], "perf/wake_up_time": MILES["onload"]})
    run.finish()
    return next((root / "wandb").glob("offline-run-*"))


def verl_tensorboard(root: Path) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(root))
    for step in range(1, STEPS + 1):  # verl counts steps from 1
        update = WARMUP_UPDATE if step <= 2 else spread(VERL["update"], step)
        writer.add_scalar("timing_s/update_weights", update, step)
        writer.add_scalar("timing_s/step", spread(VERL["step"], step), step)
        writer.add_scalar("timing_s/gen", VERL["gen"], step)
        writer.add_scalar("timing_s/update_actor", VERL["update_actor"], step)
    writer.close()
    return root


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python experiments/imported_runs/make_inputs.py DIR")
    out = Path(sys.argv[1])
    (out / "miles").mkdir(parents=True, exist_ok=True)
    print(miles_wandb(out / "miles"))
    print(verl_tensorboard(out / "verl"))
