"""The memory record of summary.json: the estimate beside the peaks the run measured."""

from __future__ import annotations

import torch

from rlsync.measure.devices import run_device_peaks
from rlsync.measure.memory import (
    peak_rss_bytes,
)


def memory_record(
    fit: dict, device: torch.device, *, engine_peak: int | None = None, rank_peak: int | None = None
) -> dict:
    """The estimate beside the measured peaks, for summary.json: how far off the estimate was.
    `engine_peak`: the engine process's own peak resident set, as its close answered; `rank_peak`: data
    parallel's largest rank's (perf/host_peak_rss_gb)."""
    estimate = fit["estimate"]
    peak = peak_rss_bytes()
    measured = {"peak_rss_bytes": peak}
    if rank_peak:
        measured["largest_rank_peak_rss_bytes"] = rank_peak
    if estimate.engine_process and engine_peak:
        measured["engine_peak_rss_bytes"] = engine_peak
    if device_peaks := run_device_peaks(device):  # the whole run's, not the last update's
        measured["device_peak_bytes"] = device_peaks["reserved"]
        measured["device_peak_allocated_bytes"] = device_peaks["allocated"]
    return {
        "estimate": estimate.as_dict(),
        "available": fit["available"],
        "measured": measured,
        "process_estimate_over_peak_rss": estimate.process_bytes / peak if peak else None,
    }
