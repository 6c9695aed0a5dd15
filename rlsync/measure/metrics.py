"""The catalogue: every phase of the step and every metric, declared once.

The summary, the console, W&B, the report (report.md, report.csv, plots) and the data-parallel merge
all read their phases and metrics from here, so a phase added to `PHASES` (or with `add_phase`)
and timed in the step with `watch("<name>")` shows up in each of them with no other edit.

Names follow Miles/slime's (perf/update_weights_time, perf/sleep_time, ...): a phase is timed as
`perf/<phase>_time`, and what it moves sits beside it (`perf/<phase>_bytes`, `_gbps`, `_limit_time`, `_efficiency`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from rlsync.fmt import fmt_bytes, fmt_seconds


class Merge(Enum):
    """How data parallel turns each rank's value of a metric into the one rank 0 records."""

    SLOWEST = "slowest rank"  # what the step waits for; _rank_min and _rank_max beside it
    LARGEST = "largest"  # each rank's own device: the fullest one
    SUM = "sum"  # each rank holds its part of the whole batch's value
    TOKEN_MEAN = "token-weighted mean"  # a per-token average, weighted by each rank's answer tokens
    ANSWER_MEAN = "answer-weighted mean"  # a per-answer average over the ranks that generated, by their answers
    RANK0 = "rank 0's"  # rank 0's (the engine, the update), or the first rank's that has it


@dataclass(frozen=True)
class Metric:
    name: str  # the key in metrics.jsonl, summary.json and W&B
    label: str  # what tables and plots call it
    unit: str = ""  # s | bytes | GB/s | GB | ratio | "" (a count or a score)
    merge: Merge = Merge.RANK0
    stat: str = "median"  # the summary stat the report shows (median, or max for a peak)
    console: str = ""  # header of its column in the per-step console table ("": none)

    def show(self, value: Optional[float]) -> str:
        """`value` as the report shows it, by unit: "0.63 s", "512 MiB", "0.82"."""
        if value is None:
            return "n/a"
        if self.unit == "s":
            return fmt_seconds(value)
        if self.unit == "bytes":
            return fmt_bytes(value)
        return f"{value:.3g}" + (f" {self.unit}" if self.unit not in ("", "ratio") else "")


@dataclass(frozen=True)
class Phase:
    name: str  # `watch(name)` times it in the step; logged as perf/<name>_time
    label: str  # what tables and plot legends call it
    short: str  # a word of at most 9 letters: its console column, the benches' tables
    color: str = ""  # in the step-breakdown plot ("": the next of matplotlib's cycle)
    breakdown: bool = True  # one of the step's parts: stacked in the plot, a share, a report column
    console: bool = False  # a column of the per-step console table
    console_if_timed: bool = False  # a console column in the runs that time it (it can be the largest phase)

    @property
    def metric(self) -> Metric:
        return Metric(
            f"perf/{self.name}_time",
            self.label,
            "s",
            Merge.SLOWEST,
            console=self.short if self.console or self.console_if_timed else "",
        )


# The step's phases in the order they run (experiment.py). Not parts of the breakdown: the whole
# step.
PHASES: tuple[Phase, ...] = (
    Phase("rollout", "generation", "rollout", "#4c72b0", console=True),
    Phase("engine_release", "engine release", "release", "#64b5cd"),
    Phase(
        "batch_scatter", "batch scatter", "scatter", "#ccb974", console_if_timed=True
    ),  # data parallel: rank 0 sends each rank its share
    Phase("wake_up", "trainer onload", "onload", "#dd8452", console=True),
    Phase("log_probs", "log-probs", "logprobs", "#55a868", console=True),
    Phase("ref_log_probs", "reference log-probs", "ref_lp", "#8c8c8c", console_if_timed=True),
    Phase("train", "training", "train", "#c44e52", console=True),
    Phase("update_layout", "update layout", "layout", "#b3a9d6"),  # the update's tensors by name (per-expert views)
    Phase("update_weights", "weight update", "update", "#8172b3", console=True),
    Phase("sleep", "trainer offload", "offload", "#937860", console=True),
    Phase("engine_resume", "engine resume", "resume", "#da8bc3"),
    Phase("step", "step", "step", breakdown=False, console=True),
)
OTHER = Phase("other", "other", "other", "#dddddd")  # the step's time outside its parts (the breakdown plot)

# What the run's closing table and the report's table lead with, in this order: the transfers this
# tool measures, against the step.
HEADLINE = ("update_weights", "sleep", "wake_up", "step")


@dataclass(frozen=True)
class IdlePart:
    """A part of perf/engine_idle_time and the row that carries it: 0 the idle's own row, -1 the row
    before it (the step whose rollout's last token started the idle)."""

    metric: str
    row: int


