"""The printed plan: the console view of plan.json (`render`), its data-parallel lines among it."""

from __future__ import annotations

from rlsync.fmt import fmt_bytes, fmt_seconds, fmt_share, markdown_table
from rlsync.plan import cost
from rlsync.plan.kinds import kinds_lines
from rlsync.trainer.parallel import parallel_class


def gather_lines(plan: dict) -> list[str]:
    """The fsdp2 gather beside the copy and the whole update, for N > 1 ranks (nothing for one)."""
    g = plan.get("gather")
    if not g or g["ranks"] <= 1:
        return []
    if not g["applies"]:
        return [f"Gather from shards: none ({g['why']})"]
    head = f"Gather from shards (trainer.parallel={g['parallel']}, {g['ranks']} ranks, update.gather={g['mode']})"
    n = g["collectives"]
    calls = (
        f"{n} all-gather{'s' if n != 1 else ''} of up to {fmt_bytes(g['call_bytes'])}"
        if g.get("call_bytes")
        else f"at least {n} all-gather{'s' if n != 1 else ''} (one a unit; the call size unknown)"
    )
    moved = (
        f"{fmt_bytes(g['bytes'])} in {g['trainer_dtype']} x {g['ranks'] - 1}/{g['ranks']} = "
        f"{fmt_bytes(g['received_bytes'])} received per rank in {calls}"
    )
    if g["time_s"] is None:
        lines = [
            f"{head}: unpredicted: no calibrated collective bandwidth (plan.calibrate=true measures an all-gather "
            f"over 2 gloo ranks; plan.collective_gbps=GBPS gives one); it moves {moved}"
        ]
    else:
        calls = (
            f" + {n} x {fmt_seconds(g['latency_s'])} call latency {fmt_seconds(g['latency_term_s'])}"
            if g["latency_s"] is not None
            else " (no call latency known: not counted)"
        )
        lines = [
            f"{head}: {fmt_seconds(g['time_s'])} = floor {fmt_seconds(g['floor_s'])} ({moved}, over a bus bandwidth "
            f"of {g['bus_gbps']:.3g} GB/s){calls}",
            f"  collective bandwidth from {g['source']}",
        ]
    held = " | ".join(f"{m} {fmt_bytes(b)}" for m, b in g["held_bytes"].items())
    lines.append(
        f"  gathered full tensors held at once ({g['trainer_dtype']}): {held} (configured: {g['mode']}; "
        f"a rank without an engine drains them unit by unit: {fmt_bytes(g['held_bytes_draining'])})"
    )
    w = g.get("whole_update")
    if w:
        lines.append(
            f"Predicted whole update (gather + copy): {fmt_seconds(w['time_s'])} "
            f"({fmt_seconds(w['low_s'])} to {fmt_seconds(w['high_s'])}; the copy's range)"
        )
    return lines


def per_rank_line(plan: dict) -> list[str]:
    """Memory per rank, for N > 1 ranks (nothing for one: the whole run's line says it)."""
    r = plan["memory"].get("per_rank")
    if not r or r["ranks"] <= 1:
        return []
    cuda = bool(plan["setup"]["cuda"])

    def one(x: dict) -> str:
        where = x["device"] if cuda else x["host"]
        parts = [f"trainer state {fmt_bytes(where.get('trainer_state', 0))}"]
        engine = where.get("engine_weights", 0) + x["host"].get("engine_process_engine_weights", 0)
        parts.append(f"engine weights {fmt_bytes(engine)}" if engine else "no engine")
        parts.append(f"transients {fmt_bytes(where.get('transient', 0))}")  # the step's, the probes', the gather's
        if cuda:  # the state, engine and gathered tensors live on the device; the host holds the offloaded state
            return f"device {fmt_bytes(x['device_bytes'])} ({', '.join(parts)}), host {fmt_bytes(x['host_bytes'])}"
        return f"{fmt_bytes(x['host_bytes'])} ({', '.join(parts)})"

    share = f"1/{r['ranks']} of the state each" if parallel_class(r["parallel"]).sharded else "the whole state each"
    tail = "" if cuda else f"; all {r['ranks']} ranks on this machine {fmt_bytes(r['all_ranks_host_bytes'])}"
    return [
        f"Memory per rank ({r['ranks']} ranks, trainer.parallel={r['parallel']}: {share}; rollout.placement="
        f"{r['placement']}; runtime not counted): rank 0 {one(r['rank0'])}; each other rank {one(r['other_rank'])}{tail}"
    ]


