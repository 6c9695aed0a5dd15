"""perf/engine_idle_time: what the rollout engine loses between two rollouts, from the previous one's
last token to this one's first, with every phase the trainer runs in between inside it."""

from conftest import FAST, read_jsonl, run_main

BETWEEN = ("engine_release", "wake_up", "log_probs", "train", "update_layout", "update_weights", "sleep")


def test_the_engine_idle_time_holds_every_phase_between_two_rollouts(tmp_path):
    proc = run_main(*FAST, "run.steps=4", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert "perf/engine_idle_time" not in rows[0]  # no rollout before the first
    for before, row in zip(rows, rows[1:]):
        inside = sum(before.get(f"perf/{p}_time", 0.0) for p in BETWEEN) + row["perf/engine_resume_time"]
        assert inside <= row["perf/engine_idle_time"] <= before["perf/step_time"] + 5.0, (row, before)
