"""The update's `null` (auto) knobs, resolved in one place, each with the reason it took its value.

- `update.flat_engine_weights=null`: `rlsync.config.flat_engine_weights_choice` (config alone: the
  engine, transport, strategy and rollout.release_weights decide it; the memory estimate reads it too).
- `update.copy_threads=null`: the CPU thread count of the fastest update copy the run's own probe
  timed (`rlsync.limits`: one thread, torch's threads and every core, on the update's dtypes). A copy
  on one idle core reaches memcpy speed; a converting fp32->bf16 copy, or an engine whose load does
  more than copy (vLLM re-packs its matrices), wants more threads when the cores are free.

The entry points (the runner, the benchmark) call `resolve_update` once the floors are measured and
before the engine opens, so every process of the update (ipc and broadcast receivers included) gets
the resolved numbers; summary.json shows them beside the reason (`setup`).
"""

from __future__ import annotations

import dataclasses

from rlsync.config import RolloutConfig, UpdateConfig, flat_engine_weights_choice


def copy_threads_choice(update: UpdateConfig, *, probe_threads: int, probe_how: str = "") -> tuple[int, str]:
    """update.copy_threads as the update runs it, and why. `probe_threads`: the thread count of the
    fastest update copy (0: not a CPU copy, where torch's default stands)."""
    if update.copy_threads is not None:
        return update.copy_threads, "set explicitly" + (" (0: torch's default)" if update.copy_threads == 0 else "")
    if probe_threads <= 0:
        return 0, "auto: torch's default (the update's copy is not a CPU copy)"
    return probe_threads, f"auto: the fastest update copy the probe timed ({probe_how or f'{probe_threads} threads'})"


def resolve_update(update: UpdateConfig, rollout: RolloutConfig, *, probe_threads: int,
                   probe_how: str = "") -> tuple[UpdateConfig, dict]:
    """(the update config with every null resolved, {key: value, key_why: reason} for the summary)."""
    flat, flat_why = flat_engine_weights_choice(update, rollout)
    threads, threads_why = copy_threads_choice(update, probe_threads=probe_threads, probe_how=probe_how)
    resolved = dataclasses.replace(update, flat_engine_weights=flat, copy_threads=threads)
    return resolved, {"flat_engine_weights": flat, "flat_engine_weights_why": flat_why,
                      "copy_threads": threads, "copy_threads_why": threads_why}


def resolved_setup(resolved: dict | None, update: UpdateConfig) -> dict:
    """summary.json's `setup` entries for the auto knobs: the resolved values and reasons, or (a run
    that ended before they were resolved) the configured values."""
    if resolved:
        return dict(resolved)
    return {"flat_engine_weights": update.flat_engine_weights, "copy_threads": update.copy_threads}
