"""`python -m rlsync.bench bench.target=pause`: what it refuses up front, how it fails, what it leaves behind.

In-process (fast): the refusals that need nothing but the config (a payload or adapters a standalone
engine does not take, more clients than the engines' streams, engine overrides of keys the bench sets),
the engine's own reason in a failed start's line, failed requests failing the bench, the printed ratio
naming what it is a ratio of. With real processes (slow): a MoE model's bench runs; a SIGTERM while the
engines start ends with its line, 143 and a summary, the engine and its directory gone; a bench killed
outright takes its engine with it; an engine that cannot start names its own reason.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import ROOT, Tiny, cli_env, run_cli, run_main

from rlsync.bench import pause

QUICK = ["bench.target=pause", "bench.repeats=1", "bench.warmup=0", "wandb.mode=disabled", "run.progress=false"]


def refused(*overrides: str, tmp_path: Path) -> str:
    """The one line a pause bench refused with (exit 2), having built nothing."""
    done = run_main(*QUICK, *overrides, f"hydra.run.dir={tmp_path / 'run'}", module="rlsync.bench")
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("rlsync: config error: "), done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    return lines[0]


# ----------------------------------------------------------------------------------------------
# Refused up front: through the rules a standalone engine's trainer is refused with (Q25, Q26, Q39)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override,named",
    [
        ("update.delta=true", "not allowed with update.delta=true"),
        ("trainer.lora.rank=16", "not allowed with update.lora=adapter"),
        ("update.wire_dtype=float8_e4m3fn", "not allowed with update.wire_dtype"),
    ],
)
def test_a_payload_a_standalone_engine_refuses_is_refused_before_anything_starts(override, named, tmp_path):
    line = refused(override, tmp_path=tmp_path)
    assert line.startswith("rlsync: config error: bench.target=pause: ") and named in line, line
    assert "update.engine_address" in line and "standalone" in line, line  # the rule's own reason, and why it applies
    # the same rule, as a run with a standalone engine meets it
    remote = ("update.transport=broadcast", "update.engine_address=127.0.0.1:0", f"hydra.run.dir={tmp_path / 'r'}")
    run = run_main(override, *remote, module="rlsync")
    assert run.returncode == 2 and "update.engine_address" in run.stderr and named in run.stderr, run.stderr


def test_adapters_merged_are_refused_the_bench_builds_none(tmp_path):
    line = refused("trainer.lora.rank=16", "update.lora=merged", tmp_path=tmp_path)
    assert "trainer.lora.rank=16" in line and "bench.target=pause" in line, line


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
    from rlsync.config.apps import BenchConfig, check_pause_target

    cfg = compose()
    bench = BenchConfig(target="pause", clients=3, engine_overrides=["serve.max_streams=3"])
    check_pause_target(bench, cfg)  # no error
    with pytest.raises(Exception, match="bench.clients=4"):
        check_pause_target(replace(bench, clients=4), cfg)


def test_an_open_file_limit_its_engines_cannot_run_under_is_refused(compose, monkeypatch):
    """U14: under ulimit -n 20 the engine failed to start, and the line was a line of its traceback."""
    import resource

    from rlsync.config.apps import BenchConfig, check_pause_target
    from rlsync.errors import ConfigError

    monkeypatch.setattr(resource, "getrlimit", lambda which: (20, 20))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: None)
    with pytest.raises(ConfigError, match=r"bench.target=pause: needs more open files .*ulimit -n 20"):
        check_pause_target(BenchConfig(target="pause"), compose())


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
    assert pause.engine_reason(traceback_tail) == "OSError: x"  # its last line, not a line of code
    own = ["some warning\n", "rlsync: config error: update.transport=broadcast: needs more open files\n", "\n"]
    assert pause.engine_reason(own) == "config error: update.transport=broadcast: needs more open files"
    assert pause.engine_reason([]) == ""


def test_an_engine_that_fails_while_the_trainer_waits_gives_its_reason_on_the_line():
    """U07b: "failed while the trainer waited for the gloo process group:" and nothing after it."""
    from collections import deque
    from types import SimpleNamespace

    from rlsync.fmt import first_line
    from rlsync.update.engine_process import EngineFailed, EngineProcess

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


def answer(failed: str = "") -> pause.Answer:
    return pause.Answer(prompt=[1, 2], sent=0.0, tokens=[3], failed=failed)


def test_failed_requests_fail_the_bench_with_their_count_and_reason():
    pause.failed_requests([answer(), answer()], "pause", 1)  # none failed: nothing raised
    busy = 'HTTP 503: {"op":"stream","error":"Busy: 1 answers are streaming, serve.max_streams=1"}'
    with pytest.raises(pause.RequestsFailed) as caught:
        pause.failed_requests([answer(), answer(busy), answer(busy), answer("StreamFailed: reset")], "stage", 2)
    line = str(caught.value)
    assert line.startswith("3 of 4 streaming requests to the stage engine failed in repeat 2 (2 of them: HTTP 503")
    assert "serve.max_streams=1" in line and caught.value.exit_code == 1


def test_the_printed_ratio_is_the_ratio_of_the_medians_shown():
    """The pause bench printed "stage / pause, longest gap: 0.808" under medians of 0.21 s and 0.76 s."""
    metrics = {
        "pause/pause/max_gap_time": {"median": 0.76, "min": 0.5, "max": 0.9},
        "pause/stage/max_gap_time": {"median": 0.21, "min": 0.2, "max": 0.6},
        "pause/gap_ratio": {"median": 0.808, "min": 0.25, "max": 1.1},
    }
    result = {"metrics": metrics, "model": {"name": "tiny"}, "measured_steps": 3, "warmup_steps": 0}
    line = next(ln for ln in pause.PauseTarget.table(result).splitlines() if ln.startswith("stage / pause"))
    assert line.startswith("stage / pause, longest gap: 0.28 (the medians above"), line
    assert "per update" in line and "0.81 (0.25 to 1.10)" in line, line


def test_the_stage_policy_swaps_in_a_moe_models_expert_views(compose):
    """Q24's second cause: in the checkpoint layout a MoE engine's experts are views of its fused parameters;
    the stage policy's pointer swap rebound the views and left the parameters unfilled (NaN answers)."""
    from test_serve_pause import BF16, FakeReceiver, FakeServer

    from rlsync.model.architecture import update_tensors
    from rlsync.serve.streams import Decoder, StagePolicy
    from rlsync.update import plan_for

    cfg, tiny = compose("model=tiny_moe"), Tiny()
    old, new = (update_tensors(tiny.weights(seed=s, model=cfg.model), cfg.model.update_layout) for s in (1, 2))
    engine = tiny.spec(model=cfg.model).build()
    engine.load_weights(old.items())
    policy = StagePolicy(Decoder(engine, max_streams=2), wait_s=5)
    receiver = FakeReceiver(plan_for(old, replace(cfg.update, bucket_mb=1.0), BF16), flat_weights=False)
    server = FakeServer(engine, receiver)
    policy.open(server)
    receiver.next = new
    policy.update(server, "update")
    live = engine.weights
    assert all(torch.equal(live[name], tensor.to(BF16)) for name, tensor in new.items())
    assert policy.swap == "local copy"  # said as it is done


