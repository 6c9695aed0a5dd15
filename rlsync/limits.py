"""The physical floor, measured in the same run on the same machine.

A copy cannot beat the memory (or link) bandwidth. We time a plain `dst.copy_(src)` over the
same path the real transfer takes and report the real transfer as a ratio to it:

- same device:  bandwidth = (bytes read + bytes written) / time, so a copy of N bytes moves 2N;
- across devices (host <-> GPU): bandwidth = bytes / time, one direction.

On a CPU-only machine the "device" is host memory and both formulas measure memcpy.
"""

from __future__ import annotations

import time

import torch

from rlsync.sync.threads import cpu_threads
from rlsync.timing import synchronize

PROBE_CAP_BYTES = 1 << 30  # buffers above this give the same bandwidth; spare the memory


def best_copy_seconds(dst: torch.Tensor, src: torch.Tensor, repeats: int, budget_s: float = 0.5, *,
                      warm_up: bool = True) -> float:
    """Best of at least `repeats` copies, repeating for up to `budget_s`.

    The first copies after an allocation can be 100x slow (page faults, in a VM also the host's),
    so one or two tries are not enough to see the bandwidth: a fresh pair of buffers is copied once
    first (`warm_up`); buffers touched already (a held probe's) need not be.
    """
    devices = {dst.device, src.device}
    if warm_up:
        dst.copy_(src)  # first touch and warm-up
    best, spent, tries = float("inf"), 0.0, 0
    while tries < repeats or (spent < budget_s and tries < 50):
        tries += 1
        for d in devices:
            synchronize(d)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        for d in devices:
            synchronize(d)
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return best


def copy_bandwidth(nbytes: int, *, src: torch.device, dst: torch.device, repeats: int = 5) -> float:
    """Bytes per second of a plain copy of about `nbytes` (capped) from `src` to `dst`."""
    n = max(1 << 20, min(nbytes, PROBE_CAP_BYTES))
    pin = src.type == "cpu" and dst.type == "cuda" or src.type == "cuda" and dst.type == "cpu"
    a = torch.empty(n, dtype=torch.uint8, device=src, pin_memory=pin and src.type == "cpu")
    a.fill_(1)
    b = torch.empty(n, dtype=torch.uint8, device=dst, pin_memory=pin and dst.type == "cpu")
    seconds = best_copy_seconds(b, a, repeats)
    if src.type == dst.type == "cpu" and torch.get_num_threads() != 1:
        # memcpy needs one thread; with more, a busy core stalls every copy at its barrier. Keep the
        # faster, so the floor is the machine's, not the thread pool's.
        with cpu_threads(1, src):
            seconds = min(seconds, best_copy_seconds(b, a, repeats))
    moved = 2 * n if src == dst else n
    del a, b
    if "cuda" in (src.type, dst.type):  # probed between steps: leave no device memory cached for the engine
        torch.cuda.empty_cache()
    return moved / seconds


PROBES = ("every_step", "start")  # run.limit_probe: when the runner measures the floors


def crosses_host_link(source: str, device_type: str) -> bool:
    """Whether the update's bytes cross the host->device link: from the offloaded host copy to a GPU."""
    return source == "host" and device_type == "cuda"


def update_floor_bytes(read_bytes: int, written_bytes: int, *, source: str, device_type: str) -> int:
    """The bytes the update's floor counts on its path.

    Same memory (a device source, or any CPU run): the copy reads the trainer's bytes and writes the
    engine's. Host source on a GPU: the link carries the host copy's own bytes, in the trainer's dtype
    (fp32: twice the engine's bf16). Every transport copies from the host views with non_blocking=True,
    and PyTorch then sends the source dtype over PCIe and converts on the device (Copy.cu,
    copy_kernel_cuda: "If non_blocking is true - type conversions are performed on the GPU"); a
    blocking copy would convert on the CPU into pageable memory instead, and stage it.
    """
    if crosses_host_link(source, device_type):
        return read_bytes
    return read_bytes + written_bytes


