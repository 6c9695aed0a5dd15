"""The report's PNG plots (matplotlib, Agg backend: no display needed).

Each plot reads the table rows of `rlsync.report.table_row` (raw seconds and bytes) and either draws
its file or returns why it could not (too few points, nothing worth drawing), so that one missing
series never costs the other plots; a plot that draws may still return a note on what it left out.
`write_plots` runs them all.

What every plot shares: axes named by the metrics catalogue's labels and units (rlsync/measure/metrics.py),
never by metric ids; one series per model x transport (flat or not, engine) x strategy, labelled
"tiny, ipc, bucketed"; bucket sizes on a log2 axis; bars one per run, horizontal, so that a run's
label (job, model, transport, strategy, bucket) has its own line and never overlaps another's.
"""

from __future__ import annotations

import importlib.util
import math
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from rlsync import fmt
from rlsync.fmt import MIB
from rlsync.measure import metrics
from rlsync.report.cells import PER_TENSOR, common_overrides, fmt_bucket
from rlsync.report.fits import Fit, FitGroup
from rlsync.report.output import RefusedTarget, check_targets, replacing
from rlsync.report.ranking import model_label
from rlsync.report.rows import UPDATE_PARTS
from rlsync.report.runs import importing, stop_point

Row = dict[str, Any]
TIMELINE_MAX_RUNS = 8  # more lines than this no longer read apart in one panel
TIMELINE_LABEL_WIDTH = 38  # characters per legend line
LOG_Y_SPREAD = 30  # times spread over more than this factor: a log time axis, or the small ones lie flat at 0
FLOOR_STYLE = {"linestyle": "--", "linewidth": 1.0, "alpha": 0.8}  # each setup's copy floor, in its colour
WIDE = (9, 4.5)  # inches: a plot whose legend stands to the right of its axes
BAR_HEIGHT_IN = 0.42  # inches per bar of a horizontal bar chart: one line of label each
LEGEND_ROW_IN = 0.22  # inches per legend entry: a bar chart is at least as tall as its legend
BAR_LABEL_WIDTH = 48  # characters per line of a bar's label, wrapped beyond
LEGEND_AT = (1.02, 1.0)  # legends right of the axes, clear of the last tick label


