"""Which setting won: per model the fastest update and step against the runner-up, and whether the
gap is real. A gap is called real only when it survives the machine the runs ran on: enough samples,
runs that did not run at the same time, copy floors (the plain copy probed beside each run) that agree,
the same setup facts beside the setting compared (MUST_MATCH: auto's copy threads, the payload's kernels),
min-max ranges apart, and the same order by time over the floor as by time. A run whose update ran far
below its own floor on a busy machine is a broken measurement (rows.broken_measurement, on the run's own
threshold record.summary.BROKEN_EFFICIENCY): named, never ranked."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from rlsync.fmt import MIB, fmt_ratio, fmt_seconds, fmt_share, fmt_spread, is_number, time_unit
from rlsync.report.cells import fmt_bucket
from rlsync.report.fits import spans_overlap, time_span
from rlsync.report.rows import update_efficiency
from rlsync.report.runs import MIN_MEASURED

# Two copy floors within this ratio agree even when each was probed once (run.limit_probe=start: no spread
# of its own); a quiet machine's probe scatters less, the busy one of issue 42 moved 0.21 to 0.73 s.
FLOOR_DRIFT = 1.25


def model_label(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The row's model; with its update size when the same name comes with several sizes among `rows`
    (say `model.num_hidden_layers` swept under one name), so that each label is one model."""
    model = str(row.get("model") or "n/a")

    def size_of(r: dict[str, Any]):  # the model's update, whatever its payload sent
        return r.get("update_full_bytes") or r.get("update_bytes")

    sizes = {size_of(r) for r in rows if str(r.get("model") or "n/a") == model}
    size = size_of(row)
    return f"{model} ({size / MIB:.3g} MiB)" if len(sizes) > 1 and is_number(size) else model


def setup_label(row: dict[str, Any], bucket: bool = True) -> str:
    """ "direct, bucket 512 MiB", "ipc, per_tensor", "direct (ENGINE), STRATEGY": how the run updated.
    A per_tensor run has no bucket size, whatever update.bucket_mb said."""
    transport = (
        str(row.get("transport") or "n/a")
        + ("" if row.get("payload") in (None, "full") else f", {row['payload']}")
        + ("" if row.get("engine") in (None, "hf") else f" ({row['engine']})")
    )
    strategy = row.get("strategy")
    if strategy in (None, "bucketed"):
        how = f"bucket {fmt_bucket(row.get('bucket_mb'))} MiB" if bucket else "bucketed"
    else:
        how = str(strategy)
    return f"{transport}, {how}"


def measured_unit(row: dict[str, Any]) -> str:
    """What a run's measured samples are: a bench's timed repeats, or steps."""
    return "repeats" if row.get("bench") else "steps"


