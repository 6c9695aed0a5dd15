"""The `ipc` and `broadcast` transports (engine in its own process) next to `direct`.

Bit-exact engine weights after updates for every transport x strategy x source, with buckets
smaller than the largest tensor; generation through the engine process equal to in-process
generation; the staging accounting; a dead engine raising a clear error within seconds; the whole
step through the CLI's entry point (in this process); a real `python -m rlsync` whose engine is killed is
tests/process/test_transports.py's.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import BF16, CPU, FAST, SMALL_BUCKET_MB, Trainer, assert_engine_holds, read_jsonl, run_main

from rlsync.config.schema import Config, UpdateConfig
from rlsync.engines.process import EngineDied
from rlsync.update import WeightMismatch, checksum, close_update, timed_update

# Process engines cost a start each (the first about 7 s of imports, then about 1 s from the
# forkserver), so each configuration is opened once per module and serves both sources.
PROCESS_CASES = [
    pytest.param("ipc", "bucketed", 2, False, id="ipc-bucketed-inflight2"),
    pytest.param("ipc", "per_tensor", 1, False, id="ipc-per_tensor"),
    pytest.param("ipc", "bucketed", 1, True, id="ipc-bucketed-flat"),
    pytest.param("broadcast", "bucketed", 1, False, id="broadcast-bucketed"),
    pytest.param("broadcast", "per_tensor", 2, False, id="broadcast-per_tensor-inflight2"),
    pytest.param("broadcast", "bucketed", 2, True, id="broadcast-bucketed-flat-inflight2"),
]


@pytest.mark.parametrize("name,strategy,inflight,flat", PROCESS_CASES)
def test_process_engine_is_bit_exact_for_both_sources(name, strategy, inflight, flat):
    trainer = Trainer()
    update = UpdateConfig(
        transport=name,
        strategy=strategy,
        inflight_buckets=inflight,
        flat_engine_weights=flat,
        bucket_mb=SMALL_BUCKET_MB,
        verify=True,
        engine_timeout_s=120,
    )
    engine, transport, buckets = trainer.open(update)
    largest_tensor = max(t.numel() * 2 for t in trainer.weights.values())
    assert max(b.nbytes for b in buckets) == largest_tensor > SMALL_BUCKET_MB * 2**20  # one tensor alone, oversized
    try:
        for source in ("device", "host", "device"):
            sent = trainer.source(source)
            metrics = timed_update(transport, sent, buckets=buckets, cfg=update, device=CPU, floor_time=1e-3)
            assert_engine_holds(engine, sent)
            for key in ("pack", "transfer", "load"):
                assert metrics[f"perf/update_weights_{key}_time"] >= 0
            rows = transport.last_update_buckets
            assert len(rows) == (len(buckets) if strategy == "bucketed" else len(trainer.weights))
            assert sum(r["bytes"] for r in rows) == metrics["perf/update_weights_bytes"]

        # The staging memory the bucket size costs, counted once per buffer on either side.
        slot = max(b.nbytes for b in buckets)  # == the largest tensor here, so per_tensor's slot too
        expected = {
            ("ipc", False): inflight * slot,
            ("ipc", True): 0,
            ("broadcast", False): 2 * inflight * slot,
            ("broadcast", True): inflight * slot,
        }
        assert metrics["perf/update_weights_peak_bytes"] == expected[name, flat and strategy == "bucketed"]
    finally:
        close_update(engine, transport)
    assert not engine.is_alive()
    assert not dist.is_initialized()


@pytest.mark.parametrize("strategy", ["bucketed", "per_tensor"])
@pytest.mark.parametrize("source", ["device", "host"])
@pytest.mark.parametrize("flat", [False, True])
def test_direct_is_bit_exact(strategy, source, flat):
    trainer = Trainer()
    update = UpdateConfig(strategy=strategy, bucket_mb=SMALL_BUCKET_MB, flat_engine_weights=flat, verify=True)
    engine, transport, buckets = trainer.open(update)
    for _ in range(2):
        sent = trainer.source(source)
        metrics = timed_update(transport, sent, buckets=buckets, cfg=update, device=CPU, floor_time=1e-3)
        assert_engine_holds(engine, sent)
    if flat and strategy == "bucketed":
        assert metrics["perf/update_weights_peak_bytes"] == 0  # packing wrote the engine's weights: no staging
        assert "perf/update_weights_load_time" not in metrics
    close_update(engine, transport)


def test_ipc_generates_what_the_in_process_engine_generates():
    """Same weights, same sampler state: same tokens and log-probs, and the sampler advances the same."""
    trainer = Trainer()
    weights = trainer.source("device")
    opened = {}  # transport name -> (engine, transport)
    try:
        for name in ("direct", "ipc"):
            update = UpdateConfig(transport=name)
            engine, transport, buckets = trainer.tiny.open(update, weights, spec=trainer.spec)
            opened[name] = engine, transport
            timed_update(transport, weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
        prompts = [[256, *b"12+7="], [256, *b"3*4=?"], [256, 65]]
        outs, states = {}, {}
        for name, (engine, _) in opened.items():
            engine.resume()
            sampler = torch.Generator().manual_seed(11)
            outs[name] = engine.generate(prompts, max_new_tokens=6, temperature=1.0, generator=sampler)
            engine.release()
            states[name] = sampler.get_state()
        for field in ("sequences", "attention_mask", "response_mask", "logprobs", "truncated"):
            assert torch.equal(getattr(outs["direct"], field), getattr(outs["ipc"], field)), field
        assert torch.equal(states["direct"], states["ipc"])
    finally:
        for engine, transport in opened.values():
            close_update(engine, transport)


def test_verify_in_the_engine_process_names_the_tensor():
    trainer = Trainer()
    update = UpdateConfig(transport="ipc", verify=True)
    engine, transport, buckets = trainer.open(update)
    try:
        timed_update(transport, trainer.weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
        sums = engine.checksums()  # computed in the engine process
        assert sums == {n: checksum(t.to(BF16)) for n, t in trainer.weights.items()}
        with torch.no_grad():
            trainer.weights["model.norm.weight"].add_(1.0)  # the trainer moves on, the engine does not hear of it
        from rlsync.update import verify

        with pytest.raises(WeightMismatch, match="model.norm.weight"):
            verify(trainer.weights, engine.checksums(), BF16)
    finally:
        close_update(engine, transport)


def kill_after(pid: int, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, args=(pid, signal.SIGKILL))
    timer.start()
    return timer


@pytest.mark.parametrize("name", ["ipc", "broadcast"])
def test_a_dead_engine_is_a_clear_error_within_seconds(name):
    """Killed while the trainer waits on it (a long generation): EngineDied naming the exit code, fast;
    then close() still leaves no process and no process group behind."""
    trainer = Trainer()
    update = UpdateConfig(transport=name, bucket_mb=SMALL_BUCKET_MB)
    engine, transport, buckets = trainer.open(update)
    try:
        timed_update(transport, trainer.weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
        kill_after(engine.pid, 0.5)
        start = time.monotonic()
        with pytest.raises(EngineDied, match=r"exit code -9 \(killed by SIGKILL\)"):
            engine.generate([[256, 65]] * 8, max_new_tokens=100_000, temperature=1.0, generator=torch.Generator())
        assert time.monotonic() - start < 5.0
        with pytest.raises(EngineDied, match="exit code -9"):  # and every later call says the same at once
            timed_update(transport, trainer.weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
    finally:
        close_update(engine, transport)
    assert not engine.is_alive()
    assert not dist.is_initialized()


def test_a_broadcast_engine_killed_mid_update_does_not_hang_the_trainer():
    """The hardest wait: the trainer inside a collective whose peer is gone."""
    trainer = Trainer()
    update = UpdateConfig(transport="broadcast", bucket_mb=SMALL_BUCKET_MB, engine_timeout_s=120)
    engine, transport, buckets = trainer.open(update)
    os.kill(engine.pid, signal.SIGSTOP)  # frozen: the trainer's broadcasts cannot complete
    kill_after(engine.pid, 0.5)
    start = time.monotonic()
    try:
        with pytest.raises(
            EngineDied, match=r"exit code -9 \(killed by SIGKILL\) while the trainer waited for a weight"
        ):
            timed_update(transport, trainer.weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
        assert time.monotonic() - start < 5.0
    finally:
        close_update(engine, transport)
    assert not dist.is_initialized()


def test_broadcast_leaves_the_default_process_group_alone():
    """A data-parallel trainer owns torch.distributed's default group; the engine's group is its own."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = Trainer()
        update = UpdateConfig(transport="broadcast", bucket_mb=SMALL_BUCKET_MB)
        engine, transport, buckets = trainer.open(update)
        try:
            timed_update(transport, trainer.weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
            assert_engine_holds(engine, trainer.weights)
        finally:
            close_update(engine, transport)
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# The whole step through the CLI
# ----------------------------------------------------------------------------------------------


def test_whole_step_runs_with_broadcast(tmp_path):
    run_dir = tmp_path / "run"
    fast = [o for o in FAST if not o.startswith(("run.steps=", "run.warmup_steps="))] + [
        "run.steps=1",
        "run.warmup_steps=0",
    ]
    proc = run_main(
        *fast,
        "update.transport=broadcast",
        "update.verify=true",
        f"update.bucket_mb={SMALL_BUCKET_MB}",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["setup"]["transport"] == "broadcast"
    # the engine's own peak resident set, as its close answered (not the trainer's, nor the forkserver's)
    assert 50 * 2**20 < summary["memory"]["measured"]["engine_peak_rss_bytes"] < 2**30, summary["memory"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 1
    for row in rows:  # the engine scored its samples with the weights the trainer just sent (bf16 vs fp32)
        assert 0 <= row["train/logprob_abs_diff"] < 0.01
        assert row["perf/update_weights_peak_bytes"] > 0 and row["perf/update_weights_transfer_time"] > 0


def test_validation_rejects_released_flat_ipc_weights_before_building_anything():
    from rlsync.config.validate import validate
    from rlsync.errors import ConfigError

    cfg = Config()
    cfg.update.transport, cfg.update.flat_engine_weights, cfg.rollout.release_level = "ipc", True, 2
    with pytest.raises(ConfigError, match="update.flat_engine_weights"):
        validate(cfg)
    cfg.update.transport = "direct"  # there the engine's own buffers can be freed and refilled
    validate(cfg)


def test_engine_processes_start_with_sleeping_openmp_threads_unless_told(monkeypatch):
    """On a CPU the engine process starts with OMP_WAIT_POLICY=PASSIVE (its spinning OpenMP workers
    would take the trainer's cores between update messages), the trainer's environment is left as
    it was, a user's own setting wins, and an engine that binds its own threads (vLLM) is left alone."""
    from rlsync.engines.base import engine_class
    from rlsync.engines.process import passive_openmp

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with passive_openmp(True):
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with passive_openmp(True):
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert engine_class("hf").passive_cpu_threads and not engine_class("vllm").passive_cpu_threads


def test_spin_poll_sees_a_waiting_message_at_once_and_gives_up_after_its_window():
    import multiprocessing

    from rlsync.engines.process import spin_poll

    ours, theirs = multiprocessing.Pipe()
    start = time.perf_counter()
    assert spin_poll(ours, 0.02) is False  # nothing sent: gives up after its window, then the caller blocks
    assert 0.02 <= time.perf_counter() - start < 1.0
    theirs.send(("update", ("tensor", "w", 0)))
    start = time.perf_counter()
    assert spin_poll(ours, 10.0) is True and time.perf_counter() - start < 1.0  # at once, not after the window
    assert ours.recv() == ("update", ("tensor", "w", 0))


def test_the_engine_and_its_transport_are_two_objects(tiny):
    """open_update returns what the loop generates with (an EngineHandle) and the weight channel (a Transport,
    never an engine handle itself); closing the engine, then the channel, leaves both closed."""
    from rlsync.engines.base import Engine, EngineHandle
    from rlsync.update import open_update, plan_for
    from rlsync.update.base import Transport, transport_class, transport_names

    assert not any(issubclass(transport_class(name), EngineHandle) for name in transport_names())
    update = UpdateConfig(bucket_mb=SMALL_BUCKET_MB)
    weights = tiny.weights()
    engine, transport = open_update(update, spec=tiny.spec(), buckets=plan_for(weights, update, BF16))
    assert isinstance(engine, Engine) and isinstance(transport, Transport) and transport.engine is engine
    transport.update_weights(weights)
    assert_engine_holds(engine, weights)
    close_update(engine, transport)
    assert transport.staging is None
