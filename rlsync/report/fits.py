"""The update-time fits: a line of update time against bytes, one per transport (payload, strategy, engine)
of the runs, and why no line is shown where it would say nothing."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Optional

from rlsync.fmt import fmt_seconds, is_number
from rlsync.report.runs import MIN_MEASURED

MIN_FIT_SIZES = 3  # distinct update sizes that make a line of time against bytes meaningful by themselves


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


def fit_update_time(rows: list[dict[str, Any]]) -> Optional[Fit]:
    """time = fixed + bytes * seconds_per_byte, least squares over the runs' medians; None when the
    line says nothing (see `fit_problem`)."""
    if fit_problem(rows):
        return None
    sizes = [float(r["update_bytes"]) for r in timed_rows(rows)]
    slope, intercept = statistics.linear_regression(sizes, [float(r["update_time_median"]) for r in timed_rows(rows)])
    return Fit(fixed_s=intercept, seconds_per_byte=slope, points=len(sizes), distinct_sizes=len(set(sizes)))


def timed_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with an update time and its bytes: the points of a fit. A broken measurement (row["broken"]:
    the update timed a busy machine, not the copy) is no point of it, as it is no ranking entry."""
    return [
        r
        for r in rows
        if is_number(r.get("update_bytes")) and is_number(r.get("update_time_median")) and not r.get("broken")
    ]


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


FIT_KEYS = ("transport", "payload", "strategy", "engine")  # each makes its own line of time against bytes


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


def update_fit_lines(groups: list[FitGroup], rows: list[dict[str, Any]] = ()) -> list[str]:
    """The fit section of report.md: one line, or one bullet per transport when the runs differ in it;
    where no line is meaningful, one line saying why; the broken measurements among `rows` named as left out."""
    broken = [str(r["job"]) for r in rows if r.get("broken") and is_number(r.get("update_time_median"))]
    left_out = [f"Left out of the fit: runs {', '.join(broken)} (a broken measurement)."] if broken else []
    if len(groups) > 1:
        return [f"- {group.describe()}" for group in groups] + left_out
    if groups:
        return [groups[0].describe(), *left_out]
    return ["No fit: no run timed the update with its bytes.", *left_out]
