"""The pause a streaming client sees while a standalone engine takes an update (serve.update_policy).

In-process (fast): the policies' swap on a tiny HF engine (pointer swap and local copy, with and
without flat engine weights: the weights are the new ones, the parameters keep their identity, a
second update lands in the retired copy), the decoder's pause between tokens, the staged copy in the
memory check, and the config rules. With real processes (slow): a `python -m rlsync.serve` engine
streaming to 2 clients takes an update under each policy; no request fails or hangs, and every answer
started after the swap scores as the new weights' (teacher-forced log-probs in this process); a client
that leaves mid-answer frees its slot; a stream before any update is refused in one line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import ROOT, Tiny, cli_env, run_main
from test_standalone_engine import StandaloneEngine, remote_update
from test_transports import Trainer

import rlsync.update.flat as flat
from rlsync.check.estimate import bench_estimate, staged_copy_bytes
from rlsync.config.apps import BenchAppConfig, EngineAppConfig
from rlsync.engines.base import token_logprobs
from rlsync.serve.app import Control, Session
from rlsync.serve.streams import Decoder, NotPaused, PausePolicy, StagePolicy, UpdateCut
from rlsync.update import plan_for
from rlsync.update.messages import SESSION_HEADER, request_body
from rlsync.update.remote import parse_address
from rlsync.update.stream import StreamFailed, StreamLine, StreamRequest, serving_state, stream_answer

BF16 = torch.bfloat16
LOGPROB_TOL = 0.05  # as rlsync/bench/pause.py checks: streamed against teacher-forced, same weights


# ----------------------------------------------------------------------------------------------
# In process: the policies' swap
# ----------------------------------------------------------------------------------------------


class FakeReceiver:
    """BroadcastReceiver's engine-side behaviour without a group: `handle` lands `self.next` (the new
    weights) bucket by bucket, into its flat buffers (flat weights) or through the engine's load_weights."""

    def __init__(self, buckets, *, flat_weights: bool):
        self.buckets, self.flat_weights = buckets, flat_weights
        self.flat = None
        self.next: dict[str, torch.Tensor] = {}

    def open(self, engine) -> dict:
        if self.flat_weights:
            self.flat = flat.allocate(self.buckets, engine.device)
            flat.bind(engine.weights, self.buckets, self.flat)
        return {"staging_bytes": 0}

    def handle(self, engine, request) -> dict:
        for k, bucket in enumerate(self.buckets):
            if self.flat is not None:
                flat.pack(bucket, self.next, self.flat[k])
            else:
                engine.load_weights((s.meta.name, self.next[s.meta.name]) for s in bucket.slots)
        return {"load_times": [0.0] * len(self.buckets), "peak_extra": 0}


class FakeServer:
    """EngineServer's open and update over a FakeReceiver."""

    def __init__(self, engine, receiver):
        self.engine, self.receiver = engine, receiver

    def open(self):
        return self.receiver.open(self.engine)

    def update(self, request):
        return self.receiver.handle(self.engine, request)


def engine_with(weights: dict) -> object:
    engine = Tiny().spec().build()
    engine.load_weights(weights.items())
    return engine


@pytest.mark.parametrize(
    "policy_cls,swap,flat_weights",
    [
        pytest.param(PausePolicy, "auto", False, id="pause"),
        pytest.param(PausePolicy, "auto", True, id="pause-flat"),
        pytest.param(StagePolicy, "auto", False, id="stage-pointer"),
        pytest.param(StagePolicy, "auto", True, id="stage-pointer-flat"),
        pytest.param(StagePolicy, "copy", False, id="stage-copy"),
        pytest.param(StagePolicy, "copy", True, id="stage-copy-flat"),
    ],
)
def test_each_policy_lands_every_update_in_the_live_weights(policy_cls, swap, flat_weights):
    tiny = Tiny()
    old, new, newer = (tiny.weights(seed=s) for s in (1, 2, 3))
    engine = engine_with(old)
    params_before = {name: id(p) for name, p in engine.weights.items()}
    decoder = Decoder(engine, max_streams=2)
    policy = policy_cls(decoder, wait_s=5, stage_swap=swap)
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
    expected = "paused receive" if policy_cls is PausePolicy else ("pointer swap" if swap == "auto" else "local copy")
    assert policy.swap == expected
    weight_bytes = sum(t.numel() * 2 for t in old.values())
    assert policy.staged_bytes == (0 if policy_cls is PausePolicy else weight_bytes)


