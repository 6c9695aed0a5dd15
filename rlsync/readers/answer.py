"""The question for another framework's run, answered as for rlsync's own: per step the update, the
trainer's offload and onload, the step (and its other parts), each framework's key read through its
map; medians and ranges over the measured steps (warm-up left out), the update's share of the step,
the verdict (record/summary.py's phrasing, config/schema.py's threshold), the largest phase and what
the framework's update time spans."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from rlsync.config.schema import VERDICT_THRESHOLD
from rlsync.fmt import fmt_share
from rlsync.measure import metrics
from rlsync.readers.base import CLOCK, STEP, History, ReadRefused
from rlsync.readers.frameworks.base import FrameworkMap, detect
from rlsync.record.summary import share_verdict

UPDATE, OFFLOAD, ONLOAD, STEP_TIME = (metrics.phase_named(n).metric.name for n in metrics.HEADLINE)


@dataclass
class Answer:
    """One imported run, answered: its figures under rlsync's metric names."""

    history: History
    framework: str  # the registry name
    map: type[FrameworkMap]
    warmup: int
    steps: list[dict[str, float]]  # per step on the framework's axis, warm-up included: rlsync name -> seconds
    stats: dict[str, dict[str, float]]  # rlsync name -> median, min, max over the measured steps
    measured: int
    keys: dict[str, str]  # rlsync name -> the framework's key it was read from ("clock" for a derived step)
    share: Optional[float] = None  # the update's median over the median step
    largest: Optional[tuple[str, float]] = None  # the largest other phase's label and share
    verdict: str = ""
    model: Optional[str] = None  # the Hugging Face id the run's config names
    notes: list[str] = field(default_factory=list)


def phase_label(name: str) -> str:
    try:
        return metrics.phase_named(name).label
    except KeyError:
        return name.replace("_", " ")


def by_step(history: History, fmap: type[FrameworkMap]) -> list[tuple[float, list[dict[str, float]]]]:
    """The rows grouped by the framework's step axis, in step order: rows without the axis join the next
    row that has it (carry_to_next) or are left out."""
    keys = history.keys()
    axis = fmap.first(keys, fmap.axis) or STEP
    groups: dict[float, list[dict[str, float]]] = defaultdict(list)
    waiting: list[dict[str, float]] = []
    for row in history.rows:
        step = row.get(axis)
        if step is None or not math.isfinite(step):
            if fmap.carry_to_next:
                waiting.append(row)
            continue
        groups[step].extend([*waiting, row])
        waiting = []
    return sorted(groups.items())


def time_of(rows: list[dict[str, float]], key: str, history: History, step: float) -> Optional[float]:
    """The seconds `key` logged in one step (several rows add up: each a separate interval); ReadRefused
    for a value that is not a time."""
    values = [row[key] for row in rows if key in row]
    for value in values:
        if not math.isfinite(value) or value < 0:
            raise ReadRefused(
                f"{history.path}: {key} is {value:g} at step {step:g}: a time must be a finite number of seconds >= 0"
            )
    return sum(values) if values else None


def read_steps(history: History, fmap: type[FrameworkMap]) -> tuple[list[dict[str, float]], dict[str, str]]:
    """Per step, the mapped times under rlsync's names, and which key each was read from."""
    keys = history.keys()
    wanted = {UPDATE: fmap.update, OFFLOAD: fmap.offload, ONLOAD: fmap.onload, STEP_TIME: fmap.step}
    wanted.update({f"perf/{name}_time": ks for name, ks in fmap.phases.items()})
    chosen = {name: key for name, ks in wanted.items() if (key := fmap.first(keys, ks))}
    steps, previous_clock = [], None
    for step, rows in by_step(history, fmap):
        out = {"step": step}
        for name, key in chosen.items():
            value = time_of(rows, key, history, step)
            if value is not None:
                out[name] = value
        clock = max((r[CLOCK] for r in rows if CLOCK in r and math.isfinite(r[CLOCK])), default=None)
        if STEP_TIME not in chosen and clock is not None and previous_clock is not None:
            out[STEP_TIME] = clock - previous_clock  # the step from the clock: the time since the last step's log
        previous_clock = clock if clock is not None else previous_clock
        steps.append(out)
    if STEP_TIME not in chosen:
        chosen[STEP_TIME] = "clock"
    return steps, chosen


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def answer(history: History, *, framework: Optional[str] = None, warmup: Optional[int] = None) -> Answer:
    """`history` answered through its framework's map (`framework` forces one); `warmup` logged steps
    left out (default: the map's). ReadRefused when no measured step holds both an update and a step."""
    name, fmap = detect(history, framework)
    warmup = fmap.warmup if warmup is None else warmup
    steps, keys = read_steps(history, fmap)
    measured = [s for s in steps[warmup:] if UPDATE in s and STEP_TIME in s]
    if not measured:
        raise ReadRefused(
            f"{history.path}: {len(steps)} logged step(s), none after the {warmup} warm-up step(s) with both "
            f"{keys[UPDATE]} and the step's time ({keys[STEP_TIME]}): lower --warmup, or give a longer run"
        )
    names = {n for s in measured for n in s if n != "step"}
    stats = {n: spread([s[n] for s in measured if n in s]) for n in sorted(names)}
    result = Answer(history, name, fmap, warmup, steps, stats, len(measured), keys)
    step_median = stats[STEP_TIME]["median"]
    result.share = stats[UPDATE]["median"] / step_median if step_median > 0 else None
    others = {n: st["median"] / step_median for n, st in stats.items() if n not in (UPDATE, STEP_TIME) and step_median}
    if others:
        top = max(others, key=others.get)
        result.largest = (phase_label(top.removeprefix("perf/").removesuffix("_time")), others[top])
    result.model = fmap.model_id(history.config)
    result.verdict = verdict_line(result)
    return result


def verdict_line(result: Answer) -> str:
    """The run's verdict as rlsync phrases its own, then the largest phase and the framework's span note."""
    if result.share is None:
        return f"{result.measured} measured steps, no step time to compare with. {result.map.spans}"
    line = share_verdict(result.share, VERDICT_THRESHOLD)
    if result.largest:
        line += f"; the largest phase is {result.largest[0]} ({fmt_share(result.largest[1])} of the step)"
    step_from = (
        " The step is the time between logged steps (no step time logged)." if result.keys[STEP_TIME] == "clock" else ""
    )
    return f"{line}.{step_from} {result.map.spans}"
