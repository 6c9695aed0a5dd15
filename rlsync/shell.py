"""The entry points' shell: one line per error, one exit code per kind.

Every entry point (python -m rlsync, rlsync.bench, rlsync.serve, rlsync.plan) runs its `@hydra.main` app
through `cli`: Hydra's error printing is replaced by the error's one line (rlsync.errors.describe) and
its exit code (rlsync.errors.exit_code), stdout and stderr survive a reader that goes away (PipeSafe),
and a sweep that ends early still gets its report (SWEEP_ENDED). Around each job `job_errors` does the
same, writing the traceback to the run directory's error.log.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from rlsync.errors import DEBUG_ENV, EARLY, BadInput, debug_enabled, describe, exit_code, translate, unusable_dir
from rlsync.record.run_lock import LOCK_NAME


class JobFailed(Exception):
    """A sweep job's error, reported by the job: Hydra marks the job failed and runs the next one.

    Picklable (its args are its fields), so a launcher that runs jobs in other processes can return it.
    """

    def __init__(self, exit_code: int, line: str):
        super().__init__(exit_code, line)
        self.exit_code, self.line = exit_code, line

    def __str__(self) -> str:
        return self.line


REPORTED: list[str] = []  # the lines job_errors printed in this process (a remote job's went to its own log)
# What a sweep in progress does when it ends before Hydra's own end (a failed job: Hydra skips on_multirun_end;
# an interruption): called with "failed" or "interrupted". rlsync.report.sweep_callback registers its report.
SWEEP_ENDED: list[Callable[[str], None]] = []
# the exit codes of a stop signal (rlsync.errors.stop_signals: SIGUSR1 / SIGUSR2 stop a run as SIGTERM does)
INTERRUPTED_CODES = tuple(
    128 + s for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
)


def kept(run_dir: Path, *, since: float) -> str:
    """What a stopped run left on disk (a summary.json written since `since`), for the end of its error line."""
    path = run_dir / "summary.json"
    try:
        if path.stat().st_mtime < since:
            return ""
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    return (
        f"; {summary.get('steps_finished', 0)} finished step(s) kept in {run_dir} "
        f"(summary.json status {summary.get('status')})"
    )


@contextmanager
def job_errors(
    run_dir: Optional[Path],
    *,
    sweep_job: Optional[str] = None,
    rank: int = 0,
    hydra_record: Optional[dict[str, str]] = None,
):
    """Around one job: any error becomes one line on stderr (the traceback goes to run_dir/error.log;
    `run_dir=None`, as in data-parallel ranks > 0, which write nothing: stderr only, their line
    starting with "rank N:").

    A single run exits with the error's code. A sweep's job raises `JobFailed`, so Hydra marks it
    failed and goes on with the next job; an interruption stops the whole sweep. `hydra_record`
    (.hydra/'s files, which the run writes once it holds its directory) goes beside error.log, so a
    report finds a job that failed before that.
    """
    started = time.time()
    try:
        EARLY.check()  # the job starts: a signal since the command started (swallowed on the way) stops it here
        yield
    except SystemExit:
        raise
    except BaseException as err:
        shown = translate(err) or err
        EARLY.reported(shown)
        ran = run_dir is not None and not isinstance(shown, BadInput)  # a run that may have kept finished steps
        line = describe(shown) + (kept(run_dir, since=started) if ran else "")
        if run_dir is not None and getattr(shown, "writes_error_log", True):  # not in a directory another run holds
            write_error_log(run_dir, line, hydra_record)
        if debug_enabled():
            traceback.print_exc()
        prefix = (f"job {sweep_job}: " if sweep_job is not None else "") + (f"rank {rank}: " if rank else "")
        print(f"rlsync: {prefix}{line}", file=sys.stderr, flush=True)
        REPORTED.append(line)
        if sweep_job is None or isinstance(err, KeyboardInterrupt):
            raise SystemExit(exit_code(shown)) from None
        raise JobFailed(exit_code(shown), line) from err


def held_by_a_live_run(run_dir: Path) -> bool:
    """Whether another live run holds `run_dir` (its flock on the lock file): nothing of its may be written."""
    import fcntl

    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops our shared lock, if we took it
    return False


def write_error_log(run_dir: Path, line: str, hydra_record: Optional[dict[str, str]] = None) -> None:
    """The traceback and the line, where a report over the sweep finds them (`*.log`); never into a
    directory another live run holds (a second command refused on bad input touches nothing of it)."""
    if held_by_a_live_run(run_dir):
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "error.log").write_text(traceback.format_exc() + f"Error: {line}\n", encoding="utf-8")
        for name, text in (hydra_record or {}).items():
            (run_dir / ".hydra").mkdir(exist_ok=True)
            (run_dir / ".hydra" / name).write_text(text, encoding="utf-8")
    except OSError:
        pass  # the line on stderr is what matters


HYDRA_REPEAT = "Error executing job with overrides: "  # what Hydra writes to stderr for each failed sweep job


class PipeSafe:
    """A text stream (stdout, stderr) whose reader may go away (`| head -n 2`): then what is written
    goes to /dev/null instead of raising BrokenPipeError, so the run goes on and keeps its files."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        if text.startswith(HYDRA_REPEAT) and REPORTED:  # Hydra's repeat of a failed job our line named already
            return len(text)
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()
            with contextlib.suppress(OSError):
                self._stream.flush()  # what was buffered goes to /dev/null now

    def _to_devnull(self) -> None:
        """Point the stream's file descriptor at /dev/null: later writes (ours, the interpreter's at exit) succeed."""
        try:
            fd = self._stream.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass  # not a file (a test's buffer): there is nothing to break

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextmanager
def pipe_safe_output():
    """Within the block sys.stdout and sys.stderr are PipeSafe; both are flushed on the way out."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = PipeSafe(saved[0]), PipeSafe(saved[1])
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = saved


def end_sweep(how: str) -> None:
    """The sweep in progress ended early: its report (or how to make it), once; never raises."""
    while SWEEP_ENDED:
        hook = SWEEP_ENDED.pop()
        try:
            hook(how)
        except Exception as err:  # noqa: BLE001 - the sweep's own outcome is what the user must see
            print(f"rlsync: the sweep report failed ({describe(err)})", file=sys.stderr, flush=True)


def cli(app: Callable[[], Any]) -> None:
    """Run a `@hydra.main` app with Hydra's error printing replaced by one line and an exit code.

    HYDRA_FULL_ERROR=1 makes Hydra re-raise what it would print (several lines, exit 1); we print
    the one line. RLSYNC_DEBUG=1 (or HYDRA_FULL_ERROR=1 set by the user) prints the traceback too.
    A reader of stdout or stderr that goes away (`| head`) stops nothing (PipeSafe).
    """
    previous = EARLY.install()  # the signals from here on, if the entry did not take them at its first line
    EARLY.started = False  # until this command holds its run directory
    raising, EARLY.raising = EARLY.raising, True
    try:
        with pipe_safe_output():
            _run_app(app)
    finally:
        EARLY.raising = raising
        for sig, handler in previous.items():  # in this process's caller (a test): its own handlers back
            signal.signal(sig, handler)
        if quiet_after_the_last_line not in QUIET:
            QUIET.append(quiet_after_the_last_line)
            atexit.register(quiet_after_the_last_line)


QUIET: list[Callable[[], None]] = []  # registered once per process, after the libraries' own exit hooks


def quiet_after_the_last_line() -> None:
    """At exit, after rlsync's last line: no library's INFO log (torch's 'FakeTensor cache stats', printed by
    an atexit hook through Hydra's logging when torch's own logging setup was cut short by a signal)."""
    logging.disable(logging.INFO)


def _run_app(app: Callable[[], Any]) -> None:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        os.environ[DEBUG_ENV] = "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        EARLY.check()  # a signal during the entry's imports
        app()
        EARLY.check()  # one that something swallowed after all: the command still ends as it asked
    except SystemExit as stop:
        if stop.code in INTERRUPTED_CODES:
            end_sweep("interrupted")
        raise
    except JobFailed as err:  # a sweep with failed jobs: each one printed its line, here or in its own log
        if err.line not in REPORTED:
            print(f"rlsync: a sweep job failed: {err.line}", file=sys.stderr, flush=True)
        end_sweep("failed")
        sys.exit(err.exit_code)
    except BaseException as err:  # noqa: BLE001 - composition errors, Ctrl-C before the run
        shown = translate(err) or unusable_dir(err) or err
        EARLY.reported(shown)
        if isinstance(shown, KeyboardInterrupt):
            end_sweep("interrupted")
        if debug_enabled():
            traceback.print_exc()
        print(f"rlsync: {describe(shown)}", file=sys.stderr, flush=True)
        sys.exit(exit_code(shown))
