"""report.md and report.csv, rendered from the table model."""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path
from typing import Any

from rlsync.fmt import plural
from rlsync.report import sizing
from rlsync.report.cells import (
    IDLE_NOTE,
    STALL_NOTE,
    TABLE_NOTE,
    common_overrides,
    idle_table,
    machine_line,
    phase_table,
    run_label,
    stall_table,
)
from rlsync.report.fits import update_fit_lines
from rlsync.report.output import replacing, write_text
from rlsync.report.ranking import best_settings
from rlsync.report.rows import csv_fields
from rlsync.report.table import ReportResult


def write_markdown(path: Path, result: ReportResult, plots: list[Path], sources: list[Path]) -> None:
    out = [f"# rlsync report: {result.group}", ""]
    out += [machine_line(result.runs), ""]
    out += [f"Sources: {', '.join(str(s) for s in sources)}. Written {datetime.now():%Y-%m-%d %H:%M:%S}.", ""]
    out += [f"{plural(len(result.runs), 'run')} reported, {len(result.failures)} failed.", ""]
    out += ["## Best setting", ""]
    out += [f"- {best.describe()}" for best in best_settings(result.rows)] or ["No run measured a time to compare."]
    out += ["", "## Runs", "", TABLE_NOTE, ""]
    out += [result.table_markdown if result.rows else "No run measured a step.", ""]
    out += ["## Step by phase", "", "Median per phase (its share of the median step).", ""]
    out += [phase_table(result.rows), ""]
    out += ["## Engine idle", "", IDLE_NOTE, "", idle_table(result.rows) or "No run logged the engine's idle time.", ""]
    out += ["## Client-seen stalls", "", STALL_NOTE, ""]
    out += [stall_table(result.rows) or "No run measured it (`python -m rlsync.bench bench.target=stall`).", ""]
    out += ["## Verdicts", ""]
    common = common_overrides(result.rows)
    out += [f"- **{run_label(row, common)}**: {row['verdict']}" for row in result.rows]
    out += ["", "## Sizing the known pain", ""]
    out += sizing.pain_lines(result.runs)
    out += ["", "## Cost model (the planner's coefficients, fitted to these runs)", ""]
    out += sizing.cost_fit_lines(result.calibration)
    out += ["", "## Update time against bytes", ""]
    out += [*update_fit_lines(result.fits, result.rows), ""]
    out += ["## Plots", ""]
    out += [f"![{p.stem.replace('_', ' ')}]({p.name})" for p in plots]
    out += [f"- {note}" for note in result.notes]
    out += ["", "## Failed runs", ""]
    out += [f"- **{f.job}** ({' '.join(f.overrides) or 'defaults'}): {f.error}" for f in result.failures] or ["None."]
    write_text(path, "\n".join(out) + "\n")  # whole or not at all, never through a link (output.py)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with replacing(path, newline="") as f:
        fields = csv_fields()
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in fields})
