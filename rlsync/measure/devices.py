"""Which device a process works on, and what it reports about that device's memory.

CUDA keeps a *current device* per thread, and every call that names no device (a `synchronize()`,
an event, a stream, `empty_cache()`, the caching allocator's context) uses it: device 0 in a fresh
process. A process that works on `cuda:N`, N > 0, must make N current before its first CUDA call,
as vLLM's workers and torch.distributed's NCCL ranks do. These functions decide that without CUDA,
so the decision is tested on a CPU; only `select_device` touches the driver.
"""

from __future__ import annotations

import torch

GB = 1e9


def resolve_device(name: str) -> torch.device:
    """run.device: "auto" (CUDA when there is one, else the CPU) or a device name as torch spells it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cuda_index_to_select(device: torch.device) -> int | None:
    """The CUDA device index to make current for work on `device`; None: nothing to select.

    None for a non-CUDA device, and for a bare "cuda" (no index): that names the current device,
    which a caller that means another one must spell (`explicit_device` does, for what crosses to
    another process).
    """
    if device.type != "cuda" or device.index is None:
        return None
    return device.index


def select_device(device: torch.device) -> None:
    """Make `device` this process's current CUDA device (before any CUDA work); nothing off CUDA."""
    index = cuda_index_to_select(device)
    if index is not None:
        torch.cuda.set_device(index)


def explicit_device(device: torch.device) -> torch.device:
    """`device` with its index spelled out: a bare "cuda" means this process's current device, which
    another process (the engine's, whose current device starts at 0) would read differently."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_memory_metric_names(phase: str) -> tuple[str, str]:
    """(this process's reserved memory, the whole device's used memory) after `phase`, in GB."""
    return f"perf/device_mem_after_{phase}_gb", f"perf/device_mem_used_after_{phase}_gb"


def device_memory_metrics(device: torch.device, phase: str) -> dict[str, float]:
    """Device memory after `phase`, on CUDA; {} elsewhere (a host has no such budget to share).

    `perf/device_mem_after_<phase>_gb`: what this process's caching allocator holds from the driver
    (tensors + cache; reserved, not allocated: what another process cannot have).
    `perf/device_mem_used_after_<phase>_gb`: the whole device's used memory (total - free, from the
    driver), so an engine in its own process, its CUDA context and any other tenant are counted too.
    """
    if device.type != "cuda":
        return {}
    reserved_name, used_name = device_memory_metric_names(phase)
    free, total = torch.cuda.mem_get_info(device)
    return {reserved_name: torch.cuda.memory_reserved(device) / GB, used_name: (total - free) / GB}


# The run's device peaks (bytes), kept across the resets that per-update tracking makes: torch has
# one set of peak counters per device, and `reset_peak_memory_stats` clears all of them at once.
_run_peaks: dict[int, dict[str, int]] = {}


def _peak_key(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def fold_run_peak(device: torch.device) -> None:
    """Fold torch's peak counters into the run's peak; call before anything resets them."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return
    peaks = _run_peaks.setdefault(_peak_key(device), {"reserved": 0, "allocated": 0})
    peaks["reserved"] = max(peaks["reserved"], torch.cuda.max_memory_reserved(device))
    peaks["allocated"] = max(peaks["allocated"], torch.cuda.max_memory_allocated(device))


def run_device_peaks(device: torch.device) -> dict[str, int]:
    """{"reserved", "allocated"}: this process's peak on `device` since `reset_run_peaks` ({} off CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return {}
    fold_run_peak(device)
    return dict(_run_peaks[_peak_key(device)])


def reset_run_peaks(device: torch.device) -> None:
    """Start a new run's peak (a multirun's jobs share the process)."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return
    _run_peaks.pop(_peak_key(device), None)
    torch.cuda.reset_peak_memory_stats(device)


def sampler(device: torch.device, seed: int) -> torch.Generator:
    """The rollout's random stream: a generator on the engine's device, so tokens are drawn where the
    probabilities are (a CPU generator would copy [batch, vocab] to the host every token)."""
    return torch.Generator(device=device).manual_seed(seed)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst <- src`, cast to `dst`'s dtype, without blocking where the devices allow.

    A host source bound for a CUDA destination of another dtype is sent in its own dtype and cast on
    the device: torch's `copy_` would cast on the CPU first, into a pageable temporary, and send that
    synchronously (aten/src/ATen/native/cuda/Copy.cu: "Type conversions are performed on the CPU for
    CPU-GPU copies"). The source's bytes cross the link, as rlsync.measure.floors counts them for source=host;
    the device holds the sent tensor until the cast is done (the caching allocator frees it after).
    """
    if dst.device.type == "cuda" and src.device.type == "cpu" and src.dtype != dst.dtype:
        src = src.to(dst.device, non_blocking=True)
    dst.copy_(src, non_blocking=True)
