"""The sweep report (rlsync.report): table, CSV, plots, W&B run and W&B Report, all offline.

The runs here are fake job directories written the way the runner writes them (summary.json,
metrics.jsonl, .hydra/), so the tests are fast and do not depend on the runner; the report runs through
its entry point in this process, and as a real `python -m rlsync.report` process where the process is
what is tested in tests/process/test_report.py (a file size limit, a real sweep's report, W&B offline).
"""

from __future__ import annotations

import csv
import json
import os
import statistics
from pathlib import Path

import pytest
from conftest import (
    BUCKETS,
    ERROR_LINE,
    MODELS,
    PLOTS,
    PNG_SIGNATURE,
    TRANSPORT_COST,
    WARMUP,
    offline_env,
    run_report,
    write_bench_job,
    write_job,
)

MEASURED_JITTER = 1.035  # median of 1 + 0.01 * step over the measured steps 2..5


# ----------------------------------------------------------------------------------------------
# Fake job directories
# ----------------------------------------------------------------------------------------------


def set_wandb_config(sweep: Path, **values: str) -> None:
    """Rewrite `wandb.*` in the resolved config of every job of `sweep` that has a summary."""
    for path in sweep.glob("*/summary.json"):
        summary = json.loads(path.read_text())
        summary["config"]["wandb"].update(values)
        path.write_text(json.dumps(summary))


# ----------------------------------------------------------------------------------------------
# The local report
# ----------------------------------------------------------------------------------------------


