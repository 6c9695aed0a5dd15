"""Experiment presets and submitit sweeps."""

import json

import pytest
from conftest import ROOT, run_cli

PRESETS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes(compose, preset):
    cfg = compose(f"experiment={preset}")
    assert cfg.model.name.startswith("qwen3_")
    assert cfg.run.steps > cfg.run.warmup_steps


def test_presets_match_the_reference_runs(compose):
    table = compose("experiment=weight_update_table")
    assert (table.run.steps, table.run.warmup_steps, table.rollout.max_response_len, table.update.bucket_mb) == (
        4,
        2,
        256,
        512,
    )
    assert compose("experiment=step_share").run.steps == 48


@pytest.mark.slow
def test_submitit_local_sweep_runs_jobs_as_processes_and_reports(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(
        "-m",
        "hydra/launcher=local",
        "run.steps=2",
        "run.warmup_steps=1",
        "rollout.prompts_per_step=1",
        "rollout.samples_per_prompt=2",
        "rollout.max_response_len=4",
        "wandb.mode=disabled",
        "run.progress=false",
        "update.bucket_mb=0.05,512",
        f"hydra.sweep.dir={sweep}",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job in ("0", "1"):
        assert json.loads((sweep / job / "summary.json").read_text())["status"] == "finished"
    # submitit ran each job as its own process and kept its logs
    assert len(list((sweep / ".submitit").glob("*/*_log.out"))) == 2
    report = (sweep / "report.md").read_text()  # the sweep callback's report
    assert "update.bucket_mb=0.05" in report and "update.bucket_mb=512" in report
