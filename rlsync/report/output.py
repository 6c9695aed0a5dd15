"""How the report writes its files (report.md, report.csv, calibration.json, the plots): each one whole or
not at all, and never through whatever already sits at its name.

A name that is a symbolic link, a FIFO, a directory or anything but a regular file is refused with one line
naming it (`RefusedTarget`, exit 1), before the report writes anything and again right before each file
replaces its name; it is never opened (a FIFO opened for writing blocks until a reader comes). Each file is
written to a fresh temporary file beside it (created exclusively, so nothing can be planted there) and renamed
over its name, which replaces a link rather than following it: a report stopped or failing midway leaves the
previous file or none, never half of one, and no temporary file.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from rlsync.config.files import kind_of
from rlsync.errors import RlsyncError, WriteFailed


class RefusedTarget(RlsyncError):
    """An output name that holds something other than a regular file: nothing is written through it."""

    def __init__(self, path: Path, what: str):
        super().__init__(
            f"refusing to write {path}: it is {what}, not a regular file; remove it, or give another --out"
        )


def what_is_there(path: Path) -> str | None:
    """What `path` names when it is not a regular file (a symbolic link, a FIFO, ...), None when it is one or
    nothing is there. lstat: a link is looked at, not followed; nothing is opened."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise WriteFailed(path, err) from None
    if stat.S_ISLNK(info.st_mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    return None if stat.S_ISREG(info.st_mode) else kind_of(info.st_mode)


def check_targets(paths: Iterable[Path]) -> None:
    """RefusedTarget for the first of `paths` that holds something other than a regular file."""
    for path in paths:
        if (what := what_is_there(path)) is not None:
            raise RefusedTarget(path, what)


def file_mode() -> int:
    """A new file's permissions as open() would give them (0o666 less the umask): mkstemp's are 0o600."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextmanager
def replacing(path: Path, mode: str = "w", **open_args) -> Iterator[IO]:
    """`with replacing(path) as f: f.write(...)`: `f` is a temporary file beside `path`, renamed over it when the
    block ends; removed instead when the block raises (an error, a stop signal). `mode` "w" (text, UTF-8 unless
    `encoding`) or "wb"; a refused write (full disk, read-only) is WriteFailed naming `path`."""
    path = Path(path)
    check_targets([path])
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise WriteFailed(path, err) from None
    try:
        if "b" not in mode:
            open_args.setdefault("encoding", "utf-8")
        with os.fdopen(fd, mode, **open_args) as f:
            os.fchmod(f.fileno(), file_mode())
            yield f
            f.flush()
            os.fsync(f.fileno())
        check_targets([path])  # planted while this file was written: still not written through
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise WriteFailed(path, err) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    """`path` holds `text` (UTF-8), whole, or is left as it was."""
    with replacing(path) as f:
        f.write(text)
