"""What the report's plots draw (rlsync/report/plots.py), read off the figures (conftest's `drawn`):
human labels and units, a log bucket axis, the copy floor beside the update, one series per model x
transport x strategy, an update-phases plot (not a step breakdown) for a bench sweep, no memory plot
when nothing was staged, and labels that never overlap. Rows come from in-memory runs through the
report's own `table_row`, so the plots see what a report sees; nothing is run."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from rlsync.report.fits import fit_by_setup
from rlsync.report.plots import write_plots
from rlsync.report.rows import table_row
from rlsync.report.runs import Run

MIB = 2**20
PHASES = ("rollout", "wake_up", "log_probs", "train", "update_weights", "sleep")


def stats(**medians: float) -> dict:
    """summary.json's metrics: each median with a min and max 5 % either side."""
    return {k: {"median": v, "min": v * 0.95, "max": v * 1.05} for k, v in medians.items()}


def bench_row(job, model="tiny", transport="direct", strategy="bucketed", bucket_mb=4.0, *, seconds, flat=False,
              floor=None, peak=0, split=None) -> dict:  # fmt: skip
    """One `rlsync.bench` update job as the report's table row: its time, copy floor, peak, phases."""
    metrics = {"perf/update_weights_time": seconds, "perf/update_weights_bytes": 5 * MIB}
    metrics |= {"perf/update_weights_limit_time": floor} if floor else {}
    metrics |= {"perf/update_weights_peak_bytes": peak, "perf/update_weights_staging_bytes": peak}
    metrics |= {f"perf/update_weights_{part}_time": s for part, s in (split or {}).items()}
    summary = {
        "kind": "bench",
        "target": "update",
        "status": "finished",
        "model": {"name": model, "params": 2_500_000, "update_bytes": 5 * MIB, "tensors": 46},
        "setup": {"transport": transport, "strategy": strategy, "bucket_mb": bucket_mb, "flat_engine_weights": flat,
                  "engine": "hf", "device": "cpu"},
        "metrics": stats(**metrics),
    }  # fmt: skip
    run = Run(Path(f"/sweep/{job}"), str(job), [], "finished", None, summary, {}, summary["metrics"], 5)
    return table_row(run)


def step_row(job, transport="direct", bucket_mb=4.0, *, update=0.002) -> dict:
    """One run of the step loop (python -m rlsync): its phases' medians and the step's."""
    phases = dict(zip(PHASES, (0.5, 0.01, 0.2, 0.6, update, 0.01)))
    metrics = {f"perf/{p}_time": s for p, s in phases.items()} | {"perf/step_time": sum(phases.values()) + 0.05}
    metrics |= {"perf/update_weights_limit_time": update / 2, "perf/update_weights_pack_time": update * 0.8}
    summary = {
        "kind": "run",
        "status": "finished",
        "model": {"name": "tiny", "params": 2_500_000, "update_bytes": 5 * MIB, "tensors": 46},
        "setup": {"transport": transport, "strategy": "bucketed", "bucket_mb": bucket_mb, "engine": "hf"},
        "metrics": stats(**metrics),
        "share": {"update_weights": update / metrics["perf/step_time"]},
    }
    run = Run(Path(f"/sweep/{job}"), str(job), [], "finished", None, summary, {}, summary["metrics"], 4)
    return table_row(run)


def bench_sweep(flat: bool = True) -> list[dict]:
    """`python -m rlsync.bench -m update.bucket_mb=1,4,16 update.transport=direct,ipc` (and per_tensor)."""
    rows, job = [], itertools.count()
    for transport, base in (("direct", 0.001), ("ipc", 0.02)):
        for bucket in (1.0, 4.0, 16.0):
            split = {"pack": base * 0.6} | ({"transfer": base * 0.1, "load": base * 0.2} if transport == "ipc" else {})
            rows.append(
                bench_row(next(job), transport=transport, bucket_mb=bucket, seconds=base * (1 + 1 / bucket),
                          flat=flat, floor=base / 3, peak=0 if flat else int(bucket * MIB), split=split)
            )  # fmt: skip
    per_tensor = {"pack": 0.01, "transfer": 0.03, "load": 0.005}
    rows.append(
        bench_row(next(job), transport="ipc", strategy="per_tensor", seconds=0.05, floor=0.01, split=per_tensor)
    )
    return rows


def draw(rows: list[dict], tmp_path: Path) -> list[str]:
    _, notes = write_plots(rows, fit_by_setup(rows), tmp_path)
    return notes


def texts(fig) -> list:
    """Every visible, non-empty text of a figure, laid out (titles, axis and tick labels, legends, notes)."""
    from matplotlib.text import Text

    rendered(fig)
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def rendered(fig):
    """The figure laid out again on an Agg canvas (the report closed it after saving); its renderer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def overlapping(fig) -> list[tuple[str, str]]:
    """Pairs of texts whose boxes overlap on the rendered figure (a legend's own texts stack apart)."""
    renderer = rendered(fig)
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts(fig)]
    return [
        (a, b)
        for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2)
        if box_a.overlaps(box_b) and min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0) > 1
        and min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0) > 1
    ]  # fmt: skip


