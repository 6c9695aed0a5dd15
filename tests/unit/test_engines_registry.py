"""The engine registry: an engine registered from outside rlsync runs whole steps, in this process
or an engine process; unknown names are refused in one line naming the registered ones."""

from __future__ import annotations

import pytest
from conftest import CountingEngine, run_in_process

from rlsync.config.validate import validate
from rlsync.engines.base import ENGINES, engine_class, engine_names, register_engine
from rlsync.errors import ConfigError


def test_a_registered_engine_runs_whole_steps_with_verify_passing(compose, counting, tmp_path):
    rows, summary = run_in_process(tmp_path, f"rollout.engine={counting}", "update.verify=true")
    assert summary["status"] == "finished" and summary["verification"] == "passed"
    assert summary["setup"]["engine"] == counting
    assert len(rows) == 3 and all(r["perf/update_weights_bytes"] > 0 for r in rows)
    assert CountingEngine.generate_calls == 3  # one rollout per step, all through the registered engine


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
