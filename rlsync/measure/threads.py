"""Torch CPU threads for the update's copies.

A copy is memory-bound, and each extra thread adds an OpenMP barrier per tensor that costs
milliseconds when the cores are busy elsewhere (experiments/transports/README.md). So the update
copies on `update.copy_threads` threads in each process and gives the rest of the program its
threads back.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

# A CPU copy of more elements than this runs on torch's thread pool (at::internal::GRAIN_SIZE: at::parallel_for
# forks only above it); at or below it, on the calling thread. Each pooled copy wakes the pool's threads.
POOL_GRAIN = 32768


def pooled(numel: int) -> bool:
    """Whether a CPU copy of `numel` elements runs on torch's thread pool (with more than one thread)."""
    return numel > POOL_GRAIN


@contextmanager
def cpu_threads(count: int | None, device: torch.device):
    """Within the block, torch uses `count` CPU threads (0, None (unresolved auto), or a CUDA device: unchanged)."""
    if not count or count < 0 or device.type != "cpu" or count == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
