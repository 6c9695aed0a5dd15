"""Experiment presets and submitit sweeps."""

import pytest
from conftest import ROOT

PRESETS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes(compose, preset):
    cfg = compose(f"experiment={preset}")
    assert cfg.model.name.startswith("qwen3_")
    assert cfg.run.steps > cfg.run.warmup_steps


def test_presets_match_the_reference_runs(compose):
    table = compose("experiment=weight_update_table")
    assert (table.run.steps, table.run.warmup_steps, table.rollout.max_response_len, table.update.bucket_mb) == (
        4,
        2,
        256,
        512,
    )
    assert compose("experiment=step_share").run.steps == 48
