"""Where a run's numbers go: the console, metrics.jsonl / summary.json on disk, and W&B.

The disk files come first and never depend on W&B: metrics.jsonl gets one line per finished step,
flushed and fsynced before the next step starts, so a killed run keeps every step it finished.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from rlsync.config import WandbConfig

STEP_COLUMNS = [  # (metric, header) of the per-step console table
    ("perf/rollout_time", "rollout"), ("perf/wake_up_time", "onload"), ("perf/log_probs_time", "logprobs"),
    ("perf/train_time", "train"), ("perf/update_weights_time", "update"), ("perf/sleep_time", "offload"),
    ("perf/step_time", "step"), ("train/logprob_abs_diff", "lp_diff"), ("rollout/reward_mean", "reward"),
]


class MetricsFile:
    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)  # never a half-written summary


class Console:
    """A progress bar over the steps and one table row per finished step."""

    def __init__(self, steps: int, *, enabled: bool, warmup_steps: int):
        from tqdm import tqdm

        self.bar = tqdm(total=steps, desc="steps", unit="step", file=sys.stderr, disable=not enabled, leave=False)
        self.warmup_steps = warmup_steps
        self.header_done = False

    def step(self, row: dict) -> None:
        from tqdm import tqdm

        if not self.header_done:
            tqdm.write("step " + " ".join(f"{h:>9}" for _, h in STEP_COLUMNS))
            self.header_done = True
        cells = [f"{row[k]:9.4f}" if isinstance(row.get(k), (int, float)) else f"{'-':>9}" for k, _ in STEP_COLUMNS]
        tag = " (warm-up)" if row["step"] < self.warmup_steps else ""
        tqdm.write(f"{row['step']:>4} " + " ".join(cells) + tag)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class WandbRun:
    """Thin wrapper so the step loop logs the same way whether W&B is on or off."""

    def __init__(self, run=None):
        self.run = run

    def log(self, row: dict) -> None:
        if self.run is not None:
            self.run.log(row)

    def summarize(self, summary: dict) -> None:
        if self.run is None:
            return
        for key, s in summary.get("metrics", {}).items():
            self.run.summary[key] = s["median"]
            self.run.summary[f"{key}.min"], self.run.summary[f"{key}.max"] = s["min"], s["max"]
        for phase, share in summary.get("share", {}).items():
            self.run.summary[f"share/{phase}"] = share
        for key in ("verdict", "status", "measured_steps"):
            self.run.summary[key] = summary.get(key)


@contextmanager
def wandb_run(cfg: WandbConfig, *, run_dir: Path, name: str, group: str, config: dict, job_type: str):
    """Open one W&B run for this job (or none when disabled), finished however the job ends.

    `with wandb.init(...)` marks the run failed when the block raises. If W&B cannot start in
    online mode (no login, no network) we say so in one line and fall back to offline.
    """
    if cfg.mode == "disabled":
        yield WandbRun(None)
        return
    import wandb

    kwargs = dict(project=cfg.project, entity=cfg.entity, group=group, name=name, job_type=job_type,
                  tags=list(cfg.tags), config=config, dir=str(run_dir), reinit="finish_previous")
    try:
        run = wandb.init(mode=cfg.mode, **kwargs)
    except Exception as err:  # noqa: BLE001 - any W&B failure must not cost the run
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"rlsync: W&B {cfg.mode} failed ({first_line}); logging offline under {run_dir}/wandb", file=sys.stderr)
        run = wandb.init(mode="offline", **kwargs)
    with run:
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        yield WandbRun(run)