def test_a_bench_sweep_draws_human_labels_a_log_bucket_axis_and_the_floor(tmp_path: Path, drawn: dict) -> None:
    notes = draw(bench_sweep(flat=False), tmp_path)
    ax = drawn["update_time_vs_bucket.png"].axes[0]
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "bucket size (MiB, log scale)"
    assert ax.get_ylabel().startswith("weight update time, median (ms")  # the catalogue's label, in ms
    series = [t.get_text() for t in ax.get_legend().get_texts()]
    assert series == ["tiny, direct, bucketed", "tiny, ipc, bucketed", "tiny, ipc, per_tensor"]
    floors = sorted(line.get_gid() for line in ax.get_lines() if (line.get_gid() or "").startswith("copy floor"))
    assert floors == [f"copy floor: {s}" for s in series]  # each setup's floor, the per_tensor one a level
    direct_floor = next(ln for ln in ax.get_lines() if ln.get_gid() == "copy floor: tiny, direct, bucketed")
    assert list(direct_floor.get_ydata()) == pytest.approx([0.001 / 3 * 1e3] * 3)  # ms, beside the times
    assert ax.get_yscale() == "log"  # ipc per_tensor 50 ms beside direct's 0.33 ms floor: 0 would swallow them
    for name, fig in drawn.items():  # no metric id anywhere: the catalogue's words; no text over another
        assert not [t.get_text() for t in texts(fig) if "perf/" in t.get_text() or "_time" in t.get_text()], name
        assert overlapping(fig) == [], name
    assert "peak_memory_vs_bucket.png" in drawn  # the staging buffers grew with the bucket: drawn
    assert not [n for n in notes if "failed" in n], notes


def test_a_bench_sweep_gets_update_phases_not_a_step_breakdown(tmp_path: Path, drawn: dict) -> None:
    rows = bench_sweep()
    notes = draw(rows, tmp_path)
    assert "step_breakdown.png" not in drawn and not (tmp_path / "step_breakdown.png").exists()
    assert any(n.startswith("step_breakdown.png skipped: the runs are benchmarks") for n in notes), notes
    fig = drawn["update_phases.png"]
    ax = fig.axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:3] == ["pack", "transfer", "load"] and legend[-1] == "copy floor"
    bars = [t.get_text() for t in ax.get_yticklabels()]
    assert len(bars) == len(rows) and all((" direct" in b) != (" ipc" in b) for b in bars)  # the transport named
    assert bars[0] == "0: tiny, direct flat, bucketed, 1 MiB" and bars[-1] == "6: tiny, ipc, per_tensor"
    assert overlapping(fig) == []


def test_no_memory_plot_when_nothing_was_staged(tmp_path: Path, drawn: dict) -> None:
    """Flat engine weights (the default with the HF engine): the update stages 0 bytes at every size."""
    notes = draw(bench_sweep(flat=True), tmp_path)
    assert "peak_memory_vs_bucket.png" not in drawn and not (tmp_path / "peak_memory_vs_bucket.png").exists()
    assert any(n.startswith("peak_memory_vs_bucket.png skipped: every run's update held 0 bytes") for n in notes)


def test_one_series_per_model_transport_and_strategy(tmp_path: Path, drawn: dict) -> None:
    """Flat and staged updates of one transport are two setups: two lines, not one zig-zag."""
    rows = [
        bench_row(i, bucket_mb=b, seconds=0.001 * (i + 1), flat=flat, floor=0.0004, peak=0 if flat else int(b * MIB))
        for i, (flat, b) in enumerate(itertools.product((True, False), (1.0, 4.0)))
    ]
    draw(rows, tmp_path)
    for name in ("update_time_vs_bucket.png", "peak_memory_vs_bucket.png"):
        legend = [t.get_text() for t in drawn[name].axes[0].get_legend().get_texts()]
        assert sorted(legend) == ["tiny, direct flat, bucketed", "tiny, direct, bucketed"], name


def test_step_breakdown_of_runs_names_each_setup_and_nothing_overlaps(tmp_path: Path, drawn: dict) -> None:
    rows = [step_row(i, transport, bucket) for i, (transport, bucket) in
            enumerate(itertools.product(("direct", "ipc", "broadcast"), (1.0, 4.0, 16.0)))]  # fmt: skip
    draw(rows, tmp_path)
    fig = drawn["step_breakdown.png"]
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()][:2] == ["0: tiny, direct, bucketed, 1 MiB",
                                                                "1: tiny, direct, bucketed, 4 MiB"]  # fmt: skip
    shares = [t.get_text() for t in ax.texts]
    assert len(shares) == len(rows) and all(s.strip().startswith("update 0.1") for s in shares)
    assert ax.get_xlabel() == "step time, median (s)"
    assert overlapping(fig) == []
