"""How an update meets a standalone engine's streaming clients (serve.update_policy), in process.

The policies' swap on a tiny HF engine (pointer swap and local copy, with and without flat engine
weights: the weights are the new ones, the parameters keep their identity, a second update lands in the
retired copy), the decoder's hold between tokens, a cut update (torn weights under `pause`, the old
version under `stage`), the staged copy in the memory check, the config rules, and a toy policy
registered from this file alone, run through the engine's update path and read by the config rules,
the memory check and the stall bench's table. The real engine's twins: tests/process/test_serve_pause.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import BF16, FakeReceiver, FakeServer, Tiny, run_main

import rlsync.update.flat as flat
from rlsync.bench.stall import StallTarget, compared, swap_phrase
from rlsync.check.estimate import bench_estimate, staged_copy_bytes
from rlsync.client.messages import SESSION_HEADER, request_body
from rlsync.client.stream import StreamLine, StreamRequest
from rlsync.config.apps import BenchAppConfig, EngineAppConfig
from rlsync.errors import ConfigError
from rlsync.serve.app import Control, Session
from rlsync.serve.policies.base import UPDATE_POLICIES, UpdatePolicy, policy_for, update_policy_class
from rlsync.serve.streams import Decoder, NotHeld, UpdateCut
from rlsync.update import plan_for


def make_policy(name: str, decoder: Decoder, **serve) -> UpdatePolicy:
    """The policy serve.update_policy=`name` makes for a session (the registry's, as the engine's session does)."""
    cfg = EngineAppConfig()
    cfg = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, update_policy=name, max_wait_s=5, **serve))
    return policy_for(cfg, decoder)


# ----------------------------------------------------------------------------------------------
# In process: the policies' swap
# ----------------------------------------------------------------------------------------------


def engine_with(weights: dict) -> object:
    engine = Tiny().spec().build()
    engine.load_weights(weights.items())
    return engine


@pytest.mark.parametrize(
    "policy_name,swap,flat_weights",
    [
        pytest.param("pause", "auto", False, id="pause"),
        pytest.param("pause", "auto", True, id="pause-flat"),
        pytest.param("stage", "auto", False, id="stage-pointer"),
        pytest.param("stage", "auto", True, id="stage-pointer-flat"),
        pytest.param("stage", "copy", False, id="stage-copy"),
        pytest.param("stage", "copy", True, id="stage-copy-flat"),
    ],
)
def test_each_policy_lands_every_update_in_the_live_weights(policy_name, swap, flat_weights):
    tiny = Tiny()
    old, new, newer = (tiny.weights(seed=s) for s in (1, 2, 3))
    engine = engine_with(old)
    params_before = {name: id(p) for name, p in engine.weights.items()}
    decoder = Decoder(engine, max_streams=2)
    policy = make_policy(policy_name, decoder, stage_swap=swap)
    buckets = plan_for(old, dataclasses.replace(tiny.cfg.update, bucket_mb=1.0), BF16)
    receiver = FakeReceiver(buckets, flat_weights=flat_weights)
    server = FakeServer(engine, receiver)
    policy.open(server)
    for version, sent in enumerate((new, newer, new), start=1):
        receiver.next = sent
        policy.update(server, "update")
        live = engine.weights
        for name, tensor in sent.items():
            assert torch.equal(live[name], tensor.to(BF16)), f"{name} is not the update's after update {version}"
        assert {name: id(p) for name, p in live.items()} == params_before  # the parameters themselves stay
        state = decoder.state()
        assert state.version == version
        assert state.last_update.swap == policy.swap
        assert state.last_update.pause_start <= state.last_update.pause_end
    expected = "in-place receive" if policy_name == "pause" else ("pointer swap" if swap == "auto" else "local copy")
    assert policy.swap == expected and state.last_update.policy == policy_name == state.policy
    weight_bytes = sum(t.numel() * 2 for t in old.values())
    assert (
        policy.staged_bytes
        == weight_bytes * type(policy).staged_copies
        == (0 if policy_name == "pause" else weight_bytes)
    )


def test_the_decoder_holds_between_tokens_a_hold_is_bounded_and_a_leaving_client_frees_its_slot(monkeypatch):
    engine = engine_with(Tiny().weights(seed=1))
    decoder = Decoder(engine, max_streams=1)
    with decoder.hold(5) as stopped:  # no stream: at once
        assert stopped <= time.perf_counter()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    produced = []

    def slow_token(stream):  # a token that takes 0.6 s
        time.sleep(0.6)
        produced.append(time.perf_counter())
        return 5, -1.0

    monkeypatch.setattr(decoder, "_next_token", slow_token)
    request = StreamRequest(prompt=[1, 2], max_new_tokens=1000)
    assert decoder.open(request, loop)[0] == 409  # no update yet: NoWeights
    decoder.version = 1
    stream = decoder.open(request, loop)
    assert decoder.open(request, loop) == (503, "Busy: 1 answers are streaming, serve.max_streams=1")
    deadline = time.monotonic() + 5
    while decoder.parked and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # inside a token now
    with pytest.raises(NotHeld, match="within 0.2 s"), decoder.hold(0.2):
        pass
    with decoder.hold(2) as stopped:  # waits for the token in progress to end, then nothing runs
        count = len(produced)
        time.sleep(0.8)
        assert len(produced) == count and produced[-1] <= stopped
    stream.cancel.set()  # its client left
    assert decoder.state().streams == 0  # the slot is free at once
    assert decoder.open(request, loop) is not None
    decoder.stop()
    loop.call_soon_threadsafe(loop.stop)


class CutReceiver(FakeReceiver):
    """A receive whose trainer goes away after `landed` buckets: the rest never arrives."""

    def __init__(self, buckets, *, flat_weights: bool, landed: int):
        super().__init__(buckets, flat_weights=flat_weights)
        self.landed = landed

    def handle(self, engine, request) -> dict:
        for k, bucket in enumerate(self.buckets[: self.landed]):
            if self.flat is not None:
                flat.pack(bucket, self.next, self.flat[k])
            else:
                engine.load_weights((s.meta.name, self.next[s.meta.name]) for s in bucket.slots)
        if self.landed < len(self.buckets):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:4242")
        return {"load_times": [0.0] * len(self.buckets), "peak_extra": 0}


def serving_app(engine, policy: str = "pause"):
    """The standalone engine's app over `engine` (this process, no socket): its Control, and a client."""
    import httpx

    cfg = EngineAppConfig()
    cfg = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, update_policy=policy, max_wait_s=5))
    control = Control(engine, cfg, token=None, log_line=lambda line: None)

    async def ask(method: str, path: str, body: dict | str | None = None, headers=None) -> tuple[int, dict | list]:
        transport = httpx.ASGITransport(app=control.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            sent = {"content": body} if isinstance(body, str) else {"json": body}
            response = await client.request(method, path, headers=headers, **sent)
        lines = [json.loads(ln) for ln in response.text.splitlines() if ln]
        return response.status_code, (lines if len(lines) != 1 else lines[0])

    return control, lambda *a: asyncio.run(ask(*a))


STREAM = {"prompt": [1, 2, 3], "max_new_tokens": 3, "temperature": 0.0, "seed": 0}
LONG = {"prompt": [4, 5], "max_new_tokens": 30_000, "temperature": 0.0, "seed": 0}


@pytest.mark.parametrize("flat_weights", [False, True], ids=["through-load_weights", "in-place-flat"])
def test_a_pause_update_cut_midway_serves_no_torn_weights_until_a_complete_one_lands(flat_weights):
    """N26: under `pause` the update lands in the live weights; cut off midway (its trainer killed), the
    engine serves nothing from them and claims no version until a complete update lands."""
    tiny = Tiny()
    old, new = tiny.weights(seed=1), tiny.weights(seed=2)
    engine = engine_with(old)
    control, ask = serving_app(engine)
    policy = make_policy("pause", control.decoder)
    buckets = plan_for(old, dataclasses.replace(tiny.cfg.update, bucket_mb=0.05), BF16)
    assert len(buckets) > 2
    cut = CutReceiver(buckets, flat_weights=flat_weights, landed=len(buckets))
    server = FakeServer(engine, cut)
    policy.open(server)
    cut.next = old
    policy.update(server, "update")  # version 1: the old weights, whole
    status, before = ask("POST", "/v1/stream", STREAM)
    assert status == 200 and before[-1]["reason"] in ("eos", "length")

    open_answer: list = []  # an answer streaming when the update is cut (its client reads it to the end)
    reader = threading.Thread(target=lambda: open_answer.append(ask("POST", "/v1/stream", LONG)), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not any(s.generated > 1 for s in list(control.decoder.streams)) and time.monotonic() < deadline:
        time.sleep(0.01)  # a few of its tokens are out
    cut.next, cut.landed = new, 2
    with pytest.raises(UpdateCut, match="cut off with .*generation is refused until a complete update lands"):
        policy.update(server, "update")
    assert not all(torch.equal(engine.weights[n], t.to(BF16)) for n, t in old.items())  # cut midway: torn
    tensors = sum(len(b.slots) for b in buckets)
    landed = f"{sum(len(b.slots) for b in buckets[:2])} of {tensors} tensors landed"
    assert (f"part of its {tensors} tensors landed" if flat_weights else landed) in control.decoder.torn

    status, state = ask("GET", "/v1/serving")
    assert status == 200 and state["version"] is None and state["torn"].startswith("Torn: the last update was cut")
    status, refused = ask("POST", "/v1/stream", STREAM)
    assert status == 503 and refused["error"] == state["torn"] and "waiting for a complete update" in refused["error"]
    control.session = Session(1, "127.0.0.1:1", server=server)  # a trainer's session: its generate is refused alike
    generate = request_body("generate", ([[1, 2]], 2, 1.0, torch.Generator().get_state(), "cpu")).model_dump_json()
    status, refused = ask("POST", "/v1/generate", generate, {SESSION_HEADER: control.session.key})
    assert status == 409 and refused["error"] == state["torn"]
    control.session = None
    reader.join(60)
    status, lines = open_answer[0]
    end = StreamLine.model_validate(lines[-1])  # the answer open at the cut ends with why, as its client reads it
    assert status == 200 and end.reason == "error" and end.error == state["torn"] and end.version is None
    assert {ln["version"] for ln in lines[:-1]} == {1}  # every token before it from the old weights, none after

    cut.landed = len(buckets)  # a complete update: service again, as the next version
    policy.update(server, "update")
    for name, tensor in new.items():
        assert torch.equal(engine.weights[name], tensor.to(BF16))
    status, state = ask("GET", "/v1/serving")
    assert state["version"] == 2 and state.get("torn") is None
    status, after = ask("POST", "/v1/stream", STREAM)
    assert status == 200 and {ln["version"] for ln in after} == {2}
    control.decoder.stop()


@pytest.mark.parametrize("name", ["pause", "stage"], ids=["pause-before-any", "stage"])
def test_an_update_cut_that_left_the_live_weights_whole_serves_the_old_version_on(name):
    """Under `pause` cut before any tensor landed, and under `stage` wherever (only the side copy was
    written, N27): the old weights serve on, under their own version."""
    tiny = Tiny()
    old, new = tiny.weights(seed=1), tiny.weights(seed=2)
    engine = engine_with(old)
    control, ask = serving_app(engine, name)
    policy = make_policy(name, control.decoder)
    buckets = plan_for(old, dataclasses.replace(tiny.cfg.update, bucket_mb=0.05), BF16)
    cut = CutReceiver(buckets, flat_weights=False, landed=len(buckets))
    server = FakeServer(engine, cut)
    policy.open(server)
    cut.next = old
    policy.update(server, "update")  # version 1: the old weights
    cut.next, cut.landed = new, (0 if name == "pause" else 2)
    with pytest.raises(UpdateCut, match="version 1 serves on"):
        policy.update(server, "update")
    for name, tensor in old.items():
        assert torch.equal(engine.weights[name], tensor.to(BF16))
    status, state = ask("GET", "/v1/serving")
    assert state["version"] == 1 and state.get("torn") is None
    status, lines = ask("POST", "/v1/stream", STREAM)
    assert status == 200 and {ln["version"] for ln in lines} == {1}
    control.decoder.stop()


@pytest.mark.parametrize("prompt", [[1, 512], [10**9], [2**70], [-5]], ids=["vocab-size", "1e9", "2^70", "negative"])
def test_a_stream_with_a_token_id_outside_the_vocabulary_is_refused_up_front(prompt, capfd):
    """N02: 422 before the answer starts (not 200 then an IndexError end line), naming the field and the range."""
    engine = engine_with(Tiny().weights(seed=1))
    control, ask = serving_app(engine)
    control.decoder.version = 1
    status, refused = ask("POST", "/v1/stream", {**STREAM, "prompt": prompt})
    bad = len(prompt) - 1
    assert status == 422, refused
    assert refused["error"] == (
        f"BadRequest: malformed 'stream' request: prompt[{bad}]: token id {prompt[bad]} is outside the vocabulary: "
        "0 to 511 (this engine's model.vocab_size=512)"
    )
    assert control.decoder.state().served == 0  # no answer was started
    assert f"prompt[{bad}]: token id {prompt[bad]} is outside the vocabulary" in capfd.readouterr().err  # its drop line
    control.decoder.stop()


def test_the_memory_check_counts_the_staged_copy():
    cfg = BenchAppConfig()
    weights = sum(t.numel() * 2 for t in Tiny().weights().values())  # bf16, the rollout dtype
    assert staged_copy_bytes(cfg, "stage") == weights
    assert staged_copy_bytes(cfg, "pause") == 0
    serve = EngineAppConfig()
    assert staged_copy_bytes(serve) == 0
    staged = dataclasses.replace(serve, serve=dataclasses.replace(serve.serve, update_policy="stage"))
    assert staged_copy_bytes(staged) == weights
    stall_bench = dataclasses.replace(cfg, bench=dataclasses.replace(cfg.bench, target="stall"))
    est = bench_estimate(stall_bench, cuda=False, runtime_bytes=1 << 20).as_dict()
    assert est["engine_process"]["stage_staged_copy"] == weights
    assert "pause_staged_copy" not in est["engine_process"]
    only_pause = dataclasses.replace(stall_bench, bench=dataclasses.replace(stall_bench.bench, policies=["pause"]))
    assert "stage_staged_copy" not in bench_estimate(only_pause, cuda=False, runtime_bytes=1 << 20).engine_process


@pytest.mark.parametrize(
    "module,override,line",
    [
        ("rlsync.serve", "serve.update_policy=swap", "serve.update_policy=swap"),
        ("rlsync.serve", "serve.stage_swap=pointer", "serve.stage_swap=pointer"),
        ("rlsync.serve", "serve.max_streams=0", "serve.max_streams=0"),
        ("rlsync.bench", "bench.policies=[pause,pause]", "bench.policies"),
        ("rlsync.bench", "bench.target=pause", "bench.target=pause: renamed to bench.target=stall (allowed: "),
        ("rlsync.bench", "bench.clients=0", "bench.clients=0"),
    ],
)
def test_a_wrong_serve_or_stall_key_is_one_config_error_line(module, override, line, tmp_path):
    done = run_main(override, f"hydra.run.dir={tmp_path}", module=module)
    assert done.returncode == 2
    errors = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and "config error" in errors[0] and line in errors[0], done.stderr


# ----------------------------------------------------------------------------------------------
# A policy registered from this file alone: the engine's update path, the config rules, what it declares
# ----------------------------------------------------------------------------------------------


class CountingPolicy(UpdatePolicy):
    """A test's toy: holds generation for the receive (through the engine's load_weights) and counts updates;
    declares two staged copies, no baseline, no fresh answers after its swap, and a rule of its own."""

    title = "a test's toy: holds generation for the receive and counts its updates"
    staged_copies = 2
    fresh_after_swap = False

    @classmethod
    def swap_phrase(cls, pointer):
        return "counted receive"

    @classmethod
    def check_config(cls, serve, root) -> None:
        if serve.max_streams > 2:
            raise ConfigError(
                "serve.max_streams", serve.max_streams, "at most 2", "not allowed with serve.update_policy=counting"
            )

    def __init__(self, decoder, serve, *, name: str):
        super().__init__(decoder, serve, name=name)
        self.updates = 0

    def update(self, server, request) -> dict:
        with self.hold() as stopped:
            r0, cpu = self.started()
            result = server.update(request)
            done = time.perf_counter()
            self.swapped((r0, done), (stopped, done), cpu.done())
        self.updates += 1
        return result


@pytest.fixture
def counting():
    """serve.update_policy=counting for one test: registered here, as a plugin would (gone afterwards)."""
    from rlsync.serve.policies.base import register_update_policy

    register_update_policy("counting", CountingPolicy)
    yield CountingPolicy
    UPDATE_POLICIES.pop("counting")


def test_a_policy_registered_here_takes_updates_through_the_engines_update_path(counting):
    tiny = Tiny()
    old, new = tiny.weights(seed=1), tiny.weights(seed=2)
    engine = engine_with(old)
    control, ask = serving_app(engine, "counting")
    receiver = FakeReceiver(
        plan_for(old, dataclasses.replace(tiny.cfg.update, bucket_mb=1.0), BF16), flat_weights=False
    )
    session = control.session = Session(1, "127.0.0.1:1", server=FakeServer(engine, receiver))
    session.policy = policy_for(control.cfg, control.decoder)  # as the session's admission makes it
    headers = {SESSION_HEADER: session.key}
    status, opened = ask("POST", "/v1/open", "{}", headers)
    assert status == 200 and opened["op"] == "open", opened
    for version, sent in enumerate((new, old, new), start=1):
        receiver.next = sent
        status, reply = ask("POST", "/v1/update", "{}", headers)  # the trainer's update: Control -> the policy
        assert status == 200 and reply["op"] == "update", reply
        assert all(torch.equal(engine.weights[n], t.to(BF16)) for n, t in sent.items())
        status, state = ask("GET", "/v1/serving")
        assert (state["policy"], state["version"]) == ("counting", version)
        assert (state["last_update"]["policy"], state["last_update"]["swap"]) == ("counting", "counted receive")
        status, lines = ask("POST", "/v1/stream", STREAM)
        assert status == 200 and {ln["version"] for ln in lines} == {version}
    assert isinstance(session.policy, CountingPolicy) and session.policy.updates == 3
    control.decoder.stop()


def test_the_config_offers_the_registrys_policies_and_asks_each_its_own_rules(counting, tmp_path):
    def line(*overrides: str, module: str) -> str:
        done = run_main(*overrides, f"hydra.run.dir={tmp_path / str(len(list(tmp_path.iterdir())))}", module=module)
        errors = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert done.returncode == 2 and len(errors) == 1, done.stderr
        return errors[0]

    assert line("serve.update_policy=swap", module="rlsync.serve").endswith("(allowed: pause, stage, counting)")
    own = "serve.max_streams=4: not allowed with serve.update_policy=counting (allowed: at most 2)"
    assert own in line("serve.update_policy=counting", "serve.max_streams=4", module="rlsync.serve")
    assert "bench.policies=[pause,swap]" in line(
        "bench.target=stall", "bench.policies=[pause,swap]", module="rlsync.bench"
    )
    bench = ("bench.target=stall", "bench.policies=[pause,counting]", 'bench.engine_overrides=["serve.max_streams=4"]')
    assert own in line(*bench, module="rlsync.bench")  # each engine's policy, asked before any engine starts


def test_the_memory_check_and_the_stall_table_read_what_a_policy_declares(counting):
    cfg = EngineAppConfig()
    weights = sum(t.numel() * 2 for t in Tiny().weights().values())  # bf16, the rollout dtype
    assert staged_copy_bytes(
        dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, update_policy="counting"))
    ) == (2 * weights)
    assert compared(["counting", "pause"]) == ("counting", "pause") and compared(["counting", "stage"]) is None
    assert swap_phrase("counting", None) == "counted receive" and swap_phrase("gone", 1.0) == "n/a"
    spread = {"median": 0.5, "min": 0.4, "max": 0.6}
    metrics = {
        **{f"pause/{p}/{k}": spread for p in ("counting", "pause") for k in ("max_gap_time", "pause_time")},
        "pause/gap_ratio": {"median": 1.0, "min": 0.9, "max": 1.1},
        "pause/pause/answers_verified_total": {"max": 4},
    }
    result = {"metrics": metrics, "model": {"name": "tiny"}, "measured_steps": 3, "warmup_steps": 0}
    table = StallTarget.table(result)
    rows = [ln.split(" | ")[:2] for ln in table.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert rows == [["| pause", "in-place receive"], ["| counting", "counted receive"]], table  # registry order
    assert "counting / pause, longest gap: 1.00" in table
    assert "Not verified for counting (it does not declare every answer after its swap" in table
    assert update_policy_class("counting") is CountingPolicy


def test_docs_list_each_registered_policy_as_it_declares_itself():
    docs = (Path(__file__).parents[2] / "docs" / "serve.md").read_text()
    for name in UPDATE_POLICIES.names():
        assert f"- `{name}`: {update_policy_class(name).title}" in " ".join(docs.split()), name
