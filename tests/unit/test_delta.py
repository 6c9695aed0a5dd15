"""update.payload=delta: only the changed elements cross, and the engine ends bit for bit where a full update puts it."""

import json

import pytest
import torch
from conftest import BF16, CPU, FAST, ROOT, check_delta_updates, nudge, read_jsonl, run_main

from rlsync.config.schema import UpdateConfig
from rlsync.update import close_update, timed_update
from rlsync.update.payload.base import FULL, SPARSE


def test_a_delta_leaves_the_engine_where_a_full_update_does(tiny):
    check_delta_updates(tiny, "direct")  # the engine processes: tests/process/test_delta.py


def test_a_bucket_that_changed_too_much_goes_whole(tiny):
    """Over a third of a bf16 bucket changed: sparse would carry more than the bucket, so it goes whole."""
    weights = tiny.weights(seed=1)
    update = UpdateConfig(payload="delta", bucket_mb=0.05)
    engine, transport, buckets = tiny.open(update, weights)
    try:
        timed_update(transport, weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
        flipped = nudge(weights, 0.5)
        metrics = timed_update(transport, weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
        assert metrics["perf/update_weights_bytes"] == sum(b.nbytes for b in buckets)  # every bucket whole
        assert metrics["perf/update_weights_changed_ratio"] == pytest.approx(flipped / sum(b.numel for b in buckets))
        for name, t in weights.items():
            assert torch.equal(engine.weights[name], t.to(BF16)), name
    finally:
        close_update(engine, transport)


def test_the_encoding_is_positions_then_values():
    """One bucket, by hand: the int32 positions of the changed elements, then their bf16 values."""
    from rlsync.measure.timing import HostTimer
    from rlsync.update.buckets import TensorMeta, plan_buckets
    from rlsync.update.payload.delta import DeltaEncoder

    weights = {"a": torch.zeros(6), "b": torch.ones(4)}
    (bucket,) = plan_buckets([TensorMeta(n, tuple(t.shape), BF16) for n, t in weights.items()], 1 << 20)
    encoder, buffer, timer = DeltaEncoder([bucket]), torch.empty(10, dtype=BF16), HostTimer()
    assert encoder.encode(0, bucket, weights, buffer, timer, {}).mode == FULL
    assert encoder.held_bytes == 20
    weights["b"][2] = 3.0
    encoded = encoder.encode(0, bucket, weights, buffer, timer, {})
    assert (encoded.mode, encoded.count, encoded.nbytes) == (SPARSE, 1, 6)
    raw = buffer.view(torch.uint8)
    assert raw[:4].view(torch.int32).tolist() == [8]  # b starts at element 6
    assert raw[4:6].view(BF16).tolist() == [3.0]
    assert encoder.encode(0, bucket, weights, buffer, timer, {}).nbytes == 0  # nothing changed since


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["update.strategy=per_tensor"], "update.strategy"),
        (["update.flat_engine_weights=true"], "update.flat_engine_weights"),
        (["rollout.release_level=2"], "rollout.release_level"),
        (["update.transport=broadcast", "update.engine_address=127.0.0.1:1"], "update.engine_address"),
    ],
)
def test_what_a_delta_cannot_go_with_is_refused_in_one_line(tmp_path, overrides, key):
    proc = run_main("update.payload=delta", *overrides, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"rlsync: config error: {key}=") and "update.payload=delta" in line, line


def test_at_learning_rate_zero_a_delta_sends_nothing(tmp_path):
    """trainer.lr=0: the weights never change, so after the engine's first (full) update nothing crosses."""
    proc = run_main(*FAST, "update.payload=delta", "update.verify=true", "trainer.lr=0", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 3
    for row in rows:
        assert row["perf/update_weights_changed_ratio"] == 0.0
        assert row["perf/update_weights_bytes"] == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["verification"].startswith("passed") or summary["verification"] == "passed", summary["verification"]


def test_the_memory_check_counts_the_last_values_a_delta_keeps(compose):
    from rlsync.check import estimate

    # flat engine weights off in both: a delta turns their auto off, and sends through a staging buffer
    plain = compose("model=qwen3_0p6b", "update.flat_engine_weights=false")
    full = estimate.rank_estimate(plain, cuda=False, runtime_bytes=0, ranks=estimate.Ranks(), rank=0)
    delta = estimate.rank_estimate(
        compose("model=qwen3_0p6b", "update.payload=delta"), cuda=False, runtime_bytes=0, ranks=estimate.Ranks(), rank=0
    )
    engine_bytes = full.process["engine_weights"]
    assert delta.process["payload"] > engine_bytes  # the last values (the engine's weights once more) and the encode
    assert delta.host_bytes - full.host_bytes == delta.process["payload"]


def test_the_report_sets_the_kinds_side_by_side(tmp_path):
    """The study's recorded runs (experiments/payloads): each row names its payload, a delta that sent
    nothing counts 0 bytes, the model stays one model, and each payload gets its own line of time against bytes."""
    from rlsync.report import write_report

    runs = ROOT / "experiments/payloads/results_cpu/runs"
    result = write_report([runs / "delta"], tmp_path, log_wandb=False)  # the full updates of its sweep beside
    payloads = {(r["transport"], r["payload"]) for r in result.rows}
    assert ("direct", "delta") in payloads and ("direct", "full") in payloads
    assert "| direct, delta |" in result.table_markdown
    nothing = [r for r in result.rows if r["payload"] == "delta" and r["update_changed_ratio_median"] == 0]
    assert nothing and all(r["update_bytes"] == 0 for r in nothing)
    assert {r["update_full_bytes"] for r in result.rows if r["payload"] == "delta"} == {1192099840}
    assert {f.label for f in result.fits} >= {"transport direct, payload delta", "transport direct, payload full"}
