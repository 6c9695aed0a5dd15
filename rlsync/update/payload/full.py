"""The `full` payload: every element of every bucket, in the engine's dtype (the default)."""

from __future__ import annotations

from dataclasses import replace

import torch

import rlsync.update.flat as flat
from rlsync.engines.base import Engine
from rlsync.measure.devices import copy_into
from rlsync.update.buckets import Bucket
from rlsync.update.payload.base import FULL, Encoded, Encoder, Floor, Payload


class FullEncoder(Encoder):
    def encode(self, index, bucket, weights, buffer, timer, row) -> Encoded:
        read = 0
        with timer("pack", row):
            for name, view in flat.views(bucket, buffer[: bucket.numel]):  # flat.pack, counting what it reads
                source = weights[name]
                copy_into(view, source)
                read += source.numel() * source.element_size()
        encoded = Encoded(FULL, bucket.numel, bucket.nbytes, None)
        return replace(encoded, floor=FullPayload.floor(bucket, encoded, read))


class FullPayload(Payload):
    name = "full"
    title = "Full"
    whole = True
    beside_full = False  # it is the full update
    metrics = ()

    @classmethod
    def encoder(cls, buckets: list[Bucket], device: torch.device) -> Encoder:
        return FullEncoder()

    @classmethod
    def decode(cls, engine: Engine, bucket: Bucket, buffer: torch.Tensor, encoded: Encoded) -> None:
        engine.load_weights(flat.views(bucket, buffer[: bucket.numel]))

    @classmethod
    def floor(cls, bucket: Bucket, encoded: Encoded, read_bytes: int, *, first: bool = False) -> Floor:
        """The pack reads the trainer's tensors and writes the bucket; the load reads it and writes the engine's."""
        return Floor(read_bytes, encoded.nbytes, encoded.nbytes, encoded.nbytes)
