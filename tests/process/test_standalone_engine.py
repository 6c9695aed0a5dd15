"""The broadcast transport across machines: `python -m rlsync.serve` started on its own, joined over HTTP.

Everything on localhost, with real processes: the engine is a `python -m rlsync.serve` subprocess
listening on a free port; the trainer side is this test process (or a `python -m rlsync`
subprocess) joining it with `update.engine_address`. Bit-exact engine weights after updates for
each strategy, generation equal to an in-process engine's, a refused plan for another model, a
second trainer refused while one is served, /health answering while the engine works, a killed
trainer's session ended, a dead engine failing in seconds, the whole run through the CLI, and
SIGTERM. Then the hostile cases: garbage, oversized heads and bodies, a probe that connects and
closes, an idle or stalled client (each dropped with one line, the engine serving on), a trainer
pointed at a listener that never answers, pickles that must never run with a token required, and a
local group's store listening on loopback only. What ends before any server listens is
tests/unit/test_standalone_engine.py's.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    BF16,
    CPU,
    FAST,
    ROOT,
    SMALL_BUCKET_MB,
    StandaloneEngine,
    Tiny,
    Trainer,
    assert_engine_holds,
    cli_env,
    read_jsonl,
    remote_update,
    run_main,
)

from rlsync.client.client import TOKEN_ENV, EngineUnreachable, parse_address
from rlsync.config.schema import ModelConfig, UpdateConfig
from rlsync.engines.process import EngineDied, EngineFailed
from rlsync.update import close_update, plan_for, timed_update

REQUEST_TIMEOUT = "serve.request_timeout_s=1"  # idle and stalled clients are dropped after 1 s, not 10
MAX_REQUEST = "serve.max_request_mb=1"  # an oversized body is sent in a moment
MAX_WAIT_S = 8  # the engine's own cap on a trainer's waits (serve.max_wait_s; 120 s by default)
SESSION_TIMEOUT_S = 6  # a silent session ends after this (serve.session_timeout_s; trainers heartbeat every second)
BOUNDS = [f"serve.max_wait_s={MAX_WAIT_S}", f"serve.session_timeout_s={SESSION_TIMEOUT_S}"]


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    server = StandaloneEngine(tmp_path_factory.mktemp("engine"), REQUEST_TIMEOUT, MAX_REQUEST, *BOUNDS)
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


def one_update_lands(trainer: Trainer, update: UpdateConfig) -> None:
    """A session of its own: open, one update, the engine holds the trainer's weights bit for bit, close."""
    engine, transport, _ = trainer.open(update)
    try:
        transport.update_weights(trainer.weights)
        assert_engine_holds(engine, trainer.weights)
    finally:
        close_update(engine, transport)


@pytest.mark.parametrize(
    "strategy,inflight,flat",
    [
        pytest.param("bucketed", 1, False, id="bucketed"),
        pytest.param("per_tensor", 2, False, id="per_tensor-inflight2"),
        pytest.param("bucketed", 2, True, id="bucketed-flat-inflight2"),
    ],
)
def test_standalone_engine_receives_bit_exact_updates(engine_server, strategy, inflight, flat):
    trainer = Trainer()
    update = remote_update(
        engine_server.address, strategy=strategy, inflight_buckets=inflight, flat_engine_weights=flat
    )
    engine, transport, buckets = trainer.open(update)
    try:
        assert engine.pid is None  # no process of ours: the engine was started on its own
        assert_listens_on_loopback_only(
            os.getpid()
        )  # the group's store and gloo device: 127.0.0.1, where the engine is
        for source in ("device", "host", "device"):
            sent = trainer.source(source)
            metrics = timed_update(transport, sent, buckets=buckets, cfg=update, device=CPU, floor_time=1e-3)
            assert_engine_holds(engine, sent)  # every tensor, bit for bit (verify=True checked the checksums too)
            assert metrics["perf/update_weights_bytes"] == sum(b.nbytes for b in buckets)
            rows = transport.last_update_buckets
            assert len(rows) == (len(buckets) if strategy == "bucketed" else len(trainer.weights))
    finally:
        close_update(engine, transport)
    assert engine_server.proc.poll() is None  # the session ended, the engine serves on


