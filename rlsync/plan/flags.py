"""The plan's flags: the known pain, sized, for the configured bucket size, and DOES NOT FIT.

The flags (the known pain, sized): a tensor larger than the bucket (it travels alone, and the staging
buffer grows to it), the staging memory each bucket size costs, and the per-tensor overhead share
(per-tensor time minus bucketed time, over per-tensor time, on the same transport).
"""

from __future__ import annotations

from typing import Optional

from rlsync.fmt import MIB, fmt_bytes, fmt_share
from rlsync.trainer.parallel import parallel_class, parallels_with


def flags(plan: dict, configured: dict) -> list[dict]:
    """The known pain, sized, for the configured bucket size."""
    out = []
    s, lt = plan["setup"], plan["model"]["largest_tensor"]
    cap = int(s["bucket_mb"] * MIB)
    if s["strategy"] == "bucketed" and configured["tensors_over_bucket"]:
        out.append(
            {
                "kind": "tensor_over_bucket",
                "tensors": configured["tensors_over_bucket"],
                "largest_tensor_bytes": lt["bytes"],
                "bucket_bytes": cap,
                "message": f"{configured['tensors_over_bucket']} tensor(s) larger than the {fmt_bytes(cap)} bucket, "
                f"the largest {lt['name']} ({fmt_bytes(lt['bytes'])}): each travels alone in its own "
                f"bucket, and "
                + (
                    f"that bucket's flat buffer is {fmt_bytes(configured['largest_bucket_bytes'])}"
                    if s["flat_engine_weights"]
                    else f"the staging buffer grows to {fmt_bytes(configured['largest_bucket_bytes'])}"
                ),
            }
        )
    if plan["memory"]["staging_bytes"]:
        out.append(
            {
                "kind": "staging",
                "bytes": plan["memory"]["staging_bytes"],
                "message": f"staging: {fmt_bytes(plan['memory']['staging_bytes'])} for update.bucket_mb="
                f"{s['bucket_mb']:g} x inflight_buckets={s['inflight_buckets']} "
                f"({s['strategy']}, {s['transport']}{' flat' if s['flat_engine_weights'] else ''})",
            }
        )
    share = configured.get("per_tensor_share")
    if share is not None:
        verdict = (
            f"bucketing at {s['bucket_mb']:g} MiB saves {fmt_share(share)} of a per_tensor update's time"
            if share >= 0
            else f"per_tensor is faster here: bucketing at {s['bucket_mb']:g} MiB takes "
            f"{fmt_share(-share)} of the per_tensor time more (its second copy outweighs the calls it saves)"
        )
        out.append(
            {
                "kind": "per_tensor_overhead",
                "share": share,
                "message": f"per-tensor overhead share on {s['transport']} (per_tensor - bucketed) / per_tensor "
                f"= {fmt_share(share)}: {verdict} (predicted)",
            }
        )
    fit = does_not_fit(plan["memory"], bool(s["cuda"]))
    if fit:
        out.append(fit)
    pred = plan["prediction"]
    if pred:
        overhead = (pred["terms"]["calls_s"] + pred["terms"]["tensors_s"]) / pred["time_s"] if pred["time_s"] else None
        out.append(
            {
                "kind": "overhead_share",
                "share": overhead,
                "message": f"per-call and per-tensor costs are {fmt_share(overhead)} of the predicted update "
                "(the rest is bytes / bandwidth)",
            }
        )
    return out


def does_not_fit(mem: dict, cuda: bool) -> Optional[dict]:
    """The flag when the plan's memory exceeds the device's: a whole run's peak (per device on a GPU,
    the host's on a CPU) or the update alone's, against `capacity_bytes`; None when it fits or is unknown."""
    capacity = mem.get("capacity_bytes")
    if (mem.get("per_rank") or {}).get("ranks", 1) > 1:
        return does_not_fit_ranks(mem, cuda)
    run = mem["run_peak_device_bytes"] if cuda else mem["run_peak_host_bytes"]
    alone = mem["update_alone_peak_bytes"]
    if not capacity or max(run or 0, alone) <= capacity:
        return None
    where = f"{mem['capacity_of']} ({fmt_bytes(capacity)})"
    parts = []
    if run and run > capacity:
        parts.append(f"a whole run needs {fmt_bytes(run)}{' per device' if cuda else ''}")
    parts.append(
        f"the update alone (rlsync.bench) needs {fmt_bytes(alone)}" + (" too" if alone > capacity else ", which fits")
    )
    return {
        "kind": "does_not_fit",
        "bytes": max(run or 0, alone),
        "capacity_bytes": capacity,
        "message": f"DOES NOT FIT in {where}: {'; '.join(parts)} (estimated, runtime not counted): the run's "
        f"memory check would refuse it; shard the trainer (trainer.parallel={sharding()} over more ranks), or a "
        "smaller model or dtype",
    }


def sharding() -> str:
    """The trainer.parallel value that shards the trainer's state over the ranks (its class declares `sharded`)."""
    return parallels_with(spans_ranks=True, sharded=True)[0]


def does_not_fit_ranks(mem: dict, cuda: bool) -> Optional[dict]:
    """The flag for N > 1 ranks, from the per-rank estimate: on a GPU each rank's device against one GPU's
    memory; on a CPU all ranks together against this machine's RAM (they share it)."""
    capacity, r = mem.get("capacity_bytes"), mem["per_rank"]
    rank0, other = r["rank0"], r["other_rank"]
    key = "device_bytes" if cuda else "host_bytes"
    need = max(rank0[key] or 0, other[key] or 0) if cuda else r["all_ranks_host_bytes"]
    if not capacity or need <= capacity:
        return None
    state = (rank0["device"] if cuda else rank0["host"]).get("trainer_state", 0)
    each = f"rank 0 needs {fmt_bytes(rank0[key])}, each other rank {fmt_bytes(other[key])}"
    what = f"{each} per device" if cuda else f"its {r['ranks']} ranks need {fmt_bytes(need)} together ({each})"
    fix = (
        f"trainer.parallel={sharding()} shards the state over the ranks"
        if not parallel_class(r["parallel"]).sharded
        else "more ranks (plan.ranks)" + ("" if cuda else ", on more machines")
    )
    return {
        "kind": "does_not_fit",
        "bytes": need,
        "capacity_bytes": capacity,
        "message": f"DOES NOT FIT in {mem['capacity_of']} ({fmt_bytes(capacity)}): {what}; trainer state "
        f"{fmt_bytes(state)} per rank under trainer.parallel={r['parallel']} (estimated per rank, runtime not "
        f"counted): {fix}, or a smaller model or dtype",
    }
