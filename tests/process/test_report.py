"""The report where its process is what is tested: its W&B run logged offline, a real 2 x 2 sweep reported,
a file size limit (tests/unit/test_report.py: the report in this process)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import (
    PLOTS,
    PNG_SIGNATURE,
    ROOT,
    leet,
    offline_env,
    run_report,
)


def test_report_run_logged_offline(sweep: Path, tmp_path: Path) -> None:
    proc = run_report(str(sweep), env=offline_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "W&B: report run logged offline" in proc.stdout
    (run_dir,) = sorted((sweep / "wandb").glob("offline-run-*"))

    state = json.loads(leet("--summary", "--json", str(run_dir)))
    assert state["state"] == "finished" and state["project"] == "rlsync-test"
    assert state["summary"]["report/runs"] == 4 and state["summary"]["report/failed"] == 1
    assert state["summary"]["report/table"]["_type"] == "table-file"
    assert state["summary"]["report/table"]["nrows"] == 4
    for name in PLOTS:
        assert state["summary"][f"report/{Path(name).stem}"]["_type"] == "image-file"

    # --summary leaves out group and job_type: they are in the "run" record of the log
    records = [json.loads(line) for line in leet("--json", str(run_dir)).splitlines() if line.strip()]
    (run_record,) = [r["run"] for r in records if r.get("type") == "run"]
    assert run_record["job_type"] == "report"
    assert run_record["run_group"] == sweep.name


def test_real_two_by_two_sweep(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {"PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable, "-m", "rlsync", "-m", "run.steps=3", "run.progress=false", "wandb.mode=disabled",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_response_len=8",  # seconds a job
        "run.limit_probe=start",  # the copy floors probed once a job, not before each step (as FAST)
        "model.num_hidden_layers=1,2", "update.bucket_mb=0.25,2", f"hydra.sweep.dir={sweep}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]

    report = run_report(str(sweep))
    assert report.returncode == 0, report.stderr
    assert "W&B: not logged" in report.stdout  # the runs said wandb.mode=disabled
    with (sweep / "report.csv").open() as f:
        rows = {row["job"]: row for row in csv.DictReader(f)}
    assert sorted(rows) == ["0", "1", "2", "3"]
    for job, row in rows.items():
        metrics = json.loads((sweep / job / "summary.json").read_text())["metrics"]
        assert float(row["update_time_median"]) == metrics["perf/update_weights_time"]["median"]
        assert float(row["step_time_median"]) == metrics["perf/step_time"]["median"]
    for name in (*PLOTS, "update_phases.png"):
        if name not in ("update_time_vs_bytes.png", "peak_memory_vs_bucket.png"):
            assert (sweep / name).read_bytes()[:8] == PNG_SIGNATURE, name
    # one measured step per run and two update sizes: a line through them would be noise, and the report says so
    md = (sweep / "report.md").read_text()
    # flat engine weights (the HF engine's default) stage nothing: a memory plot at 0 is not drawn
    assert "peak_memory_vs_bucket.png skipped: every run's update held 0 bytes" in md
    # a run that a busy machine made a broken measurement is left out of the fit and the ranking, by name
    left_out = re.search(r"Left out of the fit: runs ([\d, ]+) \(a broken measurement\)", md)
    broken = set(left_out.group(1).split(", ")) if left_out else set()
    kept = [job for job in "0123" if job not in broken]
    sizes = [{"0", "1"} - broken, {"2", "3"} - broken]  # 1 layer, 2 layers
    if all(sizes):
        assert f"No fit: two update sizes only, and runs {', '.join(kept)} measured fewer than 3 steps" in md
    else:
        assert "No fit: " in md
    assert "update_time_vs_bytes.png skipped" in md and not (sweep / "update_time_vs_bytes.png").exists()
    if any(len(jobs) == 2 for jobs in sizes):  # the best-setting warning, where two runs of one size are ranked
        assert "too few to tell a real difference from noise (raise run.steps)" in md


def test_a_file_size_limit_ends_with_one_line(sweep: Path, tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the kernel refuse any write past 2 KiB (EFBIG; Python ignores SIGXFSZ)."""
    import resource

    out = tmp_path / "out"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))  # noqa: E731
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    full_env.update({"PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"})
    proc = subprocess.run(
        [sys.executable, "-m", "rlsync.report", str(sweep), "--no-wandb", "--out", str(out)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        timeout=180,
        preexec_fn=limit,
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rlsync.report: cannot write {out}"), lines
    assert "the file is too large" in lines[0]
