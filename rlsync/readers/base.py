"""What every reader of another framework's run is: the `Reader` interface, the `History` it returns,
the registry of readers, and the bounded walk that finds their files under a path.

A reader turns one source format (a W&B offline run, TensorBoard events, verl's file logger, Miles'
dashboard phases, a CSV or JSONL history export) into rows of numbers on the writer's own step axis.
It says nothing of what the keys mean: a framework map (rlsync/readers/frameworks/) does. Adding a
format is one module holding a `Reader` subclass and one line:

    register_reader("mine", "mypackage.mine:MyReader")   # resolved on first use: no import now

Every reader is bounded and leaves its input untouched: files are opened read-only, only if regular
(a FIFO never blocks), within a size limit; a directory walk never follows a symlink and stops at
`MAX_ENTRIES`. Anything it cannot read raises `ReadRefused`, one line naming the file and why.
"""

from __future__ import annotations

import os
import stat
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from rlsync.config.files import UnreadableFile, read_bytes
from rlsync.errors import BadInput
from rlsync.record.run_lock import LOCK_NAME
from rlsync.registry import Registry

STEP = "_step"  # every reader's row holds the writer's own step under this key
CLOCK = "_timestamp"  # and, where the format records it, the row's wall-clock time (seconds)
MAX_ENTRIES = 10_000  # files and folders a walk looks at under one path before it refuses
MAX_DEPTH = 6  # folders below the path it looks into (offline-run-*/ sits 2 below a project's dir)
MAX_ROWS = 1_000_000  # logged steps of one run
MAX_VALUES = 20_000_000  # numbers of one run, all keys together


class ReadRefused(BadInput, ValueError):
    """A run the report cannot read, or cannot answer for: one line naming the input and why (exit 2)."""


@dataclass
class History:
    """One run as another framework logged it: what a reader returns."""

    path: Path  # the file or directory read
    source: str  # the reader's registry name ("wandb", "tensorboard", ...)
    name: str  # the run's label (the W&B run id, the events' directory, the file's stem)
    rows: list[dict[str, float]]  # per logged row, in order: key -> finite number; STEP always, CLOCK where known
    config: dict[str, Any] = field(default_factory=dict)  # the run's config, where the format records one
    hints: tuple[str, ...] = ()  # framework names the format itself implies (Miles' dashboard: "miles")
    device: Optional[str] = None  # the GPU the run recorded, where the format records one ("NVIDIA H200")

    def keys(self) -> set[str]:
        return {k for row in self.rows for k in row}


class Reader(ABC):
    """A source format: which files under a walk are its runs, and how one is read."""

    title: ClassVar[str] = ""  # how messages and the report's column name the format ("W&B offline run")

    @classmethod
    @abstractmethod
    def sources(cls, found: list[Path]) -> list[Path]:
        """The runs among `found` (every regular file of a bounded walk): a file or a directory each."""

    @classmethod
    @abstractmethod
    def read(cls, source: Path) -> History:
        """One run's rows; ReadRefused (one line) for anything that cannot be read."""

    @classmethod
    def addresses(cls, text: str) -> bool:
        """Whether `text`, no local path, names a run this reader fetches from elsewhere (W&B's entity/project/run_id)."""
        return False


READERS: Registry[Reader] = Registry(
    "source format",
    {
        "wandb": "rlsync.readers.wandb_offline:WandbOfflineReader",
        "tensorboard": "rlsync.readers.tensorboard:TensorBoardReader",
        "verl_jsonl": "rlsync.readers.verl_jsonl:VerlJsonlReader",
        "miles_phases": "rlsync.readers.miles_phases:MilesPhasesReader",
        "history": "rlsync.readers.history:HistoryExportReader",
        "wandb_api": "rlsync.readers.wandb_api:WandbApiReader",
    },
)
register_reader = READERS.register
reader_names = READERS.names
reader_class = READERS.resolve


# ----------------------------------------------------------------------------------------------
# Bounded, read-only access to the user's files
# ----------------------------------------------------------------------------------------------


def is_rlsync_run(folder: Path) -> bool:
    """An rlsync run's directory (its run lock, or Hydra's record beside a summary.json): rlsync's own metric
    names match Miles' map, so the readers leave such a folder to the report's own reading."""
    return (folder / LOCK_NAME).exists() or ((folder / ".hydra").is_dir() and (folder / "summary.json").exists())


