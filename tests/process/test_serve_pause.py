"""The stall streaming clients see while a real standalone engine (`python -m rlsync.serve`) takes updates.

An engine streaming to 2 clients takes an update under each policy; no request fails or hangs, and every
answer started after the swap scores as the new weights' (teacher-forced log-probs in this process); a
client that leaves mid-answer frees its slot; a stream before any update is refused in one line; a
trainer killed mid-update leaves a `pause` engine refusing (torn weights) until a complete update lands.
In-process twins: tests/unit/test_serve_pause.py.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import ROOT, StandaloneEngine, Tiny, Trainer, cli_env, remote_update

from rlsync.client.client import parse_address
from rlsync.client.stream import StreamFailed, StreamRequest, serving_state, stream_answer
from rlsync.engines.base import token_logprobs
from rlsync.update import close_update

LOGPROB_TOL = 0.05  # as rlsync/bench/stall.py checks: streamed against teacher-forced, same weights


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
    engine, transport, _ = trainer.open(remote_update(server.address, flat_engine_weights=flat_weights, verify=False))
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
        transport.update_weights(trainer.weights)  # the first update fills the engine: version 1
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        new = Tiny().weights(seed=7)  # another model: every weight changed
        transport.update_weights(new)  # under load
        swap = serving_state(server.address, timeout_s=10).last_update
        time.sleep(1.0)
        stop.set()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads), "a client hung"
    finally:
        close_update(engine, transport)
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
        engine, transport, _ = trainer.open(remote_update(server.address, verify=False))
        try:
            transport.update_weights(trainer.weights)
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
            close_update(engine, transport)
    finally:
        done = server.stop()
    assert done.returncode in (0, 143)


CUT_TRAINER = """
import sys, time
sys.path.insert(0, "tests")
from conftest import Tiny, Trainer, remote_update
trainer = Trainer()
engine, transport, _ = trainer.open(remote_update(sys.argv[1], strategy="per_tensor", verify=False))
transport.update_weights(trainer.weights)
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


transport.group = Stalls(transport.group)
transport.update_weights(Tiny().weights(seed=7))
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
        engine, transport, _ = trainer.open(remote_update(server.address, verify=True))
        try:
            transport.update_weights(trainer.weights)
        finally:
            close_update(engine, transport)
        state = serving_state(server.address, timeout_s=10)
        assert state.version == 2 and state.torn is None
        after = list(stream_answer(server.address, greedy, timeout_s=60))
        assert [ln.token for _, ln in after] == [ln.token for _, ln in before]  # the same weights' greedy answer
        assert {ln.version for _, ln in before} == {1} and {ln.version for _, ln in after} == {2}
    finally:
        server.stop()
