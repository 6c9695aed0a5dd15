"""Each payload's encode and decode time, fitted from benchmark runs that timed them against their floors.

Per payload and side (the encode on the trainer's side, the decode into the engine's weights):

    seconds = floor multiple x floor bytes / copy bandwidth + tensors x per_tensor_s + changed elements x per_changed_s

The floor bytes are what the payload class declares its kernels must read and write (`Payload.floor`; a run
records them over its own copy probe as perf/update_weights_{encode,decode}_limit_time), so the multiple is
1 / the side's efficiency; the other terms are those its class declares (`Payload.fit_terms`: "changed" for a
payload that compares what changed). Fitted as the cost model is (rlsync/plan/cost.py: non-negative least
squares on relative error), per payload and side over every transport's runs. A side that had nothing to move
(a decode when nothing changed) is left out of the fit and predicted as nothing. Pure functions: no torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Optional

from rlsync.check.estimate import DTYPE_BYTES
from rlsync.fmt import is_number
from rlsync.plan.cost import nnls
from rlsync.update.payload import payload_class, payload_names, recorded_class, recorded_payload

FIT_TERMS = ("floor", "tensors", "changed")  # what Payload.fit_terms may name
COLUMNS = {"floor": "floor_multiple", "tensors": "per_tensor_s", "changed": "per_changed_s"}  # their coefficients
SIDES = ("encode", "decode")
MODEL = (
    "seconds = floor_multiple x floor bytes / copy bandwidth + tensors x per_tensor_s + changed elements x "
    "per_changed_s, per payload and side, the terms its class declares (rlsync/plan/payload_fit.py)"
)


def fitted_names() -> list[str]:
    """The payloads whose encode and decode the planner fits (their class declares fit_terms)."""
    return [n for n in payload_names() if payload_class(n).fit_terms]


def full_name() -> str:
    """The full update's payload: the one that is not reported beside the full update (`beside_full`)."""
    return next(n for n in payload_names() if not payload_class(n).beside_full)


@dataclass(frozen=True)
class PayloadRun:
    """One side of one benchmark run of a fitted payload, as the fit sees it (medians over its repeats)."""

    payload: str
    side: str
    time_s: float
    floor_s: float  # its declared floor bytes over the run's copy probe (perf/update_weights_<side>_limit_time)
    tensors: int
    changed: int  # elements whose engine-dtype value changed per update (0 where the payload does not compare)
    spread: float = 0.0  # (max - min) / 2 / median of its time
    source: str = ""
    model: str = ""
    transport: str = ""
    floor_gbps: Optional[float] = None  # the run's copy floor (GB/s read + written) its floor seconds are at

    def column(self, term: str) -> float:
        return {"floor": self.floor_s, "tensors": self.tensors, "changed": self.changed}[term]


def median_of(metrics: dict, key: str) -> Optional[float]:
    value = (metrics.get(key) or {}).get("median") if isinstance(metrics.get(key), dict) else None
    return float(value) if is_number(value) else None


def dotted(config: dict):
    """A getter of a recorded run's config by dotted key (recorded_payload's), None where absent."""

    def get(key: str) -> Any:
        node: Any = config
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    return get


