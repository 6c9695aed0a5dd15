"""`python -m rlsync.bench`: the weight update alone, written like a run (files, W&B), sweepable (a real
`python -m rlsync.bench` sweep, marked slow; its one-process runs are in test_offload.py and test_schemes.py)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from conftest import read_jsonl, run_cli

from rlsync.bench.runner import bucket_medians, update_table
from rlsync.config.apps import BenchAppConfig


def wandb_summary(run_dir) -> dict:
    """What really reached the offline W&B run, read back with W&B's own CLI."""
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    out = subprocess.run(
        ["wandb", "leet", "inspect", "--summary", "--json", str(offline)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    return data.get("summary", data)


@pytest.mark.slow  # the bench's real CLI: a sweep, an engine process, W&B read back by its own CLI
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


def test_an_unknown_target_is_a_config_error_before_anything_is_built():
    from rlsync.config.validate import validate
    from rlsync.errors import ConfigError

    cfg = BenchAppConfig()
    cfg.bench.target = "offlaod"
    with pytest.raises(ConfigError, match="bench.target.*update, offload"):
        validate(cfg)  # checked once, with every other key, before any model is built


def test_the_offload_target_refuses_nothing_to_move_and_unknown_states():
    from rlsync.config.validate import validate
    from rlsync.errors import ConfigError

    cfg = BenchAppConfig()
    cfg.bench.target, cfg.trainer.offload = "offload", "none"
    with pytest.raises(
        ConfigError,
        match=r"^trainer.offload=none: not allowed \(allowed: full, drop_grads \(the "
        r"offload benchmark needs something to move\)\)$",
    ):
        validate(cfg)
    cfg.trainer.offload, cfg.bench.offload_state = "full", "optimizer"
    with pytest.raises(ConfigError, match=r"^bench.offload_state=optimizer: not allowed \(allowed: trainer, params\)$"):
        validate(cfg)


def test_bucket_medians_and_the_update_table():
    breakdowns = [
        [{"bytes": 100, "pack_time": t, "load_time": 2 * t}, {"bytes": 50, "pack_time": t}] for t in (1, 3, 2)
    ]
    medians = bucket_medians(breakdowns)
    assert medians == [
        {"bucket": 0, "bytes": 100, "pack_time": 2, "load_time": 4},
        {"bucket": 1, "bytes": 50, "pack_time": 2},
    ]
    stat = lambda v: {"median": v, "min": v, "max": v}  # noqa: E731
    result = {
        "measured_steps": 3,
        "warmup_steps": 1,
        "model": {"name": "qwen3_0p6b"},
        "buckets": medians,
        "setup": {
            "transport": "ipc",
            "flat_engine_weights": False,
            "strategy": "bucketed",
            "bucket_mb": 512.0,
            "buckets": 2,
            "source": "device",
        },
        "metrics": {
            "perf/update_weights_time": stat(0.2),
            "perf/update_weights_limit_time": stat(0.1),
            "perf/update_weights_efficiency": stat(0.5),
            "perf/update_weights_gbps": stat(6.0),
            "perf/update_weights_peak_bytes": stat(512 * 2**20),
            "perf/update_weights_pack_time": stat(0.12),
        },
    }
    text = update_table(result)
    assert "| qwen3_0p6b | ipc | bucketed | 512 MiB x2 | device | 0.20 s | 0.10 s | 2.00x | 0.50 |" in text
    assert "512 MiB |" in text and "Per bucket" in text


def test_bench_target_offers_the_targets_the_bench_opens():
    from rlsync.bench.runner import TARGETS
    from rlsync.config.validate import leaves

    rule = next(rule for key, _, _, rule in leaves(BenchAppConfig()) if key == "bench.target")
    assert rule.allowed == ", ".join(TARGETS)
