"""The update's payloads side by side, from the config alone: bytes per update, floor and predicted time.

Each payload registered under update.payload (rlsync/update/payload) gives its own row (`Payload.planned`): the
bytes one later update sends and its floor's bytes, each side's as its class declares them (`Payload.floor`),
from the same bucket plan and byte layouts the payloads use; over the copy floor (GB/s read + written) they are
its floor's time. A payload whose bytes are another's (the merged LoRA update is the full one) has no row.

Its predicted update time over each calibrated transport:

- a payload whose work is the transport's own copies (no `fit_terms`: the full update, the adapters): the
  transport's cost model (rlsync/plan/cost.py) for its own buckets, tensors and elements;
- a fitted one (its class declares `fit_terms`): the transport's part of the cost model for what it sends (its calls, and the
  copies between the encode and the decode: none in one memory, the broadcast's over a link) plus the encode
  and decode fitted from benchmark runs (rlsync/plan/payload_fit.py, the calibration's `payloads`).

For a payload whose fit counts changed elements, the changed share at which it and the full update take the
same time over each transport (the break-even), solved from the same predictions.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from rlsync.check.estimate import DTYPE_BYTES
from rlsync.fmt import MIB, fmt_bytes, fmt_seconds, fmt_share, markdown_table
from rlsync.measure.devices import resolve_device
from rlsync.model.architecture import model_shapes
from rlsync.plan import cost, payload_fit
from rlsync.update.buckets import Bucket
from rlsync.update.payload import PlanContext, payload_class, payload_names, recorded_class
from rlsync.update.payload.kernels import line_bytes

CHANGED_RATIO = 0.05  # a tree without plan.* (a run's config): plan.changed_ratio's default
FIT_COMMAND = "python -m rlsync.plan plan.calibrate=true"
SOLVE_STEPS = 40  # bisection steps of the break-even share: 2^-40 of the [0, 1] range


def context(cfg, buckets: list[Bucket], model_shapes, floor_gbps: Optional[float]) -> PlanContext:
    """What a payload's `planned` reads: the plan of the model's tensors at update.bucket_mb and the config's facts."""
    return PlanContext(
        buckets=buckets,
        trainer_itemsize=DTYPE_BYTES[cfg.trainer.dtype],
        engine_itemsize=DTYPE_BYTES[cfg.rollout.dtype],
        changed_ratio=cfg.plan.changed_ratio if getattr(cfg, "plan", None) is not None else CHANGED_RATIO,
        floor_gbps=floor_gbps,
        model_shapes=list(model_shapes),
        lora=cfg.trainer.lora,
        bucket_bytes=int(cfg.update.bucket_mb * MIB),
        line_bytes=line_bytes(resolve_device(cfg.run.device)),
    )


