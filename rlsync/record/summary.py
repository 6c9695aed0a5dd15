"""From per-step metrics to a run's summary: medians after warm-up, shares of the step, the verdict."""

from __future__ import annotations

import statistics

from rlsync.errors import show
from rlsync.fmt import fmt_bytes, fmt_range, fmt_seconds, fmt_share, fmt_sig, fmt_spread, markdown_table
from rlsync.measure import metrics
from rlsync.measure.threads import assumed_quiet, load_warning
from rlsync.update.payload import recorded_class


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


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def engine_idle(rows: list[dict], warmup_steps: int) -> dict | None:
    """perf/engine_idle_time over the measured steps with its parts, each part read from the row that
    carries it for the same interval (metrics.IDLE_PARTS: the engine's in the idle's row, the trainer's
    phases in the row before): per part, and for what no part holds ("unaccounted"), the median, min
    and max over the intervals. None where no measured step logged an idle time."""
    by_step = {r["step"]: r for r in rows if isinstance(r.get("step"), int)}
    intervals = []
    for step, row in by_step.items():
        idle, before = row.get("perf/engine_idle_time"), by_step.get(step - 1)
        if step < warmup_steps or not isinstance(idle, (int, float)) or before is None:
            continue
        parts = {}
        for part in metrics.IDLE_PARTS:
            value = (row if part.row == 0 else before).get(part.metric)
            if isinstance(value, (int, float)):
                parts[part.metric] = value
        intervals.append((idle, parts))
    if not intervals:
        return None
    names = [p.metric for p in metrics.IDLE_PARTS if any(p.metric in parts for _, parts in intervals)]
    return {
        "time": spread([idle for idle, _ in intervals]),
        "parts": {name: spread([parts.get(name, 0.0) for _, parts in intervals]) for name in names},
        "unaccounted": spread([idle - sum(parts.values()) for idle, parts in intervals]),
        "intervals": len(intervals),
    }


IDLE_PARTS_SHOWN = 3  # the closing table's and the report's largest parts of the idle time


def idle_parts_phrase(idle: dict, shown: int = IDLE_PARTS_SHOWN) -> str:
    """The idle time's largest parts by median: "training 0.14 s, log-probs 44 ms, trainer onload 3.1 ms"."""
    labels = metrics.declared()
    parts = sorted(idle["parts"].items(), key=lambda kv: -kv[1]["median"])[:shown]
    return ", ".join(
        f"{labels[name].label if name in labels else name} {fmt_seconds(st['median'])}" for name, st in parts
    )


def idle_update_share(idle: dict) -> float | None:
    """The weight update's median part of the median idle time."""
    update = idle["parts"].get("perf/update_weights_time")
    return update["median"] / idle["time"]["median"] if update and idle["time"]["median"] else None


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


# An update slower than this share of its own copy floor (efficiency = floor / time) on a machine that was
# not quiet is taken for a broken measurement, not a finding: on a busy 2-core machine a 2-thread copy ran at
# 0.00031 of its floor, 100x slower than on 1 thread, and the run called the update "worth tuning" (issue 42).
# Only with a sign of a busy machine: a quiet machine's per-tensor ipc or broadcast update really runs at
# 0.001 of a memcpy floor (its hand-offs and sockets are what the floor leaves out), a finding to keep.
BROKEN_EFFICIENCY = 0.05
FLOOR_METRIC = "perf/update_weights_limit_time"  # the update's copy floor, timed beside each step or repeat


def busy_signs(stats: dict, cpu: dict | None) -> list[str]:
    """What says the machine was not quiet while the update was timed: other processes' busy cores (at start,
    during the run: `load_warning`'s bar), the copy floor or the step moving by more than NOISE_SPREAD of its
    median, or a load that could not be measured (`cpu` None, or no figure). None with QUIET_ENV=1 (the test suite)."""
    if assumed_quiet():
        return []
    signs = []
    at_start, during = (cpu or {}).get("others_busy_cores_at_start"), (cpu or {}).get("others_busy_cores_during_run")
    cores = (cpu or {}).get("cores") or 1
    if at_start is None and during is None:
        signs.append("the machine's load is unknown here")
    loads = [
        (x, when) for x, when in ((at_start, "at start"), (during, "during the run")) if load_warning(x, cores, when)
    ]
    if loads:  # "other processes kept 2.0 of the machine's 2 cores busy at start and 1.7 during the run"
        (first, when), rest = loads[0], "".join(f" and {x:.1f} {w}" for x, w in loads[1:])
        signs.append(f"other processes kept {first:.1f} of the machine's {cores} cores busy {when}{rest}")
    for key, what in ((FLOOR_METRIC, "the copy floor"), ("perf/step_time", "the step")):
        st = stats.get(key)
        if st and st["median"] and (st["max"] - st["min"]) / st["median"] > NOISE_SPREAD:
            signs.append(f"{what} moved from {fmt_range(st['min'], st['max'])} around {fmt_seconds(st['median'])}")
    return signs


