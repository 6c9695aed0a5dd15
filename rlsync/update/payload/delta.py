"""The `delta` payload (update.payload=delta): only the elements whose engine-dtype value changed.

The trainer keeps the last values it sent, per bucket, in the engine's dtype (the memory check counts
them: one more copy of the engine's weights, on the engine's device). The first update is full; each
later bucket is packed as usual, compared bit for bit with the last values, and only the changed
elements cross: int32 positions within the bucket, then their values (6 bytes per element in bf16,
as AReaL-DTE counts). Where that is no smaller than the bucket itself (over a third of it changed in
bf16), the bucket goes whole. The engine writes the values in place, by trainer name, so it needs
weights it exposes by trainer name, kept between updates: the HF engine; not vLLM (it fuses and
re-packs them), not with rollout.release_level=2 (freed weights come back empty).

Bit-exact with the full update: the engine ends with the trainer's weights cast to its dtype, as
update.verify's checksums check after every step.
"""

from __future__ import annotations

from dataclasses import replace

import torch

import rlsync.update.flat as flat
from rlsync.engines.base import Engine, engine_class
from rlsync.errors import ConfigError
from rlsync.fmt import fmt_share
from rlsync.update.buckets import Bucket
from rlsync.update.payload import native
from rlsync.update.payload.base import (
    BESIDE_FULL,
    DECODE_FLOOR,
    ENCODE_FLOOR,
    FULL,
    KEY,
    SPARSE,
    Encoded,
    Encoder,
    Floor,
    Payload,
    PlanContext,
)
from rlsync.update.payload.full import FullPayload
from rlsync.update.payload.kernels import (
    CUDA_CHUNK,
    INDEX_BYTES,
    LINE_BYTES,
    SAME_WIDTH_INT,  # noqa: F401 - the bit-for-bit comparison's integer types, by width (kept importable here)
    Workers,
    delta_encode,
    line_bytes,
    scatter_changed,
)

INDEX_MAX = 2**31 - 1  # a bucket of more elements than an int32 counts goes whole
APPLY_PIECE = 1 << 18  # positions a scatter call takes at most (the apply's threads split a tensor's by it)


