"""The client of an engine started on its own (`python -m rlsync.serve`): `RemoteEngine`, the one class
a trainer holds for it, and what it is made of.

The `broadcast` transport normally starts its engine process itself and talks to it through a
pipe. With `update.engine_address=HOST:PORT` it joins an engine started on its own instead (on this
machine or another): the same requests and replies as through the pipe (rlsync/engines/process.py)
travel as typed JSON messages over HTTP (rlsync/client/messages.py; stdlib http.client, nothing is
ever unpickled), while the weights travel in the trainer-engine gloo group, as they do locally.

- `reach`: wait (up to update.engine_connect_timeout_s) until `GET /health` answers; it also tells
  the address of this machine's interface toward the engine, where the group's store then listens.
- `RemoteEngine(address, receiver, ...)`: send the plan; the engine accepts (the session's stream
  starts) or refuses (busy, another model) in one line. It is the engine's handle as an engine
  process's is (rlsync.engines.process.EngineConnection), alive as long as its session is; its
  `SessionWire` is the session as a message connection: a request thread (one HTTP request at a
  time, in order) and a watch thread reading the session stream's heartbeats, which sees the engine
  gone when the stream breaks or falls silent.
- The heartbeat thread tells the engine every HEARTBEAT_S that this trainer is alive (`POST
  /v1/heartbeat`): an engine ends a session it hears nothing from (serve.session_timeout_s).
- Every wait is bounded: each connection attempt and the handshake by the connect timeout, each
  request and the stream's silence by update.engine_timeout_s (RemoteEngine raises first).
- A token (RLSYNC_ENGINE_TOKEN), when set, goes with every request; an engine listening beyond
  loopback requires it.
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from collections import deque
from typing import Optional

from pydantic import ValidationError

from rlsync.client.messages import (
    SESSION_HEADER,
    Failure,
    Health,
    Plan,
    Reply,
    SessionEvent,
    decode_result,
    request_body,
)
from rlsync.engines.process import EngineConnection, Receiver
from rlsync.errors import RlsyncError

TOKEN_ENV = "RLSYNC_ENGINE_TOKEN"  # the shared secret of the engine's control plane (required beyond loopback)
DEFAULT_PORT = 29610  # where `python -m rlsync.serve` listens unless update.engine_address names a port
CONNECT_RETRY_S = 0.2  # between attempts while the engine is still starting
MAX_EVENT_BYTES = 4096  # one line of the session stream
MAX_REPLY_BYTES = 1 << 34  # a reply's body (weights() of the largest model read back stays under it)
REQUEST_SLACK_S = 5.0  # a request's socket timeout past update.engine_timeout_s: RemoteEngine times out first
HEARTBEAT_S = 1.0  # how often the trainer tells the engine it is alive (the engine's serve.session_timeout_s: 30 s)


class EngineUnreachable(RlsyncError):
    """No engine answered at update.engine_address within update.engine_connect_timeout_s, or it refused our token."""


def parse_address(text: str, *, default_port: int | None = None) -> tuple[str, int]:
    """ "host:port" (or "[v6 host]:port", or "host" with `default_port`) -> (host, port); ValueError otherwise."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ("" if not rest else None)
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            host, port_text = text, ""
    if not host or port_text is None:
        raise ValueError(f"not HOST:PORT: {text!r}")
    if port_text == "":
        if default_port is None:
            raise ValueError(f"no port in {text!r}")
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"port {port_text!r} is not 0 to 65535")
    return host, int(port_text)


def token_headers() -> dict[str, str]:
    token = os.environ.get(TOKEN_ENV, "")
    return {"Authorization": f"Bearer {token}"} if token.strip() else {}


class Exchange:
    """One HTTP request on a connection of its own, every socket operation under `timeout_s`."""

    def __init__(self, address: str, timeout_s: float):
        self.address = address
        host, port = parse_address(address)
        self.conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        self.sock: Optional[socket.socket] = None  # kept: http.client drops its own when a reply says "close"

    def send(self, method: str, path: str, body: Optional[bytes] = None, headers: Optional[dict] = None):
        headers = {**token_headers(), **(headers or {})}
        if body is not None:
            headers["Content-Type"] = "application/json"
        self.conn.connect()
        self.sock = self.conn.sock
        self.conn.request(method, path, body=body, headers=headers)
        return self.conn.getresponse()

    def local_host(self) -> str:
        """This machine's address on the connection: the interface that reaches the engine."""
        return self.sock.getsockname()[0]

    def shutdown(self) -> None:
        """Break the connection now (a reader blocked on it wakes up)."""
        try:
            if self.sock is not None:
                self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        self.conn.close()


