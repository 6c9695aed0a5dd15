"""A run's record (metrics.jsonl, summary.json, error.log) across runs that share a run directory."""

import json

from conftest import read_jsonl
from rlsync.sinks import MetricsFile


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
    write_run(tmp_path, [])  # a third run: one generation kept, the second's
    assert read_jsonl(tmp_path / "metrics.jsonl") == []
    assert read_jsonl(tmp_path / "metrics.jsonl.prev") == second


def test_a_rerun_sets_the_previous_summary_and_error_aside(tmp_path):
    """A rerun killed before its summary must not leave the old run's summary (or error) beside its rows."""
    write_run(tmp_path, [{"step": 0}])
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed"}))
    (tmp_path / "error.log").write_text("Error: failed: boom\n")
    write_run(tmp_path, [{"step": 0}, {"step": 1}])  # killed before writing its summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.log.prev", "metrics.jsonl", "metrics.jsonl.prev",
                                                          "summary.json.prev"]
    assert json.loads((tmp_path / "summary.json.prev").read_text()) == {"status": "failed"}


def test_a_fresh_run_dir_gets_metrics_jsonl_alone(tmp_path):
    write_run(tmp_path, [{"step": 0}])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_every_row_is_fsynced_as_it_is_written(tmp_path, monkeypatch):
    """A killed run keeps every step it finished: each write reaches the disk before it returns."""
    synced = []
    monkeypatch.setattr("rlsync.sinks.os.fsync", lambda fd: synced.append((tmp_path / "metrics.jsonl").read_text()))
    metrics = MetricsFile(tmp_path)
    metrics.write({"step": 0})
    metrics.write({"step": 1})
    metrics.close()
    assert [[json.loads(line)["step"] for line in text.splitlines()] for text in synced] == [[0], [0, 1]]