def distrust(stats: dict, cpu: dict | None) -> str | None:
    """Why the update's times cannot carry a verdict or a ranking (summary.json `verdict_untrusted_reason`), or
    None: the update ran at under BROKEN_EFFICIENCY of its copy floor while something says the machine was busy."""
    efficiency = stats.get("perf/update_weights_efficiency", {}).get("median")
    if efficiency is None or efficiency >= BROKEN_EFFICIENCY:
        return None
    signs = busy_signs(stats, cpu)
    if not signs:
        return None
    return (
        f"the update ran at {fmt_sig(efficiency)} of its copy floor (under {BROKEN_EFFICIENCY:g}) while "
        f"{'; '.join(signs)}"
    )


def trust_record(stats: dict, cpu: dict | None) -> dict:
    """summary.json's `verdict_trusted` (false: the update's times are a broken measurement, `distrust`) and
    `verdict_untrusted_reason` (why, or null)."""
    reason = distrust(stats, cpu)
    return {"verdict_trusted": reason is None, "verdict_untrusted_reason": reason}


def verdict(
    share: dict[str, float], stats: dict, *, threshold: float, setup: dict, untrusted: str | None = None
) -> str:
    """The run's verdict on its update's share of the step. `untrusted` (`distrust`): the update's times are
    a broken measurement, said with what to do instead of a judgement."""
    if "update_weights" not in share:
        return "No measured step timed the weight update: nothing to judge."
    update = share["update_weights"]
    others = {p: s for p, s in share.items() if p != "update_weights"}
    largest = max(others, key=others.get) if others else "update_weights"
    sent = sent_phrase(setup)
    if untrusted:
        threads = setup.get("copy_threads_used")
        todo = "Rerun on a quiet machine"
        if isinstance(threads, int) and threads > 1:  # the barrier a busy core makes every tensor wait at
            todo += (
                f", or with update.copy_threads=1: it copied on {threads} threads, each tensor waiting for the busiest"
            )
        return (
            f"The weight update measured {fmt_share(update)} of the step, but this measurement is not trustworthy: "
            f"{untrusted}. {todo}.{sent}"
        )
    if update < threshold:
        return (
            f"{share_verdict(update, threshold)}; the largest phase is {largest} "
            f"({fmt_share(others.get(largest, 0))} of the step).{sent}"
        )
    efficiency = stats.get("perf/update_weights_efficiency", {}).get("median")
    at_floor = f", at {fmt_sig(efficiency)} of the copy floor" if efficiency else ""
    units = stats["perf/update_weights_buckets"]["median"]
    how = (
        f"strategy=per_tensor ({units:.0f} tensors, one copy each)"
        if setup["strategy"] == "per_tensor"
        else f"strategy={setup['strategy']}, bucket {setup['bucket_mb']:g} MiB ({units:.0f} buckets)"
    )
    return f"{share_verdict(update, threshold)}. This run used transport={setup['transport']}, {how}{at_floor}.{sent}"


def payload_line(stats: dict, payload: str | None, kernels: str | None = None) -> str | None:
    """A payload other than full (update.payload, as its class calls itself): the bytes that crossed
    against the full update's, the share of elements that changed (a payload that compares), the encoding's time
    (medians over the measured updates) and the kernels that ran (setup's `payload_kernels`, where recorded);
    None for a full update."""
    full = stats.get("perf/update_weights_full_bytes", {}).get("median")
    if not full:
        return None
    sent = stats["perf/update_weights_bytes"]["median"]
    changed = stats.get("perf/update_weights_changed_ratio")
    encode = stats.get("perf/update_weights_encode_time", {}).get("median")
    took = f"; encoding took {fmt_seconds(encode)} of the update" if encode is not None else ""
    cls = recorded_class(payload)  # a run recorded before update.payload: its name then
    what = cls.phrase() if cls is not None else f"The {payload} payload"
    if changed:
        what += f": {fmt_share(changed['median'])} of the elements changed per update (median),"
    else:
        what += ":"
    line = f"{what} {fmt_bytes(sent)} sent of the full {fmt_bytes(full)} ({fmt_share(sent / full)}){took}."
    floor = stats.get("perf/update_weights_sent_limit_time", {}).get("median")
    seconds = stats.get("perf/update_weights_time", {}).get("median")
    if floor and seconds:
        line += (
            f" The copy floor of what crossed: {fmt_seconds(floor)} (time / that floor: {fmt_sig(seconds / floor)}x)."
        )
    merge = stats.get("update/lora_merge_error", {}).get("median")
    if merge is not None:
        low = stats["update/lora_merge_error_in_dtype"]["median"]
        differ = stats["update/lora_merge_differ_ratio"]["median"]
        line += (
            f" The engine's weights against the exact W + s*BA (median, ||error|| / ||s*BA||): {fmt_sig(merge)}"
            f" merged in fp32 then cast (the nearest engine-dtype weights), {fmt_sig(low)} merged in the"
            f" engine's dtype ({fmt_share(differ)} of the merged elements differ)."
        )
    if kernels:
        line += f" Kernels: {kernels}."
    return line


