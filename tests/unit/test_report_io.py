"""What the report writes and reads when its inputs and outputs are hostile, and how it stops: outputs planted
as links or FIFOs, a run given twice, a junk line of metrics.jsonl, a run too deep to be found, a reader of its
output that goes away, a stop signal at any point (issue 42: R44, R51, R54, R57, R58, G15, G16, H05)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_report, write_job

VICTIM_TEXT = "not the report's\n"


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


def leftovers(folder: Path) -> list[str]:
    """The report's files and temporary files in `folder` (what a refused report must not leave), links left out."""
    written = [p for p in folder.iterdir() if not p.is_symlink()]
    return sorted(
        p.name for p in written if (p.name.startswith(("report.", ".")) and p.is_file()) or p.suffix == ".png"
    )


# ----------------------------------------------------------------------------------------------
# Outputs: never written through what sits at their names (R58, R57)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["report.md", "report.csv", "calibration.json", "step_breakdown.png"])
def test_an_output_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path: Path, name: str) -> None:
    run = tmp_path / "run"
    write_job(run, "tiny", 4)
    target = victim(tmp_path)
    (run / name).symlink_to(target)
    result = run_report(str(run), "--no-wandb")
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"refusing to write {run / name}: it is a symbolic link" in lines[0], result.stderr
    assert target.read_text() == VICTIM_TEXT
    assert (run / name).is_symlink()
    assert leftovers(run) == [], "refused before anything was written"


def test_a_fifo_planted_as_report_md_is_refused_without_being_opened(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_job(run, "tiny", 4)
    fifo = run / "report.md"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so that a report writing into it fails this test, not hangs
    try:
        result = run_report(str(run), "--no-wandb")
        written = os.read(reader, 1 << 16)
    finally:
        os.close(reader)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"refusing to write {fifo}: it is a FIFO" in result.stderr
    assert written == b""


def test_a_link_planted_while_a_file_is_written_is_replaced_not_followed(tmp_path: Path) -> None:
    from rlsync.report.output import RefusedTarget, replacing

    target = victim(tmp_path)
    path = tmp_path / "report.md"
    with pytest.raises(RefusedTarget), replacing(path) as f:
        f.write("# report\n")
        path.symlink_to(target)  # planted after the first check
    assert target.read_text() == VICTIM_TEXT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "victim.txt"], "no temporary file left"


def test_a_file_stopped_midway_keeps_the_previous_one_whole_and_no_temporary_file(tmp_path: Path) -> None:
    from rlsync.report.output import replacing, write_text

    path = tmp_path / "report.md"
    write_text(path, "# the previous report\n")
    with pytest.raises(KeyboardInterrupt), replacing(path) as f:
        f.write("# half of the next")
        raise KeyboardInterrupt
    assert path.read_text() == "# the previous report\n"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask, "the permissions a plain open() gives, not mkstemp's 0o600"


# ----------------------------------------------------------------------------------------------
# Inputs: each run once, steps only, the search depth said (R54, R44, R51)
# ----------------------------------------------------------------------------------------------


def test_a_run_given_twice_or_also_through_its_sweep_is_reported_once(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    write_job(sweep / "0", "tiny", 1)
    write_job(sweep / "1", "tiny", 4)
    out = tmp_path / "out"
    result = run_report(str(sweep / "0"), str(sweep / "0"), "--no-wandb", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "(1 run, 0 failed)" in result.stdout
    assert f"note: {sweep / '0'}: given twice, read once" in result.stdout
    result = run_report(str(sweep), f"{sweep}/../sweep/1", "--no-wandb", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "(2 runs, 0 failed)" in result.stdout, result.stdout
    assert len((out / "report.csv").read_text().splitlines()) == 3  # the header and two runs


def test_a_junk_line_or_one_too_long_is_not_a_measured_step(tmp_path: Path) -> None:
    from rlsync.report.runs import LINE_MAX, load_job

    run = tmp_path / "run"
    write_job(run, "tiny", 4, with_summary=False)  # incomplete: its steps are counted from metrics.jsonl
    before = load_job(run)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 99, "junk": "x" * (2 * LINE_MAX)}) + "\n")
        f.write(json.dumps({"step": 100, "junk": "y"}) + "\n")
    after = load_job(run)
    assert after.measured_steps == before.measured_steps
    assert after.stats == before.stats
    assert any("1 line over 1.00 MiB skipped unread" in note for note in after.notes), after.notes
    assert any("1 line with no time in it skipped (not a step)" in note for note in after.notes), after.notes
    result = run_report(str(run), "--no-wandb")
    assert "skipped unread" in result.stdout, result.stdout


