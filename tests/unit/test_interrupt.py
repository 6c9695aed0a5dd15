"""A run never loses a finished step, in this process: a summary that cannot be written says where the steps are,
and a signal while the run names its stop is absorbed. (Real processes stopped by signals, a dead engine process,
a bad job in a sweep: tests/process/test_interrupt.py; SIGINT takes SIGTERM's path and is checked in test_errors.py.)
"""

from __future__ import annotations

import os
import signal

from conftest import FAST, ours, read_jsonl, run_main

# ----------------------------------------------------------------------------------------------
# One run per run directory; SIGHUP; a summary that cannot be written
# ----------------------------------------------------------------------------------------------


def test_a_summary_that_cannot_be_written_says_where_the_steps_are(tmp_path):
    """Every step finished, then the disk is full for summary.json (its temporary file leads to /dev/full)."""
    (tmp_path / "summary.tmp").symlink_to("/dev/full")
    result = run_main(*FAST, "wandb.mode=disabled", f"hydra.run.dir={tmp_path}")
    lines = ours(result)
    assert result.returncode == 1, result.stderr
    assert lines == [
        f"rlsync: cannot write {tmp_path / 'summary.json'}: the disk is full (No space left on device); "
        f"all 3 finished step(s) are kept in {tmp_path / 'metrics.jsonl'}"
    ]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "summary.tmp").exists()


def test_a_signal_while_the_run_names_its_stop_is_absorbed():
    """rank 0 reading another rank's failure from the store when torchrun's SIGTERM lands: the read finishes
    and nothing is raised from it (the run is stopping already); a second signal would exit at once."""
    from rlsync.errors import StopOnSignals

    with StopOnSignals() as stop:
        with stop.ending():
            os.kill(os.getpid(), signal.SIGTERM)
            done = True  # reached: the handler did not raise here
        assert done and stop.raised and stop.pending == signal.SIGTERM
