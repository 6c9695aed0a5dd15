"""The update's payload kinds side by side, from the config alone: bytes per update and their copy floor.

For each kind (full, FP8 on the wire, a delta at `plan.changed_ratio`, and with trainer.lora.rank > 0 the
adapters alone) the bytes one update sends, from the same bucket plan and byte layouts the payloads use,
and the floor of its time: the bytes the trainer's side reads and writes at the copy floor (GB/s read +
written). The delta adds its compare: each bucket is packed as the full update packs it, then its last
values read and a changed mask written, so at the floor of one machine's memory it never beats the full
update; it pays only where the bytes then cross a link slower than memory, and `delta_pays_below_gbps`
is that link's speed: below it, the bytes saved take longer on the link than the compare costs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from rlsync.check.estimate import DTYPE_BYTES
from rlsync.fmt import fmt_bytes, fmt_seconds, fmt_share
from rlsync.model.lora import adapter_shapes
from rlsync.update.buckets import Bucket
from rlsync.update.payload.delta import INDEX_BYTES
from rlsync.update.payload.fp8 import layout as fp8_layout

LORA_RANK_SHOWN = 16  # the adapter row when trainer.lora.rank is 0: the rank the field's recipes use


def kinds(cfg, buckets: list[Bucket], model_shapes, floor_gbps: Optional[float]) -> dict:
    """plan.json's `kinds`: per kind its bytes, share of the full update's and floor seconds."""
    t, e = DTYPE_BYTES[cfg.trainer.dtype], DTYPE_BYTES[cfg.rollout.dtype]
    ratio = cfg.plan.changed_ratio if getattr(cfg, "plan", None) is not None else 0.05
    full = sum(b.nbytes for b in buckets)
    elements = sum(b.numel for b in buckets)
    delta = sum(min(b.nbytes, round(ratio * b.numel) * (INDEX_BYTES + e)) for b in buckets)
    lora = cfg.trainer.lora
    rank = lora.rank or LORA_RANK_SHOWN
    adapters = adapter_shapes(list(model_shapes), dataclasses.replace(lora, rank=rank))
    adapter_elements = sum(a * b for _, (a, b) in adapters)
    rows = {
        "full": {"bytes": full, "moved": elements * (t + e)},
        "fp8": {"bytes": sum(fp8_layout(b)[1] for b in buckets), "moved": elements * (t + e)},  # reads all, casts
        "delta": {
            "bytes": delta,
            "changed_ratio": ratio,
            # pack (read t, write e), read the last values (e), write the mask (1), then the sparse bytes
            "moved": elements * (t + 2 * e + 1) + delta,
        },
        "lora_adapter": {"bytes": adapter_elements * e, "moved": adapter_elements * (t + e), "rank": rank},
    }
    for row in rows.values():
        row["share"] = row["bytes"] / full if full else None
        row["floor_s"] = row.pop("moved") / (floor_gbps * 1e9) if floor_gbps else None
    out = {"rows": rows, "floor_gbps": floor_gbps, "lora_configured": bool(lora.rank)}
    if floor_gbps:
        compare_s = elements * (e + 1) / (floor_gbps * 1e9)  # what the delta adds before any byte crosses
        saved = full - delta
        out["delta_pays_below_gbps"] = saved / compare_s / 1e9 if saved > 0 else 0.0
    return out


def kinds_lines(plan: dict) -> list[str]:
    """The console view: one line per kind, and where the delta pays."""
    k = plan.get("kinds")
    if not k:
        return []
    rows = k["rows"]
    lines = ["Payload kinds per update (bytes from the bucket plan; floor: bytes read + written at the copy floor):"]
    names = {
        "full": "full",
        "fp8": "FP8, 128x128 blocks (update.wire_dtype=float8_e4m3fn)",
        "delta": f"delta at {fmt_share(rows['delta']['changed_ratio'])} changed (update.delta=true)",
        "lora_adapter": f"LoRA rank {rows['lora_adapter']['rank']} adapters only (update.lora=adapter"
        + ("" if k["lora_configured"] else "; with trainer.lora.rank=16")
        + ")",
    }
    for key, row in rows.items():
        floor = f", floor {fmt_seconds(row['floor_s'])}" if row["floor_s"] is not None else ""
        lines.append(f"  {names[key]}: {fmt_bytes(row['bytes'])} ({fmt_share(row['share'])}){floor}")
    if k.get("delta_pays_below_gbps") is not None:
        lines.append(
            f"  The delta never beats the full update in one machine's memory (it packs as the full update does, "
            f"then compares); it pays only where the bytes cross a link slower than "
            f"{k['delta_pays_below_gbps']:.2f} GB/s at this changed ratio."
        )
    return lines
