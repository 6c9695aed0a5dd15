"""One table row per run (raw seconds, bytes and ratios, the columns of report.csv) and each run's
verdict: the share of its step, or for a bench what it timed against the copy floor."""

from __future__ import annotations

from typing import Any, Optional

from rlsync.bench.stall import METRIC, compared, measured_policies
from rlsync.bench.vllm_paths import VllmPathsTarget
from rlsync.config.apps import RENAMED_TARGETS, update_policy_names
from rlsync.config.schema import VERDICT_THRESHOLD
from rlsync.fmt import fmt_bytes, fmt_seconds, is_number
from rlsync.measure import metrics
from rlsync.record.summary import (
    FLOOR_METRIC,
    NOISE_SPREAD,
    distrust,
    engine_idle,
    idle_update_share,
    share_verdict,
)
from rlsync.report.cells import PER_TENSOR, engine_phrase, fmt_bucket
from rlsync.report.runs import Run
from rlsync.update.payload import recorded_payload

UPDATE_PARTS = ("gather", "pack", "transfer", "load")  # perf/update_weights_<part>_time, in the order they run

# report.csv columns: raw seconds, bytes and ratios (never formatted strings); between these two,
# each of the step's parts (the catalogue's, rlsync/measure/metrics.py) as <phase>_time_median: see csv_fields().
CSV_HEAD = (
    "job", "overrides", "status", "model", "params", "engine", "scheme", "transport", "payload", "strategy", "bucket_mb",
    "flat_engine_weights", "device", "measured_steps",
    "update_time_min", "update_time_median", "update_time_max",
    "step_time_min", "step_time_max",
    "sleep_time_min", "sleep_time_median", "sleep_time_max",
    "wake_up_time_min", "wake_up_time_median", "wake_up_time_max",
)  # fmt: skip
CSV_TAIL = (
    "update_share", "update_efficiency_median", "update_limit_time_median", "update_gbps_median",
    "update_bytes", "update_full_bytes", "update_changed_ratio_median", "update_buckets_median", "update_peak_bytes_max",
    *(f"update_{side}_{what}_median" for side in ("encode", "decode") for what in ("time", "limit_time", "efficiency")),
    "release_level", "engine_idle_time_min", "engine_idle_time_median", "engine_idle_time_max", "update_idle_share",
)  # fmt: skip
CSV_END = (
    "update_limit_time_min", "update_limit_time_max", "copy_threads", "payload_kernels", "cpu_threads", "cpu_cores",
    "broken", "started_at", "ended_at", "verdict",
)  # fmt: skip


def csv_fields() -> tuple[str, ...]:
    """report.csv's columns: the setup, the headline ranges, the median of every part of the step, the update's."""
    phases = [f"{p.name}_time_median" for p in metrics.step_phases()]
    return tuple(
        dict.fromkeys([*CSV_HEAD, *phases, "step_time_median", *CSV_TAIL, *stall_fields(), *CSV_END, *IMPORTED_FIELDS])
    )


STALL_COLUMNS = ("max_gap_time_median", "receive_time_median", "tokens_ratio_median")  # <policy>_<column>


def stall_fields() -> list[str]:
    """report.csv's stall bench columns: each registered update policy's longest gap, receive and tokens ratio,
    then the compared policy's gap over the baseline's (stage_gap_ratio_median)."""
    names = update_policy_names()
    pair = compared(names)
    return [f"{p}_{c}" for p in names for c in STALL_COLUMNS] + ([f"{pair[0]}_gap_ratio_median"] if pair else [])


IMPORTED_FIELDS = ("source", "framework")  # another framework's run (rlsync/report/imported.py): its format and map


