"""The report's table model: runs read back from their files, one row per run, the fits, the cells.

Everything here is plain data and pure functions; the renderers (markdown.py, plots.py,
wandb_report.py) import it, never the reverse.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlsync.config.files import SUMMARY_MAX, UnreadableFile, read_bytes
from rlsync.fmt import (
    MIB,
    fmt_bytes,
    fmt_mib,
    fmt_range,
    fmt_ratio,
    fmt_seconds,
    fmt_share,
    fmt_sig,
    fmt_spread,
    markdown_table,
)
from rlsync.measure import metrics
from rlsync.record.summary import stats_over

DEFAULT_WARMUP_STEPS = 2
DEFAULT_VERDICT_THRESHOLD = 0.03  # update share of the step above which tuning it pays (run.verdict_threshold)
MIN_MEASURED = 3  # fewer measured steps (or bench repeats) than this and a min-max range says little
MIN_FIT_SIZES = 3  # distinct update sizes that make a line of time against bytes meaningful by themselves
PER_TENSOR = "per_tensor"  # the strategy to which a bucket size does not apply
UPDATE_PARTS = ("gather", "pack", "transfer", "load")  # perf/update_weights_<part>_time, in the order they run

# report.csv columns: raw seconds, bytes and ratios (never formatted strings); between these two,
# each of the step's parts (the catalogue's, rlsync/measure/metrics.py) as <phase>_time_median: see csv_fields().
CSV_HEAD = (
    "job", "overrides", "status", "model", "params", "engine", "scheme", "transport", "strategy", "bucket_mb",
    "flat_engine_weights", "device", "measured_steps",
    "update_time_min", "update_time_median", "update_time_max",
    "step_time_min", "step_time_max",
    "sleep_time_min", "sleep_time_median", "sleep_time_max",
    "wake_up_time_min", "wake_up_time_median", "wake_up_time_max",
)  # fmt: skip
CSV_TAIL = (
    "update_share", "update_efficiency_median", "update_limit_time_median", "update_gbps_median",
    "update_bytes", "update_buckets_median", "update_peak_bytes_max",
    "verdict",
)  # fmt: skip


def csv_fields() -> tuple[str, ...]:
    """report.csv's columns: the setup, the headline ranges, the median of every part of the step, the update's."""
    phases = [f"{p.name}_time_median" for p in metrics.step_phases()]
    return tuple(dict.fromkeys([*CSV_HEAD, *phases, "step_time_median", *CSV_TAIL]))


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

    def cfg(self, dotted: str, default: Any = None) -> Any:
        return dig(self.config, dotted, default)

    def stat(self, metric: str, which: str = "median") -> Optional[float]:
        return self.stats.get(metric, {}).get(which)


@dataclass
class Failure:
    """A job that left no measurement, or whose summary says it failed."""

    path: Path
    job: str
    overrides: list[str]
    error: str
    sweep: Optional[Path] = None


@dataclass
class Fit:
    """Least squares of update time against bytes: time = fixed + bytes / bandwidth."""

    fixed_s: float
    seconds_per_byte: float
    points: int
    distinct_sizes: int

    @property
    def bandwidth_gbps(self) -> Optional[float]:
        """GB/s (1e9 bytes); None when the time does not grow with bytes."""
        return 1e-9 / self.seconds_per_byte if self.seconds_per_byte > 0 else None

    def describe(self) -> str:
        bw = self.bandwidth_gbps
        bandwidth = f"{bw:.3g} GB/s" if bw else "not resolved (time does not grow with bytes)"
        return (
            f"update time = {fmt_seconds(self.fixed_s)} fixed + bytes / {bandwidth}"
            f" (least squares over {self.points} runs, {self.distinct_sizes} update sizes)"
        )


@dataclass
class FitGroup:
    """Runs that share a transport (and strategy, engine), and the line fitted through them if it can be."""

    label: str  # "transport ipc"; "" when every run shares the setup, so one line fits them all
    rows: list[dict[str, Any]]  # table rows with an update time and bytes
    fit: Optional[Fit]
    why_not: str = ""  # when fit is None: why no line is shown

    def describe(self) -> str:
        if self.fit:
            return (f"{self.label}: " if self.label else "") + self.fit.describe()
        return f"{self.label}: no fit ({self.why_not})" if self.label else f"No fit: {self.why_not}."


@dataclass
class ReportResult:
    """What `write_report` found and wrote; `ok` when at least one run made it into the table."""

    out_dir: Path
    group: str
    runs: list[Run] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # skipped plots, unreadable paths
    fits: list[FitGroup] = field(default_factory=list)  # one per transport (strategy, engine) of the runs
    wandb_line: Optional[str] = None  # one line on what happened with W&B logging
    table_markdown: str = ""
    calibration: Optional[dict] = None  # the planner's coefficients fitted to the update benchmarks (report.sizing)

    @property
    def ok(self) -> bool:
        return bool(self.runs)

    @property
    def fit(self) -> Optional[Fit]:
        """The one fit when every run shares a setup; None when the runs make several lines (see `fits`)."""
        return self.fits[0].fit if len(self.fits) == 1 else None


def dig(tree: Any, dotted: str, default: Any = None) -> Any:
    """tree["a"]["b"] for "a.b", or default when any level is missing."""
    node = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return default if node is None else node


METRICS_MAX = 1 << 30  # a run's metrics.jsonl: ~2 KiB a step


def read_text(path: Path, max_bytes: int = SUMMARY_MAX) -> str:
    """A run's file as text, only if it is a regular file within `max_bytes` (a FIFO named summary.json
    would block a plain read forever): FileNotFoundError, UnreadableFile (a ValueError) or OSError otherwise."""
    return read_bytes(path, max_bytes=max_bytes).decode("utf-8", errors="replace")


def read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(read_text(path))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


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


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl rows; a torn last line (an interrupted write) is skipped."""
    rows = []
    try:
        lines = read_text(path, max_bytes=METRICS_MAX).splitlines()
    except (OSError, ValueError):
        return rows
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def step_stats(rows: list[dict], warmup_steps: int) -> tuple[dict[str, dict[str, float]], int]:
    """Median, min and max of every numeric metric over the steps >= warmup_steps (as the runner does)."""
    rows = [{"step": i, **r} for i, r in enumerate(rows)]  # tolerate rows without a step
    return stats_over(rows, warmup_steps), sum(1 for r in rows if r["step"] >= warmup_steps)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def error_line(run_dir: Path) -> str:
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


