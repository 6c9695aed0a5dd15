"""The memory estimate against measured peaks: a real run's, this process's own resident set, and qwen3_0p6b in
bf16 that the check accepts (tests/unit/test_memory.py: the estimate and the refusal)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import FAST, cli_env, read_jsonl, run_cli

from rlsync.measure import memory as memory_use


def test_the_estimate_is_within_25_percent_of_the_measured_peak(tmp_path):
    """A real tiny run: summary.json holds the estimate beside the peak resident set it measured (a process
    of its own: in this one the peak would be the test process's)."""
    result = run_cli(*FAST, "wandb.mode=disabled", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == summary["steps_finished"] == 3
    record = summary["memory"]
    assert record["measured"]["peak_rss_bytes"] > 0 and record["estimate"]["process_bytes"] > 0
    assert record["process_estimate_over_peak_rss"] == pytest.approx(
        record["estimate"]["process_bytes"] / record["measured"]["peak_rss_bytes"]
    )
    assert 0.75 <= record["process_estimate_over_peak_rss"] <= 1.25, record


def test_peak_rss_is_this_process_own_and_resets():
    """The peak is the process's own (a child of a large process does not report its parent's, as
    ru_maxrss would) and reset_peak_rss starts it again from now (each multirun job its own)."""
    code = "from rlsync.measure.memory import peak_rss_bytes; print(peak_rss_bytes())"
    ballast = bytearray(768 * 2**20)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # touch every page: this process's peak is > 768 MiB
    child = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=60)
    del ballast
    assert child.returncode == 0, child.stderr
    assert int(child.stdout) < 512 * 2**20  # the child imported torch: ~200-400 MiB, not its parent's peak

    before = memory_use.peak_rss_bytes()
    memory_use.reset_peak_rss()
    assert memory_use.peak_rss_bytes() <= before
    assert memory_use.peak_rss_bytes() >= memory_use.rss_bytes() - 2**20


@pytest.mark.parametrize("command", ["rlsync", "rlsync.bench"])
def test_qwen3_0p6b_in_bf16_that_the_check_accepts_finishes_within_its_estimate(tmp_path, command):
    """The check's promise on this machine: a run (and a benchmark) it accepts finishes, and its measured
    peak stays under the estimate with its margin. Refused only when this machine lacks the memory now."""
    short = (
        ["run.steps=1", "run.warmup_steps=0", *FAST[3:]]
        if command == "rlsync"
        else ["bench.warmup=0", "bench.repeats=1"]
    )
    result = run_cli(
        "model=qwen3_0p6b",
        "trainer.dtype=bfloat16",
        *short,
        "wandb.mode=disabled",
        f"hydra.run.dir={tmp_path}",
        module=command,
        timeout=600,
    )
    if result.returncode == 2 and "does not fit" in result.stderr:
        pytest.skip(f"this machine has too little memory free now: {result.stderr.strip()[:200]}")
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads((tmp_path / "summary.json").read_text())["memory"]
    estimate, peak = record["estimate"]["process_bytes"], record["measured"]["peak_rss_bytes"]
    assert peak <= estimate + record["available"]["margin_bytes"], record
    assert estimate <= 1.6 * peak, record  # conservative, not absurd