def table_row(run: Run) -> dict[str, Any]:
    """One run's numbers, raw (seconds, bytes, ratios), keyed by CSV_FIELDS (and a few extras)."""
    setup = run.summary.get("setup") or {}
    model = run.summary.get("model") or {}
    row: dict[str, Any] = {
        "job": run.job,
        "overrides": " ".join(run.overrides),
        "override_list": list(run.overrides),
        "status": run.status,
        "model": model.get("name") or run.cfg("model.name"),
        "params": model.get("params"),
        "engine": setup.get("engine") or run.cfg("rollout.engine", "hf"),
        # VLLM_RELOAD_MODE as the run set it (summary.json's setup, else its config); None: vLLM's default, or not vLLM
        "vllm_reload_mode": setup.get("vllm_reload_mode", run.cfg("rollout.vllm_reload_mode")),
        "scheme": setup.get("scheme") or run.cfg("update.scheme"),  # scheme=NAME (rlsync/conf/scheme/): group by it
        "transport": setup.get("transport") or run.cfg("update.transport"),
        "payload": recorded_payload(setup, run.cfg),  # update.payload, or the keys that chose it before
        "flat_engine_weights": setup.get("flat_engine_weights", run.cfg("update.flat_engine_weights")),  # as resolved
        "strategy": setup.get("strategy") or run.cfg("update.strategy"),
        "bucket_mb": setup.get("bucket_mb", run.cfg("update.bucket_mb")),  # None for per_tensor, below
        "device": setup.get("device") or run.cfg("run.device"),
        "measured_steps": run.measured_steps,
    }
    if row["strategy"] == PER_TENSOR:  # one copy per tensor: no bucket, whatever update.bucket_mb says
        row["bucket_mb"] = None
    for stem, name in (("update_weights", "update"), ("sleep", "sleep"), ("wake_up", "wake_up")):
        for which in ("min", "median", "max"):
            row[f"{name}_time_{which}"] = run.stat(f"perf/{stem}_time", which)
    for phase in metrics.step_phases():  # medians of every part of the step, for the breakdown
        row[f"{phase.name}_time_median"] = run.stat(phase.metric.name)
    row["step_time_median"] = run.stat("perf/step_time")
    row["step_time_min"], row["step_time_max"] = run.stat("perf/step_time", "min"), run.stat("perf/step_time", "max")
    row["update_share"] = update_share(run)
    row["update_efficiency_median"] = run.stat("perf/update_weights_efficiency")
    for which in ("min", "median", "max"):  # the floor beside each step: how much the machine moved under the run
        row[f"update_limit_time_{which}"] = run.stat("perf/update_weights_limit_time", which)
    row["update_gbps_median"] = run.stat("perf/update_weights_gbps")
    sent = run.stat("perf/update_weights_bytes")  # 0 from a payload that found nothing changed
    row["update_bytes"] = sent if sent is not None else model.get("update_bytes")
    row["update_full_bytes"] = run.stat("perf/update_weights_full_bytes")  # a payload other than full: beside its bytes
    row["update_changed_ratio_median"] = run.stat("perf/update_weights_changed_ratio")  # a payload that compares
    for side in ("encode", "decode"):  # a payload other than full against its own floors (rlsync/update/payload)
        for what in ("time", "limit_time", "efficiency"):
            row[f"update_{side}_{what}_median"] = run.stat(f"perf/update_weights_{side}_{what}")
    row["update_buckets_median"] = run.stat("perf/update_weights_buckets")
    row["update_peak_bytes_max"] = run.stat("perf/update_weights_peak_bytes", "max")
    row["update_staging_bytes_max"] = run.stat("perf/update_weights_staging_bytes", "max")
    for part in UPDATE_PARTS:  # the update's own split, where the transport times it (the update-phases plot)
        row[f"update_{part}_time_median"] = run.stat(f"perf/update_weights_{part}_time")
    row["release_level"] = run_release_level(run)
    row["engine_idle"] = idle = run_idle(run)  # the idle time and its parts, from the same intervals
    for which in ("min", "median", "max"):
        row[f"engine_idle_time_{which}"] = idle["time"][which] if idle else None
    row["update_idle_share"] = idle_update_share(idle) if idle else None
    row["client_stalls"] = stalls = client_stalls(run)  # bench.target=stall: what streaming clients saw, per policy
    for policy, f in (stalls or {}).items():  # report.csv's flat columns
        row[f"{policy}_max_gap_time_median"] = (f["max_gap"] or {}).get("median")
        row[f"{policy}_receive_time_median"] = (f["receive"] or {}).get("median")
        row[f"{policy}_tokens_ratio_median"] = f.get("tokens_ratio")
        if "gap_ratio" in f:
            row[f"{policy}_gap_ratio_median"] = f["gap_ratio"]["median"]
    row["setup"] = setup  # what the update ran with, as resolved: tells apart runs whose labels read alike
    threads = setup.get("copy_threads_used", setup.get("copy_threads", run.cfg("update.copy_threads")))
    row["copy_threads"] = threads if is_number(threads) else None  # the update's copies ran on (0: torch's default)
    recorded = setup.get("payload_kernels")  # the kernels that encoded and decoded the payload, and why; None: unknown
    row["payload_kernels"] = str(recorded) if recorded else None
    row["kernels"] = kernel_names(row["payload_kernels"])  # their names alone: what the ranking compares
    cpu = run.summary.get("cpu") if isinstance(run.summary.get("cpu"), dict) else {}
    row["cpu_threads"] = cpu.get("threads") if is_number(cpu.get("threads")) else None  # the run's torch threads
    cores = setup.get("cores", cpu.get("cores"))
    row["cpu_cores"] = cores if is_number(cores) else None  # of the cores the run could run on
    for end in ("started_at", "ended_at"):  # unix times: runs whose spans overlap ran at the same time
        row[end] = run.summary.get(end) if is_number(run.summary.get(end)) else None
    row["broken"] = broken_measurement(run)
    row["verdict"] = run_verdict(run, row["update_share"], stalls)
    if row["broken"] and "verdict_trusted" not in run.summary:  # a run recorded before it flagged this itself
        row["verdict"] = f"broken measurement: {row['broken']}; the run said: {row['verdict']}"
    row["bench"] = bench_target(run)  # its measured rows are repeats of the target, not steps
    row["warmup_steps"] = run.warmup_steps
    row["timeline"] = timeline(run)
    row["source"], row["framework"] = run.summary.get("source"), run.summary.get("framework")  # None: rlsync's own
    return row