def read_body(response, limit: int = MAX_REPLY_BYTES) -> bytes:
    length = response.getheader("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise ValueError(f"a reply of {length} bytes")
    body = response.read(limit + 1)
    if len(body) > limit:
        raise ValueError(f"a reply over {limit} bytes")
    return body


def failure_text(body: bytes) -> str:
    """The `error` of a Failure reply, or what the body starts with."""
    try:
        return Failure.model_validate_json(body).error
    except ValidationError:
        return body[:200].decode("utf-8", "replace")


def unreachable(address: str, timeout_s: float, why: str) -> EngineUnreachable:
    return EngineUnreachable(
        f"no rlsync engine answered at update.engine_address={address} within {timeout_s:g} s "
        f"({why}): start one there with `python -m rlsync.serve update.engine_address={address}` "
        f"and the trainer's model settings"
    )


def refused_token(address: str) -> EngineUnreachable:
    return EngineUnreachable(
        f"the engine at update.engine_address={address} refused this trainer's token: set the same "
        f"{TOKEN_ENV} on both sides"
    )


def reach(address: str, *, timeout_s: float) -> str:
    """Wait until the engine at `address` answers `GET /health`; return this machine's address on that
    connection (the interface facing the engine). EngineUnreachable after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        exchange = Exchange(address, max(remaining, 0.05))
        try:
            response = exchange.send("GET", "/health")
            body = read_body(response, MAX_EVENT_BYTES)
            if response.status == 200:
                Health.model_validate_json(body)
                return exchange.local_host()
            why = f"it answered HTTP {response.status}: not an rlsync engine"
        except ValidationError:
            why = "its /health answer is not an rlsync engine's"
        except (OSError, http.client.HTTPException, ValueError) as err:
            why = str(getattr(err, "strerror", None) or err or type(err).__name__)
        finally:
            exchange.close()
        if time.monotonic() + CONNECT_RETRY_S >= deadline:
            raise unreachable(address, timeout_s, why)
        time.sleep(CONNECT_RETRY_S)


def open_session(address: str, receiver, *, timeout_s: float, connect_timeout_s: float) -> SessionWire:
    """Send this trainer's plan (the receiver's half of the transport) to the engine at `address`.

    Returns the session's wire with the engine's answer to "start" queued: accepted, or refused
    (EngineBusy, PlanMismatch: RemoteEngine raises it). EngineUnreachable if it cannot be asked."""
    plan = Plan.of(receiver).model_dump_json().encode()
    exchange = Exchange(address, connect_timeout_s)
    try:
        response = exchange.send("POST", "/v1/session", plan)
        if response.status == 200:
            event = SessionEvent.model_validate_json(response.readline(MAX_EVENT_BYTES))
            if event.event != "accepted" or not event.session:
                raise ValueError(f"its session stream opened with {event.event!r}")
            return SessionWire(address, exchange, response, event.session, timeout_s=timeout_s)
        text = failure_text(read_body(response, MAX_EVENT_BYTES * 16))
    except (OSError, http.client.HTTPException, ValueError, ValidationError) as err:
        exchange.close()
        raise unreachable(address, connect_timeout_s, f"the session request failed: {err}") from None
    exchange.close()
    if response.status == 401:
        raise refused_token(address)
    return SessionWire.refused(address, text)


class SessionWire:
    """The engine's session as a message connection (send, recv, poll, close, `closed`), the
    interface EngineConnection uses for an engine process's pipe.

    `send((op, args))` queues a request; a thread sends them one at a time, in order, each on a
    connection of its own, and queues each reply as the pipe would carry it:
    ("ok", op, result, t_recv, t_send, t_prev_send) or ("error", op, text). `closed` turns true
    when the session stream ends (the engine ended the session, stopped, or fell silent for
    update.engine_timeout_s) or a request cannot reach the engine; replies already queued stay readable.
    """

    def __init__(self, address: str, stream_exchange: Optional[Exchange], stream, key: str, *, timeout_s: float):
        self.address, self.key, self.timeout_s = address, key, timeout_s
        self.closed, self.why_closed = False, None
        self.replies: deque = deque()
        self.outbox: deque = deque()
        self.cond = threading.Condition()
        self.stream_exchange, self.stream = stream_exchange, stream
        if stream is not None:
            now = time.monotonic()
            self.replies.append(("ok", "start", None, now, now, now))
            stream_exchange.sock.settimeout(timeout_s)  # the stream's silence: heartbeats come every second
            threading.Thread(target=self._watch, name="rlsync-engine-watch", daemon=True).start()
            threading.Thread(target=self._requests, name="rlsync-engine-requests", daemon=True).start()
            threading.Thread(target=self._heartbeats, name="rlsync-engine-heartbeat", daemon=True).start()

    @classmethod
    def refused(cls, address: str, error: str) -> SessionWire:
        wire = cls(address, None, None, "", timeout_s=0)
        wire.replies.append(("error", "start", error.rstrip("\n") + "\n"))
        wire.closed = True
        return wire

    # -- the message-connection interface ------------------------------------------------------

    def send(self, message: tuple) -> None:
        with self.cond:
            if self.closed:
                raise BrokenPipeError(f"the session with the engine at {self.address} is over")
            self.outbox.append(message)
            self.cond.notify_all()

    def recv(self):
        with self.cond:
            if not self.replies:
                raise EOFError(f"the session with the engine at {self.address} is over")
            return self.replies.popleft()

    def poll(self, timeout: float = 0.0) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: self.replies or self.closed, timeout=timeout)
            return bool(self.replies)

    def hold(self) -> None:  # nothing to read ahead: replies are queued as they come
        return None

    def wait_closed(self, timeout: Optional[float]) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.closed, timeout=timeout)

    def close(self, why: str = "closed by the trainer") -> None:
        self._closed(why)
        if self.stream_exchange is not None:
            self.stream_exchange.shutdown()

    # -- the threads -----------------------------------------------------------------------------

    def _closed(self, why: str) -> None:
        with self.cond:
            if not self.closed:
                self.closed, self.why_closed = True, why
            self.cond.notify_all()

    def _watch(self) -> None:
        """Read the session stream until it ends: heartbeats, then "ended" (or a break, or silence)."""
        why = "the engine ended the session"
        try:
            while True:
                line = self.stream.readline(MAX_EVENT_BYTES)
                if not line:
                    why = "the engine's session stream closed"
                    break
                if SessionEvent.model_validate_json(line).event == "ended":
                    break
        except (OSError, http.client.HTTPException, ValueError, ValidationError) as err:
            why = f"the engine's session stream broke ({err or type(err).__name__})"
        self._closed(why)

    def _heartbeats(self) -> None:
        """`POST /v1/heartbeat` every HEARTBEAT_S until the session is over; a failed one is let go (the
        watch thread tells an engine that is gone)."""
        while True:
            with self.cond:
                if self.cond.wait_for(lambda: self.closed, timeout=HEARTBEAT_S):
                    return
            exchange = Exchange(self.address, max(HEARTBEAT_S * 5, 1.0))
            try:
                read_body(exchange.send("POST", "/v1/heartbeat", b"{}", {SESSION_HEADER: self.key}), MAX_EVENT_BYTES)
            except (OSError, http.client.HTTPException, ValueError):
                pass
            finally:
                exchange.close()

    def _requests(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.outbox or self.closed)
                if not self.outbox:
                    return
                op, args = self.outbox.popleft()
            try:
                reply = self._exchange(op, args)
            except (OSError, http.client.HTTPException, ValueError, ValidationError) as err:
                self._closed(f"the {op!r} request failed ({err or type(err).__name__})")
                return
            with self.cond:
                self.replies.append(reply)
                self.cond.notify_all()

    def _exchange(self, op: str, args: tuple) -> tuple:
        body = request_body(op, args).model_dump_json().encode()
        exchange = Exchange(self.address, self.timeout_s + REQUEST_SLACK_S)
        try:
            response = exchange.send("POST", f"/v1/{op}", body, {SESSION_HEADER: self.key})
            data = read_body(response)
        finally:
            exchange.close()
        if response.status == 200:
            reply = Reply.model_validate_json(data)
            return ("ok", op, decode_result(op, reply.result), reply.t_recv, reply.t_send, reply.t_prev_send)
        if response.status in (500, 409, 422):  # the engine raised (its traceback), the session is gone, refused
            return ("error", op, failure_text(data))
        raise ValueError(f"the engine answered {op!r} with HTTP {response.status}: {failure_text(data)[:200]}")


class RemoteEngine(EngineConnection):
    """The engine serving at `address`, as the trainer holds it: a session opened with this trainer's
    `receiver` (the update's plan and settings), ready once the engine has checked that plan against its
    model. Alive as long as its session is; no pid, and killing it only ends the session."""

    def __init__(self, address: str, receiver: Receiver, *, timeout_s: float, connect_timeout_s: float):
        self.address = address
        self.wire = open_session(address, receiver, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
        self._attach(self.wire, timeout_s, who=f"the engine at {address}")

    def is_alive(self) -> bool:
        return not self.wire.closed

    def join(self, timeout: float | None = None) -> None:
        self.wire.wait_closed(timeout)

    def kill(self) -> None:
        self.wire.close()  # ends the engine's session, not the engine

    def ended(self) -> str:
        return f"closed the connection (it stopped, or the network failed: {self.wire.why_closed})"
