"""The collective: an all-gather's bandwidth over 2 gloo ranks (the FSDP2 update's gather, planned), the
calibration's `collective` (`measure_collective`, called by rlsync.plan.calibrate)."""

from __future__ import annotations

import time
from typing import Optional

COLLECTIVE_RANKS = 2  # as many as a 2-core machine runs side by side; the planner scales by (N-1)/N
COLLECTIVE_BYTES = 256 * 2**20  # an update-sized probe: every call size GatherFloor tries (1 to 256 MiB) fits
COLLECTIVE_SMALL_BYTES = 8 * 2**10  # gathered per latency probe: one small parameter's all-gather
COLLECTIVE_TIMEOUT_S = 120.0  # the whole measurement, the two processes' start (torch's import) included


def _collective_rank(rank: int, world: int, port: int, nbytes: int, small: int, timeout_s: float, queue) -> None:
    """One rank of the collective probe (a spawned process), over a gloo group on loopback: the run's own
    all-gather floor (GatherFloor) at `nbytes` (its bandwidth, at the call size it found fastest) and at
    `small` bytes (one call's latency)."""
    import datetime

    import torch
    import torch.distributed as dist

    from rlsync.measure.floors import GatherFloor
    from rlsync.update.broadcast import HOST

    torch.set_num_threads(1)  # two ranks on two cores: one each, as a data-parallel CPU launch runs them
    try:
        store = dist.TCPStore(HOST, port, world_size=world, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
        )
        cpu = torch.device("cpu")
        big = GatherFloor(nbytes, dtype=torch.float32, device=cpu, rounds=5)
        latency = GatherFloor(small, dtype=torch.float32, device=cpu, rounds=20)
        dist.destroy_process_group()
        if rank == 0:
            found = {"gathered_per_second": big.per_second, "probe": big.how, "latency_s": latency.time(small)}
            queue.put({**found, "call_bytes": getattr(big, "call_bytes", None)})
    except Exception as err:  # noqa: BLE001 - the parent names it in one line
        queue.put({"error": f"rank {rank}: {type(err).__name__}: {err}"})


def measure_collective(
    *, ranks: int = COLLECTIVE_RANKS, nbytes: int = COLLECTIVE_BYTES, timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> dict:
    """An all-gather's bus bandwidth and per-call latency on this machine: `ranks` spawned processes in a
    gloo group over loopback (a TCP store this process hosts on a free port), each running the run's
    all-gather floor (rlsync.measure.floors.GatherFloor). Bus bandwidth = what each rank receives, (N-1)/N
    of the gathered bytes, per second: the figure the planner divides (N-1)/N of the update's bytes by
    (cost.gather_seconds). Raises RuntimeError past `timeout_s` or when a rank fails."""
    import datetime
    import queue as _queue

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from rlsync.update.broadcast import HOST

    started = time.perf_counter()
    store = dist.TCPStore(HOST, 0, world_size=ranks + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
    ctx = mp.get_context("spawn")  # a fresh interpreter per rank: no fork of this process's threads
    results = ctx.Queue()
    args = (ranks, store.port, nbytes, COLLECTIVE_SMALL_BYTES, timeout_s, results)
    procs = [ctx.Process(target=_collective_rank, args=(r, *args), daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    deadline, found = started + timeout_s, None
    try:
        while found is None:  # rank 0's result, a rank's error, or a rank that died without a word
            try:
                found = results.get(timeout=1.0)
            except _queue.Empty:
                dead = [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(procs) if p.exitcode]
                if dead or time.perf_counter() > deadline:
                    found = {"error": dead[0] if dead else f"no result within {timeout_s:g} s"}
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():  # a rank stuck in a collective its peer left: ended, not waited on
                p.kill()
                p.join()
        del store
    if "error" in found:
        raise RuntimeError(f"the all-gather probe over {ranks} gloo ranks failed: {found['error']}")
    gathered = found["gathered_per_second"]
    return {
        "bus_gbps": gathered * (ranks - 1) / ranks / 1e9,  # each rank receives (N-1)/N of the gathered bytes
        "gathered_gbps": gathered / 1e9,  # as a run's limits.gather_gbps counts it
        "latency_s": found["latency_s"],  # one small all-gather call, the best of 20
        "call_bytes": found["call_bytes"],  # gathered per call at the fastest size (the update's gather calls so)
        "ranks": ranks,
        "backend": "gloo",
        "device": "cpu",
        "probe": found["probe"],
        "measured": True,
        "date": _now(),
        "load_average": _load(),
        "torch": torch.__version__,
        "seconds": time.perf_counter() - started,
    }


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _load() -> Optional[list]:
    import os

    try:
        return list(os.getloadavg())
    except OSError:
        return None
