"""Bad input from a fresh interpreter (one line, exit 2, before anything is built), and a failing W&B falling
back while the run keeps its files (tests/unit/test_errors.py: the cases in this process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, check_one_line, cli_env, read_jsonl

HANG_S = 1800  # a child's time limit catches a hang only, never a slow (loaded) machine


@pytest.mark.parametrize(
    "module,overrides,names",
    [
        ("rlsync", ["model=qwen9"], "model=qwen9"),
        ("rlsync", ["update.bucket_mb=0"], "update.bucket_mb=0"),
        ("rlsync.bench", ["rollout.samples_per_prompt=1"], "rollout.samples_per_prompt=1"),
    ],
)
def test_bad_input_from_a_fresh_interpreter(tmp_path, module, overrides, names):
    """The same as the in-process cases below, from a plain `python -m` (no warmed-up parent)."""
    args = [sys.executable, "-m", module, "wandb.mode=disabled", f"hydra.run.dir={tmp_path}", *overrides]
    check_one_line(subprocess.run(args, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=HANG_S), names)


WANDB_SNIPPET = """
import sys
from pathlib import Path
from typing import Optional
from rlsync.config.schema import WandbConfig
from rlsync.record.sinks import MetricsFile, wandb_run

run_dir = Path(sys.argv[1])
with wandb_run(WandbConfig(mode=sys.argv[2], init_timeout=10), run_dir=run_dir, name="t", group="g",
               config={"a": 1}, job_type="run") as wb:
    metrics = MetricsFile(run_dir)
    row = {"step": 0, "perf/step_time": 1.5}
    metrics.write(row)
    wb.log(row)
    metrics.close()
    wb.summarize({"metrics": {"perf/step_time": {"median": 1.5, "min": 1.5, "max": 1.5}}, "status": "finished"})
    print("wandb mode:", wb.run.settings.mode if wb.run is not None else "none")
"""


@pytest.mark.parametrize(
    "mode,env,expect_mode,failures",
    [
        ("online", {"WANDB_MODE": "online"}, "offline", 1),  # no API key: online falls back to offline
        ("offline", {"WANDB_SERVICE": "3-99999-unix-/nonexistent/wandb.sock"}, "none", 1),  # the service is unreachable
        ("online", {"WANDB_SERVICE": "3-99999-unix-/nonexistent/wandb.sock"}, "none", 2),
    ],
    ids=["online-without-login", "offline-without-service", "online-without-login-or-service"],
)
def test_wandb_failing_falls_back_and_keeps_the_files(tmp_path, mode, env, expect_mode, failures):
    full_env = {k: v for k, v in cli_env(**env).items() if k not in ("WANDB_API_KEY", "WANDB_SILENT")}
    full_env["WANDB_CONFIG_DIR"] = str(tmp_path / "wandb_config")  # no stored login
    result = subprocess.run(
        [sys.executable, "-c", WANDB_SNIPPET, str(tmp_path), mode],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert result.returncode == 0, result.stderr
    ours = [ln for ln in result.stderr.splitlines() if ln.startswith("rlsync:")]
    assert len(ours) == failures and all("W&B" in ln and "failed" in ln for ln in ours), result.stderr
    assert "Traceback" not in result.stderr
    assert f"wandb mode: {expect_mode}" in result.stdout
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0, "perf/step_time": 1.5}]
    offline_runs = list((tmp_path / "wandb").glob("offline-run-*"))
    if expect_mode == "offline":
        assert offline_runs and "logging offline" in ours[0]
        state = json.loads(
            subprocess.run(
                ["wandb", "leet", "inspect", "--summary", "--json", str(offline_runs[0])],
                capture_output=True,
                text=True,
                timeout=HANG_S,
            ).stdout
        )
        assert state["summary"]["perf/step_time"] == 1.5
    else:
        assert "local files only" in ours[-1]
