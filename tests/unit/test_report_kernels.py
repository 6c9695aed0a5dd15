"""The report and the kernels that timed a payload (summary.json's setup `payload_kernels`): two runs of one payload
whose encode and decode ran on different kernels (one machine built delta.c, another had no C compiler and ran numpy's
steps) differ by their kernels, not their setting: the ranking names both and does not call the difference.

The runs are the fake bench jobs of conftest's write_bench_job, as in test_report_verdicts.py."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from conftest import section, write_bench_job

from rlsync.report import write_report
from rlsync.report.ranking import best_settings

BUILT = "delta.c"
NO_CC = "numpy's steps (delta.c: no C compiler: neither cc nor gcc on PATH)"


def bucket_sweep(root: Path, buckets: tuple[float, ...] = (1.0, 16.0), per_bucket_s: float = 1e-3) -> Path:
    """One model and transport over bucket sizes, each bucket costing `per_bucket_s`: the biggest wins, really."""
    for num, bucket in enumerate(buckets):
        write_bench_job(root / str(num), "tiny", bucket_mb=bucket, per_bucket_s=per_bucket_s)
    return root


def set_setup(job: Path, **setup: object) -> None:
    """summary.json's setup keys set (None: removed), as a run on another machine or from before them recorded it."""
    data = json.loads((job / "summary.json").read_text())
    data["setup"].update(setup)
    data["setup"] = {k: v for k, v in data["setup"].items() if v is not None}
    (job / "summary.json").write_text(json.dumps(data))


def best_update_line(sweep: Path) -> str:
    (line,) = [b.describe() for b in best_settings(write_report([sweep], log_wandb=False).rows) if b.stem == "update"]
    return line


def test_payload_kernels_that_differ_are_no_real_difference(tmp_path: Path) -> None:
    """Job 0 built delta.c, job 1 had no C compiler and ran numpy's steps: their ranges stand apart and the report
    called the bucket size's difference real, when the kernels differ. Not called, both kernels named; the same
    kernels whose reasons read apart (a compiler's message per machine) are called again."""
    sweep = bucket_sweep(tmp_path / "sweep")
    assert "the difference is real" in best_update_line(sweep)  # the sweep's difference stands on its own
    set_setup(sweep / "0", payload="delta", payload_kernels=BUILT)
    set_setup(sweep / "1", payload="delta", payload_kernels=NO_CC)
    line = best_update_line(sweep)
    assert line.startswith("tiny, fastest update: run 1 (direct, delta, bucket 16 MiB) "), line
    assert (
        "Warning: runs 1 and 0 ran their delta payload's encode and decode on numpy's steps and delta.c: the "
        "difference may be the kernels, not the setting, so it is not called (compare runs whose payload ran on the "
        "same kernels: each summary.json's setup.payload_kernels says why a faster one did not run)."
    ) in line
    assert "the difference is real" not in line

    # the same kernels, the reason worded apart: the part before " (" is what ran, so it is called
    set_setup(sweep / "0", payload_kernels="numpy's steps (delta.c: cc failed on delta.c (exit 1): error: bad flag)")
    assert "the difference is real" in best_update_line(sweep)


def test_unrecorded_kernels_are_unknown_never_different(tmp_path: Path) -> None:
    """A run recorded before setup.payload_kernels beside one that recorded them: unknown is not different, called.
    Kernels that come with the setting compared (another payload, another kind of device) are that setting's."""
    sweep = bucket_sweep(tmp_path / "sweep")
    set_setup(sweep / "0", payload="delta", payload_kernels=BUILT)
    set_setup(sweep / "1", payload="delta", payload_kernels=None)
    assert "the difference is real" in best_update_line(sweep)

    set_setup(sweep / "1", payload="fp8", payload_kernels="fp8.c")  # payload= swept: its kernels come with it
    assert "the difference is real" in best_update_line(sweep)

    set_setup(sweep / "1", payload="delta", payload_kernels="torch's ops", device="cuda:0")  # a GPU's own kernels
    assert "the difference is real" in best_update_line(sweep)
    set_setup(sweep / "0", device="cuda")  # cuda and cuda:0: one kind of device, the kernels differ
    assert "ran their delta payload's encode and decode on torch's ops and delta.c" in best_update_line(sweep)


def test_the_csv_and_the_payload_table_show_the_kernels(tmp_path: Path) -> None:
    """report.csv carries each run's setup.payload_kernels as recorded (empty where it recorded none); the
    payload-floor table of report.md names the kernels that ran, their why left to the csv."""
    sweep = bucket_sweep(tmp_path / "sweep")
    for job, kernels in (("0", BUILT), ("1", NO_CC)):
        set_setup(sweep / job, payload="delta", payload_kernels=kernels)
        rows = [json.loads(ln) for ln in (sweep / job / "metrics.jsonl").read_text().splitlines()]
        for row in rows:  # timed against its own floors, as a delta payload logs
            row["perf/update_weights_encode_time"] = row["perf/update_weights_time"] / 2
            row["perf/update_weights_encode_limit_time"] = row["perf/update_weights_limit_time"] / 4
        (sweep / job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    set_setup(sweep / "0", payload_kernels=None)
    write_report([sweep], log_wandb=False)
    with (sweep / "report.csv").open() as f:
        assert {r["job"]: r["payload_kernels"] for r in csv.DictReader(f)} == {"0": "", "1": NO_CC}
    table = section((sweep / "report.md").read_text(), "Runs")
    header = next(ln for ln in table.splitlines() if ln.startswith("| run | payload |"))
    assert "| kernels |" in header
    floors = {ln[2]: ln for ln in table.splitlines() if ln.startswith(("| 0: ", "| 1: "))}  # the last of each run's
    assert "| direct, delta | - |" in floors["0"] and "| direct, delta | numpy's steps |" in floors["1"]
