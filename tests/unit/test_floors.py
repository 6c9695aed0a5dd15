"""The update's floor counts the bytes its path really moves, `update.source=host` on a GPU included,
and is the fastest way this machine has to do the update's own copy (its dtypes, threads, methods)."""

import math

import pytest
import torch
from conftest import Tiny

import rlsync.measure.floors
from rlsync.config.schema import Config, UpdateConfig
from rlsync.measure.floors import (
    CopyProbe,
    Floors,
    Way,
    best_copy,
    copy_bandwidth,
    copy_candidates,
    crosses_host_link,
    update_floor_bytes,
)
from rlsync.model.build import named_weights
from rlsync.trainer.offload import Offloader
from rlsync.update import plan_for

GB = 10**9


FP32_BF16 = (torch.float32, torch.bfloat16)
CPU = torch.device("cpu")


class FixedFloors(Floors):
    """Floors with a given bandwidth for the update's copy instead of a probed one (a CUDA device described, not used)."""

    def measure(self) -> None:
        self.update_copy = 50 * GB if crosses_host_link(self.source, self.device.type) else 4000 * GB


def test_host_source_on_cuda_counts_the_host_copy_bytes_over_the_link():
    read, written = 4 * GB, 2 * GB  # fp32 trainer weights, bf16 engine weights
    assert crosses_host_link("host", "cuda")
    assert update_floor_bytes(read, written, source="host", device_type="cuda") == read  # fp32 crosses, not bf16
    host = FixedFloors(torch.device("cuda"), update_bytes=written, state_bytes=read, read_bytes=read, source="host")
    assert host.update_floor_time == pytest.approx(read / (50 * GB))
    device = FixedFloors(torch.device("cuda"), update_bytes=written, state_bytes=read, read_bytes=read)
    assert device.update_floor_time == pytest.approx((read + written) / (4000 * GB))


@pytest.mark.parametrize("source", ["device", "host"])
def test_same_memory_floor_reads_and_writes(source):
    """A CPU run (either source) and a device source on a GPU: one copy, read + written bytes."""
    read, written = 4 * GB, 2 * GB
    assert not crosses_host_link(source, "cpu")
    assert update_floor_bytes(read, written, source=source, device_type="cpu") == read + written
    floors = FixedFloors(CPU, update_bytes=written, state_bytes=read, read_bytes=read, source=source)
    assert floors.update_time(read, written) == pytest.approx((read + written) / (4000 * GB))


def test_floor_bytes_are_those_of_the_offloaded_views_the_update_sends():
    """The host views the update reads (Offloader.host_weights) hold the trainer's dtype: the floor's bytes."""
    cfg = Config()
    model = Tiny().build(model=cfg.model, seed=0)
    weights = named_weights(model)
    offloader = Offloader(model, None, mode="full", device=torch.device("cpu"), memory="twin")
    offloader.offload()
    host = offloader.host_weights(weights)
    sent = sum(t.numel() * t.element_size() for t in host.values())
    engine_bytes = sum(b.nbytes for b in plan_for(weights, UpdateConfig(), torch.bfloat16))
    read = sum(t.numel() * t.element_size() for t in weights.values())
    assert sent == read == 2 * engine_bytes
    assert update_floor_bytes(read, engine_bytes, source="host", device_type="cuda") == sent


def test_the_update_probe_copies_the_update_dtypes_and_counts_what_they_read_and_write():
    """fp32 -> bf16: the probe reads 4 and writes 2 bytes per element, on buffers sized like the update
    (the destination's elements) and capped, and its floor counts the update's read + written bytes."""
    n = 3 << 20  # elements
    probe = CopyProbe(CPU, update_bytes=2 * n, read_bytes=4 * n, source="device", dtypes=FP32_BF16)
    assert (probe.src.dtype, probe.dst.dtype) == FP32_BF16 and probe.src.numel() == probe.dst.numel() == n
    assert probe.moved == 6 * n and probe.floor_bytes == 6 * n
    assert torch.equal(probe.dst, probe.src.to(torch.bfloat16))  # touched once, with the converting copy
    seconds = probe.floor_time(tries=1)
    assert 0 < seconds < math.inf and probe.last.seconds == pytest.approx(seconds)  # floor bytes = moved bytes here
    assert sum(probe.wins.values()) == 1 and probe.last.describe() in probe.wins


def test_probe_buffers_are_capped_by_the_larger_dtype(monkeypatch):
    monkeypatch.setattr(rlsync.measure.floors, "PROBE_CAP_BYTES", 8 << 20)
    src, dst = rlsync.measure.floors.probe_buffers(1 << 40, src=CPU, dst=CPU, dtypes=FP32_BF16)
    assert src.nbytes == 8 << 20 and dst.nbytes == 4 << 20  # the fp32 side at the cap, not 2 TiB of bf16
    src, dst = rlsync.measure.floors.probe_buffers(1, src=CPU, dst=CPU, dtypes=FP32_BF16)
    assert dst.nbytes == rlsync.measure.floors.PROBE_MIN_BYTES and src.nbytes == 2 * dst.nbytes


