"""The `broadcast` transport: the engine in its own process, joined to the trainer in a process group.

As in Miles/slime's non-colocated mode: the trainer (rank 0) and the engine process
(rank 1) form a two-rank gloo group (see `resolve_backend` for NCCL) over a TCP store that the
trainer hosts on a free port. The engine process is started here, or (`update.engine_address`) is
an engine started on its own, on this machine or another (`python -m rlsync.serve`, its client
rlsync.client.client.RemoteEngine), which reaches the trainer's store at the address the trainer
connected from. The store and both ends of the group listen on one address only: loopback for an engine process
started here; for a standalone engine, each side's end of the control connection. The
group is a standalone object, not torch.distributed's default group: a data-parallel trainer keeps
its own, and several engines can come and go. The bucket plan is deterministic and both sides
hold it (it travels to the engine process when it starts), so no names, shapes or dtypes go over the
wire per update: one message says "update", then one broadcast per bucket (or per tensor for
`per_tensor`). The engine receives into a staging buffer and loads it by name; with
`flat_engine_weights` it receives straight into its weights (views into bucket-laid-out buffers).
With `inflight_buckets=2` each side keeps two buffers: the trainer packs bucket k+1 while bucket k
is on the wire, the engine receives bucket k+1 while loading bucket k.

Split metrics: `pack` (trainer), `transfer` (the time the trainer waits for the wire; with two in
flight only the part packing did not hide), `load` (the engine's copy, timed in the engine process).
On CUDA `pack` and `load` are CUDA events read after one sync at the end of the update on each side
(rlsync.measure.timing.EventTimer); gloo orders a CUDA broadcast after the current stream's work and makes
`wait()` order the stream after it (ProcessGroupGloo's CUDA work), so no unit needs a sync of its
own. `transfer` is a host-side wait, on the host clock; on CUDA it also holds the pack's kernels
still running when the broadcast starts (gloo's staging copy waits for them).
NCCL would need the engine on another GPU than the trainer's; rlsync colocates them on one.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

import rlsync.update.flat as flat
from rlsync.config.schema import UpdateConfig
from rlsync.engines.base import Engine, EngineSpec
from rlsync.engines.process import EngineConnection, EngineProcess, Receiver
from rlsync.measure.threads import cpu_threads
from rlsync.measure.timing import DeviceMemory, HostTimer, unit_timer
from rlsync.update.base import Transport, UpdateResult
from rlsync.update.buckets import Bucket, Slot, largest_bucket_bytes
from rlsync.update.payload import Encoded, Payload, payload_of
from rlsync.update.payload.full import FullPayload

HOST = "127.0.0.1"  # an engine process started here: the store and both ends of the group listen on loopback only
TRAINER, ENGINE = 0, 1  # ranks
STORE_PREFIX = "rlsync/update"  # the group's keys in the store
STORE_RETRY_S = 0.1  # between attempts to reach a store that is not listening yet


def join_group(store: dist.Store, rank: int, timeout: timedelta, host: str) -> dist.ProcessGroupGloo:
    """This side of the trainer-engine group, listening on `host` only (gloo's default device would
    listen on the address the machine's hostname resolves to); blocks until the other side joins too."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, 2, options)


def listen_store(host: str, timeout: timedelta) -> dist.TCPStore:
    """The group's TCP store, bound to `host` only: torch's own TCPStore server listens on every
    interface, so it is handed a socket bound here (`master_listen_fd`); the store owns it from then on."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        return dist.TCPStore(
            host,
            port,
            world_size=2,
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            master_listen_fd=sock.detach(),
        )
    finally:
        sock.close()  # after detach(): a no-op; on an error before it: frees the socket


def reach_store(host: str, port: int, deadline: float, bound_s: float) -> None:
    """Wait until the store at host:port accepts a connection, until `deadline` (monotonic); one-line
    TimeoutError past it. Asked here rather than by torch's client, which retries once past its own
    timeout (twice the wait) and logs C++ stack frames on stderr for each try."""
    why = "nothing answered"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the trainer's store at {host}:{port} did not answer within {bound_s:g} s ({why})")
        try:
            socket.create_connection((host, port), timeout=remaining).close()
            return
        except OSError as err:
            why = err.strerror or str(err) or type(err).__name__
        time.sleep(min(STORE_RETRY_S, max(deadline - time.monotonic(), 0)))


def store_client(host: str, port: int, deadline: float, bound_s: float) -> dist.TCPStore:
    """A client of the store at host:port, made by `deadline`. torch's client waits for ever on a peer that
    accepts the connection and never answers (its handshake has no timeout), so it is made on a thread of its
    own; one past the deadline is left to end with its connection, and the wait ends in a one-line TimeoutError."""
    reach_store(host, port, deadline, bound_s)
    left = timedelta(seconds=max(deadline - time.monotonic(), STORE_RETRY_S))
    made: list = []  # the store, or what its making raised

    def connect() -> None:
        try:
            made.append(dist.TCPStore(host, port, world_size=2, is_master=False, timeout=left))
        except Exception as err:  # noqa: BLE001 - raised in the caller's thread below
            made.append(err)

    thread = threading.Thread(target=connect, name="rlsync-store-client", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), STORE_RETRY_S))
    if not made:
        raise TimeoutError(
            f"the trainer's store at {host}:{port} accepted the connection but did not answer as a store "
            f"within {bound_s:g} s"
        )
    if isinstance(made[0], Exception):
        raise made[0]
    return made[0]


def resolve_backend(name: str) -> str:
    """gloo, whatever the device: the engine shares the trainer's device, and NCCL refuses two ranks
    on one GPU ("Duplicate GPU detected", NCCL >= 2.5), so it is not offered. gloo broadcasts CUDA
    tensors through the host."""
    return "gloo"  # update.backend's choices are checked once, before any model is built (validate.py)


def units_of(buckets: list[Bucket], strategy: str) -> list[tuple[Bucket, int]]:
    """What one broadcast carries, in order: each bucket, or (per_tensor) each tensor as its own bucket."""
    if strategy == "bucketed":
        return [(b, b.numel) for b in buckets]
    return [(Bucket((Slot(s.meta, 0),), s.meta.numel, b.dtype), s.meta.numel) for b in buckets for s in b.slots]


def slot_numel(buckets: list[Bucket], strategy: str) -> int:
    if strategy == "bucketed":
        return largest_bucket_bytes(buckets) // buckets[0].dtype.itemsize
    return max(s.meta.numel for b in buckets for s in b.slots)


class BroadcastReceiver(Receiver):
    """The engine-side half: joins the group, receives each broadcast and loads it (pickled to the engine)."""

    def __init__(
        self,
        buckets: list[Bucket],
        *,
        strategy: str,
        inflight: int,
        flat_weights: bool,
        port: int,
        timeout_s: float,
        join_timeout_s: float,
        copy_threads: int,
        payload: type[Payload] = FullPayload,
    ):
        self.buckets, self.strategy, self.inflight, self.flat_weights = buckets, strategy, inflight, flat_weights
        self.payload = payload
        self.copy_threads = copy_threads
        self.host, self.port, self.timeout_s = HOST, port, timeout_s  # a standalone engine sets `host`
        self.bind_host = HOST  # where this side of the group listens (a standalone engine: its end of the session)
        self.join_timeout_s = join_timeout_s  # for reaching the trainer's store, and the group's rendezvous
        self.slots: list[torch.Tensor] = []
        self.flat: list[torch.Tensor] | None = None
        self.group = None

    def open(self, engine: Engine) -> dict:
        # reaching the store and the group's rendezvous share one bound, join_timeout_s, counted once
        deadline = time.monotonic() + self.join_timeout_s
        store = store_client(self.host, self.port, deadline, self.join_timeout_s)
        left = timedelta(seconds=max(deadline - time.monotonic(), STORE_RETRY_S))
        each = timedelta(seconds=self.timeout_s)  # each broadcast's own wait, once the group is joined
        settable = hasattr(dist.ProcessGroupGloo, "_set_default_timeout")  # (a torch without it: the rendezvous too)
        self.group = join_group(store, ENGINE, min(left, each) if settable else each, self.bind_host)
        if settable:
            self.group._set_default_timeout(each)
        device, dtype = engine.device, self.buckets[0].dtype
        if self.flat_weights:
            self.flat = flat.allocate(self.buckets, device)
            flat.bind(engine.weights, self.buckets, self.flat)
        if not (self.flat_weights and self.strategy == "bucketed"):
            self.slots = [
                flat.empty(slot_numel(self.buckets, self.strategy), dtype, device) for _ in range(self.inflight)
            ]
        return {"staging_bytes": sum(s.numel() * s.element_size() for s in self.slots)}

    def target(self, k: int, unit: Bucket, numel: int) -> torch.Tensor:
        """Where broadcast k lands: the engine's own flat weights, or a staging slot."""
        if not self.slots:
            return self.flat[k]
        return self.slots[k % len(self.slots)][:numel]

    @torch.no_grad()
    def handle(self, engine: Engine, request: tuple) -> dict:
        device = engine.device
        timer, memory = unit_timer(device), DeviceMemory(device)
        units = units_of(self.buckets, self.strategy)
        rows: list[dict] = [{"load_time": 0.0} for _ in units]  # 0: received into the weights themselves
        if not self.payload.whole:
            with cpu_threads(self.copy_threads, device), memory.track():
                self.receive_encoded(engine, units, rows, timer)
            timer.resolve()
            return {"load_times": [r["load_time"] for r in rows], "peak_extra": memory.peak_extra}
        with cpu_threads(self.copy_threads, device), memory.track():
            posted: deque = deque()
            for k in range(min(self.inflight, len(units))):
                posted.append(self.group.broadcast(self.target(k, *units[k]), root=TRAINER))
            for k, (unit, numel) in enumerate(units):
                posted.popleft().wait()
                buffer = self.target(k, unit, numel)
                if self.slots:
                    with timer("load", rows[k]):
                        engine.load_weights(flat.views(unit, buffer))
                nxt = k + self.inflight
                if nxt < len(units):  # its slot is free again only now that bucket k is loaded
                    posted.append(self.group.broadcast(self.target(nxt, *units[nxt]), root=TRAINER))
        timer.resolve()  # one sync: the update has landed before the reply says so
        return {"load_times": [r["load_time"] for r in rows], "peak_extra": memory.peak_extra}

    def receive_encoded(self, engine: Engine, units: list, rows: list[dict], timer) -> None:
        """A payload whose size varies per bucket (one that sends what changed): each bucket's header first (what it carries),
        then only its bytes, into one slot, decoded before the next is received."""
        header = torch.empty(4, dtype=torch.int64)
        for k, (unit, numel) in enumerate(units):
            self.group.broadcast(header, root=TRAINER).wait()
            encoded = Encoded.from_header(header.tolist())
            buffer = self.slots[0][:numel]
            if encoded.nbytes:
                self.group.broadcast(buffer.view(torch.uint8)[: encoded.nbytes], root=TRAINER).wait()
            with timer("load", rows[k]):
                self.payload.decode(engine, unit, buffer, encoded)

    def close(self) -> None:
        self.slots, self.flat, self.group = [], None, None


class BroadcastTransport(Transport):
    """The engine in an engine process, or a standalone one (update.engine_address), joined to this
    trainer in a two-rank process group; one broadcast per bucket (or tensor)."""

    engine_in_process = False
    joins_address = True  # a standalone engine is joined through this transport's process group

    @classmethod
    def staging_slots(cls, cfg: UpdateConfig, flat_weights: bool) -> tuple[int, int]:
        """The trainer packs into its own buffers; the engine receives into its own, or into its flat weights."""
        return cfg.inflight_buckets, (0 if flat_weights else cfg.inflight_buckets)

    @classmethod
    def copies(cls, strategy: str, flat_weights: bool) -> int:
        return 2 if strategy == "per_tensor" or flat_weights else 3  # pack, broadcast, (load)

    def __init__(self, spec: EngineSpec, buckets: list[Bucket], cfg: UpdateConfig):
        self.group = None
        self.device = torch.device(spec.device)
        self.buckets, self.strategy, self.inflight = buckets, cfg.strategy, cfg.inflight_buckets
        self.units = units_of(buckets, cfg.strategy)
        backend = resolve_backend(cfg.backend)
        timeout = timedelta(seconds=cfg.engine_timeout_s)  # one broadcast's longest wait
        # Joining: an engine on another machine that cannot reach this store (a firewall, the wrong
        # interface) must fail in engine_connect_timeout_s, not after an hour of silence.
        join_timeout_s = cfg.engine_connect_timeout_s if cfg.engine_address else cfg.engine_timeout_s
        host = HOST
        if cfg.engine_address:  # listen on the interface that reaches that engine, once it answers
            # lazy: rlsync.client costs ~0.2 s (pydantic) in every engine process that imports this module
            from rlsync.client.client import reach

            host = reach(cfg.engine_address, timeout_s=cfg.engine_connect_timeout_s)
        self.store = listen_store(host, timedelta(seconds=join_timeout_s))
        self.slots = [
            flat.empty(slot_numel(buckets, cfg.strategy), buckets[0].dtype, self.device)
            for _ in range(cfg.inflight_buckets)
        ]
        self.engine_staging = 0
        self.payload = payload_of(cfg)
        self.encoder = self.payload.encoder(buckets, self.device)
        self.headers = [torch.empty(4, dtype=torch.int64) for _ in self.slots]  # a varying payload's, per slot
        self.receiver = BroadcastReceiver(
            buckets,
            strategy=cfg.strategy,
            inflight=cfg.inflight_buckets,
            flat_weights=cfg.flat_engine_weights,
            port=self.store.port,
            timeout_s=cfg.engine_timeout_s,
            join_timeout_s=join_timeout_s,
            copy_threads=cfg.copy_threads,
            payload=self.payload,
        )
        self.cfg, self.backend, self.host, self.timeout = cfg, backend, host, timeout

    def start_engine(self, spec: EngineSpec) -> EngineConnection:
        """An engine process given this transport's receiver, or (update.engine_address) a session with an
        engine started on its own, which checks the plan against its model before it accepts."""
        cfg = self.cfg
        if cfg.engine_address:
            from rlsync.client.client import RemoteEngine  # lazy, as `reach` above

            return RemoteEngine(
                cfg.engine_address,
                self.receiver,
                timeout_s=cfg.engine_timeout_s,
                connect_timeout_s=cfg.engine_connect_timeout_s,
            )
        return EngineProcess(spec, self.receiver, strategy=cfg.strategy, timeout_s=cfg.engine_timeout_s)

    def connect(self, engine: EngineConnection) -> None:
        """The engine joins the group (its "open") while this side does."""
        self.engine = engine
        engine.send("open")
        engine.join_thread(
            lambda: setattr(self, "group", join_group(self.store, TRAINER, self.timeout, self.host)),
            f"the {self.backend} process group",
        )
        self.engine_staging = engine.reply("open").result["staging_bytes"]

    @torch.no_grad()
    def send_weights(self, weights: dict[str, torch.Tensor]) -> UpdateResult:
        timer, waits = unit_timer(self.device), HostTimer()  # pack: on the device; transfer: a host wait
        rows: list[dict] = []
        self.engine.send("update", ("update",))
        in_flight: deque = deque()  # (row, work)
        for k, (unit, numel) in enumerate(self.units):
            if len(in_flight) == len(self.slots):
                self._wait(*in_flight.popleft(), waits)
            slot = k % len(self.slots)
            buffer = self.slots[slot][:numel]
            rows.append({})
            encoded = self.encoder.encode(k, unit, weights, buffer, timer, rows[-1])  # full: the bucket's elements
            rows[-1].update(encoded.row(unit))
            if self.payload.whole:  # the same size every time: the engine posts its receives ahead
                works = [self.group.broadcast(buffer, root=TRAINER)]
            else:  # a size of its own: what it carries first, then only those bytes
                self.headers[slot].copy_(torch.tensor(encoded.header()))
                works = [self.group.broadcast(self.headers[slot], root=TRAINER)]
                if encoded.nbytes:
                    works.append(self.group.broadcast(buffer.view(torch.uint8)[: encoded.nbytes], root=TRAINER))
            in_flight.append((rows[-1], works))
        while in_flight:
            self._wait(*in_flight.popleft(), waits)
        timer.resolve()
        reply = self.engine.reply("update")
        for row, load in zip(rows, reply.result["load_times"], strict=True):
            row["load_time"] = load
        trainer_staging = sum(s.numel() * s.element_size() for s in self.slots)
        return UpdateResult(
            {
                **timer.seconds,  # pack (and a payload's encode)
                "transfer": waits.seconds["transfer"],
                "load": sum(reply.result["load_times"]),
            },
            rows,
            staging_bytes=trainer_staging + self.engine_staging,
            engine_peak_bytes=reply.result["peak_extra"],
        )

    def _wait(self, row: dict, works: list, waits: HostTimer) -> None:
        with waits("transfer", row):
            for work in works:
                self.engine.wait_for(work.is_completed, "a weight broadcast")
                try:
                    work.wait()  # raises the backend's error, if the broadcast failed; orders our stream after it
                except RuntimeError as err:
                    self.engine.blame(err, "a weight broadcast")
                    raise

    def close(self) -> None:
        """Our side of the group (after the engine, which leaves it on its way out: update.close_update)."""
        self.slots, self.group, self.store, self.receiver = [], None, None, None
