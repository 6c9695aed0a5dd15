"""Reading run directories back (summary.json, metrics.jsonl, .hydra/, logs) into a Run or a FailedRun,
and finding the runs under the paths given: the sweeps and the job directories in them."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlsync.config.files import SUMMARY_MAX, UnreadableFile, kind_of, read_bytes
from rlsync.errors import EARLY
from rlsync.fmt import fmt_bytes, is_number, plural
from rlsync.record.summary import stats_over

DEFAULT_WARMUP_STEPS = 2
MIN_MEASURED = 3  # fewer measured steps (or bench repeats) than this and a min-max range says little
RUN_DEPTH = 1  # where rlsync's runs are looked for: the path given, or its subdirectories (a sweep's jobs)


def stop_point() -> None:
    """Between two runs read, two plots drawn: a stop signal that library code swallowed on its way (an
    exception in a weakref callback or a `__del__` is printed and dropped) ends the report here. Only the
    report's entry installs the handler (rlsync.errors.EARLY) that records one."""
    if EARLY.pending is not None:
        raise EARLY.interrupted()


@contextmanager
def importing() -> Iterator[None]:
    """Around a first import of C extensions (matplotlib, wandb): a stop signal within it is acted on after it
    (stop_point), not raised inside their initialisation, which can leave a half-imported module or abort."""
    raising, EARLY.raising = EARLY.raising, False
    try:
        yield
    finally:
        EARLY.raising = raising
    stop_point()


# ----------------------------------------------------------------------------------------------
# What a run directory holds
# ----------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One job that measured at least one step (finished, interrupted or incomplete)."""

    path: Path
    job: str  # the job directory's name ("0", "1", ... in a sweep)
    overrides: list[str]
    status: str  # finished | interrupted | failed | incomplete (no summary.json)
    error: Optional[str]
    summary: dict[str, Any]  # summary.json, {} when missing
    config: dict[str, Any]  # the resolved config (summary.json's, else .hydra/config.yaml)
    stats: dict[str, dict[str, float]]  # metric -> {"median", "min", "max"} over measured steps
    measured_steps: int
    sweep: Optional[Path] = None
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    step_rows: list[dict] = field(default_factory=list)  # metrics.jsonl, warm-up rows included
    notes: list[str] = field(default_factory=list)  # what reading it left out (metrics.jsonl's lines that are no step)

    def cfg(self, dotted: str, default: Any = None) -> Any:
        return dig(self.config, dotted, default)

    def stat(self, metric: str, which: str = "median") -> Optional[float]:
        return self.stats.get(metric, {}).get(which)


@dataclass
class FailedRun:
    """A job that left no measurement, or whose summary says it failed."""

    path: Path
    job: str
    overrides: list[str]
    error: str
    sweep: Optional[Path] = None
    notes: list[str] = field(default_factory=list)


def dig(tree: Any, dotted: str, default: Any = None) -> Any:
    """tree["a"]["b"] for "a.b", or default when any level is missing."""
    node = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return default if node is None else node


METRICS_MAX = 1 << 30  # a run's metrics.jsonl: ~2 KiB a step
LINE_MAX = 1 << 20  # one line of it: a longer one is no step rlsync wrote, and is skipped unread


def read_text(path: Path, max_bytes: int = SUMMARY_MAX) -> str:
    """A run's file as text, only if it is a regular file within `max_bytes` (a FIFO named summary.json
    would block a plain read forever): FileNotFoundError, UnreadableFile (a ValueError) or OSError otherwise."""
    return read_bytes(path, max_bytes=max_bytes).decode("utf-8", errors="replace")


class Malformed(ValueError):
    """A run record the report cannot trust (summary.json torn or of the wrong shape): a failed run."""


def read_summary(path: Path) -> dict:
    """summary.json as a dict ({} when there is none); Malformed when it exists but is not a run's summary."""
    try:
        text = read_text(path)
    except FileNotFoundError:
        return {}
    except UnreadableFile as err:
        raise Malformed(f"summary.json unreadable ({err})") from None
    except OSError as err:
        raise Malformed(f"summary.json unreadable ({err.strerror or err})") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise Malformed("summary.json nests too deep") from None
    except ValueError as err:
        raise Malformed(f"summary.json is not valid JSON ({err}); truncated?") from None
    if not isinstance(data, dict):
        raise Malformed(f"summary.json holds a {type(data).__name__}, not an object")
    problem = summary_problem(data)
    if problem:
        raise Malformed(f"summary.json: {problem}")
    return data


