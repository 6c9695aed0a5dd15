"""How a run ends when it does not finish: errors a user can act on, and interruptions.

The entry points print an error as one line on stderr and exit with its `exit_code`, never a
traceback (RLSYNC_DEBUG=1 shows it): a bad value exits 2, a run that failed exits 1, a run
stopped by SIGINT, SIGTERM or SIGHUP exits 128 + the signal (130, 143, 129), as shells report it.
Hydra's own composition errors (unknown key, wrong type, unknown group choice) are translated
here into the same one-line `ConfigError`.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from rlsync.fmt import error_line, first_line

DEBUG_ENV = "RLSYNC_DEBUG"  # =1: print the full traceback as well
RUN_LOCK_NAME = ".rlsync.lock"  # a live run holds an flock on DIR/.rlsync.lock (rlsync.record.run_lock)
CONF_DIR = Path(__file__).resolve().parent / "conf"  # the YAML configs every entry point reads (pkg://rlsync.conf)


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
# The entry points: one line per error, one exit code per kind
# ----------------------------------------------------------------------------------------------


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
INTERRUPTED_CODES = (129, 130, 143)  # SIGHUP, SIGINT, SIGTERM


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
        yield
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - every way a job ends gets its line
        shown = from_hydra(err) or err
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
        fd = os.open(Path(run_dir) / RUN_LOCK_NAME, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
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
            try:
                self._stream.flush()  # what was buffered goes to /dev/null now
            except OSError:
                pass

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
    with pipe_safe_output():
        _run_app(app)


def _run_app(app: Callable[[], Any]) -> None:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        os.environ[DEBUG_ENV] = "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        app()
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
        shown = from_hydra(err) or unusable_dir(err) or err
        if debug_enabled():
            traceback.print_exc()
        print(f"rlsync: {describe(shown)}", file=sys.stderr, flush=True)
        sys.exit(exit_code(shown))
