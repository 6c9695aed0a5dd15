"""The standalone engine's control plane: a FastAPI app over one engine, one trainer session at a time.

The wire (typed JSON messages, no pickle) is rlsync/sync/messages.py; the hardening against bad
clients is rlsync/serve/http.py; the entry point is rlsync/serve/server.py.

A session is the life of one `POST /v1/session` request: the trainer sends its plan, the engine
checks it (on its work thread), answers with a stream whose first line accepts the session and names
it, then a heartbeat line every HEARTBEAT_S, and "ended" when the trainer closes it. If the trainer
goes away (killed, network gone) the stream's connection breaks and the session ends; if the engine
goes away, the trainer's read of the stream ends. Every other request names the session.

Nothing a client does holds the engine longer than the operator allows (serve.* keys):
- the trainer sends `POST /v1/heartbeat` every second; a session that hears nothing from its trainer
  for serve.session_timeout_s is ended, as one whose stream breaks is;
- a session that ends (or a request whose client disconnects) cancels its work: the HF engine checks
  between generated tokens (rlsync.engines.base.check_cancelled), queued requests never start;
- a generate request over serve.max_generate_tokens (prompts x max_new_tokens) is refused before it
  starts; the plan's waits (its store, its group, a broadcast) are cut to serve.max_wait_s, which
  bounds what cannot be cancelled (a blocked rendezvous);
- `stop()` (SIGINT, SIGTERM) cancels the session's work and ends it before the HTTP server closes.

Everything that touches the engine runs on one thread (`WorkThread`), in order; the asyncio loop
only routes, authenticates and streams, so `/health` and a busy refusal answer at once while an
update or a generation runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import queue
import secrets
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from rlsync.engines.base import Cancelled, cancelled_by, check_cancelled
from rlsync.fmt import MIB
from rlsync.serve.http import BodyLimit, drop_line
from rlsync.sync.broadcast import BroadcastReceiver
from rlsync.sync.engine_process import EngineServer
from rlsync.sync.messages import (
    OPS,
    REQUESTS,
    SESSION_HEADER,
    Failure,
    Health,
    Plan,
    Reply,
    SessionEvent,
    WireError,
    encode_result,
    request_args,
)

HEARTBEAT_S = 1.0  # the session stream's pulse: how soon either side notices the other gone
STOP_GRACE_S = 5.0  # on stop: how long the work in progress may take to notice its cancellation


def log(line: str) -> None:
    print(f"rlsync engine: {line}", file=sys.stdout, flush=True)


class WorkThread:
    """The one thread that works on the engine: jobs run in order, never on the event loop.

    A daemon thread, so that an engine stopped by a signal exits even while a job waits on a
    trainer that will never send (the job's own timeout would end it later)."""

    def __init__(self, device):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.op: Optional[str] = None  # the job running now (what /health reports)
        self.device = device
        threading.Thread(target=self._run, name="rlsync-engine-work", daemon=True).start()

    def submit(self, op: str, job: Callable) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((op, job, future))
        return future

    async def run(self, op: str, job: Callable):
        return await asyncio.wrap_future(self.submit(op, job))

    def wait_idle(self, timeout: float) -> bool:
        """Whether the jobs queued so far are done within `timeout` seconds."""
        try:
            self.submit("idle", lambda: None).result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def _run(self) -> None:
        if self.device.type == "cuda":  # the current device is per thread: this one works on the engine's
            torch.cuda.set_device(self.device)
        while True:
            op, job, future = self.jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            self.op = op
            try:
                future.set_result(job())
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(err)
            finally:
                self.op = None


@dataclass
class Session:
    number: int
    trainer: str  # "HOST:PORT" of the trainer's session request
    key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    since: str = field(default_factory=lambda: time.strftime("%H:%M:%S"))
    server: object = None  # engine_process.EngineServer once the plan is accepted
    t_prev_send: float = field(default_factory=time.monotonic)
    ended: Optional[str] = None  # how it ended, once it has
    last_seen: float = field(default_factory=time.monotonic)  # the trainer's last request or heartbeat
    cancel: threading.Event = field(default_factory=threading.Event)  # set once it is to end: its work stops
    wake: Optional[asyncio.Event] = None  # set when it ends, so that its stream says so at once
    loop: Optional[asyncio.AbstractEventLoop] = None  # the loop `wake` belongs to


class Control:
    """The engine's control plane: `app` is the ASGI app to serve; `wait(n)` returns once n sessions are over."""

    def __init__(self, engine, cfg, *, token: Optional[bytes], log_line: Callable[[str], None] = log):
        self.engine, self.cfg, self.token, self.log = engine, cfg, token, log_line
        self.work = WorkThread(engine.device)
        self.session: Optional[Session] = None
        self.served = 0  # sessions let in (a refused plan counts: it was this engine's answer to a trainer)
        self.finished = 0
        self.stopping = False
        self.changed = threading.Condition()
        self.app = BodyLimit(
            self._build(), request_timeout_s=cfg.serve.request_timeout_s, max_bytes=int(cfg.serve.max_request_mb * MIB)
        )

    def wait(self, sessions: int) -> None:
        """Until `sessions` sessions are over (0: forever), in slices, so Ctrl-C and SIGTERM stop it."""
        with self.changed:
            while sessions == 0 or self.finished < sessions:
                self.changed.wait(0.5)

    # -- the routes ------------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/health")
        async def health() -> Response:
            return json_response(
                200, Health(status="ok", model=self.cfg.model.name, busy=self.session is not None, op=self.work.op)
            )

        @app.post("/v1/session")
        async def session(request: Request) -> Response:
            refused = self._refusal(request, "session")
            if refused is not None:
                return refused
            try:
                plan = Plan.model_validate_json(await request.body())
            except ValidationError as err:
                return bad_request(request, "session", err)
            return await self._open_session(request, plan)

        @app.post("/v1/heartbeat")
        async def heartbeat(request: Request) -> Response:
            refused = self._refusal(request, "heartbeat")
            if refused is not None:
                return refused
            session = self._session_of(request)
            if session is None:
                return no_session("heartbeat")
            session.last_seen = time.monotonic()
            return Response(status_code=204)

        @app.post("/v1/{op}")
        async def call(op: str, request: Request) -> Response:
            refused = self._refusal(request, op)
            if refused is not None:
                return refused
            session = self._session_of(request)
            if session is None:
                return no_session(op)
            session.last_seen = time.monotonic()
            try:
                body = REQUESTS[op].model_validate_json(await request.body() or b"{}")
                args = request_args(op, body)
            except (ValidationError, WireError) as err:
                return bad_request(request, op, err)
            if op == "generate":
                problem = generate_problem(args, self.cfg)
                if problem is not None:  # refused before it starts: the engine never takes on the work
                    self.log(f"session {session.number}: refused a generate request: {problem}")
                    return json_response(422, Failure(op=op, error=problem))
            return await self._call(session, op, args, request)

        return app

    def _refusal(self, request: Request, op: str) -> Optional[Response]:
        """Why this request is not served (an unknown op, no or a wrong token), as its answer; None if it is."""
        if op not in OPS and op not in ("session", "heartbeat"):
            return json_response(404, Failure(op=op, error=f"BadRequest: no such request {op!r}"))
        if self.token is None:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.encode("latin-1"), self.token):
            return None
        drop_line(request.client, "no token or the wrong one (RLSYNC_ENGINE_TOKEN)")
        return json_response(
            401,
            Failure(
                op=op, error="Unauthorized: this engine needs its token (RLSYNC_ENGINE_TOKEN, the same on both sides)"
            ),
            close=True,
        )

    def _session_of(self, request: Request) -> Optional[Session]:
        session, named = self.session, request.headers.get(SESSION_HEADER, "")
        if session is None or session.ended is not None or session.server is None or session.cancel.is_set():
            return None
        return session if hmac.compare_digest(named.encode("latin-1"), session.key.encode()) else None

    async def _open_session(self, request: Request, plan: Plan) -> Response:
        trainer = f"{request.client[0]}:{request.client[1]}"
        if self.stopping:
            return json_response(503, Failure(op="start", error="EngineStopping: this engine is shutting down"))
        current = self.session
        if current is not None:
            self.log(f"refused trainer {trainer}: busy with trainer {current.trainer} (since {current.since})")
            return json_response(
                409,
                Failure(
                    op="start",
                    error=f"EngineBusy: this engine is serving trainer "
                    f"{current.trainer} (since {current.since}); it serves one trainer "
                    f"at a time",
                ),
            )
        self.served += 1
        session = self.session = Session(self.served, trainer)  # no await since the check: no other claim between
        session.wake, session.loop = asyncio.Event(), asyncio.get_running_loop()
        self.log(f"session {session.number}: trainer {trainer} connected")
        try:
            problem = await self.work.run("start", lambda: self._admit(session, plan, request))
        except Exception:  # noqa: BLE001 - the engine failed to get ready: the trainer hears its traceback
            self._over(session, "refused: the engine failed to get ready (the trainer has its traceback)")
            return json_response(500, Failure(op="start", error=traceback.format_exc()))
        if problem is not None:
            self._over(session, f"refused: {problem}")
            return json_response(422, Failure(op="start", error=f"PlanMismatch: {problem}"))
        return StreamingResponse(self._events(session), media_type="application/x-ndjson")

    def _admit(self, session: Session, plan: Plan, request: Request) -> Optional[str]:
        """(work thread) Check the trainer's plan against this engine's weights and get ready to
        receive: the problem in one line, or None."""
        try:
            buckets = plan.bucket_plan()
        except WireError as err:
            return f"the trainer's plan is malformed: {err}"
        problem = plan_mismatch(buckets, self.engine.weights)
        if problem is not None:
            return problem
        cap = self.cfg.serve.max_wait_s  # the trainer's timeouts, but never past this engine's own
        receiver = BroadcastReceiver(
            buckets,
            strategy=plan.strategy,
            inflight=plan.inflight,
            flat_weights=plan.flat_weights,
            port=plan.store_port,
            timeout_s=min(plan.timeout_s, cap),
            join_timeout_s=min(plan.join_timeout_s, cap),
            copy_threads=plan.copy_threads,
        )
        receiver.host = request.client[0]  # the trainer's store, at the address its request came from
        receiver.bind_host = request.scope["server"][0]  # this engine's end of that connection: where gloo listens
        self.engine.resume()  # the last session may have ended with the engine's memory released
        session.server = EngineServer(self.engine, receiver)
        return None

    async def _events(self, session: Session):
        """The session stream: accepted, a heartbeat every HEARTBEAT_S, ended. If it breaks (the
        trainer is gone) or the trainer falls silent for serve.session_timeout_s, the session's work
        is cancelled and the session ends."""
        session.last_seen = time.monotonic()
        timeout_s = self.cfg.serve.session_timeout_s
        try:
            yield event_line(SessionEvent(event="accepted", session=session.key))
            while session.ended is None:
                try:
                    await asyncio.wait_for(session.wake.wait(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    silent = time.monotonic() - session.last_seen
                    if silent > timeout_s and not session.cancel.is_set():
                        self.abandon(
                            session,
                            f"the trainer sent nothing for {silent:.0f} s (serve.session_timeout_s={timeout_s:g})",
                        )
                    if not session.cancel.is_set():
                        yield event_line(SessionEvent(event="heartbeat"))
            yield event_line(SessionEvent(event="ended", detail=session.ended))
        finally:
            if session.ended is None:
                self.abandon(session, "the trainer went away without closing it")

    def abandon(self, session: Session, why: str) -> None:
        """End `session` without its trainer: cancel its work (running or queued), then end it on the
        work thread once the job in progress has stopped."""
        if session.cancel.is_set() or session.ended is not None:
            return
        session.cancel.set()
        self.work.submit("end", lambda: self._end(session, why))

    def stop(self) -> bool:
        """(main thread) The engine is stopping: refuse new sessions, cancel and end the current one.
        Whether the work thread came to rest within STOP_GRACE_S (False: it is blocked in work that
        cannot be cancelled, such as a rendezvous, bounded by serve.max_wait_s)."""
        self.stopping = True
        session = self.session
        if session is not None:
            self.abandon(session, "the engine stopped")  # thread-safe: an event and a queued job
        return self.work.wait_idle(STOP_GRACE_S)

    async def _call(self, session: Session, op: str, args: tuple, request: Request) -> Response:
        client_left = threading.Event()  # this request's connection closed: its work is cancelled

        def job():
            t_recv = time.monotonic()
            with cancelled_by(session.cancel, client_left):
                check_cancelled()  # queued behind work that ended the session, or its client left
                result = getattr(session.server, op)(*args)
            if op == "close":
                self._end(session, "the trainer closed it")
            encoded = encode_result(op, result)
            return t_recv, encoded, time.monotonic()

        future = self.work.submit(op, job)
        done = asyncio.wrap_future(future)
        left = asyncio.ensure_future(disconnected(request))
        await asyncio.wait({done, left}, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():  # the client went away first: nobody waits for this answer
            client_left.set()
            future.cancel()  # a job still queued never starts
            done.add_done_callback(lambda f: f.cancelled() or f.exception())  # its end is nobody's error
            self.log(f"session {session.number}: {op!r} cancelled: its client closed the connection")
            return Response(status_code=499)
        left.cancel()
        try:
            t_recv, result, t_send = done.result()
        except Cancelled:
            why = session.ended or ("the session is ending" if session.cancel.is_set() else "its client left")
            return json_response(500, Failure(op=op, error=f"Cancelled: {op!r} was cancelled: {why}"))
        except Exception:  # noqa: BLE001 - reported to the trainer, which raises it
            return json_response(500, Failure(op=op, error=traceback.format_exc()))
        reply = Reply(op=op, result=result, t_recv=t_recv, t_send=t_send, t_prev_send=session.t_prev_send)
        session.t_prev_send = t_send
        return json_response(200, reply)

    def _end(self, session: Session, why: str) -> None:
        """(work thread) The session is over: leave the group, free the engine for the next trainer."""
        if session.ended is not None:
            return
        try:
            if session.server is not None:
                session.server.receiver.close()
        finally:
            self._over(session, f"ended: {why}", why)

    def _over(self, session: Session, line: str, why: Optional[str] = None) -> None:
        session.ended = why or line
        if self.session is session:
            self.session = None
        try:
            session.loop.call_soon_threadsafe(session.wake.set)
        except RuntimeError:  # the server's loop is gone: the engine is exiting
            pass
        self.log(f"session {session.number}: {line}")
        with self.changed:
            self.finished += 1
            self.changed.notify_all()


def generate_problem(args: tuple, cfg) -> Optional[str]:
    """Why this engine refuses a generate request before starting it (its work or its length), or None."""
    prompts, max_new_tokens = args[0], args[1]
    longest, max_positions = max(len(p) for p in prompts), cfg.model.max_position_embeddings
    if longest + max_new_tokens > max_positions:
        return (
            f"BadRequest: prompts of {longest} tokens plus {max_new_tokens} new ones exceed this engine's "
            f"model.max_position_embeddings={max_positions}"
        )
    work, ceiling = len(prompts) * max_new_tokens, cfg.serve.max_generate_tokens
    if work > ceiling:
        return (
            f"TooMuchWork: {len(prompts)} prompts x {max_new_tokens} new tokens = {work} tokens exceed this "
            f"engine's serve.max_generate_tokens={ceiling} (fewer prompts per request, shorter answers, or an "
            f"engine started with a larger serve.max_generate_tokens)"
        )
    return None


async def disconnected(request: Request) -> None:
    """Returns once the client of `request` (whose body was read) has closed its connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def no_session(op: str) -> Response:
    return json_response(
        409,
        Failure(
            op=op,
            error="NoSession: this request names no session of this engine's (it ended, or another trainer's is on)",
        ),
    )


def event_line(event: SessionEvent) -> bytes:
    return event.model_dump_json(exclude_none=True).encode() + b"\n"


def json_response(status: int, message, *, close: bool = False) -> Response:
    headers = {"connection": "close"} if close else None
    return Response(message.model_dump_json(), status_code=status, media_type="application/json", headers=headers)


def bad_request(request: Request, op: str, err: Exception) -> Response:
    """A typed message that does not validate: the client is dropped (one line), told why in its answer."""
    if isinstance(err, ValidationError):
        first = err.errors()[0]
        why = f"{'.'.join(map(str, first['loc'])) or 'body'}: {first['msg']}"
    else:
        why = str(err)
    drop_line(request.client, f"sent a malformed {op!r} request ({why[:200]})")
    return json_response(422, Failure(op=op, error=f"BadRequest: malformed {op!r} request: {why[:500]}"), close=True)


def plan_mismatch(buckets, weights: dict) -> str | None:
    """Why a trainer's bucket plan cannot land in these weights (one line), or None if it can."""
    planned = {s.meta.name: s.meta for b in buckets for s in b.slots}
    missing = sorted(set(planned) - set(weights))
    if missing:
        return (
            f"the trainer's update names {len(missing)} tensor(s) this engine's model lacks (first: {missing[0]!r}); "
            f"start the engine with the trainer's model settings"
        )
    for name, meta in planned.items():
        tensor = weights[name]
        if tuple(tensor.shape) != tuple(meta.shape) or tensor.dtype != meta.dtype:
            return (
                f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype} in this engine but "
                f"{tuple(meta.shape)} {meta.dtype} in the trainer's update; start the engine with the trainer's "
                f"model and rollout.dtype settings"
            )
    unfilled = sorted(set(weights) - set(planned))
    if unfilled:
        return (
            f"the trainer's update leaves {len(unfilled)} of this engine's tensor(s) unfilled (first: "
            f"{unfilled[0]!r}); start the engine with the trainer's model settings"
        )
    return None
