"""The standalone engine's streaming clients, and how an update meets them (serve.update_policy).

`Decoder` is one thread that generates every open answer (`POST /v1/stream`, rlsync/update/stream.py),
one token per answer per turn, round robin, each answer with its own KV cache: a token reaches its
client as soon as it is sampled. Between two tokens it checks whether it is to pause (an update) and
whether the answer's client left (its slot is freed there, at once, and its cache dropped). At most
serve.max_streams answers are open; another is refused with 503.

An update arrives from the trainer's session (rlsync/serve/app.py) and runs on the session's work
thread, under the policy the engine was started with:

- `PausePolicy` (`pause`): stop generating (between two tokens), receive the update into the
  weights themselves, go on. Clients wait the whole receive. No memory beyond the transport's.
- `StagePolicy` (`stage`): receive into a side copy of the weights while the decoder goes on with
  the live ones, then stop for the swap only: a pointer swap (each parameter takes the side copy's
  storage and the side copy the retired one, which the next update fills) where the engine's weights
  are plain tensors by the update's names (the HF engine: `Engine.holds_flat_weights`), else a local
  copy of the side copy into the weights (`serve.stage_swap=copy` forces it). It holds one more copy
  of the engine's weights, in the rollout dtype (rlsync/check/estimate.py `staged_copy_bytes`).

Answers in flight at the swap go on with the new weights (their KV cache was computed with the old
ones: each token line says which version made it); every answer started after the swap is the new
weights' alone.

An update that does not complete (its trainer killed, its connection or group broken) never leaves
weights that are neither old nor new being served under the old version. Under `stage` the live
weights were never touched: the old version serves on. Under `pause` the update lands in the live
weights themselves: if any of it may have landed, the weights are torn (`Decoder.tear`): every open
answer ends with the reason, new ones are refused (503 Torn), `GET /v1/serving` reports no version,
until a complete update lands. An update cut off before anything landed leaves the old version serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch

import rlsync.update.flat as flat
from rlsync.engines.base import Engine
from rlsync.measure.devices import copy_into
from rlsync.update.stream import ServingState, StreamLine, StreamRequest, SwapRecord


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
            raise TimeoutError(f"the staged receive did not end within {timeout_s:g} s") from None

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


class NotPaused(RuntimeError):
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
    """The thread that generates every open answer, token by token; `paused()` stops it between two tokens."""

    def __init__(self, engine: Engine, *, max_streams: int):
        self.engine, self.max_streams = engine, max_streams
        self.streams: list[Stream] = []
        self.cond = threading.Condition()
        self.pause_wanted = 0
        self.parked = True  # not between a turn's tokens (no stream, or paused)
        self.version = 0  # updates swapped in; 0: no weights yet (streams are refused)
        self.torn: Optional[str] = None  # why the weights are neither a version nor the next (streams refused)
        self.served = 0
        self.stopping = False
        self.last_update: Optional[SwapRecord] = None
        self.policy = "pause"
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
    def paused(self, timeout_s: float) -> Iterator[float]:
        """Within the block the decoder generates nothing (it stopped between two tokens); yields when it stopped."""
        with self.cond:
            self.pause_wanted += 1
            self.cond.notify_all()
            try:
                if not self.cond.wait_for(lambda: self.parked, timeout=timeout_s):
                    raise NotPaused(f"generation did not stop between two tokens within {timeout_s:g} s")
            except BaseException:
                self.pause_wanted -= 1
                self.cond.notify_all()
                raise
        try:
            yield time.perf_counter()
        finally:
            with self.cond:
                self.pause_wanted -= 1
                self.cond.notify_all()

    def receive_thread(self, nice: int) -> NicedThread:
        """The thread staged receives run on at `nice` (one per nice value, kept for the next sessions)."""
        with self.cond:
            if nice not in self.receivers:
                self.receivers[nice] = NicedThread(nice, "rlsync-engine-stage-receive")
            return self.receivers[nice]

    def swapped(self, record: Callable[[int], SwapRecord]) -> None:
        """(inside `paused`) The new weights are in: the next tokens carry the next version."""
        with self.cond:
            self.version += 1
            self.torn = None  # a complete update: every weight is the new version's
            self.last_update = record(self.version)

    def tear(self, why: str) -> None:
        """(inside `paused`) An update was cut off in the live weights: every open answer ends with `why`
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
                while not self.streams or self.pause_wanted:
                    self.parked = True
                    self.cond.notify_all()
                    self.cond.wait(0.5)
                    self._drop_cancelled()
                self.parked = False
                turn = list(self.streams)
            for stream in turn:
                if self.pause_wanted:  # read without the lock: a pause waits at most one token more
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
        version = self.version  # the weights this token is made with (a swap waits for the token to end)
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