def test_the_decoder_pauses_between_tokens_a_pause_is_bounded_and_a_leaving_client_frees_its_slot(monkeypatch):
    engine = engine_with(Tiny().weights(seed=1))
    decoder = Decoder(engine, max_streams=1)
    with decoder.paused(5) as stopped:  # no stream: at once
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
    with pytest.raises(NotPaused, match="within 0.2 s"):
        with decoder.paused(0.2):
            pass
    with decoder.paused(2) as stopped:  # waits for the token in progress to end, then nothing runs
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
    policy = PausePolicy(control.decoder, wait_s=5)
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


@pytest.mark.parametrize("policy_cls", [PausePolicy, StagePolicy], ids=["pause-before-any", "stage"])
def test_an_update_cut_that_left_the_live_weights_whole_serves_the_old_version_on(policy_cls):
    """Under `pause` cut before any tensor landed, and under `stage` wherever (only the side copy was
    written, N27): the old weights serve on, under their own version."""
    tiny = Tiny()
    old, new = tiny.weights(seed=1), tiny.weights(seed=2)
    engine = engine_with(old)
    control, ask = serving_app(engine, policy_cls.name)
    policy = policy_cls(control.decoder, wait_s=5)
    buckets = plan_for(old, dataclasses.replace(tiny.cfg.update, bucket_mb=0.05), BF16)
    cut = CutReceiver(buckets, flat_weights=False, landed=len(buckets))
    server = FakeServer(engine, cut)
    policy.open(server)
    cut.next = old
    policy.update(server, "update")  # version 1: the old weights
    cut.next, cut.landed = new, (0 if policy_cls is PausePolicy else 2)
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
    pause_bench = dataclasses.replace(cfg, bench=dataclasses.replace(cfg.bench, target="pause"))
    est = bench_estimate(pause_bench, cuda=False, runtime_bytes=1 << 20).as_dict()
    assert est["engine_process"]["stage_staged_copy"] == weights
    assert "pause_staged_copy" not in est["engine_process"]
    only_pause = dataclasses.replace(pause_bench, bench=dataclasses.replace(pause_bench.bench, policies=["pause"]))
    assert "stage_staged_copy" not in bench_estimate(only_pause, cuda=False, runtime_bytes=1 << 20).engine_process


@pytest.mark.parametrize(
    "module,override,line",
    [
        ("rlsync.serve", "serve.update_policy=swap", "serve.update_policy=swap"),
        ("rlsync.serve", "serve.stage_swap=pointer", "serve.stage_swap=pointer"),
        ("rlsync.serve", "serve.max_streams=0", "serve.max_streams=0"),
        ("rlsync.bench", "bench.policies=[pause,pause]", "bench.policies"),
        ("rlsync.bench", "bench.clients=0", "bench.clients=0"),
    ],
)
def test_a_wrong_pause_key_is_one_config_error_line(module, override, line, tmp_path):
    done = run_main(override, f"hydra.run.dir={tmp_path}", module=module)
    assert done.returncode == 2
    errors = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and "config error" in errors[0] and line in errors[0], done.stderr


# ----------------------------------------------------------------------------------------------
# Real processes: an engine streaming to clients takes updates
# ----------------------------------------------------------------------------------------------


def stream_lines(address: str, prompt: list[int], *, tokens: int, seed: int) -> tuple[float, list]:
    stamps: list[float] = []
    request = StreamRequest(prompt=prompt, max_new_tokens=tokens, temperature=1.0, seed=seed)
    lines = [line for _, line in stream_answer(address, request, timeout_s=60, stamps=stamps)]
    return stamps[0], lines


