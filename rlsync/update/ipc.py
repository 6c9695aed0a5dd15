"""The `ipc` transport: the engine in its own process, buckets handed over in shared buffers.

As in Miles/slime's colocated update: the trainer packs a bucket into a staging buffer the
engine process maps too (CPU shared memory; CUDA IPC on a GPU), sends a short message naming the
bucket and the buffer, and the engine copies from the buffer into its weights by name. The staging
buffers are allocated once, as large as the largest bucket (or tensor, for `per_tensor`), and reused.
With `inflight_buckets=2` there are two: the trainer packs bucket k+1 while the engine loads bucket k.

With `flat_engine_weights` the engine's weights are themselves views into shared flat buffers laid
out like the buckets, so packing writes the engine's weights and the process boundary costs no copy:
one message at the end tells the engine the update has landed.

Split metrics: `pack` (trainer), `transfer` (the messages' handoff latency, both ways, without the
time a message waits for a busy peer), `load` (the engine's copy, timed in the engine process).
On CUDA each side synchronizes once per message, the sync the hand-off needs (the trainer before
telling the engine the bytes are there, the engine before answering that the slot is free again);
`pack` and `load` are CUDA events around the work (rlsync.measure.timing.EventTimer).
"""

from __future__ import annotations

from collections import deque

import torch

from rlsync.config.schema import UpdateConfig
from rlsync.engines.base import Engine, EngineSpec
from rlsync.engines.process import EngineProcess, Receiver
from rlsync.errors import ConfigError
from rlsync.measure.devices import copy_into
from rlsync.measure.threads import cpu_threads
from rlsync.measure.timing import DeviceMemory, synchronize, unit_timer
from rlsync.update import flat
from rlsync.update.base import Transport, UpdateResult
from rlsync.update.buckets import Bucket, largest_bucket_bytes
from rlsync.update.gather import gather_bucket
from rlsync.update.payload import Encoded, Payload, payload_of
from rlsync.update.payload.full import FullPayload


class IpcReceiver(Receiver):
    """The engine-side half: loads named views of a shared staging buffer (pickled to the engine process)."""

    def __init__(
        self,
        buckets: list[Bucket],
        *,
        slots: list[torch.Tensor],
        flat_weights: list[torch.Tensor] | None,
        copy_threads: int,
        payload: type[Payload] = FullPayload,
    ):
        self.buckets, self.slots, self.flat, self.copy_threads = buckets, slots, flat_weights, copy_threads
        self.payload = payload

    def open(self, engine: Engine) -> dict:
        self.metas = {s.meta.name: s.meta for b in self.buckets for s in b.slots}
        if self.flat is not None:
            flat.bind(engine.weights, self.buckets, self.flat)
            # CUDA IPC shares memory, not stream order: the trainer's first pack must not race this copy
            synchronize(engine.device)
        return {}

    @torch.no_grad()
    def handle(self, engine: Engine, request: tuple) -> dict:
        kind, key, slot, *header = request  # a bucket's request carries its encoding's header
        device = engine.device
        timer, memory, row = unit_timer(device), DeviceMemory(device), {}
        with cpu_threads(self.copy_threads, device), memory.track(), timer("load", row):
            if kind == "bucket":
                bucket = self.buckets[key]
                self.payload.decode(engine, bucket, self.slots[slot][: bucket.numel], Encoded.from_header(header[0]))
            elif kind == "tensor":
                meta = self.metas[key]
                engine.load_weights([(key, self.slots[slot][: meta.numel].view(meta.shape))])
            elif kind != "landed":  # "landed": the trainer wrote the flat weights themselves
                raise ValueError(f"ipc: unknown request {kind!r}")
        timer.resolve()  # the one sync per message: the reply frees the slot for the trainer's next pack
        return {"load_time": row["load_time"], "peak_extra": memory.peak_extra}

    def close(self) -> None:
        self.slots = self.flat = None


