"""A submitit local sweep: its jobs run as processes and the sweep is reported
(tests/unit/test_experiments.py: the presets)."""

import json

from conftest import run_cli


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