def payload_runs(summary: dict, source: str = "") -> list[PayloadRun]:
    """A finished `rlsync.bench` update run of a fitted payload as the fit's rows, one per side it timed against
    its floor; [] for any other run (the full update's, one from before the floors were recorded)."""
    if summary.get("kind") != "bench" or summary.get("target") != "update" or summary.get("status") != "finished":
        return []
    setup, model, metrics = summary["setup"], summary["model"], summary.get("metrics") or {}
    name = recorded_payload(setup, dotted(summary.get("config") or {}))  # its setup.payload, or the old keys
    cls = recorded_class(name)
    if cls is None or not cls.fit_terms:
        return []
    ratio = median_of(metrics, "perf/update_weights_changed_ratio") or 0.0
    # the copy probe's bandwidth beside the repeats (payload_bandwidth): one converting copy of the update's elements
    # over the update's floor time, as rlsync.plan.calibrate.floor_s_per_byte reads it
    limit = median_of(metrics, "perf/update_weights_limit_time")
    copied = model["params"] * (DTYPE_BYTES[setup["trainer_dtype"]] + DTYPE_BYTES[setup["engine_dtype"]])
    gbps = copied / limit / 1e9 if limit else None
    out = []
    for side in SIDES:
        took = median_of(metrics, f"perf/update_weights_{side}_time")
        floor = median_of(metrics, f"perf/update_weights_{side}_limit_time")
        if took is None or floor is None or took <= 0 or floor <= 0:  # not timed, or nothing to move
            continue
        t = metrics[f"perf/update_weights_{side}_time"]
        spread = (t["max"] - t["min"]) / 2 / took if is_number(t.get("max")) and is_number(t.get("min")) else 0.0
        out.append(
            PayloadRun(
                cls.name,
                side,
                took,
                floor,
                int(model["tensors"]),
                round(ratio * model["params"]) if "changed" in cls.fit_terms else 0,
                spread,
                source,
                str(model.get("name", "")),
                str(setup.get("transport", "")),
                gbps,
            )
        )
    return out


def side_seconds(coef: dict, *, floor_s: float, tensors: int, changed: int) -> float:
    """A fitted side's time for an update whose declared floor takes `floor_s` at the copy bandwidth; nothing
    where it has nothing to move (no floor bytes), as a decode when nothing changed."""
    if floor_s <= 0:
        return 0.0
    values = {"floor": floor_s, "tensors": tensors, "changed": changed}
    return sum(coef[COLUMNS[t]] * values[t] for t in coef["terms"])


def fit_side(runs: list[PayloadRun], terms: tuple[str, ...]) -> dict:
    """One payload's side: NNLS of time on its terms, each row over its time (relative error), and why its runs
    do not determine it, if they do not (no more runs than terms, or terms that do not vary independently)."""
    import numpy as np

    a = [[r.column(t) / r.time_s for t in terms] for r in runs]
    x = nnls(a, [1.0] * len(runs))
    coef: dict[str, Any] = {"terms": list(terms), **{COLUMNS[t]: 0.0 for t in FIT_TERMS}}
    coef.update({COLUMNS[t]: v for t, v in zip(terms, x)})
    fitted = [side_seconds(coef, floor_s=r.floor_s, tensors=r.tensors, changed=r.changed) for r in runs]
    rel = [(r.time_s - f) / f if f > 0 else 0.0 for r, f in zip(runs, fitted)]
    design = np.asarray([[r.column(t) for t in terms] for r in runs], dtype=float)
    norms = np.linalg.norm(design, axis=0)
    if len(runs) <= len(terms):
        why = f"{len(runs)} runs for {len(terms)} coefficients ({', '.join(terms)})"
    elif (norms == 0).any() or np.linalg.matrix_rank(design / np.where(norms == 0, 1, norms), tol=1e-6) < len(terms):
        why = f"its runs do not vary {', '.join(terms)} independently"
    else:
        why = None
    multiple = coef["floor_multiple"]
    coef.update(
        efficiency=1 / multiple if multiple > 0 else None,
        points=len(runs),
        rel_residual_max=max(abs(r) for r in rel),
        rel_residual_rms=math.sqrt(sum(r * r for r in rel) / len(rel)),
        repeat_spread=statistics.median(r.spread for r in runs),
        underdetermined=why,
    )
    return coef


def fit(runs: Iterable[PayloadRun]) -> dict:
    """The calibration's `payloads` section: per fitted payload and side its coefficients, and the rows behind."""
    runs = list(runs)
    fits: dict[str, dict] = {}
    for name in fitted_names():
        terms = payload_class(name).fit_terms
        sides = {}
        for side in SIDES:
            mine = [r for r in runs if r.payload == name and r.side == side]
            if mine:
                sides[side] = fit_side(mine, terms)
        if sides:
            fits[name] = sides
    floors = [r.floor_gbps for r in runs if r.floor_gbps]
    return {
        "model": MODEL,
        "fits": fits,
        # the runs' median copy floor: the plan predicts at it (the fit's absolute speed), unless plan.copy_gbps
        "floor_gbps": statistics.median(floors) if floors else None,
        "observations": [asdict(r) for r in runs],
    }