def as_float(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def axis_unit(seconds: list[float]) -> tuple[float, str]:
    """Scale and unit so that the largest time reads as a plain number."""
    scale, unit, _ = fmt.time_unit(max(seconds, default=1.0))
    return scale, unit


def label_of(metric: str) -> str:
    """What the catalogue calls `metric` ("weight update", "copy floor", "peak update memory")."""
    return metrics.declared()[metric].label


def time_label(metric: str) -> str:
    """A phase's time as an axis names it: "weight update time"."""
    return f"{label_of(metric)} time"


def transport_label(row: Row) -> str:
    """ "direct", "ipc flat" (a bucketed update into the engine's flat weights), "direct (vllm)"."""
    flat = " flat" if row.get("flat_engine_weights") and row.get("strategy") != PER_TENSOR else ""
    engine = "" if row.get("engine") in (None, "hf") else f" ({row['engine']})"
    payload = "" if row.get("payload") in (None, "full") else f" {row['payload']}"  # update.payload, where not full
    return f"{row.get('transport') or 'n/a'}{flat}{payload}{engine}"


def series_label(row: Row, rows: list[Row]) -> str:
    """One series per model x transport x strategy: "tiny, ipc flat, bucketed"; the scheme too when
    the runs differ in it (scheme=miles,verl sets the same knobs differently)."""
    parts = [model_label(row, rows), transport_label(row), str(row.get("strategy") or "bucketed")]
    if len({r.get("scheme") for r in rows}) > 1 and row.get("scheme"):
        parts.append(f"scheme {row['scheme']}")
    return ", ".join(parts)


def bar_label(row: Row, rows: list[Row]) -> str:
    """A bar's label: the job and everything that sets its update apart, "3: tiny, ipc, bucketed, 4 MiB";
    with the run's own overrides too where another run has the same setup (they differ in something else)."""

    def setup(r: Row) -> str:
        bucket = "" if r.get("strategy") == PER_TENSOR else f", {fmt_bucket(r.get('bucket_mb'))} MiB"
        return f"{series_label(r, rows)}{bucket}"

    label = f"{row['job']}: {setup(row)}"
    if sum(setup(r) == setup(row) for r in rows) > 1:
        common = set(common_overrides(rows))
        own = [o for o in row.get("override_list", []) if o not in common]
        label += f" ({' '.join(own)})" if own else ""
    return textwrap.fill(label, width=BAR_LABEL_WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def by_setup(rows: list[Row], x_key: str, y_key: str) -> dict[str, list[Row]]:
    """Rows with both values, one series per model and transport/strategy (engine), sorted along x:
    a line joins only runs that differ in x. Labelled "tiny, direct, bucketed", "tiny, ipc, per_tensor"
    (a model name that comes with several update sizes is split by size, so each line is one model)."""
    rows = [r for r in rows if as_float(r.get(x_key)) is not None and as_float(r.get(y_key)) is not None]
    series: dict[str, list[Row]] = {}
    for row in rows:
        series.setdefault(series_label(row, rows), []).append(row)
    return {m: sorted(rs, key=lambda r: r[x_key]) for m, rs in sorted(series.items())}


def per_tensor_levels(
    ax, rows: list[Row], y_key: str, scale: float, colors_used: int, floor_key: Optional[str] = None
) -> int:
    """per_tensor runs on a bucket-size axis: a bucket size does not apply to them, so each setup is a
    dotted level across the axis, labelled "<model>, <transport>, per_tensor" (with `floor_key`, its
    copy floor a dashed level in the same colour). Returns how many setups it drew."""
    levels = by_setup([r for r in rows if r.get("strategy") == PER_TENSOR], y_key, y_key)
    for index, (label, rs) in enumerate(levels.items()):
        color = f"C{colors_used + index}"
        for row in rs:  # one per run; several runs of one setup share the colour and the label
            ax.axhline(row[y_key] * scale, color=color, linestyle=":", label=label if row is rs[0] else None)
            floor = as_float(row.get(floor_key)) if floor_key else None
            if floor is not None:
                ax.axhline(floor * scale, color=color, gid=f"copy floor: {label}", **FLOOR_STYLE)
    return len(levels)


def pyplot():
    """matplotlib.pyplot on the Agg backend: the report is written where no display is."""
    with importing():  # a stop signal meanwhile: acted on after the import, not inside its C extensions
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    return plt


def new_axes(title: str, size: tuple[float, float] = (7, 4.5)):
    fig, ax = pyplot().subplots(figsize=size, dpi=100)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return fig, ax


def save(fig, path: Path) -> None:
    """The figure as a PNG at `path`, whole or not at all, never through a link (rlsync/report/output.py)."""
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        with replacing(path, "wb") as f:
            fig.savefig(f, format="png")
    finally:
        plt.close(fig)


def bucket_axis(ax, buckets: list[float]) -> None:
    """Log2 (bucket sizes are swept in powers: 1, 4, 16 or 128, 512, 2048), ticks at the sizes swept, plain numbers."""
    from matplotlib.ticker import FuncFormatter, NullLocator

    if min(buckets) > 0:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(min(buckets) / 1.4, max(buckets) * 1.4)  # the end points' markers and bars inside the frame
    ax.set_xticks(buckets)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel("bucket size (MiB, log scale)")


def time_axis(ax, values: list[float], label: str) -> None:
    """A time axis from 0; log when the values spread over more than LOG_Y_SPREAD (ipc per_tensor beside direct)."""
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > LOG_Y_SPREAD:
        ax.set_yscale("log")
        log_axis_labels(ax.yaxis)
        label += ", log scale"
    else:
        ax.set_ylim(bottom=0)
    ax.set_ylabel(label)


def side_legend(ax, title: str) -> None:
    """The series' legend right of the axes, in the order they were drawn (per_tensor levels last:
    matplotlib lists plain lines before error bars)."""
    from matplotlib.container import ErrorbarContainer

    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(handles)), key=lambda i: not isinstance(handles[i], ErrorbarContainer))
    ax.legend([handles[i] for i in order], [labels[i] for i in order], title=title, fontsize="small",
              title_fontsize="small", loc="upper left", bbox_to_anchor=LEGEND_AT)  # fmt: skip


def min_max_bars(rows: list[Row], scale: float) -> list[list[float]]:
    """Error bar lengths below and above each median: down to the min, up to the max."""
    below, above = [], []
    for r in rows:
        median = r["update_time_median"]
        below.append((median - (as_float(r.get("update_time_min")) or median)) * scale)
        above.append(((as_float(r.get("update_time_max")) or median) - median) * scale)
    return [below, above]