def load_job(run_dir: Path, sweep: Optional[Path] = None) -> Run | Failure:
    """Read one job directory into a Run (it measured something) or a Failure; a record the report
    cannot read (torn, wrong types) is a Failure with one line saying what is wrong, never a traceback."""
    try:
        return read_job(run_dir, sweep)
    except Exception as err:  # noqa: BLE001 - one bad record costs its own row, never the report
        overrides = read_yaml(run_dir / ".hydra" / "overrides.yaml")
        overrides = [str(o) for o in overrides] if isinstance(overrides, list) else []
        reason = str(err) if isinstance(err, Malformed) else f"unreadable run record ({type(err).__name__}: {err})"
        return Failure(run_dir, run_dir.name, overrides, reason.splitlines()[0] if reason else "unreadable", sweep)


def read_job(run_dir: Path, sweep: Optional[Path] = None) -> Run | Failure:
    summary = read_summary(run_dir / "summary.json")
    rows = read_metrics(run_dir / "metrics.jsonl")
    config = summary.get("config") or read_yaml(run_dir / ".hydra" / "config.yaml") or {}
    config = config if isinstance(config, dict) else {}
    overrides = summary.get("overrides") or read_yaml(run_dir / ".hydra" / "overrides.yaml") or []
    overrides = [str(o) for o in overrides] if isinstance(overrides, list) else []
    if not summary and not rows:
        return Failure(run_dir, run_dir.name, overrides, error_line(run_dir), sweep)

    warmup = summary.get("warmup_steps", dig(config, "run.warmup_steps", DEFAULT_WARMUP_STEPS))
    stats, measured = step_stats(rows, int(warmup))
    for metric, agg in (summary.get("metrics") or {}).items():  # the runner's numbers win
        if isinstance(agg, dict) and is_number(agg.get("median")):
            stats[metric] = {k: float(v) for k, v in agg.items() if is_number(v)}
    status = summary.get("status", "incomplete") if summary else "incomplete"
    error = summary.get("error")
    if not stats:  # nothing to put in the table: it failed, or stopped within the warm-up
        reason = error or (error_line(run_dir) if status == "failed" else f"{status} before any measured step")
        return Failure(run_dir, run_dir.name, overrides, reason, sweep)
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


