"""Files a user names (model.config, a checkpoint's config.json, plan.calibration, a run's summary.json):
opened only if they are regular files, read up to a size limit, JSON nested at most so deep.

A FIFO or a device opened for reading blocks until a writer comes, possibly forever: the file is
opened with O_NONBLOCK (which never blocks on a FIFO) and refused unless `fstat` says it is a regular
file. JSON is parsed after its size is checked, and its nesting is bounded (json's own parser
recurses, and so do transformers' deep copies of a config), so a 120 MB or a 200,000-deep file is
one line naming it, not a hang or a RecursionError.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from rlsync.fmt import fmt_bytes

MAX_DEPTH = 64  # JSON nesting: a transformers config.json nests 3 or 4 levels, a calibration file 4
CONFIG_JSON_MAX = 4 << 20  # a model's config.json: the largest published ones are tens of KiB
CALIBRATION_MAX = 64 << 20  # a calibration file: a few KiB per benchmark run it was fitted from
SUMMARY_MAX = 64 << 20  # a run's summary.json: KiB, with its config and per-bucket rows


class UnreadableFile(ValueError):
    """A user's file that is not read: the message says why in a few words and names the file."""


def kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def read_bytes(path: str | Path, *, max_bytes: int) -> bytes:
    """The bytes of the regular file at `path`, at most `max_bytes`; UnreadableFile otherwise (FileNotFoundError
    when it does not exist, so callers can say "no such file" as before)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO opens at once
    except FileNotFoundError:
        raise
    except OSError as err:
        raise UnreadableFile(f"cannot open {path} ({err.strerror or err})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableFile(f"{path} is {kind_of(info.st_mode)}, not a regular file")
        if info.st_size > max_bytes:
            raise UnreadableFile(f"{path} is {fmt_bytes(info.st_size)}, over the limit of {fmt_bytes(max_bytes)}")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as err:
        raise UnreadableFile(f"cannot read {path} ({err.strerror or err})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:  # grew while read
        raise UnreadableFile(f"{path} is over the limit of {fmt_bytes(max_bytes)}")
    return data


def depth(value: Any, limit: int) -> int:
    """How deep `value` (parsed JSON) nests, counted up to `limit` + 1 without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def read_json(path: str | Path, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON in the regular file at `path`, within the size and nesting limits; UnreadableFile otherwise."""
    raw = read_bytes(path, max_bytes=max_bytes)
    try:
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise UnreadableFile(f"{path} nests deeper than {max_depth} levels") from None
    except UnicodeDecodeError:
        raise UnreadableFile(f"{path} is not UTF-8 text") from None
    except ValueError as err:
        raise UnreadableFile(f"{path} is not valid JSON ({err})") from None
    if depth(data, max_depth) > max_depth:
        raise UnreadableFile(f"{path} nests deeper than {max_depth} levels")
    return data