def plot_update_time_vs_bucket(rows: list[Row], fits: list[FitGroup], path: Path) -> Optional[str]:
    """Median update time per bucket size, min to max as bars, each setup's copy floor dashed beside it."""
    series = by_setup(rows, "bucket_mb", "update_time_median")
    buckets = {r["bucket_mb"] for rs in series.values() for r in rs}
    if len(buckets) < 2:
        return f"{path.name} skipped: needs runs with at least two bucket sizes (found {len(buckets)})"
    timed = [r for r in rows if as_float(r.get("update_time_median")) is not None]
    floors = [as_float(r.get("update_limit_time_median")) for r in timed]
    drawn = [as_float(r.get("update_time_max")) or r["update_time_median"] for r in timed]
    drawn += [as_float(r.get("update_time_min")) or r["update_time_median"] for r in timed]
    scale, unit = axis_unit(drawn)
    fig, ax = new_axes("Weight update time vs bucket size\n(median, bars: min to max; dashed: the copy floor)", WIDE)
    for index, (label, rs) in enumerate(series.items()):
        xs = [r["bucket_mb"] for r in rs]
        ys = [r["update_time_median"] * scale for r in rs]
        ax.errorbar(xs, ys, yerr=min_max_bars(rs, scale), marker="o", capsize=3, color=f"C{index}", label=label)
        floor = [(r["bucket_mb"], as_float(r.get("update_limit_time_median"))) for r in rs]
        floor = [(x, y * scale) for x, y in floor if y is not None]
        if floor:  # the plain copy over the same path, timed in the same run: how far the update is from it
            ax.plot(*zip(*floor), color=f"C{index}", marker="x", gid=f"copy floor: {label}", **FLOOR_STYLE)
    per_tensor_levels(ax, timed, "update_time_median", scale, len(series), floor_key="update_limit_time_median")
    bucket_axis(ax, sorted(buckets))
    time_axis(
        ax,
        [v * scale for v in drawn + [f for f in floors if f]],
        f"{time_label('perf/update_weights_time')}, median ({unit})",
    )
    title = "model, transport, strategy" + ("\n(dashed, same colour: its copy floor)" if any(floors) else "")
    side_legend(ax, title)
    save(fig, path)
    return None if any(floors) else f"{path.name}: no run measured a copy floor, none drawn"


def plot_update_time_vs_bytes(rows: list[Row], fits: list[FitGroup], path: Path) -> Optional[str]:
    if not any(group.fit for group in fits):
        return f"{path.name} skipped: no setup has a meaningful fit of update time against bytes (see the fit lines)"
    points = [r for group in fits for r in group.rows]
    scale, unit = axis_unit([r["update_time_median"] for r in points])
    fig, ax = new_axes("Weight update time vs bytes sent", WIDE if len(fits) > 1 else (7, 4.5))
    xs = [0.0, max(r["update_bytes"] for r in points) * 1.05]
    if len(fits) == 1:
        draw_single_fit(ax, fits[0], xs, scale, unit)
    else:
        draw_fit_per_group(ax, fits, xs, scale, unit)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=min(0.0, *(group.fit.fixed_s * scale * 1.1 for group in fits if group.fit)))
    ax.set_xlabel(f"{label_of('perf/update_weights_bytes')} sent per update (MiB)")
    ax.set_ylabel(f"{time_label('perf/update_weights_time')}, median ({unit})")
    save(fig, path)
    return None


def fit_line(ax, fit: Fit, xs: list[float], scale: float, **style) -> None:
    ax.plot([x / MIB for x in xs], [(fit.fixed_s + x * fit.seconds_per_byte) * scale for x in xs], **style)


def draw_single_fit(ax, group: FitGroup, xs: list[float], scale: float, unit: str) -> None:
    """Every run on one line: points by model and setup, the line in black, its numbers in a box."""
    fit = group.fit
    for model, rs in by_setup(group.rows, "update_bytes", "update_time_median").items():
        ax.scatter(
            [r["update_bytes"] / MIB for r in rs], [r["update_time_median"] * scale for r in rs], label=model, zorder=3
        )
    fit_line(ax, fit, xs, scale, color="k", linestyle="--", label="fit")
    bandwidth = fit.bandwidth_gbps
    text = f"fixed cost {fit.fixed_s * scale:.3g} {unit}\n" + (
        f"bandwidth {bandwidth:.3g} GB/s" if bandwidth else "bandwidth not resolved"
    )
    ax.text(0.02, 0.97, text, transform=ax.transAxes, va="top", bbox={"facecolor": "white", "alpha": 0.8})
    ax.legend(loc="lower right", fontsize="small")