def sent_phrase(setup: dict) -> str:
    """What the update sent: how many tensors, in which layout (a MoE model's differ by 35x)."""
    if setup.get("update_tensors") is None:
        return ""
    if setup.get("adapter_tensors"):
        return (
            f" The first update sent {setup['update_tensors']:,} tensors (model.update_layout={setup['update_layout']}),"
            f" each later one the {setup['adapter_tensors']:,} adapter tensors."
        )
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


def floor_record(stats: dict) -> dict | None:
    """summary.json's `floor`: the update's copy floor over the measured steps or repeats, median, min, max
    and `spread` ((max - min) / median), so floors of runs compared can be checked against each other (a
    bench sweep's floor moved 0.44 / 0.73 / 0.21 s between jobs of one model on a busy machine: issue 42);
    None where no step timed it."""
    st = stats.get(FLOOR_METRIC)
    if not st or not st["median"]:
        return None
    return {**st, "spread": (st["max"] - st["min"]) / st["median"]}


def floor_warning(floor: dict | None, over: str) -> str | None:
    """A line when the copy floor moved by more than NOISE_SPREAD of its median `over` the steps or repeats."""
    if not floor or floor["spread"] <= NOISE_SPREAD:
        return None
    return (
        f"the copy floor moved from {fmt_range(floor['min'], floor['max'])} around {fmt_seconds(floor['median'])} "
        f"over the {over}: the machine's memory bandwidth changed under the measurement, so times against it "
        f"may be noise (rerun on a quiet machine)"
    )


AUTO_KNOBS = ("flat_engine_weights", "copy_threads")  # update.*=null, resolved with a reason (rlsync.update.auto)


def auto_line(setup: dict, keys: tuple[str, ...] = AUTO_KNOBS) -> str | None:
    """The auto knobs as the update ran them, with why: "update: copy_threads=1 (auto: within the probe's spread:
    ...)"; None where none was resolved."""
    auto = [f"{k}={show(setup[k])} ({setup[k + '_why']})" for k in keys if setup.get(k + "_why")]
    return "update: " + "; ".join(auto) if auto else None


def setup_phrase(setup: dict) -> str:
    """The update's setup in a few words, for the closing table: "direct, bucketed 512 MiB, scheme rlsync"."""
    strategy = setup.get("strategy")
    how = f"bucketed {setup['bucket_mb']:g} MiB" if strategy == "bucketed" and setup.get("bucket_mb") else strategy
    parts = [setup.get("transport"), how, f"scheme {setup['scheme']}" if setup.get("scheme") else None]
    if (setup.get("ranks") or 1) > 1:
        parts.append(f"{setup['ranks']} ranks")
    return ", ".join(str(p) for p in parts if p)


def closing_table(model: str, stats: dict, share: dict, setup: dict | None = None, idle: dict | None = None) -> str:
    """The run's closing table: the setup, each headline phase's median with its range over the measured
    steps, and the update's share; then the engine's idle time (`engine_idle`), its largest parts and
    the update's share of it."""
    headline = [metrics.phase_named(name) for name in metrics.HEADLINE]
    cells = []
    for p in headline:
        st = stats.get(p.metric.name)
        cells.append(fmt_spread(st["median"], st["min"], st["max"]) if st else "n/a")
    update = fmt_share(share.get("update_weights"))
    idle_cells = ["n/a", "n/a", "n/a"]
    if idle:
        t = idle["time"]
        idle_cells = [
            fmt_spread(t["median"], t["min"], t["max"]),
            idle_parts_phrase(idle),
            fmt_share(idle_update_share(idle)),
        ]
    header = [
        "model",
        "update setup",
        *(f"{p.label} median (range)" for p in headline),
        "update share of step",
        "engine idle median (range)",
        "largest idle parts (median)",
        "update share of idle",
    ]
    return markdown_table(header, [[model, setup_phrase(setup or {}) or "n/a", *cells, update, *idle_cells]])