def walk(path: Path, rlsync_runs: Optional[list[Path]] = None) -> list[Path]:
    """Every regular file at or under `path`: symlinks are not followed (a loop cannot trap the walk),
    at most MAX_DEPTH folders down, and a tree of more than MAX_ENTRIES entries is refused. An rlsync run's
    folder below `path` (is_rlsync_run) is not walked into: it is added to `rlsync_runs` instead."""
    try:
        info = os.stat(path)  # follows the path the user named, once: ELOOP for a loop
    except FileNotFoundError:
        raise ReadRefused(f"{path}: no such file or directory") from None
    except OSError as err:
        raise ReadRefused(f"cannot read {path} ({err.strerror or err})") from None
    if stat.S_ISREG(info.st_mode):
        return [path]
    if not stat.S_ISDIR(info.st_mode):
        raise ReadRefused(f"{path} is {kind_name(info.st_mode)}, not a run's file or directory")
    found, seen, stack = [], 0, [(path, 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    seen += 1
                    if seen > MAX_ENTRIES:
                        raise ReadRefused(
                            f"{path} holds over {MAX_ENTRIES:,} files and folders: point rlsync at one run's "
                            f"directory or file"
                        )
                    if entry.is_dir(follow_symlinks=False) and depth < MAX_DEPTH:
                        if is_rlsync_run(Path(entry.path)):
                            if rlsync_runs is not None:
                                rlsync_runs.append(Path(entry.path))
                            continue
                        stack.append((Path(entry.path), depth + 1))
                    elif entry.is_file(follow_symlinks=False):
                        found.append(Path(entry.path))
        except PermissionError as err:
            raise ReadRefused(f"cannot read {folder} ({err.strerror or err})") from None
        except NotADirectoryError:  # replaced while walked
            continue
    return sorted(found)


def kind_name(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def read_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of a regular file within `max_bytes` (config/files.py's reader); ReadRefused otherwise."""
    try:
        return read_bytes(path, max_bytes=max_bytes)
    except FileNotFoundError:
        raise ReadRefused(f"{path}: no such file") from None
    except UnreadableFile as err:
        raise ReadRefused(str(err)) from None


def read_lines(path: Path, max_bytes: int) -> list[str]:
    """A text file's lines; ReadRefused for one that is not UTF-8."""
    try:
        return read_file(path, max_bytes).decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise ReadRefused(f"{path} is not UTF-8 text") from None


def first_line(path: Path, limit: int = 1 << 16) -> bytes:
    """The file's first line (within its first `limit` bytes), to tell formats apart without reading it
    all; b"" for a file that cannot be opened as a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return b""
    try:
        return os.read(fd, limit).split(b"\n", 1)[0] if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return b""
    finally:
        os.close(fd)


def number(value: Any) -> Optional[float]:
    """A logged value as a float, or None for what is not a number (strings, lists, booleans)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def bounded(rows: list[dict[str, float]], path: Path) -> list[dict[str, float]]:
    """`rows` if within MAX_ROWS and MAX_VALUES; ReadRefused otherwise."""
    if len(rows) > MAX_ROWS or sum(len(r) for r in rows) > MAX_VALUES:
        raise ReadRefused(
            f"{path}: over {MAX_ROWS:,} logged steps or {MAX_VALUES:,} numbers: export the timing keys alone"
        )
    return rows


JSONL_MAX = 1 << 30  # a JSONL log: ~2 KiB a step


def jsonl_objects(path: Path, max_bytes: int = JSONL_MAX) -> list[dict]:
    """Every line of a JSONL file as an object; ReadRefused naming the first line that is not one (a
    torn last line: the writer was stopped mid-write, or is still writing)."""
    import json

    lines = read_lines(path, max_bytes)
    out = []
    for index, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            torn = " (a torn last line: the writer stopped mid-line, or still writes)" if index == len(lines) else ""
            raise ReadRefused(f"{path}: line {index} is not JSON{torn}") from None
        if not isinstance(obj, dict):
            raise ReadRefused(f"{path}: line {index} holds a {type(obj).__name__}, not an object")
        out.append(obj)
    return out
