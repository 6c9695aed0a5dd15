"""Formatting the table: each row's cells, the markdown tables of the runs and of the parts of their step,
and the line on the machine they ran on."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterable
from typing import Any, Optional

from rlsync.bench.stall import swap_phrase
from rlsync.fmt import (
    fmt_mib,
    fmt_range,
    fmt_ratio,
    fmt_seconds,
    fmt_share,
    fmt_sig,
    fmt_spread,
    is_number,
    markdown_table,
)
from rlsync.measure import metrics
from rlsync.record.summary import idle_parts_phrase
from rlsync.report.runs import MIN_MEASURED, Run

PER_TENSOR = "per_tensor"  # the strategy to which a bucket size does not apply


def fmt_efficiency(eff: Optional[float]) -> str:
    """ "0.82 (1.22x floor)", "0.0031 (323x floor)": floor / time, and how many times the floor the update took."""
    if eff is None or eff <= 0:
        return "n/a"
    return f"{fmt_sig(eff)} ({fmt_ratio(1 / eff)} floor)"


def fmt_bucket(bucket_mb: Any) -> str:
    return f"{bucket_mb:g}" if is_number(bucket_mb) else "n/a" if bucket_mb is None else str(bucket_mb)


def engine_phrase(engine: Any, reload_mode: Any = None) -> str:
    """ "vllm", "vllm, reload direct": the engine, with rollout.vllm_reload_mode where a run set it (a run
    recorded before it was recorded, or left at null, vLLM's default: the engine alone)."""
    return f"{engine}, reload {reload_mode}" if reload_mode else str(engine)


def bucket_cell(row: dict[str, Any]) -> str:
    """The bucket size in MiB; "per_tensor" for a run that sends one tensor at a time (no bucket)."""
    return PER_TENSOR if row.get("strategy") == PER_TENSOR else fmt_bucket(row.get("bucket_mb"))


TABLE_HEADER = (
    "run", "model", "transport", "bucket (MiB)", "n", "update", "offload (sleep)", "onload (wake_up)",
    "step", "update share", "efficiency (floor/time)", "copy threads", "peak update (MiB)",
)  # fmt: skip
TABLE_NOTE = (
    "n: measured steps (a bench: timed repeats; warm-up left out). Update and step: median (min to max over "
    f"the n); offload and onload: min to max. With n under {MIN_MEASURED} a range says little. Update share: "
    "of the median step; efficiency: median of perf/update_weights_efficiency (the copy floor over the update "
    'time), "broken" under the share of its floor below which an update timed the machine, not the setting; '
    "copy threads: the CPU threads the update copied with (update.copy_threads as resolved; auto times them "
    "at start), of the cores the run could use; peak update: max of perf/update_weights_peak_bytes."
)


def copy_threads_cell(row: dict[str, Any]) -> str:
    """ "2 of 2 cores", "1", "torch's default" (0: not a CPU copy, or left to torch), "n/a" (not recorded)."""
    threads, cores = row.get("copy_threads"), row.get("cpu_cores")
    if not is_number(threads):
        return "n/a"
    if threads == 0:
        return "torch's default"
    return f"{threads:g} of {cores:g} cores" if is_number(cores) else f"{threads:g}"


def common_overrides(rows: list[dict[str, Any]]) -> list[str]:
    """Overrides every run shares (with two runs or more): said once above the table."""
    if len(rows) < 2:
        return []
    shared = set(rows[0]["override_list"]).intersection(*(r["override_list"] for r in rows[1:]))
    return [o for o in rows[0]["override_list"] if o in shared]


def run_label(row: dict[str, Any], common: Iterable[str] = ()) -> str:
    """ "3: model=qwen3_1p7b update.bucket_mb=512", leaving out the overrides all runs share."""
    own = [o for o in row["override_list"] if o not in set(common)]
    return f"{row['job']}: {' '.join(own)}" if own else row["job"]


def table_cells(row: dict[str, Any], common: Iterable[str] = ()) -> list[str]:
    run = run_label(row, common)
    if row["status"] != "finished":
        run += f" ({row['status']})"
    return [
        run,
        str(row["model"] or "n/a"),
        str(row["transport"] or "n/a")
        + ("" if row.get("payload") in (None, "full") else f", {row['payload']}")  # the payload if not full
        + ("" if row["engine"] in (None, "hf") else f" ({engine_phrase(row['engine'], row.get('vllm_reload_mode'))})"),
        bucket_cell(row),
        str(row["measured_steps"]),
        fmt_spread(row["update_time_median"], row["update_time_min"], row["update_time_max"]),
        fmt_range(row["sleep_time_min"], row["sleep_time_max"]),
        fmt_range(row["wake_up_time_min"], row["wake_up_time_max"]),
        fmt_spread(row["step_time_median"], row["step_time_min"], row["step_time_max"]),
        fmt_share(row["update_share"]),
        fmt_efficiency(row["update_efficiency_median"]) + (", broken" if row.get("broken") else ""),
        copy_threads_cell(row),
        "0 (no staging)" if row["update_peak_bytes_max"] == 0 else fmt_mib(row["update_peak_bytes_max"]),
    ]


def rows_markdown(rows: list[dict[str, Any]]) -> str:
    common = common_overrides(rows)
    out = [f"Overrides of every run: {' '.join(common)}", ""] if common else []
    if any(row.get("framework") for row in rows):  # other frameworks' runs beside rlsync's: which one, read from what
        cells = [[*table_cells(row, common), source_cell(row)] for row in rows]
        return "\n".join([*out, markdown_table([*TABLE_HEADER, "source (framework)"], cells)])
    out.append(markdown_table(TABLE_HEADER, [table_cells(row, common) for row in rows]))
    if floors := payload_floor_table(rows, common):
        out += ["", floors]
    return "\n".join(out)


PAYLOAD_FLOOR_HEADER = ("run", "payload", "kernels", "changed share", "encode (floor)", "encode efficiency", "decode (floor)", "decode efficiency")  # fmt: skip


def payload_floor_table(rows: list[dict[str, Any]], common: Iterable[str] = ()) -> Optional[str]:
    """The runs whose payload was timed against its own floors (the bytes its class declares over the copy
    probe's bandwidth): its encode and its decode (the engine's side), median time, floor and floor / time."""

    def side(row, name):
        took, floor = row.get(f"update_{name}_time_median"), row.get(f"update_{name}_limit_time_median")
        return "-" if took is None else f"{fmt_seconds(took)} ({fmt_seconds(floor)})"

    cells = [
        [
            run_label(row, common),
            f"{row['transport']}, {row['payload']}",
            row.get("kernels") or "-",  # which encoded and decoded it (setup.payload_kernels); "-": not recorded
            "-" if row.get("update_changed_ratio_median") is None else fmt_share(row["update_changed_ratio_median"]),
            side(row, "encode"),
            fmt_efficiency(row.get("update_encode_efficiency_median")),
            side(row, "decode"),
            fmt_efficiency(row.get("update_decode_efficiency_median")),
        ]
        for row in rows
        if row.get("update_encode_limit_time_median") is not None or row.get("update_decode_limit_time_median")
    ]
    if not cells:
        return None
    note = (
        "Each payload against its own floors: the bytes its kernels (those that ran, summary.json's "
        "setup.payload_kernels) must read and write over the copy probe."
    )
    return "\n".join([note, "", markdown_table(PAYLOAD_FLOOR_HEADER, cells)])


def source_cell(row: dict[str, Any]) -> str:
    """ "W&B offline run (verl)"; "rlsync run" for rlsync's own."""
    return f"{row['source']} ({row['framework']})" if row.get("framework") else "rlsync run"


def phase_table(rows: list[dict[str, Any]]) -> str:
    """Per run with a step: the median of each part of the step (the catalogue's), with its share of the median step."""
    rows = [r for r in rows if is_number(r.get("step_time_median")) and r["step_time_median"] > 0]
    timed = [p for p in metrics.step_phases() if any(is_number(r.get(f"{p.name}_time_median")) for r in rows)]
    if not timed:
        return "No run timed the parts of a step (a bench times its target alone)."

    def cell(row: dict[str, Any], phase: metrics.Phase) -> str:
        seconds = row.get(f"{phase.name}_time_median")
        share = fmt_share(seconds / row["step_time_median"]) if is_number(seconds) else ""
        return f"{phase.metric.show(seconds)} ({share})" if share else "n/a"

    common = common_overrides(rows)
    cells = [[run_label(r, common), *(cell(r, p) for p in timed), fmt_seconds(r["step_time_median"])] for r in rows]
    return markdown_table(["run", *(p.label for p in timed), "step (median)"], cells)


IDLE_NOTE = (
    "From one rollout's last token to the next one's first (perf/engine_idle_time): median (min to max) over "
    "the measured steps; its largest parts by median, each from the same intervals (docs/metrics.md); the "
    "weight update's median beside it, and its share of the median idle."
)


def idle_table(rows: list[dict[str, Any]]) -> Optional[str]:
    """Per run of the step loop that logged it: the engine's idle time, its largest parts and the
    update's share of it (None when no run did: a bench, or a single step)."""
    rows = [r for r in rows if r.get("engine_idle")]
    if not rows:
        return None
    common = common_overrides(rows)
    cells = [
        [
            run_label(r, common),
            "n/a" if r.get("release_level") is None else str(r["release_level"]),
            fmt_spread(r["engine_idle_time_median"], r["engine_idle_time_min"], r["engine_idle_time_max"]),
            idle_parts_phrase(r["engine_idle"]),
            fmt_seconds(r["update_time_median"]) if is_number(r.get("update_time_median")) else "n/a",
            fmt_share(r.get("update_idle_share")),
        ]
        for r in rows
    ]
    header = ["run", "release level", "engine idle", "largest parts (median)", "update", "update share of idle"]
    return markdown_table(header, cells)


STALL_NOTE = (
    "A standalone engine under streaming load taking an update (`python -m rlsync.bench bench.target=stall`, "
    "docs/serve.md): per update policy, the stall, the longest gap between two tokens a client saw from the "
    "update's start to just after the swap, median (min to max) over the timed updates; per update, that gap "
    "over the same repeat's under the policy that holds generation for the whole receive (the baseline); the "
    "time from the engine's hold to the first token after it; tokens/s during the update over before it; the "
    "engine's receive (the copy itself) and the staged copy's bytes beside them."
)


STALL_HEADER = (
    "run", "policy", "swap", "longest gap", "gap / baseline's", "hold to first token",
    "tokens/s during / before", "engine receive (the copy)", "staged copy (MiB)", "answers checked (failed)",
)  # fmt: skip


def stall_table(rows: list[dict[str, Any]]) -> Optional[str]:
    """Per stall bench and policy: the client-seen stall beside the update's copy (None when no run is one)."""
    cells = stall_cells(rows)
    return markdown_table(STALL_HEADER, cells) if cells else None


def stall_cells(rows: list[dict[str, Any]]) -> list[list[str]]:
    """stall_table's cells, a row per stall bench and policy (W&B's table takes them too)."""
    rows = [r for r in rows if r.get("client_stalls")]
    common = common_overrides(rows)

    def spread(st: Optional[dict]) -> str:
        return fmt_spread(st["median"], st["min"], st["max"]) if st else "n/a"

    def ratio_spread(st: Optional[dict]) -> str:  # per update, the same repeat: only the compared policy's row
        return f"{st['median']:.2f} ({st['min']:.2f} to {st['max']:.2f})" if st else ""

    cells = []
    for r in rows:
        for policy, f in r["client_stalls"].items():
            ratio = f.get("tokens_ratio")
            staged = f.get("staged_bytes")
            checked, failed = f.get("answers_verified"), f.get("answers_failed")
            cells.append(
                [
                    run_label(r, common),
                    policy,
                    swap_phrase(policy, f.get("swap_pointer")),
                    spread(f["max_gap"]),
                    ratio_spread(f.get("gap_ratio")),
                    fmt_seconds(f["pause_to_token"]["median"]) if f["pause_to_token"] else "n/a",
                    f"{ratio:.2f}" if is_number(ratio) else "n/a",
                    spread(f["receive"]),
                    fmt_mib(staged) if staged else "0 (none)",
                    "n/a" if checked is None else f"{checked:.0f} ({failed or 0:.0f})",
                ]
            )
    return cells


def machine_line(runs: list[Run]) -> str:
    """Where the runs ran: summary.json's "machine" when the runner wrote it, else this machine."""
    machines = [m for m in (run.summary.get("machine") for run in runs) if isinstance(m, dict)]
    devices = sorted({str(table_row_device(r)) for r in runs}) or ["n/a"]
    if machines:
        first = machines[0]
        gpus = sorted({str(m["gpu"]) for m in machines if m.get("gpu")})
        line = (
            f"Machine: {first.get('platform', 'n/a')}, {threads_phrase(runs)},"
            f" torch {first.get('torch', 'n/a')}, device {', '.join(devices)}"
        )
        line += f" ({', '.join(gpus)})" if gpus else ""
        hosts = {json.dumps(m, sort_keys=True) for m in machines}
        return line + (" (first run's; the runs report different machines)." if len(hosts) > 1 else ".")
    try:
        from importlib.metadata import version

        torch_version = version("torch")  # no `import torch`: the report stays quick
    except Exception:  # noqa: BLE001 - torch's metadata missing or unreadable: the report still renders
        torch_version = "not installed"
    return (
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, torch {torch_version},"
        f" device {', '.join(devices)} (the runs did not record theirs: this is the machine that wrote the report)."
    )


def threads_phrase(runs: list[Run]) -> str:
    """ "torch on 1 of 2 CPU cores (2 cores, 1.0 kept busy by other processes at start)": the threads the
    runs' phases used of the cores they could run on (summary.json `cpu`; a run recorded before it: its
    machine's `cpus`, which is torch's thread count, not the machine's cores)."""
    cpus = [r.summary["cpu"] for r in runs if isinstance(r.summary.get("cpu"), dict)]
    threads = sorted({c["threads"] for c in cpus if is_number(c.get("threads"))})
    cores = sorted({c["cores"] for c in cpus if is_number(c.get("cores"))})
    if not threads:
        counts = sorted({m["cpus"] for m in (r.summary.get("machine") or {} for r in runs) if is_number(m.get("cpus"))})
        shown = " to ".join(f"{n:g}" for n in counts[:: max(1, len(counts) - 1)]) or "n/a"
        return f"torch on {shown} CPU threads (the machine's cores not recorded)"
    used = " to ".join(f"{n:g}" for n in threads[:: max(1, len(threads) - 1)])
    of = f" of {' to '.join(f'{n:g}' for n in cores[:: max(1, len(cores) - 1)])}" if cores else ""
    whys = list(dict.fromkeys(str(c["why"]) for c in cpus if c.get("why")))
    why = f" ({whys[0]})" if len(whys) == 1 else " (chosen per run from the cores free at its start)" if whys else ""
    return f"torch on {used}{of} CPU core{'s' if (cores or threads)[-1] != 1 else ''}{why}"


def table_row_device(run: Run) -> Any:
    return (run.summary.get("setup") or {}).get("device") or run.cfg("run.device") or "n/a"