def sweep_jobs(sweep: Path) -> list[Path]:
    """Every numbered subdirectory, even an empty one (a job that died before writing), then every other
    subdirectory that holds a run, by name."""
    children = [child for child in sweep.iterdir() if child.is_dir()]
    numbered = sorted((c for c in children if c.name.isdigit()), key=lambda p: int(p.name))
    named = sorted(c for c in children if not c.name.isdigit() and is_job_dir(c))
    return numbered + named


def collect(paths: Iterable[Path]) -> tuple[list[Run], list[Failure], list[Path], list[str]]:
    """Runs, failures, the sweep directories seen, and notes on paths that held nothing."""
    runs: list[Run] = []
    failures: list[Failure] = []
    sweeps: list[Path] = []
    notes: list[str] = []
    for path in paths:
        if is_sweep_dir(path):
            sweeps.append(path)
            jobs = [(job, path) for job in sweep_jobs(path)]
        elif path.is_dir() and is_job_dir(path):
            jobs = [(path, None)]
        else:
            notes.append(f"{path}: not a run or sweep directory, skipped")
            continue
        for job_dir, sweep in jobs:
            loaded = load_job(job_dir, sweep)
            if isinstance(loaded, Failure):
                failures.append(loaded)
                continue
            runs.append(loaded)
            if loaded.status == "failed":  # measured some steps, then failed: both lists
                failures.append(Failure(job_dir, job_dir.name, loaded.overrides, loaded.error or "failed", sweep))
    return runs, failures, sweeps, notes


def job_label(path: Path, sweep: Optional[Path], several_sweeps: bool) -> str:
    """ "3" inside one sweep; "<sweep>/3" when several sweeps are compared."""
    return f"{sweep.name}/{path.name}" if sweep is not None and several_sweeps else path.name


# ----------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------


def table_row(run: Run) -> dict[str, Any]:
    """One run's numbers, raw (seconds, bytes, ratios), keyed by CSV_FIELDS (and a few extras)."""
    setup = run.summary.get("setup") or {}
    model = run.summary.get("model") or {}
    row: dict[str, Any] = {
        "job": run.job,
        "overrides": " ".join(run.overrides),
        "override_list": list(run.overrides),
        "status": run.status,
        "model": model.get("name") or run.cfg("model.name"),
        "params": model.get("params"),
        "engine": setup.get("engine") or run.cfg("rollout.engine", "hf"),
        "scheme": setup.get("scheme") or run.cfg("update.scheme"),  # scheme=NAME (rlsync/conf/scheme/): group by it
        "transport": setup.get("transport") or run.cfg("update.transport"),
        "flat_engine_weights": setup.get("flat_engine_weights", run.cfg("update.flat_engine_weights")),  # as resolved
        "strategy": setup.get("strategy") or run.cfg("update.strategy"),
        "bucket_mb": setup.get("bucket_mb", run.cfg("update.bucket_mb")),  # None for per_tensor, below
        "device": setup.get("device") or run.cfg("run.device"),
        "measured_steps": run.measured_steps,
    }
    if row["strategy"] == PER_TENSOR:  # one copy per tensor: no bucket, whatever update.bucket_mb says
        row["bucket_mb"] = None
    for stem, name in (("update_weights", "update"), ("sleep", "sleep"), ("wake_up", "wake_up")):
        for which in ("min", "median", "max"):
            row[f"{name}_time_{which}"] = run.stat(f"perf/{stem}_time", which)
    for phase in metrics.step_phases():  # medians of every part of the step, for the breakdown
        row[f"{phase.name}_time_median"] = run.stat(phase.metric.name)
    row["step_time_median"] = run.stat("perf/step_time")
    row["step_time_min"], row["step_time_max"] = run.stat("perf/step_time", "min"), run.stat("perf/step_time", "max")
    row["update_share"] = update_share(run)
    row["update_efficiency_median"] = run.stat("perf/update_weights_efficiency")
    row["update_limit_time_median"] = run.stat("perf/update_weights_limit_time")
    row["update_gbps_median"] = run.stat("perf/update_weights_gbps")
    row["update_bytes"] = run.stat("perf/update_weights_bytes") or model.get("update_bytes")
    row["update_buckets_median"] = run.stat("perf/update_weights_buckets")
    row["update_peak_bytes_max"] = run.stat("perf/update_weights_peak_bytes", "max")
    row["update_staging_bytes_max"] = run.stat("perf/update_weights_staging_bytes", "max")
    for part in UPDATE_PARTS:  # the update's own split, where the transport times it (the update-phases plot)
        row[f"update_{part}_time_median"] = run.stat(f"perf/update_weights_{part}_time")
    row["verdict"] = run_verdict(run, row["update_share"])
    row["bench"] = bench_target(run)  # its measured rows are repeats of the target, not steps
    row["warmup_steps"] = run.warmup_steps
    row["timeline"] = timeline(run)
    return row


