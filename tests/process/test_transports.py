"""The `ipc` transport in a real `python -m rlsync` whose engine process is killed mid-run (slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, ROOT, SMALL_BUCKET_MB, cli_env, read_jsonl


def engine_pid(parent: int, timeout: float = 60.0) -> int:
    """The engine process among `parent`'s descendants (forked by the forkserver, itself a child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in descendants(parent):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "forkserver" in cmd and descendants(pid) == [] and is_forked_child(pid):
                return pid
        time.sleep(0.2)
    raise AssertionError("no engine process appeared")


def descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            out += [child, *descendants(child)]
    return out


def is_forked_child(pid: int) -> bool:
    """A process the forkserver forked (its parent is the forkserver, not the trainer)."""
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        parent_cmd = Path(f"/proc/{ppid}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return False
    return b"forkserver" in parent_cmd


@pytest.mark.slow
def test_whole_step_runs_with_ipc_and_a_killed_engine_ends_it_clearly(tmp_path):
    """Steps run through the ipc engine; killing it mid-run fails the run within seconds with the engine's
    exit code, and metrics.jsonl and summary.json keep the steps that finished."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlsync",
            *[o for o in FAST if not o.startswith("run.steps=")],
            "run.steps=50",
            "update.transport=ipc",
            f"update.bucket_mb={SMALL_BUCKET_MB}",
            "update.inflight_buckets=2",
            "wandb.mode=disabled",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and (not metrics.exists() or len(read_jsonl(metrics)) < 1):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        pid = engine_pid(proc.pid)  # looked up once steps run: the engine is certainly up by then
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        assert time.monotonic() - killed < 15  # the error itself comes within POLL_S; the rest is the summary
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    assert "exit code -9 (killed by SIGKILL)" in stderr
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) >= 1
    for row in rows:
        assert 0 <= row["train/logprob_abs_diff"] < 0.01
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps_finished"] == len(rows)
    assert "EngineDied" in summary["error"]
