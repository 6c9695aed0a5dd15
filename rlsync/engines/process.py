"""An engine in its own process, and the trainer's handle on it (what the `ipc` and `broadcast` transports start).

The engine process is started by torch.multiprocessing (spawn on a GPU, forkserver on a CPU: see
`start_context`), so tensors sent through its pipe travel as shared memory (CPU) or CUDA IPC handles
(GPU) instead of pickled bytes. It builds the engine from its `EngineSpec`, then serves requests
one at a time, in order:

    (op, args)  ->  ("ok", op, result, t_recv, t_send, t_prev_send)  |  ("error", op, traceback)

`t_*` are CLOCK_MONOTONIC stamps (`time.monotonic`), one system-wide clock on Linux, so the trainer
can tell a request's handoff latency from the engine's work on it. A transport plugs its engine-side
half in as a `Receiver` (`open(engine)`, `handle(engine, request)`, `close()`): rlsync.update's `ipc`
loads from shared staging buffers, `broadcast` receives from a process group.

A dead engine never hangs the trainer: every wait polls in slices of `POLL_S` and checks the
process between them, raising `EngineDied` with its exit code. Both sides first poll without sleeping
for `SPIN_S` (`spin_poll`): a per-tensor update is thousands of tiny messages, each answered within
tens of microseconds, and a process that sleeps between them pays a wake-up per message.

`EngineConnection` is the trainer's side of that protocol over any message connection: `EngineProcess`
(a pipe to the process it starts) and rlsync.client's `RemoteEngine` (a session with an engine started
on its own, `python -m rlsync.serve`, typed messages over HTTP) are its two kinds.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager, suppress

import torch
import torch.multiprocessing as mp

from rlsync.engines.base import Engine, EngineHandle, EngineSpec, Preloaded, engine_class
from rlsync.measure.devices import select_device
from rlsync.measure.timing import settled_heap

POLL_S = 0.05  # liveness check interval while waiting on the engine
SPIN_S = 5e-4  # how long a wait for the peer's next message polls without sleeping before it blocks
CLOSE_S = 5.0  # how long close() lets the engine exit by itself before terminating it
# What a forked engine process should find imported already, beside its engine's and its transport's
# receiver's modules (Engine.preload_modules, Receiver.preload_modules).
PRELOAD = (__name__,)


def spin_poll(conn, seconds: float = SPIN_S) -> bool:
    """True as soon as `conn` has a message, polling for up to `seconds` without sleeping; False after.

    Waking a process blocked on a pipe costs a scheduler round trip, and a per-tensor update is
    thousands of messages; each poll yields the core so the peer's copy threads still run (as vLLM's
    shared-memory queue does). Measurements: experiments/transports/README.md."""
    end = time.perf_counter() + seconds
    while not conn.poll(0):
        if time.perf_counter() >= end:
            return False
        os.sched_yield()
    return True


class EngineDied(RuntimeError):
    """The engine process exited while the trainer waited on it."""


class EngineFailed(RuntimeError):
    """The engine raised while serving a request; the message ends with its traceback."""


def exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"exit code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


# ----------------------------------------------------------------------------------------------
# Engine side
# ----------------------------------------------------------------------------------------------


class Receiver(Preloaded, ABC):
    """The engine-side half of a transport whose engine runs in its own process.

    It is pickled to the engine process, which calls `open` once the engine is built, `handle` for each
    update request, and `close` on its way out. Results travel back to the trainer as plain dicts.
    """

    @abstractmethod
    def open(self, engine: Engine) -> dict:
        """Set up this side of the transport for `engine` (buffers, a process group); the reply's result."""

    @abstractmethod
    def handle(self, engine: Engine, request: tuple) -> dict:
        """One update request from the trainer's side, into `engine`; the reply's result."""

    @abstractmethod
    def close(self) -> None:
        """Free what `open` took; called once, as the engine process ends."""


class EngineServer:
    """The requests an engine process answers; `op` names a method."""

    def __init__(self, engine: Engine, receiver: Receiver):
        self.engine, self.receiver = engine, receiver

    def open(self):
        return self.receiver.open(self.engine)

    def update(self, request):
        return self.receiver.handle(self.engine, request)

    def generate(self, prompts, max_new_tokens, temperature, generator_state, generator_device):
        generator = torch.Generator(device=generator_here(torch.device(generator_device), self.engine.device))
        generator.set_state(generator_state)
        gen = self.engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature, generator=generator)
        return gen.to(torch.device("cpu")), generator.get_state()  # never CUDA IPC handles back: CPU, small

    def release(self):
        self.engine.release()

    def resume(self):
        self.engine.resume()

    def checksums(self):
        return self.engine.checksums()

    def weights(self):
        return {name: t.detach().to("cpu", copy=True) for name, t in self.engine.weights.items()}

    def close(self):
        """The engine process's peak resident set (bytes), for the run's memory record."""
        from rlsync.measure.memory import peak_rss_bytes  # here: the engine process needs it once, at the end

        return peak_rss_bytes()


