"""An engine and a transport registered from this file alone (no rlsync file names them) carry whole
steps of the real runner, with update.verify=true passing; validation offers their names."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FAST, SMALL_MODEL, read_jsonl

from rlsync.config.schema import UpdateConfig
from rlsync.config.validate import validate
from rlsync.engines.base import ENGINES, EngineSpec, register_engine
from rlsync.engines.hf import HFEngine
from rlsync.errors import ConfigError
from rlsync.measure.timing import HostTimer
from rlsync.run.loop import run_experiment
from rlsync.update.base import TRANSPORTS, Transport, UpdateResult, register_transport
from rlsync.update.buckets import Bucket


class ToyEngine(HFEngine):
    """The HF engine, counting the tensors it is handed."""

    loaded = 0

    def load_weights(self, named) -> None:
        named = list(named)
        type(self).loaded += len(named)
        super().load_weights(named)


class ToyTransport(Transport):
    """The engine in this process, its weights handed over one tensor at a time: no buckets, no staging.

    update.verify compares the engine's own checksums (`EngineHandle`'s default, computed from its weights)."""

    updates = 0

    def __init__(self, spec: EngineSpec, buckets: list[Bucket], cfg: UpdateConfig):
        self.strategy = cfg.strategy

    def start_engine(self, spec: EngineSpec):
        return spec.build(strategy=self.strategy)  # in this process

    def send_weights(self, weights: dict[str, torch.Tensor]) -> UpdateResult:
        type(self).updates += 1
        timer, rows = HostTimer(), []
        for name, tensor in weights.items():
            rows.append({"bytes": tensor.numel() * self.engine.dtype.itemsize})
            with timer("load", rows[-1]):
                self.engine.load_weights([(name, tensor)])
        return UpdateResult(dict(timer.seconds), rows)

    def close(self) -> None:
        """Nothing of its own to free: the engine is closed by its handle."""


@pytest.fixture
def toys():
    """`rollout.engine=toy` and `update.transport=toy`, registered for one test."""
    register_engine("toy", ToyEngine)
    register_transport("toy", ToyTransport)
    ToyEngine.loaded = ToyTransport.updates = 0
    yield "toy"
    ENGINES.pop("toy")
    TRANSPORTS.pop("toy")


def test_a_registered_engine_and_transport_run_whole_steps_with_verify_passing(compose, toys, tmp_path):
    cfg = compose(
        *FAST,
        *SMALL_MODEL,
        "wandb.mode=disabled",
        f"rollout.engine={toys}",
        f"update.transport={toys}",
        "update.verify=true",
    )
    validate(cfg)
    run_experiment(cfg, tmp_path, name="test", group="test")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["verification"] == "passed"
    assert summary["setup"]["transport"] == toys and summary["setup"]["engine"] == toys
    assert len(rows) == 3
    assert all(r["perf/update_weights_bytes"] > 0 and r["perf/update_weights_load_time"] > 0 for r in rows)
    assert all("perf/update_weights_pack_time" not in r for r in rows)  # only the phases it reports
    tensors = summary["model"]["tensors"]
    assert ToyTransport.updates == 4  # the first sync, then one update per step
    assert ToyEngine.loaded == 4 * tensors  # tensor by tensor


def test_an_unknown_transport_is_one_line_naming_the_registered_ones(compose, toys):
    with pytest.raises(ConfigError) as caught:
        validate(compose("update.transport=nccl"))
    assert str(caught.value) == "update.transport=nccl: not allowed (allowed: direct, ipc, broadcast, toy)"
    validate(compose(f"update.transport={toys}"))  # the registered name passes the same rule


class OwnTransferEngine(HFEngine):
    """An engine that describes itself: its own update strategy (a copy by name, no staging) and a
    rule of its own, asked of the class by the one validation pass."""

    own_strategies = ("toy_copy",)
    title = "Toy"
    native_updates = 0

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        if cfg.update.strategy == "toy_copy" and cfg.update.inflight_buckets != 1:
            raise ConfigError(
                "update.inflight_buckets",
                cfg.update.inflight_buckets,
                "1 (toy_copy stages nothing)",
                "not allowed with update.strategy=toy_copy",
            )

    def native_update(self, weights, *, bucket_bytes):
        type(self).native_updates += 1
        timer = HostTimer()
        with timer("load", {}):
            self.load_weights(weights.items())
        return dict(timer.seconds), 0


@pytest.fixture
def own_transfer():
    register_engine("toy_own", OwnTransferEngine)
    OwnTransferEngine.native_updates = 0
    yield "toy_own"
    ENGINES.pop("toy_own")


def test_an_engine_declares_its_strategies_and_rules_and_runs_verified_steps(compose, own_transfer, tmp_path):
    cfg = compose(
        *FAST,
        *SMALL_MODEL,
        "wandb.mode=disabled",
        f"rollout.engine={own_transfer}",
        "update.strategy=toy_copy",
        "update.verify=true",
    )
    validate(cfg)  # update.strategy offers the engine's own strategy
    run_experiment(cfg, tmp_path, name="test", group="test")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["verification"] == "passed"
    assert OwnTransferEngine.native_updates == 4  # the first sync, then one update per step: its own path
    with pytest.raises(ConfigError) as caught:  # its own rule, in the one validation pass
        validate(compose(f"rollout.engine={own_transfer}", "update.strategy=toy_copy", "update.inflight_buckets=2"))
    assert str(caught.value) == (
        "update.inflight_buckets=2: not allowed with update.strategy=toy_copy (allowed: 1 (toy_copy stages nothing))"
    )
    with pytest.raises(ConfigError) as caught:  # another engine is refused the strategy, naming its owner
        validate(compose("rollout.engine=hf", "update.strategy=toy_copy"))
    assert str(caught.value) == (
        "update.strategy=toy_copy: not allowed with rollout.engine=hf (allowed: bucketed, "
        "per_tensor (toy_copy is Toy's own transfer: set rollout.engine=toy_own))"
    )


class ToyProcessTransport(ToyTransport):
    """As ToyTransport, but declaring the facts of an engine in its own process with two staging buffers a side."""

    engine_in_process = False

    @classmethod
    def staging_slots(cls, cfg, flat_weights):
        return 2, 2


@pytest.mark.parametrize("toy, like", [(ToyTransport, "direct"), (ToyProcessTransport, "broadcast")])
def test_the_memory_check_sizes_a_registered_transport_from_its_declared_facts(compose, toy, like):
    """No rlsync module names these transports: the estimate reads what each declares (where its engine
    lives, its staging buffers), and matches the built-in transport that declares the same."""
    from rlsync.check.estimate import estimate, param_shapes, planned_largest_bucket, staging_bytes

    register_transport("toy_facts", toy)
    try:
        overrides = ("model=qwen3_0p6b", "update.flat_engine_weights=false", "update.inflight_buckets=2")
        mine = compose(*overrides, "update.transport=toy_facts")
        theirs = compose(*overrides, f"update.transport={like}")
        largest = planned_largest_bucket(mine, param_shapes(mine.model))
        slots = toy.staging_slots(mine.update, False)
        assert staging_bytes(mine, param_shapes(mine.model)) == (slots[0] * largest, slots[1] * largest)
        got, want = (estimate(c, cuda=False, runtime_bytes=0).as_dict() for c in (mine, theirs))
        if toy is ToyTransport:  # one slot in this process; direct holds the same
            assert got == want
            assert got["engine_process"] is None and "engine_weights" in got["process"]
        else:  # an engine process of its own, with its buffers: as broadcast's
            assert got == want
            assert got["engine_process"]["staging"] == 2 * largest
    finally:
        TRANSPORTS.pop("toy_facts")