def test_cli_writes_table_csv_plots_and_failures(sweep: Path) -> None:
    proc = run_report(str(sweep), "--no-wandb")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr

    md = (sweep / "report.md").read_text()
    runs_section = md.split("## Runs")[1].split("\n## ")[0]  # (the step-by-phase table has a row per run too)
    table_rows = [line for line in runs_section.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(table_rows) == 4
    for num, (model, bucket) in enumerate((m, b) for m in MODELS for b in BUCKETS):
        row = next(r for r in table_rows if r.startswith(f"| {num}: "))
        assert f"model={model}" in row and f"update.bucket_mb={bucket:g}" in row
        assert f"| {model} | direct | {bucket:g} |" in row
        summary = json.loads((sweep / str(num) / "summary.json").read_text())
        assert summary["verdict"] in md
        eff = summary["metrics"]["perf/update_weights_efficiency"]["median"]
        assert f"{eff:.2f} ({1 / eff:.2f}x floor)" in row
    assert "Machine:" in md and "device cpu" in md
    assert "## Failed runs" in md and ERROR_LINE in md
    assert "fixed + bytes /" in md and "GB/s" in md

    for name in PLOTS:
        assert (sweep / name).read_bytes()[:8] == PNG_SIGNATURE, name
        assert f"]({name})" in md

    # the CLI prints the table and the paths it wrote
    assert "| run | model |" in proc.stdout
    assert str(sweep / "report.csv") in proc.stdout
    assert ERROR_LINE in proc.stdout


def test_csv_numbers_are_the_summary_medians(sweep: Path) -> None:
    assert run_report(str(sweep), "--no-wandb").returncode == 0
    with (sweep / "report.csv").open() as f:
        rows = {row["job"]: row for row in csv.DictReader(f)}
    assert sorted(rows) == ["0", "1", "2", "3"]  # the failed job has no numbers
    pairs = {
        "update_time_median": ("perf/update_weights_time", "median"),
        "update_time_min": ("perf/update_weights_time", "min"),
        "update_time_max": ("perf/update_weights_time", "max"),
        "sleep_time_median": ("perf/sleep_time", "median"),
        "wake_up_time_max": ("perf/wake_up_time", "max"),
        "step_time_median": ("perf/step_time", "median"),
        "update_efficiency_median": ("perf/update_weights_efficiency", "median"),
        "update_peak_bytes_max": ("perf/update_weights_peak_bytes", "max"),
    }
    for job, row in rows.items():
        summary = json.loads((sweep / job / "summary.json").read_text())
        for column, (metric, which) in pairs.items():
            assert float(row[column]) == summary["metrics"][metric][which], (job, column)
        assert float(row["update_share"]) == summary["share"]["update_weights"]
        assert float(row["bucket_mb"]) == summary["setup"]["bucket_mb"]
        assert row["model"] == summary["model"]["name"]


def test_incomplete_run_is_computed_from_metrics(tmp_path: Path) -> None:
    from rlsync.report import load_job, table_row

    job = tmp_path / "runs" / "A"
    write_job(job, "tiny", 4.0, with_summary=False)
    run = load_job(job)
    assert run.status == "incomplete"
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    update = [r["perf/update_weights_time"] for r in rows if r["step"] >= WARMUP]
    row = table_row(run)
    assert row["update_time_median"] == statistics.median(update)
    assert row["update_time_min"] == min(update) and row["update_time_max"] == max(update)
    assert row["verdict"].startswith("incomplete")


def test_single_run_dir_skips_plots_it_cannot_draw(tmp_path: Path) -> None:
    """One run: no fit, no bucket sweep; the step breakdown is still drawn, the rest noted."""
    job = tmp_path / "runs" / "2026-11-29_09-00-00"
    write_job(job, "tiny", 4.0)
    proc = run_report(str(job), "--no-wandb")
    assert proc.returncode == 0, proc.stderr
    md = (job / "report.md").read_text()
    assert (job / "step_breakdown.png").read_bytes()[:8] == PNG_SIGNATURE
    for name in ("update_time_vs_bytes.png", "update_time_vs_bucket.png", "peak_memory_vs_bucket.png"):
        assert not (job / name).exists()
        assert f"{name} skipped" in md
    assert "No fit" in md


def test_nothing_found_exits_1_with_one_line(tmp_path: Path) -> None:
    proc = run_report(str(tmp_path), "--no-wandb")
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_write_report_api_without_wandb(sweep: Path, tmp_path: Path) -> None:
    from rlsync.report import write_report

    out = tmp_path / "elsewhere"
    result = write_report([sweep], out_dir=out, log_wandb=False)
    assert result.ok and len(result.runs) == 4 and len(result.failures) == 1
    assert result.group == sweep.name
    assert {p.name for p in result.files} == {"report.md", "report.csv", *PLOTS}
    assert all(p.parent == out for p in result.files)
    assert result.fit is not None and result.fit.bandwidth_gbps and result.fit.bandwidth_gbps > 0


@pytest.mark.parametrize("target", ["update", "offload"])
def test_bench_verdict_is_its_time_against_the_copy_floor(tmp_path: Path, target: str) -> None:
    """A bench has no step: its verdict is the median of what it timed, against the copy floor."""
    from rlsync.fmt import fmt_bytes, fmt_seconds
    from rlsync.report import load_job, table_row

    job = tmp_path / "runs" / "bench"
    write_bench_job(job, "tiny", "direct", target)
    verdict = table_row(load_job(job))["verdict"]
    assert "step" not in verdict
    metrics = json.loads((job / "summary.json").read_text())["metrics"]
    phases = {
        "update": [("update_weights", "update alone")],
        "offload": [("sleep", "offload alone"), ("wake_up", "onload alone")],
    }
    for stem, label in phases[target]:
        seconds = metrics[f"perf/{stem}_time"]["median"]
        limit = metrics[f"perf/{stem}_limit_time"]["median"]
        ratio = 1 / metrics[f"perf/{stem}_efficiency"]["median"]
        assert f"{label}: {fmt_seconds(seconds)} median, {ratio:.2f}x the copy floor of {fmt_seconds(limit)}" in verdict
    state = fmt_bytes(MODELS["tiny"] * 8)  # what bench_rows offloads
    setup = (
        "(transport direct, bucketed, 512 MiB)"
        if target == "update"
        else f"(trainer state, offload full, memory move, {state})"
    )
    assert verdict.endswith(setup), verdict


def test_fit_per_transport(tmp_path: Path, drawn: dict) -> None:
    """Runs of several transports: one line each, in report.md and in the plot; none through all."""
    from rlsync.report import write_report

    sweep = tmp_path / "sweep"
    jobs = [("direct", "tiny"), ("direct", "small"), ("broadcast", "tiny"), ("broadcast", "small"), ("ipc", "tiny")]
    for num, (transport, model) in enumerate(jobs):
        write_bench_job(sweep / str(num), model, transport)
    result = write_report([sweep], log_wandb=False)

    fits = {group.label: group.fit for group in result.fits}
    assert list(fits) == ["transport direct", "transport broadcast", "transport ipc"]
    for transport in ("direct", "broadcast"):
        fixed, bandwidth = TRANSPORT_COST[transport]
        assert fits[f"transport {transport}"].fixed_s == pytest.approx(fixed * MEASURED_JITTER)
        assert fits[f"transport {transport}"].bandwidth_gbps == pytest.approx(bandwidth / MEASURED_JITTER / 1e9)
    assert fits["transport ipc"] is None and result.fit is None  # one size only; no single line over all
    from rlsync.report.wandb_report import report_summary

    summary = report_summary(result)  # the report's W&B run: one fit per transport
    assert summary["report/fit/transport_direct_fixed_s"] == pytest.approx(fits["transport direct"].fixed_s)
    assert "report/fit/transport_broadcast_bandwidth_gbps" in summary and "report/fit_fixed_s" not in summary

    md = (sweep / "report.md").read_text()
    fit_section = md.split("## Update time against bytes")[1].split("## Plots")[0]
    assert [line[:24] for line in fit_section.split("\n") if line.startswith("- ")] == [
        "- transport direct: upda",
        "- transport broadcast: u",
        "- transport ipc: no fit ",
    ]
    assert "update alone:" in md and "no step time" not in md  # bench verdicts

    ax = drawn["update_time_vs_bytes.png"].axes[0]
    fitted = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(fitted) == 2 and fitted[0].get_color() != fitted[1].get_color()
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert [entry.split(":")[0] for entry in legend] == ["transport direct", "transport broadcast", "transport ipc"]
    # bench rows are repeats, not steps: no timeline
    assert "step_timeline.png skipped" in md and not (sweep / "step_timeline.png").exists()


def test_single_transport_keeps_one_fit(sweep: Path) -> None:
    from rlsync.report import write_report

    result = write_report([sweep], log_wandb=False)
    assert len(result.fits) == 1 and result.fits[0].label == "" and result.fit is result.fits[0].fit
    from rlsync.report.wandb_report import report_summary

    assert report_summary(result)["report/fit_fixed_s"] == result.fit.fixed_s
    md = (sweep / "report.md").read_text()
    assert f"\n{result.fit.describe()}\n" in md


def test_step_timeline_per_step_with_warmup_and_share(sweep: Path, tmp_path: Path, drawn: dict) -> None:
    from rlsync.report import write_report

    bench = tmp_path / "bench"
    write_bench_job(bench, "tiny")
    out = tmp_path / "out"
    result = write_report([sweep, bench], out_dir=out, log_wandb=False)
    assert (out / "step_timeline.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "](step_timeline.png)" in (out / "report.md").read_text()

    times_ax, share_ax = drawn["step_timeline.png"].axes
    assert times_ax.get_yscale() == "log"
    runs = [row["job"] for row in result.rows if row["job"] != "bench"]
    legend = [text.get_text() for text in share_ax.get_legend().get_texts()]
    assert [entry.split(":")[0] for entry in legend] == runs  # the bench is left out
    for entry, row in zip(
        legend, (r for r in result.rows if r["job"] != "bench")
    ):  # each line named by what sets it apart
        own = [
            o
            for o in row["override_list"]
            if not all(o in r["override_list"] for r in result.rows if r["job"] != "bench")
        ]
        assert own and all(o in entry.replace("\n  ", " ") for o in own), entry
    assert len(times_ax.get_lines()) == 2 * len(runs)  # step and update time per run

    rows = [json.loads(line) for line in (sweep / "0" / "metrics.jsonl").read_text().splitlines()]
    share_line = share_ax.get_lines()[0]
    assert list(share_line.get_xdata()) == [r["step"] for r in rows]
    expected = [100 * r["perf/update_weights_time"] / r["perf/step_time"] for r in rows]
    assert list(share_line.get_ydata()) == pytest.approx(expected)

    for ax in (times_ax, share_ax):  # the warm-up steps shaded: steps 0 and 1
        (band,) = ax.patches
        left, right = ax.transData.inverted().transform(band.get_extents().get_points())[:, 0]
        assert (left, right) == pytest.approx((-0.5, WARMUP - 0.5), abs=1e-6)


def test_step_timeline_draws_at_most_8_runs_and_notes_the_rest(tmp_path: Path, drawn: dict) -> None:
    from rlsync.report import write_report

    sweep = tmp_path / "sweep"
    for num in range(10):
        write_job(sweep / str(num), "tiny", BUCKETS[num % 2])
    result = write_report([sweep], log_wandb=False)
    share_ax = drawn["step_timeline.png"].axes[1]
    assert len(share_ax.get_legend().get_texts()) == 8
    note = "step_timeline.png shows the first 8 of 10 runs with per-step times; left out: 8, 9"
    assert note in result.notes and f"- {note}" in (sweep / "report.md").read_text()
    assert (sweep / "step_timeline.png").exists()


# ----------------------------------------------------------------------------------------------
# W&B
# ----------------------------------------------------------------------------------------------


def test_wandb_disabled_in_runs_logs_nothing(sweep: Path, tmp_path: Path) -> None:
    set_wandb_config(sweep, mode="disabled")
    proc = run_report(str(sweep), env=offline_env(tmp_path) | {"WANDB_MODE": ""})
    assert proc.returncode == 0, proc.stderr
    assert "W&B: not logged" in proc.stdout
    assert not (sweep / "wandb").exists()


@pytest.mark.parametrize("mode", ["offline", ""])
def test_wandb_report_without_login_fails_in_one_line(sweep: Path, tmp_path: Path, mode: str) -> None:
    proc = run_report(str(sweep), "--no-wandb", "--wandb-report", env=offline_env(tmp_path) | {"WANDB_MODE": mode})
    assert proc.returncode == 3
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--wandb-report needs W&B online" in lines[0] and "wandb login" in lines[0]
    assert (sweep / "report.md").exists()  # the local report is written anyway


def test_build_report_blocks_offline(sweep: Path) -> None:
    import wandb_workspaces.reports.v2 as wr
    from wandb_workspaces import expr

    from rlsync.report import write_report
    from rlsync.report.wandb_report import build_report_blocks, phase_metrics

    result = write_report([sweep], log_wandb=False)
    report = build_report_blocks("sweep-7", "rlsync-test", "someone", result.rows, table_markdown=result.table_markdown)
    assert isinstance(report, wr.Report)
    assert (report.entity, report.project) == ("someone", "rlsync-test")
    assert report.id == ""  # never saved

    grids = [b for b in report.blocks if isinstance(b, wr.PanelGrid)]
    assert len(grids) == 3
    for grid in grids:
        (runset,) = grid.runsets
        assert (runset.entity, runset.project) == ("someone", "rlsync-test")
        tree = expr.expr_to_filters(runset.filters)
        leaves = {(f.key.name, f.op, f.value) for f in tree.filters}
        assert ("group", "=", "sweep-7") in leaves
        assert ("jobType", "!=", "report") in leaves
    panels = [p for grid in grids for p in grid.panels]

    bars = [p for p in panels if isinstance(p, wr.BarPlot)]
    assert any(p.metrics == ["perf/update_weights_time"] for p in bars)
    lines = [p for p in panels if isinstance(p, wr.LinePlot)]
    PHASE_METRICS = phase_metrics()
    assert any(set(PHASE_METRICS) <= set(p.metrics) for p in bars)
    assert any(set(PHASE_METRICS) <= set(p.y) for p in lines)
    assert {"perf/rollout_time", "perf/train_time", "perf/sleep_time", "perf/wake_up_time"} <= set(PHASE_METRICS)

    (scatter,) = [p for p in panels if isinstance(p, wr.ScatterPlot)]
    assert scatter.x == wr.Config("update.bucket_mb")
    assert scatter.y == wr.SummaryMetric("perf/update_weights_time")
    (parallel,) = [p for p in panels if isinstance(p, wr.ParallelCoordinatesPlot)]
    assert wr.Config("update.bucket_mb") in [c.metric for c in parallel.columns]

    markdown = "\n".join(b.text for b in report.blocks if isinstance(b, wr.MarkdownBlock))
    assert "sweep-7" in markdown and "| run | model |" in markdown
    # The panels serialize without the network (only runsets and Report.save() reach the server).
    for panel in panels:
        panel._to_model()


def test_group_comes_from_wandb_group(sweep: Path) -> None:
    from rlsync.report import write_report

    set_wandb_config(sweep, group="bucket-study")
    assert write_report([sweep], log_wandb=False).group == "bucket-study"


# ----------------------------------------------------------------------------------------------
# A real sweep
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# Malformed records and an output directory that cannot be written: one line, never a traceback
# ----------------------------------------------------------------------------------------------

# job name -> how its summary.json is broken (each job starts as a good finished run)
MALFORMED = {
    "metrics_list": lambda s: {**s, "metrics": [1, 2, 3]},
    "metric_string": lambda s: {**s, "metrics": {"perf/step_time": {"median": "fast", "min": 1, "max": 2}}},
    "setup_list": lambda s: {**s, "setup": ["direct"]},
    "steps_string": lambda s: {**s, "measured_steps": "four"},
    "share_dict": lambda s: {**s, "share": {"update_weights": {"x": 1}}},
    "threshold_string": lambda s: {
        **s,
        "config": {**s["config"], "run": {**s["config"]["run"], "verdict_threshold": "3%"}},
    },
    "model_name_list": lambda s: {**s, "model": {**s["model"], "name": ["tiny"]}},
    "a_list": lambda s: [s],
    "truncated": None,  # the file cut in half
}


def test_malformed_summaries_are_failed_runs_with_one_line_each(tmp_path: Path) -> None:
    root = tmp_path / "sweeps" / "broken"
    write_job(root / "0", "tiny", 1.0)  # one good run, so the report is written
    for num, breaking in enumerate(MALFORMED.values(), start=1):
        job = root / str(num)
        write_job(job, "tiny", 1.0)
        path = job / "summary.json"
        text = path.read_text()
        path.write_text(text[: len(text) // 2] if breaking is None else json.dumps(breaking(json.loads(text))))
    proc = run_report(str(root), "--no-wandb")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("failed: ")]
    assert len(failed) == len(MALFORMED), proc.stdout
    for num in range(1, len(MALFORMED) + 1):
        line = next(ln for ln in failed if ln.startswith(f"failed: {num} "))
        assert "summary.json" in line or "malformed run record" in line, line
    assert "metrics is list [1, 2, 3], not an object" in proc.stdout
    assert 'measured_steps is str "four", not an integer' in proc.stdout
    assert "not valid JSON" in proc.stdout and "holds a list" in proc.stdout
    assert f"1 run reported, {len(MALFORMED)} failed." in (root / "report.md").read_text()


def test_an_output_path_under_a_file_ends_with_one_line_naming_it(sweep: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = run_report(str(sweep), "--no-wandb", "--out", str(blocker / "report"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"rlsync.report: cannot write {blocker / 'report'}: a part of the path is a file, not a directory "
        f"(Not a directory)"
    ]


def test_a_full_disk_ends_with_one_line_naming_the_file(sweep: Path, tmp_path: Path, monkeypatch) -> None:
    """The disk fills while report.md is written: the kernel's ENOSPC, from the write that reaches the disk
    (a symbolic link to /dev/full no longer simulates it: the report refuses to write through a link)."""
    import errno

    out = tmp_path / "out"
    out.mkdir()
    fsync = os.fsync

    def full_under_report_md(fd: int) -> None:
        if Path(os.readlink(f"/proc/self/fd/{fd}")).name.startswith(".report.md."):  # its temporary file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", full_under_report_md)
    proc = run_report(str(sweep), "--no-wandb", "--out", str(out))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"rlsync.report: cannot write {out / 'report.md'}: the disk is full (No space left on device)"
    ]
