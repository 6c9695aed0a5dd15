"""After an update every engine tensor equals the trainer's cast to the engine dtype, bit for bit."""

import pytest
import torch

from rlsync.config.schema import UpdateConfig
from rlsync.update import WeightMismatch, checksum, close_update, timed_update, verify

CPU = torch.device("cpu")
LARGEST_MIB = 512 * 256 * 4 / 2**20 / 2  # tiny's embedding in bf16: 0.125 MiB


def engine_and_weights(tiny, update: UpdateConfig, seed=3):
    """(engine, transport, trainer weights, bucket plan)."""
    weights = tiny.weights(seed=seed)
    engine, transport, buckets = tiny.open(update, weights)
    return engine, transport, weights, buckets


@pytest.mark.parametrize("strategy", ["bucketed", "per_tensor"])
@pytest.mark.parametrize("bucket_mb", [LARGEST_MIB / 3, LARGEST_MIB, LARGEST_MIB * 1.5, 512.0])
@pytest.mark.parametrize("flat", [False, None])  # None: auto, on for the HF engine's buckets (one copy, no staging)
def test_engine_equals_trainer_bit_for_bit(tiny, strategy, bucket_mb, flat):
    update = UpdateConfig(strategy=strategy, bucket_mb=bucket_mb, verify=True, flat_engine_weights=flat)
    engine, transport, weights, buckets = engine_and_weights(tiny, update)
    with torch.no_grad():
        for t in weights.values():
            t.add_(torch.randn_like(t))  # trained weights differ from anything the engine could hold
    metrics = timed_update(transport, weights, buckets=buckets, cfg=update, device=CPU, floor_time=1e-3)
    got = engine.weights
    assert set(got) == set(weights)
    for name, t in weights.items():
        assert torch.equal(got[name], t.to(torch.bfloat16)), name
    assert metrics["perf/update_weights_bytes"] == sum(t.numel() * 2 for t in weights.values())
    if strategy == "bucketed":
        assert metrics["perf/update_weights_buckets"] == len(buckets)
        staging = 0 if flat is None else max(b.nbytes for b in buckets)  # flat: packing writes the engine's weights
        assert metrics["perf/update_weights_peak_bytes"] == staging
        if bucket_mb < LARGEST_MIB:
            assert len(buckets) > len(weights) / 2  # most tensors travel alone
    close_update(engine, transport)


def test_verify_names_the_mismatching_tensor(tiny):
    update = UpdateConfig()
    engine, transport, weights, buckets = engine_and_weights(tiny, update)
    timed_update(transport, weights, buckets=buckets, cfg=update, device=CPU, floor_time=1e-3)
    sums = {n: checksum(t) for n, t in engine.weights.items()}
    verify(weights, sums, torch.bfloat16)  # equal: passes
    sums["model.norm.weight"] += 1
    with pytest.raises(WeightMismatch, match="model.norm.weight"):
        verify(weights, sums, torch.bfloat16)
