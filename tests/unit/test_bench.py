"""`python -m rlsync.bench`: the weight update alone, written like a run (files, W&B), sweepable (a real
`python -m rlsync.bench` sweep: tests/process/test_bench.py; its one-process runs are in test_offload.py and
test_schemes.py)."""

from __future__ import annotations

import pytest

from rlsync.bench.runner import bucket_medians, update_table
from rlsync.config.apps import BenchAppConfig


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
