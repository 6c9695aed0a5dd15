"""Hydra callback around a sweep (`-m`): its plan before the first job, "job k of N" with an ETA, the
sweep report at the end, however the sweep ended.

Before the first job: one line with the job count, how many fit in memory (each job's config
composed, validated and checked as the job itself will be: refused jobs named) and an estimated
duration (rlsync.check.duration); a warning when the launcher runs jobs side by side (their timings
then contaminate each other). `run.dry_run=true` prints that plan and starts nothing. A bad value
refuses a job for good; memory is the memory available at the plan, which moves on a shared machine:
such a job checks again when it starts, and the line that starts it says what that check found.

Hydra skips `on_multirun_end` when a job failed; the sweep's end is then reported from the entry
point's error handling (rlsync.shell.SWEEP_ENDED), which writes the same report listing the failed
and refused jobs, or, after an interruption, says how to make it by hand (`python -m rlsync.report DIR`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from rlsync import errors, shell
from rlsync.check.duration import fmt_duration

SEQUENTIAL_LAUNCHERS = ("BasicLauncher",)  # Hydra's default: one job after another, in this process


def say(line: str) -> None:
    print(f"rlsync: {line}", file=sys.stderr, flush=True)


@dataclass
class JobPlan:
    num: int
    overrides: list[str]
    refused: Optional[str] = None  # the one line the job would stop with (a bad value, does not fit)
    seconds: Optional[float] = None  # estimated duration
    short_of_memory: bool = False  # refused for the memory available at the plan: checked again as it starts
    cfg: Any = None  # the validated config, for that check


@dataclass
class SweepPlan:
    jobs: list[JobPlan] = field(default_factory=list)
    side_by_side: Optional[str] = None  # the launcher, when it runs jobs at once
    bench: bool = False  # python -m rlsync.bench's jobs (their own estimate)

    @property
    def runnable(self) -> list[JobPlan]:
        return [j for j in self.jobs if j.refused is None]

    def lines(self) -> list[str]:
        n, ok = len(self.jobs), self.runnable
        total = sum(j.seconds or 0 for j in ok)
        refused = [j for j in self.jobs if j.refused is not None]
        memory = sum(j.short_of_memory for j in refused)
        moves = (
            f" ({memory} for the memory available now: each checks again as it starts, and runs if it fits then)"
            if memory
            else ""
        )
        out = [
            f"sweep of {n} job{'s' if n != 1 else ''}: {len(ok)} fit, {len(refused)} refused{moves}; "
            f"estimated {fmt_duration(total)} one after another (rough, from the model's size and this "
            f"machine's rates: rlsync.check.duration)"
        ]
        out += [
            f"  job {j.num} ({' '.join(j.overrides) or 'defaults'}) "
            f"{'would be refused now' if j.short_of_memory else 'will be refused'}: {j.refused}"
            for j in refused
        ]
        if self.side_by_side:
            out.append(side_by_side_warning(self.side_by_side))
        return out


def side_by_side_warning(launcher: str) -> str:
    return (
        f"warning: hydra/launcher={launcher} runs jobs side by side: their timings contaminate each other "
        f"(the default launcher runs them one after another)"
    )


def sweep_jobs(task_overrides: list[str], sweeper_params=None) -> list[list[str]]:
    """Each job's overrides, in the order Hydra's basic sweeper runs them: its `hydra.sweeper.params` (an
    experiment preset's sweep) first, then the command line's, a key given in both taking the latter."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (sweeper_params or {}).items()]
    parsed = OverridesParser.create().parse_overrides(params + task_overrides)
    return BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]


def plan_sweep(config: DictConfig) -> SweepPlan:
    """Every job composed, validated and memory-checked as it will be, before the first one starts."""
    from hydra import compose

    from rlsync.check.duration import preview
    from rlsync.config.apps import BenchAppConfig
    from rlsync.config.launch import as_launched, launcher_ranks, tasks_per_machine
    from rlsync.config.schema import Config
    from rlsync.config.validate import checked_config

    bench = config.hydra.job.config_name == "bench"
    schema = BenchAppConfig if bench else Config
    plan = SweepPlan(bench=bench)
    launcher = str(config.hydra.launcher.get("_target_", "")).rsplit(".", 1)[-1]
    if launcher and launcher not in SEQUENTIAL_LAUNCHERS:
        plan.side_by_side = str(config.hydra.runtime.choices.get("hydra/launcher", launcher))
    # a launcher of several tasks (submitit's tasks_per_node, nodes): each job is that many ranks, checked so
    ranks, local = launcher_ranks(config.hydra), tasks_per_machine(config.hydra)
    with as_launched(ranks, local) if ranks > 1 else contextlib.nullcontext():
        params = config.hydra.sweeper.get("params")
        for num, overrides in enumerate(sweep_jobs(list(config.hydra.overrides.task), params)):
            job = JobPlan(num, overrides)
            plan.jobs.append(job)
            try:
                cfg = checked_config(compose(config_name=config.hydra.job.config_name, overrides=overrides), schema)
            except Exception as err:  # noqa: BLE001 - a job's bad value is its refusal, named here
                job.refused = errors.describe(errors.from_hydra(err) or err)
                continue
            job.refused, job.seconds = preview(cfg, bench=bench)
            job.short_of_memory, job.cfg = job.refused is not None, cfg
    return plan


