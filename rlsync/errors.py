"""How a run ends when it does not finish: errors a user can act on, and interruptions.

The entry points (rlsync.shell) print an error as one line on stderr and exit with its `exit_code`, never a
traceback (RLSYNC_DEBUG=1 shows it): a bad value exits 2, a run that failed exits 1, a run
stopped by SIGINT, SIGTERM or SIGHUP exits 128 + the signal (130, 143, 129), as shells report it.
Hydra's own composition errors (unknown key, wrong type, unknown group choice) are translated
here into the same one-line `ConfigError`. This module imports nothing heavy (Hydra only when an error is
translated): each entry point's first line installs its signal handlers from here (`signals_from_here`).
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

from rlsync.fmt import error_line, first_line

DEBUG_ENV = "RLSYNC_DEBUG"  # =1: print the full traceback as well
# The YAML configs every entry point reads (pkg://rlsync.conf); here, below rlsync.config, as from_hydra reads it
CONF_DIR = Path(__file__).resolve().parent / "conf"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


# c10d's C++ warnings (a store's or a group's timeout, its socket polls) come before rlsync's one line and say
# the same. torch reads this once, as it loads, so it is set here (each entry point imports this module first,
# and the processes it starts inherit it); RLSYNC_DEBUG=1 or the user's own TORCH_CPP_LOG_LEVEL keeps them.
if not debug_enabled():
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


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


# ----------------------------------------------------------------------------------------------
# What the system refused, anywhere: a full disk, out of memory, a process limit -> one line naming it
# ----------------------------------------------------------------------------------------------

WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)  # the file system refused a write
MEMORY_WORDS = ("failed to map segment", "cannot allocate memory", "out of memory")  # dlopen's, mmap's words
LIMIT_WORDS = ("resource temporarily unavailable", "can't start new thread", "thread creation failed", "pthread_create")


def causes(err: BaseException) -> list[BaseException]:
    """`err` and what it was raised from or during, outermost first (each once)."""
    found: list[BaseException] = []
    while err is not None and err not in found:
        found.append(err)
        err = err.__cause__ or err.__context__
    return found


def file_being_written(err: BaseException) -> Optional[str]:
    """The file an OSError without a file name was writing: an open file, or the Path written, in the frames
    it was raised through, innermost first (`Path.write_text`, `json.dump(obj, fh)`, `fh.write(...)`)."""
    frames, tb = [], err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for name, value in frame.f_locals.items():
            if isinstance(value, Path) and name == "self" and frame.f_code.co_name.startswith(("write", "open")):
                return str(value)
            mode = getattr(value, "mode", None)
            writable = isinstance(mode, str) and any(c in mode for c in "wax+")
            if hasattr(value, "write") and isinstance(getattr(value, "name", None), str) and writable:
                return value.name
    return None


def write_failure(err: BaseException) -> Optional[RlsyncError]:
    """A write the file system refused (full, over quota, past `ulimit -f`, read-only), wherever it happened:
    one line naming the file (exit 1), as rlsync's own writers say it."""
    for e in causes(err):
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            path = e.filename or file_being_written(e)
            if path:
                return WriteFailed(path, e)
            return RlsyncError(f"cannot write a file: {os_error_text(e)} ({e.strerror or e})")
    return None


class OutOfMemory(RlsyncError):
    """The process ran out of (address-space) memory where Python could still say so (exit 1)."""