def floor_gbps(data: Optional[dict]) -> Optional[float]:
    """The copy floor a calibration's payload fit was measured at (its runs' median), None without one."""
    value = ((data or {}).get("payloads") or {}).get("floor_gbps")
    return float(value) if is_number(value) and value > 0 else None


def usable(data: Optional[dict]) -> dict[str, dict]:
    """{payload: {side: coefficients}} of a calibration, less the sides its runs do not determine: {} for a file
    without a payload fit (one written before it, a published-figure profile)."""
    fits = ((data or {}).get("payloads") or {}).get("fits") or {}
    return {
        name: {side: c for side, c in sides.items() if not c.get("underdetermined")}
        for name, sides in fits.items()
        if all(side in sides and not sides[side].get("underdetermined") for side in SIDES)
    }


def section_problem(section) -> Optional[str]:
    """What makes a calibration's `payloads` section unreadable, or None (profiles.calibration_problem)."""
    if not isinstance(section, dict) or not isinstance(section.get("fits", {}), dict):
        return "its payloads is not an object with fits (payload -> side -> coefficients)"
    if section.get("floor_gbps") is not None and not is_number(section["floor_gbps"]):
        return f"its payloads.floor_gbps is {section['floor_gbps']!r}, not a number"
    for name, sides in section.get("fits", {}).items():
        if not isinstance(sides, dict):
            return f"its payloads.fits[{name!r}] is not an object of sides"
        for side, c in sides.items():
            if side not in SIDES or not isinstance(c, dict):
                return f"its payloads.fits[{name!r}] has {side!r}, not {' or '.join(SIDES)} coefficients"
            terms = c.get("terms")
            if not isinstance(terms, list) or not all(t in FIT_TERMS for t in terms):
                return f"its payloads.fits[{name!r}][{side!r}].terms is {terms!r}, not a list of {', '.join(FIT_TERMS)}"
            bad = [COLUMNS[t] for t in terms if not is_number(c.get(COLUMNS[t]))]
            if bad:
                return f"its payloads.fits[{name!r}][{side!r}].{bad[0]} is {c.get(bad[0])!r}, not a number"
    return None


def fit_lines(data: dict) -> list[str]:
    """The payload fit in a calibration's closing lines: per payload and side, its coefficients and residuals."""
    section = data.get("payloads")
    if not section:
        return ["  payloads: no payload fit (no bench run among these timed a payload's encode and decode)"]
    gbps = section.get("floor_gbps")
    out = [f"  payloads at their runs' median copy floor of {gbps:.3g} GB/s:" if gbps else "  payloads:"]
    for name, sides in section.get("fits", {}).items():
        for side, c in sides.items():
            eff = c.get("efficiency")
            parts = [
                f"efficiency {eff:.3g} of its floor" if eff else "floor multiple 0 (its floor explains none of it)"
            ]
            if "tensors" in c["terms"]:
                parts.append(f"per tensor {c['per_tensor_s'] * 1e6:.2f} us")
            if "changed" in c["terms"]:
                parts.append(f"per changed element {c['per_changed_s'] * 1e9:.2f} ns")
            why = c.get("underdetermined")
            out.append(
                f"  {name + ' ' + side:22s} {', '.join(parts)}; {c['points']} runs, residual max "
                f"{c['rel_residual_max'] * 100:.1f} % rms {c['rel_residual_rms'] * 100:.1f} %"
                + (f" (UNDERDETERMINED: {why}; left out)" if why else "")
            )
    if len(out) == 1:
        return ["  payloads: no payload fit (no bench run among these timed a payload's encode and decode)"]
    return out