# ----------------------------------------------------------------------------------------------
# Real processes: an engine that cannot start, a MoE model, signals
# ----------------------------------------------------------------------------------------------


def engines_of(marker: str) -> list[int]:
    """Live processes whose command line holds `marker` (the bench's engines: their hydra.run.dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = next(ln for ln in (entry / "status").read_text().splitlines() if ln.startswith("State:"))
            except (OSError, StopIteration):
                continue
            if marker in cmdline and "rlsync.serve" in cmdline and "zombie" not in state:
                found.append(int(entry.name))
    return found


def wait_until(done, timeout_s: float = 600) -> bool:
    """Poll `done()` until it holds (a generous bound: this asserts what happens, not how fast)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")
def test_an_engine_that_cannot_start_names_its_reason_and_leaves_nothing(tmp_path, monkeypatch):
    """U14: its own line, not a line of its traceback; U21b: no engine and no directory left."""
    cfg_overrides = ["run.device=cuda:7"]  # the engine refuses it (no such device) after the bench accepted cpu
    monkeypatch.setattr(pause, "engine_overrides", lambda cfg, policy: cfg_overrides)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(pause.EngineDidNotStart) as caught:
        pause.EngineServe(object(), "pause")
    line = str(caught.value)
    assert line.startswith("the pause engine (python -m rlsync.serve) did not start: config error: run.device=cuda:7")
    assert "exit code 2" in line, line
    assert not list(tmp_path.glob("rlsync-pause-*")) and not engines_of(str(tmp_path))


