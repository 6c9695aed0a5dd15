"""The update's `null` (auto) knobs, resolved in one place, each with the reason it took its value.

- `update.flat_engine_weights=null`: `rlsync.config.derived.flat_engine_weights_choice` (config alone: the
  engine, transport, strategy and rollout.sleep_level decide it; the memory estimate reads it too).
- `update.copy_threads=null`: the CPU thread count that copies the update's own tensors fastest
  (`fastest_threads`): a sample of them (`sample`, up to SAMPLE_BYTES) copied and cast as the update
  packs them, on one thread, torch's threads and every core, taking turns. Not the copy probe's one
  large copy (`rlsync.measure.limits`): each of the update's many copies waits at an OpenMP barrier, free on
  idle cores and milliseconds when another process holds one (experiments/transports/README.md). A
  win of fewer threads is timed again before it is believed (`fastest_of`).

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
from rlsync.measure.threads import cpu_threads, thread_candidates
from rlsync.sync.buckets import Bucket

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
    weights: dict[str, torch.Tensor], buckets: list[Bucket], device: torch.device, rounds: int = ROUNDS
) -> tuple[int, str]:
    """(thread count, how it was found): a sample of the update's tensors copied as the update copies them
    (trainer tensor -> engine dtype, one copy each, into one scratch buffer), on each candidate thread
    count in turn; 0 where the copy is not a CPU copy (threads do not drive it)."""
    if device.type != "cpu":
        return 0, "not a CPU copy"
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

    candidates = thread_candidates()

    def one_round() -> dict[int, float]:
        times = {}
        for n in candidates:
            with cpu_threads(n, device):
                start = time.perf_counter()
                for dst, src in views:
                    copy_into(dst, src)
                times[n] = time.perf_counter() - start
        return times

    winner, how = fastest_of(one_round, rounds=rounds)
    return winner, f"{len(names)} of the update's tensors ({scratch.nbytes / 2**20:.0f} MiB), {how}"


CONFIRM = 2  # a win of fewer threads than the most is timed again this many times before it is believed,
CONFIRM_PAUSE_S = 0.5  # this far apart,
CONFIRM_ABOVE_S = 0.01  # where the sample takes longer than this (below, either choice costs little)


def fastest_of(one_round, *, rounds: int, sleep=time.sleep) -> tuple[int, str]:
    """(the candidate with the best time over `rounds` calls of `one_round()` -> {threads: seconds},
    how it was found). The fewest threads win among equals.

    Fewer threads win while another process holds a core, which may last only a moment (a passing
    disturbance once halved a whole run's copy speed: experiments/transports/README.md). So a
    fewer-threads win is timed again, up to CONFIRM times, CONFIRM_PAUSE_S apart, each candidate
    keeping its best: a passing disturbance loses, a lasting one (a busy core) still wins."""
    best: dict[int, float] = {}
    timings = 0
    while True:
        timings += 1
        for _ in range(rounds):
            for n, t in one_round().items():
                best[n] = min(best.get(n, float("inf")), t)
        winner = min(sorted(best), key=best.__getitem__)
        if winner == max(best) or best[winner] < CONFIRM_ABOVE_S or timings > CONFIRM:
            break
        sleep(CONFIRM_PAUSE_S)
    timed = ", ".join(f"{n} thread{'s' if n > 1 else ''} {t * 1e3:.1f} ms" for n, t in sorted(best.items()))
    again = f" over {timings} timings {CONFIRM_PAUSE_S:g} s apart" if timings > 1 else ""
    return winner, f"best of {rounds * timings}{again}: {timed}"


def copy_threads_choice(update: UpdateConfig, *, probe_threads: int, probe_how: str = "") -> tuple[int, str]:
    """update.copy_threads as the update runs it, and why. `probe_threads`: the thread count of the
    fastest update copy (0: not a CPU copy, where torch's default stands)."""
    if update.copy_threads is not None:
        return update.copy_threads, "set explicitly" + (" (0: torch's default)" if update.copy_threads == 0 else "")
    if probe_threads <= 0:
        return 0, "auto: torch's default (the update's copy is not a CPU copy)"
    return probe_threads, f"auto: fastest on {probe_threads} thread{'s' if probe_threads > 1 else ''} ({probe_how})"


def resolve_update(
    update: UpdateConfig,
    rollout: RolloutConfig,
    *,
    probe_threads: int,
    probe_how: str = "",
    model: ModelConfig | None = None,
) -> tuple[UpdateConfig, dict]:
    """(the update config with every null resolved, {key: value, key_why: reason} for the summary)."""
    flat, flat_why = flat_engine_weights_choice(update, rollout, model)
    threads, threads_why = copy_threads_choice(update, probe_threads=probe_threads, probe_how=probe_how)
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
    when update.copy_threads is null (auto)."""
    threads, how = fastest_threads(weights, buckets, device) if update.copy_threads is None else (0, "")
    return resolve_update(update, rollout, probe_threads=threads, probe_how=how, model=model)


def resolved_setup(resolved: dict | None, update: UpdateConfig) -> dict:
    """summary.json's `setup` entries for the auto knobs: the resolved values and reasons, or (a run
    that ended before they were resolved) the configured values."""
    if resolved:
        return dict(resolved)
    return {"flat_engine_weights": update.flat_engine_weights, "copy_threads": update.copy_threads}
