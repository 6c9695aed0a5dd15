"""`python -m rlsync.bench bench.target=stall`: what it refuses up front, how it fails, in process.

The refusals that need nothing but the config (a payload or adapters a standalone engine does not take,
more clients than the engines' streams, engine overrides of keys the bench sets, an open-file limit its
engines would refuse), the engine's own reason in a failed start's line (its `rlsync:` line, a traceback's
exception line, a traceback cut off said to be), failed requests failing the bench, the printed ratio
naming what it is a ratio of, a MoE model's expert views swapped in. Real processes:
tests/process/test_bench_pause.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import Tiny, run_main

from rlsync.bench import stall

QUICK = ["bench.target=stall", "bench.repeats=1", "bench.warmup=0", "wandb.mode=disabled", "run.progress=false"]


def refused(*overrides: str, tmp_path: Path) -> str:
    """The one line a stall bench refused with (exit 2), having built nothing."""
    done = run_main(*QUICK, *overrides, f"hydra.run.dir={tmp_path / 'run'}", module="rlsync.bench")
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("rlsync: config error: "), done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    return lines[0]


# ----------------------------------------------------------------------------------------------
# Refused up front: through the rules a standalone engine's trainer is refused with (Q25, Q26, Q39)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["update.payload=delta"], "not allowed with update.payload=delta"),
        (["trainer.lora.rank=16", "update.payload=lora"], "not allowed with update.payload=lora"),
        (["update.payload=fp8"], "not allowed with update.payload=fp8"),
    ],
)
def test_a_payload_a_standalone_engine_refuses_is_refused_before_anything_starts(overrides, named, tmp_path):
    line = refused(*overrides, tmp_path=tmp_path)
    assert line.startswith("rlsync: config error: bench.target=stall: ") and named in line, line
    assert "update.engine_address" in line and "standalone" in line, line  # the rule's own reason, and why it applies
    # the same rule, as a run with a standalone engine meets it
    remote = ("update.transport=broadcast", "update.engine_address=127.0.0.1:0", f"hydra.run.dir={tmp_path / 'r'}")
    run = run_main(*overrides, *remote, module="rlsync")
    assert run.returncode == 2 and "update.engine_address" in run.stderr and named in run.stderr, run.stderr


def test_adapters_merged_are_refused_the_bench_builds_none(tmp_path):
    line = refused("trainer.lora.rank=16", "update.payload=lora_merged", tmp_path=tmp_path)
    assert "trainer.lora.rank=16" in line and "bench.target=stall" in line, line


# ----------------------------------------------------------------------------------------------
# Clients and engine overrides (Q19, Q20, Q16b)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        ["bench.clients=16"],  # the engines' default serve.max_streams=8
        ['bench.engine_overrides=["serve.max_streams=1"]', "bench.clients=2"],
    ],
)
def test_more_clients_than_the_engines_streams_are_refused(overrides, tmp_path):
    line = refused(*overrides, tmp_path=tmp_path)
    assert "bench.clients=" in line and "serve.max_streams=" in line, line


def test_as_many_clients_as_streams_are_accepted(compose):
    from rlsync.config.apps import BenchConfig, check_stall_target

    cfg = compose()
    bench = BenchConfig(target="stall", clients=3, engine_overrides=["serve.max_streams=3"])
    check_stall_target(bench, cfg)  # no error
    with pytest.raises(Exception, match="bench.clients=4"):
        check_stall_target(replace(bench, clients=4), cfg)


def test_an_open_file_limit_its_engines_cannot_run_under_is_refused(compose, monkeypatch):
    """U14: under ulimit -n 20 the engine failed to start, and the line was a line of its traceback; then the
    refusal offered other bench targets. Now: the engines' own reason, and the limit that lets them start."""
    import resource

    from rlsync.config.apps import BenchConfig, check_stall_target
    from rlsync.errors import ConfigError

    monkeypatch.setattr(resource, "getrlimit", lambda which: (20, 20))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: None)
    with pytest.raises(ConfigError) as caught:
        check_stall_target(BenchConfig(target="stall"), compose())
    assert str(caught.value) == (
        "bench.target=stall: its engines (python -m rlsync.serve, update.transport=broadcast) would not start: "
        "each needs more open files than this shell allows (ulimit -n 20, hard limit 20), to receive its buffers "
        "as file descriptors (allowed: a shell with an open-file limit of at least 256 (ulimit -n 4096), which "
        "the engines inherit)"
    )


@pytest.mark.parametrize(
    "override,instead",
    [
        ("serve.update_policy=stage", "bench.policies"),
        ("serve.sessions=1", "the bench stops its engines itself"),
    ],
)
def test_an_engine_override_of_a_key_the_bench_sets_is_refused(override, instead, tmp_path):
    line = refused(f'bench.engine_overrides=["{override}"]', "bench.policies=[pause]", tmp_path=tmp_path)
    assert "bench.engine_overrides" in line and override.split("=")[0] in line and instead in line, line


@pytest.mark.parametrize(
    "override,named",
    [("serve.max_stream=4", "unknown serve key"), ("serve.stage_nice=99", "serve.stage_nice=99")],
)
def test_an_engine_override_the_engine_would_refuse_is_refused_here(override, named, tmp_path):
    line = refused(f'bench.engine_overrides=["{override}"]', tmp_path=tmp_path)
    assert named in line, line


# ----------------------------------------------------------------------------------------------
# How it fails: the engine's reason (U14, U07b), failed requests (Q19, Q20)
# ----------------------------------------------------------------------------------------------


