"""`python -m rlsync.serve [overrides]`: a rollout engine on its own, which trainers join over HTTP.

    python -m rlsync.serve model=qwen3_0p6b update.engine_address=127.0.0.1:29610      # one machine
    RLSYNC_ENGINE_TOKEN=... python -m rlsync.serve model=qwen3_0p6b update.engine_address=0.0.0.0:29610   # machine B
    RLSYNC_ENGINE_TOKEN=... python -m rlsync model=qwen3_0p6b update.transport=broadcast update.engine_address=B:29610   # A

The engine is built once from the same config groups as the runner (model, rollout, run.device;
conf/engine.yaml), then serves HTTP at `update.engine_address` (default 127.0.0.1:29610; port 0
picks a free one, printed in the "listening" line): uvicorn, a FastAPI app (rlsync/serve/app.py),
typed JSON messages (rlsync/client/messages.py), never pickle. Each trainer is one session, served to
the end before the next is let in:

1. the trainer sends its half of the broadcast transport: the bucket plan and its settings
   (strategy, buckets in flight, flat weights, copy threads); the engine checks that the plan names
   its own weights with their shapes and dtype, and refuses the session in one line if not;
2. the engine joins the trainer's gloo group at the address the trainer connected from;
3. it serves the trainer's requests (open, update, generate, release, resume, checksums, weights,
   close) as an engine process started by the trainer would (rlsync/engines/process.py), until
   the trainer closes the session or goes away.

The weights stay between sessions; each session starts with the engine's memory resumed and is
filled by the trainer's first update. `serve.sessions=N` exits after N sessions; otherwise Ctrl-C or
SIGTERM stops it (exit 130 or 143). A trainer that arrives during another's session is refused at
once, in one line naming the trainer being served; `GET /health` answers at any time.

Beyond loopback the engine requires a shared token (RLSYNC_ENGINE_TOKEN, the same on both sides,
compared in constant time) and refuses to start without one. A client that sends garbage, stalls
or disconnects is dropped with one line on stderr (rlsync/serve/http.py); the engine serves on. No
client holds the engine longer than the operator allows: a generate request's work is capped
(serve.max_generate_tokens), a trainer's waits are cut to serve.max_wait_s, a session whose trainer
falls silent (serve.session_timeout_s) or leaves is ended and its work cancelled, and so is the
session in progress when the engine is stopped (rlsync/serve/app.py).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import hydra
import uvicorn
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from rlsync.client.client import DEFAULT_PORT, TOKEN_ENV, parse_address
from rlsync.config.apps import EngineAppConfig
from rlsync.config.compose import CONFIG_PATH, register_configs
from rlsync.config.launch import hydra_job, hydra_record
from rlsync.config.validate import checked_config
from rlsync.engines.base import engine_spec
from rlsync.errors import ConfigError, RlsyncError, StopOnSignals
from rlsync.measure.devices import resolve_device
from rlsync.measure.timing import settled_heap
from rlsync.model.build import build_tokenizer
from rlsync.record.run_lock import RunLock
from rlsync.serve.app import Control, log
from rlsync.serve.http import guarded_protocol, quiet_uvicorn
from rlsync.shell import cli, job_errors

register_configs()


def build_served_engine(cfg: EngineAppConfig):
    """The engine the config describes, on this machine's device (its weights filled by the first update)."""
    spec = engine_spec(
        cfg.model, cfg.rollout, device=resolve_device(cfg.run.device), tokenizer=build_tokenizer(cfg.model)
    )
    return spec.build(strategy=cfg.update.strategy)