def timeline(run: Run) -> list[dict[str, Any]]:
    """Per logged step, warm-up included: its step and update seconds (update None where not logged).

    Empty for a bench: its rows are repeats of the update alone, with no step around them.
    """
    points = []
    for index, row in enumerate(run.step_rows):
        step_time, update_time = row.get("perf/step_time"), row.get("perf/update_weights_time")
        if is_number(step_time):
            points.append(
                {
                    "step": row.get("step", index),  # tolerate rows without a step, as step_stats does
                    "step_time": float(step_time),
                    "update_time": float(update_time) if is_number(update_time) else None,
                }
            )
    return points


def update_share(run: Run) -> Optional[float]:
    share = run.summary.get("share") or {}
    value = share.get("update_weights", run.summary.get("share/update_weights"))
    if is_number(value):
        return float(value)
    update, step = run.stat("perf/update_weights_time"), run.stat("perf/step_time")
    return update / step if update is not None and step else None


def run_verdict(run: Run, share: Optional[float]) -> str:
    """The runner's verdict; for a bench, what it timed against the copy floor (it has no step to
    share); for a run without either, a line built from the share of the step."""
    warning = run.summary.get("warning")
    if run.summary.get("verdict"):
        return f"{run.summary['verdict']} ({warning})" if warning else str(run.summary["verdict"])
    prefix = "incomplete (no summary.json)" if run.status == "incomplete" else run.status
    target = bench_target(run)
    if target:
        line = bench_verdict(run, target)
        line = line if run.status == "finished" else f"{prefix}: {line}"
        return f"{line} ({warning})" if warning else line
    if share is None:
        return f"{prefix}: {run.measured_steps} measured steps, no step time to compare with"
    threshold = run.cfg("run.verdict_threshold", DEFAULT_VERDICT_THRESHOLD)
    advice = "worth tuning" if share > threshold else "tune rollout and training first"
    return f"{prefix}: update is {fmt_share(share)} of the step ({advice}; threshold {threshold:.0%})"


# bench.target -> (metric stem, what the verdict calls it), as the bench's closing tables do
BENCH_PHASES = {
    "update": (("update_weights", "update alone"),),
    "offload": (("sleep", "offload alone"), ("wake_up", "onload alone")),
}


def bench_target(run: Run) -> Optional[str]:
    """What a `python -m rlsync.bench` job timed: its summary says; one that left no summary still
    has bench.* in its config. None for a run of the step loop, which has neither."""
    return run.summary.get("target") or run.cfg("bench.target")


def bench_verdict(run: Run, target: str) -> str:
    """ "update alone: 0.18 s median, 1.91x the copy floor of 0.097 s (transport direct, bucketed, 512 MiB)".

    The ratio is 1 / the median efficiency, each repeat against the floor probed beside it (as the
    table's efficiency column and the bench's closing table), so a shared machine's drift cancels.
    """
    parts = []
    for stem, label in BENCH_PHASES.get(target, ()):
        seconds = run.stat(f"perf/{stem}_time")
        if seconds is None:
            continue
        limit, efficiency = run.stat(f"perf/{stem}_limit_time"), run.stat(f"perf/{stem}_efficiency")
        if limit is None:
            parts.append(f"{label}: {fmt_seconds(seconds)} median, no copy floor measured")
            continue
        ratio = 1 / efficiency if efficiency else seconds / limit
        parts.append(f"{label}: {fmt_seconds(seconds)} median, {ratio:.2f}x the copy floor of {fmt_seconds(limit)}")
    if not parts:
        return f"{run.measured_steps} timed repeats, no {target} time measured"
    return f"{'; '.join(parts)} ({bench_setup(run, target)})"


