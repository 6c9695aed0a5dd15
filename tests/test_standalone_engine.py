"""The broadcast transport across machines: `python -m rlsync.engine` started on its own, joined over TCP.

Everything on localhost, with real processes: the engine is a `python -m rlsync.engine` subprocess
listening on a free port; the trainer side is this test process (or a `python -m rlsync`
subprocess) joining it with `update.engine_address`. Bit-exact engine weights after updates for
each strategy, generation equal to an in-process engine's, a refused plan for another model, a
second trainer refused while one is served, a killed trainer's session ended, a dead engine and a missing one failing in seconds,
the whole run through the CLI, and SIGTERM.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import FAST, ROOT, cli_env, read_jsonl, run_cli
from rlsync.config import ModelConfig, UpdateConfig
from rlsync.sync import open_engine, plan_for, update_weights
from rlsync.sync.engine_process import EngineDied, EngineFailed
from rlsync.sync.remote import EngineUnreachable, parse_address
from test_transports import BF16, CPU, SMALL_BUCKET_MB, Trainer, assert_engine_holds

START_S = 120  # an engine start (imports, model build) on two busy cores


class StandaloneEngine:
    """`python -m rlsync.engine ...` in a subprocess; its stdout lines are collected as they come."""

    def __init__(self, tmp: Path, *overrides: str):
        args = [sys.executable, "-m", "rlsync.engine", "update.engine_address=127.0.0.1:0", f"hydra.run.dir={tmp}",
                *overrides]
        self.proc = subprocess.Popen(args, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),
                                       daemon=True)
        self.reader.start()
        listening = self.wait_for("listening on")
        self.address = listening.rsplit(" ", 1)[-1]

    def wait_for(self, text: str, timeout: float = START_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [ln for ln in self.lines if text in ln]
            if found:
                return found[-1].strip()
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"the engine never printed {text!r}; stdout {self.lines}, stderr "
                             f"{self.proc.stderr.read() if self.proc.poll() is not None else '(running)'}")

    def stop(self) -> subprocess.CompletedProcess:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        err = self.proc.stderr.read()
        code = self.proc.wait(timeout=30)
        self.reader.join(5)
        return subprocess.CompletedProcess(self.proc.args, code, "".join(self.lines), err)


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    server = StandaloneEngine(tmp_path_factory.mktemp("engine"))
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


def one_update_lands(trainer: Trainer, update: UpdateConfig) -> None:
    """A session of its own: open, one update, the engine holds the trainer's weights bit for bit, close."""
    engine, _ = trainer.open(update)
    try:
        engine.update_weights(trainer.weights)
        assert_engine_holds(engine, trainer.weights)
    finally:
        engine.close()


def remote_update(address: str, **kw) -> UpdateConfig:
    settings = {"bucket_mb": SMALL_BUCKET_MB, "verify": True, "engine_timeout_s": 60, "engine_connect_timeout_s": 60, **kw}
    return UpdateConfig(transport="broadcast", engine_address=address, **settings)


@pytest.mark.parametrize("strategy,inflight,flat", [
    pytest.param("bucketed", 1, False, id="bucketed"),
    pytest.param("per_tensor", 2, False, id="per_tensor-inflight2"),
    pytest.param("bucketed", 2, True, id="bucketed-flat-inflight2"),
])
def test_standalone_engine_receives_bit_exact_updates(engine_server, strategy, inflight, flat):
    trainer = Trainer()
    update = remote_update(engine_server.address, strategy=strategy, inflight_buckets=inflight, flat_engine_weights=flat)
    engine, buckets = trainer.open(update)
    try:
        assert engine.process.pid is None  # no process of ours: the engine was started on its own
        for source in ("device", "host", "device"):
            sent = trainer.source(source)
            metrics = update_weights(engine, sent, buckets=buckets, cfg=update, device=CPU, limit_time=1e-3)
            assert_engine_holds(engine, sent)  # every tensor, bit for bit (verify=True checked the checksums too)
            assert metrics["perf/update_weights_bytes"] == sum(b.nbytes for b in buckets)
            rows = engine.last_update_buckets
            assert len(rows) == (len(buckets) if strategy == "bucketed" else len(trainer.weights))
    finally:
        engine.close()
    assert engine_server.proc.poll() is None  # the session ended, the engine serves on


def test_generation_over_tcp_equals_an_engine_in_this_process(engine_server):
    """The sampler's state travels to the engine and back, so the same weights and seed give the same answers."""
    trainer = Trainer(seed=5)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    answers = []
    for update in (remote_update(engine_server.address), UpdateConfig(transport="direct")):
        engine, _ = trainer.open(update)
        try:
            engine.update_weights(trainer.weights)
            generator = torch.Generator().manual_seed(11)
            gen = engine.generate(prompts, max_new_tokens=6, temperature=1.0, generator=generator)
            answers.append((gen, generator.get_state()))
        finally:
            engine.close()
    (remote, remote_state), (local, local_state) = answers
    assert torch.equal(remote.sequences, local.sequences)
    assert torch.equal(remote.logprobs, local.logprobs)
    assert torch.equal(remote_state, local_state)


def test_engine_refuses_a_plan_for_another_model(engine_server):
    trainer = Trainer()
    other = ModelConfig(hidden_size=128, intermediate_size=256)  # the tiny model, narrower
    from rlsync.models import build_model, named_weights

    weights = named_weights(build_model(other, dtype=torch.float32, device=CPU, seed=0))
    update = remote_update(engine_server.address)
    with pytest.raises(EngineFailed) as caught:
        open_engine(update, spec=trainer.spec, buckets=plan_for(weights, update, BF16))
    first = str(caught.value).splitlines()[0]
    assert f"the engine at {engine_server.address} failed during 'start': PlanMismatch:" in first
    assert "(512, 128)" in first and "(512, 256)" in first and "model" in first  # which tensor, both shapes, the fix
    engine_server.wait_for("refused: tensor")
    assert engine_server.proc.poll() is None