def draw_fit_per_group(ax, fits: list[FitGroup], xs: list[float], scale: float, unit: str) -> None:
    """One colour per transport: its points and its own line, whose numbers the legend gives."""
    for index, group in enumerate(fits):
        color, fit = f"C{index}", group.fit
        if fit is None:
            why = (group.why_not or "too few update sizes").split(":")[0].split(";")[0]  # its first clause
            label = textwrap.fill(f"{group.label}: no fit ({why})", width=50, subsequent_indent="  ")
        else:
            slope = f"bytes / {fit.bandwidth_gbps:.3g} GB/s" if fit.bandwidth_gbps else "bandwidth not resolved"
            label = f"{group.label}: {fit.fixed_s * scale:.3g} {unit} + {slope}"
            fit_line(ax, fit, xs, scale, color=color, linestyle="--", label=label)
        xs_mib = [r["update_bytes"] / MIB for r in group.rows]
        ys = [r["update_time_median"] * scale for r in group.rows]
        ax.scatter(xs_mib, ys, color=color, zorder=3, label=label if fit is None else None)
    ax.legend(loc="upper left", bbox_to_anchor=LEGEND_AT, fontsize="small", title="fit per setup")


def step_parts(row: Row) -> dict[str, float]:
    """Median seconds per part of the step (the catalogue's), plus "other" for what the step spends outside them."""
    parts = {p.name: as_float(row.get(f"{p.name}_time_median")) for p in metrics.step_phases()}
    parts = {p: v for p, v in parts.items() if v is not None}
    step = as_float(row.get("step_time_median"))
    if step is not None and step > sum(parts.values()):
        parts["other"] = step - sum(parts.values())
    return parts


def bucket_label(row: Row) -> str:
    """ "512 MiB"; "per_tensor" for a run without buckets; "" when the bucket size is not known."""
    if row.get("strategy") == PER_TENSOR:
        return PER_TENSOR
    bucket = as_float(row.get("bucket_mb"))
    return f"{bucket:g} MiB" if bucket is not None else ""


def bar_axes(title: str, labels: list[str], legend_entries: int):
    """A horizontal bar chart, one bar per run from the top, as tall as its labels (and its legend) need."""
    lines = sum(label.count("\n") + 1 for label in labels)  # a wrapped label takes the room of its lines
    height = max(1.6 + BAR_HEIGHT_IN * len(labels) + LEGEND_ROW_IN * (lines - len(labels)),
                 1.2 + LEGEND_ROW_IN * legend_entries)  # fmt: skip
    fig, ax = pyplot().subplots(figsize=(10, height), dpi=100)
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()  # the first run on top, as in report.md
    ax.tick_params(axis="y", labelsize="small")
    return fig, ax


def stacked_bars(ax, parts: list[dict[str, float]], order: list[tuple[str, str, str]], scale: float) -> list[float]:
    """Each (name, label, colour) of `order` stacked left to right in every bar; returns the bars' ends."""
    lefts = [0.0] * len(parts)
    for name, label, color in order:
        widths = [p.get(name, 0.0) * scale for p in parts]
        if any(widths):
            ax.barh(range(len(parts)), widths, left=lefts, color=color or None, label=label, height=0.6)
            lefts = [a + w for a, w in zip(lefts, widths)]
    return lefts