# where a sweep leaves offline W&B runs: each job's, and the report's own (rlsync.report.wandb_report)
OFFLINE_RUNS = ("*/wandb/offline-run-*", "wandb/offline-run-*")


def wandb_sync_line(sweep_dir: Path) -> Optional[str]:
    """The one command that uploads every offline W&B run the sweep left (its jobs' and its report's)."""
    import shlex

    found = [pattern for pattern in OFFLINE_RUNS if any(Path(sweep_dir).glob(pattern))]
    if not found:
        return None
    where = shlex.quote(str(sweep_dir))  # the globs stay unquoted: the shell expands them
    runs = "this sweep's offline runs" + (", its report's included" if OFFLINE_RUNS[1] in found else "")
    return f"W&B: `wandb sync {' '.join(f'{where}/{p}' for p in found)}` uploads {runs}"


class SweepReport(Callback):
    """The sweep's plan, its progress and its report (see the module's docstring)."""

    def __init__(self) -> None:
        self.sweep_dir: Optional[Path] = None
        self.plan: Optional[SweepPlan] = None
        self.started: Optional[float] = None
        self.finished: list[float] = []  # seconds of each job that ended, in this process
        self.job_started: Optional[float] = None
        self.reported = False

    # -- Hydra's hooks ---------------------------------------------------------------------------

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.sweep_dir = Path(config.hydra.sweep.dir)
        self.started = time.monotonic()
        try:
            self.plan = plan_sweep(config)
        except Exception as err:  # noqa: BLE001 - the plan is advice: a sweep runs without it
            say(f"note: no sweep plan ({errors.describe(err)})")
            self.plan = None
        for line in self.plan.lines() if self.plan else []:
            say(line)
        if config.get("run", {}).get("dry_run"):
            say("run.dry_run=true: nothing started")
            raise SystemExit(0)
        shell.SWEEP_ENDED.append(self.ended_early)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.job_started = time.monotonic()
        if self.plan is None:  # a single run, or a sweep whose plan failed
            return
        num, total = config.hydra.job.num, len(self.plan.jobs)
        overrides = " ".join(config.hydra.overrides.task) or "defaults"
        say(f"sweep job {num} ({num + 1} of {total}: {overrides}){self.eta(num)}{self.memory_now(num)}")

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if self.job_started is not None:
            self.finished.append(time.monotonic() - self.job_started)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.finish("finished")

    # -- the report ------------------------------------------------------------------------------

    def eta(self, num: int) -> str:
        """ ": 2 done in 1 min, about 3 min left" from the jobs measured so far (the plan's estimate before)."""
        left = [j for j in (self.plan.jobs[num:] if self.plan else []) if j.refused is None]
        if not left:
            return ""
        if self.finished:
            per_job = sum(self.finished) / len(self.finished)
            return (
                f": {len(self.finished)} done in {fmt_duration(sum(self.finished))}, "
                f"about {fmt_duration(per_job * len(left))} left"
            )
        estimate = sum(j.seconds or 0 for j in left)
        return f": about {fmt_duration(estimate)} left (estimated)" if estimate else ""

    def memory_now(self, num: int) -> str:
        """For a job the plan found short of memory: what the same check finds now, as the job starts."""
        job = self.plan.jobs[num] if self.plan and num < len(self.plan.jobs) else None
        if job is None or not job.short_of_memory:
            return ""
        from rlsync.check.duration import preview

        try:
            still, _ = preview(job.cfg, bench=self.plan.bench, fresh=True)
        except Exception:  # noqa: BLE001 - advice only: the job's own check decides
            return ""
        if still:
            return "; short of memory at the plan, and still now: its own check refuses it"
        return "; short of memory at the plan, it fits the memory available now: it runs"

    def ended_early(self, how: str) -> None:
        """rlsync.shell calls this when the sweep stopped before Hydra's end: a job failed, or an interruption."""
        if how == "interrupted":
            say(f"sweep interrupted: `python -m rlsync.report {self.sweep_dir}` reports the jobs that finished")
            return
        self.finish("with failed jobs")

    def finish(self, how: str) -> None:
        if self.reported or self.sweep_dir is None:
            return
        self.reported = True
        if self.ended_early in shell.SWEEP_ENDED:
            shell.SWEEP_ENDED.remove(self.ended_early)
        from rlsync.report import print_result, write_report

        took = f" in {fmt_duration(time.monotonic() - self.started)}" if self.started else ""
        say(f"sweep ended {how}{took}: its report follows")
        try:
            print_result(write_report([self.sweep_dir], side_by_side=self.plan.side_by_side if self.plan else None))
        except Exception as err:  # noqa: BLE001 - a report problem must not fail a finished sweep
            say(f"the sweep report failed ({err}); retry with `python -m rlsync.report {self.sweep_dir}`")
        if line := wandb_sync_line(self.sweep_dir):
            print(line, flush=True)