def expected_lines(bucket: Bucket, changed: int, grain: int) -> int:
    """The lines of `grain` bytes that `changed` elements of `bucket` at random places fall in, on average: each
    of its lines holds grain / itemsize elements, and holds none with probability (1 - changed / numel) to that."""
    if not changed or not bucket.numel:
        return 0
    total = -(-bucket.nbytes // grain)
    per_line = max(1, grain // bucket.dtype.itemsize)
    return round(total * (1 - (1 - min(1.0, changed / bucket.numel)) ** per_line))


def sparse_bytes(changed: int, itemsize: int) -> int:
    """Bytes a bucket with `changed` changed elements carries sparse: positions, then values."""
    return changed * (INDEX_BYTES + itemsize)


class DeltaEncoder(Encoder):
    """Keeps each bucket's last sent values (the engine's dtype, on its device) and sends what changed."""

    def __init__(self, buckets: list[Bucket]):
        self.last: list[torch.Tensor | None] = [None] * len(buckets)
        self.workers = Workers()  # the chunks over the update's CPU threads, each with its scratch

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.last if t is not None)  # the scratch: transient

    @torch.no_grad()
    def encode(self, index, bucket, weights, buffer, timer, row) -> Encoded:
        first = self.last[index] is None
        with timer("encode", row):  # cast, compare, count, compact and remember: one pass (kernels.delta_encode)
            if first:  # the first update: whole, and its values kept
                self.last[index] = torch.empty(bucket.numel, dtype=buffer.dtype, device=buffer.device)
            if bucket.numel > INDEX_MAX:  # positions an int32 cannot hold: whole, compared and kept
                whole, count, lines = True, bucket.numel, None
                flat.pack(bucket, weights, buffer[: bucket.numel])
                read = sum(weights[n].numel() * weights[n].element_size() for n in bucket.names)
                self.last[index].copy_(buffer[: bucket.numel])
            else:
                whole, count, read, lines = delta_encode(
                    bucket, weights, buffer, self.last[index], self.workers, first=first
                )
        if whole:
            encoded = Encoded(FULL, bucket.numel, bucket.nbytes, count)
        else:
            encoded = Encoded(SPARSE, count, sparse_bytes(count, buffer.element_size()), count)
        grain = line_bytes(buffer.device)
        return replace(encoded, floor=DeltaPayload.floor(bucket, encoded, read, first=first, lines=lines, grain=grain))


class DeltaPayload(Payload):
    name = "delta"
    title = "Delta"
    metrics = (*BESIDE_FULL, "perf/update_weights_changed_ratio", *ENCODE_FLOOR, *DECODE_FLOOR)
    fit_terms = ("floor", "tensors", "changed")  # its compare and scatter cost per changed element beside its floor
    workers = Workers()  # the engine side's scatters over its threads (decode is a class method: no instance)

    @classmethod
    def kernels(cls, device: str) -> str | None:
        return native.DELTA.describe("numpy's steps") if device.startswith("cpu") else "torch's ops"

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
                rollout.release_level == 2,
                "rollout.release_level",
                2,
                "0, 1 (level 2 frees the weights, which come back empty: a delta needs the last ones)",
            ),
            (
                bool(update.engine_address),
                "update.engine_address",
                update.engine_address,
                "null (a standalone engine's start message carries no payload yet)",
            ),
            (
                not engine.holds_flat_weights,
                "rollout.engine",
                rollout.engine,
                f"an engine that holds its weights by trainer name, such as hf, or another {KEY} (the "
                f"{engine.title} engine's weights cannot be patched in place by trainer name: vLLM fuses q/k/v and "
                "gate/up and re-packs them)",
            ),
        ]
        for refused, key, value, allowed in refusals:
            if refused:
                raise ConfigError(key, value, allowed, f"not allowed with {cls.key()}")

    @classmethod
    def planned_encoded(cls, bucket: Bucket, ctx: PlanContext) -> Encoded:
        """At plan.changed_ratio: the positions and values of the changed elements, or the bucket whole where
        they are no smaller (or an int32 cannot index it), as `DeltaEncoder.encode` decides."""
        changed = round(ctx.changed_ratio * bucket.numel)
        sparse = sparse_bytes(changed, ctx.engine_itemsize)
        if sparse < bucket.nbytes and bucket.numel <= INDEX_MAX:
            encoded = Encoded(SPARSE, changed, sparse, changed)
        else:
            encoded = Encoded(FULL, bucket.numel, bucket.nbytes, changed)
        read = bucket.numel * ctx.trainer_itemsize  # the lines changes at random places touch, on the plan's device
        return replace(encoded, floor=cls.floor(bucket, encoded, read, grain=ctx.line_bytes))

    @classmethod
    def planned(cls, ctx: PlanContext) -> dict:
        """A later update's bytes and floor at plan.changed_ratio (the first one is full)."""
        row = super().planned(ctx)
        row.update(
            changed_ratio=ctx.changed_ratio, changed=sum(round(ctx.changed_ratio * b.numel) for b in ctx.buckets)
        )
        return row

    @classmethod
    def plan_lines(cls, row: dict) -> tuple[str, list[str]]:
        return f"{cls.title.lower()} at {fmt_share(row['changed_ratio'])} changed ({cls.key()})", []

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
        items, start = [], 0
        for slot, end in zip(bucket.slots, cuts):
            # straight into the engine tensor's weights, in pieces of at most APPLY_PIECE positions so that the
            # threads share a large tensor's (an embedding's) evenly
            for a in range(start, end, APPLY_PIECE):
                b = min(end, a + APPLY_PIECE)
                items.append((weights[slot.meta.name], positions[a:b], values[a:b], slot.offset))
            start = end

        def work(run, scratch):
            for target, where, changed, origin in run:
                scatter_changed(target, where, changed, origin)

        cls.workers.run(buffer.device, items, lambda item: item[1].numel(), work)  # the pieces over the threads

    @classmethod
    def floor(
        cls,
        bucket: Bucket,
        encoded: Encoded,
        read_bytes: int,
        *,
        first: bool = False,
        lines: int | None = None,
        grain: int = LINE_BYTES["cpu"],
    ) -> Floor:
        """The encode reads the trainer's bucket and, after the first update, the last values; it writes what
        crosses (the whole bucket, or the positions and values of the changed elements) and the changed last
        values (the first update: all of them). The decode reads what crossed and writes the engine's changed
        elements (whole: every one). A bucket that turns whole part-way (over a third changed in bf16) writes
        more of its last values than changed: its floor stays this one.

        A sparse bucket's changed elements are scattered: memory moves them in lines of `grain` bytes (a CPU's
        64-byte cache line, a GPU's 32-byte sector), a line written whole and, where partly written, read first.
        So the changed last values count the `lines` they fall in, written; the apply the same lines of the
        engine's weights, read and written (at 1 % of bf16 elements changed at random, 27 % of the lines: 1 -
        0.99^32). Lines are counted from the bucket's start (`delta_encode`), as they lie in the last values; an
        engine tensor that starts off a line of the bucket has its own lines elsewhere, the same number for
        changes at random places. `lines` None (the planner): the expected number for changes at random places."""
        n, itemsize = bucket.nbytes, bucket.dtype.itemsize
        if first:
            return Floor(read_bytes, 2 * n, n, n)
        if encoded.mode == FULL:
            changed = (encoded.changed if encoded.changed is not None else bucket.numel) * itemsize
            return Floor(read_bytes + n, n + changed, n, n)
        if lines is None:
            lines = expected_lines(bucket, encoded.count, grain)
        touched = min(n, lines * grain)
        return Floor(read_bytes + n, encoded.nbytes + touched, encoded.nbytes + touched, touched)

    @classmethod
    def memory_bytes(cls, total_bytes: int, largest_bucket_bytes: int, itemsize: int) -> tuple[int, int]:
        """The last values of every bucket; while one bucket is encoded: one chunk's cast, changed mask (a byte an
        element), int64 positions and values (kernels.DeltaWriter; a GPU's chunk, the larger, counted)."""
        chunk = min(largest_bucket_bytes // itemsize, CUDA_CHUNK)
        return total_bytes, chunk * (2 * itemsize + 1 + 8)
