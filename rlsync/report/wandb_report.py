"""What the sweep report sends to W&B: a `job_type=report` run, and (on request) a W&B Report.

1. `log_report_run`: one run in the sweep's group holding the comparison table (wandb.Table) and the
   plots (wandb.Image), so that `wandb sync` of the sweep shares the comparison with the runs.
   Offline by default, like the runs; a W&B problem costs one printed line, never the local files.
   Its id is stable per sweep, so rerunning the report replaces its run instead of adding one.
2. `build_report_blocks`: the W&B Report (wandb-workspaces) for the group: an intro with the table,
   then panel grids filtered to the group: update time per run, the step's phases, and the
   bucket-size sweep. Pure: it builds objects and touches no network, so tests check it offline.
   Two things in wandb-workspaces would reach the server, and this module avoids both until
   `publish_report`: `Report(...)` without `entity=` asks the API for the default entity (it raises
   "not logged in" offline), and serializing a `Runset` that names an entity and project looks the
   project up (that happens in `Report.save()`).
3. `publish_report`: saves the Report; needs W&B online and a login. Any failure raises
   `ReportUnavailable` with one line, which the command line prints before exiting 3.

wandb and wandb_workspaces are imported inside the functions: `--no-wandb` needs neither.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
from pathlib import Path
from typing import Any

from rlsync.config.schema import VERDICT_THRESHOLD
from rlsync.fmt import error_line, fmt_share
from rlsync.measure import metrics
from rlsync.report.cells import STALL_HEADER, TABLE_HEADER, common_overrides, stall_cells, table_cells
from rlsync.report.ranking import best_settings
from rlsync.report.rows import csv_fields
from rlsync.report.runs import importing
from rlsync.report.table import ReportResult

REPORT_JOB_TYPE = "report"
UPDATE_METRIC = "perf/update_weights_time"
STEP_AXIS = "step"  # the runner's explicit step metric (define_metric("*", step_metric="step"))
BUCKET_CONFIG = "update.bucket_mb"
OFFLINE_MODES = {"offline", "dryrun", "disabled"}


class ReportUnavailable(Exception):
    """The W&B Report could not be published; the message is one line for the user."""


# ----------------------------------------------------------------------------------------------
# Where the runs logged
# ----------------------------------------------------------------------------------------------


def wandb_settings(result: ReportResult) -> dict[str, Any]:
    """project, entity and mode from the runs' config (the first run that sets each)."""

    def first(key: str, default: Any = None) -> Any:
        return next((run.cfg(key) for run in result.runs if run.cfg(key)), default)

    modes = {str(run.cfg("wandb.mode", "offline")) for run in result.runs}
    all_disabled = bool(modes) and modes == {"disabled"}
    mode = next((m for m in sorted(modes) if m != "disabled"), "offline")
    return {
        "project": first("wandb.project", "rlsync"),
        "entity": first("wandb.entity"),
        "mode": "disabled" if all_disabled else mode,
    }


def has_credentials() -> bool:
    """Whether an API key is configured, without prompting or printing."""
    with importing():  # a stop signal meanwhile: acted on after the import, not inside its extensions
        import wandb

    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            return bool(wandb.login(prompt=False, verify=False))
        except Exception:  # noqa: BLE001 - no login, however W&B fails, means: do not publish
            return False


# ----------------------------------------------------------------------------------------------
# 1. The report run
# ----------------------------------------------------------------------------------------------


def report_run_id(result: ReportResult) -> str:
    """The report run's W&B id, the same on every rerun over the same runs: a hash of the resolved
    source directories (the sweep). A rerun so replaces its report run instead of adding one."""
    sources = "\n".join(report_config(result)["sources"])
    return f"report-{hashlib.sha256(sources.encode()).hexdigest()[:16]}"


def drop_earlier_offline_runs(wandb_dir: Path, run_id: str) -> None:
    """Delete the offline copies an earlier report left of this same run (offline-run-<time>-<id>),
    so that `wandb sync .../wandb/offline-run-*` finds one report run, the latest."""
    for old in wandb_dir.glob(f"offline-run-*-{run_id}"):
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)