def generator_here(sent: torch.device, engine_device: torch.device) -> torch.device:
    """Where the engine rebuilds the trainer's sampler: on its own device when the trainer's generator
    is of the same type. A generator's state is per device type (CPU: Mersenne Twister; CUDA: Philox
    seed and offset), not per index, and a remote engine's `cuda:0` may be the trainer's `cuda:1`."""
    return engine_device if sent.type == engine_device.type else sent


def engine_main(conn, spec: EngineSpec, receiver: Receiver, strategy: str) -> None:
    """Entry point of the engine process: build, answer "start", then serve until "close" or EOF.

    The trainer owns the engine's lifetime: a Ctrl-C or SIGTERM sent to the whole process group must
    stop the run (which then closes the engine), not kill the engine first and turn an interruption
    into an engine failure. A trainer that dies closes the pipe, which ends the engine too.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    engine = None
    try:
        try:
            select_device(torch.device(spec.device))  # cuda:N: current before the engine's first CUDA call
            if spec.cpu_threads:  # the run's choice (rlsync.measure.threads), not this process's default
                torch.set_num_threads(spec.cpu_threads)
            engine = spec.build(strategy=strategy)
        except BaseException:
            conn.send(("error", "start", traceback.format_exc()))
            raise
        with settled_heap():  # the engine's objects out of the collector's way while it decodes timed updates
            serve_requests(conn, EngineServer(engine, receiver))
    finally:
        receiver.close()
        close_engine = getattr(engine, "close", None)
        if close_engine is not None:
            close_engine()


def serve_requests(conn, server: EngineServer) -> str:
    """Answer "start", then each request in order until "close" or the trainer's side of `conn` closes.

    The engine process's loop (a pipe; the standalone engine answers the same requests over HTTP:
    rlsync/serve/app.py). Returns how the session ended; never raises for a trainer that went away.
    """
    try:
        t_prev_send = time.monotonic()
        conn.send(("ok", "start", None, t_prev_send, t_prev_send, t_prev_send))
        while True:
            spin_poll(conn)  # then block: recv waits as long as the trainer takes
            op, args = conn.recv()
            t_recv = time.monotonic()
            try:
                result = getattr(server, op)(*args)
            except Exception:  # noqa: BLE001 - reported to the trainer, which raises it
                conn.send(("error", op, traceback.format_exc()))
                t_prev_send = time.monotonic()
                continue
            t_send = time.monotonic()
            conn.send(("ok", op, result, t_recv, t_send, t_prev_send))
            t_prev_send = t_send
            if op == "close":
                return "the trainer closed it"
    except (EOFError, OSError) as err:  # the trainer is gone (pipe or socket closed, reset): nothing left to serve
        if isinstance(err, OSError) and err.errno in (errno.EMFILE, errno.ENFILE):  # a request's buffers, no fd left
            with suppress(OSError):
                conn.send(("error", "receive", f"OSError: {err}{open_files_note()}\n"))
        return "the trainer went away without closing it"


def open_files_note() -> str:
    """A note on this process's open-file limit, where it is low enough to be why an engine process died."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= 1024:
        return ""
    return (
        f" (the open-file limit is {soft}, ulimit -n: the engine receives shared buffers as file descriptors; raise it)"
    )


# ----------------------------------------------------------------------------------------------
# Trainer side
# ----------------------------------------------------------------------------------------------


def start_context(device: torch.device, preload: tuple[str, ...] = ()):
    """How engine processes start: never a plain fork of the trainer (its threads, its CUDA state).

    On a GPU, spawn: a fresh interpreter, as CUDA requires. On a CPU, forkserver: a server process
    that imported torch and the engine's model code once forks each engine, which then starts in
    about a second instead of paying those imports (about 7 s on two busy cores) every time: what a
    sweep or the tests open many of. Both pickle the same way, so tensors travel as shared memory.
    """
    if device.type == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *preload])  # read when the server starts: the first engine
    return ctx