def memory_limit() -> str:
    """What bounds this process's memory, for the advice: `ulimit -v` when it is set."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return "free host memory, or run a smaller model"
    return (
        f"this process's address space is limited to {soft / 2**30:.2g} GiB (ulimit -v {soft // 1024}): raise the limit"
    )


def importing(err: BaseException) -> Optional[str]:
    """The package an ImportError was raised in (its innermost frame's module), e.g. numpy for its C library."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    name = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return name.split(".")[0] or getattr(err, "name", None)


def out_of_memory(err: BaseException) -> Optional[OutOfMemory]:
    """A MemoryError, or a shared library that could not be mapped, anywhere in `err`'s chain: out of memory,
    not the bad config or the failed import it surfaced as (Hydra: "Error locating target ...")."""
    chain = causes(err)
    for e in reversed(chain):  # innermost first: the library that could not be mapped
        text = str(e).lower()
        if isinstance(e, MemoryError) or (
            isinstance(e, (ImportError, OSError))
            and (getattr(e, "errno", None) == errno.ENOMEM or any(w in text for w in MEMORY_WORDS))
        ):
            where = importing(e) if isinstance(e, ImportError) else None
            what = f"while importing {where} " if where else ""
            return OutOfMemory(f"out of memory {what}({error_line(e)}): {memory_limit()}")
    return None


def process_limit(err: BaseException) -> Optional[RlsyncError]:
    """A thread or process that could not be started (EAGAIN), anywhere in `err`'s chain: one line naming the
    limit on this user's processes and threads (`ulimit -u`) when one is set."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    for e in causes(err):
        if isinstance(e, BlockingIOError):  # EAGAIN of a non-blocking socket or pipe: no limit of ours
            continue
        text = str(e).lower()
        spawning = any(w in text for w in LIMIT_WORDS[1:])  # says a thread could not be made
        if soft != resource.RLIM_INFINITY and (spawning or any(w in text for w in LIMIT_WORDS[:1])):
            limit = f"this user may run {soft} processes and threads (ulimit -u {soft}): raise the limit or stop some"
        elif spawning:
            limit = "the machine's limit on processes and threads (kernel.threads-max, pid_max) was reached"
        else:
            continue
        return RlsyncError(f"cannot start a thread or process ({error_line(e)}): {limit}")
    return None


def translate(err: BaseException) -> Optional[BaseException]:
    """The one-line error `err` stands for (out of memory, a Hydra composition error, a refused write, a process
    limit); None when it is to be shown as it is."""
    if isinstance(err, (RlsyncError, KeyboardInterrupt)):
        return None
    return out_of_memory(err) or from_hydra(err) or write_failure(err) or process_limit(err)


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP (SIGUSR1, SIGUSR2 where nothing else claims them): the run stops, keeps its
    finished steps, and exits 128 + signal. `detail` ends the phrase ("before the run started")."""

    def __init__(self, signum: int, detail: str = ""):
        self.signum, self.exit_code, self.detail = signum, 128 + signum, detail
        super().__init__(f"stopped by {signal.Signals(signum).name}" + (f" {detail}" if detail else ""))

    def __reduce__(self):
        return type(self), (self.signum, self.detail)


def stop_signals() -> tuple[int, ...]:
    """The signals that stop a run with its line and summary: SIGINT, SIGTERM, SIGHUP (a closed terminal), and
    SIGUSR1 / SIGUSR2 where nothing else claimed them (their default would end the process without a word; a
    batch system sends them before its time limit). SIGQUIT keeps its default: a core dump, asked for."""
    found = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        if signal.getsignal(sig) in (signal.SIG_DFL, None) or getattr(signal.getsignal(sig), "_rlsync", False):
            found.append(sig)
    return tuple(found)


def exit_now(signum: int) -> None:
    """A second stop signal while the first is handled: out at once (the finished steps are on disk already)."""
    print(
        f"rlsync: {signal.Signals(signum).name} again: exiting now without the summary "
        f"(metrics.jsonl keeps the finished steps)",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + signum)


class EarlySignals:
    """The stop signals from an entry point's first line until the run's own handling (StopOnSignals) begins.

    A signal here is kept (`pending`) and, while `raising` (inside rlsync.shell.cli, or an entry's imports
    under `signals_from_here`), raised as `Interrupted` at once. Library code may swallow that exception
    (a `__del__`, a weakref callback, a broad `except`): the signal stays pending until its line is printed
    (`reported`), and is raised again at the next safe point (`check`: a job's start, StopOnSignals' entry,
    the end of cli), so no stop is lost. A handler a library put in place of ours is replaced there too.
    """

    def __init__(self) -> None:
        self.pending: Optional[int] = None  # the stop signal received and not yet reported
        self.raising = False
        self.started = False  # the command holds its run directory: no longer "before the run started"
        self.stops = 0  # StopOnSignals blocks open: their handlers are in place, ours wait
        self.handler = self._handle

    def install(self) -> dict:
        """Our handler for each stop signal not already ours; returns what was there (main thread only)."""
        if threading.current_thread() is not threading.main_thread() or self.stops:
            return {}
        previous = {}
        for sig in stop_signals():
            current = signal.getsignal(sig)
            if current is not self.handler:
                previous[sig] = signal.signal(sig, self.handler)
        return previous

    def _handle(self, signum: int, frame) -> None:
        if self.pending is not None:
            exit_now(signum)
        self.pending = signum
        if self.raising:
            raise self.interrupted()

    def interrupted(self) -> Interrupted:
        return Interrupted(self.pending, "" if self.started else "before the run started")

    def check(self) -> None:
        """A safe point: a signal that arrived (and was swallowed on the way) raised now; within a command
        (rlsync.shell.cli) our handlers are put back first, should a library have replaced them."""
        if self.raising:
            self.install()
        if self.pending is not None:
            raise self.interrupted()

    def reported(self, err: BaseException) -> None:
        """`err`'s line is printed: a pending signal it stands for is dealt with."""
        if isinstance(err, KeyboardInterrupt):
            self.pending = None


EARLY = EarlySignals()


@contextmanager
def signals_from_here():
    """An entry point's first lines (`python -m rlsync...`): the stop signals are handled from here on, and one
    that arrives while the block imports the entry (torch, transformers, ...) ends the process with its line
    and 128 + the signal, no traceback. A signal that arrives after the block is acted on by rlsync.shell.cli."""
    EARLY.install()
    EARLY.raising = True
    try:
        yield
    except KeyboardInterrupt:
        stop = (
            EARLY.interrupted() if EARLY.pending is not None else Interrupted(signal.SIGINT, "before the run started")
        )
        print(f"rlsync: {describe(stop)}", file=sys.stderr, flush=True)
        os._exit(stop.exit_code)  # half-imported modules: nothing to clean up, nothing written yet
    finally:
        EARLY.raising = False


class StopOnSignals:
    """Within `with StopOnSignals() as stop:`, SIGINT, SIGTERM and SIGHUP (a closed terminal) raise
    `Interrupted` in the main thread.

    Python runs the handler between bytecodes, so the step in progress stops after its current
    operation and is dropped; the caller's `finally` keeps what finished. Inside `stop.deferred()`
    (recording a finished step) the signal waits for the block to end, so a step is recorded whole
    or not at all. A second signal while the first is being handled exits at once: the finished
    steps are on disk already, only the summary is lost.
    """

    def __enter__(self) -> StopOnSignals:
        self.pending: Optional[int] = None
        self.raised = False
        self.deferring = False
        self.previous = {}
        EARLY.started = True  # the run is under way: its own handling from here
        EARLY.stops += 1
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in stop_signals()}
        self.carried, EARLY.pending = EARLY.pending, None  # a signal before the run, swallowed on the way
        return self

    def check(self) -> None:
        """The owner's first line inside the block: a signal carried over from before the run stops it here."""
        if self.carried is not None:
            signum, self.carried, self.raised = self.carried, None, True
            raise Interrupted(signum)

    def __exit__(self, *exc) -> None:
        EARLY.stops -= 1
        if self.raised or exc[:1] != (None,):  # the run is stopping: a signal during the teardown (a launcher's
            EARLY.raising = False  # SIGTERM) is kept, not raised in place of the error that stopped it
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.raised or self.pending is not None:
            exit_now(signum)
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
            self.deferring = absorb  # the stop is under way: a signal after the block still waits (or exits at once)
            if self.pending is not None and absorb:
                self.raised = True
        if self.pending is not None and not self.raised:
            self.raised = True
            raise Interrupted(self.pending)


