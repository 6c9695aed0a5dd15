"""Which setting won: per model the fastest update and step against the runner-up, and whether the
gap stands out of the noise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rlsync.fmt import MIB, fmt_ratio, fmt_seconds, fmt_share, fmt_spread, is_number
from rlsync.report.cells import fmt_bucket
from rlsync.report.fits import spans_overlap, time_span
from rlsync.report.runs import MIN_MEASURED


def model_label(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The row's model; with its update size when the same name comes with several sizes among `rows`
    (say `model.num_hidden_layers` swept under one name), so that each label is one model."""
    model = str(row.get("model") or "n/a")

    def size_of(r: dict[str, Any]):  # the model's update, whatever its payload sent (a delta: fewer bytes)
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
    ranked: list[dict[str, Any]]  # the model's rows with that time, fastest median first
    warning: str = ""  # why the ranking may be noise ("" when the ranges stand apart, with enough samples)

    @property
    def best(self) -> dict[str, Any]:
        return self.ranked[0]

    @property
    def runner_up(self) -> Optional[dict[str, Any]]:
        return self.ranked[1] if len(self.ranked) > 1 else None

    def describe(self) -> str:
        what = f"{self.model}, fastest {'update' if self.stem == 'update' else 'step'}"
        best, other = self.best, self.runner_up
        if other is None:
            return f"{what}: {self.run_text(best)}; the only run with this time, nothing to compare"
        lead, second = best[f"{self.stem}_time_median"], other[f"{self.stem}_time_median"]
        if second == lead:
            line = f"{what}: a tie between {self.run_text(best)} and {self.run_text(other)} (equal medians)."
        else:
            line = (
                f"{what}: {self.run_text(best)}; {fmt_lead(lead, second)} faster ({fmt_seconds(second - lead)} less) "
                f"than the runner-up {self.run_text(other)}."
            )
        return (
            f"{line} Warning: {self.warning}"
            if self.warning
            else f"{line} The ranges do not overlap: the difference is real."
        )

    def run_text(self, row: dict[str, Any]) -> str:
        """ "run 2 (ipc, bucket 512 MiB) 1.21 ms median (1.18 to 1.30 ms over 3 repeats)"."""
        stem = self.stem
        spread = fmt_spread(row[f"{stem}_time_median"], row.get(f"{stem}_time_min"), row.get(f"{stem}_time_max"))
        return f"run {row['job']} ({setup_label(row)}) {spread} over {row.get('measured_steps')} {measured_unit(row)}"


def fmt_lead(best: float, other: float) -> str:
    """How much faster best is than other: "1.52x"; under 1.1x as a percentage ("0.27 %"), which a
    ratio would round to "1.00x"."""
    if best <= 0:
        return "n/a"
    ratio = other / best
    return fmt_ratio(ratio) if ratio >= 1.1 else fmt_share(ratio - 1)


def ranking_warning(best: dict[str, Any], other: dict[str, Any], stem: str) -> str:
    """Why best may not really beat other: too few samples, or min-max ranges that overlap; "" otherwise."""
    more = " or ".join(dict.fromkeys("bench.repeats" if r.get("bench") else "run.steps" for r in (best, other)))
    few = [r for r in (best, other) if (r.get("measured_steps") or 0) < MIN_MEASURED]
    if few:
        named = " and ".join(f"run {r['job']} measured {r.get('measured_steps') or 0} {measured_unit(r)}" for r in few)
        return f"{named}, fewer than {MIN_MEASURED}: too few to tell a real difference from noise (raise {more})."
    if spans_overlap(time_span([best], stem), time_span([other], stem)):
        return (
            f"the min-max ranges of runs {best['job']} and {other['job']} overlap: the difference may be noise "
            f"(raise {more})."
        )
    return ""


def best_settings(rows: list[dict[str, Any]]) -> list[Best]:
    """Per model: the fastest update, and the fastest step where steps ran, each against its runner-up."""
    out = []
    for stem in ("update", "step"):
        timed = [r for r in rows if is_number(r.get(f"{stem}_time_median"))]
        models: dict[str, list[dict[str, Any]]] = {}
        for row in timed:
            models.setdefault(model_label(row, timed), []).append(row)
        for model, members in models.items():
            ranked = sorted(members, key=lambda r: r[f"{stem}_time_median"])  # stable: ties keep the run order
            warning = ranking_warning(ranked[0], ranked[1], stem) if len(ranked) > 1 else ""
            out.append(Best(model, stem, ranked, warning))
    return out
