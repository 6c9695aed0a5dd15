"""A phase declared in the catalogue and timed by a hook in the step reaches every sink: one real run of the
tiny model (tests/unit/test_metrics.py: the catalogue's rules)."""

from __future__ import annotations

import csv
import json
import subprocess
import time

import pytest
from conftest import FAST, read_jsonl

MINE = "my_phase"


@pytest.fixture
def my_phase(monkeypatch: pytest.MonkeyPatch):
    """`my_phase` declared (a console column, just before the trainer's offload) and timed in every step."""
    from rlsync.measure import metrics
    from rlsync.run.loop import Experiment

    monkeypatch.setattr(metrics, "PHASES", metrics.PHASES)  # the catalogue as it was, back after the test
    phase = metrics.Phase(MINE, "my phase", "mine", "#000000", console=True)
    metrics.add_phase(phase, before="sleep")
    trainer_offload = Experiment.trainer_offload

    def timed_then_sleep(self, watch, step_metrics):  # the step calls this right before the offload
        with watch(MINE):
            time.sleep(0.002)
        trainer_offload(self, watch, step_metrics)

    monkeypatch.setattr(Experiment, "trainer_offload", timed_then_sleep)
    return phase


def test_a_declared_phase_reaches_every_sink(my_phase, compose, tmp_path, capsys, drawn, monkeypatch):
    from rlsync.report import write_report
    from rlsync.report.wandb_report import phase_metrics
    from rlsync.run.loop import run_experiment
    from rlsync.trainer.data_parallel import merge_ranks

    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    cfg = compose(*FAST, "run.steps=2", "wandb.mode=offline", "update.source=device")  # one warm-up, one measured
    run_experiment(cfg, run_dir, name="my-phase", group="catalogue")
    key = "perf/my_phase_time"

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 2 and all(r[key] >= 0.002 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    median = summary["metrics"][key]["median"]
    assert median == rows[1][key]  # step 0 is the warm-up
    assert summary["share"][MINE] == pytest.approx(median / summary["metrics"]["perf/step_time"]["median"])

    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step "))
    assert header.split()[1:] == [
        "rollout",
        "onload",
        "logprobs",
        "train",
        "update",
        "mine",
        "offload",
        "step",
        "lp_diff",
        "reward",
    ]

    (wandb_dir,) = (run_dir / "wandb").glob("offline-run-*")
    inspect = subprocess.run(
        ["wandb", "leet", "inspect", "--summary", "--json", str(wandb_dir)], capture_output=True, text=True, timeout=60
    )
    state = json.loads(inspect.stdout)
    assert state["summary"][key] == pytest.approx(median)
    assert state["summary"][f"share/{MINE}"] == pytest.approx(summary["share"][MINE])

    out = tmp_path / "report"
    write_report([run_dir], out_dir=out, log_wandb=False)
    phase_section = (out / "report.md").read_text().split("## Step by phase")[1].split("\n## ")[0]
    table = [line for line in phase_section.splitlines() if line.startswith("|")]
    assert "| weight update | my phase | trainer offload |" in table[0] and len(table) == 3
    with (out / "report.csv").open() as f:
        (csv_row,) = csv.DictReader(f)
    assert float(csv_row["my_phase_time_median"]) == median

    ax = drawn["step_breakdown.png"].axes[0]
    series = [text.get_text() for text in ax.get_legend().get_texts()]
    assert series[series.index("weight update") + 1] == "my phase" and series[-1] == "other"

    assert key in phase_metrics()  # the W&B Report's phase panels
    merged = merge_ranks([{key: 0.1}, {key: 0.3}], [1, 1])  # data parallel: the slowest rank's, spread beside
    assert (merged[key], merged[f"{key}_rank_min"]) == (0.3, 0.1)
