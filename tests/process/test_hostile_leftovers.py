"""The hostile cases of 2026-12-05 still open after issue 42 that need a new interpreter (E17r): torch reads
TORCH_CPP_LOG_LEVEL once, as it loads."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import cli_env

BOUND_S = 3  # the join bound the engine's open is given (serve.max_wait_s caps a plan's to it)


@pytest.mark.slow
def test_a_store_that_answers_but_whose_group_never_forms_fails_without_cpp_log_lines() -> None:
    """The trainer's store answers, its trainer never joins the group: the rendezvous' timeout is rlsync's one
    line, not c10d's C++ warnings before it (TORCH_CPP_LOG_LEVEL is read once, as torch loads: a new interpreter)."""
    script = f"""
from datetime import timedelta
import rlsync.errors  # each entry point imports it first, before torch
from rlsync.update.broadcast import BroadcastReceiver, listen_store
store = listen_store("127.0.0.1", timedelta(seconds=60))
receiver = BroadcastReceiver([], strategy="bucketed", inflight=1, flat_weights=False, port=store.port,
                             timeout_s=3600, join_timeout_s={BOUND_S}, copy_threads=0)
try:
    receiver.open(None)
except Exception as err:
    print(type(err).__name__)
"""
    env = cli_env()
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "DistStoreError", done.stdout + done.stderr
    assert "c10d" not in done.stderr and "socket.cpp" not in done.stderr, done.stderr
