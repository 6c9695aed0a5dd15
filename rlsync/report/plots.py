"""The report's PNG plots (matplotlib, Agg backend: no display needed).

Each plot reads the table rows of `rlsync.report.table_row` (raw seconds and bytes) and either draws
its file or returns why it could not (too few points), so that one missing series never costs the
other plots; a plot that draws may still return a note on what it left out. `write_plots` runs them all.
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
from rlsync.report.table import PER_TENSOR, Fit, FitGroup, common_overrides, model_label, setup_label

Row = dict[str, Any]
TIMELINE_MAX_RUNS = 8  # more lines than this no longer read apart in one panel
TIMELINE_LABEL_WIDTH = 38  # characters per legend line


def number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def time_unit(seconds: list[float]) -> tuple[float, str]:
    """Scale and unit so that the largest time reads as a plain number."""
    scale, unit, _ = fmt.time_unit(max(seconds, default=1.0))
    return scale, unit


def by_setup(rows: list[Row], x_key: str, y_key: str) -> dict[str, list[Row]]:
    """Rows with both values, one series per model and transport/strategy (engine), sorted along x:
    a line joins only runs that differ in x. Labelled "tiny, direct, bucketed", "tiny, ipc, per_tensor"
    (a model name that comes with several update sizes is split by size, so each line is one model)."""
    rows = [r for r in rows if number(r.get(x_key)) is not None and number(r.get(y_key)) is not None]
    series: dict[str, list[Row]] = {}
    for row in rows:
        series.setdefault(f"{model_label(row, rows)}, {setup_label(row, bucket=False)}", []).append(row)
    return {m: sorted(rs, key=lambda r: r[x_key]) for m, rs in sorted(series.items())}


def per_tensor_levels(ax, rows: list[Row], y_key: str, scale: float, colors_used: int) -> int:
    """per_tensor runs on a bucket-size axis: a bucket size does not apply to them, so each setup is a
    dotted level across the axis, labelled "<model>, <transport>, per_tensor". Returns how many it drew."""
    levels = by_setup([r for r in rows if r.get("strategy") == PER_TENSOR], y_key, y_key)
    for index, (label, rs) in enumerate(levels.items()):
        for row in rs:  # one per run; several runs of one setup share the colour and the label
            ax.axhline(
                row[y_key] * scale,
                color=f"C{colors_used + index}",
                linestyle=":",
                label=label if row is rs[0] else None,
            )
    return len(levels)


def pyplot():
    """matplotlib.pyplot on the Agg backend: the report is written where no display is."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def new_axes(title: str):
    fig, ax = pyplot().subplots(figsize=(7, 4.5), dpi=100)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return fig, ax


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def bucket_axis(ax, buckets: list[float]) -> None:
    """Log2 when the sizes spread (128, 512, 2048), ticks at the sizes swept, plain numbers."""
    from matplotlib.ticker import FuncFormatter, NullLocator

    if min(buckets) > 0 and max(buckets) / min(buckets) >= 4:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(buckets)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel("bucket size (MiB)")


def min_max_bars(rows: list[Row], scale: float) -> list[list[float]]:
    """Error bar lengths below and above each median: down to the min, up to the max."""
    below, above = [], []
    for r in rows:
        median = r["update_time_median"]
        below.append((median - (number(r.get("update_time_min")) or median)) * scale)
        above.append(((number(r.get("update_time_max")) or median) - median) * scale)
    return [below, above]


def plot_update_time_vs_bucket(rows: list[Row], fits: list[FitGroup], path: Path) -> Optional[str]:
    series = by_setup(rows, "bucket_mb", "update_time_median")
    buckets = {r["bucket_mb"] for rs in series.values() for r in rs}
    if len(buckets) < 2:
        return f"{path.name} skipped: needs runs with at least two bucket sizes (found {len(buckets)})"
    timed = [r for r in rows if number(r.get("update_time_median")) is not None]
    scale, unit = time_unit([number(r.get("update_time_max")) or r["update_time_median"] for r in timed])
    fig, ax = new_axes("Weight update time vs bucket size (median, bars: min to max)")
    for index, (label, rs) in enumerate(series.items()):
        xs = [r["bucket_mb"] for r in rs]
        ys = [r["update_time_median"] * scale for r in rs]
        ax.errorbar(xs, ys, yerr=min_max_bars(rs, scale), marker="o", capsize=3, color=f"C{index}", label=label)
    per_tensor_levels(ax, timed, "update_time_median", scale, len(series))
    bucket_axis(ax, sorted(buckets))
    ax.set_ylim(bottom=0)
    ax.set_ylabel(f"perf/update_weights_time ({unit})")
    ax.legend(title="model, transport, strategy", fontsize="small")
    save(fig, path)
    return None