def kernel_names(recorded: Optional[str]) -> Optional[str]:
    """The kernels' names in a run's setup.payload_kernels, the part before " (": "numpy's steps" of "numpy's steps
    (KERNEL.c: no C compiler: ...)" (native.Library.describe's "FALLBACK (FILE: WHY)"). Parsed from the recorded string,
    not asked of the payload: a run from another machine holds only it, and the why after " (" is worded per machine (a
    compiler's message, a path) where the kernels that ran are the same. None where the run recorded none."""
    return (recorded.partition(" (")[0].strip() or None) if recorded else None


def update_efficiency(row: dict[str, Any]) -> Optional[float]:
    """The update's copy floor over its time: the median of each step's own ratio (a drifting machine
    cancels), else the floor's median over the time's."""
    eff, limit, seconds = (
        row.get("update_efficiency_median"),
        row.get("update_limit_time_median"),
        row.get("update_time_median"),
    )
    if is_number(eff):
        return float(eff)
    return limit / seconds if is_number(limit) and is_number(seconds) and seconds > 0 else None


def broken_measurement(run: Run) -> Optional[str]:
    """Why the run's update times are a broken measurement, not a finding (never a ranking entry), or None.
    The run's own judgement where summary.json holds one (`verdict_trusted`, `verdict_untrusted_reason`);
    a run recorded before it is judged here by the run's own rule (record.summary.distrust: under
    BROKEN_EFFICIENCY of its copy floor with a sign of a busy machine; one that recorded no load at all,
    only on the signs its own figures hold: its floor or step moving by more than NOISE_SPREAD)."""
    trusted = run.summary.get("verdict_trusted")
    if trusted is True:
        return None
    if trusted is False:
        reason = run.summary.get("verdict_untrusted_reason")
        return str(reason) if reason else "its run judged its update times no finding (summary.json verdict_trusted)"
    cpu = run.summary.get("cpu")
    if isinstance(cpu, dict):
        return distrust(run.stats, cpu)
    # recorded before summary.json held the machine's load: only its own figures can show a busy machine
    moved = [st for st in (run.stats.get(FLOOR_METRIC), run.stats.get("perf/step_time")) if moved_much(st)]
    return distrust(run.stats, None) if moved else None


def moved_much(st: Optional[dict]) -> bool:
    """A metric whose measured steps spread by more than NOISE_SPREAD of its median (the run's own noise sign)."""
    return is_spread(st) and st["median"] > 0 and (st["max"] - st["min"]) / st["median"] > NOISE_SPREAD


def run_release_level(run: Run) -> Optional[int]:
    """rollout.release_level; from a run recorded before its rename (issue 44), its rollout.sleep_level (setup's
    sleep_level); from one older still, its rollout.release_weights (true: level 2, false: what the engine then
    did, level 1)."""
    setup = run.summary.get("setup") or {}
    level = next(
        (
            v
            for v in (setup.get("release_level"), run.cfg("rollout.release_level"), setup.get("sleep_level"))
            if v is not None
        ),
        run.cfg("rollout.sleep_level"),
    )
    if level is None and run.cfg("rollout.release_weights") is not None:
        level = 2 if run.cfg("rollout.release_weights") else 1
    return int(level) if is_number(level) else None


def is_spread(st: Any) -> bool:
    """{"median", "min", "max"}, each a number: a metric's figures over the measured steps."""
    return isinstance(st, dict) and all(is_number(st.get(k)) for k in ("median", "min", "max"))


