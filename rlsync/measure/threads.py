"""Torch CPU threads: the update's copies, the run's phases, and how busy the machine is.

A copy is memory-bound, and each extra thread adds an OpenMP barrier per tensor that costs
milliseconds when the cores are busy elsewhere (experiments/transports/README.md). So the update
copies on `update.copy_threads` threads in each process and gives the rest of the program its
threads back.
"""

from __future__ import annotations

import os
import time
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


# ----------------------------------------------------------------------------------------------
# The run's threads, and how busy the machine is
# ----------------------------------------------------------------------------------------------
# On a busy CPU torch's default (one thread per core) oversubscribes: every parallel region waits for
# its slowest thread, which the other processes keep off a core. Measured on a 2-core machine beside a
# 2-thread matmul (experiments/cpu_threads/README.md): the tiny default step took 3.5 s at 2 threads and
# 1.1 s at 1; on the quiet machine 0.45 s at 2 and 0.6 s at 1. So the run takes the cores free at start.


def machine_threads() -> int:
    """The CPU threads this process may run on (its affinity: a container's or taskset's limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def thread_candidates() -> list[int]:
    """The CPU thread counts worth trying for a copy: one, torch's count, every core the process may use
    (with N data-parallel ranks on this machine, its 1/N share: a rank copying on every core oversubscribes
    them, and the other rank's collective threads wait: Qwen3-0.6B's update over 2 ranks took 1.53 s with
    the copy on 2 threads, 1.04 s on 1)."""
    share = max(1, machine_threads() // processes_here())
    return sorted({1, min(torch.get_num_threads(), share), share})


def _busy_seconds() -> float | None:
    """CPU seconds every process of the machine has spent busy since boot (/proc/stat), None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuLoad:
    """How many cores the machine's *other* processes keep busy: since `start()`, or over a short window."""

    def __init__(self):
        self.wall = self.busy = self.own = None

    def start(self) -> CpuLoad:
        self.wall, self.busy, self.own = time.monotonic(), _busy_seconds(), _own_seconds()
        return self

    def others(self) -> float | None:
        """Average busy cores of other processes since start() (None where /proc/stat is not there)."""
        busy = _busy_seconds()
        if busy is None or self.busy is None:
            return None
        wall = time.monotonic() - self.wall
        if wall <= 0:
            return None
        return max(0.0, ((busy - self.busy) - (_own_seconds() - self.own)) / wall)

    @classmethod
    def sample(cls, seconds: float = 0.3) -> float | None:
        """Busy cores of other processes over the next `seconds` (this process sleeps meanwhile)."""
        load = cls().start()
        time.sleep(seconds)
        return load.others()


def choose_threads(setting: int | None, device: torch.device) -> tuple[int, str, float | None]:
    """(torch CPU threads for the run's phases, why, busy cores of other processes sampled at start).
    `setting`: run.cpu_threads (None: auto)."""
    if setting:
        return setting, "run.cpu_threads", None
    if device.type != "cpu":  # the phases run on the device: torch's default for the host-side work
        return torch.get_num_threads(), "torch's default (the phases run on the device)", None
    cores = min(machine_threads(), torch.get_num_threads())  # OMP_NUM_THREADS, if set, is an upper bound
    others = CpuLoad.sample()
    if others is None:
        return cores, f"{cores} cores (the machine's load is unknown here)", None
    busy = min(cores - 1, round(others))
    return cores - busy, f"{cores} cores, {others:.1f} kept busy by other processes at start", others


QUIET_ENV = "RLSYNC_NO_LOAD_WARNING"  # =1: the machine is taken as quiet (the test suite: its two workers load it)


def assumed_quiet() -> bool:
    """Whether the busy-machine line and the busy signs of the trust check are off (QUIET_ENV=1): the test
    suite sets it so that a run's output does not depend on what the other worker is doing."""
    return os.environ.get(QUIET_ENV) == "1"


def load_warning(others: float | None, cores: int, when: str) -> str | None:
    """A line when other processes kept at least one core (or half the machine) busy: times will swing."""
    if others is None or others < max(1.0, 0.5 * cores) - 0.25:
        return None
    return (
        f"the machine was busy {when}: other processes kept {others:.1f} of its {cores} cores busy, so these "
        f"times may be noise (rerun on a quiet machine)"
    )


def processes_here() -> int:
    """The run's processes on this machine: torchrun's LOCAL_WORLD_SIZE (data parallel), else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    except ValueError:
        return 1


class RunCpu:
    """The run's (or a benchmark's: `what`) torch CPU threads, chosen once before any model is built, and
    the machine's load around it: at start, and averaged over the run (summary.json `cpu`)."""

    def __init__(self, setting: int | None, device: torch.device, *, what: str = "run"):
        self.cores, self.what = machine_threads(), what
        ranks = processes_here()
        usable = min(self.cores, torch.get_num_threads())  # before the run's count is set
        if ranks > 1 and not setting and device.type == "cpu":  # the ranks start together: split the cores
            self.threads = max(1, usable // ranks)
            self.why, self.others_at_start = f"{self.cores} cores shared by {ranks} ranks", None
        else:
            self.threads, self.why, self.others_at_start = choose_threads(setting, device)
        # auto on a busy machine: the cores the run left to the other processes
        self.kept_free = usable - self.threads if not setting and self.others_at_start is not None else 0
        self.load = CpuLoad().start()

    @contextmanager
    def applied(self, device: torch.device):
        """Within the block, torch runs on the run's threads, and update.copy_threads=null takes no more than
        `copy_cap()` (`run_copy_cap`: the update's auto knob reads it, in a run or any benchmark target)."""
        with cpu_threads(self.threads, device):
            _COPY_CAPS.append(self.copy_cap())
            try:
                yield
            finally:
                _COPY_CAPS.pop()

    def copy_cap(self) -> tuple[int, str] | None:
        """(the most threads the update's copy may take, why) where the run kept cores free for other
        processes, else None. A copy on more threads than the run has waits at an OpenMP barrier per
        tensor for cores the others hold: on a busy 2-core machine a 2-thread copy ran 100x slower than a
        1-thread one (issue 42), and the copy-threads probe, a millisecond long, did not see it."""
        if self.kept_free <= 0:
            return None
        return self.threads, (
            f"the machine is busy (other processes kept {self.others_at_start:.1f} of its {self.cores} cores "
            f"busy at start), so the {self.what} kept {self.kept_free} free"
        )

    def start_warning(self) -> str | None:
        """The line printed before the first step when the machine is busy (none with RLSYNC_NO_LOAD_WARNING=1,
        which the test suite sets: its two workers keep each other's machine busy)."""
        if assumed_quiet():
            return None
        return load_warning(self.others_at_start, self.cores, "at start")

    def as_dict(self) -> dict:
        """What summary.json records; the load over the run is measured now (at the summary)."""
        during = self.load.others()
        return {
            "threads": self.threads,
            "why": self.why,
            "cores": self.cores,
            "others_busy_cores_at_start": self.others_at_start,
            "others_busy_cores_during_run": during,
            "warning": load_warning(during, self.cores, f"during the {self.what}"),
        }


_COPY_CAPS: list[tuple[int, str] | None] = []  # the caps of the RunCpu.applied() blocks this process is in


def run_copy_cap() -> tuple[int, str] | None:
    """The innermost `RunCpu.applied()` block's `copy_cap()`: (most threads, why) or None (no cap, or no run)."""
    return _COPY_CAPS[-1] if _COPY_CAPS else None
