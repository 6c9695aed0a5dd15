"""Data parallel's part of the plan: the fsdp2 update's gather from the shards and the memory per rank.

With data-parallel ranks (`plan.ranks`) the plan adds, under trainer.parallel=fsdp2, the update's gather from
the shards beside the copy (bytes x (N-1)/N over the calibration's all-gather bus bandwidth, `gather_plan`),
and the memory per rank (`per_rank_memory`: the run's memory check per rank), from which DOES NOT FIT is then
judged.
"""

from __future__ import annotations

from typing import Optional

from rlsync.check.estimate import Ranks, rank_estimate
from rlsync.config.schema import Config
from rlsync.plan import cost
from rlsync.trainer.parallel import parallel_class
from rlsync.update.gather import GATHER_MODES


def collective_of(calibration: Optional[dict], collective_gbps: Optional[float]) -> Optional[dict]:
    """The all-gather's bus bandwidth (GB/s each rank receives) and call latency the fsdp2 gather is predicted
    at, with where they came from: plan.collective_gbps, else the calibration's probe (plan.calibrate=true) or
    a profile's published NVLink figure; None where there is none."""
    if collective_gbps:
        return {"bus_gbps": collective_gbps, "latency_s": None, "measured": None, "source": "plan.collective_gbps"}
    found = (calibration or {}).get("collective")
    if not found:
        return None
    if not found.get("measured"):
        return {**found, "source": f"published: {found.get('source', 'a profile')}"}
    load = found.get("load_average")
    whose = (
        "the reference calibration's (another machine's)"
        if (calibration or {}).get("reference")
        else "the calibration's"
    )
    return {
        **found,
        "source": f"{whose}, measured {found.get('date', '?')}: {found.get('probe', 'an all-gather')}"
        + (f", load {load[0]:.2f}" if load else ""),
    }


def gather_plan(
    p,  # the plan's rlsync.plan.planner.Planner (which imports this module)
    ranks: int,
    collective: Optional[dict],
    table: list[dict],
    copy: Optional[dict],
) -> dict:
    """plan.json's `gather`: under trainer.parallel=fsdp2 over N > 1 ranks the update first gathers each
    parameter from its shards, every rank receiving (N-1)/N of its bytes in the trainer's dtype; predicted at
    the collective's floor (cost.gather_seconds) plus, where one was measured, a call latency per all-gather.
    Adds each bucket size's gather to `table`; the whole update = gather + copy (the copy: `copy`)."""
    cfg = p.cfg
    parallel, mode = cfg.trainer.parallel, cfg.update.gather
    out = {"ranks": ranks, "parallel": parallel, "mode": mode, "trainer_dtype": cfg.trainer.dtype}
    if ranks <= 1 or not parallel_class(parallel).sharded:
        held = "one process holds" if ranks <= 1 else f"trainer.parallel={parallel}: every rank holds"
        return {**out, "applies": False, "why": f"{held} the whole model: nothing to gather", "time_s": 0.0}
    bw = collective["bus_gbps"] if collective else None
    latency = collective.get("latency_s") if collective else None
    call_bytes = collective.get("call_bytes") if collective else None

    def predicted(g: dict) -> tuple[Optional[float], Optional[float]]:
        if not bw:
            return None, None
        calls = g["collectives"] * latency if latency is not None else 0.0
        return cost.gather_seconds(g["bytes"], ranks, bw), calls

    for row in table:
        g = p.gather(row["bucket_mb"], mode, call_bytes)
        floor, calls = predicted(g)
        row["gather_time_s"] = floor + calls if floor is not None else None
        row["gather_held_bytes"] = g["held_bytes"]
        bucketed = row.get("bucketed_time_s")
        row["bucketed_with_gather_s"] = (
            bucketed + row["gather_time_s"] if bucketed is not None and floor is not None else None
        )
    g = p.gather(cfg.update.bucket_mb, mode, call_bytes)
    floor, calls = predicted(g)
    time_s = floor + calls if floor is not None else None
    whole = None
    if copy and time_s is not None:
        whole = {k: copy[k] + time_s for k in ("time_s", "low_s", "high_s")}
    return {
        **out,
        "applies": True,
        "bytes": g["bytes"],
        "received_bytes": g["bytes"] * (ranks - 1) // ranks,
        "collectives": g["collectives"],
        "call_bytes": call_bytes,
        "bus_gbps": bw,
        "latency_s": latency,
        "source": collective["source"] if collective else None,
        "measured": collective.get("measured") if collective else None,
        "floor_s": floor,
        "latency_term_s": calls,
        "time_s": time_s,
        "held_bytes": {m: p.gather(cfg.update.bucket_mb, m, call_bytes)["held_bytes"] for m in GATHER_MODES},
        "held_bytes_draining": g["held_bytes_draining"],
        "whole_update": whole,
    }


def per_rank_memory(cfg: Config, *, ranks: int, cuda: bool) -> dict:
    """The run's memory per rank (rlsync.check.estimate.rank_estimate, the run's own memory check per rank):
    under fsdp2 each rank's shards of the trainer state (1/N, padded), under ddp the whole state and DDP's
    gradient buckets; the engine on every rank under rollout.placement=every_rank, on rank 0 only under rank0;
    under fsdp2 the gather's transients. On a CPU all ranks share this machine's RAM (a CPU launch:
    torchrun --nproc_per_node N); on GPUs each rank has its own device. Runtime not counted."""
    launch = Ranks(world=ranks, local=1 if cuda else ranks)

    def one(rank: int) -> dict:
        est = rank_estimate(cfg, cuda=cuda, runtime_bytes=0, ranks=launch, rank=rank)
        host = {**est.process, **{f"engine_process_{k}": v for k, v in est.engine_process.items()}}
        return {
            "host_bytes": sum(host.values()),
            "device_bytes": est.device_bytes or None,
            "host": host,
            "device": est.device or None,
        }

    rank0 = one(0)
    other = one(1) if ranks > 1 else None
    return {
        "ranks": ranks,
        "parallel": cfg.trainer.parallel if ranks > 1 else "none",
        "placement": cfg.rollout.placement,
        "rank0": rank0,
        "other_rank": other,
        # the ranks of one machine share its RAM: what a CPU launch of them all needs
        "all_ranks_host_bytes": rank0["host_bytes"] + (ranks - 1) * (other["host_bytes"] if other else 0),
    }