# perf/engine_idle_time in step N's row runs from step N-1's last token to step N's first. Its parts,
# in the order they run: step N-1's engine release, its trainer phases (that row's perf/<phase>_time,
# timed once), the time between the two steps (the record), and the engine's resumes (step N-1's before its update,
# step N's before its rollout). What no part holds: scoring the rollout, making the prompts, update.verify.
# rlsync's own floor probe (perf/engine_idle_probe_time) is left out of the idle time: a framework does not pay it.
IDLE_PARTS: tuple[IdlePart, ...] = (
    IdlePart("perf/engine_idle_release_time", 0),
    *(  # perf/update_weights_time is the update's own clock (without update.verify's checksums)
        IdlePart(f"perf/{name}_time", -1)
        for name in (
            "batch_scatter",
            "wake_up",
            "log_probs",
            "ref_log_probs",
            "train",
            "update_layout",
            "update_weights",
            "sleep",
        )
    ),
    IdlePart("perf/engine_idle_between_time", 0),
    IdlePart("perf/engine_idle_resume_time", 0),
)


def moved(phase: str) -> tuple[Metric, ...]:
    """What a phase that copies bytes logs beside its time: bytes, GB/s, its copy floor, floor / time."""
    p = f"perf/{phase}"
    return (
        Metric(f"{p}_bytes", "bytes", "bytes"),
        Metric(f"{p}_gbps", "GB/s", "GB/s"),
        Metric(f"{p}_limit_time", "copy floor", "s"),
        Metric(f"{p}_efficiency", "efficiency (floor/time)", "ratio"),
    )


# Every metric that is not a phase's time, in the order the console and W&B show them.
METRICS: tuple[Metric, ...] = (
    *moved("update_weights"),
    Metric("perf/update_weights_buckets", "buckets"),
    Metric("perf/update_weights_peak_bytes", "peak update memory", "bytes", stat="max"),
    Metric("perf/update_weights_staging_bytes", "staging buffers", "bytes", stat="max"),
    Metric("perf/update_weights_engine_peak_bytes", "engine peak memory", "bytes", stat="max"),
    Metric("perf/update_weights_pack_time", "pack", "s", Merge.SLOWEST),  # the update's split, where the
    Metric("perf/update_weights_transfer_time", "transfer", "s", Merge.SLOWEST),  # transport can tell them apart
    Metric("perf/update_weights_load_time", "load", "s", Merge.SLOWEST),
    # update.payload other than full: its encode per bucket, the full update's bytes, the share that changed
    # (each payload class declares which it adds: Payload.metrics)
    Metric("perf/update_weights_encode_time", "encode", "s", Merge.SLOWEST),
    # a payload other than full against its own floors: the bytes its class declares (Payload.floor) over the
    # copy bandwidth probed in the same run; the decode is the engine's side (the transport's load)
    Metric("perf/update_weights_decode_time", "decode", "s", Merge.SLOWEST),
    Metric("perf/update_weights_encode_limit_time", "encode floor", "s"),
    Metric("perf/update_weights_encode_efficiency", "encode efficiency (floor/time)", "ratio"),
    Metric("perf/update_weights_decode_limit_time", "decode floor", "s"),
    Metric("perf/update_weights_decode_efficiency", "decode efficiency (floor/time)", "ratio"),
    Metric("perf/update_weights_full_bytes", "full update bytes", "bytes"),
    Metric("perf/update_weights_changed_ratio", "changed share", "ratio"),
    Metric("perf/update_weights_sent_limit_time", "copy floor of what crossed", "s"),  # the floor scaled by sent/full
    # trainer.parallel=fsdp2: the full tensors gathered from the shards, inside the update (update/gather.py)
    Metric("perf/update_weights_gather_time", "gather", "s", Merge.SLOWEST),
    Metric("perf/update_weights_gather_bytes", "gathered bytes", "bytes"),
    Metric("perf/update_weights_gather_peak_bytes", "gathered bytes held at once", "bytes", Merge.LARGEST, stat="max"),
    Metric("perf/update_weights_gather_limit_time", "gather floor", "s"),  # an all-gather of the same bytes
    Metric("perf/update_weights_gather_efficiency", "gather efficiency (floor/time)", "ratio"),
    Metric("perf/update_weights_copy_limit_time", "copy floor", "s"),  # the update's copy alone, without the gather
    Metric("perf/update_weights_copy_efficiency", "copy efficiency (floor/time)", "ratio"),
    Metric("update/verified_engines", "engines verified", merge=Merge.SUM),
    # a payload that merges LoRA's adapters into the weights: how far the engine's land from W + s*BA (Payload.after_update)
    Metric("update/lora_merge_error", "LoRA merge error (fp32, then cast)", "ratio"),
    Metric("update/lora_merge_error_in_dtype", "LoRA merge error (in the engine's dtype)", "ratio"),
    Metric("update/lora_merge_differ_ratio", "LoRA merged elements that differ", "ratio"),
    Metric("perf/lora_merge_error_time", "LoRA merge error check", "s", Merge.SLOWEST),  # after the update, outside it
    # from the previous rollout's last token to this one's first: release, onload, log-probs, train, update,
    # offload, what runs between steps, resume (each its own metric); from the second step on
    Metric("perf/engine_idle_time", "engine idle", "s", Merge.SLOWEST),  # update.verify: one per rank's engine
    # its parts that no phase of the step times (IDLE_PARTS), in the idle's row
    Metric("perf/engine_idle_release_time", "engine release", "s", Merge.SLOWEST),  # the last step's release
    Metric("perf/engine_idle_resume_time", "engine resume", "s", Merge.SLOWEST),  # before the last update and now
    Metric("perf/engine_idle_between_time", "between steps", "s", Merge.SLOWEST),  # the step's record
    # rlsync's floors probed again between the steps (run.limit_probe=every_step): beside the idle time, not in it
    Metric("perf/engine_idle_probe_time", "rlsync's floor probe", "s", Merge.SLOWEST),
    *moved("sleep"),
    *moved("wake_up"),
    # this process's peak resident set so far (VmHWM): data parallel's merge is the largest rank's
    Metric("perf/host_peak_rss_gb", "host peak memory of a rank", "GB", Merge.LARGEST, stat="max"),
    Metric("perf/device_mem_after_sleep_gb", "device memory after offload", "GB", Merge.LARGEST),  # CUDA only
    Metric("perf/device_mem_after_wake_up_gb", "device memory after onload", "GB", Merge.LARGEST),
    # the whole device's used memory (mem_get_info): an engine in another process counts too
    Metric("perf/device_mem_used_after_sleep_gb", "device memory used after offload", "GB", Merge.RANK0),
    Metric("perf/device_mem_used_after_wake_up_gb", "device memory used after onload", "GB", Merge.RANK0),
    Metric("train/logprob_abs_diff", "engine vs trainer log-prob", merge=Merge.TOKEN_MEAN, console="lp_diff"),
    Metric("train/loss", "loss", merge=Merge.SUM),  # each rank's share of the batch's token mean
    Metric("train/grad_norm", "gradient norm"),  # every rank holds the same all-reduced gradient
    Metric("train/clip_frac", "clipped ratio", merge=Merge.TOKEN_MEAN),
    Metric("train/kl", "KL to the reference", merge=Merge.TOKEN_MEAN),
    # rollout.placement=every_rank: every rank's engine generated its own groups (rank0: rank 0's engine, all)
    Metric("rollout/reward_mean", "reward", merge=Merge.ANSWER_MEAN, console="reward"),
    Metric("rollout/response_len_mean", "answer length", merge=Merge.ANSWER_MEAN),
    Metric("rollout/truncated_ratio", "truncated answers", "ratio", merge=Merge.ANSWER_MEAN),
)


