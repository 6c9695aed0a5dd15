"""The `direct` transport: the engine lives in the trainer's process.

`bucketed` packs each bucket into one staging buffer (allocated once, the largest bucket's size,
reused) and the engine loads named views of it: two copies. With `flat_weights` the engine's weights
are themselves views into one flat buffer per bucket, so packing writes them: one copy, no staging.
`per_tensor` hands the engine tensor by tensor, the baseline. An engine whose own loader copies
(and casts) whatever it is handed, at a cost per call (`Engine.loads_trainer_tensors`: vLLM's reload
path), gets each bucket's trainer tensors in one call instead: packing a staging buffer first would
be a second copy for nothing.
"""

from __future__ import annotations

import torch

from rlsync.config.schema import UpdateConfig
from rlsync.engines.base import Engine, EngineSpec
from rlsync.measure.timing import unit_timer
from rlsync.update import flat
from rlsync.update.base import Transport, UpdateResult
from rlsync.update.buckets import Bucket, largest_bucket_bytes
from rlsync.update.gather import gather_bucket
from rlsync.update.payload import payload_of


class DirectTransport(Transport):
    """The engine built in this process; the channel is this process's copies into it (`connect` makes
    the staging buffer, or binds the engine's weights to flat buffers)."""

    data_parallel = calibrated = True

    def __init__(self, spec: EngineSpec | None, buckets: list[Bucket], cfg: UpdateConfig):
        self.buckets, self.strategy, self.flat_weights = buckets, cfg.strategy, bool(cfg.flat_engine_weights)
        self.payload = payload_of(cfg)
        self.staging = None
        self.flat = None  # the engine's weights, one flat buffer per bucket (flat_weights)

    def start_engine(self, spec: EngineSpec) -> Engine:
        return spec.build(strategy=self.strategy)  # here, in the trainer's process

    def connect(self, engine: Engine) -> None:
        self.engine = engine
        self.encoder = self.payload.encoder(self.buckets, engine.device)  # before pass_through
        self.pass_through = (
            self.strategy == "bucketed"
            and not self.flat_weights
            and engine.loads_trainer_tensors
            and self.payload.whole
        )
        if self.flat_weights:
            self.flat = flat.allocate(self.buckets, engine.device)
            flat.bind(engine.weights, self.buckets, self.flat)
        elif self.strategy == "bucketed" and not self.pass_through:
            numel = largest_bucket_bytes(self.buckets) // engine.dtype.itemsize
            self.staging = torch.empty(numel, dtype=engine.dtype, device=engine.device)

    @torch.no_grad()
    def send_weights(self, weights: dict[str, torch.Tensor]) -> UpdateResult:
        """Per-unit seconds come from `unit_timer`: on CUDA events, resolved by one sync at the end
        (the rows and totals are filled then), so `per_tensor` does not time 2 syncs per tensor."""
        timer = unit_timer(self.engine.device)
        rows: list[dict] = []
        staging_bytes = self.staging.numel() * self.staging.element_size() if self.staging is not None else 0
        if self.strategy in self.engine.own_strategies:  # the engine's own transfer path (Engine.native_update)
            seconds, staging_bytes = self.engine.native_update(weights, bucket_bytes=largest_bucket_bytes(self.buckets))
            return UpdateResult(seconds, staging_bytes=staging_bytes)
        if self.strategy == "per_tensor":
            for name, tensor in weights.items():
                rows.append({"bytes": tensor.numel() * self.engine.dtype.itemsize})
                with timer("load", rows[-1]):
                    self.engine.load_trainer_weights([(name, tensor)])
        elif self.pass_through:  # the engine's loader is the copy: one call per bucket, the trainer's tensors
            for bucket in self.buckets:
                rows.append({"bytes": bucket.nbytes})
                gather_bucket(weights, bucket)  # from shards: gathered here, outside the load's clock
                with timer("load", rows[-1]):
                    self.engine.load_trainer_weights([(name, weights[name]) for name in bucket.names])
        elif self.flat is not None:
            for bucket, buffer in zip(self.buckets, self.flat):
                rows.append({"bytes": bucket.nbytes})
                gather_bucket(weights, bucket)
                with timer("pack", rows[-1]):
                    flat.pack(bucket, weights, buffer)  # writes the engine's weights: the whole update
        else:  # through the staging buffer, in the update's payload (full: the bucket's elements)
            for index, bucket in enumerate(self.buckets):
                buffer = self.staging[: bucket.numel]
                rows.append({})
                gather_bucket(weights, bucket)
                encoded = self.encoder.encode(index, bucket, weights, buffer, timer, rows[-1])
                rows[-1].update(encoded.row(bucket))
                with timer("load", rows[-1]):  # same stream: the load follows the pack without a sync
                    self.payload.decode(self.engine, bucket, buffer, encoded)
        timer.resolve()
        return UpdateResult(dict(timer.seconds), rows, staging_bytes=staging_bytes)

    def close(self) -> None:
        self.staging = self.flat = None