def test_a_failed_start_names_the_engines_own_line():
    traceback_tail = ["Traceback (most recent call last):\n", "    check_open_files(cfg.update)\n", "OSError: x\n"]
    assert stall.engine_reason(traceback_tail) == "OSError: x"  # its exception line, not a line of code
    own = ["some warning\n", "rlsync: config error: update.transport=broadcast: needs more open files\n", "\n"]
    assert stall.engine_reason(own) == "config error: update.transport=broadcast: needs more open files"
    assert stall.engine_reason([]) == ""


def test_a_traceback_cut_off_before_its_exception_line_is_said_to_be_not_given_as_a_reason():
    """U14 (at 231d17b): the engine ran out of file descriptors while writing its traceback, and the bench's
    line ended with the code line it stopped at: `did not start: check_open_files(cfg.update)`."""
    cut = [
        "Traceback (most recent call last):\n",
        '  File "/x/rlsync/config/validate.py", line 104, in validate\n',
        "    check_open_files(cfg.update)\n",
    ]
    reason = stall.engine_reason(cut)
    assert reason != "check_open_files(cfg.update)" and reason.startswith("its traceback was cut off"), reason
    assert 'File "/x/rlsync/config/validate.py", line 104, in validate' in reason


def test_an_engine_that_fails_while_the_trainer_waits_gives_its_reason_on_the_line():
    """U07b: "failed while the trainer waited for the gloo process group:" and nothing after it."""
    from collections import deque
    from types import SimpleNamespace

    from rlsync.engines.process import EngineFailed, EngineProcess
    from rlsync.fmt import first_line

    tb = 'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: Resource temporarily unavailable\n'
    waiting = EngineProcess.__new__(EngineProcess)
    waiting.conn = SimpleNamespace(poll=lambda timeout=0: True, recv=lambda: ("error", "open", tb))
    waiting.process = SimpleNamespace(is_alive=lambda: True)
    waiting.who, waiting.timeout_s, waiting._early = "the engine at 127.0.0.1:1", 60.0, deque()
    with pytest.raises(EngineFailed) as caught:
        waiting.wait_for(lambda: False, "the gloo process group")
    assert first_line(caught.value) == (
        "the engine at 127.0.0.1:1 failed while the trainer waited for the gloo process group: "
        "RuntimeError: Resource temporarily unavailable"
    )


def answer(failed: str = "") -> stall.Answer:
    return stall.Answer(prompt=[1, 2], sent=0.0, tokens=[3], failed=failed)


def test_failed_requests_fail_the_bench_with_their_count_and_reason():
    stall.failed_requests([answer(), answer()], "pause", 1)  # none failed: nothing raised
    busy = 'HTTP 503: {"op":"stream","error":"Busy: 1 answers are streaming, serve.max_streams=1"}'
    with pytest.raises(stall.RequestsFailed) as caught:
        stall.failed_requests([answer(), answer(busy), answer(busy), answer("StreamFailed: reset")], "stage", 2)
    line = str(caught.value)
    assert line.startswith("3 of 4 streaming requests to the stage engine failed in repeat 2 (2 of them: HTTP 503")
    assert "serve.max_streams=1" in line and caught.value.exit_code == 1


def test_the_printed_ratio_is_the_ratio_of_the_medians_shown():
    """The bench printed "stage / pause, longest gap: 0.808" under medians of 0.21 s and 0.76 s."""
    metrics = {
        "pause/pause/max_gap_time": {"median": 0.76, "min": 0.5, "max": 0.9},
        "pause/stage/max_gap_time": {"median": 0.21, "min": 0.2, "max": 0.6},
        "pause/gap_ratio": {"median": 0.808, "min": 0.25, "max": 1.1},
    }
    result = {"metrics": metrics, "model": {"name": "tiny"}, "measured_steps": 3, "warmup_steps": 0}
    line = next(ln for ln in stall.StallTarget.table(result).splitlines() if ln.startswith("stage / pause"))
    assert line.startswith("stage / pause, longest gap: 0.28 (the medians above"), line
    assert "per update" in line and "0.81 (0.25 to 1.10)" in line, line


def test_the_stage_policy_swaps_in_a_moe_models_expert_views(compose):
    """Q24's second cause: in the checkpoint layout a MoE engine's experts are views of its fused parameters;
    the stage policy's pointer swap rebound the views and left the parameters unfilled (NaN answers)."""
    from types import SimpleNamespace

    from conftest import BF16, FakeReceiver, FakeServer

    from rlsync.config.apps import ServeConfig
    from rlsync.model.architecture import update_tensors
    from rlsync.serve.policies.base import policy_for
    from rlsync.serve.streams import Decoder
    from rlsync.update import plan_for

    cfg, tiny = compose("model=tiny_moe"), Tiny()
    old, new = (update_tensors(tiny.weights(seed=s, model=cfg.model), cfg.model.update_layout) for s in (1, 2))
    engine = tiny.spec(model=cfg.model).build()
    engine.load_weights(old.items())
    stage = SimpleNamespace(serve=ServeConfig(update_policy="stage", max_wait_s=5))  # an engine's serve.* keys
    policy = policy_for(stage, Decoder(engine, max_streams=2))
    receiver = FakeReceiver(plan_for(old, replace(cfg.update, bucket_mb=1.0), BF16), flat_weights=False)
    server = FakeServer(engine, receiver)
    policy.open(server)
    receiver.next = new
    policy.update(server, "update")
    live = engine.weights
    assert all(torch.equal(live[name], tensor.to(BF16)) for name, tensor in new.items())
    assert policy.swap == "local copy"  # said as it is done
