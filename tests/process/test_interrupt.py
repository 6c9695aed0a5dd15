"""A run never loses a finished step: SIGTERM, a dead engine process, a bad job in a sweep, one live run per
directory and SIGHUP, a signal from the first instant; real `python -m rlsync` processes on the tiny model
(tests/unit/test_interrupt.py: what is checked in this process)."""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import FAST, ROOT, cli_env, ours, read_jsonl

HANG_S = 1800  # a child's time limit catches a hang only, never a slow (loaded) machine


# Cheap steps, and many of them: the test stops the run long before the end.
LONG = [
    "run.steps=1000",
    "run.warmup_steps=1",
    "rollout.prompts_per_step=1",
    "rollout.samples_per_prompt=2",
    "rollout.max_response_len=4",
    "run.progress=false",
]


WAIT_S = 300  # generous: other jobs load this 2-core machine


def start(run_dir: Path, *args: str) -> subprocess.Popen:
    out = (run_dir.parent / f"{run_dir.name}.out").open("w")
    err = (run_dir.parent / f"{run_dir.name}.err").open("w")
    return subprocess.Popen([sys.executable, "-m", "rlsync", *args], cwd=ROOT, env=cli_env(), stdout=out, stderr=err)


def steps_done(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


@dataclass
class Outcome:
    run_dir: Path
    code: int
    stopped_at: float | None  # when the test sent the signal / killed the engine
    exited_at: float


def kill_engine(proc: subprocess.Popen) -> None:
    engines = engine_processes(proc.pid)
    assert len(engines) == 1, [cmdline(c) for c in engines]
    os.kill(engines[0], signal.SIGKILL)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    """Every run of this file at once (the machine is shared: waiting in parallel is what saves time).

    Each run is stopped as soon as it has 2 finished steps: by a signal, or by killing its engine process.
    """
    root = tmp_path_factory.mktemp("interrupt")
    plans = {  # name -> (args, how to stop it once 2 steps are done; None: let it end)
        "SIGTERM": ([*LONG, "wandb.mode=offline"], lambda p: p.send_signal(signal.SIGTERM)),
        "sweep": (
            [
                "-m",
                *LONG,
                "run.steps=2",
                "wandb.mode=disabled",
                f"hydra.sweep.dir={root / 'sweep'}",
                "update.bucket_mb=-1,1",
            ],
            None,
        ),
        "ipc": ([*LONG, "update.transport=ipc", "wandb.mode=disabled"], kill_engine),
    }
    procs = {name: start(root / name, *args, f"hydra.run.dir={root / name}") for name, (args, _) in plans.items()}
    stopped, exited = {}, {}
    deadline = time.time() + WAIT_S
    while len(exited) < len(procs) and time.time() < deadline:
        for name, proc in procs.items():
            if name in exited:
                continue
            if proc.poll() is not None:
                exited[name] = time.time()
            elif name not in stopped and plans[name][1] is not None and steps_done(root / name) >= 2:
                plans[name][1](proc)
                stopped[name] = time.time()
        time.sleep(0.1)
    for name, proc in procs.items():
        if name not in exited:
            proc.kill()
            proc.wait()
            exited[name] = time.time()
    return {
        name: Outcome(root / name, proc.returncode, stopped.get(name), exited[name]) for name, proc in procs.items()
    }


def stderr_lines(run_dir: Path) -> list[str]:
    return [ln for ln in (run_dir.parent / f"{run_dir.name}.err").read_text().splitlines() if ln.strip()]


def check_kept(run_dir: Path, status: str) -> dict:
    """metrics.jsonl holds whole steps 0..n-1; summary.json is computed from exactly those."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(len(rows)))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == status
    assert summary["steps_finished"] == len(rows) and summary["measured_steps"] == len(rows) - 1
    measured = [r["perf/step_time"] for r in rows if r["step"] >= 1]
    assert summary["metrics"]["perf/step_time"]["median"] == pytest.approx(statistics.median(measured))
    assert "partial" in summary["warning"]
    return summary


def test_sigterm_stops_the_run_and_keeps_the_finished_steps(outcomes):
    sig, code, wandb_mode = signal.SIGTERM, 143, "offline"  # SIGINT takes the same path (test_errors.py: 130)
    run = outcomes[sig.name]
    assert run.stopped_at is not None, stderr_lines(run.run_dir)
    assert run.code == code, stderr_lines(run.run_dir)

    summary = check_kept(run.run_dir, "interrupted")
    assert summary["error"] == f"Interrupted: stopped by {sig.name}"
    lines = stderr_lines(run.run_dir)
    assert not any("Traceback" in ln for ln in lines)
    ours = [ln for ln in lines if ln.startswith("rlsync:")]
    assert ours == [
        f"rlsync: interrupted: stopped by {sig.name}; {summary['steps_finished']} finished step(s) kept in "
        f"{run.run_dir} (summary.json status interrupted)"
    ]
    closing = (run.run_dir.parent / f"{sig.name}.out").read_text()
    assert "interrupted" in closing and "WARNING: only" in closing  # the closing table says the numbers are partial
    if wandb_mode == "offline":  # the W&B run is finished as failed, with the signal's exit code
        wandb_dir = next((run.run_dir / "wandb").glob("offline-run-*"))
        state = json.loads(
            subprocess.run(
                ["wandb", "leet", "inspect", "--summary", "--json", str(wandb_dir)],
                capture_output=True,
                text=True,
                timeout=HANG_S,
            ).stdout
        )
        assert (state["state"], state["exit_code"]) == ("failed", code)
        assert state["summary"]["status"] == "interrupted"


def test_a_bad_job_in_a_sweep_fails_alone(outcomes):
    run = outcomes["sweep"]
    sweep, stderr = run.run_dir.parent / "sweep", (run.run_dir.parent / "sweep.err").read_text()
    assert run.code == 2, stderr
    assert "Traceback" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("rlsync:")]
    progress = ("rlsync: sweep of ", "rlsync:   job ", "rlsync: sweep job ", "rlsync: sweep ended ")
    ours = [ln for ln in lines if not ln.startswith(progress)]  # the sweep's plan, progress and ending
    assert len(ours) == 1 and "job 0" in ours[0] and "update.bucket_mb=-1.0: out of range" in ours[0], lines
    assert any(ln.startswith("rlsync: sweep of 2 jobs: 1 fit, 1 refused") for ln in lines), lines
    assert any(ln.startswith("rlsync: sweep ended with failed jobs") for ln in lines), lines
    assert (sweep / "report.md").exists()  # written although a job failed
    assert not (sweep / "0" / "summary.json").exists()
    assert "update.bucket_mb=-1.0" in (sweep / "0" / "error.log").read_text()
    good = json.loads((sweep / "1" / "summary.json").read_text())  # the other job ran to the end
    assert good["status"] == "finished" and good["measured_steps"] == 1
    assert len(read_jsonl(sweep / "1" / "metrics.jsonl")) == 2


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def engine_processes(pid: int) -> list[int]:
    """Leaf descendants but multiprocessing's resource tracker: the engine (a child with `spawn`, a
    grandchild under the forkserver)."""
    leaves, todo = [], children(pid)
    while todo:
        p = todo.pop()
        below = children(p)
        todo += below
        if not below and "resource_tracker" not in cmdline(p):
            leaves.append(p)
    return leaves


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_a_dead_engine_is_one_line_within_seconds(outcomes):
    """The error line of any engine process (test_transports.py kills ipc and broadcast engines at the API)."""
    run = outcomes["ipc"]
    assert run.stopped_at is not None, stderr_lines(run.run_dir)
    assert run.code == 1, stderr_lines(run.run_dir)
    assert run.exited_at - run.stopped_at < 30  # seconds, not the engine timeout (update.engine_timeout_s=600)

    check_kept(run.run_dir, "failed")
    lines = stderr_lines(run.run_dir)
    ours = [ln for ln in lines if ln.startswith("rlsync:")]
    assert len(ours) == 1 and "EngineDied" in ours[0] and "SIGKILL" in ours[0], lines
    assert not any("Traceback" in ln for ln in lines)


HOLD_AND_DIE = """
import os, signal, sys
from pathlib import Path
from rlsync.record.run_lock import RunLock
lock = RunLock(Path(sys.argv[1])).__enter__()
print(os.getpid(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # dies holding it: the kernel drops the flock, the holder stays written
"""


def wait_for_steps(run_dir: Path, proc: subprocess.Popen, n: int) -> None:
    deadline = time.time() + WAIT_S
    while steps_done(run_dir) < n and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert steps_done(run_dir) >= n, stderr_lines(run_dir)


def test_one_live_run_per_directory_then_sighup_keeps_the_steps_and_a_dead_holder_is_taken_over(tmp_path):
    run_dir = tmp_path / "shared"
    run_dir.mkdir()
    first = start(run_dir, *LONG, "wandb.mode=disabled", f"hydra.run.dir={run_dir}")
    try:
        wait_for_steps(run_dir, first, 1)
        # a second run, and a benchmark, in the directory the first one holds: refused, nothing touched
        for module in ("rlsync", "rlsync.bench"):
            second = subprocess.run(
                [sys.executable, "-m", module, *FAST, "wandb.mode=disabled", f"hydra.run.dir={run_dir}"],
                cwd=ROOT,
                env=cli_env(),
                capture_output=True,
                text=True,
                timeout=WAIT_S,
            )
            lines = ours(second)
            assert second.returncode == 2, second.stderr
            assert len(lines) == 1 and lines[0].startswith(
                f"rlsync: run directory {run_dir} is in use by another run (pid {first.pid} on "
            ), lines
            assert ", started 20" in lines[0] and "hydra.run.dir" in lines[0]
        assert not (run_dir / "error.log").exists() and not (run_dir / "metrics.jsonl.prev").exists()
        assert first.poll() is None  # the first run goes on
        wait_for_steps(run_dir, first, 2)
        first.send_signal(signal.SIGHUP)  # its terminal closed
        first.wait(timeout=WAIT_S)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 129, stderr_lines(run_dir)
    summary = check_kept(run_dir, "interrupted")
    assert summary["error"] == "Interrupted: stopped by SIGHUP"
    assert [ln for ln in stderr_lines(run_dir) if ln.startswith("rlsync:")] == [
        f"rlsync: interrupted: stopped by SIGHUP; {summary['steps_finished']} finished step(s) kept in {run_dir} "
        f"(summary.json status interrupted)"
    ]
    first_summary, first_rows = (run_dir / "summary.json").read_text(), (run_dir / "metrics.jsonl").read_text()

    # a run killed while holding the directory: the next run takes it over with a note, and keeps the first's record
    dead = subprocess.run(
        [sys.executable, "-c", HOLD_AND_DIE, str(run_dir)],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert dead.returncode == -signal.SIGKILL
    dead_pid = int(dead.stdout.split()[0])
    third = subprocess.run(
        [sys.executable, "-m", "rlsync", *FAST, "wandb.mode=disabled", f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert third.returncode == 0, third.stderr
    assert ours(third) == [
        f"rlsync: note: taking over run directory {run_dir} from a run that is no longer alive "
        f"(pid {dead_pid} on {socket.gethostname()}, started " + ours(third)[0].split("started ")[1]
    ]
    assert json.loads((run_dir / "summary.json").read_text())["steps_finished"] == 3
    assert (run_dir / "summary.json.prev").read_text() == first_summary  # nothing of the first run lost
    assert (run_dir / "metrics.jsonl.prev").read_text() == first_rows
    assert (run_dir / ".rlsync.lock").read_text() == ""  # ended cleanly: no holder left


def caught_signals(pid: int) -> int:
    """The signals process `pid` has a handler for (its SigCgt mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("SigCgt:")).split()[1], 16)


@pytest.mark.parametrize("module", ["rlsync", "rlsync.serve"])
def test_a_signal_from_the_first_instant_is_one_line_and_128_plus_it(tmp_path, module):
    """G02/G11: SIGTERM as soon as the process handles it (its entry's first lines, before Hydra, torch or
    uvicorn is imported): one line and 143, no traceback, nothing run or served."""
    args = [sys.executable, "-m", module, "wandb.mode=disabled", *LONG, f"hydra.run.dir={tmp_path / 'run'}"]
    if module == "rlsync.serve":
        args = [sys.executable, "-m", module, "update.engine_address=127.0.0.1:0", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(args, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + WAIT_S
    while not caught_signals(proc.pid) & (1 << (signal.SIGTERM - 1)) and time.time() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == "rlsync: interrupted: stopped by SIGTERM before the run started", err[-3000:]
    assert "Traceback" not in err and "listening on" not in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