def bench_setup(run: Run, target: str) -> str:
    """What the bench's time depends on: the update's path, or the offloaded state."""
    if target == "offload":
        offload = run.summary.get("offload") or {}
        state = offload.get("state") or run.cfg("bench.offload_state", "trainer")
        mode = offload.get("mode") or run.cfg("trainer.offload", "n/a")
        memory = offload.get("memory") or run.cfg("trainer.offload_memory", "n/a")
        moved = run.stat("perf/sleep_bytes")
        size = f", {fmt_bytes(moved)}" if moved is not None else ""
        return f"{state} state, offload {mode}, memory {memory}{size}"
    setup = run.summary.get("setup") or {}
    transport = setup.get("transport") or run.cfg("update.transport", "n/a")
    flat = setup.get("flat_engine_weights", run.cfg("update.flat_engine_weights"))
    strategy = setup.get("strategy") or run.cfg("update.strategy", "n/a")
    bucket = setup.get("bucket_mb", run.cfg("update.bucket_mb"))
    source = setup.get("source") or run.cfg("update.source")
    engine = setup.get("engine") or run.cfg("rollout.engine", "hf")
    parts = [f"transport {transport}" + (" flat" if flat else ""), str(strategy)]
    parts += [f"{fmt_bucket(bucket)} MiB"] if strategy == "bucketed" else []
    parts += [f"source {source}"] if source == "host" else []  # device is the default
    parts += [f"engine {engine}"] if engine != "hf" else []
    return ", ".join(parts)


def fit_update_time(rows: list[dict[str, Any]]) -> Optional[Fit]:
    """time = fixed + bytes * seconds_per_byte, least squares over the runs' medians; None when the
    line says nothing (see `fit_problem`)."""
    if fit_problem(rows):
        return None
    sizes = [float(r["update_bytes"]) for r in timed_rows(rows)]
    slope, intercept = statistics.linear_regression(sizes, [float(r["update_time_median"]) for r in timed_rows(rows)])
    return Fit(fixed_s=intercept, seconds_per_byte=slope, points=len(sizes), distinct_sizes=len(set(sizes)))


