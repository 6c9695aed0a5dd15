"""Runs that other RL frameworks made, read and answered as rlsync's own: which files under a path are
runs (each registered reader's `sources`), each read into a `History` (base.py) and answered through its
framework's map (frameworks/, answer.py). `python -m rlsync.report` asks `imported_runs` for every path
that is not an rlsync run or sweep (rlsync/report/imported.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from rlsync.readers.answer import Answer, answer
from rlsync.readers.base import History, ReadRefused, reader_class, reader_names, walk

__all__ = ["Answer", "History", "ReadRefused", "find_sources", "imported_runs"]


def find_sources(path: Path, rlsync_runs: Optional[list[Path]] = None) -> list[tuple[str, Path]]:
    """(reader name, source) for every run any reader finds at or under `path` (a bounded walk); a `path` that
    is no local file but a run's address (W&B's entity/project/run_id), the reader that fetches it. rlsync's
    own runs met on the way are added to `rlsync_runs`, not read."""
    if not os.path.lexists(path):
        remote = [name for name in reader_names() if reader_class(name).addresses(str(path))]
        if remote:
            return [(remote[0], path)]
    found = walk(path, rlsync_runs)
    out, claimed = [], set()
    for name in reader_names():
        for source in reader_class(name).sources(found):
            if source not in claimed:
                claimed.add(source)
                out.append((name, source))
    return out


def imported_runs(
    path: Path,
    *,
    framework: Optional[str] = None,
    warmup: Optional[int] = None,
    rlsync_runs: Optional[list[Path]] = None,
) -> list[Answer]:
    """Every run another framework left at or under `path`, answered; [] when none is there (rlsync's own runs
    under it go to `rlsync_runs`). ReadRefused (one line) for a run that cannot be read or answered: nothing at
    the path is written."""
    return [
        answer(reader_class(name).read(source), framework=framework, warmup=warmup)
        for name, source in find_sources(path, rlsync_runs)
    ]
