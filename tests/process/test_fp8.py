"""update.payload=fp8 through the engine-process transports: the engine process holds exactly
what the same quantize-dequantize of the trainer's weights gives (tests/unit/test_fp8.py: the format, direct)."""

import pytest
import torch
from conftest import BF16, CPU

from rlsync.config.schema import UpdateConfig
from rlsync.update import close_update, timed_update
from rlsync.update.payload.fp8 import layout, reference


@pytest.mark.parametrize("transport", ["ipc", "broadcast"])
def test_the_engine_holds_the_reference_quantization(tiny, transport):
    update = UpdateConfig(transport=transport, payload="fp8", bucket_mb=0.05, verify=True)
    weights = tiny.weights(seed=2)
    engine, transport, buckets = tiny.open(update, weights)
    try:
        metrics = timed_update(transport, weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
        assert metrics["perf/update_weights_bytes"] == sum(layout(b)[1] for b in buckets)
        assert metrics["perf/update_weights_bytes"] < metrics["perf/update_weights_full_bytes"]
        assert metrics["perf/update_weights_encode_time"] > 0
        slots = {s.meta.name: s for b in buckets for s in b.slots}
        got = engine.weights
        for name, t in weights.items():
            assert torch.equal(got[name], reference(slots[name], t, BF16)), name
        assert any(not torch.equal(got[n], t.to(BF16)) for n, t in weights.items())  # FP8 did change some
    finally:
        close_update(engine, transport)