def plot_step_breakdown(rows: list[Row], fits: list[FitGroup], path: Path) -> Optional[str]:
    """The median step by phase, one bar per run of the step loop, the update's share at its end.
    A bench has no step (its rows are repeats of the update alone): update_phases.png splits those."""
    stepped = [r for r in rows if not r.get("bench") and as_float(r.get("step_time_median")) is not None]
    bars = [(row, step_parts(row)) for row in stepped]
    bars = [(row, parts) for row, parts in bars if parts]
    if not bars:
        why = "the runs are benchmarks, which time no step (update_phases.png splits the update)"
        return f"{path.name} skipped: " + (why if any(r.get("bench") for r in rows) else "no run logged phase times")
    scale, unit = axis_unit([sum(parts.values()) for _, parts in bars])
    drawn_rows = [row for row, _ in bars]
    order = [(p.name, p.label, p.color) for p in (*metrics.step_phases(), metrics.OTHER)]  # the order the step runs
    entries = sum(any(parts.get(name) for _, parts in bars) for name, _, _ in order)
    fig, ax = bar_axes("Median step by phase (the weight update's share at the end)",
                       [bar_label(row, drawn_rows) for row in drawn_rows], entries)  # fmt: skip
    ends = stacked_bars(ax, [parts for _, parts in bars], order, scale)
    for y, ((_row, parts), end) in enumerate(zip(bars, ends)):
        if "update_weights" in parts and sum(parts.values()) > 0:
            share = parts["update_weights"] / sum(parts.values())
            ax.annotate(f" update {fmt.fmt_share(share)}", (end, y), va="center", ha="left", fontsize="small")
    ax.set_xlim(0, max(ends) * 1.3)  # room for the share beside the longest bar
    ax.set_xlabel(f"{time_label('perf/step_time')}, median ({unit})")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=LEGEND_AT, title="phase")
    save(fig, path)
    return None


IDLE_COLORS = {  # the engine's own parts of its idle time in the colours of its release and resume phases
    "perf/engine_idle_release_time": metrics.phase_named("engine_release").color,
    "perf/engine_idle_resume_time": metrics.phase_named("engine_resume").color,
    "perf/engine_idle_between_time": "#bbbbbb",
    "perf/engine_idle_probe_time": "#e5c494",
}


def plot_engine_idle(rows: list[Row], fits: list[FitGroup], path: Path) -> Optional[str]:
    """The engine's median idle time by part (summary.json's engine_idle: each part from the same
    intervals), one bar per run of the step loop, the update's share of it at its end."""
    bars = [
        (row, {k: v["median"] for k, v in row["engine_idle"]["parts"].items()})
        for row in rows
        if row.get("engine_idle")
    ]
    if not bars:
        why = "the runs are benchmarks, which time no step" if any(r.get("bench") for r in rows) else "no run logged it"
        return f"{path.name} skipped: {why} (perf/engine_idle_time, from a run's second step)"
    for row, parts in bars:  # what no part holds: scoring, the prompts, update.verify
        rest = row["engine_idle"]["time"]["median"] - sum(parts.values())
        parts["other"] = max(rest, 0.0)
    scale, unit = axis_unit([row["engine_idle"]["time"]["median"] for row, _ in bars])
    drawn_rows = [row for row, _ in bars]
    phases = {p.metric.name: p for p in metrics.PHASES}
    labels = metrics.declared()
    order = [
        (
            p.metric,
            labels[p.metric].label,
            phases[p.metric].color if p.metric in phases else IDLE_COLORS.get(p.metric, ""),
        )
        for p in metrics.IDLE_PARTS
    ]
    order.append(("other", metrics.OTHER.label, metrics.OTHER.color))
    entries = sum(any(parts.get(name) for _, parts in bars) for name, _, _ in order)
    fig, ax = bar_axes("Median engine idle by part (the weight update's share at the end)",
                       [bar_label(row, drawn_rows) for row in drawn_rows], entries)  # fmt: skip
    ends = stacked_bars(ax, [parts for _, parts in bars], order, scale)
    for y, ((row, _parts), end) in enumerate(zip(bars, ends)):
        share = row.get("update_idle_share")
        if share is not None:
            ax.annotate(f" update {fmt.fmt_share(share)}", (end, y), va="center", ha="left", fontsize="small")
    ax.set_xlim(0, max(ends) * 1.3)
    ax.set_xlabel(f"{time_label('perf/engine_idle_time')}, median ({unit})")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=LEGEND_AT, title="part")
    save(fig, path)
    return None


STALL_BARS = (  # (figure, label, colour): a policy's two bars, the gap a client saw and the copy under it
    ("max_gap", "longest client-seen gap", "#c44e52"),
    ("receive", "the engine's receive (the copy)", "#4c72b0"),
)


