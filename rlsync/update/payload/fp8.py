"""The `fp8` payload (update.payload=fp8): 2-D weights cross in FP8, block-quantized.

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
from dataclasses import replace

import torch
import torch.nn.functional as F

from rlsync.engines.base import Engine
from rlsync.errors import ConfigError
from rlsync.measure.devices import copy_into
from rlsync.update.buckets import Bucket, Slot
from rlsync.update.payload import native
from rlsync.update.payload.base import (
    BESIDE_FULL,
    DECODE_FLOOR,
    ENCODE_FLOOR,
    Encoded,
    Encoder,
    Floor,
    Payload,
    PlanContext,
)
from rlsync.update.payload.kernels import (
    BLOCK,
    E4M3_MAX,
    FP8,
    Scratch,
    Workers,
    block_row_groups,
    blocks_of,
    chunk_elements,
    dequantize_rows,
    dequantize_whole,
    native_dequantize,
    native_quantize,
    quantize_rows,
    quantize_whole,
)

MIN_QUANTIZED = (
    1024  # smaller tensors stay in the engine's dtype: their scales and alignment would outweigh the bytes saved
)
KEPT = ("embed_tokens", "lm_head")  # as FP8 checkpoints keep them
QUANTIZED_MODE = 2  # Encoded.mode


def quantized(slot: Slot) -> bool:
    """Whether this tensor crosses in FP8 (both sides decide it from the plan alone)."""
    meta = slot.meta
    return len(meta.shape) == 2 and meta.numel >= MIN_QUANTIZED and not any(k in meta.name for k in KEPT)


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


def fp8_views(raw: torch.Tensor, meta, values: int, scales: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized tensor's e4m3 values and float32 block scales inside a bucket's bytes `raw`."""
    blocks = blocks_of(meta.shape)
    q = raw[values : values + meta.numel].view(FP8).view(meta.shape)
    return q, raw[scales : scales + 4 * math.prod(blocks)].view(torch.float32).view(blocks)


