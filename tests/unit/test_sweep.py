"""A sweep a user can plan and trust: its plan before the first job (jobs, fits, an estimated duration),
a dry run that starts nothing, "job k of N" with an ETA, and the report written however the sweep ended."""

from __future__ import annotations

import pytest
from conftest import FAST, run_main

from rlsync.report import sweep_callback

SHORT = [*FAST[:1], "run.steps=2", "run.warmup_steps=1", *FAST[3:], "wandb.mode=disabled"]
HUGE = "qwen3_4b"  # refused for memory: the tests give the machine 8 GiB (small_machine)


@pytest.fixture(autouse=True)
def small_machine(monkeypatch):
    """An 8 GiB machine, whatever this one has: qwen3_4b never fits, the tiny model always does."""
    from rlsync.check import fit

    monkeypatch.setattr(fit, "host_available_bytes", lambda: 8 * 2**30)


def test_a_dry_run_prints_the_plan_and_starts_nothing(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_main(
        "-m", "run.dry_run=true", f"model=tiny,{HUGE}", "update.bucket_mb=1,4", f"hydra.sweep.dir={sweep}"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    head = "rlsync: sweep of 4 jobs: 2 fit, 2 refused (2 for the memory available now: each checks again as it starts"
    assert any(ln.startswith(head) for ln in lines), lines
    refused = [ln for ln in lines if "would be refused now: does not fit: host memory" in ln]
    assert [ln.split("(")[0].strip() for ln in refused] == ["rlsync:   job 2", "rlsync:   job 3"]
    assert f"model={HUGE}" in refused[0]
    assert "rlsync: run.dry_run=true: nothing started" in lines
    assert not sweep.exists()  # no job directory, no report


def test_a_single_dry_run_says_whether_it_fits_and_how_long(tmp_path):
    result = run_main("run.dry_run=true", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr
    assert "rlsync: dry run (run.dry_run=true): fits; estimated " in result.stderr
    assert not any((tmp_path / "run").iterdir())  # Hydra makes the run directory; nothing is written in it
    refused = run_main("run.dry_run=true", f"model={HUGE}", f"hydra.run.dir={tmp_path / 'huge'}")
    assert refused.returncode == 0 and "would be refused: does not fit: host memory" in refused.stderr


def test_the_plan_names_a_launcher_that_runs_jobs_side_by_side():
    plan = sweep_callback.SweepPlan(jobs=[sweep_callback.JobPlan(0, ["a=1"], seconds=30.0)], side_by_side="local")
    lines = plan.lines()
    assert lines[0].startswith("sweep of 1 job: 1 fit, 0 refused; estimated 30 s")
    assert lines[-1].startswith("warning: hydra/launcher=local runs jobs side by side")


def test_jobs_that_ran_at_the_same_time_are_noted_in_the_report():
    from types import SimpleNamespace

    from rlsync.report import overlap_note

    runs = [
        SimpleNamespace(job="0", summary={"started_at": 0.0, "ended_at": 10.0}),
        SimpleNamespace(job="1", summary={"started_at": 5.0, "ended_at": 12.0}),
        SimpleNamespace(job="2", summary={"started_at": 20.0, "ended_at": 30.0}),
    ]
    assert overlap_note(runs).startswith("jobs 0 and 1 ran at the same time")
    assert overlap_note(runs[1:]) is None


@pytest.mark.parametrize(("seconds", "text"), [(45, "45 s"), (12 * 60, "12 min"), (2.5 * 3600, "2.5 h")])
def test_durations_read_in_the_unit_that_fits(seconds, text):
    assert sweep_callback.fmt_duration(seconds) == text


def test_the_sweep_ends_with_the_command_that_uploads_its_offline_runs(tmp_path):
    assert sweep_callback.wandb_sync_line(tmp_path) is None
    (tmp_path / "0" / "wandb" / "offline-run-20261202_000000-abc").mkdir(parents=True)
    assert sweep_callback.wandb_sync_line(tmp_path) == (
        f"W&B: `wandb sync {tmp_path}/*/wandb/offline-run-*` uploads this sweep's offline runs"
    )


def test_the_upload_command_takes_the_reports_own_run_too(tmp_path):
    """The report logs its own run under the sweep's wandb/ (rlsync.report.wandb_report): one command uploads
    it with the jobs' runs, and a path with a space stays one argument while its globs still expand."""
    import glob
    import shlex

    sweep = tmp_path / "my sweep"
    for run in ("0/wandb/offline-run-20261202_000000-abc", "1/wandb/offline-run-20261202_000100-def"):
        (sweep / run).mkdir(parents=True)
    (sweep / "wandb" / "offline-run-20261202_000200-report-x").mkdir(parents=True)
    line = sweep_callback.wandb_sync_line(sweep)
    command = line.split("`")[1]
    assert command.startswith("wandb sync ") and "its report's included" in line
    uploaded = {hit for arg in shlex.split(command)[2:] for hit in glob.glob(arg)}  # as the shell expands them
    assert uploaded == {str(p) for p in sweep.glob("**/offline-run-*")} and len(uploaded) == 3


def test_a_job_the_plan_found_short_of_memory_says_what_its_start_finds(compose, monkeypatch):
    """The plan checks memory at one moment; on a shared machine it frees up before a job starts. The plan
    says its refusal is the memory of that moment, and the job's start line says what the same check finds then."""
    from rlsync.check import duration, fit

    monkeypatch.setattr(duration, "_MACHINES", {})
    monkeypatch.setattr(fit, "host_available_bytes", lambda: 2**20)  # 1 MiB free: nothing fits
    cfg = compose(*SHORT)
    refused, _ = duration.preview(cfg)
    assert refused and refused.startswith("does not fit: host memory")
    job = sweep_callback.JobPlan(0, ["model=tiny"], refused=refused, short_of_memory=True, cfg=cfg)
    plan = sweep_callback.SweepPlan(jobs=[job])
    (head, line) = plan.lines()
    assert head.startswith("sweep of 1 job: 0 fit, 1 refused (1 for the memory available now: each checks again")
    assert line.startswith("  job 0 (model=tiny) would be refused now: does not fit: host memory")
    report = sweep_callback.SweepReport()
    report.plan = plan
    assert report.memory_now(0) == "; short of memory at the plan, and still now: its own check refuses it"
    monkeypatch.setattr(fit, "host_available_bytes", lambda: 8 * 2**30)  # freed: the job's own check passes
    assert report.memory_now(0) == "; short of memory at the plan, it fits the memory available now: it runs"
    assert duration.preview(cfg)[0] is None  # the fresh measurement is the one later checks see


def test_the_benchmark_dry_run_checks_its_own_estimate(tmp_path):
    result = run_main("run.dry_run=true", f"hydra.run.dir={tmp_path / 'bench'}", module="rlsync.bench")
    assert result.returncode == 0, result.stderr
    assert "rlsync: dry run (run.dry_run=true): fits; estimated " in result.stderr
    assert not (tmp_path / "bench" / "summary.json").exists()


def test_a_presets_own_sweep_is_planned_as_it_will_run(tmp_path):
    """experiment=delta sweeps from its own hydra.sweeper.params (12 jobs); a key the command line sets
    as well takes the command line's values, as Hydra's basic sweeper runs it."""
    sweep = tmp_path / "sweep"
    bench = {"module": "rlsync.bench"}
    preset = run_main("-m", "run.dry_run=true", "experiment=delta", "model=tiny", f"hydra.sweep.dir={sweep}", **bench)
    assert preset.returncode == 0, preset.stderr
    assert any(ln.startswith("rlsync: sweep of 12 jobs: 12 fit") for ln in preset.stderr.splitlines()), preset.stderr
    narrowed = run_main(
        "-m",
        "run.dry_run=true",
        "experiment=delta",
        "model=tiny",
        "bench.changed_ratio=0.01",
        f"hydra.sweep.dir={sweep}",
        **bench,
    )
    assert any(ln.startswith("rlsync: sweep of 3 jobs: 3 fit") for ln in narrowed.stderr.splitlines()), narrowed.stderr
