"""The `full` payload: every element of every bucket, in the engine's dtype (the default)."""

from __future__ import annotations

import torch

import rlsync.sync.flat as flat
from rlsync.engines.base import Engine
from rlsync.sync.buckets import Bucket
from rlsync.sync.payload.base import FULL, Encoded, Encoder, Payload


class FullEncoder(Encoder):
    def encode(self, index, bucket, weights, buffer, timer, row) -> Encoded:
        with timer("pack", row):
            flat.pack(bucket, weights, buffer[: bucket.numel])
        return Encoded(FULL, bucket.numel, bucket.nbytes, None)


class FullPayload(Payload):
    name = "full"
    whole = True

    @classmethod
    def encoder(cls, buckets: list[Bucket], device: torch.device) -> Encoder:
        return FullEncoder()

    @classmethod
    def decode(cls, engine: Engine, bucket: Bucket, buffer: torch.Tensor, encoded: Encoded) -> None:
        engine.load_weights(flat.views(bucket, buffer[: bucket.numel]))