def test_generation_over_http_equals_an_engine_in_this_process(engine_server):
    """The sampler's state travels to the engine and back, so the same weights and seed give the same answers."""
    trainer = Trainer(seed=5)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    answers = []
    for update in (remote_update(engine_server.address), UpdateConfig(transport="direct")):
        engine, transport, _ = trainer.open(update)
        try:
            transport.update_weights(trainer.weights)
            generator = torch.Generator().manual_seed(11)
            gen = engine.generate(prompts, max_new_tokens=6, temperature=1.0, generator=generator)
            answers.append((gen, generator.get_state()))
        finally:
            close_update(engine, transport)
    (remote, remote_state), (local, local_state) = answers
    assert torch.equal(remote.sequences, local.sequences)
    assert torch.equal(remote.logprobs, local.logprobs)
    assert torch.equal(remote_state, local_state)


def test_engine_refuses_a_plan_for_another_model(engine_server):
    trainer = Trainer()
    other = ModelConfig(hidden_size=128, intermediate_size=256)  # the tiny model, narrower

    weights = Tiny().weights(model=other, seed=0)
    update = remote_update(engine_server.address)
    with pytest.raises(EngineFailed) as caught:
        Tiny().open(update, weights, spec=trainer.spec)
    first = str(caught.value).splitlines()[0]
    assert f"the engine at {engine_server.address} failed during 'start': PlanMismatch:" in first
    assert "(512, 128)" in first and "(512, 256)" in first and "model" in first  # which tensor, both shapes, the fix
    engine_server.wait_for("refused: tensor")
    assert engine_server.proc.poll() is None


