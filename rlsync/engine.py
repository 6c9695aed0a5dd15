"""`python -m rlsync.engine [overrides]`: a rollout engine on its own, which trainers join over TCP.

    python -m rlsync.engine model=qwen3_0p6b update.engine_address=0.0.0.0:29610      # machine B
    python -m rlsync model=qwen3_0p6b update.transport=broadcast update.engine_address=B:29610   # machine A

The engine is built once from the same config groups as the runner (model, rollout, run.device;
conf/engine.yaml), then listens at `update.engine_address` (default 127.0.0.1:29610; port 0 picks
a free one, printed in the "listening" line). Each trainer that connects is one session, served to
the end before the next is accepted:

1. the trainer sends its half of the broadcast transport: the bucket plan and its settings
   (strategy, buckets in flight, flat weights, copy threads); the engine checks that the plan names
   its own weights with their shapes and dtype, and refuses the session in one line if not;
2. the engine joins the trainer's gloo group at the address the trainer connected from;
3. it serves the trainer's requests (update, generate, release, resume, checksums, weights) as an
   engine process started by the trainer would (rlsync/sync/engine_process.py), until the trainer
   closes or goes away.

The weights stay between sessions; each session starts with the engine's memory resumed and is
filled by the trainer's first update. `serve.sessions=N` exits after N sessions; otherwise Ctrl-C or
SIGTERM stops it (exit 130 or 143). A trainer that arrives during another's session is refused at
once, in one line naming the trainer being served. The control connection is authenticated with RLSYNC_ENGINE_KEY
(the same on both sides) and carries pickles: keep it on a trusted network.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener

import hydra
from omegaconf import DictConfig

from rlsync.config import EngineAppConfig, register_configs
from rlsync.errors import StopOnSignals, cli, job_errors

register_configs()


def log(line: str) -> None:
    print(f"rlsync engine: {line}", file=sys.stdout, flush=True)


def build_engine(cfg: EngineAppConfig):
    """The engine the config describes, on this machine's device (its weights filled by the first update)."""
    from rlsync.experiment import resolve_device
    from rlsync.models import build_tokenizer
    from rlsync.engines.base import EngineSpec

    tokenizer = build_tokenizer(cfg.model)
    spec = EngineSpec(model=cfg.model, rollout=cfg.rollout, device=str(resolve_device(cfg.run.device)),
                      allowed_ids=tokenizer.allowed_ids(cfg.model.vocab_size), eos_id=tokenizer.eos_id,
                      pad_id=tokenizer.pad_id)
    return spec.build(strategy=cfg.update.strategy)


def plan_mismatch(buckets, weights: dict) -> str | None:
    """Why a trainer's bucket plan cannot land in these weights (one line), or None if it can."""
    planned = {s.meta.name: s.meta for b in buckets for s in b.slots}
    missing = sorted(set(planned) - set(weights))
    if missing:
        return (f"the trainer's update names {len(missing)} tensor(s) this engine's model lacks (first: {missing[0]!r}); "
                f"start the engine with the trainer's model settings")
    for name, meta in planned.items():
        tensor = weights[name]
        if tuple(tensor.shape) != tuple(meta.shape) or tensor.dtype != meta.dtype:
            return (f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype} in this engine but "
                    f"{tuple(meta.shape)} {meta.dtype} in the trainer's update; start the engine with the trainer's "
                    f"model and rollout.dtype settings")
    unfilled = sorted(set(weights) - set(planned))
    if unfilled:
        return (f"the trainer's update leaves {len(unfilled)} of this engine's tensor(s) unfilled (first: "
                f"{unfilled[0]!r}); start the engine with the trainer's model settings")
    return None


def serve_session(conn, engine, trainer_host: str) -> str:
    """One trainer, start to end (see the module docstring); returns how the session ended."""
    from rlsync.sync.broadcast import BroadcastReceiver
    from rlsync.sync.engine_process import EngineServer, serve_requests

    op, args = conn.recv()
    receiver = args[0] if op == "start" and args else None
    if not isinstance(receiver, BroadcastReceiver):
        problem = f"expected the broadcast transport's start request, got {op!r}"
    else:
        problem = plan_mismatch(receiver.buckets, engine.weights)
    if problem is not None:
        conn.send(("error", "start", f"PlanMismatch: {problem}\n"))
        return f"refused: {problem}"
    receiver.host = trainer_host  # the trainer's TCP store, as this engine reaches it
    engine.resume()  # the last session may have ended with the engine's memory released
    try:
        return "ended: " + serve_requests(conn, EngineServer(engine, receiver))
    finally:
        receiver.close()


