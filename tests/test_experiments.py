"""Experiment presets, the GPU check script (--smoke on the CPU) and submitit sweeps."""

import json
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, cli_env, run_cli

PRESETS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes(compose, preset):
    cfg = compose(f"experiment={preset}")
    assert cfg.model.name.startswith("qwen3_")
    assert cfg.run.steps > cfg.run.warmup_steps


def test_presets_match_the_reference_runs(compose):
    table = compose("experiment=weight_update_table")
    assert (table.run.steps, table.run.warmup_steps, table.rollout.max_response_len, table.update.bucket_mb) == (4, 2, 256, 512)
    assert compose("experiment=step_share").run.steps == 48


def test_gpu_check_smoke_runs_every_study(tmp_path):
    proc = subprocess.run(["bash", "experiments/gpu_check.sh", "--smoke", str(tmp_path)], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for study, jobs in [("weight_update_table", 1), ("transports", 3), ("strategies", 4), ("offload", 1)]:
        summaries = sorted((tmp_path / study).glob("*/summary.json"))
        assert len(summaries) == jobs, study
        assert all(json.loads(s.read_text())["status"] == "finished" for s in summaries), study
        assert (tmp_path / study / "report.md").exists(), study
    assert "torch" in (tmp_path / "machine.txt").read_text()


def test_submitit_local_sweep_runs_jobs_as_processes_and_reports(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "hydra/launcher=local", "run.steps=2", "run.warmup_steps=1", "rollout.prompts_per_step=1",
                   "rollout.samples_per_prompt=2", "rollout.max_response_len=4", "wandb.mode=disabled",
                   "run.progress=false", "update.bucket_mb=0.05,512", f"hydra.sweep.dir={sweep}", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job in ("0", "1"):
        assert json.loads((sweep / job / "summary.json").read_text())["status"] == "finished"
    # submitit ran each job as its own process and kept its logs
    assert len(list((sweep / ".submitit").glob("*/*_log.out"))) == 2
    report = (sweep / "report.md").read_text()  # the sweep callback's report
    assert "update.bucket_mb=0.05" in report and "update.bucket_mb=512" in report
