"""Every rollout.release_level trains and generates the same, whole runs of each (slow)."""

from __future__ import annotations

import pytest
from conftest import run_in_process


@pytest.mark.slow
def test_every_sleep_level_trains_and_generates_the_same(tmp_path):
    """Same seed, sleep levels 0, 1 and 2: the same samples, losses and log-prob agreement, with level 2's
    pre-update resume timed as part of perf/engine_resume_time."""
    rows = {level: run_in_process(tmp_path / str(level), f"rollout.release_level={level}", "update.source=host")[0]
            for level in (0, 1, 2)}  # fmt: skip
    for key in (
        "train/loss",
        "train/grad_norm",
        "train/logprob_abs_diff",
        "rollout/reward_mean",
        "rollout/response_len_mean",
    ):
        assert [r[key] for r in rows[2]] == [r[key] for r in rows[1]] == [r[key] for r in rows[0]], key
    assert all(r["train/logprob_abs_diff"] < 0.05 for r in rows[2])  # the engine really has the trainer's weights
    assert all(r["perf/engine_resume_time"] > 0 and r["perf/engine_release_time"] > 0 for r in rows[2])