EarlySignals._handle._rlsync = StopOnSignals._handle._rlsync = True  # stop_signals(): SIGUSR1/2 are ours already


# ----------------------------------------------------------------------------------------------
# Hydra's composition errors -> ConfigError
# ----------------------------------------------------------------------------------------------


def from_hydra(err: BaseException) -> Optional[RlsyncError]:
    """The ConfigError (or BadInput) a Hydra/OmegaConf composition error stands for, BrokenInstall when the
    install lacks its configs; None for anything else."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

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
            return renamed_key(getattr(cause, "object_type", None), key, value) or ConfigError(
                key, value, sibling_keys(cause), "unknown key"
            )
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
    if "Error locating target 'rlsync." in str(err):  # rlsync's own class (a callback) failed to import: not input
        root = err
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__
        target = str(err).split("'")[1]
        return RlsyncError(
            f"failed: rlsync's own {target} could not be loaded: {type(root).__name__}: {first_line(root)}"
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


def renamed_key(schema, key: str, value: Any) -> Optional[ConfigError]:
    """`key` refused naming its new name, where its schema class renamed it (`renamed_keys`: old -> new leaf name,
    rlsync/config/schema.py); None for a key never renamed."""
    parent, _, leaf = key.rpartition(".")
    new = (getattr(schema, "renamed_keys", None) or {}).get(leaf)
    if new is None:
        return None
    if callable(new):  # replaced by another key whose value depends on this one's: (problem, allowed) from the schema
        problem, allowed = new(key, value)
        return ConfigError(key, value, allowed, problem)
    new = f"{parent}.{new}" if parent else new
    return ConfigError(key, value, f"{new}={show(value)}", f"renamed to {new}")


def sibling_keys(cause) -> str:
    """The keys that do exist next to the unknown one."""
    node = getattr(cause, "parent_node", None)
    if node is None and getattr(cause, "object_type", None) is not None and is_dataclass(cause.object_type):
        return ", ".join(f.name for f in fields(cause.object_type))
    try:
        keys = [k for k in node if k != "hydra"]
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