def plot_client_stalls(rows: list[Row], fits: list[FitGroup], path: Path) -> Optional[str]:
    """Per stall bench and policy: the longest gap between two tokens a streaming client saw (median,
    min to max) beside the engine's receive of the update, so it shows which of the two to tune."""
    bars = [(row, policy, f) for row in rows for policy, f in (row.get("client_stalls") or {}).items()]
    if not bars:
        return f"{path.name} skipped: no run is a stall bench (python -m rlsync.bench bench.target=stall)"
    drawn_rows = [row for row, _, _ in bars]
    labels = [f"{bar_label(row, drawn_rows)}, {policy}" for row, policy, _ in bars]
    medians = [f[name]["median"] for _, _, f in bars for name, _, _ in STALL_BARS if f.get(name)]
    scale, unit = axis_unit(medians)
    fig, ax = bar_axes("Client-seen stall beside the update's copy, per policy", labels, len(STALL_BARS))
    height = 0.38
    for k, (name, label, color) in enumerate(STALL_BARS):
        ys, widths, low, high = [], [], [], []
        for y, (_, _, f) in enumerate(bars):
            if f.get(name):
                st = f[name]
                ys.append(y + (k - 0.5) * height)
                widths.append(st["median"] * scale)
                low.append((st["median"] - st["min"]) * scale)
                high.append((st["max"] - st["median"]) * scale)
        ax.barh(ys, widths, height=height, color=color, label=label, xerr=[low, high], capsize=3)
    ax.set_xlabel(f"time ({unit}): median, whiskers min to max over the timed updates")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=LEGEND_AT)
    save(fig, path)
    return None


def update_parts(row: Row) -> dict[str, float]:
    """The update's median split (gather, pack, transfer, load: what the transport times), plus
    "unsplit" for the rest of the median update; {} when the run logged no split."""
    parts = {p: as_float(row.get(f"update_{p}_time_median")) for p in UPDATE_PARTS}
    parts = {p: v for p, v in parts.items() if v is not None}
    total = as_float(row.get("update_time_median"))
    if not parts or total is None:
        return {}
    if total > sum(parts.values()):
        parts["unsplit"] = total - sum(parts.values())
    return parts


UPDATE_PART_COLORS = {"gather": "#ccb974", "pack": "#4c72b0", "transfer": "#dd8452", "load": "#55a868"}


def plot_update_phases(rows: list[Row], fits: list[FitGroup], path: Path) -> Optional[str]:
    """The median update split into its phases (pack, transfer, load), one bar per run: what a bench
    sweep shows instead of the step breakdown, where the update's time goes. Each bar is the run's own
    median update (100 %), so that a 1 ms and a 0.3 s update read alike; its time and its multiple of
    the copy floor are written beside it, the floor marked inside it ("|": the floor's share)."""
    from matplotlib.lines import Line2D

    bars = [(row, update_parts(row)) for row in rows]
    bars = [(row, parts) for row, parts in bars if parts]
    if not bars:
        return f"{path.name} skipped: no run logged the update's phases (perf/update_weights_pack_time, ...)"
    drawn_rows = [row for row, _ in bars]
    fig, ax = bar_axes("Weight update by phase (share of each run's median update; |: the copy floor)",
                       [bar_label(row, drawn_rows) for row in drawn_rows], len(UPDATE_PARTS) + 2)  # fmt: skip
    shares = [{p: 100 * v / sum(parts.values()) for p, v in parts.items()} for _, parts in bars]
    order = [(p, label_of(f"perf/update_weights_{p}_time"), UPDATE_PART_COLORS[p]) for p in UPDATE_PARTS]
    stacked_bars(ax, shares, [*order, ("unsplit", "not split", "#dddddd")], 1.0)
    handles, labels = ax.get_legend_handles_labels()
    marked = False
    for y, (row, parts) in enumerate(bars):
        total, floor = as_float(row.get("update_time_median")), as_float(row.get("update_limit_time_median"))
        total = total or sum(parts.values())  # the parts' medians need not add up to the update's
        efficiency = as_float(row.get("update_efficiency_median"))  # each repeat against its own floor, as the table
        times = 1 / efficiency if efficiency else total / floor if floor else None
        text = f" {fmt.fmt_seconds(total)}" + (f", {times:.3g}x the floor" if times else "")
        ax.annotate(text, (100, y), va="center", ha="left", fontsize="small")
        if floor:
            ax.plot([min(100.0, 100 * floor / total)], [y], marker="|", markersize=18, color="k", gid="copy floor")
            marked = True
    if marked:
        handles.append(Line2D([], [], color="k", marker="|", markersize=14, linestyle="", label="copy floor"))
        labels.append("copy floor")
    ax.set_xlim(0, 145)  # room for the time beside each bar
    ax.set_xticks(range(0, 101, 25))
    ax.set_xlabel(f"share of the median {time_label('perf/update_weights_time')} (%)")
    ax.legend(handles, labels, fontsize="small", loc="upper left", bbox_to_anchor=LEGEND_AT, title="phase")
    save(fig, path)
    return None


