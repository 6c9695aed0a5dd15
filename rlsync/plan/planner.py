"""The bucket plan of a config, and its predicted update time, from the config alone.

`make_plan(cfg, calibration)` lists the update's tensors (`rlsync.check.estimate.param_shapes`, the same
names and shapes the update sends), plans the buckets for each bucket size (`rlsync.update.buckets`,
the planner the update itself uses), estimates the staging and peak memory (`rlsync.check.estimate`) and,
where the calibration has coefficients for a setup, predicts the update time with a range
(`rlsync.plan.cost`). Nothing is allocated: a 235B model plans in seconds. Data-parallel ranks: ranks.py;
the flags: flags.py; the printed plan: render.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from rlsync.check.estimate import DTYPE_BYTES, Ranks, estimate, param_shapes, staging_bytes
from rlsync.config.derived import flat_engine_weights_choice
from rlsync.config.schema import VERDICT_THRESHOLD, Config, ModelConfig
from rlsync.errors import CONF_DIR, BadInput, ConfigError
from rlsync.fmt import MIB
from rlsync.measure.floors import cache_resident_elements
from rlsync.measure.threads import pooled
from rlsync.model.architecture import layout_plan, model_shapes
from rlsync.model.build import torch_dtype
from rlsync.plan import cost, profiles
from rlsync.plan.calibrate import calibrate_hint
from rlsync.plan.flags import flags
from rlsync.plan.kinds import kinds
from rlsync.plan.ranks import collective_of, gather_plan, per_rank_memory
from rlsync.readers.frameworks.base import FrameworkMap, framework_class, framework_names
from rlsync.record.summary import share_verdict
from rlsync.update.base import STRATEGIES
from rlsync.update.buckets import TensorMeta, plan_buckets

SCHEMA_VERSION = 1


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
        """The parameters each unit of the fsdp2 update gathers at once, in order (rlsync/update/gather.py): a
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
    sizes = sorted({*bucket_sizes, u.bucket_mb})
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
    plan["kinds"] = kinds(cfg, p, calibration)  # each payload's row, its floor and predicted time
    # the update's share of plan.step_s (with an fsdp2 gather, the gather and the copy), and what the figure spans
    plan["verdict"] = plan_verdict(cfg, (gathered or {}).get("whole_update") or prediction)
    plan["flags"] = flags(plan, configured)
    return plan


# What the predicted time spans, said beside what each framework's update metric spans (their maps' notes)
PREDICTION_SPANS = (
    "the transfer alone: the trainer's tensors copied into the engine's weights (every bucket packed, sent "
    "and loaded), with no pause of the engine, cache flush, offload, wake or barrier around it"
)


def scheme_frameworks(scheme: Optional[str]) -> list[tuple[str, type[FrameworkMap]]]:
    """The framework maps whose span notes the verdict shows: the one `update.scheme` names (scheme=miles), else
    every map (rlsync/readers/frameworks/)."""
    names = [scheme] if scheme in framework_names() else framework_names()
    return [(name, framework_class(name)) for name in names]


def plan_verdict(cfg: Config, prediction: Optional[dict]) -> dict:
    """plan.json's `verdict`: with plan.step_s, the predicted update's share of that step judged against
    run.verdict_threshold (record/summary.py's share_verdict, the run's own phrasing), its range's shares;
    always what the predicted time spans beside what each framework's update metric spans. `prediction`:
    time_s, low_s, high_s (the copy's, or the fsdp2 gather's and the copy's together)."""
    step_s = getattr(getattr(cfg, "plan", None), "step_s", None)
    threshold = getattr(cfg.run, "verdict_threshold", VERDICT_THRESHOLD)
    out: dict = {
        "step_s": step_s,
        "threshold": threshold,
        "share": None,
        "low_share": None,
        "high_share": None,
        "verdict": None,
        "spans": PREDICTION_SPANS,
        "frameworks": [
            {"name": name, "title": cls.title, "update_keys": list(cls.update), "spans": cls.spans}
            for name, cls in scheme_frameworks(cfg.update.scheme)
        ],
    }
    if step_s and prediction:
        share = prediction["time_s"] / step_s
        out.update(
            share=share,
            low_share=prediction["low_s"] / step_s,
            high_share=prediction["high_s"] / step_s,
            verdict=share_verdict(share, threshold),
        )
    return out


# ----------------------------------------------------------------------------------------------
# Another framework's run (python -m rlsync.report): its model's update bytes and their floor on a GPU
# ----------------------------------------------------------------------------------------------


def preset_names() -> list[str]:
    """The model presets (rlsync/conf/model/*.yaml): what `model=NAME` and the report's --model take."""
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def preset_model(name: str) -> ModelConfig:
    """The model preset `name` as the runner composes it (its config.json's keys filled in, for the MoE ones)."""
    from omegaconf import OmegaConf

    from rlsync.config.compose import conf_file

    if name not in preset_names():
        raise BadInput(f"--model {name}: not a model preset ({', '.join(preset_names())}) nor a config.json")
    OmegaConf.register_new_resolver("rlsync_conf", conf_file, replace=True)  # the MoE presets name their JSON so
    node = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))
    return filled(OmegaConf.to_object(node), f"--model {name}")


def config_json_model(path: str) -> ModelConfig:
    """A transformers config.json (or a folder holding one) as model.config reads it: any causal-LM architecture."""
    return filled(ModelConfig(config=path), f"--model {path}")


def filled(model: ModelConfig, named: str) -> ModelConfig:
    """`model` with its config.json's keys (model.config), checked as validation checks it; a refusal names `named`."""
    from rlsync.model.architecture import check_supported, fill_keys

    if model.config:
        try:
            check_supported(model)
            fill_keys(model)
        except ConfigError as err:
            raise BadInput(f"{named}: {err.problem} (allowed: {err.allowed})") from None
    return model


def update_floor(model: ModelConfig, device: str, dtype: str = "bfloat16") -> dict:
    """The update's bytes (every tensor it sends, in `dtype`) and their floor on `device` (a built-in GPU
    profile: h200, h100, a100): those bytes read once and written once at the profile's copy rate, the least
    any update of these weights can take on that GPU, whatever else a framework's update does around it."""
    profile = profiles.PROFILES[device]()
    per_byte_s = min(c.per_byte_s for c in profiles.coefficients(profile).values())  # seconds per byte read + written
    elements = sum(math.prod(shape) for _, shape in param_shapes(model))
    update_bytes = elements * DTYPE_BYTES[dtype]
    return {
        "model": model.name,
        "params": elements,
        "dtype": dtype,
        "update_bytes": update_bytes,
        "device": device,
        "gpu": profile["machine"]["device"],
        "copy_gbps": 1 / per_byte_s / 1e9,
        "floor_s": 2 * update_bytes * per_byte_s,
        "source": profile["source"],
    }


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


OPTIONAL_PLAN_KEYS = {
    "gather": dict,
    "kinds": dict,
    "verdict": dict,
}  # added since schema 1 was first written: absent from older plan.json files


def check_plan(plan: dict) -> None:
    for k, kind in PLAN_KEYS.items():
        if k not in plan or not isinstance(plan[k], kind):
            raise ValueError(f"plan.json: {k!r} missing or not {kind}")
    for k, kind in OPTIONAL_PLAN_KEYS.items():
        if k in plan and not isinstance(plan[k], kind):
            raise ValueError(f"plan.json: {k!r} not {kind}")
    if plan["kind"] != "plan" or plan["schema"] != SCHEMA_VERSION:
        raise ValueError(f"plan.json: kind {plan['kind']!r} schema {plan['schema']!r}, expected plan {SCHEMA_VERSION}")