def render(plan: dict) -> str:
    """The console view of plan.json."""
    m, s, mem = plan["model"], plan["setup"], plan["memory"]
    lt = m["largest_tensor"]
    lines = [
        f"Plan: {m['name']}, {m['params'] / 1e9:.3f}B parameters, {m['tensors']} tensors, "
        f"{fmt_bytes(m['update_bytes'])} in {s['engine_dtype']} ({m['update_bytes']:,} bytes); largest tensor "
        f"{lt['name']} {tuple(lt['shape'])} {fmt_bytes(lt['bytes'])}",
        f"Update: {s['transport']}{' flat' if s['flat_engine_weights'] else ''}, {s['strategy']}, "
        f"{s['trainer_dtype']} -> {s['engine_dtype']}, inflight_buckets={s['inflight_buckets']}",
        f"Calibration: {plan['calibration']['describe']}",
        "",
    ]
    unmeasured = "" if plan["calibration"]["measured"] is not False else " (unmeasured)"
    if plan["calibration"].get("reference"):
        unmeasured = " (reference calibration)"  # another machine's coefficients: said beside every time
    head = [
        "bucket",
        "buckets",
        "largest bucket",
        "over bucket",
        "staging",
        f"bucketed{unmeasured}",
        f"per_tensor{unmeasured}",
        "per-tensor overhead",
    ]
    g = plan.get("gather") or {}
    gathers = bool(g.get("applies"))
    if gathers:  # the fsdp2 gather beside the copy: its time, what it holds at once, the two together
        head += ["gather", "gathered held", f"bucketed + gather{unmeasured}"]
    rows = [
        [
            f"{r['bucket_mb']:g} MiB" + (" *" if r["bucket_mb"] == s["bucket_mb"] else ""),
            r["buckets"],
            fmt_bytes(r["largest_bucket_bytes"]),
            r["tensors_over_bucket"] or "-",
            fmt_bytes(r["staging_bytes"]),
            fmt_seconds(r["bucketed_time_s"]),
            fmt_seconds(r["per_tensor_time_s"]),
            fmt_share(r["per_tensor_share"]),
        ]
        + (
            [
                fmt_seconds(r["gather_time_s"]),
                fmt_bytes(r["gather_held_bytes"]),
                fmt_seconds(r["bucketed_with_gather_s"]),
            ]
            if gathers
            else []
        )
        for r in plan["buckets"]
    ]
    note = (
        f"; gather: the update.gather={g['mode']} gather from {g['ranks']} shards, its held bytes in {g['trainer_dtype']}"
        if gathers
        else ""
    )
    lines += [
        markdown_table(head, rows),
        f"(* the configured update.bucket_mb; staging for the configured transport{note})",
        "",
    ]
    pred = plan["prediction"]
    if pred:
        lines.append(
            f"Predicted update time{unmeasured}: {fmt_seconds(pred['time_s'])} "
            f"({fmt_seconds(pred['low_s'])} to {fmt_seconds(pred['high_s'])}) = {pred['calls']} calls "
            f"{fmt_seconds(pred['terms']['calls_s'])} + {pred['tensor_term']['count']} {pred['tensor_term']['counts']} "
            f"{fmt_seconds(pred['terms']['tensors_s'])} + {fmt_bytes(pred['moved_bytes'])} moved "
            f"{fmt_seconds(pred['terms']['bytes_s'])}"
        )
        f = pred.get("at_floor")
        if f:
            whose = "plan.copy_gbps" if plan["setup"].get("copy_gbps") else "the calibration runs' median"
            lines.append(
                f"  at a copy floor of {f['floor_gbps']:.2f} GB/s ({whose}): "
                f"{fmt_seconds(f['time_s'])} ({fmt_seconds(f['low_s'])} to {fmt_seconds(f['high_s'])}) = "
                f"{fmt_seconds(f['overhead_s'])} per call and tensor + {f['floor_multiple']:.2f}x the floor's time for the moved bytes"
            )
    else:
        lines.append(
            f"Predicted update time: n/a (no coefficients for {setup_of_plan(plan)} in the calibration"
            + ("" if plan["calibration"]["machine"] is not None else "; none found")
            + ")"
        )
    lines += gather_lines(plan)
    lines += verdict_lines(plan, unmeasured)
    lines += kinds_lines(plan)
    peak_dev = f", device {fmt_bytes(mem['run_peak_device_bytes'])}" if mem["run_peak_device_bytes"] else ""
    lines.append(
        f"Memory: staging {fmt_bytes(mem['staging_bytes'])}; the update alone (rlsync.bench: trainer and "
        f"engine weights + staging) {fmt_bytes(mem['update_alone_peak_bytes'])}; a whole run (AdamW state in "
        f"{s['trainer_dtype']}, runtime not counted) host {fmt_bytes(mem['run_peak_host_bytes'])}{peak_dev}"
    )
    lines += per_rank_line(plan)
    for f in plan["flags"]:
        lines.append(f"Flag {f['kind']}: {f['message']}")
    return "\n".join(lines)


def verdict_lines(plan: dict, unmeasured: str = "") -> list[str]:
    """The update's share of plan.step_s and whether to tune it (the run's own phrasing), then what the predicted
    time spans beside what each framework's update metric spans (their maps' notes)."""
    v = plan.get("verdict")
    if not v:
        return []
    if v["verdict"]:
        shares = f"{fmt_share(v['low_share'])} to {fmt_share(v['high_share'])}"
        crosses = (
            f"; its range crosses {fmt_share(v['threshold'])}: measure it (python -m rlsync.bench) before deciding"
            if v["low_share"] < v["threshold"] <= v["high_share"]
            else ""
        )
        lines = [f"Verdict at plan.step_s={v['step_s']:g} s{unmeasured}: {v['verdict']} (its range: {shares}{crosses})"]
    elif v["step_s"]:
        lines = [f"Verdict at plan.step_s={v['step_s']:g} s: n/a (no predicted update time to compare with)"]
    else:
        lines = [
            "Verdict: n/a (plan.step_s=SECONDS, your step's time, gives the update's share of it and whether to tune it)"
        ]
    lines.append(f"The predicted time is {v['spans']}; what each framework's update metric spans:")
    lines += [f"  {f['title']}: {f['spans']}" for f in v["frameworks"]]
    return lines


def setup_of_plan(plan: dict) -> str:
    s = plan["setup"]
    return cost.Setup(s["transport"], s["strategy"], bool(s["flat_engine_weights"]) and s["strategy"] == "bucketed").key
