"""The LoRA payloads (trainer.lora.rank > 0): the adapters alone, or the model with them merged.

`lora` (update.payload=lora): the engine holds the base weights and the
adapters, as the trainer does (the HF engine injects the same PEFT adapters: EngineSpec.lora). The plan
puts the base weights in buckets of their own and the adapters after them, each layer's A and B in one
bucket (a layer is never half-updated between two buckets). The first update sends every bucket (the
engine starts empty); the base is frozen, so each later update sends the adapter buckets only and the
base buckets cross as empty headers.

`lora_merged` (update.payload=lora_merged): the engine holds a model without adapters; each targeted weight
crosses as W + alpha/rank * B @ A, merged in fp32 as it is read (rlsync.model.lora.MergedWeights), then
cast to the engine's dtype like any full update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from rlsync.config.schema import Config
from rlsync.engines.base import Engine, engine_class
from rlsync.errors import ConfigError
from rlsync.model.build import torch_dtype
from rlsync.model.lora import MergedWeights, adapter_shapes, is_adapter, merge_errors, scaling
from rlsync.update.buckets import Bucket, TensorMeta, plan_units
from rlsync.update.payload.base import (
    BESIDE_FULL,
    DECODE_FLOOR,
    FULL,
    Encoded,
    Encoder,
    Floor,
    Payload,
    PlanContext,
)
from rlsync.update.payload.full import FullEncoder, FullPayload

RANK_SHOWN = 16  # the planner's adapter row when trainer.lora.rank is 0: the rank the field's recipes use
MERGE_METRICS = ("update/lora_merge_error", "update/lora_merge_error_in_dtype", "update/lora_merge_differ_ratio")


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
    name = "lora"
    title = "LoRA adapters only"
    note = "the first update also sent the base"
    adapters = True

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        update, rollout = cfg.update, cfg.rollout
        engine = engine_class(rollout.engine)
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
                rollout.release_level == 2,
                "rollout.release_level",
                2,
                "0 or 1 (level 2 frees the weights: an adapter-only update cannot refill the base)",
            ),
            (
                bool(update.engine_address),
                "update.engine_address",
                update.engine_address,
                f"null (a standalone engine's start message carries no adapters yet: use {LoraMergedPayload.key()})",
            ),
            (
                not engine.takes_adapters,
                "rollout.engine",
                rollout.engine,
                f"an engine that holds PEFT adapters, such as hf, or {LoraMergedPayload.key()} (the {engine.title} "
                "engine takes no adapters from rlsync: vLLM loads one from a directory through a LoRARequest, and "
                "rlsync does not write one per update yet)",
            ),
        ]
        bench = getattr(cfg, "bench", None)
        if bench is not None and getattr(bench, "target", "update") == "update":
            refusals.append(
                (
                    bench.warmup < 1,
                    "bench.warmup",
                    bench.warmup,
                    f"1 or more with {cls.key()} (the first update also sends the base weights)",
                )
            )
        for refused, key, value, allowed in refusals:
            if refused:
                raise ConfigError(key, value, allowed, f"not allowed with {cls.key()}")

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
    def planned(cls, ctx: PlanContext) -> dict:
        """A later update: the adapter buckets at trainer.lora.rank (or at RANK_SHOWN without LoRA), each layer's A
        and B in one bucket as `plan` puts them, read and cast as a full update's (its declared floor)."""
        rank = ctx.lora.rank or RANK_SHOWN
        adapters = adapter_shapes(list(ctx.model_shapes), dataclasses.replace(ctx.lora, rank=rank))
        metas = [TensorMeta(name, tuple(shape), ctx.buckets[0].dtype) for name, shape in adapters]  # engine dtype
        size = ctx.bucket_bytes or sum(m.nbytes for m in metas)  # no bucket size given: all in one bucket
        buckets = plan_units(adapter_units(metas), size) if metas else []
        row = super().planned(dataclasses.replace(ctx, buckets=buckets))
        return {**row, "rank": rank, "configured": bool(ctx.lora.rank)}

    @classmethod
    def plan_lines(cls, row: dict) -> tuple[str, list[str]]:
        shown = "" if row["configured"] else f"; with trainer.lora.rank={row['rank']}"
        return f"LoRA rank {row['rank']} adapters only ({cls.key()}{shown})", []

    @classmethod
    def floor(cls, bucket: Bucket, encoded: Encoded, read_bytes: int, *, first: bool = False) -> Floor:
        """A bucket that crosses costs what the full payload's does; a base bucket left out, nothing."""
        return FullPayload.floor(bucket, encoded, read_bytes) if encoded.nbytes else Floor()


class LoraMergedPayload(FullPayload):
    name = "lora_merged"
    title = "LoRA merged in fp32"
    adapters = True
    beside_full = True  # its bytes beside the full update's: the same, the adapters merged into them
    metrics = BESIDE_FULL + DECODE_FLOOR + MERGE_METRICS + ("perf/lora_merge_error_time",)
    after_update_phase = "lora_merge_error"

    @classmethod
    def planned(cls, ctx: PlanContext) -> None:
        return None  # the full update's bytes (the merge runs as the update reads the weights): no row of its own

    @classmethod
    def after_update(cls, params: dict[str, torch.Tensor], cfg) -> dict[str, float]:
        """How far the engine's merged weights land from the exact W + s*BA, merged in fp32 then cast, and
        merged in the engine's dtype (rlsync.model.lora.merge_errors)."""
        return merge_errors(params, scaling(cfg.trainer.lora), torch_dtype(cfg.rollout.dtype))

    @classmethod
    def plan(cls, metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
        return super().plan([m for m in metas if not is_adapter(m.name)], bucket_bytes)

    @classmethod
    def source(cls, weights: Mapping[str, torch.Tensor], cfg: Config) -> Mapping[str, torch.Tensor]:
        return MergedWeights(weights, scaling(cfg.trainer.lora))