def well_formed_idle(idle: Any) -> bool:
    """summary.json's engine_idle as the runner writes it: a spread for the time and for each part."""
    parts = idle.get("parts") if isinstance(idle, dict) else None
    return (
        is_spread(idle.get("time") if isinstance(idle, dict) else None)
        and isinstance(parts, dict)
        and all(is_spread(st) for st in parts.values())
    )


def run_idle(run: Run) -> Optional[dict[str, Any]]:
    """The engine's idle time and its parts: summary.json's, else made from metrics.jsonl as the runner
    makes it (a run recorded before summary.json held it, or one that left no summary)."""
    idle = run.summary.get("engine_idle")
    if well_formed_idle(idle):
        return idle
    return engine_idle(run.step_rows, run.warmup_steps) if run.step_rows and not bench_target(run) else None


STALL_SPREADS = ("max_gap", "pause_to_token", "receive")  # pause/<policy>/<x>_time (recorded names), as spreads
STALL_VALUES = ("tokens_ratio", "staged_bytes", "swap_pointer")  # pause/<policy>/<x>, their medians


def client_stalls(run: Run) -> Optional[dict[str, dict[str, Any]]]:
    """A stall bench's per-policy figures: policy -> {"max_gap": spread, ..., "tokens_ratio": median,
    ...} with a spread as {"median", "min", "max"} over the timed updates; None for any other run. The
    policies as the bench's table orders them; the gap ratio on the compared policy's (its baseline's aside)."""
    if bench_target(run) != "stall":
        return None
    out = {}
    for policy in measured_policies(run.stats):
        stem = f"{METRIC}/{policy}"
        out[policy] = {name: spread_of(run, f"{stem}/{name}_time") for name in STALL_SPREADS}
        out[policy].update({name: run.stat(f"{stem}/{name}") for name in STALL_VALUES})
        out[policy]["answers_verified"] = run.stat(f"{stem}/answers_verified_total", "max")
        out[policy]["answers_failed"] = run.stat(f"{stem}/answers_failed_total", "max")
    pair = compared(out)
    if pair is not None and run.stat(f"{METRIC}/gap_ratio") is not None:
        out[pair[0]]["gap_ratio"] = spread_of(run, f"{METRIC}/gap_ratio")  # its longest gap over the baseline's
    return out or None


def spread_of(run: Run, metric: str) -> Optional[dict[str, float]]:
    st = run.stats.get(metric)
    return st if is_spread(st) else None


def timeline(run: Run) -> list[dict[str, Any]]:
    """Per logged step, warm-up included: its step and update seconds (update None where not logged).

    Empty for a bench: its rows are repeats of the update alone, with no step around them.
    """
    points = []
    for index, row in enumerate(run.step_rows):
        step_time, update_time = row.get("perf/step_time"), row.get("perf/update_weights_time")
        if is_number(step_time):
            points.append(
                {
                    "step": row.get("step", index),  # tolerate rows without a step, as step_stats does
                    "step_time": float(step_time),
                    "update_time": float(update_time) if is_number(update_time) else None,
                }
            )
    return points


def update_share(run: Run) -> Optional[float]:
    share = run.summary.get("share") or {}
    value = share.get("update_weights", run.summary.get("share/update_weights"))
    if is_number(value):
        return float(value)
    update, step = run.stat("perf/update_weights_time"), run.stat("perf/step_time")
    return update / step if update is not None and step else None


def run_verdict(run: Run, share: Optional[float], stalls: Optional[dict] = None) -> str:
    """The runner's verdict; for a bench, what it timed against the copy floor (it has no step to
    share) or, a stall bench, the client-seen gaps (`stalls`: client_stalls'); for a run without
    either, a line built from the share of the step."""
    warning = run.summary.get("warning")
    if run.summary.get("verdict"):
        return f"{run.summary['verdict']} ({warning})" if warning else str(run.summary["verdict"])
    prefix = "incomplete (no summary.json)" if run.status == "incomplete" else run.status
    target = bench_target(run)
    if target:
        line = bench_verdict(run, target, stalls)
        line = line if run.status == "finished" else f"{prefix}: {line}"
        return f"{line} ({warning})" if warning else line
    if share is None:
        return f"{prefix}: {run.measured_steps} measured steps, no step time to compare with"
    return f"{prefix}: {share_verdict(share, run.cfg('run.verdict_threshold', VERDICT_THRESHOLD))}"


# bench.target -> (metric stem, what the verdict calls it), as the bench's closing tables do
BENCH_PHASES = {
    "update": (("update_weights", "update alone"),),
    "offload": (("sleep", "offload alone"), ("wake_up", "onload alone")),
}


