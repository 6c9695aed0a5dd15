"""The `direct` transport (the engine in this process) and what the engine-process transports share.

Bit-exact engine weights after updates for every strategy x source x flat layout, with buckets smaller than
the largest tensor; the engine and its transport as two objects; validation and the engine process's start
settings, without a process. The `ipc` and `broadcast` transports (an engine process each: bit-exact updates,
generation, a dead engine, the whole step through the CLI's entry point) are tests/process/test_transports.py's.
"""

from __future__ import annotations

import os
import time

import pytest
from conftest import BF16, CPU, SMALL_BUCKET_MB, Trainer, assert_engine_holds

from rlsync.config.schema import Config, UpdateConfig
from rlsync.update import close_update, timed_update


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