def timed_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with an update time and its bytes: the points of a fit."""
    return [r for r in rows if is_number(r.get("update_bytes")) and is_number(r.get("update_time_median"))]


def fit_problem(rows: list[dict[str, Any]]) -> Optional[str]:
    """Why a line of time against bytes through these runs would say nothing, or None when it can be drawn.

    Three distinct sizes or more: the line is checked by the third point. Two sizes: only when every
    run measured at least MIN_MEASURED steps and the two sizes' time ranges (min to max) stay apart,
    else the slope is noise (two noisy points make "time does not grow with bytes" as readily as a bandwidth).
    """
    timed = timed_rows(rows)
    sizes = sorted({float(r["update_bytes"]) for r in timed})
    if len(sizes) >= MIN_FIT_SIZES:
        return None
    if len(sizes) < 2:
        return (
            f"{len(timed)} runs, all of one update size; a line needs {MIN_FIT_SIZES} sizes, "
            "or 2 whose times stand apart"
        )
    few = [r["job"] for r in timed if (r.get("measured_steps") or 0) < MIN_MEASURED]
    if few:
        return (
            f"two update sizes only, and runs {', '.join(few)} measured fewer than {MIN_MEASURED} steps or "
            "repeats: a line through two noisy points is not shown; add a third size or more steps"
        )
    spans = [time_span([r for r in timed if float(r["update_bytes"]) == size]) for size in sizes]
    if spans_overlap(*spans):
        return (
            "two update sizes only, and their update times overlap (min to max): the slope would be noise; "
            "add a third size or more steps"
        )
    return None


def time_span(rows: list[dict[str, Any]], stem: str = "update") -> tuple[float, float]:
    """The lowest min and the highest max of `<stem>_time` over `rows` (the median where a run has no range)."""
    lows = [r[f"{stem}_time_min"] if is_number(r.get(f"{stem}_time_min")) else r[f"{stem}_time_median"] for r in rows]
    highs = [r[f"{stem}_time_max"] if is_number(r.get(f"{stem}_time_max")) else r[f"{stem}_time_median"] for r in rows]
    return min(lows), max(highs)


def spans_overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


FIT_KEYS = ("transport", "strategy", "engine")  # each makes its own line of time against bytes


def fit_by_setup(rows: list[dict[str, Any]]) -> list[FitGroup]:
    """One fit per transport (and strategy, engine) where the runs differ in it.

    Broadcast and direct, say, have different fixed costs and bandwidths: one line through both
    describes neither. The groups are labelled only by the keys that differ; when none does, there
    is one group with an empty label, the single fit over every run.
    """
    timed = timed_rows(rows)
    differing = [key for key in FIT_KEYS if len({r.get(key) for r in timed}) > 1]
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in timed:
        groups.setdefault(", ".join(f"{key} {row.get(key) or 'n/a'}" for key in differing), []).append(row)
    return [
        FitGroup(label, members, fit_update_time(members), fit_problem(members) or "")
        for label, members in groups.items()
    ]


def update_fit_lines(groups: list[FitGroup]) -> list[str]:
    """The fit section of report.md: one line, or one bullet per transport when the runs differ in it;
    where no line is meaningful, one line saying why."""
    if len(groups) > 1:
        return [f"- {group.describe()}" for group in groups]
    if groups:
        return [groups[0].describe()]
    return ["No fit: no run timed the update with its bytes."]


# ----------------------------------------------------------------------------------------------
# Which setting won
# ----------------------------------------------------------------------------------------------


def model_label(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The row's model; with its update size when the same name comes with several sizes among `rows`
    (say `model.num_hidden_layers` swept under one name), so that each label is one model."""
    model = str(row.get("model") or "n/a")
    sizes = {r.get("update_bytes") for r in rows if str(r.get("model") or "n/a") == model}
    size = row.get("update_bytes")
    return f"{model} ({size / MIB:.3g} MiB)" if len(sizes) > 1 and is_number(size) else model


def setup_label(row: dict[str, Any], bucket: bool = True) -> str:
    """ "direct, bucket 512 MiB", "ipc, per_tensor", "direct (ENGINE), STRATEGY": how the run updated.
    A per_tensor run has no bucket size, whatever update.bucket_mb said."""
    transport = str(row.get("transport") or "n/a") + (
        "" if row.get("engine") in (None, "hf") else f" ({row['engine']})"
    )
    strategy = row.get("strategy")
    if strategy in (None, "bucketed"):
        how = f"bucket {fmt_bucket(row.get('bucket_mb'))} MiB" if bucket else "bucketed"
    else:
        how = str(strategy)
    return f"{transport}, {how}"


def measured_unit(row: dict[str, Any]) -> str:
    """What a run's measured samples are: a bench's timed repeats, or steps."""
    return "repeats" if row.get("bench") else "steps"


@dataclass
class Best:
    """The fastest run of one model by one time, against the runner-up, and whether the gap is real."""

    model: str
    stem: str  # "update" | "step": which <stem>_time_* the runs are ranked by
    ranked: list[dict[str, Any]]  # the model's rows with that time, fastest median first
    warning: str = ""  # why the ranking may be noise ("" when the ranges stand apart, with enough samples)

    @property
    def best(self) -> dict[str, Any]:
        return self.ranked[0]

    @property
    def runner_up(self) -> Optional[dict[str, Any]]:
        return self.ranked[1] if len(self.ranked) > 1 else None

    def describe(self) -> str:
        what = f"{self.model}, fastest {'update' if self.stem == 'update' else 'step'}"
        best, other = self.best, self.runner_up
        if other is None:
            return f"{what}: {self.run_text(best)}; the only run with this time, nothing to compare"
        lead, second = best[f"{self.stem}_time_median"], other[f"{self.stem}_time_median"]
        if second == lead:
            line = f"{what}: a tie between {self.run_text(best)} and {self.run_text(other)} (equal medians)."
        else:
            line = (
                f"{what}: {self.run_text(best)}; {fmt_lead(lead, second)} faster ({fmt_seconds(second - lead)} less) "
                f"than the runner-up {self.run_text(other)}."
            )
        return (
            f"{line} Warning: {self.warning}"
            if self.warning
            else f"{line} The ranges do not overlap: the difference is real."
        )

    def run_text(self, row: dict[str, Any]) -> str:
        """ "run 2 (ipc, bucket 512 MiB) 1.21 ms median (1.18 to 1.30 ms over 3 repeats)"."""
        stem = self.stem
        spread = fmt_spread(row[f"{stem}_time_median"], row.get(f"{stem}_time_min"), row.get(f"{stem}_time_max"))
        return f"run {row['job']} ({setup_label(row)}) {spread} over {row.get('measured_steps')} {measured_unit(row)}"