def test_runner_joins_a_standalone_engine_and_matches_a_local_one(engine_server, tmp_path):
    """The runner (its entry point, in this process) against the engine over HTTP: verified updates, and the
    same run as with an engine process started by the trainer (same seed: same answers, rewards and losses)."""
    common = [*FAST, "update.transport=broadcast", "update.verify=true", "wandb.mode=disabled"]
    remote = run_main(*common, f"update.engine_address={engine_server.address}", f"hydra.run.dir={tmp_path / 'remote'}")
    assert remote.returncode == 0, remote.stderr
    local = run_main(*common, f"hydra.run.dir={tmp_path / 'local'}")
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
from conftest import Trainer, remote_update
trainer = Trainer()
update = remote_update(sys.argv[1])
engine, transport, _ = trainer.open(update)
transport.update_weights(trainer.weights)
print("updated", flush=True)
time.sleep(600)
"""


def test_a_trainer_killed_mid_session_leaves_the_engine_serving(engine_server):
    """SIGKILL, so the trainer never closes its session: the engine notices and takes the next one."""
    killed = subprocess.Popen(
        [sys.executable, "-c", KILLED_TRAINER, engine_server.address],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
    first, first_transport, _ = trainer.open(update)
    try:
        assert health(engine_server.address)["busy"] is True
        start = time.monotonic()
        with pytest.raises(EngineFailed) as caught:
            trainer.open(update)
        assert time.monotonic() - start < 10
        line = str(caught.value).splitlines()[0]
        assert "EngineBusy: this engine is serving trainer 127.0.0.1:" in line and "one trainer at a time" in line
        first_transport.update_weights(trainer.weights)  # the session being served is untouched
        assert_engine_holds(first, trainer.weights)
    finally:
        close_update(first, first_transport)
    close_update(*trainer.open(update)[:2])  # free again once the first has left
    engine_server.wait_for("busy with trainer")


def test_health_answers_while_the_engine_works(engine_server):
    """The engine waits inside an update for the trainer's first broadcast (its work thread blocked
    in gloo), and /health still answers, naming that work; then the update lands bit for bit."""
    trainer = Trainer(seed=4)
    engine, transport, _ = trainer.open(remote_update(engine_server.address))
    seen = []
    send = engine.send

    def send_then_ask(op, *args):
        sent = send(op, *args)
        if op == "update":  # the broadcasts start only when this returns: the engine cannot be done
            seen.append(health(engine_server.address, until=lambda h: h["op"] == "update"))
        return sent

    engine.send = send_then_ask
    try:
        transport.update_weights(trainer.weights)
        assert_engine_holds(engine, trainer.weights)
    finally:
        close_update(engine, transport)
    assert seen == [{"status": "ok", "model": "tiny", "busy": True, "op": "update"}]


HOSTILE = [  # (what the client sends, how its line on the engine's stderr reads)
    pytest.param(b"\x16\x03\x01\x02\x00garbage\x00\xff\r\n\r\n", "is not an HTTP request", id="garbage"),
    pytest.param(
        b"GET /health HTTP/1.1\r\nHost: e\r\nX-Big: " + b"a" * 100_000,  # a head that never ends
        "is not an HTTP request (or a header over the size limit)",
        id="oversized-header",
    ),
    pytest.param(  # a whole 100 KB head: h11 bounds only a head that arrives in pieces, so it would be answered
        b"GET /health HTTP/1.1\r\nHost: e\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        "sent a request head of|(or a header over the size limit)",  # whole in one read, or in pieces
        id="oversized-whole-header",
    ),
    pytest.param(
        b"POST /v1/session HTTP/1.1\r\nHost: e\r\nContent-Length: 1099511627776\r\n\r\n",
        "announced a body of 1099511627776 bytes",
        id="oversized-length-header",
    ),
    pytest.param(
        b"POST /v1/session HTTP/1.1\r\nHost: e\r\nTransfer-Encoding: chunked\r\n\r\n"
        + (b"10000\r\n" + b"x" * 0x10000 + b"\r\n") * 17,
        "sent a body over the limit of 1048576 bytes",
        id="oversized-body",
    ),
    pytest.param(b"", "closed the connection without sending a request", id="connect-and-close"),
    pytest.param(None, "sent no complete request within serve.request_timeout_s=1 s", id="idle"),
    pytest.param(
        b'POST /v1/session HTTP/1.1\r\nHost: e\r\nContent-Length: 100\r\n\r\n{"bu',
        "did not send its request body within serve.request_timeout_s=1 s",
        id="stalled-body",
    ),
    pytest.param(
        b'POST /v1/session HTTP/1.1\r\nHost: e\r\nContent-Length: 20\r\n\r\n{"buckets": "all"}  ',
        "sent a malformed 'session' request",
        id="untyped-plan",
    ),
]


@pytest.mark.parametrize("sent,line", HOSTILE)
def test_a_bad_client_is_dropped_with_one_line_and_the_engine_serves_on(engine_server, sent, line):
    port = hostile_client(engine_server.address, sent)
    engine_server.wait_for(f"client 127.0.0.1:{port}: ", timeout=30, stderr=True)
    about_it = [ln for ln in engine_server.errors if f"client 127.0.0.1:{port}:" in ln]
    assert len(about_it) == 1 and any(text in about_it[0] for text in line.split("|")), engine_server.errors
    one_update_lands(Trainer(seed=6), remote_update(engine_server.address))


class RawSession:
    """A client that opens a session by hand, sends no heartbeat and may leave at any moment: what a
    hostile or crashed client does (a real trainer's is RemoteEngine, rlsync/client/client.py)."""

    def __init__(self, address: str, *, store_port: int = 1, join_timeout_s: float = 3600.0):
        from rlsync.client.messages import Plan
        from rlsync.update.broadcast import BroadcastReceiver

        trainer = Trainer()
        buckets = plan_for(trainer.weights, UpdateConfig(transport="broadcast", bucket_mb=SMALL_BUCKET_MB), BF16)
        receiver = BroadcastReceiver(
            buckets,
            strategy="bucketed",
            inflight=1,
            flat_weights=False,
            port=store_port,
            timeout_s=3600.0,  # what the client asks; the engine cuts it to serve.max_wait_s
            join_timeout_s=join_timeout_s,
            copy_threads=0,
        )
        self.where = parse_address(address)
        self.stream = self.post("/v1/session", Plan.of(receiver).model_dump_json().encode())
        seen = b""
        while b'"accepted"' not in seen:
            chunk = self.stream.recv(4096)
            assert chunk, seen
            seen += chunk
        self.key = seen.split(b'"session":"', 1)[1].split(b'"', 1)[0].decode()
        self.sockets = [self.stream]

    def post(self, path: str, body: bytes, headers: dict | None = None) -> socket.socket:
        """Send one request on a connection of its own; the connection, unread."""
        head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        sock = socket.create_connection(self.where, timeout=60)
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: e\r\nContent-Type: application/json\r\n{head}"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        return sock

    def call(self, op: str, body: bytes = b"{}") -> socket.socket:
        from rlsync.client.messages import SESSION_HEADER

        sock = self.post(f"/v1/{op}", body, {SESSION_HEADER: self.key})
        self.sockets.append(sock)
        return sock

    def generate(self, prompts: int, max_new_tokens: int) -> socket.socket:
        from rlsync.client.messages import GenerateRequest, TensorData

        request = GenerateRequest(
            prompts=[[1, 2, 3]] * prompts,
            max_new_tokens=max_new_tokens,
            temperature=1.0,
            generator_state=TensorData.of(torch.Generator().get_state()),
            generator_device="cpu",
        )
        return self.call("generate", request.model_dump_json().encode())

    def leave(self) -> None:
        for sock in self.sockets:
            sock.close()


def answer(sock: socket.socket) -> bytes:
    """What the engine answered on `sock` (until it closes or the body is in)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
        data.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0] if b"content-length: " in data else 0
    ):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def until_free(address: str, timeout: float) -> float:
    """Seconds until /health says no session holds the engine; fails after `timeout`."""
    start = time.monotonic()
    assert health(address, until=lambda h: not h["busy"], timeout=timeout)["busy"] is False
    return time.monotonic() - start


def test_a_client_that_leaves_mid_generation_frees_the_engine_within_seconds(engine_server):
    """Too much work is refused before it starts; a long generation is cancelled when its request's
    client goes away, and the session when its stream goes; the next trainer's update verifies."""
    client = RawSession(engine_server.address)
    refused = answer(client.generate(prompts=200, max_new_tokens=30_000))  # 6M tokens: over 2^22 (a request: alive)
    assert refused.startswith(b"HTTP/1.1 422") and b"TooMuchWork: 200 prompts x 30000 new tokens" in refused
    assert b"serve.max_generate_tokens=4194304" in refused
    long = client.generate(prompts=64, max_new_tokens=30_000)  # hours of work on two cores
    health(engine_server.address, until=lambda h: h["op"] == "generate")
    long.close()  # the request's client goes: its generation stops between two tokens
    engine_server.wait_for("'generate' cancelled: its client closed the connection", timeout=10)
    assert answer(client.call("heartbeat")).startswith(b"HTTP/1.1 204")  # the client is alive: its session stays
    assert health(engine_server.address, until=lambda h: h["op"] is None)["busy"] is True
    client.generate(prompts=64, max_new_tokens=30_000)
    health(engine_server.address, until=lambda h: h["op"] == "generate")
    client.leave()  # the whole client goes, mid-generation
    assert until_free(engine_server.address, timeout=15) < 15
    engine_server.wait_for("ended: the trainer went away without closing it")
    one_update_lands(Trainer(seed=7), remote_update(engine_server.address))  # verify=True: every checksum


def test_an_open_with_an_unreachable_store_frees_the_engine_within_its_own_limit(engine_server):
    """The plan asks the engine to wait an hour for a store nobody listens on, and the client falls
    silent: serve.max_wait_s bounds the wait, serve.session_timeout_s ends the session."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    client = RawSession(engine_server.address, store_port=closed_port, join_timeout_s=3600)
    start = time.monotonic()
    opened = client.call("open")
    health(engine_server.address, until=lambda h: h["op"] == "open")
    assert until_free(engine_server.address, timeout=MAX_WAIT_S + SESSION_TIMEOUT_S + 20) >= 0
    assert time.monotonic() - start < MAX_WAIT_S + SESSION_TIMEOUT_S + 20
    failed = answer(opened)
    assert failed.startswith(b"HTTP/1.1 500")  # the open failed within the engine's limit, once (E17r)
    assert f"did not answer within {MAX_WAIT_S} s (Connection refused)".encode() in failed
    engine_server.wait_for(f"(serve.session_timeout_s={SESSION_TIMEOUT_S})")
    client.leave()
    assert not [ln for ln in engine_server.errors if "frame #" in ln or "c10d" in ln]  # no C++ frames on its console


def test_sigterm_mid_request_stops_the_engine_cleanly_in_one_line(engine_server):
    client = RawSession(engine_server.address)
    client.generate(prompts=64, max_new_tokens=30_000)
    health(engine_server.address, until=lambda h: h["op"] == "generate")
    start = time.monotonic()
    result = engine_server.stop()
    assert time.monotonic() - start < 20
    client.leave()
    assert result.returncode == 143, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "rlsync: interrupted: stopped by SIGTERM"
    for noise in ("Traceback", "CancelledError", "terminate called", "graceful shutdown"):
        assert noise not in result.stderr, result.stderr
    assert "ended: the engine stopped" in result.stdout


def test_a_dead_engine_fails_the_update_within_seconds(tmp_path):
    server = StandaloneEngine(tmp_path)
    trainer = Trainer()
    update = remote_update(server.address)
    engine, transport, _ = trainer.open(update)
    try:
        server.proc.kill()
        server.proc.wait()
        start = time.monotonic()
        with pytest.raises(EngineDied, match=f"the engine at {server.address} closed the connection"):
            transport.update_weights(trainer.weights)
        assert time.monotonic() - start < 10
    finally:
        close_update(engine, transport)


@pytest.mark.slow  # waits out a connect timeout on a real socket
def test_a_trainer_pointed_at_a_silent_listener_fails_within_its_connect_timeout(tmp_path):
    """A port that accepts connections (the kernel does) but never answers: the run ends after
    update.engine_connect_timeout_s with one line."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        result = run_main(
            *FAST,
            "update.transport=broadcast",
            f"update.engine_address={address}",
            "update.engine_connect_timeout_s=2",
            "wandb.mode=disabled",
            f"hydra.run.dir={tmp_path}",
        )
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"rlsync: no rlsync engine answered at update.engine_address={address} within 2 s (timed out): start one there"
    ), result.stderr
    assert [ln for ln in result.stderr.splitlines() if ln.startswith("rlsync:")] == [last]