class Predictor:
    """A payload's predicted update time over one transport, from the planner's cost model and the payload fit.

    `planner`: the rlsync.plan.planner.Planner of the config (its coefficients, `predict`, element count)."""

    def __init__(self, cfg, planner, floor_gbps: Optional[float], calibration: Optional[dict]):
        self.cfg, self.planner, self.floor_gbps = cfg, planner, floor_gbps
        self.fits = payload_fit.usable(calibration)
        self.transports = sorted(
            {cost.Setup.from_key(k).transport for k in planner.coefficients if k.endswith("/bucketed")}
        )

    def setup(self, cls, transport: str) -> cost.Setup:
        """A whole payload runs the configured setup (flat engine weights where they resolved so); the others
        refuse flat weights: the transport's bucketed setup."""
        flat = bool(self.cfg.update.flat_engine_weights) and cls.whole
        return cost.Setup(transport, "bucketed", flat)

    def predict(self, cls, row: dict, transport: str) -> Optional[dict]:
        """{time_s, transport_s, encode_s, decode_s, setup} of `row` (cls.planned) over `transport`, None where the
        calibration cannot say (no coefficients for its setup, no payload fit, no copy floor)."""
        setup = self.setup(cls, transport)
        coef = self.planner.coefficients.get(setup.key)
        if coef is None:
            return None
        if not cls.fit_terms:  # its work is the transport's copies: the cost model of its own tensors
            if row["elements"] == self.planner.elements:
                time_s = self.planner.predict(setup, self.cfg.update.bucket_mb)["time_s"]
            else:
                w = cost.work(
                    setup,
                    tensors=row["tensors"],
                    buckets=row["buckets"],
                    elements=row["elements"],
                    trainer_dtype=self.cfg.trainer.dtype,
                    engine_dtype=self.cfg.rollout.dtype,
                )
                time_s = coef.predict(w, setup)
            return {"time_s": time_s, "transport_s": time_s, "encode_s": None, "decode_s": None, "setup": setup.key}
        fit = self.fits.get(cls.name)
        if fit is None or not self.floor_gbps:
            return None
        # the transport's calls, and its copies between the encode (which writes what it sends) and the decode
        between = max(0, cost.copies(setup) - 2) * 2 * row["bytes"]
        transport_s = row["buckets"] * coef.per_call_s + between * coef.per_byte_s
        sides = {
            side: payload_fit.side_seconds(
                fit[side],
                floor_s=row[f"{side}_floor_bytes"] / (self.floor_gbps * 1e9),
                tensors=row["tensors"],
                changed=row.get("changed", 0),
            )
            for side in payload_fit.SIDES
        }
        return {
            "time_s": transport_s + sides["encode"] + sides["decode"],
            "transport_s": transport_s,
            "encode_s": sides["encode"],
            "decode_s": sides["decode"],
            "setup": setup.key,
        }

    def break_even(self, cls, ctx: PlanContext, full_s: float, transport: str) -> dict:
        """The changed share at which `cls` takes as long as the full update (`full_s`) over `transport`: its
        prediction grows with the share, so the largest share at which it is no slower, by bisection."""

        def at(ratio: float) -> float:
            return self.predict(cls, cls.planned(dataclasses.replace(ctx, changed_ratio=ratio)), transport)["time_s"]

        low_s, high_s = at(0.0), at(1.0)
        out = {"full_s": full_s, "at_zero_s": low_s}
        if low_s >= full_s:
            return {**out, "share": None, "pays": "never"}
        if high_s <= full_s:
            return {**out, "share": 1.0, "pays": "always"}
        lo, hi = 0.0, 1.0
        for _ in range(SOLVE_STEPS):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if at(mid) <= full_s else (lo, mid)
        return {**out, "share": lo, "pays": "below"}


ONLY_AT_ZERO = 1e-4  # a break-even below 0.01 % changed: the payload pays only when nothing changed


def kinds(cfg, planner, calibration: Optional[dict] = None) -> dict:
    """plan.json's `kinds`: per payload its bytes, share of the full update's, floor seconds and predicted time
    over each calibrated transport; the break-even changed share of the payloads whose fit counts changes. The
    floors are at the payload fit's runs' copy floor (its absolute speed, as the cost model's bandwidth is its
    runs'), else the planner's (plan.copy_gbps, else the calibration runs' median)."""
    floor_gbps = payload_fit.floor_gbps(calibration) or planner.floor_gbps
    ctx = context(cfg, planner.plan(cfg.update.bucket_mb), model_shapes(cfg.model), floor_gbps)
    full = sum(b.nbytes for b in ctx.buckets)
    predictor = Predictor(cfg, planner, floor_gbps, calibration)
    rows, classes = {}, {}
    for name in payload_names():
        cls = payload_class(name)
        row = cls.planned(ctx)
        if row is None:
            continue
        bw = floor_gbps * 1e9 if floor_gbps else None
        row.update(
            share=row["bytes"] / full if full else None,
            floor_s=row["encode_floor_bytes"] / bw if bw else None,
            decode_floor_s=row["decode_floor_bytes"] / bw if bw else None,
            fit_terms=list(cls.fit_terms),
            fitted=bool(cls.fit_terms) and cls.name in predictor.fits,
            predicted={t: predictor.predict(cls, row, t) for t in predictor.transports},
        )
        rows[name], classes[name] = row, cls
    full_name = payload_fit.full_name()
    break_even = {}
    for name, cls in classes.items():
        if "changed" not in cls.fit_terms or full_name not in rows:
            continue
        per = {}
        for t in predictor.transports:
            full_pred, mine = rows[full_name]["predicted"].get(t), rows[name]["predicted"].get(t)
            if full_pred and mine:
                per[t] = predictor.break_even(cls, ctx, full_pred["time_s"], t)
        if per:
            break_even[name] = per
    return {
        "rows": rows,
        "floor_gbps": floor_gbps,
        "transports": predictor.transports,
        "payload_fit": bool(predictor.fits),
        "unfitted": [n for n, r in rows.items() if r["fit_terms"] and not r["fitted"]],
        "changed_ratio": ctx.changed_ratio,
        "break_even": break_even,
    }


