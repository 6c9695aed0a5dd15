"""Device-synchronized timers.

GPU work is asynchronous: a wall clock read without a sync charges kernels to whichever phase
happens to wait for them. Every phase boundary here synchronizes the device first.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


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


class DeviceMemory:
    """Extra device memory a block allocates at its peak (CUDA allocator), 0 elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_extra = 0

    @contextmanager
    def track(self):
        if self.device.type != "cuda":
            yield self
            return
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        yield self
        torch.cuda.synchronize(self.device)
        self.peak_extra = torch.cuda.max_memory_allocated(self.device) - base
