"""The standalone engine's HTTP server, hardened: one bad client is dropped and harms nobody else.

uvicorn parses HTTP (h11) and runs the app on one asyncio loop, so a slow or silent connection costs
a socket, never the engine's attention. What uvicorn leaves open is closed here:

- `guarded_protocol`: a connection must deliver each request's head within `request_timeout_s`
  (uvicorn waits forever for the first request of a connection, and for a head sent a byte at a
  time); a connection that is not HTTP (garbage, a header over h11's 16 KiB limit) or that closes
  before any request is dropped with one line too;
- `BodyLimit` (ASGI middleware): a request head over MAX_HEAD_BYTES (h11 limits only a head that
  arrives in pieces, not one that arrives whole) gets 431, and the body is read whole, within `request_timeout_s` and at most
  `max_bytes` (serve.max_request_mb; an announced or streamed larger one gets 413 at once), before
  any route sees it, so the app never waits on a client's network.

Each drop is one line on stderr: `rlsync engine: dropped client HOST:PORT: WHY`.
"""

from __future__ import annotations

import json
import logging
import sys

import anyio
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEAD_BYTES = 16 * 1024  # a request's line and headers, as h11 bounds a head that arrives in pieces


def drop_line(client, why: str) -> None:
    who = f"{client[0]}:{client[1]}" if client else "(unknown)"
    print(f"rlsync engine: dropped client {who}: {why}", file=sys.stderr, flush=True)


class _SilenceInvalidRequest(logging.Filter):
    """uvicorn's own "Invalid HTTP request received." (our protocol prints the line that names the client)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Invalid HTTP request" not in record.getMessage()


class _OneLine(logging.Formatter):
    """A record as one line: its message's first line and the exception's name, never a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        line = (record.getMessage().splitlines() or [""])[0]
        if record.exc_info and record.exc_info[1] is not None:
            line += f" ({type(record.exc_info[1]).__name__})"
        return f"rlsync engine: server: {line}"


def quiet_uvicorn() -> None:
    """uvicorn's warnings and errors as one `rlsync engine:` line each on stderr; no start-up or access chatter."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine())
    handler.addFilter(_SilenceInvalidRequest())
    for name in ("uvicorn", "uvicorn.error"):
        log = logging.getLogger(name)
        log.handlers, log.propagate = [handler] if name == "uvicorn" else [], name != "uvicorn"
        log.setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").disabled = True


def guarded_protocol(request_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on every request head and a line for every dropped client."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._deadline = None
            self._seen_cycle = None
            self._requests = 0
            self._dropped = False
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._waiting_for_head():
                self._arm()
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._seen_cycle:  # a request's head arrived
                self._seen_cycle, self._requests = self.cycle, self._requests + 1
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm()  # idle between requests: uvicorn's keep-alive timeout closes the connection

        def connection_lost(self, exc) -> None:
            self._disarm()
            if not self._requests and not self._dropped:
                self._drop("closed the connection without sending a request", close=False)
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            self._drop("sent something that is not an HTTP request (or a header over the size limit)", close=False)
            super().send_400_response(msg)

        def _waiting_for_head(self) -> bool:
            return self._deadline is None and (self.cycle is None or self.cycle.response_complete)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(request_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self._waiting_for_head() and not self.transport.is_closing():
                self._drop(f"sent no complete request within serve.request_timeout_s={request_timeout_s:g} s")

        def _drop(self, why: str, *, close: bool = True) -> None:
            self._dropped = True
            drop_line(self.client, why)
            if close:
                self.transport.close()

    return GuardedH11Protocol


class BodyLimit:
    """ASGI middleware: read each request's body whole (bounded in size and time), then hand the app
    a `receive` that replays it; a body too large or too slow ends the request with 413 or 408 and
    the connection closed."""

    def __init__(self, app, *, request_timeout_s: float, max_bytes: int):
        self.app, self.timeout_s, self.max_bytes = app, request_timeout_s, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        head = len(scope.get("raw_path") or b"") + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if head > MAX_HEAD_BYTES:
            drop_line(client, f"sent a request head of {head} bytes (the limit is {MAX_HEAD_BYTES})")
            await refuse(send, 431, "BadRequest: request head over the size limit")
            return
        announced = dict(scope["headers"]).get(b"content-length")
        if announced is not None and (not announced.isdigit() or int(announced) > self.max_bytes):
            drop_line(
                client, f"announced a body of {announced.decode('latin-1')[:40]} bytes (the limit is {self.max_bytes})"
            )
            await refuse(send, 413, "BadRequest: request body over the size limit")
            return
        body = bytearray()
        try:
            with anyio.fail_after(self.timeout_s):  # one deadline for the whole body, however it is cut
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        drop_line(client, "closed the connection in the middle of a request")
                        return
                    body += message.get("body", b"")
                    if len(body) > self.max_bytes:
                        drop_line(client, f"sent a body over the limit of {self.max_bytes} bytes")
                        await refuse(send, 413, "BadRequest: request body over the size limit")
                        return
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            drop_line(client, f"did not send its request body within serve.request_timeout_s={self.timeout_s:g} s")
            await refuse(send, 408, "BadRequest: request body too slow")
            return
        await self.app(scope, replay(bytes(body), receive), send)


def replay(body: bytes, receive):
    """A `receive` that returns `body` once, then passes on to the connection (to hear a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


async def refuse(send, status: int, error: str) -> None:
    body = json.dumps({"op": "", "error": error}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
