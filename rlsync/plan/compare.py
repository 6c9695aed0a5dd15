"""Plan against benchmark: `python -m rlsync.plan.compare PATH... [--out FILE]`.

PATHs are plan.json files or directories holding them, and benchmark run (or sweep) directories
holding summary.json files, searched recursively. Each finished `rlsync.bench` update run is paired
with the plan of the same model and dtypes, and within it the prediction of the same transport,
strategy, flat engine weights and bucket size; the table puts the predicted time (and its range)
beside the measured median (and min to max), with the error relative to the measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

from rlsync.fmt import fmt_seconds, markdown_table
from rlsync.plan.calibrate import floor_s_per_byte
from rlsync.plan.planner import check_plan

TOLERANCE = 0.25  # the goal: predicted within 25 % of the measured median


def find(paths: Iterable[str | Path], name: str) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_file() and p.name == name:
            out.append(p)
        elif p.is_dir():
            out += sorted(p.rglob(name))
    return out


def load_plans(paths) -> list[dict]:
    plans = []
    for path in find(paths, "plan.json"):
        plan = json.loads(path.read_text())
        check_plan(plan)
        plan["_path"] = str(path)
        plans.append(plan)
    return plans


def load_benches(paths) -> list[dict]:
    out = []
    for path in find(paths, "summary.json"):
        s = json.loads(path.read_text())
        if s.get("kind") == "bench" and s.get("target") == "update" and s.get("status") == "finished":
            s["_path"] = str(path.parent)
            out.append(s)
    return out


def matching_prediction(plans: list[dict], bench: dict) -> tuple[Optional[dict], Optional[dict]]:
    s = bench["setup"]
    flat = bool(s.get("flat_engine_weights")) and s["strategy"] == "bucketed"
    for plan in plans:
        ps = plan["setup"]
        if (plan["model"]["name"], ps["trainer_dtype"], ps["engine_dtype"]) != (
            bench["model"]["name"],
            s["trainer_dtype"],
            s["engine_dtype"],
        ):
            continue
        for row in plan["predictions"]:
            if (row["transport"], row["strategy"], row["flat"]) == (s["transport"], s["strategy"], flat) and (
                s["strategy"] != "bucketed" or row["bucket_mb"] == s["bucket_mb"]
            ):
                return plan, row
    return None, None


def compare(plans: list[dict], benches: list[dict], tolerance: float = TOLERANCE) -> list[dict]:
    """One row per benchmark run: its setup, predicted and measured time, the error."""
    rows = []
    for b in benches:
        plan, pred = matching_prediction(plans, b)
        t = b["metrics"]["perf/update_weights_time"]
        s = b["setup"]
        err = (pred["time_s"] - t["median"]) / t["median"] if pred else None
        floor = floor_s_per_byte(b)
        f = pred.get("at_floor") if pred else None
        at_floor = f["overhead_s"] + f["floor_multiple"] * pred["moved_bytes"] * floor if f and floor else None
        floor_err = (at_floor - t["median"]) / t["median"] if at_floor else None
        rows.append(
            {
                "model": b["model"]["name"],
                "transport": s["transport"] + (" flat" if s.get("flat_engine_weights") else ""),
                "strategy": s["strategy"],
                "bucket_mb": s["bucket_mb"] if s["strategy"] == "bucketed" else None,
                "calls": pred["calls"] if pred else None,
                "tensors": b["model"]["tensors"],
                "predicted_s": pred["time_s"] if pred else None,
                "low_s": pred["low_s"] if pred else None,
                "high_s": pred["high_s"] if pred else None,
                "measured_s": t["median"],
                "min_s": t["min"],
                "max_s": t["max"],
                "error": err,
                "within": err is not None and abs(err) <= tolerance,
                "in_range": pred is not None and pred["low_s"] <= t["median"] <= pred["high_s"],
                "at_floor_s": at_floor,
                "floor_gbps": 1e-9 / floor if floor else None,
                "floor_error": floor_err,
                "floor_within": floor_err is not None and abs(floor_err) <= tolerance,
                "measured": pred.get("measured") if pred else None,
                "bench": b["_path"],
                "plan": plan["_path"] if plan else None,
            }
        )
    return sorted(rows, key=lambda r: (r["tensors"], r["model"], r["transport"], r["strategy"]))


def table(rows: list[dict], tolerance: float = TOLERANCE) -> str:
    head = [
        "model",
        "transport",
        "strategy",
        "calls",
        "predicted (range)",
        "measured median (min to max)",
        "error",
        f"within {tolerance:.0%}",
        "at the bench's copy floor",
        "error",
    ]
    body = [
        [
            r["model"],
            r["transport"],
            r["strategy"] + (f" {r['bucket_mb']:g} MiB" if r["bucket_mb"] else ""),
            r["calls"] if r["calls"] is not None else "-",
            (
                f"{fmt_seconds(r['predicted_s'])} ({fmt_seconds(r['low_s'])} to {fmt_seconds(r['high_s'])})"
                + ("" if r["measured"] is not False else " unmeasured")
            )
            if r["predicted_s"] is not None
            else "no plan",
            f"{fmt_seconds(r['measured_s'])} ({fmt_seconds(r['min_s'])} to {fmt_seconds(r['max_s'])})",
            f"{r['error'] * 100:+.1f} %" if r["error"] is not None else "-",
            ("yes" if r["within"] else "NO") if r["error"] is not None else "-",
            f"{fmt_seconds(r['at_floor_s'])} ({r['floor_gbps']:.1f} GB/s)" if r.get("at_floor_s") else "-",
            f"{r['floor_error'] * 100:+.1f} %" if r.get("floor_error") is not None else "-",
        ]
        for r in rows
    ]
    return markdown_table(head, body)


def write(paths: list[str], out: Optional[Path], tolerance: float = TOLERANCE) -> tuple[str, list[dict]]:
    plans, benches = load_plans(paths), load_benches(paths)
    if not benches:
        raise SystemExit(f"rlsync.plan.compare: no finished rlsync.bench update run under {' '.join(paths)}")
    rows = compare(plans, benches, tolerance)
    cal = {p["calibration"]["describe"] for p in plans}
    scored = [r for r in rows if r["error"] is not None]
    text = "\n".join(
        [
            "Predicted (rlsync.plan) against measured (rlsync.bench, median of the timed repeats) update time.",
            "",
            *(f"Calibration: {c}" for c in sorted(cal)),
            "",
            table(rows, tolerance),
            "",
            f"{sum(r['within'] for r in scored)} of {len(scored)} predictions within {tolerance:.0%} of the measured median"
            + (f"; {len(rows) - len(scored)} runs without a matching plan" if len(scored) < len(rows) else "")
            + "; at "
            f"each bench's own copy floor {sum(r['floor_within'] for r in scored)} of "
            f"{sum(r['floor_error'] is not None for r in scored)}.",
            "",
            "predicted: the plan's time, from the calibration's absolute bandwidth (its range: the fit's worst residual or "
            "the repeats' spread). At the bench's copy floor: the same model fitted with bytes in units of each run's copy "
            "floor (rlsync.measure.floors, re-timed beside every repeat), evaluated at the floor the benchmark measured: what the "
            "plan predicts once the machine's floor at that moment is known (plan.copy_gbps).",
        ]
    )
    if out:
        Path(out).write_text(text + "\n")
        Path(out).with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    return text, rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlsync.plan.compare", description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="plan.json files, bench run dirs, or directories holding them")
    ap.add_argument("--out", type=Path, help="write the markdown table here (and the rows as JSON beside it)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help="relative error counted as a hit (0.25)")
    args = ap.parse_args(argv)
    text, _rows = write(args.paths, args.out, args.tolerance)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