@torch.no_grad()
def teacher_forced(engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    logits = engine.model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor(tokens), allowed=engine.allowed, temperature=1.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,flat_weights",
    [
        pytest.param(["serve.update_policy=pause"], True, id="pause"),
        pytest.param(["serve.update_policy=stage"], True, id="stage-pointer-flat"),
        pytest.param(["serve.update_policy=stage", "serve.stage_swap=copy"], False, id="stage-copy"),
    ],
)
def test_an_engine_under_load_takes_an_update_and_answers_after_it_come_from_the_new_weights(
    tmp_path, overrides, flat_weights
):
    server = StandaloneEngine(tmp_path, "serve.max_wait_s=20", *overrides)
    trainer = Trainer(seed=3)
    old = {n: t.detach().clone() for n, t in trainer.weights.items()}
    engine, _ = trainer.open(remote_update(server.address, flat_engine_weights=flat_weights, verify=False))
    answers: list[tuple[float, list[int], list]] = []  # (sent, prompt, lines) per answer
    failures: list[str] = []
    stop = threading.Event()

    def client(i: int) -> None:
        k = 0
        while not stop.is_set():
            k += 1
            prompt = [3 + i, 5, 7, 9 + k % 50]
            try:
                sent, lines = stream_lines(server.address, prompt, tokens=12, seed=100 * i + k)
                answers.append((sent, prompt, lines))
            except StreamFailed as err:
                failures.append(str(err))

    try:
        engine.update_weights(trainer.weights)  # the first update fills the engine: version 1
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        new = Tiny().weights(seed=7)  # another model: every weight changed
        engine.update_weights(new)  # under load
        swap = serving_state(server.address, timeout_s=10).last_update
        time.sleep(1.0)
        stop.set()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads), "a client hung"
    finally:
        engine.close()
        server.stop()
    assert not failures, failures  # no request failed during the update
    assert all(lines[-1].kind == "end" and lines[-1].reason in ("eos", "length") for _, _, lines in answers)
    assert swap.version == 2 and swap.pause_end - swap.pause_start < 5
    after = [(prompt, lines) for sent, prompt, lines in answers if sent > swap.pause_end]
    before = [(prompt, lines) for sent, prompt, lines in answers if lines[-1].t < swap.pause_start]
    assert after and before, (len(answers), swap)
    local = Tiny().spec().build()
    for weights, other, version, group in ((new, old, 2, after), (old, new, 1, before)):
        for prompt, lines in group:  # each answer is its weights' own: its version, and its log-probs
            tokens = [ln for ln in lines if ln.kind == "token"]
            assert {ln.version for ln in tokens} == {version}
            ids, streamed = [ln.token for ln in tokens], torch.tensor([ln.logprob for ln in tokens])
            local.load_weights(weights.items())
            to_own = float((streamed - teacher_forced(local, prompt, ids)).abs().max())
            local.load_weights(other.items())
            to_other = float((streamed - teacher_forced(local, prompt, ids)).abs().max())
            assert to_own < LOGPROB_TOL < to_other, (version, to_own, to_other)


