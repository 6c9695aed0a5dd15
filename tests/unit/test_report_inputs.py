"""What the report is handed: a folder of runs named by time, runs whose paths end alike, a FIFO where a
summary should be, a plot that cannot be written."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import run_report, write_job


def test_a_folder_of_runs_named_by_time_is_reported(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    write_job(runs / "2026-12-02_01-00-00", "tiny", 1)
    write_job(runs / "2026-12-02_01-05-00", "tiny", 4)
    result = run_report(str(runs), "--no-wandb")
    assert result.returncode == 0, result.stderr
    assert "(2 runs, 0 failed)" in result.stdout
    assert (runs / "report.md").exists()


def test_runs_whose_paths_end_alike_get_labels_of_their_own(tmp_path: Path) -> None:
    write_job(tmp_path / "a" / "run", "tiny", 1)
    write_job(tmp_path / "b" / "run", "tiny", 4)
    result = run_report(
        str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run"), "--no-wandb", "--out", str(tmp_path / "out")
    )
    assert result.returncode == 0, result.stderr
    csv = (tmp_path / "out" / "report.csv").read_text()
    assert "a/run" in csv and "b/run" in csv


def test_a_fifo_as_a_summary_is_a_failed_run_not_a_hang(tmp_path: Path) -> None:
    write_job(tmp_path / "sweep" / "0", "tiny", 1)
    write_job(tmp_path / "sweep" / "1", "tiny", 4, with_summary=False)
    os.mkfifo(tmp_path / "sweep" / "1" / "summary.json")
    result = run_report(str(tmp_path / "sweep"), "--no-wandb")
    assert "FIFO" in result.stdout, result.stdout + result.stderr
    assert "failed: 1 (" in result.stdout


def test_a_plot_that_cannot_be_written_fails_the_report(tmp_path: Path, monkeypatch) -> None:
    from rlsync.report import plots

    write_job(tmp_path / "sweep" / "0", "tiny", 1)
    write_job(tmp_path / "sweep" / "1", "tiny", 4)
    write_job(tmp_path / "sweep" / "2", "tiny", 16)

    def broken(fig, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plots, "save", broken)
    result = run_report(str(tmp_path / "sweep"), "--no-wandb")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "plot(s) failed" in result.stderr


def test_a_failed_jobs_reason_comes_from_error_log_before_the_launchers_log(tmp_path):
    """The submitit launcher appends "Exiting after successful completion" to the job's log after the job
    failed: the reason is error.log's line, whichever log changed last."""
    import os

    from rlsync.report.runs import failure_line

    (tmp_path / "error.log").write_text("rlsync: failed: ValueError: bad shard\n")
    (tmp_path / "rlsync.log").write_text(
        "[2026-12-02 05:00:00,000][submitit][INFO] - Exiting after successful completion\n"
    )
    os.utime(tmp_path / "error.log", (1, 1))  # older than the launcher's line
    assert failure_line(tmp_path) == "rlsync: failed: ValueError: bad shard"