def fmt_lead(best: float, other: float) -> str:
    """How much faster best is than other: "1.52x"; under 1.1x as a percentage ("0.27 %"), which a
    ratio would round to "1.00x"."""
    if best <= 0:
        return "n/a"
    ratio = other / best
    return fmt_ratio(ratio) if ratio >= 1.1 else fmt_share(ratio - 1)


def ranking_warning(best: dict[str, Any], other: dict[str, Any], stem: str) -> str:
    """Why best may not really beat other: too few samples, or min-max ranges that overlap; "" otherwise."""
    more = " or ".join(dict.fromkeys("bench.repeats" if r.get("bench") else "run.steps" for r in (best, other)))
    few = [r for r in (best, other) if (r.get("measured_steps") or 0) < MIN_MEASURED]
    if few:
        named = " and ".join(f"run {r['job']} measured {r.get('measured_steps') or 0} {measured_unit(r)}" for r in few)
        return f"{named}, fewer than {MIN_MEASURED}: too few to tell a real difference from noise (raise {more})."
    if spans_overlap(time_span([best], stem), time_span([other], stem)):
        return (
            f"the min-max ranges of runs {best['job']} and {other['job']} overlap: the difference may be noise "
            f"(raise {more})."
        )
    return ""


def best_settings(rows: list[dict[str, Any]]) -> list[Best]:
    """Per model: the fastest update, and the fastest step where steps ran, each against its runner-up."""
    out = []
    for stem in ("update", "step"):
        timed = [r for r in rows if is_number(r.get(f"{stem}_time_median"))]
        models: dict[str, list[dict[str, Any]]] = {}
        for row in timed:
            models.setdefault(model_label(row, timed), []).append(row)
        for model, members in models.items():
            ranked = sorted(members, key=lambda r: r[f"{stem}_time_median"])  # stable: ties keep the run order
            warning = ranking_warning(ranked[0], ranked[1], stem) if len(ranked) > 1 else ""
            out.append(Best(model, stem, ranked, warning))
    return out


# ----------------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------------


def fmt_efficiency(eff: Optional[float]) -> str:
    """ "0.82 (1.22x limit)", "0.0031 (323x limit)": limit / time, and how many times the limit the update took."""
    if eff is None or eff <= 0:
        return "n/a"
    return f"{fmt_sig(eff)} ({fmt_ratio(1 / eff)} limit)"


def fmt_bucket(bucket_mb: Any) -> str:
    return f"{bucket_mb:g}" if is_number(bucket_mb) else "n/a" if bucket_mb is None else str(bucket_mb)


def bucket_cell(row: dict[str, Any]) -> str:
    """The bucket size in MiB; "per_tensor" for a run that sends one tensor at a time (no bucket)."""
    return PER_TENSOR if row.get("strategy") == PER_TENSOR else fmt_bucket(row.get("bucket_mb"))


TABLE_HEADER = (
    "run", "model", "transport", "bucket (MiB)", "n", "update", "offload (sleep)", "onload (wake_up)",
    "step", "update share", "efficiency (limit/time)", "peak update (MiB)",
)  # fmt: skip
TABLE_NOTE = (
    "n: measured steps (a bench: timed repeats; warm-up left out). Update and step: median (min to max over "
    f"the n); offload and onload: min to max. With n under {MIN_MEASURED} a range says little. Update share: "
    "of the median step; efficiency: median of perf/update_weights_efficiency (the copy floor over the update "
    "time); peak update: max of perf/update_weights_peak_bytes."
)


