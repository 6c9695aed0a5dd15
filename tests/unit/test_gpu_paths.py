"""CUDA-only paths whose logic runs on a CPU: the run's device peak, the ipc open's synchronize,
the pinned twin's size in the memory estimate."""

from __future__ import annotations

import torch
from conftest import Tiny
from simulated_cuda import SimulatedAllocator

from rlsync.check import estimate as memory
from rlsync.check.record import memory_record
from rlsync.fmt import MIB
from rlsync.measure import devices
from rlsync.measure.timing import DeviceMemory
from rlsync.trainer.offload import plan_pin_chunks
from rlsync.update import flat, ipc
from rlsync.update.buckets import TensorMeta, plan_buckets

CUDA = torch.device("cuda", 0)
GB = 10**9


def test_the_run_peak_survives_every_updates_reset(monkeypatch):
    """DeviceMemory.track resets torch's peaks at every update; the run's peak (the train step's
    activations, here) must still be the one summary.json records."""
    allocator = SimulatedAllocator()
    allocator.install(monkeypatch)
    monkeypatch.setattr(devices, "_run_peaks", {})
    devices.reset_run_peaks(CUDA)
    allocator.alloc(4 * GB)  # the trainer's state
    allocator.alloc(10 * GB)  # the train step's activations: the run's peak
    allocator.free(10 * GB)
    for _ in range(3):  # three updates, each tracked (and reset) on its own
        tracker = DeviceMemory(CUDA)
        with tracker.track():
            allocator.alloc(GB)
            allocator.free(GB)
        assert tracker.peak_extra == GB
    assert allocator.resets == 4 and allocator.peak_allocated == 5 * GB  # torch's counters: the last update's
    assert devices.run_device_peaks(CUDA) == {"reserved": 14 * GB, "allocated": 14 * GB}
    fit = {"estimate": memory.Estimate(process={"runtime": 1}), "available": {}}
    measured = memory_record(fit, CUDA)["measured"]
    assert (measured["device_peak_bytes"], measured["device_peak_allocated_bytes"]) == (14 * GB, 14 * GB)
    devices.reset_run_peaks(CUDA)  # the next job of a multirun starts from what is allocated now
    assert devices.run_device_peaks(CUDA) == {"reserved": 14 * GB, "allocated": 4 * GB}


def test_off_cuda_there_is_no_device_peak():
    assert devices.run_device_peaks(torch.device("cpu")) == {}
    fit = {"estimate": memory.Estimate(process={"runtime": 1}), "available": {}}
    assert "device_peak_bytes" not in memory_record(fit, torch.device("cpu"))["measured"]


class FlatEngine:
    """The engine side of flat weights: named weights the receiver rebinds into shared buffers."""

    def __init__(self, weights: dict[str, torch.Tensor], device: torch.device):
        self.weights, self.device = weights, device


def test_ipc_open_synchronizes_after_copying_weights_into_the_shared_buffers(monkeypatch):
    """The engine's copy into the trainer's shared buffers runs on the engine's stream; CUDA IPC
    does not order the trainer's stream after it, so the reply to `open` must wait for the copy."""
    weights = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4)}
    buckets = plan_buckets([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in weights.items()], 1 << 20)
    buffers = flat.allocate(buckets, torch.device("cpu"))
    calls = []
    bind = flat.bind
    monkeypatch.setattr(flat, "bind", lambda *a: (bind(*a), calls.append("bind")))
    monkeypatch.setattr(ipc, "synchronize", lambda device: calls.append(("synchronize", device)))
    receiver = ipc.IpcReceiver(buckets, slots=[], flat_weights=buffers, copy_threads=1)
    receiver.open(FlatEngine(weights, CUDA))
    assert calls == ["bind", ("synchronize", CUDA)]  # after the copy, before the reply
    assert torch.equal(buffers[0][:6].view(2, 3), torch.arange(6, dtype=torch.float32).view(2, 3))
    calls.clear()
    ipc.IpcReceiver(buckets, slots=[torch.empty(16)], flat_weights=None, copy_threads=1).open(FlatEngine(weights, CUDA))
    assert calls == []  # staging slots only: nothing was copied, nothing to wait for


def test_the_pinned_twin_is_estimated_per_chunk_as_the_offload_pins_it(compose):
    """On CUDA the twin is pinned in chunks of at most trainer.offload_pin_chunk_mb, each rounded up
    to a power of two on its own (rlsync.trainer.offload); one rounding of the whole copy overstates it (9.5 GB
    of Qwen3-0.6B state -> 16 GiB)."""
    cfg = compose("model=qwen3_0p6b", "trainer.offload_memory=twin", "trainer.offload=full")
    extra = memory.estimate(cfg, cuda=True, runtime_bytes=0).process["offload_host"]
    shapes = list(memory.model_shapes(cfg.model))
    params = [memory.numel(s) * 4 for _, s in shapes]
    travelling = params + [b for b in params for _ in range(2)] + params  # as rlsync.trainer.offload lays them out
    chunks = plan_pin_chunks(travelling, 1024 * MIB)
    assert extra == sum(memory.pinned_bytes(end - start) for start, end in chunks)
    assert sum(travelling) <= extra < memory.pinned_bytes(sum(travelling))
    assert extra < 1.2 * sum(travelling)  # whole chunks of 1 GiB lose nothing to the rounding
    smaller = compose(
        "model=qwen3_0p6b", "trainer.offload_memory=twin", "trainer.offload=full", "trainer.offload_pin_chunk_mb=64"
    )
    assert memory.estimate(smaller, cuda=True, runtime_bytes=0).process["offload_host"] != extra


def test_the_estimate_matches_the_chunks_an_offloader_allocates(compose):
    """The same chunks, from the config alone and from a real Offloader (twin, on the CPU)."""
    from rlsync.trainer.offload import Offloader

    cfg = compose(
        "model=tiny", "trainer.offload_memory=twin", "trainer.offload=full", "trainer.offload_pin_chunk_mb=0.01"
    )
    model = Tiny().build(model=cfg.model, seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    offloader = Offloader(
        model, optimizer, mode="full", device=torch.device("cpu"), memory="twin", pin_chunk_bytes=int(0.01 * MIB)
    )
    chunks = [c.host.numel() for s in offloader.segments for c in s.twin]
    offloader.close()
    assert len(chunks) > 1
    expected = sum(memory.pinned_bytes(n) for n in chunks)
    assert memory.estimate(cfg, cuda=True, runtime_bytes=0).process["offload_host"] == expected
    assert memory.estimate(cfg, cuda=False, runtime_bytes=0).process["offload_extra"] == sum(chunks)
