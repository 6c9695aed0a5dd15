"""The bucket plan of a config, and its predicted update time, from the config alone.

`make_plan(cfg, calibration)` lists the update's tensors (`rlsync.run.memory_check.param_shapes`, the same
names and shapes the update sends), plans the buckets for each bucket size (`rlsync.sync.buckets`,
the planner the update itself uses), estimates the staging and peak memory (`rlsync.run.memory_check`) and,
where the calibration has coefficients for a setup, predicts the update time with a range
(`rlsync.plan.cost`). Nothing is allocated: a 235B model plans in seconds.

The flags (the known pain, sized): a tensor larger than the bucket (it travels alone, and the staging
buffer grows to it), the staging memory each bucket size costs, and the per-tensor overhead share
(per-tensor time minus bucketed time, over per-tensor time, on the same transport).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from rlsync.config.schema import MIB, Config, flat_engine_weights_choice
from rlsync.fmt import fmt_bytes, fmt_seconds, fmt_share, markdown_table
from rlsync.measure.limits import cache_resident_elements
from rlsync.measure.threads import pooled
from rlsync.model.build import torch_dtype
from rlsync.plan import cost, profiles
from rlsync.plan.calibrate import calibrate_hint
from rlsync.run.memory_check import DTYPE_BYTES, estimate, param_shapes, staging_bytes
from rlsync.sync.buckets import TensorMeta, plan_buckets

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
) -> dict:
    """plan.json: the tensors, the buckets per bucket size, memory, the predicted time and the flags."""
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
    staging = staging_bytes(cfg, p.shapes)
    run_peak = estimate(cfg, cuda=cuda, runtime_bytes=0)
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
        },
    }
    plan["flags"] = flags(plan, configured)
    return plan


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
        for r in plan["buckets"]
    ]
    lines += [
        markdown_table(head, rows),
        "(* the configured update.bucket_mb; staging for the configured transport)",
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
    peak_dev = f", device {fmt_bytes(mem['run_peak_device_bytes'])}" if mem["run_peak_device_bytes"] else ""
    lines.append(
        f"Memory: staging {fmt_bytes(mem['staging_bytes'])}; the update alone (rlsync.bench: trainer and "
        f"engine weights + staging) {fmt_bytes(mem['update_alone_peak_bytes'])}; a whole run (AdamW state in "
        f"{s['trainer_dtype']}, runtime not counted) host {fmt_bytes(mem['run_peak_host_bytes'])}{peak_dev}"
    )
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


def check_plan(plan: dict) -> None:
    for k, kind in PLAN_KEYS.items():
        if k not in plan or not isinstance(plan[k], kind):
            raise ValueError(f"plan.json: {k!r} missing or not {kind}")
    if plan["kind"] != "plan" or plan["schema"] != SCHEMA_VERSION:
        raise ValueError(f"plan.json: kind {plan['kind']!r} schema {plan['schema']!r}, expected plan {SCHEMA_VERSION}")