def log_report_run(result: ReportResult) -> str:
    """Log the table and plots as a job_type=report run in the sweep's group; returns one line.

    The run's id is stable per sweep (`report_run_id`): a rerun resumes that run online (its summary,
    table and plots replaced by the new ones) and replaces its offline copy on disk.
    """
    settings = wandb_settings(result)
    if settings["mode"] == "disabled" or os.environ.get("WANDB_MODE") == "disabled":
        return "W&B: not logged (wandb.mode=disabled)"
    try:
        with importing():  # only when logging: --no-wandb and wandb.mode=disabled need no wandb
            import wandb

        mode = os.environ.get("WANDB_MODE") or settings["mode"]
        note = ""
        if mode == "online" and not has_credentials():
            mode, note = "offline", " (no W&B login: logged offline instead)"
        run_id = report_run_id(result)
        if mode != "online":
            drop_earlier_offline_runs(result.out_dir / "wandb", run_id)
        with wandb.init(
            project=settings["project"],
            entity=settings["entity"],
            group=result.group,
            job_type=REPORT_JOB_TYPE,
            name=f"report {result.group}",
            id=run_id,
            resume="allow",  # online: the rerun continues the same run; offline: a fresh copy under the same id
            tags=[REPORT_JOB_TYPE],
            mode=mode,
            dir=str(result.out_dir),
            config=report_config(result),
            settings=wandb.Settings(silent=True),
            reinit="finish_previous",  # from a Hydra callback: never log into a job's run
        ) as run:
            run.log(report_payload(result, wandb))
            run.summary.update(report_summary(result))
            run_dir = Path(run.dir).parent  # run.dir is <run dir>/files
    except Exception as exc:  # noqa: BLE001 - any W&B problem: say so once, the local files stand
        return f"rlsync.report: W&B logging failed ({error_line(exc)}); the local report is in {result.out_dir}"
    if mode == "online":
        return f"W&B: report run logged online in group {result.group}{note}"
    return f"W&B: report run logged {mode} to {run_dir}{note}; share it with `wandb sync {run_dir}`"


def report_config(result: ReportResult) -> dict[str, Any]:
    return {
        "group": result.group,
        "runs": [row["job"] for row in result.rows],
        "failed": [f.job for f in result.failures],
        "sources": sorted({str(run.sweep or run.path) for run in result.runs}),
    }


def report_payload(result: ReportResult, wandb: Any) -> dict[str, Any]:
    """The table twice (as in report.md, and raw numbers as in report.csv), the client-seen stalls
    where a run is a stall bench, and every plot."""
    common, fields = common_overrides(result.rows), csv_fields()
    payload: dict[str, Any] = {
        "report/table": wandb.Table(columns=list(TABLE_HEADER), data=[table_cells(r, common) for r in result.rows]),
        "report/numbers": wandb.Table(columns=list(fields), data=[[r.get(c) for c in fields] for r in result.rows]),
    }
    if stalls := stall_cells(result.rows):  # stall benches: report.md's "Client-seen stalls"
        payload["report/stall_table"] = wandb.Table(columns=list(STALL_HEADER), data=stalls)
    for path in result.files:
        if path.suffix == ".png":
            payload[f"report/{path.stem}"] = wandb.Image(str(path), caption=path.stem.replace("_", " "))
    return payload


def report_summary(result: ReportResult) -> dict[str, Any]:
    summary: dict[str, Any] = {"report/runs": len(result.runs), "report/failed": len(result.failures)}
    summary["report/best"] = [best.describe() for best in best_settings(result.rows)]  # report.md's "Best setting"
    for group in result.fits:  # one line per transport; report/fit_* alone when every run shares one
        if group.fit is None:
            continue
        prefix = "report/fit" + (f"/{group.label.replace(' ', '_')}" if group.label else "")
        summary[f"{prefix}_fixed_s"] = group.fit.fixed_s
        if group.fit.bandwidth_gbps:
            summary[f"{prefix}_bandwidth_gbps"] = group.fit.bandwidth_gbps
    return summary


# ----------------------------------------------------------------------------------------------
# 2. The W&B Report, built offline
# ----------------------------------------------------------------------------------------------


