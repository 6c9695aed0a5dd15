"""The standalone engine's client without a server: its address parsing, no engine (or a store nobody
listens on) failing in one line within its bound, and `python -m rlsync.serve` refusing to start (beyond
loopback without a token, a taken port) in this process. The tests with a server or an engine process of
their own are tests/process/test_standalone_engine.py's.
"""

from __future__ import annotations

import socket
import time

import pytest
from conftest import (
    BF16,
    SMALL_BUCKET_MB,
    Trainer,
    cli_env,
    remote_update,
    run_main,
)

from rlsync.client.client import TOKEN_ENV, EngineUnreachable, parse_address
from rlsync.config.schema import UpdateConfig
from rlsync.update import plan_for


def test_a_store_nobody_listens_on_fails_the_open_once_within_its_bound_in_one_line(capfd):
    """E17r: torch's store client retries once past its timeout (twice the wait) and logs about 40 lines
    of C++ stack frames; the engine's open asks the store itself, within join_timeout_s counted once."""
    from rlsync.update.broadcast import BroadcastReceiver

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    trainer = Trainer()
    buckets = plan_for(trainer.weights, UpdateConfig(transport="broadcast", bucket_mb=SMALL_BUCKET_MB), BF16)
    bound_s = 1.5  # short: the test waits it out; twice it (torch's own client's wait) still tells the two apart
    receiver = BroadcastReceiver(
        buckets,
        strategy="bucketed",
        inflight=1,
        flat_weights=False,
        port=closed_port,
        timeout_s=60,
        join_timeout_s=bound_s,
        copy_threads=0,
    )
    engine = trainer.tiny.spec().build()  # built before the clock starts: the bound is the open's alone
    start = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        receiver.open(engine)
    waited = time.monotonic() - start
    assert str(caught.value) == (
        f"the trainer's store at 127.0.0.1:{closed_port} did not answer within {bound_s} s (Connection refused)"
    )
    assert bound_s <= waited < 2 * bound_s  # its bound, once (torch's own client: twice and a retry delay)
    err = capfd.readouterr().err
    assert "frame #" not in err and "c10d" not in err, err


def test_no_engine_at_the_address_is_one_clear_error():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    trainer = Trainer()
    update = remote_update(address, engine_connect_timeout_s=1)
    start = time.monotonic()
    with pytest.raises(
        EngineUnreachable, match=f"no rlsync engine answered at update.engine_address={address} within 1 s"
    ):
        trainer.open(update)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("token", [None, " "], ids=["unset", "blank"])
def test_an_engine_beyond_loopback_without_a_token_refuses_to_start(tmp_path, token):
    env = {k: v for k, v in cli_env().items() if k != TOKEN_ENV} | ({} if token is None else {TOKEN_ENV: token})
    result = run_main(
        "update.engine_address=0.0.0.0:0", f"hydra.run.dir={tmp_path}", module="rlsync.serve", environ=env
    )
    assert result.returncode == 2, result.stderr
    assert "listening" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        "rlsync: config error: update.engine_address=0.0.0.0:0: listens beyond loopback "
        f"without a token ({TOKEN_ENV} is {'unset' if token is None else 'empty'})"
    )


def test_an_engine_on_a_taken_port_says_so_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = run_main(f"update.engine_address={address}", f"hydra.run.dir={tmp_path}", module="rlsync.serve")
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"rlsync: cannot listen on update.engine_address={address} "
        f"(Address already in use): pick another port (0: any free one) "
        f"or address"
    ]


@pytest.mark.parametrize(
    "text,parsed",
    [
        ("127.0.0.1:29610", ("127.0.0.1", 29610)),
        ("node-3.cluster:0", ("node-3.cluster", 0)),
        ("[::1]:29610", ("::1", 29610)),
    ],
)
def test_parse_address(text, parsed):
    assert parse_address(text) == parsed


@pytest.mark.parametrize("text", ["node-3", ":29610", "host:http", "host:70000", "[::1]x"])
def test_parse_address_rejects(text):
    with pytest.raises(ValueError):
        parse_address(text)