class Doorway:
    """Accepts trainers in a thread of its own, so that one arriving while a session runs hears at
    once that the engine is busy (and with whom) instead of waiting without a word.

    The next trainer waits in `arrivals` for the main thread; `serving` names the trainer whose
    session is on (set here when it is let in, cleared by `done` when its session ends).
    """

    REFUSE_READ_S = 5.0  # how long a refused trainer has to send its start request
    GRACE_S = 1.0  # how long a trainer arriving during a session waits for it to end before it is refused

    def __init__(self, listener: Listener):
        self.listener = listener
        self.arrivals: queue.Queue = queue.Queue()
        self.serving: str | None = None
        threading.Thread(target=self._accept, name="rlsync-engine-doorway", daemon=True).start()

    def next(self) -> tuple:
        """The next trainer let in: (connection, (host, port)). Waits in slices, so Ctrl-C and SIGTERM stop it."""
        while True:
            try:
                return self.arrivals.get(timeout=0.5)
            except queue.Empty:
                continue

    def done(self) -> None:
        self.serving = None

    def _accept(self) -> None:
        from rlsync.sync.remote import WireConnection

        while True:
            try:
                raw = self.listener.accept()
            except AuthenticationError:
                log("refused a connection with the wrong key (RLSYNC_ENGINE_KEY)")
                continue
            except OSError:  # the listener was closed: the engine is exiting
                return
            host, port = self.listener.last_accepted[:2]
            conn = WireConnection(raw)
            self._grace()
            if self.serving is not None:
                self._refuse(conn, f"EngineBusy: this engine is serving {self.serving}; it serves one trainer at a time")
                log(f"refused trainer {host}:{port}: busy with {self.serving}")
                continue
            self.serving = f"trainer {host}:{port} (since {time.strftime('%H:%M:%S')})"
            self.arrivals.put((conn, (host, port)))

    def _grace(self) -> None:
        """A trainer arriving just as the last one leaves (its "close" answered, the session not yet
        wound up) is let in, not refused: wait up to GRACE_S for the session to end."""
        deadline = time.monotonic() + self.GRACE_S
        while self.serving is not None and time.monotonic() < deadline:
            time.sleep(0.02)

    def _refuse(self, conn, line: str) -> None:
        """Answer the trainer's start request with `line` (it raises it), then hang up."""
        try:
            if conn.poll(self.REFUSE_READ_S):
                conn.recv()
            conn.send(("error", "start", line + "\n"))
        except (EOFError, OSError):
            pass
        finally:
            conn.close()


def serve(cfg: EngineAppConfig) -> None:
    from rlsync.sync.remote import DEFAULT_PORT, authkey, parse_address

    host, port = parse_address(cfg.update.engine_address or "127.0.0.1", default_port=DEFAULT_PORT)
    with StopOnSignals():  # Ctrl-C / SIGTERM: stop between (or inside) sessions, exit 130 / 143
        engine = build_engine(cfg)
        family = "AF_INET6" if ":" in host else "AF_INET"
        with Listener((host, port), family=family, authkey=authkey()) as listener:
            bound = listener.address
            log(f"{cfg.model.name} ({cfg.rollout.engine}, {cfg.rollout.dtype}, {engine.device}) listening on "
                f"{bound[0]}:{bound[1]}")
            doorway = Doorway(listener)
            served = 0
            while cfg.serve.sessions == 0 or served < cfg.serve.sessions:
                conn, trainer = doorway.next()
                served += 1
                log(f"session {served}: trainer {trainer[0]}:{trainer[1]} connected")
                try:
                    ended = serve_session(conn, engine, trainer[0])
                finally:
                    conn.close()
                    doorway.done()
                log(f"session {served}: {ended}")
        log(f"served {served} session(s); exiting")


@hydra.main(version_base="1.3", config_path="../conf", config_name="engine")
def hydra_main(dcfg: DictConfig) -> None:
    from rlsync.validate import checked_config

    with job_errors(None):
        serve(checked_config(dcfg, EngineAppConfig))


def main() -> None:
    cli(hydra_main)


if __name__ == "__main__":
    main()