@pytest.mark.slow
def test_a_client_that_leaves_mid_answer_frees_its_slot(tmp_path):
    server = StandaloneEngine(tmp_path, "serve.max_streams=1", "serve.update_policy=stage")
    host, port = parse_address(server.address)
    try:
        with pytest.raises(StreamFailed, match="409.*NoWeights"):  # before any update: refused in one line
            stream_lines(server.address, [1, 2, 3], tokens=4, seed=0)
        trainer = Trainer()
        engine, _ = trainer.open(remote_update(server.address, verify=False))
        try:
            engine.update_weights(trainer.weights)
            conn = http.client.HTTPConnection(host, port, timeout=30)
            body = StreamRequest(prompt=[1, 2, 3], max_new_tokens=4000, seed=1).model_dump_json()
            conn.request("POST", "/v1/stream", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200
            assert json.loads(response.readline())["kind"] == "token"
            with pytest.raises(StreamFailed, match="503.*Busy"):  # the one slot is taken
                stream_lines(server.address, [4, 5, 6], tokens=4, seed=2)
            conn.sock.shutdown(2)
            conn.close()  # the client leaves mid-answer
            deadline = time.monotonic() + 10
            while serving_state(server.address, timeout_s=5).streams and time.monotonic() < deadline:
                time.sleep(0.05)
            assert serving_state(server.address, timeout_s=5).streams == 0
            _, lines = stream_lines(server.address, [4, 5, 6], tokens=4, seed=2)  # the slot is free again
            assert lines[-1].reason in ("eos", "length")
        finally:
            engine.close()
    finally:
        done = server.stop()
    assert done.returncode in (0, 143)


CUT_TRAINER = """
import sys, time
sys.path.insert(0, "tests")
from conftest import Tiny
from test_standalone_engine import Trainer, remote_update
trainer = Trainer()
engine, _ = trainer.open(remote_update(sys.argv[1], strategy="per_tensor", verify=False))
engine.update_weights(trainer.weights)
print("updated", flush=True)
sys.stdin.readline()  # the test's answer from these weights is in: the next update may start


class Stalls:  # the group: its first tensors go, then the trainer stalls (until it is killed)
    def __init__(self, group):
        self.group, self.sent = group, 0

    def __getattr__(self, name):
        return getattr(self.group, name)

    def broadcast(self, *args, **kwargs):
        if self.sent == 5:
            print("cut", flush=True)
            time.sleep(600)
        self.sent += 1
        return self.group.broadcast(*args, **kwargs)


engine.group = Stalls(engine.group)
engine.update_weights(Tiny().weights(seed=7))
"""


@pytest.mark.slow
def test_a_trainer_killed_mid_update_leaves_a_pause_engine_refusing_until_a_complete_update(tmp_path):
    """N26: serve.update_policy=pause, the trainer SIGKILLed after a few of its update's tensors landed in
    the live weights: the engine says so, reports no version, refuses answers (503 Torn) instead of serving
    torn weights; the next trainer's complete update brings the same greedy answer back as the next version."""
    server = StandaloneEngine(tmp_path, "serve.update_policy=pause", "serve.max_wait_s=20")
    greedy = StreamRequest(prompt=[3, 5, 7, 9], max_new_tokens=8, temperature=0.0)
    killed = subprocess.Popen(
        [sys.executable, "-c", CUT_TRAINER, server.address],
        cwd=ROOT,
        env=cli_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert killed.stdout.readline().strip() == "updated"
        before = list(stream_answer(server.address, greedy, timeout_s=60))
        assert before[-1][1].reason == "length"
        killed.stdin.write("go\n")
        killed.stdin.flush()
        assert killed.stdout.readline().strip() == "cut"
    finally:
        killed.kill()
        killed.wait()
    try:
        line = server.wait_for("the update was cut off with", timeout=60)
        landed, total = map(int, re.search(r"with (\d+) of (\d+) tensors landed", line).groups())
        assert 0 < landed < total and "generation is refused until a complete update lands" in line
        state = serving_state(server.address, timeout_s=10)
        assert state.version is None and state.torn.startswith(f"Torn: the last update was cut off with {landed} of")
        with pytest.raises(StreamFailed, match="503.*Torn: .*waiting for a complete update"):
            list(stream_answer(server.address, greedy, timeout_s=60))
        trainer = Trainer()  # the killed trainer's first weights (its seed): a complete update of them
        engine, _ = trainer.open(remote_update(server.address, verify=True))
        try:
            engine.update_weights(trainer.weights)
        finally:
            engine.close()
        state = serving_state(server.address, timeout_s=10)
        assert state.version == 2 and state.torn is None
        after = list(stream_answer(server.address, greedy, timeout_s=60))
        assert [ln.token for _, ln in after] == [ln.token for _, ln in before]  # the same weights' greedy answer
        assert {ln.version for _, ln in before} == {1} and {ln.version for _, ln in after} == {2}
    finally:
        server.stop()
