"""The update's `null` (auto) knobs, resolved in one place, each with the reason it took its value.

- `update.flat_engine_weights=null`: `rlsync.config.derived.flat_engine_weights_choice` (config alone: the
  engine, transport, strategy and rollout.release_level decide it; the memory estimate reads it too).
- `update.copy_threads=null`: the CPU thread count that copies the update's own tensors fastest
  (`fastest_threads`): a sample of them (`sample`, up to SAMPLE_BYTES) copied and cast as the update
  packs them, on one thread, torch's threads and every core, taking turns. Not the copy probe's one
  large copy (`rlsync.measure.floors`): each of the update's many copies waits at an OpenMP barrier, free on
  idle cores and milliseconds when another process holds one (experiments/transports/README.md). A
  win of fewer threads is timed again before it is believed, and more threads are taken only on a
  margin wider than the probe's spread (`fastest_of`); on a machine so busy that the run kept cores
  free, the copy takes no more threads than the run has (`rlsync.measure.threads.run_copy_cap`).

The entry points (the runner, the benchmark) call `resolve_update` once the floors are measured and
before the engine opens, so every process of the update (ipc and broadcast receivers included) gets
the resolved numbers; summary.json shows them beside the reason (`setup`).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from rlsync.config.derived import flat_engine_weights_choice
from rlsync.config.schema import ModelConfig, RolloutConfig, UpdateConfig
from rlsync.measure.devices import copy_into
from rlsync.measure.threads import cpu_threads, run_copy_cap, thread_candidates
from rlsync.update.buckets import Bucket

SAMPLE_BYTES = (
    128 << 20
)  # engine bytes of the update's tensors the thread timing copies (a sample across the plan: sample())
ROUNDS = 3  # each candidate's best of this many, taking turns


def sample(buckets: list[Bucket], cap_bytes: int = SAMPLE_BYTES) -> list:
    """The update's tensors the thread timing copies: every k-th of the plan (k = total bytes / cap),
    from the middle of the first stride, leaving out any tensor above half the cap. So the sample has
    the update's mix of many small tensors and few large ones (each copy pays one thread barrier),
    not only its first tensor (often the embedding: one large copy, what the copy probe times already)."""
    metas = [s.meta for b in buckets for s in b.slots]
    total = sum(m.nbytes for m in metas)
    stride = max(1, -(-total // cap_bytes))
    picked, nbytes = [], 0
    for meta in metas[stride // 2 :: stride]:
        if meta.nbytes > cap_bytes // 2 or nbytes + meta.nbytes > cap_bytes:
            continue
        picked.append(meta)
        nbytes += meta.nbytes
    return picked or metas[:1]


@torch.no_grad()
def fastest_threads(
    weights: dict[str, torch.Tensor],
    buckets: list[Bucket],
    device: torch.device,
    rounds: int = ROUNDS,
    *,
    max_threads: int | None = None,
) -> tuple[int, str]:
    """(thread count, how it was found): a sample of the update's tensors copied as the update copies them
    (trainer tensor -> engine dtype, one copy each, into one scratch buffer), on each candidate thread
    count in turn; 0 where the copy is not a CPU copy (threads do not drive it). `max_threads`: no
    candidate above it (the run's own count on a busy machine: `resolve_for_run`)."""
    if device.type != "cpu":
        return 0, "not a CPU copy"
    candidates = [n for n in thread_candidates() if max_threads is None or n <= max_threads] or [1]
    if len(candidates) == 1:  # nothing to choose between: not timed
        return candidates[0], f"{threads_phrase(candidates[0])}, not timed: no other count allowed"
    names, numel = [], 0
    for meta in sample(buckets):
        names.append(meta.name)
        numel += meta.numel
    scratch = torch.empty(numel, dtype=buckets[0].dtype, device=device)
    views, offset = [], 0
    for name in names:
        views.append((scratch[offset : offset + weights[name].numel()].view(weights[name].shape), weights[name]))
        offset += weights[name].numel()
    for dst, src in views:  # first touch, untimed
        copy_into(dst, src)

    def one_round() -> dict[int, float]:
        times = {}
        for n in candidates:
            with cpu_threads(n, device):
                start = time.perf_counter()
                for dst, src in views:
                    copy_into(dst, src)
                times[n] = time.perf_counter() - start
        return times

    return fastest_of(
        one_round, rounds=rounds, sample=f"{len(names)} of the update's tensors ({scratch.nbytes / 2**20:.0f} MiB)"
    )


CONFIRM = 2  # a win of fewer threads than the most is timed again this many times before it is believed,
CONFIRM_PAUSE_S = 0.5  # this far apart,
CONFIRM_ABOVE_S = 0.01  # where the sample takes longer than this (below, SPREAD_FLOOR_S keeps a small win out)
# The least spread a probe is credited with: Linux gives a busy core's processes slices of milliseconds, so
# a probe shorter than that may have run entirely while a neighbour was off its core. The quick start's
# 0.5 ms probe chose 2 threads on a busy 2-core machine ("1 thread 0.7 ms, 2 threads 0.5 ms") and its
# update then ran 100x slower than on 1 (issue 42): a gain under this is not one to bet the run on.
SPREAD_FLOOR_S = 0.001


def fastest_of(one_round, *, rounds: int, sleep=time.sleep, sample: str = "") -> tuple[int, str]:
    """(the thread count chosen over `rounds` calls of `one_round()` -> {threads: seconds}, why: the
    decision, then in brackets `sample` (what was copied), the best times and the spread).

    Fewer threads win while another process holds a core, which may last only a moment (a passing
    disturbance once halved a whole run's copy speed: experiments/transports/README.md). So a
    fewer-threads win is timed again, up to CONFIRM times, CONFIRM_PAUSE_S apart, each candidate
    keeping its best: a passing disturbance loses, a lasting one (a busy core) still wins.

    More threads cost an OpenMP barrier per tensor, which a busy machine makes milliseconds each
    (and a short probe may not see). So the choice is the fewest threads whose best is within the
    probe's spread of the fastest: the widest range (max - min) of any candidate's times in the last
    timing, and at least SPREAD_FLOOR_S. More threads win only by a margin wider than that."""
    best: dict[int, float] = {}
    timings = 0
    while True:
        timings += 1
        last: dict[int, list[float]] = {}
        for _ in range(rounds):
            for n, t in one_round().items():
                best[n] = min(best.get(n, float("inf")), t)
                last.setdefault(n, []).append(t)
        winner = min(sorted(best), key=best.__getitem__)
        if winner == max(best) or best[winner] < CONFIRM_ABOVE_S or timings > CONFIRM:
            break
        sleep(CONFIRM_PAUSE_S)
    measured = max(max(ts) - min(ts) for ts in last.values())
    spread = max(measured, SPREAD_FLOOR_S)
    chosen = min(n for n in sorted(best) if best[n] - best[winner] <= spread)
    timed = ", ".join(f"{threads_phrase(n)} {t * 1e3:.1f} ms" for n, t in sorted(best.items()))
    again = f" over {timings} timings {CONFIRM_PAUSE_S:g} s apart" if timings > 1 else ""
    margin = f"spread {measured * 1e3:.1f} ms, counted as at least {SPREAD_FLOOR_S * 1e3:g} ms"
    how = f"({sample + ', ' if sample else ''}best of {rounds * timings}{again}: {timed}; {margin})"
    if chosen != winner:
        return chosen, f"within the probe's spread: {threads_phrase(chosen)}, the safe choice {how}"
    wider = ", by more than the probe's spread" if chosen > min(best) else ""
    return chosen, f"fastest on {threads_phrase(chosen)}{wider} {how}"


def threads_phrase(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def copy_threads_choice(
    update: UpdateConfig, *, probe_threads: int, probe_how: str = "", cap: tuple[int, str] | None = None
) -> tuple[int, str]:
    """update.copy_threads as the update runs it, and why. `probe_threads`: the thread count `fastest_threads`
    chose (0: not a CPU copy, where torch's default stands); `cap`: (most threads, why): the run's own count on
    a machine so busy that it kept cores free (`rlsync.measure.threads.run_copy_cap`)."""
    if update.copy_threads is not None:
        return update.copy_threads, "set explicitly" + (" (0: torch's default)" if update.copy_threads == 0 else "")
    if probe_threads <= 0:
        return 0, "auto: torch's default (the update's copy is not a CPU copy)"
    capped = f"; no more than the run's {threads_phrase(cap[0])}: {cap[1]}" if cap else ""
    return probe_threads, f"auto: {probe_how}{capped}"


def resolve_update(
    update: UpdateConfig,
    rollout: RolloutConfig,
    *,
    probe_threads: int,
    probe_how: str = "",
    model: ModelConfig | None = None,
    cap: tuple[int, str] | None = None,
) -> tuple[UpdateConfig, dict]:
    """(the update config with every null resolved, {key: value, key_why: reason} for the summary)."""
    flat, flat_why = flat_engine_weights_choice(update, rollout, model)
    threads, threads_why = copy_threads_choice(update, probe_threads=probe_threads, probe_how=probe_how, cap=cap)
    resolved = dataclasses.replace(update, flat_engine_weights=flat, copy_threads=threads)
    return resolved, {
        "flat_engine_weights": flat,
        "flat_engine_weights_why": flat_why,
        "copy_threads": threads,
        "copy_threads_why": threads_why,
    }


def resolve_for_run(
    update: UpdateConfig,
    rollout: RolloutConfig,
    *,
    weights: dict[str, torch.Tensor],
    buckets: list[Bucket],
    device: torch.device,
    model: ModelConfig | None = None,
) -> tuple[UpdateConfig, dict]:
    """`resolve_update` at an entry point: the thread count timed on the update's own tensors, only
    when update.copy_threads is null (auto), never above the run's own count where a busy machine made
    it keep cores free (`rlsync.measure.threads.run_copy_cap`)."""
    cap = run_copy_cap() if device.type == "cpu" else None
    threads, how = (0, "")
    if update.copy_threads is None:
        threads, how = fastest_threads(weights, buckets, device, max_threads=cap[0] if cap else None)
    return resolve_update(update, rollout, probe_threads=threads, probe_how=how, model=model, cap=cap)


def resolved_setup(resolved: dict | None, update: UpdateConfig) -> dict:
    """summary.json's `setup` entries for the auto knobs: the resolved values and reasons, or (a run
    that ended before they were resolved) the configured values."""
    if resolved:
        return dict(resolved)
    return {"flat_engine_weights": update.flat_engine_weights, "copy_threads": update.copy_threads}


def copy_threads_used(resolved: dict | None, device: torch.device, cpu: dict | None) -> int | None:
    """summary.json's `setup.copy_threads_used`: the CPU threads the update's copies ran on, update.copy_threads
    as resolved or, with 0 (torch's default), the run's own count (`cpu`: RunCpu.as_dict()); None where the
    copy is not a CPU copy or the knobs were never resolved."""
    if device.type != "cpu" or not resolved:
        return None
    return resolved.get("copy_threads") or (cpu or {}).get("threads") or torch.get_num_threads()
