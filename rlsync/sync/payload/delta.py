"""The `delta` payload (update.delta=true): only the elements whose engine-dtype value changed.

The trainer keeps the last values it sent, per bucket, in the engine's dtype (the memory check counts
them: one more copy of the engine's weights, on the engine's device). The first update is full; each
later bucket is packed as usual, compared bit for bit with the last values, and only the changed
elements cross: int32 positions within the bucket, then their values (6 bytes per element in bf16,
as AReaL-DTE counts). Where that is no smaller than the bucket itself (over a third of it changed in
bf16), the bucket goes whole. The engine writes the values in place, by trainer name, so it needs
weights it exposes by trainer name, kept between updates: the HF engine; not vLLM (it fuses and
re-packs them), not with rollout.sleep_level=2 (freed weights come back empty).

Bit-exact with the full update: the engine ends with the trainer's weights cast to its dtype, as
update.verify's checksums check after every step.
"""

from __future__ import annotations

import torch

import rlsync.sync.flat as flat
from rlsync.engines.base import Engine
from rlsync.errors import ConfigError
from rlsync.sync.buckets import Bucket
from rlsync.sync.payload.base import FULL, SPARSE, Encoded, Encoder, Payload
from rlsync.sync.payload.full import FullPayload

INDEX_BYTES = 4  # an int32 position within its bucket
INDEX_MAX = 2**31 - 1  # a bucket of more elements than an int32 counts goes whole
SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bit-for-bit comparison


def sparse_bytes(changed: int, itemsize: int) -> int:
    """Bytes a bucket with `changed` changed elements carries sparse: positions, then values."""
    return changed * (INDEX_BYTES + itemsize)


class DeltaEncoder(Encoder):
    """Keeps each bucket's last sent values (the engine's dtype, on its device) and sends what changed."""

    def __init__(self, buckets: list[Bucket]):
        self.last: list[torch.Tensor | None] = [None] * len(buckets)

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.last if t is not None)

    @torch.no_grad()
    def encode(self, index, bucket, weights, buffer, timer, row) -> Encoded:
        new = buffer[: bucket.numel]
        with timer("pack", row):
            flat.pack(bucket, weights, new)  # the trainer's weights in the engine's dtype, as a full update packs them
        last = self.last[index]
        with timer("encode", row):
            if last is None or bucket.numel > INDEX_MAX:  # the first update (or an outsized bucket): whole
                if last is None:
                    self.last[index] = new.clone()
                else:
                    last.copy_(new)
                return Encoded(FULL, bucket.numel, bucket.nbytes, bucket.numel)
            bits = SAME_WIDTH_INT[new.element_size()]
            changed = new.view(bits) != last.view(bits)  # bit for bit: -0.0 against 0.0 and NaNs count as changed
            count = int(torch.count_nonzero(changed))  # on CUDA a sync: what follows is sized by it
            nbytes = sparse_bytes(count, new.element_size())
            if nbytes >= bucket.nbytes:
                last.copy_(new)
                return Encoded(FULL, bucket.numel, bucket.nbytes, count)
            if count:
                positions = changed.nonzero().view(-1)  # ascending, which the engine side relies on
                values = new.index_select(0, positions)
                last.index_copy_(0, positions, values)
                raw = buffer.view(torch.uint8)  # the values were read out: the buffer can be overwritten
                raw[: count * INDEX_BYTES].view(torch.int32).copy_(positions)
                raw[count * INDEX_BYTES : nbytes].view(new.dtype).copy_(values)
        return Encoded(SPARSE, count, nbytes, count)


class DeltaPayload(Payload):
    name = "delta"

    @classmethod
    def check_config(cls, cfg) -> None:
        update, rollout = cfg.update, cfg.rollout
        refusals = [
            (
                update.strategy != "bucketed",
                "update.strategy",
                update.strategy,
                "bucketed (a delta is encoded per bucket)",
            ),
            (
                update.flat_engine_weights is True,
                "update.flat_engine_weights",
                True,
                "false or null (with flat engine weights the trainer writes the "
                "engine's weights in place: there is no transfer for a delta to shrink)",
            ),
            (
                rollout.sleep_level == 2,
                "rollout.sleep_level",
                2,
                "0, 1 (level 2 frees the weights, which come back empty: a delta needs the last ones)",
            ),
            (
                update.wire_dtype is not None,
                "update.wire_dtype",
                update.wire_dtype,
                "null (one payload at a time: the delta sends the engine's dtype)",
            ),
            (
                bool(update.engine_address),
                "update.engine_address",
                update.engine_address,
                "null (a standalone engine's start message carries no payload yet)",
            ),
        ]
        for refused, key, value, allowed in refusals:
            if refused:
                raise ConfigError(key, value, allowed, "not allowed with update.delta=true")

    @classmethod
    def encoder(cls, buckets: list[Bucket], device: torch.device) -> Encoder:
        return DeltaEncoder(buckets)

    @classmethod
    @torch.no_grad()
    def decode(cls, engine: Engine, bucket: Bucket, buffer: torch.Tensor, encoded: Encoded) -> None:
        if encoded.mode == FULL:
            FullPayload.decode(engine, bucket, buffer, encoded)
            return
        count = encoded.count
        if not count:
            return
        raw = buffer.view(torch.uint8)
        positions = raw[: count * INDEX_BYTES].view(torch.int32)
        values = raw[count * INDEX_BYTES : encoded.nbytes].view(bucket.dtype)
        ends = [s.offset + s.meta.numel for s in bucket.slots]
        bounds = torch.tensor(ends, dtype=torch.int32, device=positions.device)
        cuts = torch.searchsorted(positions, bounds).tolist()  # per tensor, where its positions end
        weights = engine.weights
        start = 0
        for slot, end in zip(bucket.slots, cuts):
            if end > start:
                target = weights[slot.meta.name]
                where = (positions[start:end] - slot.offset).long()
                if target.is_contiguous():
                    target.view(-1).index_copy_(0, where, values[start:end])
                else:  # a view into a fused tensor (per-expert weights of a MoE model)
                    target[torch.unravel_index(where, target.shape)] = values[start:end]
            start = end

    @classmethod
    def memory_bytes(cls, total_bytes: int, largest_bucket_bytes: int, itemsize: int) -> tuple[int, int]:
        """The last values of every bucket; while one bucket is encoded: its changed mask (1 byte an element),
        at most a sparse bucket's worth of int64 positions, and its values."""
        numel = largest_bucket_bytes // itemsize
        most = largest_bucket_bytes // (INDEX_BYTES + itemsize)  # changed elements a sparse bucket can carry
        return total_bytes, numel + most * (8 + itemsize)
