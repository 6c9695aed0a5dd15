"""The standalone engine's streaming clients: the decoder that generates their answers, and its hold.

`Decoder` is one thread that generates every open answer (`POST /v1/stream`, rlsync/client/stream.py),
one token per answer per turn, round robin, each answer with its own KV cache: a token reaches its
client as soon as it is sampled. Between two tokens it checks whether it is held (an update's swap)
and whether the answer's client left (its slot is freed there, at once, and its cache dropped). At most
serve.max_streams answers are open; another is refused with 503.

`Decoder.hold(timeout_s)` stops generation between two tokens for a block; what runs inside it, and
when, is the update policy's (serve.update_policy, rlsync/serve/policies/). The gap a streaming client
sees during an update is its stall: the hold, plus the token in progress when it began.

Answers in flight at a swap go on with the new weights (their KV cache was computed with the old
ones: each token line says which version made it); every answer started after the swap is the new
weights' alone. An update cut off in the live weights tears them (`Decoder.tear`): every open answer
ends with the reason, new ones are refused (503 Torn), `GET /v1/serving` reports no version, until a
complete update lands.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch

from rlsync.client.stream import ServingState, StreamLine, StreamRequest, SwapRecord
from rlsync.engines.base import Engine


def process_cpu_s() -> float:
    """CPU seconds this process has used, every thread (user + system)."""
    times = os.times()
    return times.user + times.system


def thread_cpu_s(native_id: Optional[int]) -> float:
    """CPU seconds thread `native_id` of this process has used (Linux /proc; 0.0 where unreadable)."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class CpuSplit:
    """The CPU the engine process and its decoder thread use over a stretch (the receive)."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.engine0, self.decoder0 = process_cpu_s(), thread_cpu_s(decoder.native_id)

    def done(self) -> dict[str, float]:
        return {
            "engine_cpu_s": process_cpu_s() - self.engine0,
            "decoder_cpu_s": thread_cpu_s(self.decoder.native_id) - self.decoder0,
        }


class NicedThread:
    """One thread that runs the jobs given to it at `nice` (Linux: a thread's own nice value, which the
    threads it starts inherit: gloo's, OpenMP's), so the scheduler gives the cores to generation first."""

    def __init__(self, nice: int, name: str):
        self.nice = nice
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.applied: Optional[int] = None  # the nice value it runs at (None: it could not be set)
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def run(self, job: Callable, timeout_s: float):
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((job, future))
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the receive did not end within {timeout_s:g} s") from None

    def _run(self) -> None:
        if self.nice:
            try:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self.nice)
                self.applied = os.getpriority(os.PRIO_PROCESS, tid)
            except (OSError, AttributeError):
                self.applied = None
        while True:
            job, future = self.jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(err)


class NotHeld(RuntimeError):
    """The decoder did not reach a point between two tokens within the wait's bound."""


class UpdateCut(RuntimeError):
    """An update that did not complete: what it left the engine serving, in one line (its cause chained)."""


@dataclass
class Stream:
    """One answer being generated for one client."""

    request: StreamRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    generator: torch.Generator
    cancel: threading.Event = field(default_factory=threading.Event)  # its client left: stop at the next turn
    cache: object = None
    last: int = -1  # the token fed at the next step
    position: int = 0
    generated: int = 0
    ended: bool = False

    def emit(self, line: StreamLine) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, line)
        except RuntimeError:  # the server's loop is gone (the engine is exiting)
            self.cancel.set()


