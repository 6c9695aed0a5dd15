"""`python -m rlsync.bench` as a real process: a sweep over transports writes a run's files for each job
(tests/unit/test_bench.py: the benchmark in this process)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from conftest import read_jsonl, run_cli


def wandb_summary(run_dir) -> dict:
    """What really reached the offline W&B run, read back with W&B's own CLI."""
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    out = subprocess.run(
        ["wandb", "leet", "inspect", "--summary", "--json", str(offline)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    return data.get("summary", data)


def test_bench_sweep_writes_runs_files_for_each_transport(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(
        "-m",
        "update.transport=direct,ipc",
        "update.bucket_mb=0.05",
        "bench.warmup=1",
        "bench.repeats=3",
        "wandb.mode=offline",
        f"hydra.sweep.dir={sweep}",
        module="rlsync.bench",
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("time / floor") == 2  # one closing table per job
    for job, transport in (("0", "direct"), ("1", "ipc")):
        run_dir = sweep / job
        rows = read_jsonl(run_dir / "metrics.jsonl")
        assert [r["step"] for r in rows] == [0, 1, 2, 3]  # warm-up row first, marked by summary.warmup_steps
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["kind"] == "bench" and summary["status"] == "finished"
        assert summary["warmup_steps"] == 1 and summary["measured_steps"] == 3
        assert summary["setup"]["transport"] == transport and summary["model"]["name"] == "tiny"
        # copies on torch's thread pool (over 32768 elements), by hand: 4 layers x (q, o, gate, up, down)
        # + the tied embedding (k and v, 128 x 256, are exactly 32768: one thread)
        assert summary["model"]["pooled_tensors"] == 21 and summary["model"]["tensors"] == 46
        # its one 5 MiB bucket fits in half of any CPU's last-level cache; without an LLC figure none counts
        llc = summary["setup"]["llc_bytes"]
        assert summary["setup"]["cache_resident_elements"] == (summary["model"]["params"] if llc else 0)
        # direct: the default flat engine weights (update.flat_engine_weights=null, on for the HF engine)
        # make packing the whole update; ipc: shared flat weights too, the engine only acknowledges
        assert summary["setup"]["flat_engine_weights"] is True
        for key in (
            "perf/update_weights_time",
            "perf/update_weights_limit_time",
            "perf/update_weights_efficiency",
            "perf/update_weights_peak_bytes",
            "perf/update_weights_pack_time",
        ):
            stat = summary["metrics"][key]
            assert stat["min"] <= stat["median"] <= stat["max"], key
        assert summary["limits"]["device_copy_gbps"] > 0 and summary["machine"]["torch"] == torch.__version__
        assert summary["config"]["bench"]["repeats"] == 3
        assert len(summary["buckets"]) == summary["setup"]["buckets"] > 1  # the per-bucket breakdown
        assert sum(b["bytes"] for b in summary["buckets"]) == summary["model"]["update_bytes"]
        if transport == "ipc":
            assert summary["metrics"]["perf/update_weights_transfer_time"]["median"] > 0
        reached = wandb_summary(run_dir)
        assert reached["perf/update_weights_time"] == pytest.approx(
            summary["metrics"]["perf/update_weights_time"]["median"]
        )
