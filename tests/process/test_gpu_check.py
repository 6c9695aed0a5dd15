"""experiments/gpu_check.sh --smoke: what comes back from a lent GPU machine, and how it ends.

Only $OUT comes back from the device, at most 8 files no more than 2 folders down, with plain names;
the check must leave its table there whatever happens: finished, out of time, or stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tarfile
import time
from pathlib import Path

from conftest import ROOT, cli_env

NAME = re.compile(r"^[A-Za-z0-9._-]+$")
SMOKE_SKIPS = {
    "small_tiny_bench_direct",
    "small_tiny_bench_broadcast",
    "small_tiny_sleep_level2",
    "small_tiny_two_copy",
    "tiny_moe_ipc",
    "tiny_ipc_source_host",
    "small_tiny_bench_source_host",
    "large_tiny_offload",  # small_tiny_offload exactly: both models are tiny under --smoke
    "large_tiny_bench_direct",
    "tiny_sleep_level2",
    "tiny_two_copy",
}  # tiny_* steps exactly, on the CPU (or suite runs)


def smoke(out: Path, tmp_path: Path, **env) -> subprocess.Popen:
    """The smoke as the device runs it: OUT set, no argument, no wandb (the GPU machine lacks it)."""
    no_wandb = tmp_path / "no_wandb" / "wandb"
    no_wandb.mkdir(parents=True, exist_ok=True)
    (no_wandb / "__init__.py").write_text('raise ImportError("wandb is not installed on the GPU machine")\n')
    env = cli_env(PYTHONPATH=f"{no_wandb.parent}:{ROOT}", OUT=str(out), TMPDIR=str(tmp_path), **env)
    return subprocess.Popen(
        ["bash", "experiments/gpu_check.sh", "--smoke"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def table_rows(out: Path) -> tuple[dict[str, str], str]:
    """{step: result} and the table's last line."""
    lines = (out / "table.txt").read_text().splitlines()
    rows = {}
    for line in lines[1:-1]:
        name, _seconds, result = line.split(None, 2)
        rows[name] = result
    return rows, lines[-1]


def assert_comes_back(out: Path) -> None:
    """What the device tool brings back of $OUT: at most 8 files, 2 folders deep, plain names."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    for p in out.rglob("*"):
        rel = p.relative_to(out)
        assert len(rel.parts) <= 3 and all(NAME.match(part) for part in rel.parts), rel
    assert {"table.txt", "gpu_check.log", "results.tgz"} <= {p.name for p in files}


def tarball(out: Path) -> dict[str, bytes]:
    with tarfile.open(out / "results.tgz") as tar:
        return {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_the_smoke_runs_every_step_and_brings_back_three_files(tmp_path):
    out = tmp_path / "out"
    proc = smoke(out, tmp_path, GPU_CHECK_DEADLINE_S="3600")
    output, _ = proc.communicate(timeout=2400)
    rows, last = table_rows(out)
    assert proc.returncode == 0, (out / "table.txt").read_text() + output[-3000:]
    assert "0 step(s) failed or timed out" in last
    assert {name for name, result in rows.items() if result.startswith("skipped (smoke)")} == SMOKE_SKIPS, rows
    assert all(result == "passed" for name, result in rows.items() if name not in SMOKE_SKIPS), rows
    assert {
        "environment",
        "cuda_ipc_probe",
        "tiny_direct",
        "tiny_ipc",
        "tiny_broadcast",
        "tiny_ipc_source_host",
        "tiny_sleep_level2",
        "tiny_two_copy",
        "small_tiny_bench_ipc",
        "small_tiny_offload",
        "large_tiny_bench_direct",
        "large_tiny_offload",
        "study_transports",
    } <= set(rows)
    assert_comes_back(out)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "results.tgz", "table.txt"]
    files = tarball(out)
    for name in rows.keys() - SMOKE_SKIPS:  # every step's output, and each run's summary
        assert f"{name}/output.txt" in files, name
    for transport in ("direct", "ipc", "broadcast"):  # every transport verified the update it landed
        summary = json.loads(files[f"tiny_{transport}/run/summary.json"])
        assert (summary["status"], summary["verification"]) == ("finished", "passed")
        assert (
            "estimate" in summary["memory"] and "peak_rss_bytes" in summary["memory"]["measured"]
        )  # check off, recorded
    assert b"wandb not installed" in files["environment/output.txt"]
    assert b"PYTORCH_CUDA_ALLOC_CONF was" in files["environment/output.txt"]
    assert "study_transports/sweep/report.md" in files
    assert files["table.txt"].decode() == (out / "table.txt").read_text()


def test_the_deadline_ends_the_check_with_a_complete_table(tmp_path):
    out = tmp_path / "out"
    started = time.monotonic()
    deadline_s = 32  # room for the environment step (its least: 10 s), not for a tiny run (its least: 20 s)
    proc = smoke(out, tmp_path, GPU_CHECK_DEADLINE_S=str(deadline_s), GPU_CHECK_NO_IPC="declared by the test")
    output, _ = proc.communicate(timeout=300)
    elapsed = time.monotonic() - started
    rows, last = table_rows(out)
    assert elapsed < deadline_s + 15, (elapsed, output[-2000:])
    assert last.startswith("total:") and "finished" in last
    assert rows["environment"] == "passed" and rows["cuda_ipc_probe"] == "unavailable (declared: declared by the test)"
    ipc_steps = {"tiny_ipc", "tiny_ipc_source_host", "small_tiny_bench_ipc", "study_transports"}
    assert all(rows[name] == "skipped (no CUDA IPC: declared by the test)" for name in ipc_steps), rows
    # the deadline cut the check: every step after the last one started reads "skipped (deadline)"
    names = list(rows)
    started_last = max(i for i, n in enumerate(names) if not rows[n].startswith("skipped") and n != "cuda_ipc_probe")
    remaining = [n for n in names[started_last + 1 :] if n not in SMOKE_SKIPS | ipc_steps | {"cuda_ipc_probe"}]
    assert remaining and all(rows[n] == "skipped (deadline)" for n in remaining), rows
    assert "study_transports" in rows and "large_tiny_offload" in rows  # the table names every step
    assert_comes_back(out)


def test_a_terminated_check_keeps_the_finished_steps(tmp_path):
    out = tmp_path / "out"
    proc = smoke(out, tmp_path, GPU_CHECK_DEADLINE_S="3600", GPU_CHECK_NO_IPC="declared by the test")  # no probe
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # half way: once the first tiny run has finished
        if (out / "table.txt").exists() and "tiny_direct" in (out / "table.txt").read_text():
            break
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output[-3000:]
    rows, last = table_rows(out)
    assert rows["environment"] == "passed" and rows["tiny_direct"] == "passed", rows
    assert "stopped by SIGTERM" in last, last
    assert_comes_back(out)
    files = tarball(out)
    assert "tiny_direct/output.txt" in files and "tiny_direct/run/summary.json" in files