@dataclass
class Best:
    """The fastest run of one model by one time, against the runner-up, and whether the gap is real."""

    model: str
    stem: str  # "update" | "step": which <stem>_time_* the runs are ranked by
    ranked: list[dict[str, Any]]  # the model's rows with that time, fastest median first (broken ones left out)
    warning: str = ""  # why the difference is not called real ("" when it survives every check)
    broken: list[dict[str, Any]] = field(default_factory=list)  # rows left out: a broken measurement (row["broken"])
    labels: dict[str, str] = field(default_factory=dict)  # job -> its setup, told apart from runs that read alike

    @property
    def best(self) -> dict[str, Any]:
        return self.ranked[0]

    @property
    def runner_up(self) -> Optional[dict[str, Any]]:
        return self.ranked[1] if len(self.ranked) > 1 else None

    def describe(self) -> str:
        what = f"{self.model}, fastest {'update' if self.stem == 'update' else 'step'}"
        left_out = self.left_out_text()
        if not self.ranked:
            return f"{what}: no run to rank.{left_out}"
        best, other = self.best, self.runner_up
        if other is None:
            return f"{what}: {self.run_text(best)}; the only run with this time, nothing to compare.{left_out}"
        lead, second = best[f"{self.stem}_time_median"], other[f"{self.stem}_time_median"]
        if second == lead:
            line = f"{what}: a tie between {self.run_text(best)} and {self.run_text(other)} (equal medians)."
        else:
            line = (
                f"{what}: {self.run_text(best)}; {fmt_lead(lead, second)} faster ({fmt_seconds(second - lead)} less) "
                f"than the runner-up {self.run_text(other)}."
            )
        if self.warning:
            return f"{line} Warning: {self.warning}{left_out}"
        return (
            f"{line} The ranges do not overlap, time over the copy floor ranks them alike and their copy floors "
            f"agree: the difference is real.{left_out}"
        )

    def run_text(self, row: dict[str, Any]) -> str:
        """ "run 2 (ipc, bucket 512 MiB) 1.21 ms median (1.18 to 1.30 ms over 3 repeats)"."""
        stem = self.stem
        spread = fmt_spread(row[f"{stem}_time_median"], row.get(f"{stem}_time_min"), row.get(f"{stem}_time_max"))
        label = self.labels.get(row["job"]) or setup_label(row)
        return f"run {row['job']} ({label}) {spread} over {row.get('measured_steps')} {measured_unit(row)}"

    def left_out_text(self) -> str:
        """ " Not ranked, a broken measurement: run 1 (direct, bucket 512 MiB): its update ran at ..."."""
        if not self.broken:
            return ""
        named = "; ".join(
            f"run {r['job']} ({self.labels.get(r['job']) or setup_label(r)}): {r['broken']}" for r in self.broken
        )
        return f" Not ranked, a broken measurement: {named}."


def fmt_lead(best: float, other: float) -> str:
    """How much faster best is than other: "1.52x"; under 1.1x as a percentage ("0.27 %"), which a
    ratio would round to "1.00x"."""
    if best <= 0:
        return "n/a"
    ratio = other / best
    return fmt_ratio(ratio) if ratio >= 1.1 else fmt_share(ratio - 1)


def ran_together(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether the two runs' spans (summary.json's started_at to ended_at) overlap: they shared the machine."""
    ends = (a.get("started_at"), a.get("ended_at"), b.get("started_at"), b.get("ended_at"))
    return all(is_number(t) for t in ends) and spans_overlap((ends[0], ends[1]), (ends[2], ends[3]))


def floor_span(row: dict[str, Any]) -> Optional[tuple[float, float]]:
    """The lowest and highest copy floor probed beside the run's measured steps (its median alone when
    the run probed once); None when it recorded none."""
    median = row.get("update_limit_time_median")
    if not is_number(median):
        return None
    lo, hi = row.get("update_limit_time_min"), row.get("update_limit_time_max")
    return (lo if is_number(lo) else median), (hi if is_number(hi) else median)


def floors_agree(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The two runs' copy floors agree within their spread (their min-max ranges meet), or within
    FLOOR_DRIFT of each other: the machine under them was the same machine."""
    fa, fb, ma, mb = floor_span(a), floor_span(b), a["update_limit_time_median"], b["update_limit_time_median"]
    return spans_overlap(fa, fb) or (min(ma, mb) > 0 and max(ma, mb) / min(ma, mb) <= FLOOR_DRIFT)


def over_floor(row: dict[str, Any], stem: str) -> Optional[float]:
    """The run's time in units of its copy floor (time / floor): the update's from each step's own ratio,
    the step's over the floor's median. Lower is better, whatever the machine did between runs."""
    if stem == "update":
        eff = update_efficiency(row)
        return 1 / eff if eff else None
    floor, seconds = row.get("update_limit_time_median"), row.get(f"{stem}_time_median")
    return seconds / floor if is_number(floor) and floor > 0 and is_number(seconds) else None