def plot_update_time_vs_bytes(rows: list[Row], fits: list[FitGroup], path: Path) -> Optional[str]:
    if not any(group.fit for group in fits):
        return f"{path.name} skipped: no setup has a meaningful fit of update time against bytes (see the fit lines)"
    points = [r for group in fits for r in group.rows]
    scale, unit = time_unit([r["update_time_median"] for r in points])
    fig, ax = new_axes("Weight update time vs bytes sent")
    xs = [0.0, max(r["update_bytes"] for r in points) * 1.05]
    if len(fits) == 1:
        draw_single_fit(ax, fits[0], xs, scale, unit)
    else:
        draw_fit_per_group(ax, fits, xs, scale, unit)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=min(0.0, *(group.fit.fixed_s * scale * 1.1 for group in fits if group.fit)))
    ax.set_xlabel("update bytes (MiB)")
    ax.set_ylabel(f"perf/update_weights_time, median ({unit})")
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
    ax.legend(loc="lower right")


def draw_fit_per_group(ax, fits: list[FitGroup], xs: list[float], scale: float, unit: str) -> None:
    """One colour per transport: its points and its own line, whose numbers the legend gives."""
    for index, group in enumerate(fits):
        color, fit = f"C{index}", group.fit
        if fit is None:
            label = f"{group.label}: no fit (one update size)"
        else:
            slope = f"bytes / {fit.bandwidth_gbps:.3g} GB/s" if fit.bandwidth_gbps else "bandwidth not resolved"
            label = f"{group.label}: {fit.fixed_s * scale:.3g} {unit} + {slope}"
            fit_line(ax, fit, xs, scale, color=color, linestyle="--", label=label)
        xs_mib = [r["update_bytes"] / MIB for r in group.rows]
        ys = [r["update_time_median"] * scale for r in group.rows]
        ax.scatter(xs_mib, ys, color=color, zorder=3, label=label if fit is None else None)
    ax.legend(loc="upper left", fontsize="small", title="fit per setup")


def step_parts(row: Row) -> dict[str, float]:
    """Median seconds per part of the step (the catalogue's), plus "other" for what the step spends outside them."""
    parts = {p.name: number(row.get(f"{p.name}_time_median")) for p in metrics.step_phases()}
    parts = {p: v for p, v in parts.items() if v is not None}
    step = number(row.get("step_time_median"))
    if step is not None and step > sum(parts.values()):
        parts["other"] = step - sum(parts.values())
    return parts


def bucket_label(row: Row) -> str:
    """ "512 MiB"; "per_tensor" for a run without buckets; "" when the bucket size is not known."""
    if row.get("strategy") == PER_TENSOR:
        return PER_TENSOR
    bucket = number(row.get("bucket_mb"))
    return f"{bucket:g} MiB" if bucket is not None else ""


def plot_step_breakdown(rows: list[Row], fits: list[FitGroup], path: Path) -> Optional[str]:
    bars = [(row, step_parts(row)) for row in rows]
    bars = [(row, parts) for row, parts in bars if parts]
    if not bars:
        return f"{path.name} skipped: no run logged phase times"
    scale, unit = time_unit([sum(parts.values()) for _, parts in bars])
    fig, ax = new_axes("Median step by phase")
    labels = [f"{row['job']}\n{row.get('model') or ''}\n{bucket_label(row)}" for row, _ in bars]
    bottoms = [0.0] * len(bars)
    for phase in (*metrics.step_phases(), metrics.OTHER):  # stacked in the order the step runs them
        heights = [parts.get(phase.name, 0.0) * scale for _, parts in bars]
        if any(heights):
            ax.bar(labels, heights, bottom=bottoms, color=phase.color or None, label=phase.label)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    for x, ((_row, parts), top) in enumerate(zip(bars, bottoms)):
        if "update_weights" in parts and sum(parts.values()) > 0:
            share = parts["update_weights"] / sum(parts.values())
            ax.annotate(f"update {fmt.fmt_share(share)}", (x, top), ha="center", va="bottom", fontsize="small")
    ax.margins(y=0.08)
    ax.set_ylabel(f"seconds per step ({unit})")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", labelsize="small")
    save(fig, path)
    return None


