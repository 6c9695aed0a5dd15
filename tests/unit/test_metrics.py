"""The catalogue (rlsync/measure/metrics.py): what it refuses. (A phase declared there reaching every sink, through
one real run: tests/process/test_metrics.py.)"""

from __future__ import annotations

import pytest


def test_adding_a_phase_twice_or_before_an_unknown_one_is_refused(monkeypatch):
    from rlsync.measure import metrics

    monkeypatch.setattr(metrics, "PHASES", metrics.PHASES)
    with pytest.raises(ValueError, match="already declared"):
        metrics.add_phase(metrics.Phase("train", "training", "train"))
    with pytest.raises(KeyError, match="no phase 'nope'"):
        metrics.add_phase(metrics.Phase("mine", "mine", "mine"), before="nope")
    assert [p.name for p in metrics.step_phases()][:2] == ["rollout", "engine_release"]