def ranking_warning(best: dict[str, Any], other: dict[str, Any], stem: str, ranked: list[dict[str, Any]] = ()) -> str:
    """Why best is not called faster than other, in one line; "" when the difference is real. `ranked`:
    every run of the model, whose floors the line lists when the machine moved under them."""
    more = " or ".join(dict.fromkeys("bench.repeats" if r.get("bench") else "run.steps" for r in (best, other)))
    few = [r for r in (best, other) if (r.get("measured_steps") or 0) < MIN_MEASURED]
    if few:
        named = " and ".join(f"run {r['job']} measured {r.get('measured_steps') or 0} {measured_unit(r)}" for r in few)
        return f"{named}, fewer than {MIN_MEASURED}: too few to tell a real difference from noise (raise {more})."
    if ran_together(best, other):
        return (
            f"runs {best['job']} and {other['job']} ran at the same time: each timed the other's load, so their "
            f"difference is not called (run them one after another: Hydra's default launcher)."
        )
    unfloored = [r for r in (best, other) if floor_span(r) is None]
    if unfloored:
        named = " and ".join(f"run {r['job']}" for r in unfloored)
        return (
            f"{named} recorded no copy floor: a faster setting cannot be told from a faster machine, so the "
            f"difference is not called."
        )
    if not floors_agree(best, other):
        floored = sorted((r for r in ranked or (best, other) if floor_span(r)), key=job_order)
        scale, unit, decimals = time_unit(max(r["update_limit_time_median"] for r in floored))
        floors = " / ".join(f"{r['update_limit_time_median'] * scale:.{decimals}f}" for r in floored)
        jobs = " / ".join(str(r["job"]) for r in floored)
        return (
            f"the copy floor moved {floors} {unit} between runs {jobs}: the machine changed under them, so the "
            f"difference is not called; rerun on a quiet machine."
        )
    for fact in MUST_MATCH:  # what the two ran with, beside the setting compared, that moves their times
        if said := fact.warning(best, other):
            return said
    if spans_overlap(time_span([best], stem), time_span([other], stem)):
        return (
            f"the min-max ranges of runs {best['job']} and {other['job']} overlap: the difference may be noise "
            f"(raise {more})."
        )
    mine, theirs = over_floor(best, stem), over_floor(other, stem)
    if mine is None or theirs is None or mine >= theirs:
        at = f" ({fmt_ratio(mine)} against {fmt_ratio(theirs)} its floor)" if mine and theirs else ""
        return (
            f"over its copy floor run {best['job']} is not the faster{at}: time and time / floor rank runs "
            f"{best['job']} and {other['job']} differently, so the difference is not called; rerun on a quiet machine."
        )
    return ""


@dataclass(frozen=True)
class SetupFact:
    """Something a run ran with, beside the setting its sweep compares, that moves its times: where two runs differ
    in it, their difference may be that fact's, not the setting's, and it is not called."""

    apart: Callable[[dict[str, Any], dict[str, Any]], Optional[str]]  # "copied on 2 and 1 threads, ...": None: alike
    cause: str  # what the difference may be instead of the setting
    remedy: str  # how to compare the two runs

    def warning(self, best: dict[str, Any], other: dict[str, Any]) -> str:
        """ "runs 1 and 0 copied on 2 and 1 threads, ...: the difference may be ..." where they differ in it, else ""."""
        said = self.apart(best, other)
        if said is None:
            return ""
        return (
            f"runs {best['job']} and {other['job']} {said}: the difference may be {self.cause}, not the setting, so it "
            f"is not called ({self.remedy})."
        )


def auto_threads_apart(best: dict[str, Any], other: dict[str, Any]) -> Optional[str]:
    """Best's and other's copy threads where they differ and auto chose them for at least one run (its probe picks
    1 or 2 threads within noise: a sweep's jobs can resolve it apart, moving a ratio by up to 1.4x on a 2-core CPU);
    None where they agree, are unknown, or a run set them (then the threads are the setting compared)."""
    threads = (best.get("copy_threads"), other.get("copy_threads"))
    if not all(is_number(t) for t in threads) or threads[0] == threads[1]:
        return None
    setups = [r.get("setup") if isinstance(r.get("setup"), dict) else {} for r in (best, other)]
    if not any(str(s.get("copy_threads_why", "")).startswith("auto") for s in setups):
        return None
    return f"copied on {int(threads[0])} and {int(threads[1])} threads, as update.copy_threads=auto chose for each"


