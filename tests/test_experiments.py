"""Experiment presets, the GPU check script (--smoke on the CPU) and submitit sweeps."""

import json
import subprocess

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


def test_gpu_check_smoke_runs_every_step_and_ends_with_the_table(tmp_path):
    """The GPU check's --smoke: every step of the GPU run, on the CPU, without wandb (the GPU machine lacks it)."""
    no_wandb = tmp_path / "no_wandb" / "wandb"
    no_wandb.mkdir(parents=True)
    (no_wandb / "__init__.py").write_text('raise ImportError("wandb is not installed on the GPU machine")\n')
    out = tmp_path / "check"
    env = cli_env(PYTHONPATH=f"{no_wandb.parent}:{ROOT}", GPU_CHECK_BUDGET_S="3600")
    proc = subprocess.run(["bash", "experiments/gpu_check.sh", "--smoke", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=2400)
    table = (out / "table.txt").read_text()
    assert proc.returncode == 0, table + proc.stdout[-3000:]
    assert table in (out / "gpu_check.log").read_text() and "0 step(s) failed or timed out" in table
    rows = dict(line.split(None, 1) for line in table.splitlines()[2:-1])
    repeats = {"small_tiny_bench_direct", "small_tiny_bench_broadcast", "small_tiny_release_weights",
               "small_tiny_two_copy", "tiny_moe_ipc"}  # tiny_* steps exactly, on the CPU (or suite runs): --smoke names and skips them
    assert {name for name, result in rows.items() if result.startswith("skipped (smoke)")} == repeats, table
    assert all(result.startswith("passed") for name, result in rows.items() if name not in repeats), table
    assert {"environment", "tiny_direct", "tiny_ipc", "tiny_broadcast", "tiny_ipc_source_host", "tiny_release_weights",
            "tiny_two_copy", "small_tiny_bench_ipc", "small_tiny_offload", "large_tiny_offload",
            "study_transports"} <= set(rows)
    for transport in ("direct", "ipc", "broadcast"):  # every transport verified the update it landed
        summary = json.loads((out / f"tiny_{transport}" / "run" / "summary.json").read_text())
        assert (summary["status"], summary["verification"]) == ("finished", "passed")
    assert "wandb not installed" in (out / "environment" / "output.txt").read_text()
    assert (out / "study_transports" / "sweep" / "report.md").exists()


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
