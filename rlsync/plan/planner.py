"""The bucket plan of a config, and its predicted update time, from the config alone.

`make_plan(cfg, calibration)` lists the update's tensors (`rlsync.check.estimate.param_shapes`, the same
names and shapes the update sends), plans the buckets for each bucket size (`rlsync.sync.buckets`,
the planner the update itself uses), estimates the staging and peak memory (`rlsync.check.estimate`) and,
where the calibration has coefficients for a setup, predicts the update time with a range
(`rlsync.plan.cost`). Nothing is allocated: a 235B model plans in seconds.

With data-parallel ranks (`plan.ranks`) the plan adds, under trainer.parallel=fsdp2, the update's gather from
the shards beside the copy (bytes x (N-1)/N over the calibration's all-gather bus bandwidth, `gather_plan`),
and the memory per rank (`per_rank_memory`: the run's memory check per rank), from which DOES NOT FIT is then
judged.

The flags (the known pain, sized): a tensor larger than the bucket (it travels alone, and the staging
buffer grows to it), the staging memory each bucket size costs, and the per-tensor overhead share
(per-tensor time minus bucketed time, over per-tensor time, on the same transport).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from rlsync.check.estimate import DTYPE_BYTES, Ranks, estimate, param_shapes, rank_estimate, staging_bytes
from rlsync.config.schema import MIB, Config, flat_engine_weights_choice
from rlsync.fmt import fmt_bytes, fmt_seconds, fmt_share, markdown_table
from rlsync.measure.limits import cache_resident_elements
from rlsync.measure.threads import pooled
from rlsync.model.architecture import layout_plan, model_shapes
from rlsync.model.build import torch_dtype
from rlsync.plan import cost, profiles
from rlsync.plan.calibrate import calibrate_hint
from rlsync.sync.buckets import TensorMeta, plan_buckets
from rlsync.sync.gather import GATHER_MODES

SCHEMA_VERSION = 1
STRATEGIES = ("bucketed", "per_tensor")


def with_update(cfg: Config, **changes) -> Config:
    return dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, **changes))


def setup_of(cfg: Config, strategy: Optional[str] = None, transport: Optional[str] = None) -> cost.Setup:
    strategy = strategy or cfg.update.strategy
    flat = cfg.update.flat_engine_weights and strategy == "bucketed"
    return cost.Setup(transport or cfg.update.transport, strategy, bool(flat))


class Planner:
    """One model's tensors and a calibration's coefficients; plans and predicts per bucket size and setup."""

    def __init__(self, cfg: Config, calibration: Optional[dict], *, copy_gbps: Optional[float] = None):
        flat, _ = flat_engine_weights_choice(
            cfg.update, cfg.rollout, cfg.model
        )  # null (auto) as the update resolves it
        cfg = with_update(cfg, flat_engine_weights=flat)
        self.cfg, self.calibration = cfg, calibration
        self.coefficients = profiles.coefficients(calibration)
        self.at_floor = profiles.coefficients(calibration, "coefficients_at_floor")
        self.floor_gbps = copy_gbps or (calibration or {}).get("floor_gbps")  # the floor the second prediction is at
        self.shapes = param_shapes(cfg.model)
        self.dtype = torch_dtype(cfg.rollout.dtype)
        self.metas = [TensorMeta(n, tuple(s), self.dtype) for n, s in self.shapes]
        self.numels = [m.numel for m in self.metas]  # per tensor: what per_tensor sends one by one
        self.elements = sum(self.numels)
        self.pooled = sum(map(pooled, self.numels))
        self.largest = max(self.metas, key=lambda m: m.numel)
        self.measured = bool(calibration) and calibration.get("measured", True)
        machine = (calibration or {}).get("machine", {})
        self.llc = None if machine.get("cuda") else machine.get("llc_bytes")  # the calibration machine's CPU cache
        self._plans: dict[float, list] = {}
        self._param_of: Optional[dict[str, str]] = None  # update tensor -> the parameter it is (a view of)
        self._param_bytes: dict[str, int] = {}  # parameter -> its bytes in the trainer's dtype (gather_units)

    def plan(self, bucket_mb: float) -> list:
        """The bucket plan at `bucket_mb`, once per size (a 235B MoE has ~37k tensors)."""
        if bucket_mb not in self._plans:
            self._plans[bucket_mb] = plan_buckets(self.metas, int(bucket_mb * MIB))
        return self._plans[bucket_mb]

    def buckets(self, bucket_mb: float) -> dict:
        plan = self.plan(bucket_mb)
        cap = int(bucket_mb * MIB)
        over = [m for m in self.metas if m.nbytes > cap]
        cfg = with_update(self.cfg, bucket_mb=bucket_mb, strategy="bucketed")
        trainer_staging, engine_staging = staging_bytes(cfg, self.shapes)
        return {
            "bucket_mb": bucket_mb,
            "buckets": len(plan),
            "largest_bucket_bytes": max(b.nbytes for b in plan),
            "tensors_over_bucket": len(over),
            "tensors_over_bucket_bytes": sum(m.nbytes for m in over),
            "staging_bytes": trainer_staging + engine_staging,
        }

    def predict(self, setup: cost.Setup, bucket_mb: Optional[float]) -> Optional[dict]:
        """`setup`'s predicted time at `bucket_mb` (per_tensor: None, it sends no buckets)."""
        coef = self.coefficients.get(setup.key)
        if coef is None:
            return None
        buckets = [b.numel for b in self.plan(bucket_mb)] if bucket_mb is not None else []
        w = cost.work(
            setup,
            tensors=len(self.metas),
            buckets=len(buckets),
            elements=self.elements,
            trainer_dtype=self.cfg.trainer.dtype,
            engine_dtype=self.cfg.rollout.dtype,
            pooled=self.pooled,
            cached=cache_resident_elements(setup.strategy, self.numels, buckets, self.dtype.itemsize, self.llc),
        )
        pred = cost.predict(coef, w, setup)
        low, high = self.range_of(setup.key, coef)
        pred.update(low_s=pred["time_s"] * low, high_s=pred["time_s"] * high)
        return {
            **pred,
            "calls": w.calls,
            "tensors": w.tensors,
            "pooled_tensors": w.pooled,
            "tensor_term": {"count": w.row(setup)[1], "counts": cost.tensor_term(setup)},
            "moved_bytes": w.bytes,
            "measured": self.measured,
            "at_floor": self.predict_at_floor(setup, w),
        }

    def range_of(self, key: str, coef: cost.Coefficients) -> tuple[float, float]:
        """The prediction's range as multiples of it. A profile's is its own (`range`: published figures);
        a calibration's runs from its most negative to its most positive fitted residual (measured / fitted
        - 1: on a shared machine load only slows a copy, so the two sides differ), each side at least the
        repeats' median spread; a file without its runs: the worst residual either way (cost.predict)."""
        spread = (self.calibration or {}).get("range")
        if spread:
            return spread["low"], spread["high"]
        rel = [r["rel_error"] for r in (self.calibration or {}).get("observations", []) if r.get("setup") == key]
        rel = [r for r in rel if isinstance(r, (int, float)) and not isinstance(r, bool)]
        if not rel:
            return max(0.0, 1 - coef.rel_error), 1 + coef.rel_error
        return max(0.0, 1 + min(min(rel), -coef.repeat_spread)), 1 + max(max(rel), coef.repeat_spread)

    def predict_at_floor(self, setup: cost.Setup, w: cost.Work) -> Optional[dict]:
        """The model fitted with bytes in units of the copy floor: time at a given floor (GB/s read + written)
        is overhead_s + floor_multiple x moved bytes / floor. rlsync.plan.compare puts in each bench's own floor."""
        coef = self.at_floor.get(setup.key)
        if coef is None or not self.floor_gbps:
            return None
        calls, tensors, _ = w.row(setup)
        overhead = calls * coef.per_call_s + tensors * coef.per_tensor_s
        multiple = coef.per_byte_s * 1e9
        t = overhead + multiple * w.bytes / (self.floor_gbps * 1e9)
        e = coef.rel_error
        return {
            "overhead_s": overhead,
            "floor_multiple": multiple,
            "floor_gbps": self.floor_gbps,
            "time_s": t,
            "low_s": t * max(0.0, 1 - e),
            "high_s": t * (1 + e),
            "rel_error": e,
        }

    def predictions(self, bucket_sizes: list[float]) -> list[dict]:
        """Every calibrated setup of the configured flat_engine_weights at every bucket size (per_tensor once)."""
        rows = []
        for key in sorted(self.coefficients):
            setup = cost.Setup.from_key(key)
            if setup.flat != bool(self.cfg.update.flat_engine_weights) and setup.strategy == "bucketed":
                continue
            sizes = bucket_sizes if setup.strategy == "bucketed" else [None]
            for mb in sizes:
                p = self.predict(setup, mb)
                rows.append(
                    {"transport": setup.transport, "strategy": setup.strategy, "flat": setup.flat, "bucket_mb": mb, **p}
                )
        return rows

    def gather_units(self, bucket_mb: float, mode: str) -> list[list[str]]:
        """The parameters each unit of the fsdp2 update gathers at once, in order (rlsync/sync/gather.py): a
        bucket's (per_bucket, all_at_once) or one tensor's (per_tensor), each whole (a fused expert tensor is
        gathered whole by every unit that sends one of its experts)."""
        if self._param_of is None:
            params = dict(model_shapes(self.cfg.model))
            self._param_of = {e.name: e.param for e in layout_plan(params, self.cfg.model.update_layout)}
            self._param_bytes = {n: math.prod(s) * DTYPE_BYTES[self.cfg.trainer.dtype] for n, s in params.items()}
        units = [[m.name] for m in self.metas] if mode == "per_tensor" else [b.names for b in self.plan(bucket_mb)]
        return [list(dict.fromkeys(self._param_of[n] for n in unit)) for unit in units]

    def gather(self, bucket_mb: float, mode: str, call_bytes: Optional[int] = None) -> dict:
        """What the fsdp2 update gathers at `bucket_mb`: all-gather calls, bytes, and the bytes held at once (a
        unit's on a rank, the whole model's under all_at_once on a rank whose engine reads them; a rank without
        an engine drains unit by unit, ShardedWeights.drain). Each unit's shards are packed and all-gathered
        in calls of `call_bytes` (gather_shards, at the size the collective's floor found fastest); without
        one, one call per unit is counted (at least)."""
        units = [sum(self._param_bytes[p] for p in unit) for unit in self.gather_units(bucket_mb, mode)]
        whole = sum(units)
        return {
            "collectives": sum(max(1, -(-u // call_bytes)) for u in units) if call_bytes else len(units),
            "bytes": whole,
            "held_bytes": whole if mode == "all_at_once" else max(units),
            "held_bytes_draining": max(units),
        }

    def per_tensor_share(self, transport: str, bucket_mb: float) -> Optional[float]:
        per_tensor = self.predict(cost.Setup(transport, "per_tensor"), None)
        bucketed = self.predict(setup_of(self.cfg, "bucketed", transport), bucket_mb)
        if not per_tensor or not bucketed or per_tensor["time_s"] <= 0:
            return None
        return (per_tensor["time_s"] - bucketed["time_s"]) / per_tensor["time_s"]


def make_plan(
    cfg: Config,
    *,
    calibration: Optional[dict],
    calibration_where: str,
    bucket_sizes: list[float],
    cuda: Optional[bool] = None,
    copy_gbps: Optional[float] = None,
    ranks: Optional[int] = None,
    collective_gbps: Optional[float] = None,
) -> dict:
    """plan.json: the tensors, the buckets per bucket size, memory, the predicted time and the flags.
    `ranks` (default plan.ranks, else 1): the trainer's data-parallel ranks; with trainer.parallel=fsdp2 the
    update's gather from the shards is predicted beside the copy, at `collective_gbps` (default
    plan.collective_gbps, else the calibration's `collective`), and the memory per rank."""
    plan_keys = getattr(cfg, "plan", None)
    ranks = ranks or getattr(plan_keys, "ranks", 1)
    collective_gbps = collective_gbps or getattr(plan_keys, "collective_gbps", None)
    p = Planner(cfg, calibration, copy_gbps=copy_gbps)
    cfg = p.cfg  # update.flat_engine_weights=null (auto) resolved, as the update resolves it
    u = cfg.update
    if cuda is None:
        cuda = bool((calibration or {}).get("machine", {}).get("cuda", False))
    sizes = sorted(set([*bucket_sizes, u.bucket_mb]))
    table = []
    for mb in sizes:
        row = p.buckets(mb)
        for strategy in STRATEGIES:
            pred = p.predict(setup_of(cfg, strategy), mb)
            row[f"{strategy}_time_s"] = pred["time_s"] if pred else None
        row["per_tensor_share"] = p.per_tensor_share(u.transport, mb)
        table.append(row)
    configured = next(r for r in table if r["bucket_mb"] == u.bucket_mb)
    setup = setup_of(cfg)
    prediction = p.predict(setup, u.bucket_mb) if u.strategy in STRATEGIES else None
    gathered = gather_plan(p, ranks, collective_of(calibration, collective_gbps), table, prediction)
    staging = staging_bytes(cfg, p.shapes)
    run_peak = estimate(cfg, cuda=cuda, runtime_bytes=0, ranks=Ranks())  # one process: the planner's own launch aside
    t, e = DTYPE_BYTES[cfg.trainer.dtype], DTYPE_BYTES[cfg.rollout.dtype]
    update_alone = p.elements * (t + e) + sum(staging)
    machine = (calibration or {}).get("machine") or {}
    # what the run must fit in: the GPU's memory (a profile's or a GPU calibration's), else this machine's RAM
    capacity = machine.get("memory_bytes") if cuda else profiles.host_memory_bytes()
    plan = {
        "kind": "plan",
        "schema": SCHEMA_VERSION,
        "model": {
            "name": cfg.model.name,
            "params": p.elements,
            "tensors": len(p.metas),
            "update_bytes": p.elements * e,
            "read_bytes": p.elements * t,
            "largest_tensor": {"name": p.largest.name, "shape": list(p.largest.shape), "bytes": p.largest.nbytes},
        },
        "setup": {
            "transport": u.transport,
            "strategy": u.strategy,
            "flat_engine_weights": u.flat_engine_weights,
            "bucket_mb": u.bucket_mb,
            "inflight_buckets": u.inflight_buckets,
            "trainer_dtype": cfg.trainer.dtype,
            "engine_dtype": cfg.rollout.dtype,
            "source": u.source,
            "cuda": cuda,
            "copy_gbps": copy_gbps,
        },
        "calibration": {
            "where": calibration_where,
            "measured": p.measured if calibration else None,
            "machine": (calibration or {}).get("machine"),
            "dtypes": (calibration or {}).get("dtypes"),
            "describe": profiles.describe(calibration_where, calibration, calibrate_hint()),
            "reference": bool((calibration or {}).get("reference")),
        },
        "buckets": table,
        "prediction": prediction,
        "predictions": p.predictions(sizes),
        "memory": {
            "staging_bytes": sum(staging),
            "staging_trainer_bytes": staging[0],
            "staging_engine_bytes": staging[1],
            "update_alone_peak_bytes": update_alone,
            "run_peak_host_bytes": run_peak.host_bytes,
            "run_peak_device_bytes": run_peak.device_bytes or None,
            "capacity_bytes": capacity,
            "capacity_of": (machine.get("gpu") or machine.get("device") or "the GPU") if cuda else "this machine's RAM",
            "per_rank": per_rank_memory(cfg, ranks=ranks, cuda=cuda),
        },
        "gather": gathered,
    }
    plan["flags"] = flags(plan, configured)
    return plan


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


def gather_plan(p: Planner, ranks: int, collective: Optional[dict], table: list[dict], copy: Optional[dict]) -> dict:
    """plan.json's `gather`: under trainer.parallel=fsdp2 over N > 1 ranks the update first gathers each
    parameter from its shards, every rank receiving (N-1)/N of its bytes in the trainer's dtype; predicted at
    the collective's floor (cost.gather_seconds) plus, where one was measured, a call latency per all-gather.
    Adds each bucket size's gather to `table`; the whole update = gather + copy (the copy: `copy`)."""
    cfg = p.cfg
    parallel, mode = cfg.trainer.parallel, cfg.update.gather
    out = {"ranks": ranks, "parallel": parallel, "mode": mode, "trainer_dtype": cfg.trainer.dtype}
    if ranks <= 1 or parallel != "fsdp2":
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
    gradient buckets; the engine on every rank under rollout.engines=every_rank, on rank 0 only under rank0;
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
        "engines": cfg.rollout.engines,
        "rank0": rank0,
        "other_rank": other,
        # the ranks of one machine share its RAM: what a CPU launch of them all needs
        "all_ranks_host_bytes": rank0["host_bytes"] + (ranks - 1) * (other["host_bytes"] if other else 0),
    }


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
        "memory check would refuse it; shard the trainer (trainer.parallel=fsdp2 over more ranks), or a "
        "smaller model or dtype",
    }


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
        "trainer.parallel=fsdp2 shards the state over the ranks"
        if r["parallel"] == "ddp"
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


def gather_lines(plan: dict) -> list[str]:
    """The fsdp2 gather beside the copy and the whole update, for N > 1 ranks (nothing for one)."""
    g = plan.get("gather")
    if not g or g["ranks"] <= 1:
        return []
    if not g["applies"]:
        return [f"Gather from shards: none ({g['why']})"]
    head = f"Gather from shards (trainer.parallel=fsdp2, {g['ranks']} ranks, update.gather={g['mode']})"
    n = g["collectives"]
    calls = (
        f"{n} all-gather{'s' if n != 1 else ''} of up to {fmt_bytes(g['call_bytes'])}"
        if g.get("call_bytes")
        else f"at least {n} all-gather{'s' if n != 1 else ''} (one a unit; the call size unknown)"
    )
    moved = (
        f"{fmt_bytes(g['bytes'])} in {g['trainer_dtype']} x {g['ranks'] - 1}/{g['ranks']} = "
        f"{fmt_bytes(g['received_bytes'])} received per rank in {calls}"
    )
    if g["time_s"] is None:
        lines = [
            f"{head}: unpredicted: no calibrated collective bandwidth (plan.calibrate=true measures an all-gather "
            f"over 2 gloo ranks; plan.collective_gbps=GBPS gives one); it moves {moved}"
        ]
    else:
        calls = (
            f" + {n} x {fmt_seconds(g['latency_s'])} call latency {fmt_seconds(g['latency_term_s'])}"
            if g["latency_s"] is not None
            else " (no call latency known: not counted)"
        )
        lines = [
            f"{head}: {fmt_seconds(g['time_s'])} = floor {fmt_seconds(g['floor_s'])} ({moved}, over a bus bandwidth "
            f"of {g['bus_gbps']:.3g} GB/s){calls}",
            f"  collective bandwidth from {g['source']}",
        ]
    held = " | ".join(f"{m} {fmt_bytes(b)}" for m, b in g["held_bytes"].items())
    lines.append(
        f"  gathered full tensors held at once ({g['trainer_dtype']}): {held} (configured: {g['mode']}; "
        f"a rank without an engine drains them unit by unit: {fmt_bytes(g['held_bytes_draining'])})"
    )
    w = g.get("whole_update")
    if w:
        lines.append(
            f"Predicted whole update (gather + copy): {fmt_seconds(w['time_s'])} "
            f"({fmt_seconds(w['low_s'])} to {fmt_seconds(w['high_s'])}; the copy's range)"
        )
    return lines


def per_rank_line(plan: dict) -> list[str]:
    """Memory per rank, for N > 1 ranks (nothing for one: the whole run's line says it)."""
    r = plan["memory"].get("per_rank")
    if not r or r["ranks"] <= 1:
        return []
    cuda = bool(plan["setup"]["cuda"])

    def one(x: dict) -> str:
        where = x["device"] if cuda else x["host"]
        parts = [f"trainer state {fmt_bytes(where.get('trainer_state', 0))}"]
        engine = where.get("engine_weights", 0) + x["host"].get("engine_process_engine_weights", 0)
        parts.append(f"engine weights {fmt_bytes(engine)}" if engine else "no engine")
        parts.append(f"transients {fmt_bytes(where.get('transient', 0))}")  # the step's, the probes', the gather's
        if cuda:  # the state, engine and gathered tensors live on the device; the host holds the offloaded state
            return f"device {fmt_bytes(x['device_bytes'])} ({', '.join(parts)}), host {fmt_bytes(x['host_bytes'])}"
        return f"{fmt_bytes(x['host_bytes'])} ({', '.join(parts)})"

    share = f"1/{r['ranks']} of the state each" if r["parallel"] == "fsdp2" else "the whole state each"
    tail = "" if cuda else f"; all {r['ranks']} ranks on this machine {fmt_bytes(r['all_ranks_host_bytes'])}"
    return [
        f"Memory per rank ({r['ranks']} ranks, trainer.parallel={r['parallel']}: {share}; rollout.engines="
        f"{r['engines']}; runtime not counted): rank 0 {one(r['rank0'])}; each other rank {one(r['other_rank'])}{tail}"
    ]


def render(plan: dict) -> str:
    """The console view of plan.json."""
    m, s, mem = plan["model"], plan["setup"], plan["memory"]
    lt = m["largest_tensor"]
    lines = [
        f"Plan: {m['name']}, {m['params'] / 1e9:.3f}B parameters, {m['tensors']} tensors, "
        f"{fmt_bytes(m['update_bytes'])} in {s['engine_dtype']} ({m['update_bytes']:,} bytes); largest tensor "
        f"{lt['name']} {tuple(lt['shape'])} {fmt_bytes(lt['bytes'])}",
        f"Update: {s['transport']}{' flat' if s['flat_engine_weights'] else ''}, {s['strategy']}, "
        f"{s['trainer_dtype']} -> {s['engine_dtype']}, inflight_buckets={s['inflight_buckets']}",
        f"Calibration: {plan['calibration']['describe']}",
        "",
    ]
    unmeasured = "" if plan["calibration"]["measured"] is not False else " (unmeasured)"
    if plan["calibration"].get("reference"):
        unmeasured = " (reference calibration)"  # another machine's coefficients: said beside every time
    head = [
        "bucket",
        "buckets",
        "largest bucket",
        "over bucket",
        "staging",
        f"bucketed{unmeasured}",
        f"per_tensor{unmeasured}",
        "per-tensor overhead",
    ]
    g = plan.get("gather") or {}
    gathers = bool(g.get("applies"))
    if gathers:  # the fsdp2 gather beside the copy: its time, what it holds at once, the two together
        head += ["gather", "gathered held", f"bucketed + gather{unmeasured}"]
    rows = [
        [
            f"{r['bucket_mb']:g} MiB" + (" *" if r["bucket_mb"] == s["bucket_mb"] else ""),
            r["buckets"],
            fmt_bytes(r["largest_bucket_bytes"]),
            r["tensors_over_bucket"] or "-",
            fmt_bytes(r["staging_bytes"]),
            fmt_seconds(r["bucketed_time_s"]),
            fmt_seconds(r["per_tensor_time_s"]),
            fmt_share(r["per_tensor_share"]),
        ]
        + (
            [
                fmt_seconds(r["gather_time_s"]),
                fmt_bytes(r["gather_held_bytes"]),
                fmt_seconds(r["bucketed_with_gather_s"]),
            ]
            if gathers
            else []
        )
        for r in plan["buckets"]
    ]
    note = (
        f"; gather: the update.gather={g['mode']} gather from {g['ranks']} shards, its held bytes in {g['trainer_dtype']}"
        if gathers
        else ""
    )
    lines += [
        markdown_table(head, rows),
        f"(* the configured update.bucket_mb; staging for the configured transport{note})",
        "",
    ]
    pred = plan["prediction"]
    if pred:
        lines.append(
            f"Predicted update time{unmeasured}: {fmt_seconds(pred['time_s'])} "
            f"({fmt_seconds(pred['low_s'])} to {fmt_seconds(pred['high_s'])}) = {pred['calls']} calls "
            f"{fmt_seconds(pred['terms']['calls_s'])} + {pred['tensor_term']['count']} {pred['tensor_term']['counts']} "
            f"{fmt_seconds(pred['terms']['tensors_s'])} + {fmt_bytes(pred['moved_bytes'])} moved "
            f"{fmt_seconds(pred['terms']['bytes_s'])}"
        )
        f = pred.get("at_floor")
        if f:
            whose = "plan.copy_gbps" if plan["setup"].get("copy_gbps") else "the calibration runs' median"
            lines.append(
                f"  at a copy floor of {f['floor_gbps']:.2f} GB/s ({whose}): "
                f"{fmt_seconds(f['time_s'])} ({fmt_seconds(f['low_s'])} to {fmt_seconds(f['high_s'])}) = "
                f"{fmt_seconds(f['overhead_s'])} per call and tensor + {f['floor_multiple']:.2f}x the floor's time for the moved bytes"
            )
    else:
        lines.append(
            f"Predicted update time: n/a (no coefficients for {setup_of_plan(plan)} in the calibration"
            + ("" if plan["calibration"]["machine"] is not None else "; none found")
            + ")"
        )
    lines += gather_lines(plan)
    peak_dev = f", device {fmt_bytes(mem['run_peak_device_bytes'])}" if mem["run_peak_device_bytes"] else ""
    lines.append(
        f"Memory: staging {fmt_bytes(mem['staging_bytes'])}; the update alone (rlsync.bench: trainer and "
        f"engine weights + staging) {fmt_bytes(mem['update_alone_peak_bytes'])}; a whole run (AdamW state in "
        f"{s['trainer_dtype']}, runtime not counted) host {fmt_bytes(mem['run_peak_host_bytes'])}{peak_dev}"
    )
    lines += per_rank_line(plan)
    for f in plan["flags"]:
        lines.append(f"Flag {f['kind']}: {f['message']}")
    return "\n".join(lines)


def setup_of_plan(plan: dict) -> str:
    s = plan["setup"]
    return cost.Setup(s["transport"], s["strategy"], bool(s["flat_engine_weights"]) and s["strategy"] == "bucketed").key


PLAN_KEYS = {  # plan.json's schema: key -> type, checked by tests and by rlsync.plan.compare when it reads one
    "kind": str,
    "schema": int,
    "model": dict,
    "setup": dict,
    "calibration": dict,
    "buckets": list,
    "prediction": (dict, type(None)),
    "predictions": list,
    "memory": dict,
    "flags": list,
}


OPTIONAL_PLAN_KEYS = {"gather": dict}  # added since schema 1 was first written: absent from older plan.json files


def check_plan(plan: dict) -> None:
    for k, kind in PLAN_KEYS.items():
        if k not in plan or not isinstance(plan[k], kind):
            raise ValueError(f"plan.json: {k!r} missing or not {kind}")
    for k, kind in OPTIONAL_PLAN_KEYS.items():
        if k in plan and not isinstance(plan[k], kind):
            raise ValueError(f"plan.json: {k!r} not {kind}")
    if plan["kind"] != "plan" or plan["schema"] != SCHEMA_VERSION:
        raise ValueError(f"plan.json: kind {plan['kind']!r} schema {plan['schema']!r}, expected plan {SCHEMA_VERSION}")
