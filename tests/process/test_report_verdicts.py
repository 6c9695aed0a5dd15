"""A real tiny bench sweep reported twice with W&B offline keeps one W&B report run
(tests/unit/test_report_verdicts.py: the verdicts on fake job directories)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import (
    ROOT,
    leet,
    offline_env,
    run_report,
)

from rlsync.report import write_report


def test_real_bench_sweep_reported_twice_keeps_one_wandb_report_run(tmp_path: Path, drawn: dict) -> None:
    """A real tiny bench sweep over two transports and two bucket sizes: its callback reports it (W&B
    offline), then the report is run again by hand; one report run remains, holding the best line."""
    sweep = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {"PYTHONPATH": str(ROOT)}
    env |= offline_env(tmp_path)
    cmd = [
        sys.executable, "-m", "rlsync.bench", "-m", "model=tiny", "update.transport=direct,ipc",
        "update.bucket_mb=0.25,512", "bench.warmup=1", "bench.repeats=3", "wandb.mode=offline",
        f"hydra.sweep.dir={sweep}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "best: tiny, fastest update: run " in proc.stdout  # the sweep callback's report
    (first_run,) = (sweep / "wandb").glob("offline-run-*")  # the callback's report run

    result = write_report([sweep], log_wandb=False)  # in this process, so `drawn` sees the plots
    ax = drawn["update_time_vs_bucket.png"].axes[0]
    # the HF engine's default: flat engine weights (update.flat_engine_weights=null), named in the series
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "tiny, direct flat, bucketed",
        "tiny, ipc flat, bucketed",
    ]
    assert {r["transport"] for r in result.rows} == {"direct", "ipc"}

    report = run_report(str(sweep), env=offline_env(tmp_path))
    assert report.returncode == 0, report.stderr
    (best,) = [ln for ln in report.stdout.splitlines() if ln.startswith("best: ")]
    assert " faster (" in best and "than the runner-up run " in best and "over 3 repeats" in best
    md = (sweep / "report.md").read_text()
    assert best.removeprefix("best: ") in md
    with (sweep / "report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and all(r["measured_steps"] == "3" for r in rows)
    assert all(
        float(r["update_time_min"]) <= float(r["update_time_median"]) <= float(r["update_time_max"]) for r in rows
    )

    (run_dir,) = (sweep / "wandb").glob("offline-run-*")  # one report run: the rerun replaced the callback's
    run_id = run_dir.name.split("-", 3)[-1]  # offline-run-<time>-<id>
    assert run_id.startswith("report-") and first_run.name.endswith(run_id) and run_dir != first_run
    state = json.loads(leet("--summary", "--json", str(run_dir)))
    assert state["state"] == "finished" and state["summary"]["report/best"] == [best.removeprefix("best: ")]
