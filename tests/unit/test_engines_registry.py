"""The engine registry: an engine registered from outside rlsync runs whole steps, in this process
or an engine process; unknown names are refused in one line naming the registered ones."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import FAST, ROOT, cli_env, read_jsonl

from rlsync.config.validate import validate
from rlsync.engines.base import ENGINES, Engine, EngineSpec, engine_class, engine_names, register_engine
from rlsync.errors import ConfigError

SMALL_MODEL = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_hidden_layers=2",
    "model.head_dim=16",
    "model.vocab_size=300",
]


class CountingEngine(Engine):
    """A toy engine written against the interface alone: the HF engine inside, every call counted
    (in the process the engine runs in)."""

    generate_calls = 0
    preload = engine_class("hf").preload_modules()  # the model code of the engine inside, imported once per process

    def __init__(self, inner: Engine):
        self.inner, self.device, self.dtype = inner, inner.device, inner.dtype

    @classmethod
    def from_spec(cls, spec: EngineSpec, *, strategy: str) -> CountingEngine:
        return cls(engine_class("hf").from_spec(spec, strategy=strategy))

    def generate(self, prompts, **kwargs):
        type(self).generate_calls += 1
        return self.inner.generate(prompts, **kwargs)

    def release(self) -> None:
        self.inner.release()

    def resume(self) -> None:
        self.inner.resume()

    def load_weights(self, named) -> None:
        self.inner.load_weights(named)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.inner.weights


@pytest.fixture
def counting():
    """`rollout.engine=counting`, registered here only (no rlsync file names it), for one test."""
    register_engine("counting", CountingEngine)
    CountingEngine.generate_calls = 0
    yield "counting"
    ENGINES.pop("counting")


def run_in_process(compose, run_dir, *overrides: str) -> tuple[list[dict], dict]:
    """`python -m rlsync` without a new interpreter (the registration lives in this one): (rows, summary)."""
    from rlsync.run.loop import run_experiment

    cfg = compose(*FAST, *SMALL_MODEL, "wandb.mode=disabled", *overrides)
    validate(cfg)
    run_experiment(cfg, run_dir, name="test", group="test")
    return read_jsonl(run_dir / "metrics.jsonl"), json.loads((run_dir / "summary.json").read_text())


def test_a_registered_engine_runs_whole_steps_with_verify_passing(compose, counting, tmp_path):
    rows, summary = run_in_process(compose, tmp_path, f"rollout.engine={counting}", "update.verify=true")
    assert summary["status"] == "finished" and summary["verification"] == "passed"
    assert summary["setup"]["engine"] == counting
    assert len(rows) == 3 and all(r["perf/update_weights_bytes"] > 0 for r in rows)
    assert CountingEngine.generate_calls == 3  # one rollout per step, all through the registered engine


@pytest.mark.slow  # starts an engine process
def test_a_registered_engine_runs_in_an_engine_process_too(compose, counting, tmp_path):
    """The engine process never ran this file's registration: the spec carries the engine's class there."""
    rows, summary = run_in_process(
        compose, tmp_path, f"rollout.engine={counting}", "update.verify=true", "update.transport=ipc", "run.steps=2"
    )
    assert summary["status"] == "finished" and summary["verification"] == "passed"
    assert len(rows) == 2
    assert CountingEngine.generate_calls == 0  # it generated in the engine process, not here


def test_an_unknown_engine_is_one_line_naming_the_registered_ones(compose, counting):
    with pytest.raises(ConfigError) as caught:
        validate(compose("rollout.engine=sglang"))
    assert str(caught.value) == "rollout.engine=sglang: not allowed (allowed: hf, vllm, counting)"
    validate(compose(f"rollout.engine={counting}"))  # the registered name passes the same rule


def test_registration_forms_and_lazy_paths():
    @register_engine("decorated")
    class Decorated(CountingEngine):
        pass

    register_engine("by_path", f"{__name__}:CountingEngine")
    register_engine("missing", "no_such_module_for_rlsync:Engine")  # registering imports nothing
    try:
        assert engine_names()[:2] == ("hf", "vllm")
        assert {"decorated", "by_path", "missing"} <= set(engine_names())
        assert engine_class("decorated") is Decorated
        assert engine_class("by_path") is CountingEngine
        with pytest.raises(ModuleNotFoundError):
            engine_class("missing")
        with pytest.raises(ValueError, match="rollout.engine='nope': expected one of hf, vllm"):
            engine_class("nope")
    finally:
        for name in ("decorated", "by_path", "missing"):
            ENGINES.pop(name)


@pytest.mark.slow  # what a fresh interpreter imports
def test_the_registry_and_the_run_modules_import_no_engine_dependency():
    """vLLM is imported when its engine starts, not when rlsync (or the vLLM engine's class) is loaded."""
    code = (
        "import sys, rlsync.run.loop, rlsync.config.validate, rlsync.serve, rlsync.bench\n"
        "from rlsync.engines.base import engine_class\n"
        "assert engine_class('vllm').__name__ == 'VLLMEngine'\n"
        "print(sorted(m for m in ('vllm', 'rlsync.engines.vllm') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[-2] == "['rlsync.engines.vllm']"
