"""The update's floor counts the bytes its path really moves, `update.source=host` on a GPU included."""

import pytest
import torch

from rlsync.config import Config, UpdateConfig
from rlsync.limits import Limits, crosses_host_link, update_floor_bytes
from rlsync.models import build_model, named_weights
from rlsync.offload import Offloader
from rlsync.sync import plan_for

GB = 10**9


class FixedLimits(Limits):
    """Limits with given bandwidths instead of probed ones (a CUDA device described, not used)."""

    def measure(self) -> None:
        self.device_copy, self.to_host, self.to_device = 4000 * GB, 50 * GB, 50 * GB


def test_host_source_on_cuda_counts_the_host_copy_bytes_over_the_link():
    read, written = 4 * GB, 2 * GB  # fp32 trainer weights, bf16 engine weights
    assert crosses_host_link("host", "cuda")
    assert update_floor_bytes(read, written, source="host", device_type="cuda") == read  # fp32 crosses, not bf16
    limits = FixedLimits(torch.device("cuda"), update_bytes=written, state_bytes=read)
    assert limits.update_time(read, written, source="host") == pytest.approx(read / (50 * GB))
    assert limits.update_time(read, written, source="device") == pytest.approx((read + written) / (4000 * GB))


@pytest.mark.parametrize("source", ["device", "host"])
def test_same_memory_floor_reads_and_writes(source):
    """A CPU run (either source) and a device source on a GPU: one copy, read + written bytes."""
    read, written = 4 * GB, 2 * GB
    assert not crosses_host_link(source, "cpu")
    assert update_floor_bytes(read, written, source=source, device_type="cpu") == read + written
    limits = FixedLimits(torch.device("cpu"), update_bytes=written, state_bytes=read)
    assert limits.update_time(read, written, source=source) == pytest.approx((read + written) / (4000 * GB))


def test_floor_bytes_are_those_of_the_offloaded_views_the_update_sends():
    """The host views the update reads (Offloader.host_weights) hold the trainer's dtype: the floor's bytes."""
    cfg = Config()
    model = build_model(cfg.model, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    weights = named_weights(model)
    offloader = Offloader(model, None, mode="full", device=torch.device("cpu"), memory="twin")
    offloader.sleep()
    host = offloader.host_weights(weights)
    sent = sum(t.numel() * t.element_size() for t in host.values())
    engine_bytes = sum(b.nbytes for b in plan_for(weights, UpdateConfig(), torch.bfloat16))
    read = sum(t.numel() * t.element_size() for t in weights.values())
    assert sent == read == 2 * engine_bytes
    assert update_floor_bytes(read, engine_bytes, source="host", device_type="cuda") == sent
