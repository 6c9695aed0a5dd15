"""How a run ends when it does not finish: errors a user can act on, and interruptions.

The entry points (rlsync.shell) print an error as one line on stderr and exit with its `exit_code`, never a
traceback (RLSYNC_DEBUG=1 shows it): a bad value exits 2, a run that failed exits 1, a run
stopped by SIGINT, SIGTERM or SIGHUP exits 128 + the signal (130, 143, 129), as shells report it.
Hydra's own composition errors (unknown key, wrong type, unknown group choice) are translated
here into the same one-line `ConfigError`.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from rlsync.fmt import error_line, first_line

DEBUG_ENV = "RLSYNC_DEBUG"  # =1: print the full traceback as well
# The YAML configs every entry point reads (pkg://rlsync.conf); here, below rlsync.config, as from_hydra reads it
CONF_DIR = Path(__file__).resolve().parent / "conf"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class RlsyncError(Exception):
    """An error whose message says what to do: printed as one line, no traceback."""

    exit_code = 1


class BadInput(RlsyncError):
    """Input that cannot run (exit 2): a bad config value, or an override Hydra cannot apply."""

    exit_code = 2


class ConfigError(BadInput, ValueError):
    """A config value that cannot run: names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str, problem: str = "not allowed"):
        self.key, self.value, self.allowed, self.problem = key, value, allowed, problem
        super().__init__(f"{key}={show(value)}: {problem} (allowed: {allowed})")

    def __reduce__(self):
        return type(self), (self.key, self.value, self.allowed, self.problem)


def show(value: Any) -> str:
    """A value as it is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and not value.strip():
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(show(v) for v in value) + "]"
    return str(value)


class BrokenInstall(RlsyncError):
    """rlsync's own files are missing from its install (its configs): reinstalling fixes it, not the command line."""

    exit_code = 3


class UpdateOutOfMemory(RlsyncError):
    """The device ran out of memory inside the weight update: the bucket size is the knob."""

    def __init__(
        self,
        *,
        bucket_mb: float,
        largest_bucket_mb: float,
        largest_tensor_mb: float,
        inflight: int,
        phase: str = "during the weight update",
    ):
        smaller = bucket_mb / 2
        advice = f"try a smaller update.bucket_mb (e.g. update.bucket_mb={smaller:g})"
        if largest_tensor_mb >= smaller:
            advice += (
                f"; the largest tensor ({largest_tensor_mb:.0f} MiB) always travels whole, so also "
                f"free memory elsewhere (update.source=host, trainer.offload)"
            )
        if inflight > 1:
            advice += f", or update.inflight_buckets=1 (now {inflight} staging buffers)"
        super().__init__(
            f"out of device memory {phase} with update.bucket_mb={bucket_mb:g} "
            f"(largest bucket {largest_bucket_mb:.0f} MiB): {advice}"
        )


# errno -> what it means for a file we write, in words a user acts on
WRITE_PROBLEMS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "the file is too large for this file system or its size limit (ulimit -f)",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EISDIR: "it is a directory",
    errno.EEXIST: "a file of that name is in the way",
    errno.ENOENT: "its directory does not exist",
    errno.EIO: "an I/O error (the disk failed)",
    errno.ENAMETOOLONG: "the path is too long",
    errno.ELOOP: "the path has a symbolic link where none is allowed, or too many",
}


def os_error_text(err: OSError) -> str:
    """An OSError as a reason: the errno's meaning for a write, else the system's own words."""
    return WRITE_PROBLEMS.get(err.errno, err.strerror or type(err).__name__)