def kernels_apart(best: dict[str, Any], other: dict[str, Any]) -> Optional[str]:
    """The kernels that encoded and decoded the same payload in each run where they differ (rows.kernel_names: one
    machine built the payload's C kernel, another had no C compiler and ran numpy's steps); None where they agree, either run
    recorded none (a run from before setup.payload_kernels: unknown, never different) or the payloads or the kinds
    of device differ (then the kernels come with the setting compared: a CPU's and a GPU's are their own)."""
    kernels = (best.get("kernels"), other.get("kernels"))
    if None in kernels or kernels[0] == kernels[1] or best.get("payload") != other.get("payload"):
        return None
    kinds = {str(r["device"]).partition(":")[0] for r in (best, other) if r.get("device")}  # cuda:0 and cuda alike
    if len(kinds) > 1:
        return None
    return f"ran their {best['payload']} payload's encode and decode on {kernels[0]} and {kernels[1]}"


# What two runs must share for their difference to be called, checked in this order after the machine's own checks.
MUST_MATCH = (
    SetupFact(auto_threads_apart, "the thread count", "set update.copy_threads to compare"),
    SetupFact(
        kernels_apart,
        "the kernels",
        "compare runs whose payload ran on the same kernels: each summary.json's setup.payload_kernels says why a "
        "faster one did not run",
    ),
)


def job_order(row: dict[str, Any]) -> tuple:
    """Runs in the order they were numbered (a sweep's job 2 before job 10)."""
    job = str(row["job"])
    return (0, int(job), "") if job.isdigit() else (1, 0, job)


def setup_labels(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Each run's setup_label; where runs share one (ddp and fsdp2 read "direct, bucket 512 MiB" alike),
    with what differs between them: their own overrides, else the setup keys summary.json resolved."""
    labels = {r["job"]: setup_label(r) for r in rows}
    alike: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        alike.setdefault(labels[row["job"]], []).append(row)
    for label, members in alike.items():
        if len(members) < 2:
            continue
        shared = set.intersection(*(set(m.get("override_list") or []) for m in members))
        setups = [m.get("setup") if isinstance(m.get("setup"), dict) else {} for m in members]
        keys = [k for k in dict.fromkeys(k for s in setups for k in s) if not k.endswith("_why")]
        differing = [k for k in keys if len({repr(s.get(k)) for s in setups}) > 1]
        for member, setup in zip(members, setups):
            own = [o for o in member.get("override_list") or [] if o not in shared]
            own = own or [f"{k} {setup.get(k)}" for k in differing]
            labels[member["job"]] = f"{label}, {' '.join(own)}" if own else label
    return labels


def best_settings(rows: list[dict[str, Any]]) -> list[Best]:
    """Per model: the fastest update, and the fastest step where steps ran, each against its runner-up;
    a broken measurement left out of the ranking, and named. Another framework's runs are not ranked: their
    update and step keys span other work than rlsync's (each answers with its own verdict instead)."""
    out = []
    own = [r for r in rows if not r.get("framework")]
    for stem in ("update", "step"):
        timed = [r for r in own if is_number(r.get(f"{stem}_time_median"))]
        models: dict[str, list[dict[str, Any]]] = {}
        for row in timed:
            models.setdefault(model_label(row, timed), []).append(row)
        for model, members in models.items():
            trusted = [r for r in members if not r.get("broken")]
            ranked = sorted(trusted, key=lambda r: r[f"{stem}_time_median"])  # stable: ties keep the run order
            warning = ranking_warning(ranked[0], ranked[1], stem, ranked) if len(ranked) > 1 else ""
            broken = [r for r in members if r.get("broken")]
            out.append(Best(model, stem, ranked, warning, broken, setup_labels(members)))
    return out