class IpcTransport(Transport):
    """The engine in an engine process that maps this transport's staging buffers (or flat weights)."""

    engine_in_process = False
    flat_weights_shared = True  # the flat weights are the shared buffers themselves
    data_parallel = calibrated = True

    @classmethod
    def staging_slots(cls, cfg: UpdateConfig, flat_weights: bool) -> tuple[int, int]:
        return (0 if flat_weights else cfg.inflight_buckets), 0  # shared: the same pages on both sides, once

    @classmethod
    def copies(cls, strategy: str, flat_weights: bool) -> int:
        return 1 if flat_weights and strategy == "bucketed" else 2  # per_tensor: into the shared slot, then the load

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.update.flat_engine_weights is True and cfg.rollout.release_level == 2:
            raise ConfigError(
                "update.flat_engine_weights",
                True,
                "false with rollout.release_level=2 (with ipc "
                "the engine's weights are then shared memory, which the engine cannot free)",
                "not allowed with rollout.release_level=2",
            )

    def __init__(self, spec: EngineSpec, buckets: list[Bucket], cfg: UpdateConfig):
        self.device = torch.device(spec.device)
        self.buckets, self.strategy = buckets, cfg.strategy
        self.dtype = buckets[0].dtype
        self.flat = flat.allocate(buckets, self.device, shared=True) if cfg.flat_engine_weights else None
        if self.flat is not None and self.strategy == "bucketed":
            slot_numel = 0  # packing writes the engine's weights: no staging
        elif self.strategy == "bucketed":
            slot_numel = largest_bucket_bytes(buckets) // self.dtype.itemsize
        else:
            slot_numel = max(s.meta.numel for b in buckets for s in b.slots)
        count = cfg.inflight_buckets if slot_numel else 0
        self.slots = [flat.empty(slot_numel, self.dtype, self.device, shared=True) for _ in range(count)]
        self.payload = payload_of(cfg)
        self.encoder = self.payload.encoder(buckets, self.device)
        self.timeout_s = cfg.engine_timeout_s
        self.receiver = IpcReceiver(
            buckets, slots=self.slots, flat_weights=self.flat, copy_threads=cfg.copy_threads, payload=self.payload
        )

    def start_engine(self, spec: EngineSpec) -> EngineProcess:
        """An engine process that maps this transport's buffers (its receiver holds them)."""
        return EngineProcess(spec, self.receiver, strategy=self.strategy, timeout_s=self.timeout_s)

    def connect(self, engine: EngineProcess) -> None:
        self.engine = engine
        engine.call("open")

    def units(self, weights: dict[str, torch.Tensor]) -> list[tuple[tuple, int, object]]:
        """(request key, elements, what to pack) per message: a bucket, or one tensor."""
        if self.strategy == "bucketed":
            return [(("bucket", i), b.numel, b) for i, b in enumerate(self.buckets)]
        # from the plan, in the weights' order: reading a tensor of shards here would gather it
        return [(("tensor", s.meta.name), s.meta.numel, s.meta.name) for b in self.buckets for s in b.slots]

    @torch.no_grad()
    def send_weights(self, weights: dict[str, torch.Tensor]) -> UpdateResult:
        timer = unit_timer(self.device)
        rows: list[dict] = []
        engine_peak = 0
        if not self.slots:  # flat engine weights: pack into them, then one message
            for bucket, buffer in zip(self.buckets, self.flat):
                rows.append({"bytes": bucket.nbytes})
                gather_bucket(weights, bucket)  # from shards: gathered here, outside the pack's clock
                with timer("pack", rows[-1]):
                    flat.pack(bucket, weights, buffer)
            timer.handoff()  # every bucket's bytes are in the engine's weights before it is told
            self.engine.send("update", ("landed", None, None))
            reply = self.engine.reply("update")
            rows[-1]["transfer_time"] = reply.handoff
            transfer, load, engine_peak = reply.handoff, reply.result["load_time"], reply.result["peak_extra"]
        else:
            pending: deque[int] = deque()  # rows whose message is not answered yet
            for k, (key, numel, item) in enumerate(self.units(weights)):
                if len(pending) == len(self.slots):
                    engine_peak = max(engine_peak, self._finish(rows[pending.popleft()]))
                buffer = self.slots[k % len(self.slots)][:numel]
                rows.append({"bytes": numel * self.dtype.itemsize})
                source = weights[item] if key[0] == "tensor" else gather_bucket(weights, item)  # gathered off the clock
                message = (*key, k % len(self.slots))
                if key[0] == "bucket":  # in the update's payload (full: the bucket's elements)
                    encoded = self.encoder.encode(key[1], item, weights, buffer, timer, rows[-1])
                    rows[-1].update(encoded.row(item))
                    message += (encoded.header(),)
                else:  # a host source is cast on the device, as flat.pack does (rlsync.measure.devices.copy_into)
                    with timer("pack", rows[-1]):
                        copy_into(buffer, source.reshape(-1))
                timer.handoff()  # the bytes are in the buffer before the engine is told
                self.engine.send("update", message)
                pending.append(len(rows) - 1)
            while pending:
                engine_peak = max(engine_peak, self._finish(rows[pending.popleft()]))
            transfer = sum(r["transfer_time"] for r in rows)
            load = sum(r["load_time"] for r in rows)
        timer.resolve()
        staging = sum(s.numel() * s.element_size() for s in self.slots)  # shared: the same pages on both sides
        return UpdateResult(
            {**timer.seconds, "transfer": transfer, "load": load},  # pack (and a payload's encode), transfer, load
            rows,
            staging_bytes=staging,
            engine_peak_bytes=engine_peak,
        )

    def _finish(self, row: dict) -> int:
        reply = self.engine.reply("update")
        row["transfer_time"], row["load_time"] = reply.handoff, reply.result["load_time"]
        return reply.result["peak_extra"]

    def close(self) -> None:
        self.slots, self.flat, self.receiver = [], None, None
