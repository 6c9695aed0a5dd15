"""Timers: synchronized phases, and the weight update's per-unit breakdown.

GPU work is asynchronous: a wall clock read without a sync charges kernels to whichever phase
happens to wait for them. `Stopwatch` times phases (rollout, train, the whole update): every
boundary synchronizes the device first.

Inside one update the breakdown is per unit (a bucket, or a tensor for `per_tensor`: 311 of them
for Qwen3-0.6B against a ~1 ms copy floor), and two syncs per unit would mostly time the syncs.
`unit_timer(device)` gives one interface with two clocks: `HostTimer` (perf_counter; a CPU run, or
a host-side wait) and `EventTimer` (CUDA events recorded around each unit on the device's stream,
read after a single synchronize at the end of the update: `resolve()`). A unit that is handed to
another process (ipc) calls `handoff()`, the one sync the hand-off needs anyway. The pattern is
PyTorch's own (torch.cuda.Event docs: record on a stream, `synchronize`, then `elapsed_time`).
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

import torch

from rlsync.measure.devices import fold_run_peak


@contextmanager
def settled_heap() -> Iterator[None]:
    """Within the block, what setup left (torch's, transformers', Hydra's objects: about half a million for
    tiny_moe) is frozen out of Python's cyclic collector (gc.freeze), so that a full collection, 0.2 s there on this
    project's CPU, cannot land in a timed phase: the steps' own objects are still collected, quickly. The young
    generations are collected first (setup's last garbage, in a millisecond); a full collection there found 0 to
    120 objects more in 0.2 s, left frozen until the block ends. Unfrozen on the way out, so that the next job of a
    sweep in this process gets this one's cycles back. vLLM's engine core freezes its start-up heap the same way."""
    gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Sums synchronized wall time per label: `with watch("pack"): ...`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.last = 0.0  # seconds of the most recent block (per-bucket breakdowns)

    @contextmanager
    def __call__(self, label: str):
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.last = time.perf_counter() - start
            self.seconds[label] += self.last

    def totals(self, pattern: str = "{}") -> dict[str, float]:
        return {pattern.format(label): s for label, s in self.seconds.items()}


class HostTimer:
    """Per-unit seconds on the host clock, known at once: `with timer("pack", row): ...`.

    `row` (optional) gets `row["pack_time"]` when the seconds are known; `seconds` sums per label.
    Nothing is synchronized: on a CPU the work is done when the block ends; elsewhere use it for
    host-side waits (a message, a collective's completion), which is what it then measures.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, label: str, row: Optional[dict] = None) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self._add(label, row, self.clock() - start)

    def _add(self, label: str, row: Optional[dict], seconds: float) -> None:
        self.seconds[label] += seconds
        if row is not None:
            row[f"{label}_time"] = seconds

    def handoff(self) -> None:
        """Before another process reads what the last unit wrote: nothing is pending on the host."""

    def resolve(self) -> None:
        """End of the update: every unit's seconds are final (already, on the host clock)."""

    def totals(self, pattern: str = "{}") -> dict[str, float]:
        return {pattern.format(label): s for label, s in self.seconds.items()}


class EventTimer(HostTimer):
    """Per-unit seconds from device events: recorded around each unit, read once at `resolve()`.

    `new_event` and `synchronize` are injectable so that the pairing and the single resolution are
    tested without a GPU; by default a timing `torch.cuda.Event` recorded on `stream` (the device's
    current stream) and `torch.cuda.synchronize(device)`. Until `resolve()` the rows and `seconds`
    hold nothing for the units timed so far.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        new_event: Optional[Callable[[], object]] = None,
        synchronize: Optional[Callable[[], None]] = None,
        stream: object = None,
    ):
        super().__init__()
        self.new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self.sync = synchronize or (lambda: torch.cuda.synchronize(device))
        self.stream = stream if stream is not None or new_event is not None else torch.cuda.current_stream(device)
        self.pending: list[tuple[str, Optional[dict], object, object]] = []  # (label, row, start, end)
        self.syncs = 0  # device synchronizations this timer made (resolve and handoff)

    @contextmanager
    def __call__(self, label: str, row: Optional[dict] = None) -> Iterator[None]:
        start = self.new_event()
        start.record(self.stream)
        try:
            yield
        finally:
            end = self.new_event()
            end.record(self.stream)
            self.pending.append((label, row, start, end))

    def handoff(self) -> None:
        """Wait for the last unit's work (its end event): another process reads its bytes next.
        CUDA IPC gives the reader the memory, not the writer's stream order (torch.multiprocessing
        docs; vLLM's and slime's IPC paths synchronize before sending the handles)."""
        if self.pending:
            self.pending[-1][3].synchronize()
            self.syncs += 1

    def resolve(self) -> None:
        if not self.pending:
            return
        self.sync()  # one for the whole update: every event has completed after it
        self.syncs += 1
        for label, row, start, end in self.pending:
            self._add(label, row, start.elapsed_time(end) / 1000.0)  # elapsed_time is in milliseconds
        self.pending = []


def unit_timer(device: torch.device) -> HostTimer:
    """The per-unit timer for work on `device`: CUDA events on a GPU, the host clock elsewhere."""
    return EventTimer(device) if device.type == "cuda" else HostTimer()


class DeviceMemory:
    """Extra device memory a block allocates at its peak (CUDA allocator), 0 elsewhere.

    No synchronize: the caching allocator counts allocations when the host asks for them (its stats
    are host-side bookkeeping, c10/cuda/CUDACachingAllocator.cpp), so the peak is right without
    waiting for the kernels; a sync here would cost one per unit in the ipc engine's loop.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_extra = 0

    @contextmanager
    def track(self):
        if self.device.type != "cuda":
            yield self
            return
        base = torch.cuda.memory_allocated(self.device)
        fold_run_peak(self.device)  # the reset below would drop the run's peak (train step, KV cache)
        torch.cuda.reset_peak_memory_stats(self.device)
        yield self
        self.peak_extra = torch.cuda.max_memory_allocated(self.device) - base