def plot_peak_memory_vs_bucket(rows: list[Row], fits: list[FitGroup], path: Path) -> Optional[str]:
    """The update's peak memory (its staging buffers) per bucket size; not drawn when every run staged
    nothing (flat engine weights pack straight into the engine's weights: a line at 0 says nothing)."""
    series = by_setup(rows, "bucket_mb", "update_peak_bytes_max")
    buckets = {r["bucket_mb"] for rs in series.values() for r in rs}
    if len(buckets) < 2:
        return f"{path.name} skipped: needs runs with perf/update_weights_peak_bytes at two or more bucket sizes"
    peaks = [as_float(r.get("update_peak_bytes_max")) for r in rows]
    if not any(peaks):
        return (
            f"{path.name} skipped: every run's update held 0 bytes beyond the weights (no staging buffer: "
            "flat engine weights, or a transport that stages nothing)"
        )
    fig, ax = new_axes(
        f"{label_of('perf/update_weights_peak_bytes').capitalize()} vs bucket size (staging buffers)", WIDE
    )
    for index, (label, rs) in enumerate(series.items()):
        ax.plot(
            [r["bucket_mb"] for r in rs],
            [r["update_peak_bytes_max"] / MIB for r in rs],
            marker="o",
            color=f"C{index}",
            label=label,
        )
    per_tensor_levels(
        ax,
        [r for r in rows if as_float(r.get("update_peak_bytes_max")) is not None],
        "update_peak_bytes_max",
        1 / MIB,
        len(series),
    )
    bucket_axis(ax, sorted(buckets))
    ax.set_ylim(bottom=0)
    ax.set_ylabel(f"{label_of('perf/update_weights_peak_bytes')}, max over repeats (MiB)")
    side_legend(ax, "model, transport, strategy")
    save(fig, path)
    return None


def log_axis_labels(axis) -> None:
    """Plain numbers on a log axis, at the powers of ten and at their 2x and 5x, so that a time
    between two decades can be read off."""
    from matplotlib.ticker import FuncFormatter

    def leading_digit(y: float) -> int:
        return round(y / 10 ** math.floor(math.log10(y))) if y > 0 else 0

    axis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}" if leading_digit(y) in (2, 5) else ""))


