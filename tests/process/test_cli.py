"""The runner as real `python -m rlsync` processes, where the process is what is tested: the log-prob gap
that proves the update landed, SIGKILL keeping the finished steps, W&B offline as a user sees it
(tests/unit/test_cli.py: the same entry point in this process)."""

import json
import signal
import subprocess
import sys
import time

import pytest
from conftest import FAST, ROOT, cli_env, read_jsonl, run_cli, run_main

HANG_S = 1800  # a child's time limit catches a hang only, never a slow (loaded) machine


def test_logprob_gap_is_the_proof_the_update_landed(tmp_path):
    gaps = {}
    for enabled in ("true", "false"):
        out = tmp_path / enabled
        proc = run_main(
            *FAST,
            "run.steps=4",
            "trainer.lr=1e-3",
            f"update.enabled={enabled}",
            "wandb.mode=disabled",
            f"hydra.run.dir={out}",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        gaps[enabled] = [r["train/logprob_abs_diff"] for r in read_jsonl(out / "metrics.jsonl")]
    # bf16 engine vs fp32 trainer: a small gap every step when the update lands ...
    assert max(gaps["true"]) < 0.02
    # ... and a growing one once the trainer has moved away from a stale engine
    assert min(gaps["false"][1:]) > 10 * max(gaps["true"])
    assert gaps["false"][0] < 0.02  # step 0: nothing trained yet, the engine is still current


def test_killed_run_keeps_every_finished_step(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlsync", *FAST, "run.steps=200", "wandb.mode=disabled", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 600  # generous: a loaded 2-core machine can be slow
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    rows = read_jsonl(metrics)  # every line parses: no torn writes
    assert len(rows) >= 2 and [r["step"] for r in rows] == list(range(len(rows)))


def test_wandb_offline_run_holds_the_same_numbers(tmp_path):
    run_dir = tmp_path / "run1"
    proc = run_cli(
        *FAST, "wandb.mode=offline", f"hydra.run.dir={run_dir}", WANDB_SILENT="false"
    )  # W&B as a user sees it
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "of the step" in proc.stdout.splitlines()[-1]
    assert "Run summary" not in proc.stderr and "Run history" not in proc.stderr  # no W&B footer after the verdict
    wandb_dir = next((run_dir / "wandb").glob("offline-run-*"))
    inspect = subprocess.run(
        ["wandb", "leet", "inspect", "--summary", "--json", str(wandb_dir)],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    state = json.loads(inspect.stdout)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert state["state"] == "finished" and state["exit_code"] == 0
    assert state["name"] == ",".join(a for a in FAST) + ",wandb.mode=offline"
    assert state["config"]["update"]["bucket_mb"] == 512
    assert state["config"]["wandb"]["group"] == "run1"  # the group the run joined (the run dir's name), not null
    for key in ("perf/update_weights_time", "perf/step_time", "perf/sleep_time"):
        assert state["summary"][key] == pytest.approx(summary["metrics"][key]["median"])
    assert state["summary"]["verdict"] == summary["verdict"]
    records = [
        json.loads(x)
        for x in subprocess.run(
            ["wandb", "leet", "inspect", "--json", str(wandb_dir)], capture_output=True, text=True, timeout=HANG_S
        ).stdout.splitlines()
    ]
    run_record = next(r for r in records if r.get("type") == "run")
    assert run_record["run"]["run_group"] == "run1"
