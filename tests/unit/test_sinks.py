"""A run's record (metrics.jsonl, summary.json, error.log) across runs that share a run directory."""

import json

import pytest
from conftest import read_jsonl

from rlsync.errors import WriteFailed
from rlsync.record.sinks import MetricsFile, write_json


def write_run(run_dir, rows: list[dict]) -> None:
    metrics = MetricsFile(run_dir)
    for row in rows:
        metrics.write(row)
    metrics.close()


def test_a_reused_run_dir_starts_a_fresh_metrics_file_and_keeps_the_previous_aside(tmp_path):
    first = [{"step": 0, "perf/step_time": 1.0}, {"step": 1, "perf/step_time": 1.1}]
    second = [{"step": 0, "perf/step_time": 2.0}]
    write_run(tmp_path, first)
    write_run(tmp_path, second)
    assert read_jsonl(tmp_path / "metrics.jsonl") == second  # the second run's rows alone
    assert read_jsonl(tmp_path / "metrics.jsonl.prev") == first
    write_run(tmp_path, [])  # a third run: every earlier run kept, the older one never overwritten
    assert read_jsonl(tmp_path / "metrics.jsonl") == []
    assert read_jsonl(tmp_path / "metrics.jsonl.prev") == first
    assert read_jsonl(tmp_path / "metrics.jsonl.prev2") == second


def test_no_run_overwrites_an_earlier_runs_summary(tmp_path):
    """Three runs' summaries in one directory: each earlier one kept whole, with its own rows."""
    for n in range(3):
        write_run(tmp_path, [{"step": s} for s in range(n + 1)])
        write_json(tmp_path / "summary.json", {"run": n, "steps_finished": n + 1})
    write_run(tmp_path, [])
    assert not (tmp_path / "summary.json").exists()
    for n, suffix in enumerate([".prev", ".prev2", ".prev3"]):
        assert json.loads((tmp_path / f"summary.json{suffix}").read_text()) == {"run": n, "steps_finished": n + 1}
        assert len(read_jsonl(tmp_path / f"metrics.jsonl{suffix}")) == n + 1


def test_a_summary_that_cannot_be_written_names_the_file_and_leaves_no_temp_file(tmp_path):
    (tmp_path / "summary.tmp").symlink_to("/dev/full")  # every write there fails with ENOSPC, as on a full disk
    with pytest.raises(WriteFailed) as caught:
        write_json(tmp_path / "summary.json", {"status": "finished"})
    assert str(caught.value) == f"cannot write {tmp_path / 'summary.json'}: the disk is full (No space left on device)"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_metrics_row_that_cannot_be_written_names_the_file_and_the_rows_kept(tmp_path):
    metrics = MetricsFile(tmp_path)
    metrics.write({"step": 0})
    metrics._f = open("/dev/full", "w")  # noqa: SIM115 - the sink's own file from here on: the disk fills up
    with pytest.raises(WriteFailed) as caught:
        metrics.write({"step": 1})
    metrics.close()
    assert str(caught.value).startswith(f"cannot write {tmp_path / 'metrics.jsonl'}: the disk is full")
    assert str(caught.value).endswith("; the 1 step(s) finished before are kept in it")
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0}]


def test_a_rerun_sets_the_previous_summary_and_error_aside(tmp_path):
    """A rerun killed before its summary must not leave the old run's summary (or error) beside its rows."""
    write_run(tmp_path, [{"step": 0}])
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed"}))
    (tmp_path / "error.log").write_text("Error: failed: boom\n")
    write_run(tmp_path, [{"step": 0}, {"step": 1}])  # killed before writing its summary
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "error.log.prev",
        "metrics.jsonl",
        "metrics.jsonl.prev",
        "summary.json.prev",
    ]
    assert json.loads((tmp_path / "summary.json.prev").read_text()) == {"status": "failed"}


def test_a_fresh_run_dir_gets_metrics_jsonl_alone(tmp_path):
    write_run(tmp_path, [{"step": 0}])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_every_row_is_fsynced_as_it_is_written(tmp_path, monkeypatch):
    """A killed run keeps every step it finished: each write reaches the disk before it returns."""
    synced = []
    monkeypatch.setattr(
        "rlsync.record.sinks.os.fsync", lambda fd: synced.append((tmp_path / "metrics.jsonl").read_text())
    )
    metrics = MetricsFile(tmp_path)
    metrics.write({"step": 0})
    metrics.write({"step": 1})
    metrics.close()
    assert [[json.loads(line)["step"] for line in text.splitlines()] for text in synced] == [[0], [0, 1]]
