"""From per-step metrics to a run's summary: medians after warm-up, shares of the step, the verdict."""

from __future__ import annotations

import statistics

from rlsync.fmt import fmt_bytes, fmt_range, fmt_seconds, fmt_share, fmt_sig, fmt_spread, markdown_table
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


def share_verdict(update: float, threshold: float) -> str:
    """The verdict's judgement, in the one phrasing the run, the bench-less report row and docs use."""
    if update < threshold:
        return (
            f"The weight update is {fmt_share(update)} of the step (under {fmt_share(threshold)}): not the step to tune"
        )
    return f"The weight update is {fmt_share(update)} of the step (over {fmt_share(threshold)}): worth tuning"


def verdict(share: dict[str, float], stats: dict, *, threshold: float, setup: dict) -> str:
    if "update_weights" not in share:
        return "No measured step timed the weight update: nothing to judge."
    update = share["update_weights"]
    others = {p: s for p, s in share.items() if p != "update_weights"}
    largest = max(others, key=others.get) if others else "update_weights"
    sent = sent_phrase(setup)
    if update < threshold:
        return (
            f"{share_verdict(update, threshold)}; the largest phase is {largest} "
            f"({fmt_share(others.get(largest, 0))} of the step).{sent}"
        )
    efficiency = stats.get("perf/update_weights_efficiency", {}).get("median")
    at_limit = f", at {fmt_sig(efficiency)} of the copy floor" if efficiency else ""
    units = stats["perf/update_weights_buckets"]["median"]
    how = (
        f"strategy=per_tensor ({units:.0f} tensors, one copy each)"
        if setup["strategy"] == "per_tensor"
        else f"strategy={setup['strategy']}, bucket {setup['bucket_mb']:g} MiB ({units:.0f} buckets)"
    )
    return f"{share_verdict(update, threshold)}. This run used transport={setup['transport']}, {how}{at_limit}.{sent}"


def payload_line(stats: dict) -> str | None:
    """A payload other than full (update.delta, update.wire_dtype): the bytes that crossed against the full
    update's, the share of elements that changed (a delta) and the encoding's time (medians over the
    measured updates); None for a full update."""
    full = stats.get("perf/update_weights_full_bytes", {}).get("median")
    if not full:
        return None
    sent = stats["perf/update_weights_bytes"]["median"]
    changed = stats.get("perf/update_weights_changed_ratio")
    encode = stats.get("perf/update_weights_encode_time", {}).get("median")
    took = f"; encoding took {fmt_seconds(encode)} of the update" if encode is not None else ""
    what = (
        f"Delta (update.delta=true): {fmt_share(changed['median'])} of the elements changed per update (median), "
        if changed
        else "FP8 on the wire (update.wire_dtype=float8_e4m3fn): "
    )
    return f"{what}{fmt_bytes(sent)} sent of the full {fmt_bytes(full)} ({fmt_share(sent / full)}){took}."


def sent_phrase(setup: dict) -> str:
    """What the update sent: how many tensors, in which layout (a MoE model's differ by 35x)."""
    if setup.get("update_tensors") is None:
        return ""
    return f" Each update sent {setup['update_tensors']:,} tensors (model.update_layout={setup['update_layout']})."


NOISE_SPREAD = 0.5  # a step whose slowest and fastest measured steps differ by more than half its median


def noise_warning(stats: dict) -> str | None:
    """A line when the measured steps spread wide around their median: one run's figures may be noise."""
    step = stats.get("perf/step_time")
    if not step or not step["median"] or (step["max"] - step["min"]) / step["median"] <= NOISE_SPREAD:
        return None
    return (
        f"the measured steps spread from {fmt_range(step['min'], step['max'])} around a median of "
        f"{fmt_seconds(step['median'])}: these numbers may be noise (a busy machine, or too few steps: raise run.steps)"
    )


def setup_phrase(setup: dict) -> str:
    """The update's setup in a few words, for the closing table: "direct, bucketed 512 MiB, scheme rlsync"."""
    strategy = setup.get("strategy")
    how = f"bucketed {setup['bucket_mb']:g} MiB" if strategy == "bucketed" and setup.get("bucket_mb") else strategy
    parts = [setup.get("transport"), how, f"scheme {setup['scheme']}" if setup.get("scheme") else None]
    if (setup.get("ranks") or 1) > 1:
        parts.append(f"{setup['ranks']} ranks")
    return ", ".join(str(p) for p in parts if p)


def closing_table(model: str, stats: dict, share: dict, setup: dict | None = None) -> str:
    """The run's closing table: the setup, each headline phase's median with its range over the measured
    steps, and the update's share."""
    headline = [metrics.phase_named(name) for name in metrics.HEADLINE]
    cells = []
    for p in headline:
        st = stats.get(p.metric.name)
        cells.append(fmt_spread(st["median"], st["min"], st["max"]) if st else "n/a")
    update = fmt_share(share.get("update_weights"))
    header = ["model", "update setup", *(f"{p.label} median (range)" for p in headline), "update share of step"]
    return markdown_table(header, [[model, setup_phrase(setup or {}) or "n/a", *cells, update]])
