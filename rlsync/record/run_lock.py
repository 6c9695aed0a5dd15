"""One run per run directory: an OS lock on `DIR/.rlsync.lock`, the holder written inside.

Two runs in one directory (`hydra.run.dir=X` twice, at once) would interleave their metrics.jsonl
and overwrite each other's summary.json. The first run holds `fcntl.flock` on the lock file for its
whole life; a second one cannot take it and stops before it touches anything (exit 2, one line
naming the directory and the holder: pid, host, start time). The kernel drops a flock when its
holder's process dies however it dies (SIGKILL included), so a dead run never blocks the next: the
lock is free, and the holder it left written inside is named in a note as the next run takes over.
A run that ends cleanly empties the file, so a later run sees no holder at all.

Every command that writes into a run directory (python -m rlsync, rlsync.bench, rlsync.plan, rlsync.serve)
takes this lock before anything of it is written: its config sets `hydra.output_subdir: null`, so Hydra
writes no `.hydra/`, and the lock writes Hydra's record (`record`: config.yaml, hydra.yaml, overrides.yaml)
once it holds the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from rlsync.errors import EARLY, BadInput, WriteFailed, os_error_text

LOCK_NAME = ".rlsync.lock"  # what a live run holds an flock on (rlsync.shell.held_by_a_live_run tests it too)


class RunDirBusy(BadInput):
    """Another live run holds this run directory (exit 2; no file of the directory is touched)."""

    writes_error_log = False  # error.log belongs to the run that holds the directory


class RunDirUnusable(BadInput):
    """The run directory cannot be made or written (under a file, too long a path, read-only, full): exit 2, nothing ran."""

    writes_error_log = False  # there is nowhere to write it


def holder_info() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()),
    }


def describe_holder(holder: Optional[dict]) -> str:
    if not holder:
        return "a run that has not written its pid yet"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')}"


def read_holder(fd: int) -> Optional[dict]:
    """What the lock file says (the holder, or the run that held it last and died); None if empty or torn."""
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode("utf-8", errors="replace").strip()
    if not text:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        return {"pid": "?", "host": "?", "started": f"? (unreadable lock file: {text[:40]!r})"}
    return holder if isinstance(holder, dict) else None


class RunLock:
    """`with RunLock(run_dir, record):` holds the directory for this process (then writes Hydra's `record` of
    the job into its .hydra/), or raises RunDirBusy touching nothing."""

    def __init__(self, run_dir: Path, record: Optional[dict[str, str]] = None):
        self.run_dir, self.path = Path(run_dir), Path(run_dir) / LOCK_NAME
        self.record = record or {}  # .hydra/'s files (rlsync.config.launch.hydra_record)
        self.fd: Optional[int] = None

    def __enter__(self) -> RunLock:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            raise RunDirUnusable(
                f"cannot use run directory {self.run_dir}: {os_error_text(err)} ({err.strerror or err}): "
                f"give the run a directory it can write (hydra.run.dir=...)"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(fd)
            os.close(fd)
            raise RunDirBusy(
                f"run directory {self.run_dir} is in use by another run ({describe_holder(holder)}): "
                f"wait for it to end, or give this run its own directory (hydra.run.dir=...)"
            ) from None
        stale = read_holder(fd)
        if stale is not None:  # the lock was free, yet a holder is written: that run died without cleaning up
            print(
                f"rlsync: note: taking over run directory {self.run_dir} from a run that is no longer alive "
                f"({describe_holder(stale)})",
                file=sys.stderr,
                flush=True,
            )
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder_info()) + "\n").encode(), 0)
        except OSError as err:  # a full disk: the lock holds all the same, the holder goes unnamed
            print(f"rlsync: note: cannot write {self.path} ({os_error_text(err)})", file=sys.stderr, flush=True)
        self.fd = fd
        EARLY.started = True  # a signal from now on stops a run, not a command "before the run started"
        self.write_record()
        return self

    def write_record(self) -> None:
        """Hydra's record of the job, now that this process holds the directory (a write it cannot make: the
        directory is let go, and the line names the file)."""
        for name, text in self.record.items():
            path = self.run_dir / ".hydra" / name
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
            except OSError as err:
                self.__exit__()
                raise WriteFailed(path, err) from None

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):  # the lock is released below all the same; the next run only prints a note
            os.ftruncate(self.fd, 0)  # ended cleanly: no holder left to take over
        os.close(self.fd)  # closing drops the flock
        self.fd = None
