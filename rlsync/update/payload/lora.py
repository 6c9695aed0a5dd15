"""The LoRA payloads (trainer.lora.rank > 0): the adapters alone, or the model with them merged.

`lora_adapter` (update.lora=adapter, the default with LoRA): the engine holds the base weights and the
adapters, as the trainer does (the HF engine injects the same PEFT adapters: EngineSpec.lora). The plan
puts the base weights in buckets of their own and the adapters after them, each layer's A and B in one
bucket (a layer is never half-updated between two buckets). The first update sends every bucket (the
engine starts empty); the base is frozen, so each later update sends the adapter buckets only and the
base buckets cross as empty headers.

`lora_merged` (update.lora=merged): the engine holds a model without adapters; each targeted weight
crosses as W + alpha/rank * B @ A, merged in fp32 as it is read (rlsync.model.lora.MergedWeights), then
cast to the engine's dtype like any full update.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rlsync.config.schema import Config
from rlsync.engines.base import Engine
from rlsync.errors import ConfigError
from rlsync.model.lora import MergedWeights, is_adapter, scaling
from rlsync.update.buckets import Bucket, TensorMeta, plan_units
from rlsync.update.payload.base import FULL, Encoded, Encoder, Floor, Payload
from rlsync.update.payload.full import FullEncoder, FullPayload


def adapter_units(metas: list[TensorMeta]) -> list[list[TensorMeta]]:
    """The base tensors one by one, then each layer's A and B as one unit (PEFT names A before B)."""
    base = [[m] for m in metas if not is_adapter(m.name)]
    adapters = [m for m in metas if is_adapter(m.name)]
    pairs: dict[str, list[TensorMeta]] = {}
    for meta in adapters:
        pairs.setdefault(meta.name.rsplit(".lora_", 1)[0], []).append(meta)
    return base + list(pairs.values())


class AdapterEncoder(Encoder):
    """Every bucket on the first update; the adapter buckets only after it (the base never changes)."""

    def __init__(self, buckets: list[Bucket]):
        self.adapter = [all(is_adapter(n) for n in b.names) for b in buckets]
        self.sent_base = False
        self.full = FullEncoder()

    def encode(self, index, bucket, weights, buffer, timer, row) -> Encoded:
        if not self.adapter[index] and self.sent_base:  # nothing crosses: the engine keeps the base it has
            return Encoded(FULL, 0, 0, None, floor=Floor())
        if index == len(self.adapter) - 1:
            self.sent_base = True
        return self.full.encode(index, bucket, weights, buffer, timer, row)


class LoraAdapterPayload(Payload):
    name = "lora_adapter"

    @classmethod
    def check_config(cls, cfg) -> None:
        update, rollout = cfg.update, cfg.rollout
        refusals = [
            (
                update.strategy != "bucketed",
                "update.strategy",
                update.strategy,
                "bucketed (adapters travel in buckets)",
            ),
            (
                update.flat_engine_weights is True,
                "update.flat_engine_weights",
                True,
                "false or null (the engine's adapters are PEFT's own parameters, not views of the buckets)",
            ),
            (
                rollout.sleep_level == 2,
                "rollout.sleep_level",
                2,
                "0 or 1 (level 2 frees the weights: an adapter-only update cannot refill the base)",
            ),
            (update.delta, "update.delta", True, "false (one payload at a time: the adapters go whole)"),
            (
                update.wire_dtype is not None,
                "update.wire_dtype",
                update.wire_dtype,
                "null (one payload at a time: the adapters go in the engine's dtype)",
            ),
            (
                bool(update.engine_address),
                "update.engine_address",
                update.engine_address,
                "null (a standalone engine's start message carries no adapters yet: use update.lora=merged)",
            ),
        ]
        bench = getattr(cfg, "bench", None)
        if bench is not None and getattr(bench, "target", "update") == "update":
            refusals.append(
                (
                    bench.warmup < 1,
                    "bench.warmup",
                    bench.warmup,
                    "1 or more with update.lora=adapter (the first update also sends the base weights)",
                )
            )
        for refused, key, value, allowed in refusals:
            if refused:
                raise ConfigError(key, value, allowed, "not allowed with update.lora=adapter")

    @classmethod
    def plan(cls, metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
        base = [u for u in adapter_units(metas) if not is_adapter(u[0].name)]
        pairs = [u for u in adapter_units(metas) if is_adapter(u[0].name)]
        return plan_units(base, bucket_bytes) + plan_units(pairs, bucket_bytes)  # no bucket mixes the two

    @classmethod
    def encoder(cls, buckets: list[Bucket], device: torch.device) -> Encoder:
        return AdapterEncoder(buckets)

    @classmethod
    def decode(cls, engine: Engine, bucket: Bucket, buffer: torch.Tensor, encoded: Encoded) -> None:
        if encoded.count:
            FullPayload.decode(engine, bucket, buffer, encoded)

    @classmethod
    def engine_lora(cls, cfg: Config):
        return cfg.trainer.lora

    @classmethod
    def floor(cls, bucket: Bucket, encoded: Encoded, read_bytes: int, *, first: bool = False) -> Floor:
        """A bucket that crosses costs what the full payload's does; a base bucket left out, nothing."""
        return FullPayload.floor(bucket, encoded, read_bytes) if encoded.nbytes else Floor()


class LoraMergedPayload(FullPayload):
    name = "lora_merged"

    @classmethod
    def check_config(cls, cfg) -> None:
        update = cfg.update
        for refused, key, value in (
            (update.delta, "update.delta", True),
            (update.wire_dtype is not None, "update.wire_dtype", update.wire_dtype),
        ):
            if refused:
                raise ConfigError(
                    key, value, "its default (one payload at a time: the merged model goes whole)", "not allowed"
                )

    @classmethod
    def plan(cls, metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
        return super().plan([m for m in metas if not is_adapter(m.name)], bucket_bytes)

    @classmethod
    def source(cls, weights: Mapping[str, torch.Tensor], cfg: Config) -> Mapping[str, torch.Tensor]:
        return MergedWeights(weights, scaling(cfg.trainer.lora))