# ----------------------------------------------------------------------------------------------
# The policies: how an update reaches the weights the decoder generates with
# ----------------------------------------------------------------------------------------------


class SideCopy:
    """The staged weights, as the transport's receiver sees an engine: where an update lands by name."""

    def __init__(self, live: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self._weights = {name: torch.empty_like(t) for name, t in live.items()}

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self._weights

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            copy_into(self._weights[name], tensor)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._weights.values())


class Landing:
    """The engine as the pause policy's receive sees it: counts the tensors handed to its `load_weights`,
    so that an update cut off says how much of it may have landed in the live weights."""

    def __init__(self, engine: Engine):
        self.engine, self.loaded = engine, 0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = list(named)
        self.loaded += len(named)  # counted before the copy: a copy that fails midway may have written
        self.engine.load_weights(named)

    def touched(self, receiver) -> str | None:
        """How much of the update may be in the live weights ("N of M tensors landed"), or None if nothing is."""
        total = sum(len(b.slots) for b in getattr(receiver, "buckets", ()))
        if getattr(receiver, "flat", None) is not None and not getattr(receiver, "slots", None):
            return f"part of its {total} tensors landed (flat engine weights receive in place)"
        return f"{self.loaded} of {total} tensors landed" if self.loaded else None


def cause_line(err: BaseException) -> str:
    """An exception as a short line: its name and its message's first sentence, less the source location
    gloo's errors start with ("[.../pair.cc:537] Read error ...: Connection reset by peer. This is ...")."""
    first = re.sub(r"^\[[^\]]*\]\s*", "", (str(err).strip().splitlines() or [""])[0]).split(". ", 1)[0]
    return f"{type(err).__name__}: {first}"[:300] if first else type(err).__name__


class PausePolicy:
    """`serve.update_policy=pause`: generation stops for the whole receive."""

    name, swap = "pause", "paused receive"

    def __init__(self, decoder: Decoder, *, wait_s: float, stage_swap: str = "auto", nice: int = 0):
        self.decoder, self.wait_s = decoder, wait_s
        self.staged_bytes = 0

    def open(self, server) -> dict:
        with self.decoder.paused(self.wait_s):  # flat engine weights are rebound here: not under a token
            return server.open()

    def update(self, server, request) -> dict:
        with self.decoder.paused(self.wait_s) as stopped:
            cpu = CpuSplit(self.decoder)
            landing = Landing(server.engine)
            try:
                result = server.receiver.handle(landing, request)
            except BaseException as err:
                raise self.cut(err, landing.touched(server.receiver)) from err
            done, split = time.perf_counter(), cpu.done()
            self.decoder.swapped(lambda v: self.record(v, stopped, done, stopped, done, split))
        return result

    def cut(self, err: BaseException, touched: str | None) -> UpdateCut:
        """(inside `paused`) The update into the live weights failed: tear them if any of it may have
        landed (`touched`: how much), else the old version serves on."""
        version, cause = self.decoder.version, cause_line(err)
        if touched is None:
            return UpdateCut(f"the update was cut off before any tensor landed ({cause}); version {version} serves on")
        self.decoder.tear(
            f"Torn: the last update was cut off with {touched}; this engine's weights are neither version "
            f"{version} nor the next: waiting for a complete update"
        )
        return UpdateCut(
            f"the update was cut off with {touched} ({cause}): generation is refused until a complete update lands"
        )

    def record(self, version: int, r0: float, r1: float, p0: float, p1: float, split: dict) -> SwapRecord:
        return SwapRecord(
            version=version,
            policy=self.name,
            swap=self.swap,
            receive_start=r0,
            receive_end=r1,
            pause_start=p0,
            pause_end=p1,
            staged_bytes=self.staged_bytes,
            **split,
        )


