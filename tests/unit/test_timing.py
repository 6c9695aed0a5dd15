"""The per-unit timer: one interface, a host clock and CUDA events resolved by one sync at the end.

The CUDA implementation runs here on fake events (a clock the test moves, a device that completes
events only when synchronized), so its pairing and single resolution are checked without a GPU,
also through a real `direct` update of the tiny model.
"""

import pytest
from conftest import CPU

import rlsync.update.direct as direct
from rlsync.config.schema import UpdateConfig
from rlsync.measure.timing import EventTimer, HostTimer, unit_timer
from rlsync.update import close_update, timed_update


class FakeDevice:
    """A stream whose events complete only when it is synchronized (or the event itself is)."""

    def __init__(self):
        self.now = 0.0  # seconds
        self.syncs = 0
        self.event_syncs = 0
        self.events: list[FakeEvent] = []

    def new_event(self) -> "FakeEvent":
        return FakeEvent(self)

    def synchronize(self) -> None:
        self.syncs += 1
        for e in self.events:
            e.done = True


class FakeEvent:
    def __init__(self, device: FakeDevice):
        self.device, self.at, self.done = device, None, False

    def record(self, stream=None) -> None:
        self.at = self.device.now
        self.device.events.append(self)

    def synchronize(self) -> None:
        self.device.event_syncs += 1
        for e in self.device.events:  # everything recorded before it on the stream is done too
            e.done = True
            if e is self:
                break

    def elapsed_time(self, end: "FakeEvent") -> float:
        if not (self.done and end.done):  # what torch.cuda.Event raises on an unfinished event
            raise RuntimeError("elapsed_time on an event that has not completed")
        return (end.at - self.at) * 1000.0  # milliseconds, as torch.cuda.Event


def run_units(timer, advance, durations):
    """Time one unit per duration (label alternating pack/load), each with its row."""
    rows = []
    for i, seconds in enumerate(durations):
        rows.append({"bytes": i})
        with timer("pack" if i % 2 == 0 else "load", rows[-1]):
            advance(seconds)
    return rows


def test_host_timer_fills_rows_and_totals_at_once():
    now = [0.0]
    timer = HostTimer(clock=lambda: now[0])
    rows = run_units(timer, lambda s: now.__setitem__(0, now[0] + s), [0.5, 0.25, 1.0])
    assert rows == [{"bytes": 0, "pack_time": 0.5}, {"bytes": 1, "load_time": 0.25}, {"bytes": 2, "pack_time": 1.0}]
    timer.resolve()
    assert timer.totals("perf/{}_time") == {"perf/pack_time": 1.5, "perf/load_time": 0.25}


def test_event_timer_pairs_events_and_resolves_with_one_sync():
    device = FakeDevice()
    timer = EventTimer(CPU, new_event=device.new_event, synchronize=device.synchronize)

    def advance(s):
        device.now += s

    rows = run_units(timer, advance, [0.5, 0.25, 1.0, 0.125])
    assert device.syncs == 0 and all(set(r) == {"bytes"} for r in rows)  # nothing read before the end
    assert dict(timer.seconds) == {}
    timer.resolve()
    assert device.syncs == 1 and timer.syncs == 1
    assert [r.get("pack_time", r.get("load_time")) for r in rows] == [0.5, 0.25, 1.0, 0.125]
    assert timer.totals("perf/{}_time") == {"perf/pack_time": 1.5, "perf/load_time": 0.375}
    timer.resolve()  # nothing pending: no second sync, totals unchanged
    assert device.syncs == 1 and timer.totals()["pack"] == 1.5


def test_event_timer_gives_the_host_timer_shape():
    """Same units, same durations: the same rows and totals from both implementations."""
    durations = [0.5, 0.25, 1.0]
    now = [0.0]
    host = HostTimer(clock=lambda: now[0])
    host_rows = run_units(host, lambda s: now.__setitem__(0, now[0] + s), durations)
    device = FakeDevice()
    events = EventTimer(CPU, new_event=device.new_event, synchronize=device.synchronize)
    event_rows = run_units(events, lambda s: setattr(device, "now", device.now + s), durations)
    events.resolve()
    assert event_rows == host_rows
    assert events.totals("perf/update_weights_{}_time") == host.totals("perf/update_weights_{}_time")


def test_handoff_waits_for_the_last_unit_only():
    device = FakeDevice()
    timer = EventTimer(CPU, new_event=device.new_event, synchronize=device.synchronize)
    timer.handoff()  # nothing timed yet: nothing to wait for
    assert device.event_syncs == 0
    with timer("pack", {}):
        device.now += 1.0
    timer.handoff()
    assert device.event_syncs == 1 and device.syncs == 0
    timer.resolve()
    assert timer.syncs == 2 and timer.totals() == {"pack": 1.0}


def test_unit_timer_picks_the_host_clock_off_cuda():
    assert type(unit_timer(CPU)) is HostTimer


@pytest.mark.parametrize("strategy", ["per_tensor", "bucketed"])
def test_direct_update_with_event_timing_syncs_once(monkeypatch, tiny, strategy):
    """The CUDA implementation inside a real `direct` update: one sync for all units, a row per unit."""
    device = FakeDevice()
    made = []

    def fake_unit_timer(_device):
        made.append(EventTimer(_device, new_event=device.new_event, synchronize=device.synchronize))
        return made[-1]

    monkeypatch.setattr(direct, "unit_timer", fake_unit_timer)
    update = UpdateConfig(strategy=strategy, bucket_mb=0.05, flat_engine_weights=False)  # two copies: pack, load
    weights = tiny.weights(seed=1)
    engine, transport, buckets = tiny.open(update, weights)
    try:
        metrics = timed_update(transport, weights, buckets=buckets, cfg=update, device=CPU, floor_time=1e-3)
    finally:
        close_update(engine, transport)
    assert len(made) == 1 and device.syncs == 1 and device.event_syncs == 0
    rows = transport.last_update_buckets
    keys = {"per_tensor": {"bytes", "load_time"}, "bucketed": {"bytes", "pack_time", "load_time"}}[strategy]
    assert len(rows) == (len(weights) if strategy == "per_tensor" else len(buckets)) > 1
    floors = {"encode_floor_bytes", "decode_floor_bytes"}  # what the payload declares each side must move
    assert all(keys <= set(r) <= keys | floors for r in rows), rows[:2]
    assert metrics["perf/update_weights_load_time"] == pytest.approx(sum(r["load_time"] for r in rows))