def plot_peak_memory_vs_bucket(rows: list[Row], fits: list[FitGroup], path: Path) -> Optional[str]:
    series = by_setup(rows, "bucket_mb", "update_peak_bytes_max")
    buckets = {r["bucket_mb"] for rs in series.values() for r in rs}
    if len(buckets) < 2:
        return f"{path.name} skipped: needs runs with perf/update_weights_peak_bytes at two or more bucket sizes"
    fig, ax = new_axes("Peak update memory vs bucket size")
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
        [r for r in rows if number(r.get("update_peak_bytes_max")) is not None],
        "update_peak_bytes_max",
        1 / MIB,
        len(series),
    )
    bucket_axis(ax, sorted(buckets))
    ax.set_ylim(bottom=0)
    ax.set_ylabel("perf/update_weights_peak_bytes, max (MiB)")
    ax.legend(title="model, transport, strategy", fontsize="small")
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
    warmups = sorted({int(r["warmup_steps"]) for r in rows if number(r.get("warmup_steps"))})
    warmups = [w for w in warmups if w > 0]
    for warmup in warmups:  # runs with different warm-ups: overlapping bands, darker where all agree
        for ax in axes:
            ax.axvspan(-0.5, warmup - 0.5, color="0.5", alpha=0.15, linewidth=0)
    if not warmups:
        return None
    return f"warm-up ({' / '.join(map(str, warmups))} steps, not in the medians)"


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
    scale, unit = time_unit([p["step_time"] for p in points])
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
    key = [Line2D([], [], color="k", label="perf/step_time"),
           Line2D([], [], color="k", linestyle="--", label="perf/update_weights_time")]  # fmt: skip
    key += [Patch(color="0.5", alpha=0.15, label=warmup_label)] if warmup_label else []
    times_ax.legend(handles=key, fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    share_ax.set_ylim(bottom=0)
    share_ax.set_ylabel("update / step (%)")
    share_ax.set_xlabel("step")
    share_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    share_ax.grid(True, alpha=0.3)
    share_ax.legend(title="run", fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save(fig, path)
    if len(runs) > len(drawn):
        left_out = ", ".join(r["job"] for r in runs[len(drawn) :])
        return f"{path.name} shows the first {len(drawn)} of {len(runs)} runs with per-step times; left out: {left_out}"
    return None


PLOTS: dict[str, Callable[[list[Row], list[FitGroup], Path], Optional[str]]] = {
    "update_time_vs_bucket.png": plot_update_time_vs_bucket,
    "update_time_vs_bytes.png": plot_update_time_vs_bytes,
    "step_breakdown.png": plot_step_breakdown,
    "peak_memory_vs_bucket.png": plot_peak_memory_vs_bucket,
    "step_timeline.png": plot_step_timeline,
}


def write_plots(rows: list[Row], fits: list[FitGroup], out_dir: Path) -> tuple[list[Path], list[str]]:
    """Draw every plot it can; returns (files written, the notes of the plots: skipped, failed, or what
    one left out). A plot counts as written when its file exists after it ran."""
    if importlib.util.find_spec("matplotlib") is None:  # an optional dependency (pip install rlsync[report])
        return [], ["plots skipped: matplotlib is not installed (pip install 'rlsync[report]')"]
    written, notes = [], []
    for name, plot in PLOTS.items():
        path = out_dir / name
        path.unlink(missing_ok=True)  # no stale plot from an earlier report
        try:
            note = plot(rows, fits, path)
        except Exception as exc:  # a plotting bug must not cost the table
            path.unlink(missing_ok=True)
            note = f"{name} failed: {type(exc).__name__}: {exc}"
        if path.exists():
            written.append(path)
        if note:
            notes.append(note)
    return written, notes
