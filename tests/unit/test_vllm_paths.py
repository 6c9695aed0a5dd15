"""bench.target=vllm_paths: vLLM's three update paths timed in one benchmark, each row verified (issue 46); and
rollout.vllm_reload_mode in summary.json's setup and the report's setup (the transport cell, a bench's verdict).

Here: its rules, its check and its table, in this process; the benchmark itself on the tiny model runs in
tests/process/test_vllm_paths.py (a real process, as the other real vLLM engines' tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import needs_vllm, run_main, run_report, write_bench_job

from rlsync.bench import vllm_paths
from rlsync.bench.vllm_paths import PATHS, SEPARATION, VllmPathsTarget, verified

BENCH = ("bench.target=vllm_paths", "rollout.engine=vllm", "run.progress=false")


def test_the_check_needs_the_new_weights_and_fails_on_nan():
    assert verified(0.003, 0.45) and verified(0.011, 1.1)  # the tiny model's and Qwen3-0.6B's, as measured
    assert not verified(0.003, 0.003 * SEPARATION * 0.9)  # not far enough from the old weights: not this update
    assert not verified(0.52, 0.45)  # vLLM's reload on a CPU with a tied lm_head left stale
    assert not verified(float("nan"), 0.45) and not verified(0.003, float("nan"))  # NaN compares false


def one_line_refusal(proc, start: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), proc.stderr


@pytest.mark.parametrize(
    "overrides, start",
    [
        ((), "rlsync: config error: rollout.engine=hf: not allowed with bench.target=vllm_paths"),
        (("rollout.engine=vllm", "update.strategy=per_tensor"), "rlsync: config error: update.strategy=per_tensor"),
        (("rollout.engine=vllm", "update.transport=ipc"), "rlsync: config error: update.transport=ipc"),
        (("rollout.engine=vllm", "update.payload=fp8"), "rlsync: config error: update.payload=fp8"),
    ],
)
@needs_vllm  # without vLLM the first refusal is that it does not import (the test below)
def test_the_target_refuses_what_it_would_not_compare(tmp_path, overrides, start):
    proc = run_main("bench.target=vllm_paths", *overrides, f"hydra.run.dir={tmp_path}", module="rlsync.bench")
    one_line_refusal(proc, start)
    assert not (tmp_path / "summary.json").exists()


def test_the_target_is_refused_in_one_line_where_vllm_does_not_import(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_paths, "unavailable_reason", lambda: "vllm is not importable (ImportError: no vllm)")
    proc = run_main(*BENCH, f"hydra.run.dir={tmp_path}", module="rlsync.bench")
    one_line_refusal(proc, "rlsync: config error: bench.target=vllm_paths: vllm is not importable")


def test_the_table_and_warning_name_a_path_that_failed_its_check():
    stats = {
        f"vllm_paths/{p}/{k}": {"median": v, "min": v, "max": v}
        for p in PATHS
        for k, v in (
            ("update_weights_time", 0.02),
            ("update_weights_limit_time", 0.001),
            ("update_weights_efficiency", 0.05),
            ("update_weights_gbps", 0.3),
            ("verified", 0.0 if p == "vllm_reload" else 1.0),
            ("logprob_max_diff", 2.0 if p == "vllm_reload" else 0.01),
            ("logprob_mean_diff", 0.5 if p == "vllm_reload" else 0.003),
            ("logprob_old_mean_diff", 0.45),
        )
    }
    assert VllmPathsTarget.warning(stats).startswith("NOT VERIFIED: vllm_reload:")
    result = {
        "metrics": stats,
        "setup": {"buckets": 1, "bucket_mb": 512.0, "device": "cpu"},
        "model": {"name": "tiny", "update_bytes": 5 << 20},
        "measured_steps": 3,
        "warmup_steps": 1,
        "cpu": {"others_busy_cores_at_start": 2.0, "cores": 2},
        "vllm_paths": {"vllm": "0.32.0", "reload_mode": "direct", "load_average_start": [2.0, 1.5, 1.5]},
    }
    table = VllmPathsTarget.table(result)
    assert all(f"| {path} |" in table for path in PATHS)
    assert "NO (2 / 0.5, 0.45)" in table and "yes (0.01 / 0.003, 0.45)" in table
    assert "rollout.vllm_reload_mode=direct" in table and "2.0 of 2 cores busy" in table
    verdict = VllmPathsTarget.verdict(stats)
    assert verdict.startswith(
        "rlsync_reload 20.0 ms (20.0x its floor); vllm_reload 20.0 ms (20.0x its floor, NOT VERIFIED)"
    )


def test_the_reports_verdict_of_a_vllm_paths_job_names_each_path_not_a_missing_time(tmp_path):
    """A vllm_paths job records its paths' figures under vllm_paths/<path>/..., no perf/update_weights_time: the
    report's verdict reads them (it said "no vllm_paths time measured")."""
    from rlsync.report import load_job, table_row

    vllm_bench_job(tmp_path / "job", mode=None, recorded=True)
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    summary["target"] = "vllm_paths"
    summary["metrics"] = {
        f"vllm_paths/{p}/{k}": {"median": v, "min": v, "max": v}
        for p in PATHS
        for k, v in (("update_weights_time", 0.5), ("update_weights_efficiency", 0.25), ("verified", 1.0))
    }
    (tmp_path / "job" / "summary.json").write_text(json.dumps(summary))
    verdict = table_row(load_job(tmp_path / "job"))["verdict"]
    assert verdict.startswith("rlsync_reload 0.50 s (4.00x its floor); vllm_reload 0.50 s"), verdict
    assert "NOT VERIFIED" not in verdict and "no vllm_paths time" not in verdict


# -- rollout.vllm_reload_mode in the report's setup ----------------------------------------------


def vllm_bench_job(job: Path, *, mode: str | None, recorded: bool) -> None:
    """A bench job of the vLLM engine; `recorded`: its summary.json's setup names the reload mode (else, as a run
    recorded before it did, only its config may)."""
    write_bench_job(job, "tiny")
    summary = json.loads((job / "summary.json").read_text())
    summary["setup"]["engine"] = "vllm"
    summary["config"]["rollout"]["engine"] = "vllm"
    if recorded:
        summary["setup"]["vllm_reload_mode"] = mode
    (job / "summary.json").write_text(json.dumps(summary))


def test_the_report_shows_the_reload_mode_and_reads_runs_recorded_without_it(tmp_path):
    from rlsync.report import load_job, table_row
    from rlsync.report.cells import table_cells

    vllm_bench_job(tmp_path / "direct", mode="direct", recorded=True)
    vllm_bench_job(tmp_path / "default", mode=None, recorded=True)
    vllm_bench_job(tmp_path / "old", mode=None, recorded=False)  # before summary.json held the key
    rows = {name: table_row(load_job(tmp_path / name)) for name in ("direct", "default", "old")}
    assert rows["direct"]["vllm_reload_mode"] == "direct"
    assert rows["default"]["vllm_reload_mode"] is None and rows["old"]["vllm_reload_mode"] is None
    assert table_cells(rows["direct"])[2] == "direct (vllm, reload direct)"
    assert table_cells(rows["old"])[2] == table_cells(rows["default"])[2] == "direct (vllm)"
    assert "engine vllm, reload direct)" in rows["direct"]["verdict"]
    assert "engine vllm)" in rows["old"]["verdict"]
    proc = run_report(str(tmp_path), "--no-wandb")
    assert proc.returncode == 0, proc.stderr
    assert "direct (vllm, reload direct)" in (tmp_path / "report.md").read_text()
