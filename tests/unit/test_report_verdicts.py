"""The report answers the sweep's question: which setting won, by how much, and whether it is real.

Most runs here are the fake job directories of test_report.py (bench jobs with chosen times and
noise); one test runs a real tiny bench sweep, reports it twice with W&B offline, and checks the
best-setting line, the spreads, one plot series per transport and a single W&B report run.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import (
    PNG_SIGNATURE,
    measured_stats,
    run_report,
    section,
    write_bench_job,
    write_job,
)

from rlsync.fmt import fmt_seconds, fmt_share, fmt_spread, time_unit
from rlsync.record.summary import BROKEN_EFFICIENCY
from rlsync.report import write_report
from rlsync.report.cells import fmt_efficiency
from rlsync.report.ranking import FLOOR_DRIFT, best_settings, fmt_lead

BUCKETS = (1.0, 4.0)  # MiB
PER_BUCKET_S = 1e-4  # what each bucket adds to a fake update: bigger buckets win


def transport_sweep(root: Path, noise: float = 0.01, repeats: int = 4) -> Path:
    """Two transports x two bucket sizes of one model, as bench jobs 0-3 (direct 1, direct 4, ipc 1, ipc 4)."""
    jobs = [(t, b) for t in ("direct", "ipc") for b in BUCKETS]
    for num, (transport, bucket) in enumerate(jobs):
        write_bench_job(
            root / str(num),
            "tiny",
            transport,
            bucket_mb=bucket,
            noise=noise,
            repeats=repeats,
            per_bucket_s=PER_BUCKET_S,
        )
    return root


def test_best_setting_says_who_won_by_how_much_and_that_it_is_real(tmp_path: Path, drawn: dict) -> None:
    sweep = transport_sweep(tmp_path / "sweep")
    result = write_report([sweep], log_wandb=False)
    rows = {row["job"]: row for row in result.rows}
    best, second = rows["1"], rows["0"]  # direct with 4 MiB buckets, then direct with 1 MiB
    lead = fmt_lead(best["update_time_median"], second["update_time_median"])
    md = (sweep / "report.md").read_text()

    (line,) = [ln for ln in section(md, "Best setting").splitlines() if ln.startswith("- ")]
    assert line.startswith("- tiny, fastest update: run 1 (direct, bucket 4 MiB) "), line
    assert lead.endswith(" %")  # 9 % faster: a ratio would read "1.09x"
    assert f"{lead} faster ({fmt_seconds(second['update_time_median'] - best['update_time_median'])} less)" in line
    assert "runner-up run 0 (direct, bucket 1 MiB)" in line and "over 4 repeats" in line
    assert "the difference is real" in line and "Warning" not in line
    assert "fastest step" not in md  # a bench has no step

    # the spread of every run: n, median (min to max) in report.md, min/median/max in the CSV
    table = section(md, "Runs")
    for job, row in rows.items():
        spread = fmt_spread(row["update_time_median"], row["update_time_min"], row["update_time_max"])
        assert row["update_time_min"] < row["update_time_median"] < row["update_time_max"]
        assert f"| 4 | {spread} |" in next(ln for ln in table.splitlines() if ln.startswith(f"| {job}: ")), job
    with (sweep / "report.csv").open() as f:
        for row in csv.DictReader(f):
            assert float(row["update_time_min"]) == rows[row["job"]]["update_time_min"]
            assert float(row["update_time_max"]) == rows[row["job"]]["update_time_max"]
            assert row["measured_steps"] == "4"

    # one series per transport on the bucket axis, each through its own two bucket sizes
    ax = drawn["update_time_vs_bucket.png"].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["tiny, direct, bucketed", "tiny, ipc, bucketed"]
    lines = [container.lines[0] for container in ax.containers]  # each errorbar's data line
    assert [list(ln.get_xdata()) for ln in lines] == [list(BUCKETS)] * 2
    assert lines[0].get_ydata()[1] * 1e-3 == pytest.approx(best["update_time_median"])  # ms on the axis


def test_overlapping_ranges_warn_that_the_difference_may_be_noise(tmp_path: Path) -> None:
    sweep = transport_sweep(tmp_path / "sweep", noise=0.5)  # each repeat 50 % slower than the one before
    result = write_report([sweep], log_wandb=False)
    (line,) = [best.describe() for best in best_settings(result.rows)]
    assert "Warning: the min-max ranges of runs 1 and 0 overlap: the difference may be noise" in line
    assert "the difference is real" not in line
    assert f"- {line}" in (sweep / "report.md").read_text()


def test_too_few_repeats_warn_naming_the_runs(tmp_path: Path) -> None:
    sweep = transport_sweep(tmp_path / "sweep", repeats=2)
    proc = run_report(str(sweep), "--no-wandb")
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("best: ")]  # the console says it too
    assert (
        "Warning: run 1 measured 2 repeats and run 0 measured 2 repeats, fewer than 3: too few to tell a real "
        "difference from noise"
    ) in line
    assert line.removeprefix("best: ") in (sweep / "report.md").read_text()
    assert "| 2 |" in proc.stdout  # the table's n column


def test_fit_needs_three_sizes_or_two_clearly_apart(tmp_path: Path) -> None:
    sizes = (5_000_000, 10_000_000, 20_000_000)
    for count, repeats in ((2, 2), (3, 2)):
        sweep = tmp_path / f"sweep{count}"
        for num, size in enumerate(sizes[:count]):
            write_bench_job(sweep / str(num), "tiny", update_bytes=size, repeats=repeats)
        result = write_report([sweep], log_wandb=False)
        fit_section = section((sweep / "report.md").read_text(), "Update time against bytes")
        if count == 2:  # two sizes, 2 repeats each: no line, and why
            assert result.fit is None and not (sweep / "update_time_vs_bytes.png").exists()
            assert "No fit: two update sizes only, and runs 0, 1 measured fewer than 3 steps or repeats" in fit_section
        else:  # three sizes: the line, with its bandwidth
            assert result.fit is not None and result.fit.distinct_sizes == 3
            assert result.fit.bandwidth_gbps == pytest.approx(5, rel=0.05)  # bench_rows' direct: 5e9 bytes/s
            assert (sweep / "update_time_vs_bytes.png").read_bytes()[:8] == PNG_SIGNATURE


def test_per_tensor_has_no_bucket_size_and_its_own_series(tmp_path: Path, drawn: dict) -> None:
    sweep = transport_sweep(tmp_path / "sweep")
    write_bench_job(sweep / "4", "tiny", "direct", bucket_mb=512.0, strategy="per_tensor", per_bucket_s=PER_BUCKET_S)
    result = write_report([sweep], log_wandb=False)
    row = next(r for r in result.rows if r["job"] == "4")
    assert row["bucket_mb"] is None and row["strategy"] == "per_tensor"
    assert "| tiny | direct | per_tensor | 4 |" in (sweep / "report.md").read_text()
    with (sweep / "report.csv").open() as f:
        assert next(r for r in csv.DictReader(f) if r["job"] == "4")["bucket_mb"] == ""
    for name in ("update_time_vs_bucket.png", "peak_memory_vs_bucket.png"):
        ax = drawn[name].axes[0]
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert sorted(labels) == ["tiny, direct, bucketed", "tiny, direct, per_tensor", "tiny, ipc, bucketed"], name


def test_numbers_never_round_to_zero() -> None:
    assert fmt_share(0.0004) == "0.04 %" and fmt_share(0.00004) == "0.004 %" and fmt_share(0.123) == "12.3 %"
    assert fmt_share(0) == "0 %"
    assert fmt_efficiency(0.003) == "0.0030 (333.3x floor)"
    assert fmt_efficiency(0.82) == "0.82 (1.22x floor)"
    assert fmt_lead(0.87, 0.8724) == "0.28 %" and fmt_lead(1, 1.05) == "5.00 %" and fmt_lead(1, 1.52) == "1.52x"


def test_verdict_and_table_share_agree(tmp_path: Path) -> None:
    """A run without the runner's verdict: the report's own verdict and the table print one share."""
    job = tmp_path / "runs" / "A"
    write_job(job, "tiny", 4.0)
    summary = json.loads((job / "summary.json").read_text())
    summary.pop("verdict")
    summary["share"]["update_weights"] = 0.0004
    (job / "summary.json").write_text(json.dumps(summary))
    proc = run_report(str(job), "--no-wandb")
    assert proc.returncode == 0, proc.stderr
    md = (job / "report.md").read_text()
    assert "| 0.04 % |" in proc.stdout and "| 0.04 % |" in md
    assert "update is 0.04 % of the step" in md


def test_step_runs_rank_the_step_too_and_equal_medians_tie(tmp_path: Path) -> None:
    """Runs of the step loop: a fastest-step line beside the fastest-update one; the fake buckets cost nothing, so they tie."""
    sweep = tmp_path / "sweep"
    for num, bucket in enumerate(BUCKETS):
        write_job(sweep / str(num), "tiny", bucket)
    lines = [best.describe() for best in best_settings(write_report([sweep], log_wandb=False).rows)]
    assert [line.split(":")[0] for line in lines] == ["tiny, fastest update", "tiny, fastest step"]
    assert all("a tie between run 0 (direct, bucket 1 MiB)" in line and "over 4 steps" in line for line in lines)
    assert all("(raise run.steps)" in line for line in lines)  # equal ranges overlap


# ----------------------------------------------------------------------------------------------
# Verdicts that survive the machine (issue 42): broken measurements, moved floors, runs at once
# ----------------------------------------------------------------------------------------------


def reshape_job(job: Path, *, time: float = 1.0, floor: float = 1.0, swing: float = 1.0, **summary: object) -> None:
    """Rewrite a fake bench job as if its update took `time` times as long and its copy floor, probed beside
    it, `floor` times as long, every other repeat's `swing` times more (the efficiency follows, as the bench
    logs it); `summary` keys set on top."""
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row["perf/update_weights_time"] *= time
        row["perf/update_weights_limit_time"] *= floor * (swing if row["step"] % 2 else 1.0)
        row["perf/update_weights_efficiency"] = row["perf/update_weights_limit_time"] / row["perf/update_weights_time"]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = json.loads((job / "summary.json").read_text())
    data["metrics"] = measured_stats([r for r in rows if r["step"] >= data["warmup_steps"]])
    data.update(summary)
    (job / "summary.json").write_text(json.dumps(data))


def bucket_sweep(root: Path, buckets: tuple[float, ...] = (1.0, 4.0, 16.0), per_bucket_s: float = 1e-3) -> Path:
    """One model and transport over bucket sizes, each bucket costing `per_bucket_s`: the biggest wins."""
    for num, bucket in enumerate(buckets):
        write_bench_job(root / str(num), "tiny", bucket_mb=bucket, per_bucket_s=per_bucket_s)
    return root


def best_update_line(sweep: Path) -> str:
    (line,) = [b.describe() for b in best_settings(write_report([sweep], log_wandb=False).rows) if b.stem == "update"]
    return line


BUSY = {"threads": 1, "why": "2 cores, 1.0 kept busy", "cores": 2, "others_busy_cores_at_start": 1.0}
QUIET = {
    **BUSY,
    "why": "2 cores, 0.0 kept busy",
    "others_busy_cores_at_start": 0.0,
    "others_busy_cores_during_run": 0.0,
}


def test_an_update_far_below_its_floor_is_a_broken_measurement_not_a_ranking_entry(tmp_path: Path) -> None:
    """The 512 MiB job of issue 42 took 0.78 s at 0.00031 of its copy floor (two copy threads on a busy
    two-core machine): the report called the other job "97.4x faster ... real". A run recorded before its
    summary judged this itself is judged here by the run's own rule (under BROKEN_EFFICIENCY of its floor
    on a busy machine): left out of the ranking, and named."""
    sweep = bucket_sweep(tmp_path / "sweep", (1.0, 4.0))
    for job in ("0", "1"):
        reshape_job(sweep / job, cpu=BUSY)
    reshape_job(sweep / "0", time=2000.0)
    result = write_report([sweep], log_wandb=False)
    rows = {r["job"]: r for r in result.rows}
    assert rows["0"]["update_efficiency_median"] < BROKEN_EFFICIENCY and rows["1"]["broken"] is None
    line = best_update_line(sweep)
    assert line.startswith("tiny, fastest update: run 1 (direct, bucket 4 MiB) ") and "the only run" in line
    assert "faster" not in line and "the difference is real" not in line
    assert "Not ranked, a broken measurement: run 0 (direct, bucket 1 MiB): the update ran at " in line
    assert (
        f"of its copy floor (under {BROKEN_EFFICIENCY:g}) while other processes kept 1.0 of " in line
    )  # the run's rule
    md = (sweep / "report.md").read_text()
    assert f"- {line}" in md
    assert ", broken |" in next(ln for ln in section(md, "Runs").splitlines() if ln.startswith("| 0: "))
    assert "**0: update.bucket_mb=1**: broken measurement: the update ran at " in section(md, "Verdicts")
    assert "Left out of the fit: runs 0 (a broken measurement)." in section(md, "Update time against bytes")

    # every run broken: nothing is ranked, each is named
    reshape_job(sweep / "1", time=2000.0)
    line = best_update_line(sweep)
    assert line.startswith("tiny, fastest update: no run to rank. Not ranked, a broken measurement: run 0 ")

    # the same efficiency on a quiet machine is a finding (a per-tensor update's hand-offs), ranked
    for job in ("0", "1"):
        reshape_job(sweep / job, cpu=QUIET)
    assert not any(r["broken"] for r in write_report([sweep], log_wandb=False).rows)


def test_a_run_that_recorded_no_load_is_judged_on_its_own_figures(tmp_path: Path) -> None:
    """A summary from before rlsync recorded the machine's load: far below its floor is a finding while its
    own floor held still (a per-tensor update's hand-offs), a broken measurement when its floor swung."""
    sweep = bucket_sweep(tmp_path / "sweep", (1.0, 4.0))
    reshape_job(sweep / "0", time=2000.0)
    assert not any(r["broken"] for r in write_report([sweep], log_wandb=False).rows)
    reshape_job(sweep / "0", swing=3.0)  # the floor moved 3x between repeats: the machine changed under it
    rows = {r["job"]: r for r in write_report([sweep], log_wandb=False).rows}
    assert "the copy floor moved from " in rows["0"]["broken"] and rows["1"]["broken"] is None


def test_the_runs_own_flag_decides_where_it_wrote_one(tmp_path: Path) -> None:
    """summary.json's `verdict_trusted` (the runner's own judgement) wins over the report's: false leaves
    the run out, in its own words; true keeps it in, even far below its floor on a busy machine."""
    sweep = bucket_sweep(tmp_path / "sweep")
    reason = "the update ran at 0.0010 of its copy floor (under 0.05) while the machine was busy"
    reshape_job(sweep / "2", cpu=BUSY, verdict_trusted=False, verdict_untrusted_reason=reason)  # the fastest
    reshape_job(sweep / "0", time=2000.0, cpu=BUSY, verdict_trusted=True)
    rows = {r["job"]: r for r in write_report([sweep], log_wandb=False).rows}
    assert rows["2"]["broken"] == reason and not rows["0"]["broken"] and not rows["1"]["broken"]
    line = best_update_line(sweep)
    assert line.startswith("tiny, fastest update: run 1 (direct, bucket 4 MiB) ")
    assert f"Not ranked, a broken measurement: run 2 (direct, bucket 16 MiB): {reason}." in line
    assert "broken measurement:" not in rows["2"]["verdict"]  # the run's own verdict already says what it judged


def test_a_copy_floor_that_moved_between_jobs_is_no_real_difference(tmp_path: Path) -> None:
    """The bench sweep of issue 42: "1024 MiB ... 2.17x faster than 256 MiB ... real" while the copy floor
    probed beside each job moved 0.44 / 0.73 / 0.21 s. The ranges stand apart, yet it is not called."""
    sweep = bucket_sweep(tmp_path / "sweep")
    for job, moved in (("0", 0.44), ("1", 0.73), ("2", 0.21)):
        reshape_job(sweep / job, floor=moved / 0.44)
    rows = {r["job"]: r for r in write_report([sweep], log_wandb=False).rows}
    assert rows["2"]["update_time_max"] < rows["1"]["update_time_min"]  # apart: the old report called it real
    line = best_update_line(sweep)
    assert line.startswith("tiny, fastest update: run 2 (direct, bucket 16 MiB) ")
    floors = [rows[j]["update_limit_time_median"] for j in "012"]
    scale, unit, decimals = time_unit(max(floors))
    shown = " / ".join(f"{f * scale:.{decimals}f}" for f in floors)
    assert (
        f"Warning: the copy floor moved {shown} {unit} between runs 0 / 1 / 2: the machine changed under them, "
        "so the difference is not called; rerun on a quiet machine."
    ) in line
    assert "the difference is real" not in line

    # floors within their spread: the same sweep is called real again
    for job, moved in (("0", 0.44), ("1", 0.73), ("2", 0.21)):
        reshape_job(sweep / job, floor=0.44 / moved)
    assert "the difference is real" in best_update_line(sweep)


def test_time_and_time_over_the_floor_must_rank_alike(tmp_path: Path) -> None:
    """Floors that agree within FLOOR_DRIFT, yet the faster run is slower over its own floor: the machine
    was quicker under it, not its setting. Not called."""
    sweep = bucket_sweep(tmp_path / "sweep", (1.0, 16.0), per_bucket_s=PER_BUCKET_S)  # 13 % apart
    rows = {r["job"]: r for r in write_report([sweep], log_wandb=False).rows}
    assert rows["1"]["update_time_max"] < rows["0"]["update_time_min"]  # apart: the old report called it real
    lead = rows["0"]["update_time_median"] / rows["1"]["update_time_median"]  # run 1 faster by this much
    drift = lead * 1.05  # run 0's floor this much slower: over its floor, run 0 leads
    assert drift < FLOOR_DRIFT
    reshape_job(sweep / "0", floor=drift)
    line = best_update_line(sweep)
    assert line.startswith("tiny, fastest update: run 1 (direct, bucket 16 MiB) ")
    assert "Warning: over its copy floor run 1 is not the faster (" in line
    assert "time and time / floor rank runs 1 and 0 differently, so the difference is not called" in line


def test_runs_that_ran_at_the_same_time_are_never_called_real(tmp_path: Path) -> None:
    """A hydra/launcher=local sweep: its jobs overlap in time, each timing the other's load. However far
    apart their ranges, the difference is not called; their overlap is named in the same line."""
    sweep = bucket_sweep(tmp_path / "sweep", (1.0, 16.0))
    reshape_job(sweep / "0", started_at=1000.0, ended_at=1060.0)
    reshape_job(sweep / "1", started_at=1030.0, ended_at=1090.0)
    line = best_update_line(sweep)
    assert (
        "Warning: runs 1 and 0 ran at the same time: each timed the other's load, so their difference is not called"
        in line
    )
    assert "the difference is real" not in line
    reshape_job(sweep / "1", started_at=1070.0, ended_at=1130.0)  # one after the other
    assert "the difference is real" in best_update_line(sweep)


def test_copy_threads_that_auto_chose_apart_are_no_real_difference(tmp_path: Path) -> None:
    """The payload study's sweep: update.copy_threads=auto took 1 thread in one job and 2 in the next (its probe
    within noise), which moved the ratio between them by up to 1.4x. Ranges apart, it is not called; where a run
    set the threads (a sweep of update.copy_threads), the threads are the setting and it is."""
    sweep = bucket_sweep(tmp_path / "sweep", (1.0, 16.0))
    for job, threads, why in (("0", 1, "auto: within the probe's spread: 1 thread"), ("1", 2, "auto: fastest on 2")):
        data = json.loads((sweep / job / "summary.json").read_text())
        data["setup"].update(copy_threads=threads, copy_threads_used=threads, copy_threads_why=why)
        (sweep / job / "summary.json").write_text(json.dumps(data))
    line = best_update_line(sweep)
    assert "Warning: runs 1 and 0 copied on 2 and 1 threads, as update.copy_threads=auto chose for each" in line
    assert "the difference is real" not in line
    for job in "01":
        data = json.loads((sweep / job / "summary.json").read_text())
        data["setup"]["copy_threads_why"] = "set explicitly"
        (sweep / job / "summary.json").write_text(json.dumps(data))
    assert "the difference is real" in best_update_line(sweep)


def test_runs_whose_setups_read_alike_are_labelled_by_what_differs(tmp_path: Path) -> None:
    """The ddp and fsdp2 runs of a sweep both read "direct, bucket 512 MiB": each is labelled with its own
    overrides; runs given by path with the same overrides, by the setup keys summary.json resolved."""
    sweep = tmp_path / "sweep"
    for num, parallel in enumerate(("ddp", "fsdp2")):
        job = sweep / str(num)
        write_bench_job(job, "tiny", per_bucket_s=PER_BUCKET_S * num * 10)
        data = json.loads((job / "summary.json").read_text())
        data["overrides"] = [*data["overrides"], f"trainer.parallel={parallel}"]
        data["setup"]["parallel"] = parallel
        (job / "summary.json").write_text(json.dumps(data))
    line = best_update_line(sweep)
    assert "run 0 (direct, bucket 512 MiB, trainer.parallel=ddp) " in line
    assert "runner-up run 1 (direct, bucket 512 MiB, trainer.parallel=fsdp2) " in line

    for num in (0, 1):  # the same overrides: what summary.json resolved tells them apart
        data = json.loads((sweep / str(num) / "summary.json").read_text())
        data["overrides"] = data["overrides"][:-1]
        (sweep / str(num) / "summary.json").write_text(json.dumps(data))
    line = best_update_line(sweep)
    assert (
        "run 0 (direct, bucket 512 MiB, parallel ddp) " in line
        and "run 1 (direct, bucket 512 MiB, parallel fsdp2) " in line
    )


def test_the_table_shows_the_copy_threads_and_the_machine_line_what_its_threads_mean(tmp_path: Path) -> None:
    """Issue 42: whichever job drew 2 copy threads lost, and neither the console table nor report.md showed
    the count; report.md said "1 CPU threads" on a 2-CPU machine (torch's threads, read as the machine's)."""
    sweep = bucket_sweep(tmp_path / "sweep", (1.0, 4.0))
    why = "2 cores, 1.0 kept busy by other processes at start"
    for job, threads in (("0", 2), ("1", 1)):
        data = json.loads((sweep / job / "summary.json").read_text())
        reshape_job(
            sweep / job,
            setup={**data["setup"], "copy_threads": threads},
            cpu={"threads": 1, "why": why, "cores": 2},
            machine={"platform": "Linux", "torch": "2.13.0+cpu", "cpus": 1, "device": "cpu"},
        )
    proc = run_report(str(sweep), "--no-wandb")
    assert proc.returncode == 0, proc.stderr
    md = (sweep / "report.md").read_text()
    for text in (proc.stdout, md):  # the console's table and report.md's
        header = next(ln for ln in text.splitlines() if ln.startswith("| run |"))
        assert "| copy threads |" in header
        assert "| 2 of 2 cores |" in next(ln for ln in text.splitlines() if ln.startswith("| 0: "))
        assert "| 1 of 2 cores |" in next(ln for ln in text.splitlines() if ln.startswith("| 1: "))
    assert f"Machine: Linux, torch on 1 of 2 CPU cores ({why}), torch 2.13.0+cpu, device cpu." in md
    assert " CPU threads," not in md  # the old line: torch's thread count read as the machine's
    with (sweep / "report.csv").open() as f:
        assert {r["job"]: r["copy_threads"] for r in csv.DictReader(f)} == {"0": "2", "1": "1"}