def test_a_run_deeper_than_the_search_names_the_depth(tmp_path: Path) -> None:
    deep = tmp_path / "top"
    for level in range(8):  # below rlsync's own level and other frameworks' walk
        deep = deep / f"d{level}"
    write_job(deep, "tiny", 4)
    result = run_report(str(tmp_path / "top"), "--no-wandb")
    assert result.returncode == 1
    assert f"no run directories found within 1 level under {tmp_path / 'top'}" in result.stderr
    assert "Finding the runs" in (ROOT / "docs" / "report.md").read_text()


def test_an_rlsync_run_below_another_folder_is_read_as_rlsyncs_not_as_an_export(tmp_path: Path) -> None:
    """rlsync's metric names match Miles' map: the readers' deeper walk hands rlsync's runs to the report."""
    write_job(tmp_path / "top" / "a" / "b", "tiny", 4)
    result = run_report(str(tmp_path / "top"), "--no-wandb", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "(1 run, 0 failed)" in result.stdout, result.stdout
    assert "Miles" not in result.stdout and "history export" not in result.stdout


# ----------------------------------------------------------------------------------------------
# Its output's reader goes away; a stop signal anywhere (H05, G15, G16)
# ----------------------------------------------------------------------------------------------


class ClosedPipe(io.StringIO):
    """stdout whose reader went away (`| head -n 1`): every write after the first line fails."""

    def write(self, text: str) -> int:
        if self.getvalue().count("\n") >= 1:
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(text)


def test_a_reader_of_its_output_that_goes_away_stops_nothing(tmp_path: Path) -> None:
    from rlsync.report import main

    run = tmp_path / "run"
    write_job(run, "tiny", 4)
    err = io.StringIO()
    with contextlib.redirect_stdout(ClosedPipe()), contextlib.redirect_stderr(err):
        code = main([str(run), "--no-wandb"])
    assert code == 0, err.getvalue()
    assert "BrokenPipe" not in err.getvalue()
    assert (run / "report.md").exists() and (run / "report.csv").exists()


class Stopped(BaseException):
    """What this test's own handler raises, had the report not taken the signals: a clean failure, not pytest's end."""


@pytest.fixture
def own_sigint():
    def handler(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGINT, handler)
    yield handler
    signal.signal(signal.SIGINT, previous)


def test_a_signal_while_the_runs_are_read_stops_the_report_with_its_line(tmp_path, monkeypatch, own_sigint) -> None:
    from rlsync.errors import EARLY
    from rlsync.report import runs

    for i in range(3):
        write_job(tmp_path / "sweep" / str(i), "tiny", 4)
    read = runs.load_job

    def load_and_stop(run_dir, sweep=None):
        if run_dir.name == "1":
            os.kill(os.getpid(), signal.SIGINT)
        return read(run_dir, sweep)

    monkeypatch.setattr(runs, "load_job", load_and_stop)
    result = run_report(str(tmp_path / "sweep"), "--no-wandb")
    assert result.returncode == 130, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == ["rlsync.report: interrupted: stopped by SIGINT"]
    assert not (tmp_path / "sweep" / "report.md").exists()
    assert signal.getsignal(signal.SIGINT) is own_sigint, "the caller's handler is back"
    assert EARLY.pending is None and not EARLY.raising


def test_a_signal_that_library_code_swallows_still_stops_the_report(tmp_path, monkeypatch, own_sigint) -> None:
    """matplotlib's weakref callbacks and `__del__`s print and drop an exception raised in them: the stop
    is acted on at the next plot (G16: a report still running long after Ctrl-C)."""
    from rlsync.report import plots

    run = tmp_path / "run"
    write_job(run, "tiny", 4)

    def swallowing(rows, fits, path):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the handler runs here
        except BaseException:  # noqa: BLE001 - what a callback's caller does with it
            pass
        return None

    monkeypatch.setitem(plots.PLOTS, "step_breakdown.png", swallowing)
    result = run_report(str(run), "--no-wandb")
    assert result.returncode == 130, result.stdout + result.stderr
    assert "rlsync.report: interrupted: stopped by SIGINT" in result.stderr
    assert not (run / "report.md").exists()