class Touch:
    """Unpickling this creates `path`: proof that a pickle was loaded."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_token_engine_never_runs_a_pickle_and_refuses_a_wrong_token(tmp_path, monkeypatch):
    """With RLSYNC_ENGINE_TOKEN set, every request needs it; pickles, sent raw, framed as the old
    channel framed them, or as request bodies with and without the token, are never loaded; the
    right token's trainer is served; `serve.sessions=1` exits after it."""
    token = "s3cret-for-this-test"
    server = StandaloneEngine(
        tmp_path / "engine", "serve.sessions=1", REQUEST_TIMEOUT, env=cli_env(**{TOKEN_ENV: token})
    )
    assert server.wait_for("listening on").endswith("(token required)")
    marker = tmp_path / "pickle-ran"
    payload = pickle.dumps(Touch(marker))
    host, port = parse_address(server.address)
    hostile_client(server.address, payload)
    hostile_client(server.address, struct.pack("!i", len(payload)) + payload)  # multiprocessing.connection's frame
    for path in ("/v1/session", "/v1/open", "/v1/generate"):
        for headers in ({}, {"Authorization": f"Bearer {token}"}):
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("POST", path, body=payload, headers={"Content-Type": "application/octet-stream", **headers})
            status = conn.getresponse().status
            conn.close()
            assert status in ((401,) if not headers else (409, 422)), (path, headers, status)
    assert not marker.exists()

    trainer = Trainer()
    update = remote_update(server.address, engine_connect_timeout_s=5)
    monkeypatch.setenv(TOKEN_ENV, "not-the-engine's")
    with pytest.raises(EngineUnreachable, match=f"refused this trainer's token: set the same {TOKEN_ENV} on both"):
        trainer.open(update)
    server.wait_for("no token or the wrong one", stderr=True)
    monkeypatch.setenv(TOKEN_ENV, token)
    one_update_lands(trainer, update)
    server.proc.wait(timeout=30)  # it exits by itself after its one session
    result = server.stop()
    assert result.returncode == 0, result.stderr
    assert "served 1 session(s); exiting" in result.stdout
    assert not marker.exists()