def row_groups(meta, fp8: bool, device: torch.device) -> list[tuple[int, int]]:
    """(first row, rows) of each chunk the kernels take of a tensor: whole 128-row blocks where it is quantized."""
    if fp8:
        return block_row_groups(meta.shape[0], meta.shape[1], device)
    rows = meta.shape[0] if meta.shape else 1
    step = max(1, chunk_elements(device) // max(1, meta.numel // max(rows, 1)))
    return [(r0, min(step, rows - r0)) for r0 in range(0, rows, step)]


def rows_of(t: torch.Tensor, r0: int, h: int) -> torch.Tensor:
    return (t.reshape(1) if t.dim() == 0 else t)[r0 : r0 + h]


class Fp8Encoder(Encoder):
    def __init__(self):
        self.workers = Workers()  # the chunks over the update's CPU threads, each with its scratch
        self.scratch = Scratch()  # the compiled kernel's values and scales (quantize_whole)

    @torch.no_grad()
    def encode(self, index, bucket, weights, buffer, timer, row) -> Encoded:
        parts, nbytes = layout(bucket)
        raw = buffer.view(torch.uint8)
        device = buffer.device
        with timer("encode", row):  # each quantized tensor a group of block rows at a time, on the threads
            items, read = [], 0
            for slot, fp8, values, scales in parts:
                source, meta = weights[slot.meta.name], slot.meta
                read += source.numel() * source.element_size()
                kind = "copy"
                if fp8:
                    q, scale = fp8_views(raw, meta, values, scales)
                    job = native_quantize(source, q, scale)  # fp8.c (kernels' FP8 note: which runs where)
                    if job is not None:
                        kind, dst = "native", job
                    elif quantize_whole(source, q, scale, self.scratch):  # the compiled kernel (kernels.Compiled)
                        continue
                    else:
                        kind, dst = "rows", (q, scale)
                else:
                    dst = raw[values : values + meta.nbytes].view(bucket.dtype).view(meta.shape)
                width = meta.numel // max(1, meta.shape[0] if meta.shape else 1)  # elements a row
                items += [(kind, source, dst, r0, h, h * width) for r0, h in row_groups(meta, fp8, device)]

            def work(run, scratch):
                for kind, source, dst, r0, h, _ in run:
                    b0, b1 = r0 // BLOCK, -(-(r0 + h) // BLOCK)
                    if kind == "native":
                        dst(b0, b1)
                    elif kind == "rows":
                        q, scale = dst
                        quantize_rows(source[r0 : r0 + h], q[r0 : r0 + h], scale[b0:b1], scratch)
                    else:
                        copy_into(rows_of(dst, r0, h), rows_of(source, r0, h))

            self.workers.run(device, items, lambda item: item[-1], work)
        encoded = Encoded(QUANTIZED_MODE, bucket.numel, nbytes, None)
        return replace(encoded, floor=Fp8Payload.floor(bucket, encoded, read))


class Fp8Payload(Payload):
    name = "fp8"
    title = "FP8 on the wire"
    verified = "the same block quantization of the trainer's"  # quantized, then dequantized: not the weights
    metrics = BESIDE_FULL + ENCODE_FLOOR + DECODE_FLOOR
    fit_terms = ("floor", "tensors")  # one pass each way: a multiple of its floor and a cost per tensor
    workers = Workers()  # the engine side's chunks over its threads (decode is a class method: no instance)

    @classmethod
    def kernels(cls, device: str) -> str | None:
        if not device.startswith("cpu"):
            return "torch.compile's (Triton), else the eager chunks"
        return native.FP8.describe("torch.compile's, else the eager chunks")

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        update = cfg.update
        if update.strategy != "bucketed":
            raise ConfigError(
                "update.strategy",
                update.strategy,
                "bucketed (FP8 is laid out per bucket)",
                f"not allowed with {cls.key()}",
            )
        if update.flat_engine_weights is True:
            raise ConfigError(
                "update.flat_engine_weights",
                True,
                "false or null (the engine dequantizes FP8 into its weights: the trainer cannot write them in place)",
                f"not allowed with {cls.key()}",
            )
        if update.engine_address:
            raise ConfigError(
                "update.engine_address",
                update.engine_address,
                "null (a standalone engine's start message carries no payload yet)",
                f"not allowed with {cls.key()}",
            )

    @classmethod
    def planned_encoded(cls, bucket: Bucket, ctx: PlanContext) -> Encoded:
        """Its byte layout of the bucket (values, scales, kept tensors, aligned), as `Fp8Encoder.encode` writes it."""
        return Encoded(QUANTIZED_MODE, bucket.numel, layout(bucket)[1], None)

    @classmethod
    def plan_lines(cls, row: dict) -> tuple[str, list[str]]:
        return f"{cls.title}, {BLOCK}x{BLOCK} blocks ({cls.key()})", []

    @classmethod
    def encoder(cls, buckets: list[Bucket], device: torch.device) -> Encoder:
        return Fp8Encoder()

    @classmethod
    @torch.no_grad()
    def decode(cls, engine: Engine, bucket: Bucket, buffer: torch.Tensor, encoded: Encoded) -> None:
        """Each tensor a chunk at a time straight into the engine's weight where the engine holds its weights by
        trainer name (`holds_flat_weights`: the HF engine), the quantized ones dequantized on the way (fp8.c's
        block rows on the threads, else the compiled kernel, else kernels.dequantize_rows: kernels' FP8 note);
        else into tensors handed to its loader in one call."""
        parts, _ = layout(bucket)
        raw = buffer.view(torch.uint8)
        device = buffer.device
        weights = engine.weights if engine.holds_flat_weights else None
        items, named = [], []
        for slot, fp8, values, scales in parts:
            meta = slot.meta
            src = fp8_views(raw, meta, values, scales) if fp8 else raw[values : values + meta.nbytes]
            if not fp8:
                src = src.view(bucket.dtype).view(meta.shape)
                if weights is None:
                    named.append((meta.name, src))
                    continue
            if weights is not None:
                target = weights[meta.name]
            else:
                target = torch.empty(meta.shape, dtype=bucket.dtype, device=device)
                named.append((meta.name, target))
            kind = "rows" if fp8 else "copy"
            if fp8:
                job = native_dequantize(*src, target)  # fp8.c (kernels' FP8 note: which runs where)
                if job is not None:
                    kind, src = "native", job
                elif dequantize_whole(*src, target):  # the compiled kernel, whole (kernels.Compiled)
                    continue
            width = meta.numel // max(1, meta.shape[0] if meta.shape else 1)  # elements a row
            items += [(kind, src, target, r0, h, h * width) for r0, h in row_groups(meta, fp8, device)]

        def work(run, scratch):
            for kind, src, target, r0, h, _ in run:
                b0, b1 = r0 // BLOCK, -(-(r0 + h) // BLOCK)
                if kind == "native":
                    src(b0, b1)
                elif kind == "rows":
                    q, scale = src
                    dequantize_rows(q[r0 : r0 + h], scale[b0:b1], target[r0 : r0 + h], scratch)
                else:
                    copy_into(rows_of(target, r0, h), rows_of(src, r0, h))

        cls.workers.run(device, items, lambda item: item[-1], work)
        if named:
            engine.load_weights(named)  # one call per bucket, as the full payload's

    @classmethod
    def floor(cls, bucket: Bucket, encoded: Encoded, read_bytes: int, *, first: bool = False) -> Floor:
        """The encode reads the trainer's tensors once and writes each quantized one's e4m3 values and float32
        scales, each kept one in the engine's dtype; the decode reads those and writes every engine element."""
        wire = 0
        for slot in bucket.slots:
            meta = slot.meta
            wire += meta.numel + 4 * math.prod(blocks_of(meta.shape)) if quantized(slot) else meta.nbytes
        return Floor(read_bytes, wire, wire, bucket.nbytes)

    @classmethod
    def expected(cls, buckets: list[Bucket], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {s.meta.name: reference(s, weights[s.meta.name], b.dtype) for b in buckets for s in b.slots}