# what the report reads from a summary, and the types it needs (None is always allowed)
NUMBER, TEXT, COUNT, TABLE, LIST = "a number", "a string", "an integer", "an object", "a list"
SUMMARY_TYPES = {
    "status": TEXT,
    "error": TEXT,
    "verdict": TEXT,
    "warning": TEXT,
    "target": TEXT,
    "kind": TEXT,
    "warmup_steps": COUNT,
    "measured_steps": COUNT,
    "steps_finished": COUNT,
    "steps_requested": COUNT,
    "metrics": TABLE,
    "share": TABLE,
    "setup": TABLE,
    "model": TABLE,
    "machine": TABLE,
    "limits": TABLE,
    "offload": TABLE,
    "config": TABLE,
    "overrides": LIST,
    "memory": TABLE,
    "model.name": TEXT,
    "model.params": NUMBER,
    "model.update_bytes": NUMBER,
    "setup.bucket_mb": NUMBER,
    "setup.transport": TEXT,
    "setup.payload": TEXT,
    "setup.strategy": TEXT,
    "setup.device": TEXT,
    "setup.engine": TEXT,
    "setup.source": TEXT,
    "offload.state": TEXT,
    "offload.mode": TEXT,
    "offload.memory": TEXT,
    "config.run": TABLE,
    "config.update": TABLE,
    "config.model": TABLE,
    "config.rollout": TABLE,
    "config.trainer": TABLE,
    "config.wandb": TABLE,
    "config.bench": TABLE,
    "config.run.warmup_steps": COUNT,
    "config.run.verdict_threshold": NUMBER,
    "config.update.bucket_mb": NUMBER,
}


def type_fits(value: Any, kind: str) -> bool:
    if value is None:
        return True
    if kind == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == COUNT:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return isinstance(value, {TEXT: str, TABLE: dict, LIST: list}[kind])


def summary_problem(summary: dict) -> Optional[str]:
    """What makes `summary` unreadable for the report (a key of the wrong type), or None."""
    for key, kind in SUMMARY_TYPES.items():
        head, _, rest = key.rpartition(".")
        parent = summary if not head else raw_dig(summary, head)
        if not isinstance(parent, dict) or rest not in parent:
            continue
        if not type_fits(parent[rest], kind):
            return f"{key} is {shown_type(parent[rest])}, not {kind}"
    for metric, agg in (summary.get("metrics") or {}).items():
        if not isinstance(agg, dict) or not all(type_fits(v, NUMBER) for v in agg.values()):
            return f"metrics.{metric} is {shown_type(agg)}, not an object of numbers"
    for phase, share in (summary.get("share") or {}).items():
        if not type_fits(share, NUMBER):
            return f"share.{phase} is {shown_type(share)}, not a number"
    if not all(isinstance(o, str) for o in summary.get("overrides") or []):
        return "overrides is not a list of strings"
    return None


