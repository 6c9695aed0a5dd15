"""From per-step metrics to a run's summary: medians after warm-up, shares of the step, the verdict."""

from __future__ import annotations

import statistics

from rlsync.fmt import fmt_range, fmt_share, fmt_sig, markdown_table
from rlsync.measure import metrics


def stats_over(rows: list[dict], warmup_steps: int) -> dict[str, dict[str, float]]:
    """Per numeric metric: median, min and max over the steps from `warmup_steps` on."""
    measured = [r for r in rows if r["step"] >= warmup_steps]
    keys = sorted({k for r in measured for k, v in r.items() if k != "step" and isinstance(v, (int, float))})
    out = {}
    for key in keys:
        values = [r[key] for r in measured if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def shares(stats: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each phase's median over the median step."""
    step = stats.get("perf/step_time", {}).get("median")
    if not step:
        return {}
    timed = [p for p in metrics.step_phases() if p.metric.name in stats]
    return {p.name: stats[p.metric.name]["median"] / step for p in timed}


def verdict(share: dict[str, float], stats: dict, *, threshold: float, setup: dict) -> str:
    if "update_weights" not in share:
        return "No measured step timed the weight update: nothing to judge."
    update = share["update_weights"]
    others = {p: s for p, s in share.items() if p != "update_weights"}
    largest = max(others, key=others.get) if others else "update_weights"
    sent = sent_phrase(setup)
    if update < threshold:
        return (
            f"The weight update is {fmt_share(update)} of the step (under {fmt_share(threshold)}): not the step "
            f"to tune; the largest phase is {largest} ({fmt_share(others.get(largest, 0))} of the step).{sent}"
        )
    efficiency = stats.get("perf/update_weights_efficiency", {}).get("median")
    at_limit = f", at {fmt_sig(efficiency)} of the copy limit" if efficiency else ""
    units = stats["perf/update_weights_buckets"]["median"]
    how = (
        f"strategy=per_tensor ({units:.0f} tensors, one copy each)"
        if setup["strategy"] == "per_tensor"
        else f"strategy={setup['strategy']}, bucket {setup['bucket_mb']:g} MiB ({units:.0f} buckets)"
    )
    return (
        f"The weight update is {fmt_share(update)} of the step (over {fmt_share(threshold)}): worth tuning. "
        f"This run used transport={setup['transport']}, {how}{at_limit}.{sent}"
    )


def sent_phrase(setup: dict) -> str:
    """What the update sent: how many tensors, in which layout (a MoE model's differ by 35x)."""
    if setup.get("update_tensors") is None:
        return ""
    return f" Each update sent {setup['update_tensors']:,} tensors (model.update_layout={setup['update_layout']})."


def closing_table(model: str, stats: dict, share: dict) -> str:
    """The run's closing table: the headline phases' ranges over the measured steps, and the update's share."""
    headline = [metrics.phase_named(name) for name in metrics.HEADLINE]
    ranges = [
        fmt_range(stats[p.metric.name]["min"], stats[p.metric.name]["max"]) if p.metric.name in stats else "n/a"
        for p in headline
    ]
    update = fmt_share(share.get("update_weights"))
    return markdown_table(["model", *(p.label for p in headline), "update share of step"], [[model, *ranges, update]])
