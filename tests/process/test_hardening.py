"""A reader that goes away: --help into a pipe closed after one line exits 0 quietly, and a run whose stdout
reader leaves finishes and keeps its steps (tests/unit/test_hardening.py: the cases in this process)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import FAST, QUIET, ROOT, cli_env, read_jsonl


def test_help_into_a_pipe_closed_after_one_line_exits_0_quietly():
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlsync.bench", "--help"],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout.readline()  # `| head -1`
    proc.stdout.close()
    assert proc.wait(timeout=120) == 0
    assert proc.stderr.read() == b""


def test_a_run_whose_stdout_reader_leaves_finishes_and_keeps_its_steps(tmp_path):
    """`python -m rlsync ... | head -n 2`: unbuffered, so the writes after the reader left fail at once."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlsync", *FAST, *QUIET, f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        env=cli_env(PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = [proc.stdout.readline(), proc.stdout.readline()]  # the header and step 0
    proc.stdout.close()
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    assert first[0].startswith("step") and first[1].split()[0] == "0"
    assert "BrokenPipe" not in proc.stderr.read()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "finished" and len(read_jsonl(tmp_path / "metrics.jsonl")) == 3