def test_a_local_broadcast_group_listens_on_loopback_only():
    """An engine process rlsync starts itself: the store and both ends of the gloo group bind 127.0.0.1."""
    trainer = Trainer()
    engine, transport, _ = trainer.open(
        UpdateConfig(transport="broadcast", bucket_mb=SMALL_BUCKET_MB, engine_timeout_s=120)
    )
    try:
        transport.update_weights(trainer.weights)
        assert_engine_holds(engine, trainer.weights)
        assert transport.store.port in assert_listens_on_loopback_only(os.getpid())
        assert assert_listens_on_loopback_only(engine.pid)  # the engine's gloo device
    finally:
        close_update(engine, transport)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def health(address: str, *, until=lambda h: True, timeout: float = 30) -> dict:
    """GET /health (again, until `until(answer)`)."""
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout
    while True:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        conn.request("GET", "/health")
        response = conn.getresponse()
        answer = json.loads(response.read())
        conn.close()
        assert response.status == 200
        if until(answer) or time.monotonic() > deadline:
            return answer
        time.sleep(0.02)


def hostile_client(address: str, sent: bytes | None) -> int:
    """Connect, send `sent` (None: nothing), read until the engine closes the connection; our port."""
    with socket.create_connection(parse_address(address), timeout=60) as sock:
        port = sock.getsockname()[1]
        try:
            if sent:
                sock.sendall(sent)
            if sent == b"":
                return port  # connect and close, as a port probe does
            while sock.recv(65536):
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass  # the engine closed on us while we were still sending: dropped, as it should
    return port


def listening_sockets(pid: int) -> dict[int, ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """{port: address} of every TCP socket process `pid` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = {}
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = row.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # /proc prints 32-bit words host-order
            found[int(hex_port, 16)] = ipaddress.ip_address(raw)
    return found


def assert_listens_on_loopback_only(pid: int) -> dict:
    found = listening_sockets(pid)
    assert found and all(a.is_loopback for a in found.values()), found
    return found
