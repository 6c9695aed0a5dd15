"""update.payload=delta through the engine-process transports: the engine process ends bit for bit where a full
update puts it, and a whole run over ipc verifies every step (tests/unit/test_delta.py: the payload, direct)."""

import pytest
from conftest import FAST, check_delta_updates, read_jsonl, run_main


@pytest.mark.parametrize("transport", ["ipc", "broadcast"])
def test_a_delta_leaves_the_engine_where_a_full_update_does(tiny, transport):
    check_delta_updates(tiny, transport)


def test_a_delta_run_passes_verification_every_step(tmp_path):
    """The default learning rate over ipc: every step's delta is checked against the trainer's weights."""
    proc = run_main(
        *FAST, "update.payload=delta", "update.verify=true", "update.transport=ipc", f"hydra.run.dir={tmp_path}"
    )
    assert proc.returncode == 0, proc.stderr
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(0 < r["perf/update_weights_changed_ratio"] <= 1 for r in rows)