def timeline_label(row: Row, drawn: list[Row]) -> str:
    """The run's own overrides (what sets it apart from the other lines), else its model, transport, bucket."""
    common = set(common_overrides(drawn))
    own = [o for o in row.get("override_list", []) if o not in common]
    if own and len(drawn) > 1:  # wrapped: a long legend would squeeze the panels beside it
        return textwrap.fill(
            f"{row['job']}: {' '.join(own)}",
            width=TIMELINE_LABEL_WIDTH,
            subsequent_indent="  ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    parts = [row.get("model"), row.get("transport"), bucket_label(row)]
    return f"{row['job']}: {', '.join(str(p) for p in parts if p)}"


def shade_warmup(axes: list, rows: list[Row]) -> Optional[str]:
    """Grey band over the warm-up steps (left out of every median); returns its legend label."""
    warmups = sorted({int(r["warmup_steps"]) for r in rows if as_float(r.get("warmup_steps"))})
    warmups = [w for w in warmups if w > 0]
    for warmup in warmups:  # runs with different warm-ups: overlapping bands, darker where all agree
        for ax in axes:
            ax.axvspan(-0.5, warmup - 0.5, color="0.5", alpha=0.15, linewidth=0)
    if not warmups:
        return None
    steps = "step" if warmups == [1] else "steps"
    return f"warm-up ({' / '.join(map(str, warmups))} {steps}, not in the medians)"


def plot_step_timeline(rows: list[Row], fits: list[FitGroup], path: Path) -> Optional[str]:
    """Step and update time per step, and the update's share of each: drift, spikes and the warm-up
    that the medians hide. Bench runs have no step (their rows are repeats) and are left out."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    runs = [r for r in rows if r.get("timeline")]
    if not any(len(r["timeline"]) >= 3 for r in runs):
        return f"{path.name} skipped: needs a run with perf/step_time logged for at least 3 steps (a bench has none)"
    drawn = runs[:TIMELINE_MAX_RUNS]
    points = [p for r in drawn for p in r["timeline"]]
    scale, unit = axis_unit([p["step_time"] for p in points])
    fig, (times_ax, share_ax) = pyplot().subplots(
        2, 1, sharex=True, figsize=(9, 6.5), dpi=100, gridspec_kw={"height_ratios": [3, 2]}
    )
    fig.suptitle("Per step: step and update time, update share of the step")
    for index, row in enumerate(drawn):
        color = f"C{index}"
        steps = [p["step"] for p in row["timeline"]]
        times_ax.plot(steps, [p["step_time"] * scale for p in row["timeline"]], color=color, marker=".")
        updated = [p for p in row["timeline"] if p["update_time"] is not None]
        update_steps = [p["step"] for p in updated]
        times_ax.plot(
            update_steps, [p["update_time"] * scale for p in updated], color=color, marker=".", linestyle="--"
        )
        shares = [100 * p["update_time"] / p["step_time"] for p in updated]
        share_ax.plot(update_steps, shares, color=color, marker=".", label=timeline_label(row, drawn))
    warmup_label = shade_warmup([times_ax, share_ax], drawn)

    times_ax.set_yscale("log")  # the update is often 1% of the step: on a linear axis it lies flat at 0
    log_axis_labels(times_ax.yaxis)
    times_ax.set_ylabel(f"time per step ({unit}, log scale)")
    times_ax.grid(True, which="both", alpha=0.3)
    key = [Line2D([], [], color="k", label=time_label("perf/step_time")),
           Line2D([], [], color="k", linestyle="--", label=time_label("perf/update_weights_time"))]  # fmt: skip
    key += [Patch(color="0.5", alpha=0.15, label=warmup_label)] if warmup_label else []
    times_ax.legend(handles=key, fontsize="small", loc="upper left", bbox_to_anchor=LEGEND_AT)
    share_ax.set_ylim(bottom=0)
    share_ax.set_ylabel("update / step (%)")
    share_ax.set_xlabel("step")
    share_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    share_ax.grid(True, alpha=0.3)
    share_ax.legend(title="run", fontsize="small", loc="upper left", bbox_to_anchor=LEGEND_AT)
    save(fig, path)
    if len(runs) > len(drawn):
        left_out = ", ".join(r["job"] for r in runs[len(drawn) :])
        return f"{path.name} shows the first {len(drawn)} of {len(runs)} runs with per-step times; left out: {left_out}"
    return None


PLOTS: dict[str, Callable[[list[Row], list[FitGroup], Path], Optional[str]]] = {
    "update_time_vs_bucket.png": plot_update_time_vs_bucket,
    "update_time_vs_bytes.png": plot_update_time_vs_bytes,
    "step_breakdown.png": plot_step_breakdown,
    "engine_idle.png": plot_engine_idle,
    "client_stall.png": plot_client_stalls,
    "update_phases.png": plot_update_phases,
    "peak_memory_vs_bucket.png": plot_peak_memory_vs_bucket,
    "step_timeline.png": plot_step_timeline,
}


def write_plots(rows: list[Row], fits: list[FitGroup], out_dir: Path) -> tuple[list[Path], list[str]]:
    """Draw every plot it can; returns (files written, the notes of the plots: skipped, failed, or what
    one left out). A plot counts as written when its file exists after it ran."""
    if importlib.util.find_spec("matplotlib") is None:  # an optional dependency (pip install rlsync[report])
        return [], ["plots skipped: matplotlib is not installed (pip install 'rlsync[report]')"]
    written, notes = [], []
    check_targets(out_dir / name for name in PLOTS)  # a link or a FIFO at a plot's name: refused, nothing written
    for name, plot in PLOTS.items():
        path = out_dir / name
        path.unlink(missing_ok=True)  # no stale plot from an earlier report
        try:
            note = plot(rows, fits, path)
        except RefusedTarget:  # planted while the report ran: the report's one line, not a plot's note
            raise
        except Exception as exc:  # noqa: BLE001 - a plotting bug must not cost the table
            path.unlink(missing_ok=True)
            note = f"{name} failed: {type(exc).__name__}: {exc}"
        stop_point()  # a stop signal a library swallowed (matplotlib's weakref callbacks) ends the report here
        if path.exists():
            written.append(path)
        if note:
            notes.append(note)
    return written, notes
