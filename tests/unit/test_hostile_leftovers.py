"""The hostile cases of 2026-12-05 that still misbehaved on the tree after issue 42 (E17r, G20), in process:
a store that accepts the engine's connection and never answers, a sweep stopped by SIGUSR1 or SIGUSR2."""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time

import pytest

BOUND_S = 1  # the join bound the engine's open is given (serve.max_wait_s caps a plan's to it); short: waited out


def open_receiver(port: int) -> tuple[list, float]:
    """BroadcastReceiver.open against the store at 127.0.0.1:port, on a thread this test can give up on
    (torch's own client would wait for ever): what it raised, or ["hung"], and the seconds it took."""
    from rlsync.update.broadcast import BroadcastReceiver

    receiver = BroadcastReceiver(
        [],  # the buckets are read only once the group is joined
        strategy="bucketed",
        inflight=1,
        flat_weights=False,
        port=port,
        timeout_s=3600,
        join_timeout_s=BOUND_S,
        copy_threads=0,
    )
    outcome: list = []

    def attempt() -> None:
        try:
            receiver.open(None)  # the engine is touched only after the group is joined
        except BaseException as err:  # noqa: BLE001 - the test reads what it raised
            outcome.append(err)

    start = time.monotonic()
    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(BOUND_S + 60)
    return outcome or ["hung"], time.monotonic() - start


def test_a_store_that_accepts_and_never_answers_fails_the_open_within_its_bound(capfd) -> None:
    """E17r: the engine's probe saw the port accept and handed over to torch's store client, whose
    handshake waits for ever on a peer that never answers: serve.max_wait_s did not bound the open."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts (the kernel's backlog) and never says a word
        port = silent.getsockname()[1]
        (raised,), waited = open_receiver(port)
    assert isinstance(raised, TimeoutError), raised
    assert str(raised) == (
        f"the trainer's store at 127.0.0.1:{port} accepted the connection but did not answer as a store "
        f"within {BOUND_S} s"
    )
    assert BOUND_S <= waited < 2 * BOUND_S + 10  # its bound, once (a loaded machine may add a few seconds)
    err = capfd.readouterr().err
    assert "frame #" not in err and "c10d" not in err, err


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2])
def test_a_sweep_stopped_by_sigusr1_or_sigusr2_ends_as_an_interrupted_sweep(sig) -> None:
    """G20's signals stop a run as SIGTERM does (exit 128 + signal); in a sweep the stop must also end the
    sweep as interrupted (its line naming the report to run), as SIGINT, SIGTERM and SIGHUP do."""
    from rlsync import shell

    ended: list[str] = []
    shell.SWEEP_ENDED.append(ended.append)
    try:
        with pytest.raises(SystemExit) as stop:
            shell._run_app(lambda: sys.exit(128 + sig))  # what job_errors raises for a job stopped by `sig`
    finally:
        shell.SWEEP_ENDED.clear()
    assert stop.value.code == 128 + sig
    assert ended == ["interrupted"]
