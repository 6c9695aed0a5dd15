"""Miles' dashboard phase files (`--use-miles-dashboard`: DIR/dashboard/phases/<YYYYMMDD_HH>.jsonl, or
the flat DIR/dashboard/phases.jsonl of its first version): one timer interval per line and process,
`{"name", "t0", "t1", "node", "gpus", "rank", "role"}`, `t1` = -1 while the interval was still open
(a later line with its end supersedes it).

A phase's k-th interval on each rank is that rank's k-th step of it; the step waits for its slowest
rank, so each phase's time per step is the longest interval over the ranks (as rlsync merges its own
ranks: metrics.Merge.SLOWEST). A row per step holds `perf/<name>_time`, Miles' own metric names."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from rlsync.config.files import CONFIG_JSON_MAX, read_json
from rlsync.readers.base import CLOCK, STEP, History, Reader, ReadRefused, bounded, jsonl_objects, number

OPEN_T1 = -1.0  # Miles' PhaseEvent.OPEN_T1: the interval had not ended when written


def phase_files(dashboard: Path) -> list[Path]:
    flat = dashboard / "phases.jsonl"
    parts = sorted((dashboard / "phases").glob("*.jsonl")) if (dashboard / "phases").is_dir() else []
    return [p for p in [flat, *parts] if p.is_file() and not p.is_symlink()]


class MilesPhasesReader(Reader):
    title = "Miles dashboard phases"

    @classmethod
    def sources(cls, found: list[Path]) -> list[Path]:
        out = set()
        for path in found:
            if path.suffix == ".jsonl" and path.parent.name == "phases" and path.parent.parent.name == "dashboard":
                out.add(path.parent.parent)
            elif path.name == "phases.jsonl" and path.parent.name == "dashboard":
                out.add(path.parent)
        return sorted(out)

    @classmethod
    def read(cls, source: Path) -> History:
        # (name, rank) -> t0 -> t1: an interval's closing line replaces its open one
        intervals: dict[tuple[str, int], dict[float, float]] = defaultdict(dict)
        for path in phase_files(source):
            for index, event in enumerate(jsonl_objects(path), 1):
                name, rank = event.get("name"), number(event.get("rank"))
                t0, t1 = number(event.get("t0")), number(event.get("t1"))
                if not isinstance(name, str) or rank is None or t0 is None or t1 is None:
                    raise ReadRefused(f"{path}: line {index} is not a Miles phase event (name, t0, t1, rank)")
                if not (math.isfinite(t0) and math.isfinite(t1)) or (t1 != OPEN_T1 and t1 < t0):
                    raise ReadRefused(f"{path}: line {index}: {name} runs from t0={t0} to t1={t1}, not a time interval")
                if t1 == OPEN_T1 and t0 in intervals[(name, int(rank))]:
                    continue
                intervals[(name, int(rank))][t0] = t1
        per_step: dict[int, dict[str, float]] = defaultdict(dict)
        for (name, _rank), spans in intervals.items():
            closed = [(t0, t1) for t0, t1 in sorted(spans.items()) if t1 != OPEN_T1]
            for k, (t0, t1) in enumerate(closed):
                row, key = per_step[k], f"perf/{name}_time"
                row[key] = max(row.get(key, 0.0), t1 - t0)  # the slowest rank
                row[CLOCK] = max(row.get(CLOCK, t1), t1)
        if not per_step:
            raise ReadRefused(f"{source}: its phase files hold no finished interval")
        rows = [{**row, STEP: float(k)} for k, row in sorted(per_step.items())]
        return History(source, "miles_phases", source.parent.name, bounded(rows, source), meta_args(source), ("miles",))


def meta_args(dashboard: Path) -> dict:
    """The run's arguments from the dashboard's meta.json (Miles' Meta: run_name, start_ts, args), if readable."""
    try:
        meta = read_json(dashboard / "meta.json", max_bytes=CONFIG_JSON_MAX)
    except (OSError, ValueError):
        return {}
    args = meta.get("args") if isinstance(meta, dict) else None
    return args if isinstance(args, dict) else {}
