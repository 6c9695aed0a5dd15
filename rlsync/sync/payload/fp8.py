"""The `fp8` payload (update.wire_dtype=float8_e4m3fn): 2-D weights cross in FP8, block-quantized.

As the Qwen3-FP8 and DeepSeek-V3 checkpoints store them: e4m3 values with one float32 scale per
128x128 block (the block's largest magnitude over 448, e4m3's largest finite value); the embeddings,
lm_head, norms and any tensor under 1024 elements stay in the engine's dtype, as those checkpoints
keep them (the embeddings and head are looked up or projected once per token, where FP8's error is
largest for what it saves; a norm is one vector). The trainer quantizes each bucket (timed as
`encode`); the engine dequantizes into its weights, in its dtype (timed as `load`): no engine here
keeps FP8 weights. update.verify checks the engine against the same quantize-dequantize of the
trainer's weights, bit for bit; train/logprob_abs_diff shows what FP8 costs the log-probs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rlsync.engines.base import Engine
from rlsync.errors import ConfigError
from rlsync.sync.buckets import Bucket, Slot
from rlsync.sync.payload.base import Encoded, Encoder, Payload

BLOCK = 128  # the scale's block, each way
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8 = torch.float8_e4m3fn
MIN_QUANTIZED = (
    1024  # smaller tensors stay in the engine's dtype: their scales and alignment would outweigh the bytes saved
)
KEPT = ("embed_tokens", "lm_head")  # as FP8 checkpoints keep them
QUANTIZED_MODE = 2  # Encoded.mode


def quantized(slot: Slot) -> bool:
    """Whether this tensor crosses in FP8 (both sides decide it from the plan alone)."""
    meta = slot.meta
    return len(meta.shape) == 2 and meta.numel >= MIN_QUANTIZED and not any(k in meta.name for k in KEPT)


def blocks_of(shape: tuple[int, ...]) -> tuple[int, int]:
    return math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)


def layout(bucket: Bucket) -> tuple[list[tuple[Slot, bool, int, int]], int]:
    """(slot, quantized, byte offset of its values, byte offset of its scales) per tensor, and the bytes
    in all; each part aligned to its element size."""
    out, at = [], 0
    for slot in bucket.slots:
        if quantized(slot):
            values = at
            scales = -(-(values + slot.meta.numel) // 4) * 4
            at = scales + 4 * math.prod(blocks_of(slot.meta.shape))
        else:
            size = bucket.dtype.itemsize
            values = scales = -(-at // size) * size
            at = values + slot.meta.nbytes
        out.append((slot, quantized(slot), values, scales))
    return out, at


@torch.no_grad()
def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (2-D) as e4m3 values and a float32 scale per 128x128 block."""
    rows, cols = x.shape
    br, bc = blocks_of(x.shape)
    padded = F.pad(x.float(), (0, bc * BLOCK - cols, 0, br * BLOCK - rows)).view(br, BLOCK, bc, BLOCK)
    amax = padded.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (padded / scale[:, None, :, None]).to(FP8).view(br * BLOCK, bc * BLOCK)[:rows, :cols]
    return q.contiguous(), scale


@torch.no_grad()
def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = q.shape
    br, bc = scale.shape
    padded = F.pad(q.float(), (0, bc * BLOCK - cols, 0, br * BLOCK - rows)).view(br, BLOCK, bc, BLOCK)
    return (padded * scale[:, None, :, None]).view(br * BLOCK, bc * BLOCK)[:rows, :cols].to(dtype)


def reference(slot: Slot, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the engine holds of `tensor` after an FP8 update: the same quantize-dequantize, or the cast."""
    return dequantize_blocks(*quantize_blocks(tensor), dtype) if quantized(slot) else tensor.to(dtype)


class Fp8Encoder(Encoder):
    @torch.no_grad()
    def encode(self, index, bucket, weights, buffer, timer, row) -> Encoded:
        parts, nbytes = layout(bucket)
        raw = buffer.view(torch.uint8)
        for slot, fp8, values, scales in parts:
            source = weights[slot.meta.name]
            if fp8:
                with timer("encode", row):
                    q, scale = quantize_blocks(source)
                    raw[values : values + slot.meta.numel].copy_(q.view(torch.uint8).view(-1))
                    raw[scales : scales + 4 * scale.numel()].view(torch.float32).copy_(scale.view(-1))
            else:
                with timer("pack", row):
                    raw[values : values + slot.meta.nbytes].view(bucket.dtype).copy_(source.reshape(-1))
        return Encoded(QUANTIZED_MODE, bucket.numel, nbytes, None)


class Fp8Payload(Payload):
    name = "fp8"

    @classmethod
    def check_config(cls, cfg) -> None:
        update = cfg.update
        if update.delta:
            raise ConfigError(
                "update.delta", True, "false with update.wire_dtype set (one payload at a time)", "not allowed"
            )
        if update.strategy != "bucketed":
            raise ConfigError(
                "update.strategy",
                update.strategy,
                "bucketed (FP8 is laid out per bucket)",
                "not allowed with update.wire_dtype",
            )
        if update.flat_engine_weights is True:
            raise ConfigError(
                "update.flat_engine_weights",
                True,
                "false or null (the engine dequantizes FP8 into its weights: the trainer cannot write them in place)",
                "not allowed with update.wire_dtype",
            )
        if update.engine_address:
            raise ConfigError(
                "update.engine_address",
                update.engine_address,
                "null (a standalone engine's start message carries no payload yet)",
                "not allowed with update.wire_dtype",
            )

    @classmethod
    def encoder(cls, buckets: list[Bucket], device: torch.device) -> Encoder:
        return Fp8Encoder()

    @classmethod
    @torch.no_grad()
    def decode(cls, engine: Engine, bucket: Bucket, buffer: torch.Tensor, encoded: Encoded) -> None:
        parts, _ = layout(bucket)
        raw = buffer.view(torch.uint8)
        named = []
        for slot, fp8, values, scales in parts:
            meta = slot.meta
            if fp8:
                q = raw[values : values + meta.numel].view(FP8).view(meta.shape)
                scale = raw[scales : scales + 4 * math.prod(blocks_of(meta.shape))].view(torch.float32)
                tensor = dequantize_blocks(q, scale.view(blocks_of(meta.shape)), bucket.dtype)
            else:
                tensor = raw[values : values + meta.nbytes].view(bucket.dtype).view(meta.shape)
            named.append((meta.name, tensor))
        engine.load_weights(named)  # one call per bucket, as the full payload's

    @classmethod
    def expected(cls, buckets: list[Bucket], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {s.meta.name: reference(s, weights[s.meta.name], b.dtype) for b in buckets for s in b.slots}