def bench_target(run: Run) -> Optional[str]:
    """What a `python -m rlsync.bench` job timed: its summary says; one that left no summary still
    has bench.* in its config. None for a run of the step loop, which has neither. A target recorded under
    its name before a rename reads as its name now (bench.target=pause: stall)."""
    target = run.summary.get("target") or run.cfg("bench.target")
    return dict(RENAMED_TARGETS).get(target, target)


def bench_verdict(run: Run, target: str, stalls: Optional[dict] = None) -> str:
    """ "update alone: 0.18 s median, 1.91x the copy floor of 0.097 s (transport direct, bucketed, 512 MiB)".

    The ratio is 1 / the median efficiency, each repeat against the floor probed beside it (as the
    table's efficiency column and the bench's closing table), so a shared machine's drift cancels.
    """
    parts = []
    for stem, label in BENCH_PHASES.get(target, ()):
        seconds = run.stat(f"perf/{stem}_time")
        if seconds is None:
            continue
        limit, efficiency = run.stat(f"perf/{stem}_limit_time"), run.stat(f"perf/{stem}_efficiency")
        if limit is None:
            parts.append(f"{label}: {fmt_seconds(seconds)} median, no copy floor measured")
            continue
        ratio = 1 / efficiency if efficiency else seconds / limit
        parts.append(f"{label}: {fmt_seconds(seconds)} median, {ratio:.2f}x the copy floor of {fmt_seconds(limit)}")
    if stalls:  # a stall bench: no copy floor of its own; its clients' gaps beside the receive
        parts = [stall_verdict(stalls)]
    if target == "vllm_paths" and (line := VllmPathsTarget.verdict(run.summary.get("metrics") or {})):
        parts = [line]  # each path against its own floor, verified or not
    if not parts:
        return f"{run.measured_steps} timed repeats, no {target} time measured"
    return f"{'; '.join(parts)} ({bench_setup(run, target)})"


def stall_verdict(policies: dict[str, dict[str, Any]]) -> str:
    """ "longest client-seen gap: pause 0.95 s, stage 0.43 s (0.45x pause's) beside the engine's receive of 1.42 s"."""

    def gap(policy: str) -> str:
        spread = policies[policy]["max_gap"]
        return f"{policy} {fmt_seconds(spread['median']) if spread else 'n/a'}"

    line = "longest client-seen gap: " + ", ".join(gap(p) for p in policies)
    pair = compared(policies)
    ratio = policies[pair[0]].get("gap_ratio") if pair else None
    line += f" ({ratio['median']:.2f}x {pair[1]}'s)" if ratio else ""
    receive = [f"{p} {fmt_seconds(v['receive']['median'])}" for p, v in policies.items() if v["receive"]]
    return line + (f"; the engine's receive (the copy): {', '.join(receive)}" if receive else "")


def bench_setup(run: Run, target: str) -> str:
    """What the bench's time depends on: the update's path, or the offloaded state."""
    if target == "offload":
        offload = run.summary.get("offload") or {}
        state = offload.get("state") or run.cfg("bench.offload_state", "trainer")
        mode = offload.get("mode") or run.cfg("trainer.offload", "n/a")
        memory = offload.get("memory") or run.cfg("trainer.offload_memory", "n/a")
        moved = run.stat("perf/sleep_bytes")
        size = f", {fmt_bytes(moved)}" if moved is not None else ""
        return f"{state} state, offload {mode}, memory {memory}{size}"
    setup = run.summary.get("setup") or {}
    transport = setup.get("transport") or run.cfg("update.transport", "n/a")
    flat = setup.get("flat_engine_weights", run.cfg("update.flat_engine_weights"))
    strategy = setup.get("strategy") or run.cfg("update.strategy", "n/a")
    bucket = setup.get("bucket_mb", run.cfg("update.bucket_mb"))
    source = setup.get("source") or run.cfg("update.source")
    engine = setup.get("engine") or run.cfg("rollout.engine", "hf")
    parts = [f"transport {transport}" + (" flat" if flat else ""), str(strategy)]
    parts += [f"{fmt_bucket(bucket)} MiB"] if strategy == "bucketed" else []
    parts += [f"source {source}"] if source == "host" else []  # device is the default
    mode = setup.get("vllm_reload_mode", run.cfg("rollout.vllm_reload_mode"))
    parts += [f"engine {engine_phrase(engine, mode)}"] if engine != "hf" else []
    if target == "stall":  # the load the gaps were measured under
        clients = (run.summary.get(METRIC) or {}).get("clients") or run.cfg("bench.clients")
        parts.insert(0, f"{clients} streaming clients")
    return ", ".join(parts)
