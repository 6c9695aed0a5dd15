"""The known pain, sized from benchmark runs, and the planner's cost model fitted to them.

For the update benchmarks among a report's runs (`rlsync.bench`, target update):

- a tensor larger than the bucket: a bucket exceeds `update.bucket_mb` only when one tensor does, and
  it then travels alone and the staging buffer grows to it;
- the staging memory of each bucket size (the update's peak bytes, staging included);
- the per-tensor overhead share: (per_tensor time - bucketed time) / per_tensor time, for each model,
  transport and bucket size where both strategies are in the runs;
- the cost model's coefficients fitted to these runs (rlsync.plan.cost), written as calibration.json
  beside the report, which `python -m rlsync.plan plan.calibration=<it>` plans with.
"""

from __future__ import annotations

from typing import Optional

from rlsync.fmt import MIB, fmt_bytes, fmt_seconds, fmt_share
from rlsync.report.runs import Run

SETUP_KEYS = ("transport", "strategy", "bucket_mb")  # what a summary must say for its run to be sized


def update_benches(runs: list[Run]) -> list[Run]:
    """The update benchmarks whose summary says what this section needs (older or partial records are left out)."""
    return [
        r
        for r in runs
        if r.summary.get("kind") == "bench"
        and r.summary.get("target") == "update"
        and r.stat("perf/update_weights_time")
        and all(k in r.summary.get("setup", {}) for k in SETUP_KEYS)
        and "name" in r.summary.get("model", {})
    ]


def pain_lines(runs: list[Run]) -> list[str]:
    benches = update_benches(runs)
    out = []
    for r in benches:
        s, m = r.summary["setup"], r.summary["model"]
        cap = s["bucket_mb"] * MIB
        if s["strategy"] == "bucketed" and (s.get("largest_bucket_bytes") or 0) > cap:
            out.append(
                f"- tensor larger than the bucket: {m['name']} at {s['bucket_mb']:g} MiB: its largest bucket is "
                f"{fmt_bytes(s['largest_bucket_bytes'])}, one tensor alone ({r.job})"
            )
    staging = {}
    for r in benches:
        s = r.summary["setup"]
        key = (
            r.summary["model"]["name"],
            s["transport"],
            s["strategy"],
            s["bucket_mb"] if s["strategy"] == "bucketed" else None,
        )
        staging[key] = r.stat("perf/update_weights_peak_bytes", "max")
    for (model, transport, strategy, mb), peak in sorted(staging.items(), key=lambda kv: tuple(map(str, kv[0]))):
        if peak:
            out.append(
                f"- staging memory: {model} {transport} {strategy}{f' {mb:g} MiB' if mb else ''}: {fmt_bytes(peak)} "
                "(the update's peak bytes, staging included)"
            )
    for line in per_tensor_shares(benches):
        out.append(f"- per-tensor overhead share: {line}")
    return out or ["No update benchmark among the runs."]


def per_tensor_shares(benches: list[Run]) -> list[str]:
    by = {}
    for r in benches:
        s = r.summary["setup"]
        by.setdefault((r.summary["model"]["name"], s["transport"], bool(s.get("flat_engine_weights"))), []).append(r)
    out = []
    for (model, transport, _flat), group in sorted(by.items()):
        per_tensor = [r for r in group if r.summary["setup"]["strategy"] == "per_tensor"]
        if not per_tensor:
            continue
        pt = per_tensor[0].stat("perf/update_weights_time")
        for b in sorted(
            (r for r in group if r.summary["setup"]["strategy"] == "bucketed"),
            key=lambda r: r.summary["setup"]["bucket_mb"],
        ):
            bt = b.stat("perf/update_weights_time")
            share = (pt - bt) / pt
            out.append(
                f"{model} {transport} at {b.summary['setup']['bucket_mb']:g} MiB: {fmt_share(share)} "
                f"(per_tensor {fmt_seconds(pt)}, bucketed {fmt_seconds(bt)})"
            )
    return out


def cost_fit(runs: list[Run]) -> Optional[dict]:
    """The planner's calibration fitted to these runs, or None where none is an update benchmark."""
    from rlsync.plan.calibrate import calibration_file, observation

    def observed(run: Run):
        try:
            return observation(run.summary, str(run.path))
        except (KeyError, TypeError, ValueError, ZeroDivisionError):  # a summary without the counts the fit needs
            return None

    observations = [o for o in map(observed, runs) if o is not None]
    if not observations:
        return None
    data = calibration_file(observations, device=str(runs[0].summary.get("machine", {}).get("device", "?")))
    data["machine"].update(
        {k: v for k, v in runs[0].summary.get("machine", {}).items() if k in ("cpus", "torch", "gpu")}
    )
    data["machine"]["fitted_from_runs"] = True
    return data


def cost_fit_lines(data: Optional[dict]) -> list[str]:
    if data is None:
        return ["No update benchmark among the runs: nothing to fit."]
    from rlsync.plan.calibrate import coefficient_lines

    return [
        "time = calls x per_call + tensors x per_tensor + moved bytes / bandwidth (rlsync/plan/cost.py), per setup; "
        "written to calibration.json here (`python -m rlsync.plan plan.calibration=calibration.json`):",
        "",
        "    " + "\n    ".join(line.strip() for line in coefficient_lines(data)),
    ]