def add_phase(phase: Phase, *, before: str = "step") -> None:
    """Declare a new phase, placed before `before` (the step's end by default).

    Then time it in the step (`with watch(phase.name): ...`): every sink, the report and the plots pick it up.
    """
    global PHASES
    if any(p.name == phase.name for p in PHASES):
        raise ValueError(f"phase {phase.name!r} is already declared")
    at = PHASES.index(phase_named(before))
    PHASES = (*PHASES[:at], phase, *PHASES[at:])


def add_metric(metric: Metric) -> None:
    """Declare a metric that is not a phase's time (its merge over ranks, its console column, its label)."""
    global METRICS
    if metric.name in declared():
        raise ValueError(f"metric {metric.name!r} is already declared")
    METRICS = (*METRICS, metric)


def phase_named(name: str) -> Phase:
    found = next((p for p in PHASES if p.name == name), None)
    if found is None:
        raise KeyError(f"no phase {name!r} in the catalogue (rlsync/measure/metrics.py)")
    return found


def step_phases() -> tuple[Phase, ...]:
    """The step's parts, in order: stacked in the breakdown, each a share of the step and a report column."""
    return tuple(p for p in PHASES if p.breakdown)


def declared() -> dict[str, Metric]:
    """Every declared metric by name: the phases' times first, then METRICS."""
    return {m.name: m for m in (*(p.metric for p in PHASES), *METRICS)}


def console_columns(row: Optional[dict] = None) -> tuple[Metric, ...]:
    """The per-step console table's columns: the phases marked for it in step order (with those `row`
    times that can be the largest: data parallel's scatter, the reference's log-probs), then the metrics."""
    if_timed = {p.metric.name for p in PHASES if p.console_if_timed}
    return tuple(
        m for m in declared().values() if m.console and (m.name not in if_timed or (row is not None and m.name in row))
    )


def merge_rule(name: str) -> Merge:
    """How data parallel merges `name`: as declared, else rank 0's."""
    metric = declared().get(name)
    return metric.merge if metric else Merge.RANK0