class Limits:
    """Bandwidths measured in the run: the floor every phase is reported against.

    `measure()` probes again: on a shared machine the bandwidth drifts with the load, and a floor
    measured in a quiet moment makes a later, loaded step look slow (or one measured under load
    makes it look faster than the floor). The runner re-measures before each step (run.limit_probe).
    """

    def __init__(self, device: torch.device, *, update_bytes: int, state_bytes: int, read_bytes: int | None = None,
                 source: str = "device"):
        self.device, self.update_bytes, self.state_bytes = device, update_bytes, state_bytes
        self.read_bytes, self.source = read_bytes, source  # the update's: the trainer's bytes, and where they are read
        self.measure()

    def measure(self) -> None:
        device, update_bytes, state_bytes = self.device, self.update_bytes, self.state_bytes
        self.device_copy = copy_bandwidth(update_bytes, src=device, dst=device)  # read + write
        if device.type == "cuda":
            host = torch.device("cpu")
            self.to_host = copy_bandwidth(state_bytes, src=device, dst=host)  # payload, one direction
            self.to_device = copy_bandwidth(state_bytes, src=host, dst=device)
        else:  # host memory both sides: a copy of N payload bytes reads N and writes N
            # probed at the state's size when it differs: small copies run at cache (or thread wake-up) speed
            same_size = min(state_bytes, PROBE_CAP_BYTES) == min(update_bytes, PROBE_CAP_BYTES)
            copy = self.device_copy if same_size else copy_bandwidth(state_bytes, src=device, dst=device)
            self.to_host = self.to_device = copy / 2

    def update_time(self, read_bytes: int, written_bytes: int, *, source: str = "device") -> float:
        """Floor of a weight update: `update_floor_bytes` over the bandwidth of its path (the pinned
        host->device copy for a host source on a GPU, the same-memory copy everywhere else)."""
        nbytes = update_floor_bytes(read_bytes, written_bytes, source=source, device_type=self.device.type)
        return nbytes / (self.to_device if crosses_host_link(source, self.device.type) else self.device_copy)

    @property
    def update_limit(self) -> float:
        """The update's floor (`update_time` of its read and written bytes) at the bandwidth last measured."""
        return self.update_time(self.read_bytes, self.update_bytes, source=self.source)

    def update_probe(self) -> "CopyProbe":
        """The update's floor re-timed on demand, beside each repeat of a benchmark (CopyProbe)."""
        return CopyProbe(self.device, update_bytes=self.update_bytes, read_bytes=self.read_bytes, source=self.source)

    def as_dict(self) -> dict[str, float]:
        return {"device_copy_gbps": self.device_copy / 1e9, "to_host_gbps": self.to_host / 1e9,
                "to_device_gbps": self.to_device / 1e9}


class CopyProbe:
    """The plain copy the update's limit is made of, held and re-timed right before every repeat.

    On a shared machine the memory bandwidth drifts with the neighbours' load (the limit measured
    once at setup varied 2x between runs here), so each repeat is compared with a copy timed next
    to it: the ratio then speaks about the update, not about the load. Same formulas as `Limits`
    (read + written bytes over the same-memory copy bandwidth; the host copy's bytes, as they cross
    the link, over the host->device bandwidth for `source=host` on a GPU); buffers allocated and
    touched once, each probe the best of `tries` copies on one CPU thread.
    """

    def __init__(self, device: torch.device, *, update_bytes: int, read_bytes: int, source: str):
        self.device = device
        host_link = crosses_host_link(source, device.type)
        n = max(1 << 20, min(update_bytes, PROBE_CAP_BYTES))
        self.src = torch.empty(n, dtype=torch.uint8, device="cpu" if host_link else device, pin_memory=host_link)
        self.src.fill_(1)
        self.dst = torch.empty(n, dtype=torch.uint8, device=device)
        self.dst.copy_(self.src)
        self.moved = n if host_link else 2 * n  # bytes per copy, counted as the bandwidth is
        self.floor_bytes = update_floor_bytes(read_bytes, update_bytes, source=source, device_type=device.type)

    def limit_time(self, tries: int = 3) -> float:
        with cpu_threads(1, self.device):  # one thread reaches memcpy speed (rlsync.sync.threads)
            best = best_copy_seconds(self.dst, self.src, tries, budget_s=0.0, warm_up=False)
        return self.floor_bytes / (self.moved / best)