def marker(plan: dict) -> str:
    """What the plan says beside each time of a calibration not of this machine (render.py's marker)."""
    c = plan.get("calibration") or {}
    if c.get("reference"):
        return " (reference calibration)"
    return " (unmeasured)" if c.get("measured") is False else ""


def kinds_lines(plan: dict) -> list[str]:
    """The console view: a table of the payloads (their class's label), then what each says under it, the
    encode and decode of the fitted ones, the break-even shares, or the one line that there is no payload fit."""
    k = plan.get("kinds")
    if not k:
        return []
    gbps = f" of {k['floor_gbps']:.3g} GB/s" if k.get("floor_gbps") else ""
    transports = k.get("transports") or []
    mark = marker(plan)
    lines = [
        f"Payloads per update (bytes from the bucket plan; floor: the bytes each side's kernels must read and write, "
        f"as the payload declares them, at the copy floor{gbps}; predicted: the transport's cost model for what it "
        "sends + the fitted encode and decode):"
    ]
    head = ["payload", "sent", "of full", "floor (encode + decode)", *(f"{t}{mark}" for t in transports)]
    table, notes, parts = [], [], []
    for name, row in k["rows"].items():
        cls = recorded_class(name)
        label, below = cls.plan_lines(row) if cls is not None else (name, [])
        floor = (
            f"{fmt_seconds(row['floor_s'])} + {fmt_seconds(row['decode_floor_s'])}"
            if row["floor_s"] is not None
            else "-"
        )
        cells = []
        for t in transports:
            p = (row.get("predicted") or {}).get(t)
            cells.append(
                fmt_seconds(p["time_s"]) if p else ("no fit" if row["fit_terms"] and not row["fitted"] else "n/a")
            )
        table.append([label, fmt_bytes(row["bytes"]), fmt_share(row["share"]), floor, *cells])
        notes += [f"  {line}" for line in below]
        fitted = [(t, p) for t, p in (row.get("predicted") or {}).items() if p and p["encode_s"] is not None]
        if fitted:  # the fitted sides are the same over every transport; the transport's part is its own
            _, first = fitted[0]
            parts.append(
                f"  {label}: encode {fmt_seconds(first['encode_s'])} + decode {fmt_seconds(first['decode_s'])} "
                "(fitted) + the transport's part ("
                + ", ".join(f"{t} {fmt_seconds(p['transport_s'])}" for t, p in fitted)
                + ")"
            )
    lines += [markdown_table(head, table) if transports else markdown_table(head[:4], table), *notes, *parts]
    if k.get("unfitted"):
        names = "|".join(k["unfitted"])
        lines.append(
            f"No payload fit in the calibration: {', '.join(k['unfitted'])} not predicted ({FIT_COMMAND} fits their "
            f"encode and decode; or plan.fit_from=DIR over bench runs of update.payload={names})"
        )
    for name, per in (k.get("break_even") or {}).items():
        cls = recorded_class(name)
        title = cls.title if cls is not None else name
        said = []
        for t, b in per.items():
            if b["pays"] == "never":
                said.append(
                    f"over {t} none, slower even at 0 % changed ({fmt_seconds(b['at_zero_s'])} against "
                    f"{fmt_seconds(b['full_s'])})"
                )
            elif b["pays"] == "always":
                said.append(f"over {t} none, faster at any changed share")
            elif b["share"] < ONLY_AT_ZERO:  # the first changed element's per-tensor costs already tip it
                said.append(
                    f"over {t} faster only when nothing changed ({fmt_seconds(b['at_zero_s'])} at 0 % against "
                    f"{fmt_seconds(b['full_s'])})"
                )
            else:
                said.append(f"over {t} {fmt_share(b['share'])} changed (faster below it)")
        lines.append(
            f"Break-even share of {title} against the full update (predicted from the payload fit{mark}): "
            + "; ".join(said)
        )
    changing = [n for n, r in k["rows"].items() if "changed" in r["fit_terms"]]
    if changing:
        lines.append(
            f"{', '.join(changing)}: predicted at plan.changed_ratio={k['changed_ratio']:g} (the share of elements one "
            "step changes; its bytes, floor and time depend on it)"
        )
    return lines