def test_floors_record_how_the_update_floor_was_measured():
    """summary.json's limits say which dtypes, threads and method gave the update's floor."""
    floors = Floors(CPU, update_bytes=2 << 20, state_bytes=4 << 20, read_bytes=4 << 20, dtypes=FP32_BF16)
    d = floors.as_dict()
    ways = {
        f"{w.threads} thread{'s' if w.threads > 1 else ''}, {w.method}"
        for w in copy_candidates(torch.empty(1, dtype=torch.bfloat16), torch.empty(1))
    }
    assert d["update_probe"].startswith("float32->bfloat16, ") and d["update_probe"].split(", ", 1)[1] in ways
    assert d["update_copy_gbps"] > 0 and d["device_copy_gbps"] > 0
    assert floors.update_floor_time == pytest.approx(((4 << 20) + (2 << 20)) / floors.update_copy)
    assert copy_bandwidth(1 << 20, src=CPU, dst=CPU).how.startswith("uint8->uint8, ")  # the offload's: memcpy


def test_cpu_candidates_include_the_update_own_copy():
    """One thread (the update's `update.copy_threads` default) and torch's thread count, as one `copy_`:
    the copy the update does is always one of the probe's candidates, so the probe cannot be slower."""
    ways = copy_candidates(torch.empty(1, dtype=torch.bfloat16), torch.empty(1))
    assert Way("copy_", 1) in ways and Way("copy_", torch.get_num_threads()) in ways
    assert {w.method for w in ways} == set(rlsync.measure.floors.COPY_METHODS) and ways[0] == Way("copy_", 1)


class FakeMachine:
    """A clock that only the copies advance, each by a set time per (method, threads): no wall clock."""

    def __init__(self, monkeypatch, seconds: dict[Way, list[float]]):
        self.now, self.seconds, self.calls = 0.0, {w: list(s) for w, s in seconds.items()}, []
        for method in {w.method for w in seconds}:  # "chunked": a second method, as one worth trying would be
            monkeypatch.setitem(rlsync.measure.floors.COPY_METHODS, method, self.copier(method))

    def copier(self, method):
        def copy(dst, src):
            way = Way(method, torch.get_num_threads())  # the thread count it really ran on
            self.calls.append(way)
            times = self.seconds[way]
            self.now += times.pop(0) if len(times) > 1 else times[0]

        return copy

    def clock(self) -> float:
        return self.now


def test_best_copy_keeps_the_fastest_candidate_and_its_best_round(monkeypatch):
    ways = [Way("copy_", 1), Way("chunked", 1), Way("copy_", 2), Way("chunked", 2)]
    machine = FakeMachine(
        monkeypatch,
        {
            Way("copy_", 1): [0.123, 0.130, 0.125],
            Way("chunked", 1): [0.2],
            Way("copy_", 2): [0.150, 0.100, 0.140],
            Way("chunked", 2): [0.3],
        },
    )
    before = torch.get_num_threads()
    a, b = torch.ones(4), torch.empty(4, dtype=torch.bfloat16)
    best = best_copy(b, a, 3, budget_s=0.0, warm_up=False, candidates=ways, clock=machine.clock)
    assert best.seconds == pytest.approx(0.100) and best.way == Way("copy_", 2)  # the best round of the best way
    assert best.describe() == "float32->bfloat16, 2 threads, copy_"
    assert machine.calls == ways * 3  # every candidate once per round, in turn, on its own thread count
    assert torch.get_num_threads() == before


def test_probe_floor_is_not_above_the_update_own_copy_timed_alike(monkeypatch):
    """The floor time for the update's bytes is at most that of a plain one-thread fp32 -> bf16 `copy_`
    of the same tensors (the update's own copy), whichever way the machine favours."""
    n = 1 << 20
    monkeypatch.setitem(rlsync.measure.floors.COPY_METHODS, "chunked", None)  # a second method among the candidates
    ways = copy_candidates(torch.empty(1, dtype=torch.bfloat16), torch.empty(1))
    own = Way("copy_", 1)
    assert own in ways and Way("chunked", 1) in ways
    for faster in ways:
        seconds = {w: [0.2] for w in ways} | {own: [0.123]}
        if faster != own:
            seconds[faster] = [0.1]
        machine = FakeMachine(monkeypatch, seconds)
        monkeypatch.setattr(rlsync.measure.floors, "CLOCK", machine.clock)  # CopyProbe's clock
        probe = CopyProbe(CPU, update_bytes=2 * n, read_bytes=4 * n, source="device", dtypes=FP32_BF16)
        floor = probe.floor_time()
        direct = probe.floor_bytes / probe.moved * 0.123  # the plain one-thread copy_, the same bytes
        assert floor <= direct and probe.last.way == faster