class WriteFailed(RlsyncError):
    """A file could not be written (disk full, read-only, not a directory): the line names the file."""

    def __init__(self, path: Path, err: OSError, then: str = ""):
        self.path, self.err = Path(path), err
        super().__init__(f"cannot write {path}: {os_error_text(err)} ({err.strerror or err}){then}")


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP: the run stops, keeps its finished steps, and exits 128 + signal."""

    def __init__(self, signum: int):
        self.signum, self.exit_code = signum, 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class StopOnSignals:
    """Within `with StopOnSignals() as stop:`, SIGINT, SIGTERM and SIGHUP (a closed terminal) raise
    `Interrupted` in the main thread.

    Python runs the handler between bytecodes, so the step in progress stops after its current
    operation and is dropped; the caller's `finally` keeps what finished. Inside `stop.deferred()`
    (recording a finished step) the signal waits for the block to end, so a step is recorded whole
    or not at all. A second signal while the first is being handled exits at once: the finished
    steps are on disk already, only the summary is lost.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __enter__(self) -> StopOnSignals:
        self.pending: Optional[int] = None
        self.raised = False
        self.deferring = False
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.raised or self.pending is not None:
            print(
                f"rlsync: {signal.Signals(signum).name} again: exiting now without the summary "
                f"(metrics.jsonl keeps the finished steps)",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)
        if self.deferring:
            self.pending = signum
            return
        self.raised = True
        raise Interrupted(signum)

    def ending(self):
        """While the run is already stopping (naming what stopped it): a signal now is absorbed, not raised
        in the middle (a data-parallel rank 0 reading another rank's failure from the store was cut short
        by the launcher's SIGTERM, and reported the SIGTERM instead)."""
        return self.deferred(absorb=True)

    @contextmanager
    def deferred(self, *, absorb: bool = False):
        """A signal within the block waits for its end, then raises; `absorb`: the stop is under way, it is
        not raised (a second signal still exits at once)."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
            if self.pending is not None and absorb:
                self.raised = True
        if self.pending is not None and not self.raised:
            self.raised = True
            raise Interrupted(self.pending)


# ----------------------------------------------------------------------------------------------
# Hydra's composition errors -> ConfigError
# ----------------------------------------------------------------------------------------------


def from_hydra(err: BaseException) -> Optional[RlsyncError]:
    """The ConfigError (or BadInput) a Hydra/OmegaConf composition error stands for, BrokenInstall when the
    install lacks its configs; None for anything else."""
    if (
        isinstance(err, MissingConfigException)
        and "primary config" in str(err).lower()
        and not any(CONF_DIR.glob("*.yaml"))
    ):
        return BrokenInstall(
            f"installation error: this rlsync install has no configs ({CONF_DIR} holds no *.yaml; "
            f"Hydra: {first_line(err)}): reinstall rlsync (pip install -e . in a checkout, or a wheel "
            f"built by pip wheel . from one)"
        )
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, _, choice = err.missing_cfg_file.rpartition("/")
        return ConfigError(
            group.replace("/", "."), choice, ", ".join(err.options or []) or "no options", "unknown choice"
        )
    if isinstance(err, OverrideParseException):
        key, _, value = (err.override or "override=").partition("=")
        allowed = "key=value in Hydra's override grammar"
        if value.startswith("[") and "]:" in value:  # [v6]:port reads as a list to Hydra: it must be quoted
            allowed = f"an IPv6 HOST:PORT quoted for Hydra, inside the shell's quotes: '{key}=\"{value}\"'"
        return ConfigError(key, value, allowed, f"cannot parse ({first_line(err.message)})")
    cause = err if isinstance(err, OmegaConfBaseException) else err.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        key, value = cause.full_key, override_value(err, cause.full_key, cause.value)
        if isinstance(cause, ConfigKeyError) or "not in" in first_line(cause.msg):
            return ConfigError(key, value, sibling_keys(cause), "unknown key")
        if isinstance(cause, ValidationError) and "is not a subclass of" in first_line(cause.msg):
            # `update=fast`: a node of the schema with no config group in conf/ to choose from
            return ConfigError(key, value, "a config group in conf/, or key.subkey=value", "unknown config group")
        if isinstance(cause, ValidationError):
            return ConfigError(key, value, type_phrase(cause), "wrong type")
    message = first_line(str(err))
    if isinstance(err, ValueError) and "Config group override must be a string" in message:  # `model=null`
        for arg in sys.argv[1:]:
            group, _, value = arg.lstrip("+~").partition("=")
            if value in ("null", "None", "") and (CONF_DIR / group).is_dir():
                options = ", ".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))
                return ConfigError(group, None, options, "no choice (the run needs one)")
        return BadInput(f"bad config: a config group set to null ({message})")
    if "No match in the defaults list" in str(err):  # `update=x` where conf/ has no such group
        group = message.split("'")[1] if "'" in message else message
        return ConfigError(
            group,
            override_value(err, group, ""),
            "a config group in conf/, or key.subkey=value",
            "unknown config group",
        )
    if isinstance(err, HydraException) or isinstance(cause, OmegaConfBaseException):
        return BadInput(f"bad config: {message}" + (f": {first_line(cause)}" if cause is not None else ""))
    return None


def unusable_dir(err: BaseException) -> Optional[BadInput]:
    """An OSError naming a path before any job ran: Hydra could not make the run (or sweep) directory
    (under a file such as /dev/null, too long a path, a read-only or full disk)."""
    if not isinstance(err, OSError) or not err.filename:
        return None
    return BadInput(
        f"cannot create {err.filename}: {os_error_text(err)} ({err.strerror or err}): give the run a "
        f"directory it can write (hydra.run.dir=..., or hydra.sweep.dir=... with -m)"
    )


def override_value(err: BaseException, key: str, fallback: Any) -> Any:
    """The value the user typed for `key` (the override in Hydra's message), else `fallback`."""
    for text in (str(err), str(err.__cause__ or "")):
        for token in text.replace("'", " ").split():
            name, sep, value = token.lstrip("+~").partition("=")
            if sep and name == key:
                return value
    return fallback


def sibling_keys(cause) -> str:
    """The keys that do exist next to the unknown one."""
    node = getattr(cause, "parent_node", None)
    if node is None and getattr(cause, "object_type", None) is not None:
        if is_dataclass(cause.object_type):
            return ", ".join(f.name for f in fields(cause.object_type))
    try:
        keys = [k for k in node.keys() if k != "hydra"]
    except Exception:  # noqa: BLE001 - the message still names key and value
        return "a key of the schema in rlsync/config/schema.py"
    return ", ".join(str(k) for k in keys)


def type_phrase(cause) -> str:
    msg = first_line(cause.msg)
    for marker, phrase in (
        ("Integer", "an integer"),
        ("Float", "a number"),
        ("bool", "true or false"),
        ("ListConfig", "a list such as [a,b]"),
        ("String", "a string"),
    ):
        if marker in msg:
            return phrase
    return msg


# ----------------------------------------------------------------------------------------------
# Each error's line and exit code: what the entry points print and exit with (rlsync.shell)
# ----------------------------------------------------------------------------------------------


def describe(err: BaseException) -> str:
    if isinstance(err, ConfigError):
        return f"config error: {err}"
    if isinstance(err, KeyboardInterrupt):
        return f"interrupted: {err if isinstance(err, Interrupted) else 'stopped by SIGINT'}"
    if isinstance(err, RlsyncError):
        return str(err)
    return f"failed: {error_line(err)}"


def exit_code(err: BaseException) -> int:
    if isinstance(err, (RlsyncError, Interrupted)):
        return err.exit_code
    if isinstance(err, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1
