"""What this process uses and what the machine has left: resident sets, host and device memory available.

Readings only; rlsync.check estimates what a run will need and compares the two.
"""

from __future__ import annotations

import os
import resource
import sys

import torch


def rss_bytes() -> int:
    """This process's resident set now (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak resident set since start or reset_peak_rss() (/proc/self/status VmHWM).

    Not getrusage's ru_maxrss: Linux carries it across exec, so a process started by a large one
    (an engine process, a sweep's job) would report its parent's peak; nor can it be reset."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def reset_peak_rss() -> None:
    """Start peak_rss_bytes() again from the resident set now (each job of a multirun measures its own)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or a kernel before 4.0: the peak since the process started
        pass


def host_available_bytes() -> int | None:
    """MemAvailable (free plus reclaimable), psutil's figure when installed, else /proc/meminfo."""
    try:
        import psutil  # optional: not a dependency of rlsync

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_available_bytes(device) -> int | None:
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)
