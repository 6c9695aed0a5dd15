"""The report's PNG plots (matplotlib, Agg backend: no display needed).

Each plot reads the table rows of `rlsync.report.table_row` (raw seconds and bytes) and either draws
its file or returns why it could not (too few points), so that one missing series never costs the
other plots. `write_plots` runs them all.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from rlsync.report import Fit

MIB = 2**20
Row = dict[str, Any]

# Stacked in the order the step runs them (design.md, "The problem"); "other" is the rest of the step.
PHASE_COLORS = {
    "rollout": "#4c72b0",
    "engine_release": "#64b5cd",
    "wake_up": "#dd8452",
    "log_probs": "#55a868",
    "ref_log_probs": "#8c8c8c",
    "train": "#c44e52",
    "update_weights": "#8172b3",
    "sleep": "#937860",
    "engine_resume": "#da8bc3",
    "other": "#dddddd",
}


def number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def time_unit(seconds: list[float]) -> tuple[float, str]:
    """Scale and unit so that the largest time reads as a plain number."""
    top = max(seconds, default=1.0)
    return (1.0, "s") if top >= 0.1 else (1e3, "ms") if top >= 1e-4 else (1e6, "µs")


def by_model(rows: list[Row], x_key: str, y_key: str) -> dict[str, list[Row]]:
    """Rows with both values, one series per model, sorted along x.

    A model name that comes with several update sizes (say `model.num_hidden_layers` swept under
    one name) is split by size, so that each line is one model.
    """
    rows = [r for r in rows if number(r.get(x_key)) is not None and number(r.get(y_key)) is not None]
    sizes: dict[str, set] = {}
    for row in rows:
        sizes.setdefault(str(row.get("model") or "n/a"), set()).add(row.get("update_bytes"))
    series: dict[str, list[Row]] = {}
    for row in rows:
        model = str(row.get("model") or "n/a")
        size = number(row.get("update_bytes"))
        label = f"{model} ({size / MIB:.3g} MiB)" if len(sizes[model]) > 1 and size is not None else model
        series.setdefault(label, []).append(row)
    return {m: sorted(rs, key=lambda r: r[x_key]) for m, rs in sorted(series.items())}


def new_axes(title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
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


def plot_update_time_vs_bucket(rows: list[Row], fit: Optional[Fit], path: Path) -> Optional[str]:
    series = by_model(rows, "bucket_mb", "update_time_median")
    buckets = {r["bucket_mb"] for rs in series.values() for r in rs}
    if len(buckets) < 2:
        return f"{path.name} skipped: needs runs with at least two bucket sizes (found {len(buckets)})"
    scale, unit = time_unit([number(r.get("update_time_max")) or r["update_time_median"] for rs in series.values() for r in rs])
    fig, ax = new_axes("Weight update time vs bucket size (median, bars: min to max)")
    for model, rs in series.items():
        xs = [r["bucket_mb"] for r in rs]
        ys = [r["update_time_median"] * scale for r in rs]
        ax.errorbar(xs, ys, yerr=min_max_bars(rs, scale), marker="o", capsize=3, label=model)
    bucket_axis(ax, sorted(buckets))
    ax.set_ylim(bottom=0)
    ax.set_ylabel(f"perf/update_weights_time ({unit})")
    ax.legend(title="model")
    save(fig, path)
    return None


def plot_update_time_vs_bytes(rows: list[Row], fit: Optional[Fit], path: Path) -> Optional[str]:
    if fit is None:
        return f"{path.name} skipped: the fit needs runs with at least two distinct update sizes"
    series = by_model(rows, "update_bytes", "update_time_median")
    times = [r["update_time_median"] for rs in series.values() for r in rs]
    scale, unit = time_unit(times)
    fig, ax = new_axes("Weight update time vs bytes sent")
    for model, rs in series.items():
        ax.scatter([r["update_bytes"] / MIB for r in rs], [r["update_time_median"] * scale for r in rs], label=model, zorder=3)
    sizes = [r["update_bytes"] for rs in series.values() for r in rs]
    xs = [0.0, max(sizes) * 1.05]
    ax.plot([x / MIB for x in xs], [(fit.fixed_s + x * fit.seconds_per_byte) * scale for x in xs], "k--", label="fit")
    bandwidth = fit.bandwidth_gbps
    text = f"fixed cost {fit.fixed_s * scale:.3g} {unit}\n" + (
        f"bandwidth {bandwidth:.3g} GB/s" if bandwidth else "bandwidth not resolved"
    )
    ax.text(0.02, 0.97, text, transform=ax.transAxes, va="top", bbox={"facecolor": "white", "alpha": 0.8})
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=min(0.0, fit.fixed_s * scale * 1.1))
    ax.set_xlabel("update bytes (MiB)")
    ax.set_ylabel(f"perf/update_weights_time, median ({unit})")
    ax.legend(loc="lower right")
    save(fig, path)
    return None


def step_parts(row: Row) -> dict[str, float]:
    """Median seconds per phase, plus "other" for what the step spends outside them."""
    parts = {p: number(row.get(f"{p}_time_median")) for p in PHASE_COLORS if p != "other"}
    parts = {p: v for p, v in parts.items() if v is not None}
    step = number(row.get("step_time_median"))
    if step is not None and step > sum(parts.values()):
        parts["other"] = step - sum(parts.values())
    return parts


def bucket_label(row: Row) -> str:
    bucket = number(row.get("bucket_mb"))
    return f"{bucket:g} MiB" if bucket is not None else ""


def plot_step_breakdown(rows: list[Row], fit: Optional[Fit], path: Path) -> Optional[str]:
    bars = [(row, step_parts(row)) for row in rows]
    bars = [(row, parts) for row, parts in bars if parts]
    if not bars:
        return f"{path.name} skipped: no run logged phase times"
    scale, unit = time_unit([sum(parts.values()) for _, parts in bars])
    fig, ax = new_axes("Median step by phase")
    labels = [f"{row['job']}\n{row.get('model') or ''}\n{bucket_label(row)}" for row, _ in bars]
    bottoms = [0.0] * len(bars)
    for phase, color in PHASE_COLORS.items():
        heights = [parts.get(phase, 0.0) * scale for _, parts in bars]
        if any(heights):
            ax.bar(labels, heights, bottom=bottoms, color=color, label=phase)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    for x, ((row, parts), top) in enumerate(zip(bars, bottoms)):
        if "update_weights" in parts and sum(parts.values()) > 0:
            share = parts["update_weights"] / sum(parts.values())
            ax.annotate(f"update {share:.2%}", (x, top), ha="center", va="bottom", fontsize="small")
    ax.margins(y=0.08)
    ax.set_ylabel(f"seconds per step ({unit})")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", labelsize="small")
    save(fig, path)
    return None


def plot_peak_memory_vs_bucket(rows: list[Row], fit: Optional[Fit], path: Path) -> Optional[str]:
    series = by_model(rows, "bucket_mb", "update_peak_bytes_max")
    buckets = {r["bucket_mb"] for rs in series.values() for r in rs}
    if len(buckets) < 2:
        return f"{path.name} skipped: needs runs with perf/update_weights_peak_bytes at two or more bucket sizes"
    fig, ax = new_axes("Peak update memory vs bucket size")
    for model, rs in series.items():
        ax.plot([r["bucket_mb"] for r in rs], [r["update_peak_bytes_max"] / MIB for r in rs], marker="o", label=model)
    bucket_axis(ax, sorted(buckets))
    ax.set_ylim(bottom=0)
    ax.set_ylabel("perf/update_weights_peak_bytes, max (MiB)")
    ax.legend(title="model")
    save(fig, path)
    return None


PLOTS: dict[str, Callable[[list[Row], Optional["Fit"], Path], Optional[str]]] = {
    "update_time_vs_bucket.png": plot_update_time_vs_bucket,
    "update_time_vs_bytes.png": plot_update_time_vs_bytes,
    "step_breakdown.png": plot_step_breakdown,
    "peak_memory_vs_bucket.png": plot_peak_memory_vs_bucket,
}


def write_plots(rows: list[Row], fit: Optional[Fit], out_dir: Path) -> tuple[list[Path], list[str]]:
    """Draw every plot it can; returns (files written, one note per plot skipped or failed)."""
    if importlib.util.find_spec("matplotlib") is None:  # an optional dependency (pip install rlsync[report])
        return [], ["plots skipped: matplotlib is not installed (pip install 'rlsync[report]')"]
    written, notes = [], []
    for name, plot in PLOTS.items():
        path = out_dir / name
        try:
            skipped = plot(rows, fit, path)
        except Exception as exc:  # a plotting bug must not cost the table
            skipped = f"{name} failed: {type(exc).__name__}: {exc}"
        if skipped:
            notes.append(skipped)
            path.unlink(missing_ok=True)  # no stale plot from an earlier report
        else:
            written.append(path)
    return written, notes