class StagePolicy(PausePolicy):
    """`serve.update_policy=stage`: receive into a side copy while generating, swap it in inside a short pause."""

    name = "stage"

    def __init__(self, decoder: Decoder, *, wait_s: float, stage_swap: str = "auto", nice: int = 0):
        super().__init__(decoder, wait_s=wait_s)
        # the receive (and the group's threads, started by it) at a lower priority than generation
        self.receiving = decoder.receive_thread(nice)
        engine = decoder.engine
        self.pointer = stage_swap == "auto" and type(engine).holds_flat_weights
        self.swap = "pointer swap" if self.pointer else "local copy"
        self.side: Optional[SideCopy] = None
        self.retired: Optional[list[torch.Tensor]] = None  # flat weights: the bank the live weights are views of

    def open(self, server) -> dict:
        engine, receiver = server.engine, server.receiver
        live = engine.weights
        if self.pointer and not all(isinstance(t, torch.nn.Parameter) for t in live.values()):
            # views of fused parameters (a MoE's experts, checkpoint layout): rebinding a view's data would leave
            # the parameter as it was, so the swap copies
            self.pointer, self.swap = False, "local copy"
        self.side = SideCopy(live, engine.device, engine.dtype)
        # on the receive's thread: the group's threads start there and inherit its nice value
        result = self.receiving.run(lambda: receiver.open(self.side), self.bound(receiver))
        # flat weights: the side copy is now views of the receiver's buffers
        self.staged_bytes = self.side.nbytes
        if self.pointer and receiver.flat is not None:
            # the live weights as views of a second bank laid out alike: a swap trades the banks whole
            with self.decoder.paused(self.wait_s):
                self.retired = flat.allocate(receiver.buckets, engine.device)
                flat.bind(live, receiver.buckets, self.retired)
        return result

    def update(self, server, request) -> dict:
        r0, cpu = time.perf_counter(), CpuSplit(self.decoder)
        receiver = server.receiver
        try:
            result = self.receiving.run(lambda: receiver.handle(self.side, request), self.bound(receiver))
        except BaseException as err:  # only the side copy was written: the live weights are untouched
            raise UpdateCut(
                f"the staged update was cut off ({cause_line(err)}); version {self.decoder.version} serves on"
            ) from err
        r1, split = time.perf_counter(), cpu.done()
        with self.decoder.paused(self.wait_s) as stopped:
            try:
                self._swap(server)
            except BaseException as err:
                raise self.cut(err, "part of its tensors swapped in") from err
            done = time.perf_counter()
            self.decoder.swapped(lambda v: self.record(v, r0, r1, stopped, done, split))
        return result

    def bound(self, receiver) -> float:
        """The longest a receive may take: each of its waits is cut to serve.max_wait_s."""
        return self.wait_s * (len(getattr(receiver, "buckets", ())) + 2)

    @torch.no_grad()
    def _swap(self, server) -> None:
        live, staged = server.engine.weights, self.side.weights
        if not self.pointer:
            server.engine.load_weights(staged.items())
            return
        for name, param in live.items():
            side = staged[name]
            old = param.data
            param.data = side.data  # the parameter object stays: modules and tied weights keep pointing at it
            side.data = old
        receiver = server.receiver
        if self.retired is not None:  # the receiver fills the retired bank next
            receiver.flat, self.retired = self.retired, receiver.flat


POLICY_CLASSES = {"pause": PausePolicy, "stage": StagePolicy}


def policy_for(cfg, decoder: Decoder) -> PausePolicy:
    """The policy serve.update_policy names, for one trainer session."""
    decoder.policy = cfg.serve.update_policy
    return POLICY_CLASSES[cfg.serve.update_policy](
        decoder, wait_s=cfg.serve.max_wait_s, stage_swap=cfg.serve.stage_swap, nice=cfg.serve.stage_nice
    )