def common_overrides(rows: list[dict[str, Any]]) -> list[str]:
    """Overrides every run shares (with two runs or more): said once above the table."""
    if len(rows) < 2:
        return []
    shared = set(rows[0]["override_list"]).intersection(*(r["override_list"] for r in rows[1:]))
    return [o for o in rows[0]["override_list"] if o in shared]


def run_label(row: dict[str, Any], common: Iterable[str] = ()) -> str:
    """ "3: model=qwen3_1p7b update.bucket_mb=512", leaving out the overrides all runs share."""
    own = [o for o in row["override_list"] if o not in set(common)]
    return f"{row['job']}: {' '.join(own)}" if own else row["job"]


def table_cells(row: dict[str, Any], common: Iterable[str] = ()) -> list[str]:
    run = run_label(row, common)
    if row["status"] != "finished":
        run += f" ({row['status']})"
    return [
        run,
        str(row["model"] or "n/a"),
        str(row["transport"] or "n/a")
        + ("" if row["engine"] in (None, "hf") else f" ({row['engine']})"),  # engine if not hf
        bucket_cell(row),
        str(row["measured_steps"]),
        fmt_spread(row["update_time_median"], row["update_time_min"], row["update_time_max"]),
        fmt_range(row["sleep_time_min"], row["sleep_time_max"]),
        fmt_range(row["wake_up_time_min"], row["wake_up_time_max"]),
        fmt_spread(row["step_time_median"], row["step_time_min"], row["step_time_max"]),
        fmt_share(row["update_share"]),
        fmt_efficiency(row["update_efficiency_median"]),
        "0 (no staging)" if row["update_peak_bytes_max"] == 0 else fmt_mib(row["update_peak_bytes_max"]),
    ]


def rows_markdown(rows: list[dict[str, Any]]) -> str:
    common = common_overrides(rows)
    out = [f"Overrides of every run: {' '.join(common)}", ""] if common else []
    return "\n".join([*out, markdown_table(TABLE_HEADER, [table_cells(row, common) for row in rows])])


def phase_table(rows: list[dict[str, Any]]) -> str:
    """Per run with a step: the median of each part of the step (the catalogue's), with its share of the median step."""
    rows = [r for r in rows if is_number(r.get("step_time_median")) and r["step_time_median"] > 0]
    timed = [p for p in metrics.step_phases() if any(is_number(r.get(f"{p.name}_time_median")) for r in rows)]
    if not timed:
        return "No run timed the parts of a step (a bench times its target alone)."

    def cell(row: dict[str, Any], phase: metrics.Phase) -> str:
        seconds = row.get(f"{phase.name}_time_median")
        share = fmt_share(seconds / row["step_time_median"]) if is_number(seconds) else ""
        return f"{phase.metric.show(seconds)} ({share})" if share else "n/a"

    common = common_overrides(rows)
    cells = [[run_label(r, common), *(cell(r, p) for p in timed), fmt_seconds(r["step_time_median"])] for r in rows]
    return markdown_table(["run", *(p.label for p in timed), "step (median)"], cells)


def machine_line(runs: list[Run]) -> str:
    """Where the runs ran: summary.json's "machine" when the runner wrote it, else this machine."""
    machines = [m for m in (run.summary.get("machine") for run in runs) if isinstance(m, dict)]
    devices = sorted({str(table_row_device(r)) for r in runs}) or ["n/a"]
    if machines:
        first = machines[0]
        gpus = sorted({str(m["gpu"]) for m in machines if m.get("gpu")})
        line = (
            f"Machine: {first.get('platform', 'n/a')}, {first.get('cpus', 'n/a')} CPU threads,"
            f" torch {first.get('torch', 'n/a')}, device {', '.join(devices)}"
        )
        line += f" ({', '.join(gpus)})" if gpus else ""
        hosts = {json.dumps(m, sort_keys=True) for m in machines}
        return line + (" (first run's; the runs report different machines)." if len(hosts) > 1 else ".")
    try:
        from importlib.metadata import version

        torch_version = version("torch")  # no `import torch`: the report stays quick
    except Exception:
        torch_version = "not installed"
    return (
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, torch {torch_version},"
        f" device {', '.join(devices)} (the runs did not record theirs: this is the machine that wrote the report)."
    )


def table_row_device(run: Run) -> Any:
    return (run.summary.get("setup") or {}).get("device") or run.cfg("run.device") or "n/a"
