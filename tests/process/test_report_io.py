"""How the report stops as a process: a stop signal ends it with its line, and piped into head it exits with
its own code (tests/unit/test_report_io.py: its hostile inputs and outputs)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, cli_env, write_job


def sigcgt(pid: int) -> int:
    """The signals process `pid` catches (its handlers installed), as a bit mask; 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)


def sweep_report(tmp_path: Path, runs: int, **popen) -> subprocess.Popen:
    """`python -m rlsync.report` started on a sweep of `runs` tiny jobs, its output piped."""
    for i in range(runs):
        write_job(tmp_path / "sweep" / str(i), "tiny", [1, 4, 16][i % 3])
    return subprocess.Popen(
        [sys.executable, "-m", "rlsync.report", str(tmp_path / "sweep"), "--no-wandb"],
        cwd=ROOT,
        env=cli_env(MPLBACKEND="Agg"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


@pytest.mark.parametrize(
    "sig, ignored, code",
    [
        (signal.SIGINT, True, 130),  # G16: started in the background of a script, where the shell ignores SIGINT
        (signal.SIGTERM, False, 143),  # G15: no line before, killed silently
    ],
)
def test_a_stop_signal_ends_the_report_with_its_line(tmp_path: Path, sig: int, ignored: bool, code: int) -> None:
    proc = sweep_report(
        tmp_path, 12, preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None
    )
    try:
        while proc.poll() is None and not sigcgt(proc.pid) & (1 << (sig - 1)):
            time.sleep(0.05)  # until the report has taken the signal (or has ended without taking it)
        if proc.poll() is None:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, out + err
    assert err.strip().splitlines()[-1] == f"rlsync.report: interrupted: stopped by {signal.Signals(sig).name}", err
    assert "Traceback" not in err


def test_the_report_piped_into_head_exits_with_its_own_code(tmp_path: Path) -> None:
    proc = sweep_report(tmp_path, 30)  # more output than Python's 8 KiB buffer: the second part after the close
    try:
        assert proc.stdout.readline().startswith("rlsync report:")
        proc.stdout.close()  # `| head -n 1`
        err = proc.stderr.read()
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "BrokenPipe" not in err