def test_runner_joins_a_standalone_engine_and_matches_a_local_one(engine_server, tmp_path):
    """`python -m rlsync` against the engine over TCP: verified updates, and the same run as with an
    engine process started by the trainer (same seed: same answers, rewards and losses)."""
    common = [*FAST, "update.transport=broadcast", "update.verify=true", "wandb.mode=disabled"]
    remote = run_cli(*common, f"update.engine_address={engine_server.address}", f"hydra.run.dir={tmp_path / 'remote'}")
    assert remote.returncode == 0, remote.stderr
    local = run_cli(*common, f"hydra.run.dir={tmp_path / 'local'}")
    assert local.returncode == 0, local.stderr
    summary = json.loads((tmp_path / "remote" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["verification"] == "passed"
    assert summary["setup"]["engine_address"] == engine_server.address
    rows = {name: read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("remote", "local")}
    for key in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/logprob_abs_diff"):
        assert [r[key] for r in rows["remote"]] == [r[key] for r in rows["local"]], key
    engine_server.wait_for("ended")


KILLED_TRAINER = """
import sys, time
sys.path.insert(0, "tests")
from test_standalone_engine import Trainer, remote_update
trainer = Trainer()
update = remote_update(sys.argv[1])
engine, _ = trainer.open(update)
engine.update_weights(trainer.weights)
print("updated", flush=True)
time.sleep(600)
"""


def test_a_trainer_killed_mid_session_leaves_the_engine_serving(engine_server):
    """SIGKILL, so the trainer never closes its session: the engine notices and takes the next one."""
    killed = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER, engine_server.address], cwd=ROOT, env=cli_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert killed.stdout.readline().strip() == "updated", killed.stderr.read() if killed.poll() is not None else ""
    finally:
        killed.kill()
        killed.wait()
    engine_server.wait_for("ended: the trainer went away without closing it", timeout=30)
    trainer = Trainer(seed=9)
    update = remote_update(engine_server.address)
    one_update_lands(trainer, update)
    engine_server.wait_for("ended: the trainer closed it")


def test_a_second_trainer_is_refused_at_once_while_one_is_served(engine_server):
    trainer = Trainer()
    update = remote_update(engine_server.address)
    first, _ = trainer.open(update)
    try:
        start = time.monotonic()
        with pytest.raises(EngineFailed) as caught:
            trainer.open(update)
        assert time.monotonic() - start < 10
        line = str(caught.value).splitlines()[0]
        assert "EngineBusy: this engine is serving trainer 127.0.0.1:" in line and "one trainer at a time" in line
        first.update_weights(trainer.weights)  # the session being served is untouched
        assert_engine_holds(first, trainer.weights)
    finally:
        first.close()
    second, _ = trainer.open(update)  # free again once the first has left
    second.close()
    engine_server.wait_for("busy with trainer")


def test_sigterm_stops_the_engine_between_sessions(engine_server):
    result = engine_server.stop()
    assert result.returncode == 143, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "rlsync: interrupted: stopped by SIGTERM"


def test_a_dead_engine_fails_the_update_within_seconds(tmp_path):
    server = StandaloneEngine(tmp_path)
    trainer = Trainer()
    update = remote_update(server.address)
    engine, _ = trainer.open(update)
    try:
        server.proc.kill()
        server.proc.wait()
        start = time.monotonic()
        with pytest.raises(EngineDied, match=f"the engine at {server.address} closed the connection"):
            engine.update_weights(trainer.weights)
        assert time.monotonic() - start < 10
    finally:
        engine.close()


def test_no_engine_at_the_address_is_one_clear_error():
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    trainer = Trainer()
    update = remote_update(address, engine_connect_timeout_s=1)
    start = time.monotonic()
    with pytest.raises(EngineUnreachable, match=f"no rlsync engine at update.engine_address={address} after 1 s"):
        trainer.open(update)
    assert time.monotonic() - start < 10


def test_engine_exits_after_its_sessions_and_refuses_a_wrong_key(tmp_path):
    server = StandaloneEngine(tmp_path, "serve.sessions=1")
    trainer = Trainer()
    update = remote_update(server.address, engine_connect_timeout_s=2)
    import os

    os.environ["RLSYNC_ENGINE_KEY"] = "not-the-engine's"
    try:
        with pytest.raises(EngineUnreachable, match="refused this trainer's key"):
            trainer.open(update)
    finally:
        del os.environ["RLSYNC_ENGINE_KEY"]
    server.wait_for("wrong key")
    one_update_lands(trainer, update)
    server.proc.wait(timeout=30)  # it exits by itself after its one session
    result = server.stop()
    assert result.returncode == 0, result.stderr
    assert "served 1 session(s); exiting" in result.stdout


@pytest.mark.parametrize("text,parsed", [
    ("127.0.0.1:29610", ("127.0.0.1", 29610)),
    ("node-3.cluster:0", ("node-3.cluster", 0)),
    ("[::1]:29610", ("::1", 29610)),
])
def test_parse_address(text, parsed):
    assert parse_address(text) == parsed


@pytest.mark.parametrize("text", ["node-3", ":29610", "host:http", "host:70000", "[::1]x"])
def test_parse_address_rejects(text):
    with pytest.raises(ValueError):
        parse_address(text)