class Decoder:
    """The thread that generates every open answer, token by token; `hold()` stops it between two tokens."""

    def __init__(self, engine: Engine, *, max_streams: int):
        self.engine, self.max_streams = engine, max_streams
        self.streams: list[Stream] = []
        self.cond = threading.Condition()
        self.holds = 0  # holds asked for (an update's swap): generation stops between two tokens while any is
        self.parked = True  # not between a turn's tokens (no stream, or held)
        self.version = 0  # updates swapped in; 0: no weights yet (streams are refused)
        self.torn: Optional[str] = None  # why the weights are neither a version nor the next (streams refused)
        self.served = 0
        self.stopping = False
        self.last_update: Optional[SwapRecord] = None
        self.policy = ""  # serve.update_policy, as GET /v1/serving reports it (Control sets it)
        self.native_id: Optional[int] = None  # the decoder thread's, for its CPU time (CpuSplit)
        self.receivers: dict[int, NicedThread] = {}
        self.streaming = hasattr(engine, "model") and hasattr(engine, "allowed")  # the HF engine's parts
        if self.streaming:
            from transformers import DynamicCache  # loaded with the engine's model already

            from rlsync.engines.hf import cache_kwarg

            self._cache_cls, self._cache_kw = DynamicCache, cache_kwarg(engine.model)
        threading.Thread(target=self._run, name="rlsync-engine-decoder", daemon=True).start()

    # -- clients -------------------------------------------------------------------------------

    def open(self, request: StreamRequest, loop: asyncio.AbstractEventLoop) -> Stream | tuple[int, str]:
        """A stream for `request`, or (HTTP status, why) it is refused."""
        if not self.streaming:
            return 501, "Unsupported: streaming needs an engine that exposes its model (rollout.engine=hf)"
        device = self.engine.device
        generator = torch.Generator(device=device).manual_seed(request.seed)
        stream = Stream(request, loop, asyncio.Queue(), generator)
        with self.cond:
            if self.stopping:
                return 503, "EngineStopping: this engine is shutting down"
            if self.torn is not None:
                return 503, self.torn
            if self.version == 0:
                return 409, "NoWeights: no update has reached this engine yet (a trainer's first update fills it)"
            busy = sum(not s.cancel.is_set() for s in self.streams)
            if busy >= self.max_streams:
                return 503, f"Busy: {busy} answers are streaming, serve.max_streams={self.max_streams}"
            self.streams.append(stream)
            self.served += 1
            self.cond.notify_all()
        return stream

    def state(self) -> ServingState:
        with self.cond:
            return ServingState(
                version=self.held,
                torn=self.torn,
                policy=self.policy,
                streams=sum(not s.cancel.is_set() for s in self.streams),
                max_streams=self.max_streams,
                served=self.served,
                last_update=self.last_update,
                engine_cpu_s=process_cpu_s(),
                decoder_cpu_s=thread_cpu_s(self.native_id),
            )

    @property
    def held(self) -> Optional[int]:
        """The version of the weights the engine holds; None while they are torn."""
        return None if self.torn is not None else self.version

    def stop(self) -> None:
        """Every open answer ends ("cancelled"); no new one starts."""
        with self.cond:
            self.stopping = True
            for stream in self.streams:
                stream.cancel.set()
            self.cond.notify_all()

    # -- the update's side -----------------------------------------------------------------------

    @contextmanager
    def hold(self, timeout_s: float) -> Iterator[float]:
        """Within the block the decoder generates nothing (it stopped between two tokens); yields when it stopped."""
        with self.cond:
            self.holds += 1
            self.cond.notify_all()
            try:
                if not self.cond.wait_for(lambda: self.parked, timeout=timeout_s):
                    raise NotHeld(f"generation did not stop between two tokens within {timeout_s:g} s")
            except BaseException:
                self.holds -= 1
                self.cond.notify_all()
                raise
        try:
            yield time.perf_counter()
        finally:
            with self.cond:
                self.holds -= 1
                self.cond.notify_all()

    def receive_thread(self, nice: int) -> NicedThread:
        """A thread for receives beside generation, at `nice` (one per nice value, kept for the next sessions)."""
        with self.cond:
            if nice not in self.receivers:
                self.receivers[nice] = NicedThread(nice, "rlsync-engine-receive")
            return self.receivers[nice]

    def swapped(self, record: Callable[[int], SwapRecord]) -> None:
        """(inside `hold`) The new weights are in: the next tokens carry the next version."""
        with self.cond:
            self.version += 1
            self.torn = None  # a complete update: every weight is the new version's
            self.last_update = record(self.version)

    def tear(self, why: str) -> None:
        """(inside `hold`) An update was cut off in the live weights: every open answer ends with `why`
        (no token of torn weights reaches a client), and none starts until `swapped`."""
        with self.cond:
            self.torn = why
            for stream in list(self.streams):
                self._end(stream, "error", why)
            self.cond.notify_all()

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        if self.engine.device.type == "cuda":
            torch.cuda.set_device(self.engine.device)
        while True:
            with self.cond:
                self._drop_cancelled()
                while not self.streams or self.holds:
                    self.parked = True
                    self.cond.notify_all()
                    self.cond.wait(0.5)
                    self._drop_cancelled()
                self.parked = False
                turn = list(self.streams)
            for stream in turn:
                if self.holds:  # read without the lock: a hold waits at most one token more
                    break
                self._step(stream)

    def _drop_cancelled(self) -> None:
        """(under the lock) Answers whose client left: their slots and caches freed, their end line sent."""
        for stream in [s for s in self.streams if s.cancel.is_set()]:
            self._end(stream, "cancelled")

    def _end(self, stream: Stream, reason: str, error: Optional[str] = None) -> None:
        if stream in self.streams:
            self.streams.remove(stream)
        if not stream.ended:
            stream.ended, stream.cache = True, None
            stream.emit(StreamLine(kind="end", version=self.held, t=time.perf_counter(), reason=reason, error=error))

    def _step(self, stream: Stream) -> None:
        if stream.cancel.is_set():
            return  # dropped at the next turn's start
        version = self.version  # the weights this token is made with (a hold waits for the token to end)
        try:
            token, logprob = self._next_token(stream)
        except Exception as err:  # noqa: BLE001 - this answer fails alone; the others go on
            with self.cond:
                self._end(stream, "error", f"{type(err).__name__}: {err}"[:500])
            return
        stream.generated += 1
        stream.emit(StreamLine(kind="token", token=token, logprob=logprob, version=version, t=time.perf_counter()))
        reason = (
            "eos"
            if token == self.engine.eos_id
            else ("length" if stream.generated >= stream.request.max_new_tokens else None)
        )
        if reason is not None:
            with self.cond:
                self._end(stream, reason)

    @torch.no_grad()
    def _next_token(self, stream: Stream) -> tuple[int, float]:
        engine, device = self.engine, self.engine.device
        if stream.cache is None:  # the prompt, whole
            stream.cache = self._cache_cls(config=engine.model.config)
            ids = torch.tensor([stream.request.prompt], device=device)
            positions = torch.arange(ids.shape[1], device=device).unsqueeze(0)
            stream.position = ids.shape[1]
        else:
            ids = torch.tensor([[stream.last]], device=device)
            positions = torch.tensor([[stream.position]], device=device)
            stream.position += 1
        out = engine.model(input_ids=ids, position_ids=positions, use_cache=True, **{self._cache_kw: stream.cache})
        temperature = stream.request.temperature
        logits = out.logits[:, -1, :].float() / (temperature if temperature > 0 else 1.0)
        logp = torch.log_softmax(logits.masked_fill(~engine.allowed, float("-inf")), dim=-1)[0]
        if temperature > 0:
            token = int(torch.multinomial(logp.exp(), 1, generator=stream.generator))
        else:
            token = int(logp.argmax())
        stream.last = token
        return token, float(logp[token])
