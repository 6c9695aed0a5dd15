"""A run's history exported as CSV or JSONL: one row per logged step, a column (or key) per metric, as
W&B's `run.history()` / `scan_history()` exports it (`_step`, `_timestamp`), as pandas writes a
TensorBoard or MLflow export, or by hand. The step is `_step`, else `step`, else `global_step`, else the
row's place; the clock is `_timestamp` (or `timestamp`, `wall_time`) where there is one."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from rlsync.readers.base import (
    CLOCK,
    STEP,
    History,
    Reader,
    ReadRefused,
    bounded,
    first_line,
    jsonl_objects,
    number,
    read_lines,
)
from rlsync.readers.verl_jsonl import is_verl_line

STEP_COLUMNS = ("_step", "step", "global_step", "Step")
CLOCK_COLUMNS = ("_timestamp", "timestamp", "wall_time", "Wall time")
CSV_MAX = 1 << 30


def csv_value(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # an empty cell (a metric not logged that step), or text


def normalised(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Each row with its step under STEP and its clock under CLOCK, as every reader's rows are."""
    out = []
    for index, row in enumerate(rows):
        step = next((row[c] for c in STEP_COLUMNS if c in row), float(index))
        clock = next((row[c] for c in CLOCK_COLUMNS if c in row), None)
        out.append({**row, STEP: step, **({CLOCK: clock} if clock is not None else {})})
    return out


class HistoryExportReader(Reader):
    title = "history export"

    @classmethod
    def sources(cls, found: list[Path]) -> list[Path]:
        def exported_jsonl(p: Path) -> bool:  # not verl's, not Miles' phases, not rlsync's own metrics.jsonl
            return not is_verl_line(first_line(p)) and p.parent.name not in ("phases", "dashboard")

        return [p for p in found if p.suffix == ".csv" or (p.suffix == ".jsonl" and exported_jsonl(p))]

    @classmethod
    def read(cls, source: Path) -> History:
        if source.suffix == ".csv":
            lines = read_lines(source, CSV_MAX)
            try:
                table = list(csv.DictReader(io.StringIO("\n".join(lines))))
            except csv.Error as err:
                raise ReadRefused(f"{source} is not CSV ({err})") from None
            rows = [
                {k: v for k, v in ((k, csv_value(v or "")) for k, v in r.items() if k) if v is not None} for r in table
            ]
        else:
            rows = [
                {k: v for k, v in ((k, number(v)) for k, v in obj.items()) if v is not None}
                for obj in jsonl_objects(source)
            ]
        rows = [r for r in rows if r]
        if not rows:
            raise ReadRefused(f"{source}: no row holds a number")
        return History(source, "history", source.stem, bounded(normalised(rows), source))
