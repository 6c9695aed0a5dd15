"""The report on stall benches (bench.target=stall): the client-seen stall per policy beside the
engine's receive, in report.md, report.csv, the verdict, client_stall.png and W&B, read from the study's
own recorded runs (experiments/pause/results_cpu: real output of `python -m rlsync.bench`, recorded when the
target was named pause: read as a stall bench). The bench's real run: tests/process/test_report_pause.py."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from conftest import MODELS, ROOT, section, write_job

from rlsync.fmt import fmt_spread
from rlsync.report import write_report

STUDY = ROOT / "experiments" / "pause" / "results_cpu"


@pytest.fixture
def pause_runs(tmp_path: Path) -> tuple[Path, dict]:
    """The Qwen3-0.6B pause study's run (both policies), copied; and its summary's metrics."""
    run = tmp_path / "qwen3_0p6b"
    shutil.copytree(STUDY / "qwen3_0p6b", run)
    return run, json.loads((run / "summary.json").read_text())["metrics"]


def test_the_report_shows_each_policys_longest_gap_beside_the_engines_receive(pause_runs, tmp_path, drawn):
    run, m = pause_runs
    result = write_report([run], out_dir=tmp_path / "out", log_wandb=False)
    md = (tmp_path / "out" / "report.md").read_text()
    table = section(md, "Client-seen stalls")
    lines = {line.split(" | ")[1]: line for line in table.splitlines() if line.startswith("| qwen3_0p6b")}
    assert set(lines) == {"pause", "stage"}
    for policy, line in lines.items():
        for metric in ("max_gap_time", "receive_time"):
            st = m[f"pause/{policy}/{metric}"]
            assert fmt_spread(st["median"], st["min"], st["max"]) in line, (policy, metric, line)
        assert f"{m[f'pause/{policy}/tokens_ratio']['median']:.2f}" in line
    assert "pointer swap" in lines["stage"] and "in-place receive" in lines["pause"]
    ratio = m["pause/gap_ratio"]
    assert f"{ratio['median']:.2f} ({ratio['min']:.2f} to {ratio['max']:.2f})" in lines["stage"]

    # the verdict names both gaps, their ratio and the receive; report.csv holds the raw medians
    (verdict,) = [line for line in section(md, "Verdicts").splitlines() if line.startswith("- ")]
    assert "longest client-seen gap: pause" in verdict and f"({ratio['median']:.2f}x pause's)" in verdict
    assert "2 streaming clients" in verdict
    (row,) = csv.DictReader((tmp_path / "out" / "report.csv").open())
    assert float(row["stage_gap_ratio_median"]) == pytest.approx(ratio["median"])
    assert float(row["pause_max_gap_time_median"]) == pytest.approx(m["pause/pause/max_gap_time"]["median"])
    assert float(row["stage_receive_time_median"]) == pytest.approx(m["pause/stage/receive_time"]["median"])

    # the plot: a gap bar and a receive bar per policy, each the median
    fig = drawn["client_stall.png"]
    widths = sorted(round(p.get_width(), 6) for p in fig.axes[0].patches)
    expect = [m[f"pause/{p}/{k}"]["median"] for p in ("pause", "stage") for k in ("max_gap_time", "receive_time")]
    assert widths == sorted(round(v, 6) for v in expect)  # seconds: the largest is over 1 s
    assert tmp_path / "out" / "client_stall.png" in result.files


def test_a_run_of_the_step_loop_has_no_client_stall_and_the_plot_says_why(tmp_path):
    write_job(tmp_path / "sweep" / "0", next(iter(MODELS)), 512.0)
    result = write_report([tmp_path / "sweep"], log_wandb=False)
    md = (tmp_path / "sweep" / "report.md").read_text()
    assert "No run measured it (`python -m rlsync.bench bench.target=stall`)." in section(md, "Client-seen stalls")
    assert any(n.startswith("client_stall.png skipped: no run is a stall bench") for n in result.notes)


def test_a_stall_run_with_one_policy_reports_it_alone(pause_runs, tmp_path):
    """bench.policies=[stage]: one row, no ratio (summary.json's and metrics.jsonl's keys both)."""
    run, _ = pause_runs
    summary = json.loads((run / "summary.json").read_text())
    summary["metrics"] = {k: v for k, v in summary["metrics"].items() if not k.startswith("pause/pause/")}
    del summary["metrics"]["pause/gap_ratio"]
    (run / "summary.json").write_text(json.dumps(summary))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kept = [{k: v for k, v in r.items() if not k.startswith("pause/pause/") and k != "pause/gap_ratio"} for r in rows]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    write_report([run], out_dir=tmp_path / "out", log_wandb=False)
    table = section((tmp_path / "out" / "report.md").read_text(), "Client-seen stalls")
    assert [line.split(" | ")[1] for line in table.splitlines() if line.startswith("| qwen3_0p6b")] == ["stage"]


def test_the_wandb_report_run_holds_the_client_stall_table(pause_runs, tmp_path):
    from types import SimpleNamespace

    from rlsync.report.cells import STALL_HEADER, stall_table
    from rlsync.report.wandb_report import report_payload

    class Table:  # what wandb.Table was given
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    run, _ = pause_runs
    result = write_report([run], out_dir=tmp_path / "out", log_wandb=False)
    payload = report_payload(result, SimpleNamespace(Table=Table, Image=lambda path, caption: path))
    table = payload["report/stall_table"]
    assert table.columns == list(STALL_HEADER) and [row[1] for row in table.data] == ["pause", "stage"]
    assert all(" | ".join(row) in stall_table(result.rows) for row in table.data)  # report.md's cells
    assert payload["report/client_stall"] == str(tmp_path / "out" / "client_stall.png")  # the plot, apart
