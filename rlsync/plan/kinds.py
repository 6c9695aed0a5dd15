"""The update's payloads side by side, from the config alone: bytes per update and their copy floor.

Each payload registered under update.payload (rlsync/update/payload) gives its own row (`Payload.planned`): the
bytes one update sends, from the same bucket plan and byte layouts the payloads use, and the floor of its time:
the bytes the trainer's side reads and writes at the copy floor (GB/s read + written). A payload whose bytes
are another's (the merged LoRA update is the full one) has no row; one that compares what changed says below
which link speed it pays (`pays_below_gbps`: in one machine's memory its compare costs what the copy saves).
"""

from __future__ import annotations

from typing import Optional

from rlsync.check.estimate import DTYPE_BYTES
from rlsync.fmt import fmt_bytes, fmt_seconds, fmt_share
from rlsync.update.buckets import Bucket
from rlsync.update.payload import PlanContext, payload_class, payload_names, recorded_class

CHANGED_RATIO = 0.05  # a tree without plan.* (a run's config): plan.changed_ratio's default


def kinds(cfg, buckets: list[Bucket], model_shapes, floor_gbps: Optional[float]) -> dict:
    """plan.json's `kinds`: per payload its bytes, share of the full update's and floor seconds."""
    ctx = PlanContext(
        buckets=buckets,
        trainer_itemsize=DTYPE_BYTES[cfg.trainer.dtype],
        engine_itemsize=DTYPE_BYTES[cfg.rollout.dtype],
        changed_ratio=cfg.plan.changed_ratio if getattr(cfg, "plan", None) is not None else CHANGED_RATIO,
        floor_gbps=floor_gbps,
        model_shapes=list(model_shapes),
        lora=cfg.trainer.lora,
    )
    full = sum(b.nbytes for b in buckets)
    rows = {}
    for name in payload_names():
        row = payload_class(name).planned(ctx)
        if row is None:
            continue
        row["share"] = row["bytes"] / full if full else None
        row["floor_s"] = row.pop("moved") / (floor_gbps * 1e9) if floor_gbps else None
        rows[name] = row
    return {"rows": rows, "floor_gbps": floor_gbps}


def kinds_lines(plan: dict) -> list[str]:
    """The console view: one line per payload (its class's label), then what each says under the table."""
    k = plan.get("kinds")
    if not k:
        return []
    lines = ["Payloads per update (bytes from the bucket plan; floor: bytes read + written at the copy floor):"]
    notes = []
    for name, row in k["rows"].items():
        cls = recorded_class(name)
        label, below = cls.plan_lines(row) if cls is not None else (name, [])
        floor = f", floor {fmt_seconds(row['floor_s'])}" if row["floor_s"] is not None else ""
        lines.append(f"  {label}: {fmt_bytes(row['bytes'])} ({fmt_share(row['share'])}){floor}")
        notes += [f"  {line}" for line in below]
    return lines + notes