def build_report_blocks(
    group: str,
    project: str,
    entity: str,
    runs: list[dict[str, Any]],
    table_markdown: str = "",
    fit_line: str = "",
    best_lines: tuple[str, ...] = (),
):
    """The unsaved W&B Report for one sweep group.

    `runs` are the table rows of `rlsync.report.table_row`; they only feed the intro text. The
    panels read the group's runs from W&B (the runs, not this report's own job_type=report run).
    `entity` must be given: wandb-workspaces would otherwise ask the server for a default.
    """
    with importing():
        import wandb_workspaces.reports.v2 as wr
        from wandb_workspaces import expr

    def grid(*panels) -> Any:
        runset = wr.Runset(
            entity=entity,
            project=project,
            name=f"sweep {group}",
            filters=expr.And(expr.Metric("Group") == group, expr.Metric("JobType") != REPORT_JOB_TYPE),
        )
        return wr.PanelGrid(runsets=[runset], panels=list(panels))

    def layout(x: int, y: int, w: int = 12, h: int = 8):
        return wr.Layout(x=x, y=y, w=w, h=h)

    update_grid = grid(
        wr.BarPlot(title="Weight update time per run (s)", metrics=[UPDATE_METRIC], layout=layout(0, 0)),
        wr.LinePlot(title="Weight update time per step (s)", x=STEP_AXIS, y=[UPDATE_METRIC], layout=layout(12, 0)),
    )
    phases = phase_metrics()
    phase_grid = grid(
        wr.BarPlot(title="Step by phase per run (s)", metrics=phases, layout=layout(0, 0)),
        wr.LinePlot(title="Phases per step (s)", x=STEP_AXIS, y=phases, plot_type="stacked-area", layout=layout(12, 0)),
    )
    bucket_grid = grid(
        wr.ScatterPlot(
            title="Update time vs bucket size",
            x=wr.Config(BUCKET_CONFIG),
            y=wr.SummaryMetric(UPDATE_METRIC),
            log_x=True,
            layout=layout(0, 0),
        ),
        wr.ParallelCoordinatesPlot(
            title="Bucket-size sweep",
            columns=[
                wr.ParallelCoordinatesPlotColumn(metric=wr.Config("model.name")),
                wr.ParallelCoordinatesPlotColumn(metric=wr.Config(BUCKET_CONFIG), log=True),
                wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric(UPDATE_METRIC)),
                wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric("perf/update_weights_peak_bytes")),
                wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric("perf/step_time")),
            ],
            layout=layout(12, 0),
        ),
    )
    blocks = [
        wr.MarkdownBlock(intro_markdown(group, runs)),
        *([wr.MarkdownBlock("\n".join(f"- {line}" for line in best_lines))] if best_lines else []),
        *([wr.MarkdownBlock(table_markdown)] if table_markdown else []),
        *([wr.P(fit_line)] if fit_line else []),
        wr.H2("Weight update per run"),
        update_grid,
        wr.H2("Where the step goes"),
        phase_grid,
        wr.H2("Bucket-size sweep"),
        bucket_grid,
    ]
    return wr.Report(
        project=project,
        entity=entity,
        title=f"rlsync sweep {group}"[:128],
        description="Weight update, offload and onload against the step, per run of one sweep.",
        blocks=blocks,
        width="fluid",
    )


def phase_metrics() -> list[str]:
    """The step's parts, in the order they run (the catalogue's; a phase a run did not time draws nothing)."""
    return [p.metric.name for p in metrics.step_phases()]


def intro_markdown(group: str, runs: list[dict[str, Any]]) -> str:
    models = sorted({str(r.get("model")) for r in runs if r.get("model")})
    buckets = sorted({r["bucket_mb"] for r in runs if isinstance(r.get("bucket_mb"), (int, float))})
    return (
        f"Sweep group `{group}`: {len(runs)} runs"
        + (f", models {', '.join(models)}" if models else "")
        + (f", bucket sizes {', '.join(f'{b:g}' for b in buckets)} MiB" if buckets else "")
        + ". Times are medians over the measured steps (warm-up left out). "
        + "The verdict: the update is worth tuning once it passes run.verdict_threshold (default "
        + f"{fmt_share(VERDICT_THRESHOLD)}) of the step. Built by `python -m rlsync.report --wandb-report`."
    )


# ----------------------------------------------------------------------------------------------
# 3. Publishing it
# ----------------------------------------------------------------------------------------------


def publish_report(result: ReportResult) -> str:
    """Save the Report to W&B and return its URL; raises ReportUnavailable (one line) otherwise."""
    needs = "--wandb-report needs W&B online (run `wandb login`)"
    env_mode = os.environ.get("WANDB_MODE", "")
    if env_mode in OFFLINE_MODES:
        raise ReportUnavailable(f"{needs}, but WANDB_MODE={env_mode}")
    try:
        if not has_credentials():
            raise ReportUnavailable(f"{needs}: no W&B API key is configured")
        settings = wandb_settings(result)
        with contextlib.redirect_stderr(io.StringIO()):  # wandb's own log lines; ours is the one line
            entity = settings["entity"] or default_entity()
            report = build_report_blocks(
                result.group,
                settings["project"],
                entity,
                result.rows,
                table_markdown=result.table_markdown,
                fit_line="; ".join(group.describe() for group in result.fits),
                best_lines=tuple(best.describe() for best in best_settings(result.rows)),
            )
            report.save()
            return report.url
    except ReportUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever W&B's report API raises becomes the one ReportUnavailable line
        raise ReportUnavailable(f"{needs}; publishing failed ({error_line(exc)})") from None


def default_entity() -> str:
    import wandb

    return wandb.Api().default_entity
