"""The schemes whose transport starts an engine process (ipc): each runs one benchmark repeat on the tiny model
(tests/unit/test_schemes.py: the others, and the presets' composition)."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, compose_app

from rlsync.bench.runner import run_bench

SCHEMES = sorted(p.stem for p in (ROOT / "rlsync" / "conf" / "scheme").glob("*.yaml"))
PROCESS = [
    s for s in SCHEMES if "  transport: direct" not in (ROOT / "rlsync" / "conf" / "scheme" / f"{s}.yaml").read_text()
]


@pytest.mark.parametrize("scheme", PROCESS)
def test_each_scheme_runs_a_benchmark_repeat_on_the_tiny_model(scheme, tmp_path):
    cfg = compose_app(
        "bench",
        f"scheme={scheme}",
        "bench.warmup=0",
        "bench.repeats=1",
        "wandb.mode=disabled",
        "update.bucket_mb=1",
        "update.verify=true",
    )  # small buckets: several of them; verify: the weights landed
    result = run_bench(cfg, tmp_path, name=scheme, group="test")
    assert result["status"] == "finished", result
    summary = json.loads((tmp_path / "summary.json").read_text())
    setup = summary["setup"]
    assert setup["scheme"] == scheme and summary["config"]["update"]["scheme"] == scheme
    assert summary["metrics"]["perf/update_weights_time"]["median"] > 0
    assert isinstance(setup["flat_engine_weights"], bool) and setup["flat_engine_weights_why"]
    assert isinstance(setup["copy_threads"], int) and setup["copy_threads_why"]
    if scheme == "rlsync":  # the HF engine holds bucket-shaped views: one copy, nothing but the pack
        assert setup["flat_engine_weights"] is True and setup["flat_engine_weights_why"].startswith("auto: on")
        assert "perf/update_weights_load_time" not in summary["metrics"]
