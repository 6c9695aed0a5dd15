"""The table model as a whole: ReportResult (what write_report found and wrote) and table_rows, its rows.
Its modules (runs, rows, fits, ranking, cells and this) import none of the renderers, which import them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlsync.report.cells import table_cells
from rlsync.report.fits import Fit, FitGroup
from rlsync.report.rows import table_row
from rlsync.report.runs import FailedRun, Run


@dataclass
class ReportResult:
    """What `write_report` found and wrote; `ok` when at least one run made it into the table."""

    out_dir: Path
    group: str
    runs: list[Run] = field(default_factory=list)
    failures: list[FailedRun] = field(default_factory=list)
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


def table_rows(result: ReportResult) -> list[dict[str, Any]]:
    """One table row per run; a run whose numbers cannot be tabulated (a value of a type nothing
    expected) moves to the failures with one line instead of stopping the report."""
    rows, kept = [], []
    for run in result.runs:
        try:
            row = table_row(run)
            table_cells(row)  # formatting is where a wrong type would show
        except Exception as err:  # noqa: BLE001 - one bad record costs its own row
            result.failures.append(
                FailedRun(
                    run.path,
                    run.job,
                    run.overrides,
                    f"malformed run record ({type(err).__name__}: {err})".splitlines()[0],
                    run.sweep,
                )
            )
            continue
        rows.append(row)
        kept.append(run)
    result.runs = kept
    return rows