@contextmanager
def passive_openmp(enabled: bool):
    """Within the block, OMP_WAIT_POLICY=PASSIVE in the environment (unless it is set already), for an
    engine process started in it (on a CPU the forkserver, which forks every later engine, reads it
    when the first engine starts it): spinning OpenMP workers in the engine would take the cores the
    trainer packs the next message on (experiments/transports/README.md). The trainer's own threads
    are set up already, and its later children see the environment unchanged."""
    if not enabled or "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        del os.environ["OMP_WAIT_POLICY"]


class PipeReply:
    """One request answered (over HTTP the wire's is rlsync.client.messages.Reply, unpacked into this too):
    the result and the handoff latency around the engine's work."""

    def __init__(
        self, result, *, sent: float, waited: float, received: float, t_recv: float, t_send: float, t_prev_send: float
    ):
        self.result = result
        # in: from our send (or the engine finishing its previous request, if later) to the engine reading it;
        # out: from the engine's send (or us starting to wait, if later) to us reading it.
        self.handoff = max(0.0, t_recv - max(sent, t_prev_send)) + max(0.0, received - max(t_send, waited))


class EngineConnection(EngineHandle):
    """The trainer's handle on an engine behind a message connection (`conn`: send, recv, poll, close):
    requests answered in order, every wait bounded and watching that the engine lives. `close()` always
    leaves no engine of ours behind.

    Its kinds say what the engine is and how to tell it is gone: `EngineProcess` (a process started
    here, through a pipe), rlsync.client's `RemoteEngine` (a standalone engine's session over HTTP)."""

    pid: int | None = None  # the engine's process, where it is ours

    def _attach(self, conn, timeout_s: float, *, who: str) -> None:
        """Wait for the engine's "start" answer on `conn`; `who` names the engine in messages."""
        self.conn, self.timeout_s, self.who = conn, timeout_s, who
        self.closed = False
        self.peak_rss_bytes = None  # the engine's own peak resident set, as its close() answered
        self._sent: deque[tuple[str, float]] = deque()  # requests not answered yet, in order
        self._early: deque[tuple] = deque()  # replies read while waiting on something else
        try:
            self._sent.append(("start", time.monotonic()))
            self.reply("start")
        except BaseException:
            self.close()
            raise

    # -- what each kind says of its engine -------------------------------------------------------

    @abstractmethod
    def is_alive(self) -> bool:
        """Whether the engine can still answer (its process runs, its session is on)."""

    @abstractmethod
    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` for the engine to show whether it is gone."""

    @abstractmethod
    def kill(self) -> None:
        """End the engine (ours: its process; a standalone one: only its session) and wait for it."""

    @abstractmethod
    def ended(self) -> str:
        """How the engine went, said once it is gone ("died with exit code 1")."""

    # -- requests ------------------------------------------------------------------------------

    def send(self, op: str, *args) -> float:
        """Send a request without waiting; returns its send stamp."""
        self.check_alive(op)
        sent = time.monotonic()
        try:
            self.conn.send((op, args))
        except (BrokenPipeError, ConnectionResetError):
            self._raise_died(op)
        self._sent.append((op, sent))
        return sent

    def reply(self, op: str) -> PipeReply:
        """The answer to the oldest outstanding request, which must be `op`."""
        expected, sent = self._sent[0]
        assert expected == op, f"engine protocol: waiting for {op!r}, but {expected!r} is answered first"
        waited = time.monotonic()
        if not self._early and not spin_poll(self.conn):
            self.wait_for(lambda: self.conn.poll(POLL_S), f"its answer to {op!r}", watch_pipe=False)
        message = self._early.popleft() if self._early else self._recv(op)
        self._sent.popleft()
        return self._unpack(message, sent=sent, waited=waited)

    def call(self, op: str, *args):
        self.send(op, *args)
        return self.reply(op).result

    def wait_for(self, done: Callable[[], bool], what: str, *, watch_pipe: bool = True) -> None:
        """Wait until `done()`, checking between polls that the engine lives and has not reported an error.

        `done` should block for at most about POLL_S (a pipe poll) or return at once (a work's
        is_completed); returning at once, the wait backs off from 50 us to 1 ms between checks.
        """
        start, pause = time.monotonic(), 5e-5
        while not done():
            if watch_pipe and not self._early and self.conn.poll(0):
                message = self._recv(what)
                if message[0] == "error":  # its reason, the traceback's last line, on the first line
                    last = (message[2].strip().splitlines() or ["no reason given"])[-1]
                    raise EngineFailed(f"{self.who} failed while the trainer waited for {what}: {last}\n{message[2]}")
                self._early.append(message)
            self.check_alive(what)
            if time.monotonic() - start > self.timeout_s:
                raise TimeoutError(
                    f"{self.who} is alive but gave no answer for {what} "
                    f"within update.engine_timeout_s={self.timeout_s:g} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def join_thread(self, target: Callable[[], None], what: str) -> None:
        """Run a blocking call (a process-group rendezvous) in a thread, watching the engine meanwhile."""
        errors: list[BaseException] = []

        def run():
            try:
                target()
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(err)

        thread = threading.Thread(target=run, name=f"rlsync-{what}", daemon=True)
        thread.start()
        self.wait_for(lambda: (thread.join(POLL_S), not thread.is_alive())[1], what)
        if errors:
            raise errors[0]

    def blame(self, err: BaseException, what: str) -> None:
        """A transfer failed (a collective's "connection reset", say): if the engine died, say that instead."""
        self.join(CLOSE_S / 2)  # a peer that reset the connection is usually exiting: let it
        if not self.is_alive():
            raise EngineDied(self._death(what)) from err

    def check_alive(self, what: str) -> None:
        if not self.is_alive():
            self._raise_died(what)

    # -- the engine's interface ------------------------------------------------------------------

    def generate(self, prompts, *, max_new_tokens: int, temperature: float, generator: torch.Generator):
        """Generation in the engine process; the sampler's state goes there and comes back advanced,
        so the random stream is the same as with the engine in this process."""
        gen, state = self.call(
            "generate", prompts, max_new_tokens, temperature, generator.get_state(), str(generator.device)
        )
        generator.set_state(state)
        return gen

    def release(self) -> None:
        self.call("release")

    def resume(self) -> None:
        self.call("resume")

    def checksums(self) -> dict[str, int]:
        return self.call("checksums")

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of the engine's weights (tests and debugging: it moves the whole model)."""
        return self.call("weights")

    def close(self) -> None:
        """Ask the engine to exit; kill it if it does not answer within CLOSE_S. Safe to call twice.

        An engine busy with a request that cannot finish (a receive whose sender stopped) never
        answers; SIGTERM is ignored there (see `engine_main`), so it is killed.
        """
        if self.closed:
            return
        self.closed = True
        answered = False
        try:
            if self.is_alive():
                self.conn.send(("close", ()))
                deadline = time.monotonic() + CLOSE_S
                while not answered and time.monotonic() < deadline and self.is_alive():
                    if self.conn.poll(POLL_S):
                        message = self.conn.recv()  # drain answers to requests still outstanding
                        answered = message[1] == "close"
                        if answered and message[0] == "ok" and isinstance(message[2], int):
                            self.peak_rss_bytes = message[2]
        except (OSError, EOFError):
            pass
        finally:
            self.join(CLOSE_S if answered else 0.1)
            if self.is_alive():
                self.kill()
            self.conn.close()

    # -- internals -------------------------------------------------------------------------------

    def _recv(self, what: str) -> tuple:
        try:
            return self.conn.recv()
        except (EOFError, ConnectionResetError):
            self.join(CLOSE_S)  # the pipe closed: the process is exiting, get its code
            self._raise_died(what)

    def _death(self, what: str) -> str:
        return f"{self.who} {self.ended()} while the trainer waited for {what}"

    def _unpack(self, message: tuple, *, sent: float, waited: float) -> PipeReply:
        received = time.monotonic()
        if message[0] == "error":
            _, op, tb = message
            last = tb.strip().splitlines()[-1]
            raise EngineFailed(f"{self.who} failed during {op!r}: {last}\n{tb}")
        _, op, result, t_recv, t_send, t_prev_send = message
        return PipeReply(
            result, sent=sent, waited=waited, received=received, t_recv=t_recv, t_send=t_send, t_prev_send=t_prev_send
        )

    def _raise_died(self, what: str):
        self.join(0.5)
        raise EngineDied(self._death(what)) from None


class EngineProcess(EngineConnection):
    """The engine in a process started here, talked to through a pipe."""

    def __init__(self, spec: EngineSpec, receiver: Receiver, *, strategy: str, timeout_s: float):
        preload = (*engine_class(spec.rollout.engine).preload_modules(), *receiver.preload_modules())
        ctx = start_context(torch.device(spec.device), preload)
        conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=engine_main, args=(child, spec, receiver, strategy), name="rlsync-serve", daemon=True
        )
        with passive_openmp(engine_class(spec.rollout.engine).passive_cpu_threads):
            self.process.start()
        child.close()
        self._attach(conn, timeout_s, who=f"the engine process (pid {self.process.pid})")

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)

    def kill(self) -> None:
        self.process.kill()
        self.process.join()

    def ended(self) -> str:
        code = self.process.exitcode
        return f"died with {exit_description(code)}{open_files_note() if code == 0 else ''}"