@pytest.mark.slow
def test_a_moe_model_is_benched_and_the_ratio_names_its_figures(tmp_path):
    """Q24: the standalone engine takes the update in its checkpoint layout (per-expert names)."""
    done = run_cli(
        *QUICK, "model=tiny_moe", "bench.repeats=2", f"hydra.run.dir={tmp_path}", module="rlsync.bench", timeout=900
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stage / pause, longest gap: " in done.stdout and "(the medians above" in done.stdout, done.stdout
    assert "| stage | local copy |" in done.stdout, done.stdout  # its experts are views: copied, and said so
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["measured_steps"] == 2
    verified = sum(summary["metrics"][f"pause/{p}/answers_verified_total"]["max"] for p in ("pause", "stage"))
    # every answer checked came from the new weights (a miss fails the bench); on a busy machine none may start
    assert ("Verified: " if verified else "Not verified: no answer started") in done.stdout, done.stdout


@pytest.mark.slow
def test_a_bench_whose_requests_fail_fails_and_says_why(tmp_path):
    """Q19/Q20: thousands of failed requests, a "Verified" line and exit 0. Here every request is refused
    (an answer longer than the engine's serve.max_generate_tokens)."""
    refuse = 'bench.engine_overrides=["serve.max_generate_tokens=2"]'
    done = run_cli(*QUICK, refuse, "bench.policies=[pause]", f"hydra.run.dir={tmp_path}", module="rlsync.bench")
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("rlsync:")]
    assert done.returncode == 1 and "Verified" not in done.stdout, (done.stdout, done.stderr[-2000:])
    assert " streaming requests to the pause engine failed in repeat 1 (" in lines[-1], lines
    assert "max_generate_tokens" in lines[-1], lines
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def start_bench(run_dir: Path, tmp: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rlsync.bench", *QUICK, *args, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=cli_env(TMPDIR=str(tmp)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")
def test_sigterm_while_the_engines_start_ends_with_its_line_and_takes_the_engine_down(tmp_path):
    """G10 and U21b: 143, the line, summary.json; no engine and no rlsync-pause-* directory left."""
    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    bench = start_bench(run_dir, tmp)
    try:
        assert wait_until(lambda: engines_of(str(tmp)) or bench.poll() is not None), "no engine started"
        assert bench.poll() is None, bench.communicate()
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=300)
    finally:
        if bench.poll() is None:
            bench.kill()
    lines = [ln for ln in err.splitlines() if ln.startswith("rlsync:")]
    assert bench.returncode == 143, err[-2000:]
    assert lines[-1].startswith("rlsync: interrupted: stopped by SIGTERM; 0 finished step(s) kept in"), err[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert not engines_of(str(tmp)) and not list(tmp.glob("rlsync-pause-*"))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")
def test_a_bench_killed_outright_takes_its_engine_with_it(tmp_path):
    """U21b: even a SIGKILLed bench leaves no engine serving (PR_SET_PDEATHSIG)."""
    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    bench = start_bench(run_dir, tmp, "bench.policies=[pause]")
    try:
        assert wait_until(lambda: engines_of(str(tmp)) or bench.poll() is not None), "no engine started"
        engines = engines_of(str(tmp))
        bench.kill()
        bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
    # gone, or a zombie its new parent has not reaped yet (engines_of leaves those out): nothing serves
    assert engines and wait_until(lambda: not engines_of(str(tmp)), timeout_s=120), engines_of(str(tmp))