def raw_dig(tree: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(tree, dict):
            return None
        tree = tree.get(key)
    return tree


def shown_type(value: Any) -> str:
    text = json.dumps(value, default=str)
    return f"{type(value).__name__} {text[:30] + '...' if len(text) > 30 else text}"


def read_yaml(path: Path) -> Any:
    import yaml  # PyYAML, a dependency of omegaconf

    try:
        return yaml.safe_load(read_text(path))
    except (OSError, ValueError, yaml.YAMLError, RecursionError):
        return None


def metrics_lines(path: Path) -> Iterator[bytes | int]:
    """metrics.jsonl's lines, each up to LINE_MAX bytes, the whole file up to METRICS_MAX; a longer line is
    consumed without being kept and yielded as its length. Opened only if it is a regular file (a FIFO would
    block a read): UnreadableFile, FileNotFoundError or OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with open(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableFile(f"{path} is {kind_of(info.st_mode)}, not a regular file")
        left = METRICS_MAX
        while left > 0:
            line = f.readline(min(LINE_MAX + 1, left))
            if not line:
                return
            left -= len(line)
            if len(line) <= LINE_MAX:
                yield line
                continue
            size = len(line)
            while left > 0 and not line.endswith(b"\n"):  # the rest of the long line, a chunk at a time
                line = f.readline(min(1 << 20, left))
                if not line:
                    break
                size += len(line)
                left -= len(line)
            yield size


def is_step(row: dict) -> bool:
    """A line rlsync wrote for a step (or a bench repeat): it times something (perf/step_time, a bench's
    perf/update_weights_time, a stall bench's pause/<policy>/max_gap_time), as a finite number."""
    return any(key.endswith("_time") and is_number(value) for key, value in row.items())


def read_metrics(path: Path, notes: Optional[list[str]] = None) -> list[dict]:
    """metrics.jsonl's steps; a torn last line (an interrupted write) is skipped, and so is a line that is no
    step (no time in it, or over LINE_MAX), which `notes` (when given) then names."""
    rows, long_lines, not_steps = [], [], 0
    try:
        for line in metrics_lines(path):
            if isinstance(line, int):
                long_lines.append(line)
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if not isinstance(row, dict):
                continue
            if is_step(row):
                rows.append(row)
            else:
                not_steps += 1
    except (OSError, ValueError):
        return rows
    if notes is not None and long_lines:
        notes.append(
            f"{path}: {plural(len(long_lines), 'line')} over {fmt_bytes(LINE_MAX)} skipped unread "
            f"(the longest {fmt_bytes(max(long_lines))}; a step's line is a few KiB)"
        )
    if notes is not None and not_steps:
        notes.append(f"{path}: {plural(not_steps, 'line')} with no time in it skipped (not a step)")
    return rows


def step_stats(rows: list[dict], warmup_steps: int) -> tuple[dict[str, dict[str, float]], int]:
    """Median, min and max of every numeric metric over the steps >= warmup_steps (as the runner does)."""
    rows = [{"step": i, **r} for i, r in enumerate(rows)]  # tolerate rows without a step
    return stats_over(rows, warmup_steps), sum(1 for r in rows if r["step"] >= warmup_steps)


def failure_line(run_dir: Path) -> str:
    """The last log line naming an error, else the last non-empty log line: rlsync's error.log first (the
    submitit launcher appends its own "Exiting after successful completion" to the job's log after it)."""
    logs = sorted(run_dir.glob("*.log"), key=lambda p: (p.name != "error.log", -p.stat().st_mtime))
    for log in logs:
        try:
            lines = [ln.strip() for ln in read_text(log).splitlines() if ln.strip()]
        except (OSError, ValueError):
            continue
        if not lines:
            continue
        flagged = [ln for ln in lines if "Error" in ln or "Exception" in ln]
        return strip_log_prefix((flagged or lines)[-1])
    return "no summary.json, metrics.jsonl or log: the job did not start"


def strip_log_prefix(line: str) -> str:
    """Drop Hydra's "[time][logger][LEVEL] - " prefix."""
    head, sep, rest = line.partition("] - ")
    return rest if sep and head.startswith("[") else line


def load_job(run_dir: Path, sweep: Optional[Path] = None) -> Run | FailedRun:
    """Read one job directory into a Run (it measured something) or a FailedRun; a record the report
    cannot read (torn, wrong types) is a FailedRun with one line saying what is wrong, never a traceback."""
    try:
        return read_job(run_dir, sweep)
    except Exception as err:  # noqa: BLE001 - one bad record costs its own row, never the report
        overrides = read_yaml(run_dir / ".hydra" / "overrides.yaml")
        overrides = [str(o) for o in overrides] if isinstance(overrides, list) else []
        reason = str(err) if isinstance(err, Malformed) else f"unreadable run record ({type(err).__name__}: {err})"
        return FailedRun(run_dir, run_dir.name, overrides, reason.splitlines()[0] if reason else "unreadable", sweep)


def read_job(run_dir: Path, sweep: Optional[Path] = None) -> Run | FailedRun:
    summary = read_summary(run_dir / "summary.json")
    notes: list[str] = []
    rows = read_metrics(run_dir / "metrics.jsonl", notes)
    config = summary.get("config") or read_yaml(run_dir / ".hydra" / "config.yaml") or {}
    config = config if isinstance(config, dict) else {}
    overrides = summary.get("overrides") or read_yaml(run_dir / ".hydra" / "overrides.yaml") or []
    overrides = [str(o) for o in overrides] if isinstance(overrides, list) else []
    if not summary and not rows:
        return FailedRun(run_dir, run_dir.name, overrides, failure_line(run_dir), sweep, notes)

    warmup = summary.get("warmup_steps", dig(config, "run.warmup_steps", DEFAULT_WARMUP_STEPS))
    stats, measured = step_stats(rows, int(warmup))
    for metric, agg in (summary.get("metrics") or {}).items():  # the runner's numbers win
        if isinstance(agg, dict) and is_number(agg.get("median")):
            stats[metric] = {k: float(v) for k, v in agg.items() if is_number(v)}
    status = summary.get("status", "incomplete") if summary else "incomplete"
    error = summary.get("error")
    if not stats:  # nothing to put in the table: it failed, or stopped within the warm-up
        reason = error or (failure_line(run_dir) if status == "failed" else f"{status} before any measured step")
        return FailedRun(run_dir, run_dir.name, overrides, reason, sweep, notes)
    measured = summary.get("measured_steps", measured)
    return Run(
        run_dir,
        run_dir.name,
        overrides,
        status,
        error,
        summary,
        config,
        stats,
        measured,
        sweep,
        warmup_steps=int(warmup),
        step_rows=rows,
        notes=notes,
    )


# ----------------------------------------------------------------------------------------------
# Finding the runs
# ----------------------------------------------------------------------------------------------


def is_job_dir(path: Path) -> bool:
    return any((path / name).exists() for name in (".hydra", "summary.json", "metrics.jsonl"))


def is_sweep_dir(path: Path) -> bool:
    """A folder of runs: a Hydra multirun directory (numbered job subdirectories), or any folder whose
    subdirectories are runs (outputs/runs/, named by time), with no run of its own."""
    if not path.is_dir() or is_job_dir(path):
        return False
    return any(child.is_dir() and is_job_dir(child) for child in path.iterdir())


def job_dirs(sweep: Path) -> list[Path]:
    """Every numbered subdirectory, even an empty one (a job that died before writing), then every other
    subdirectory that holds a run, by name."""
    children = [child for child in sweep.iterdir() if child.is_dir()]
    numbered = sorted((c for c in children if c.name.isdigit()), key=lambda p: int(p.name))
    named = sorted(c for c in children if not c.name.isdigit() and is_job_dir(c))
    return numbered + named


def unique_paths(paths: Iterable[Path]) -> tuple[list[Path], list[str]]:
    """`paths` with each one that names the same file or folder as an earlier one (given twice, `a` and `./a`,
    a link to it) left out, and a note for each left out."""
    kept: dict[Path, Path] = {}
    notes = []
    for path in paths:
        key = path.resolve()
        if key in kept:
            alias = f" (as {kept[key]})" if str(kept[key]) != str(path) else ""
            notes.append(f"{path}: given twice{alias}, read once")
        else:
            kept[key] = path
    return list(kept.values()), notes


def collect(paths: Iterable[Path]) -> tuple[list[Run], list[FailedRun], list[Path], list[str]]:
    """Runs, failures, the sweep directories seen, and notes on paths that held nothing. A run directory
    reached twice (given twice, by another name, or alone and inside its sweep) is read once."""
    runs: list[Run] = []
    failures: list[FailedRun] = []
    sweeps: list[Path] = []
    notes: list[str] = []
    seen: dict[Path, Path] = {}  # resolved job directory -> the path it was first read as
    for path in paths:
        if is_sweep_dir(path):
            sweeps.append(path)
            jobs = [(job, path) for job in job_dirs(path)]
        elif path.is_dir() and is_job_dir(path):
            jobs = [(path, None)]
        else:
            notes.append(f"{path}: not a run or sweep directory, skipped")
            continue
        for job_dir, sweep in jobs:
            stop_point()
            key = job_dir.resolve()
            if key in seen:
                notes.append(f"{job_dir}: the same run as {seen[key]}, reported once")
                continue
            seen[key] = job_dir
            loaded = load_job(job_dir, sweep)
            notes += loaded.notes
            if isinstance(loaded, FailedRun):
                failures.append(loaded)
                continue
            runs.append(loaded)
            if loaded.status == "failed":  # measured some steps, then failed: both lists
                failures.append(FailedRun(job_dir, job_dir.name, loaded.overrides, loaded.error or "failed", sweep))
    return runs, failures, sweeps, notes


def job_label(path: Path, sweep: Optional[Path], several_sweeps: bool) -> str:
    """ "3" inside one sweep; "<sweep>/3" when several sweeps are compared."""
    return f"{sweep.name}/{path.name}" if sweep is not None and several_sweeps else path.name