def loopback(host: str) -> bool:
    """Whether `host` only ever means this machine (every address it resolves to is a loopback one)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def engine_token(address: str, host: str) -> bytes | None:
    """The token trainers must present (RLSYNC_ENGINE_TOKEN); None on loopback without one.
    Listening beyond loopback without a token is refused (ConfigError: exit 2, before any model is built)."""

    token = os.environ.get(TOKEN_ENV, "")
    if token.strip():
        if not token.isascii() or not token.isprintable():
            raise ConfigError(TOKEN_ENV, "(hidden)", "printable ASCII characters (it travels in an HTTP header)")
        return token.encode()
    if loopback(host):
        return None
    state = "empty" if TOKEN_ENV in os.environ else "unset"
    raise ConfigError(
        "update.engine_address",
        address,
        f"a loopback address (127.0.0.1, ::1, localhost), or set {TOKEN_ENV} to a shared secret "
        f"(the same for the trainers) to listen beyond this machine",
        f"listens beyond loopback without a token ({TOKEN_ENV} is {state})",
    )


def listen(host: str, port: int) -> socket.socket:
    """The engine's listening socket, bound to `host` only (one line if it cannot be)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise RlsyncError(
            f"cannot listen on update.engine_address={host}:{port} ({err.strerror or err}): "
            f"pick another port (0: any free one) or address"
        ) from None
    return sock


def start_server(app, sock: socket.socket, request_timeout_s: float):
    """uvicorn serving `app` on `sock` in a thread of its own (the main thread keeps the signals)."""
    quiet_uvicorn()
    config = uvicorn.Config(
        app,
        http=guarded_protocol(request_timeout_s),
        ws="none",
        lifespan="off",
        log_config=None,
        access_log=False,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=3,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="rlsync-engine-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RlsyncError(f"the engine's HTTP server did not start on {sock.getsockname()[:2]}")
        time.sleep(0.02)
    return server, thread


def serve(cfg: EngineAppConfig, run_dir: Path, record: Optional[dict[str, str]] = None) -> None:
    address = cfg.update.engine_address or "127.0.0.1"
    host, port = parse_address(address, default_port=DEFAULT_PORT)
    token = engine_token(address, host)  # before anything is built
    # the run directory held (a live run's: refused, nothing of it rewritten), then Ctrl-C / SIGTERM stop between
    # (or inside) sessions, exit 130 / 143
    with RunLock(run_dir, record), StopOnSignals() as stop:
        stop.check()  # a signal since the command started
        sock = listen(host, port)  # a taken port fails before the model is built; trainers wait in the backlog
        engine = build_served_engine(cfg)
        control = Control(engine, cfg, token=token)
        server, thread = start_server(control.app, sock, cfg.serve.request_timeout_s)
        bound = sock.getsockname()
        log(
            f"{cfg.model.name} ({cfg.rollout.engine}, {cfg.rollout.dtype}, {engine.device}) listening on "
            f"{bound[0]}:{bound[1]}" + (" (token required)" if token else "")
        )
        try:
            with settled_heap():  # the engine's objects out of the collector's way while it serves timed updates
                control.wait(cfg.serve.sessions)
        finally:
            # the session's work cancelled and the session ended first, so that no request is in flight
            # when the HTTP server closes; work that cannot be cancelled (a blocked rendezvous) leaves
            # the process to exit at once once its line is printed (main)
            if control.stop():
                server.should_exit = True
                thread.join(10)
            else:  # the server's requests wait on that work: the process exits without closing them (main)
                STUCK.append(control.work.op or "work")
        log(f"served {control.served} session(s); exiting")


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="engine")
def hydra_main(dcfg: DictConfig) -> None:
    with job_errors(None):
        run_dir, _sweep_dir, _name = hydra_job(HydraConfig.get())
        serve(checked_config(dcfg, EngineAppConfig), run_dir, hydra_record(dcfg))


STUCK: list[str] = []  # the engine's work that did not stop when the engine did


def main() -> None:
    try:
        cli(hydra_main)
    except SystemExit as done:
        if STUCK:  # the work thread is blocked in native code: interpreter shutdown would abort on it
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(done.code if isinstance(done.code, int) else 1)
        raise


if __name__ == "__main__":
    main()
