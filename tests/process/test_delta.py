"""update.payload=delta through the engine-process transports: the engine process ends bit for bit where a full
update puts it, and a whole run over ipc verifies every step (tests/unit/test_delta.py: the payload, direct)."""

import pytest
import torch
from conftest import BF16, CPU, FAST, nudge, read_jsonl, run_main

from rlsync.config.schema import Config, UpdateConfig
from rlsync.update import close_update, timed_update
from rlsync.update.payload.delta import DeltaPayload, sparse_bytes


@pytest.mark.parametrize("transport", ["ipc", "broadcast"])
def test_a_delta_leaves_the_engine_where_a_full_update_does(tiny, transport):
    """Three updates of changing weights: after each the engine equals the trainer's weights in bf16, and
    only the changed elements crossed (6 bytes each in bf16) once the first, full, update is done."""
    update = UpdateConfig(transport=transport, bucket_mb=0.05, verify=True, engine_timeout_s=120)
    cfg = Config(update=UpdateConfig(payload="delta", transport=transport, bucket_mb=0.05, verify=True))
    DeltaPayload.check_config(cfg)  # allowed
    update = cfg.update
    weights = tiny.weights(seed=3)
    engine, transport, buckets = tiny.open(update, weights)
    try:
        first = timed_update(transport, weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
        total = sum(b.numel for b in buckets)
        assert first["perf/update_weights_changed_ratio"] == 1.0  # nothing sent before: all of it
        assert first["perf/update_weights_bytes"] == sum(b.nbytes for b in buckets)
        for step in range(2):
            flipped = nudge(weights, 0.01, seed=step)
            metrics = timed_update(transport, weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
            assert metrics["perf/update_weights_changed_ratio"] == pytest.approx(flipped / total)
            assert metrics["perf/update_weights_bytes"] == sparse_bytes(flipped, 2)
            assert metrics["perf/update_weights_full_bytes"] == sum(b.nbytes for b in buckets)
            assert metrics["perf/update_weights_encode_time"] > 0
            got = engine.weights
            for name, t in weights.items():
                assert torch.equal(got[name], t.to(BF16)), name
    finally:
        close_update(engine, transport)


def test_a_delta_run_passes_verification_every_step(tmp_path):
    """The default learning rate over ipc: every step's delta is checked against the trainer's weights."""
    proc = run_main(
        *FAST, "update.payload=delta", "update.verify=true", "update.transport=ipc", f"hydra.run.dir={tmp_path}"
    )
    assert proc.returncode == 0, proc.stderr
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(0 < r["perf/update_weights_changed_ratio"] <= 1 for r in rows)
