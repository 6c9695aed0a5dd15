"""An engine on the other end of a TCP connection: the wire between a trainer and `python -m rlsync.engine`.

The `broadcast` transport normally starts its engine process itself and talks to it through a
pipe. With `update.engine_address=HOST:PORT` it joins an engine started on its own instead (on this
machine or another): the trainer connects to the engine's control port, and the same requests and
replies as through the pipe (rlsync/sync/engine_process.py) travel over that connection, while the
weights travel in the trainer-engine gloo group, as they do locally.

- The control connection is `multiprocessing.connection` over TCP, authenticated with an HMAC
  challenge on a shared key (`RLSYNC_ENGINE_KEY` on both sides; a built-in key when unset, so run
  it on a trusted network only: what travels on it is unpickled).
- Messages are pickled by value (`WireConnection`): a tensor crosses machines as its bytes, never as
  a shared-memory or CUDA IPC handle that only means something on the sender's machine.
- The trainer hosts the group's TCP store; the engine reaches it at the address the trainer
  connected from. gloo then connects the two sides on ports of its own choosing (both sides listen),
  over the interface GLOO_SOCKET_IFNAME names: between machines, open those ports to each other.
"""

from __future__ import annotations

import io
import os
import pickle
import time
from collections import deque
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection

from rlsync.errors import RlsyncError

KEY_ENV = "RLSYNC_ENGINE_KEY"  # the control connection's shared secret, the same on both sides
DEFAULT_KEY = b"rlsync-engine"  # without RLSYNC_ENGINE_KEY: fine on localhost, weak across machines
DEFAULT_PORT = 29610  # where `python -m rlsync.engine` listens unless update.engine_address names a port
CONNECT_RETRY_S = 0.2  # between attempts while the engine is still starting


class EngineUnreachable(RlsyncError):
    """No engine answered at update.engine_address within update.engine_connect_timeout_s, or it refused our key."""


def parse_address(text: str, *, default_port: int | None = None) -> tuple[str, int]:
    """"host:port" (or "[v6 host]:port", or "host" with `default_port`) -> (host, port); ValueError otherwise."""
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


def authkey() -> bytes:
    return os.environ.get(KEY_ENV, "").encode() or DEFAULT_KEY


def dumps(obj) -> bytes:
    """Plain pickle: tensors by value (torch.multiprocessing's reducers would send shared-memory handles)."""
    buffer = io.BytesIO()
    pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


class WireConnection:
    """A `multiprocessing.connection.Connection` whose messages are pickled by value (see `dumps`).

    The interface the engine protocol uses on both ends: send, recv, poll, close. `closed` turns
    true once the other end is seen gone; `hold` reads a message ahead (recv returns it first).
    """

    def __init__(self, conn: Connection):
        self.conn, self.closed = conn, False
        self.held: deque = deque()

    def send(self, obj) -> None:
        self.conn.send_bytes(dumps(obj))

    def recv(self):
        if self.held:
            return self.held.popleft()
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            self.closed = True
            raise

    def hold(self) -> None:
        self.held.append(self.recv())

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self.held) or self.conn.poll(timeout)

    def close(self) -> None:
        self.closed = True
        self.conn.close()


class RemotePeer:
    """Stands in for the engine's process when the engine runs on its own: alive as long as its
    control connection is; no pid, no exit code, and killing it only hangs up on it."""

    pid = exitcode = None

    def __init__(self, conn: WireConnection):
        self.conn = conn

    def is_alive(self) -> bool:
        return not self.conn.closed

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` for the connection to show whether the engine is gone (a message
        that arrives instead is held for the trainer's next read)."""
        if self.is_alive() and self.conn.poll(timeout):
            try:
                self.conn.hold()
            except (EOFError, OSError):
                pass  # gone: conn.closed says so

    def kill(self) -> None:
        self.conn.close()  # ends the engine's session, not the engine


def connect(address: str, *, timeout_s: float) -> WireConnection:
    """The control connection to the engine at `address`, retried while it is still starting."""
    host, port = parse_address(address)
    family = "AF_INET6" if ":" in host else "AF_INET"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return WireConnection(Client((host, port), family=family, authkey=authkey()))
        except AuthenticationError:
            raise EngineUnreachable(f"the engine at update.engine_address={address} refused this trainer's key: "
                                    f"set the same {KEY_ENV} on both sides") from None
        except OSError as err:  # refused (not listening yet), reset, unreachable, unknown host
            if time.monotonic() >= deadline:
                raise EngineUnreachable(
                    f"no rlsync engine at update.engine_address={address} after {timeout_s:g} s "
                    f"({err.strerror or err}): start one there with `python -m rlsync.engine "
                    f"update.engine_address={address}` and the trainer's model settings") from None
            time.sleep(CONNECT_RETRY_S)
