"""Bucket planning: which named tensors travel together, at which offsets.

Pure functions on metadata only. The plan is deterministic (same names, shapes and order in,
same buckets out), so the trainer and an engine in another process compute the same layout.
A new bucket starts when the next tensor would overflow the bucket size or changes dtype; a
tensor larger than the bucket size travels alone in its own, larger bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # the dtype on the wire (the engine's)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Slot:
    meta: TensorMeta
    offset: int  # in elements, within the bucket's flat buffer


@dataclass(frozen=True)
class Bucket:
    slots: tuple[Slot, ...]
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def names(self) -> list[str]:
        return [s.meta.name for s in self.slots]


def metas_of(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> list[TensorMeta]:
    """Wire metadata for `weights` cast to `dtype`, in the dict's order."""
    return [TensorMeta(name, tuple(t.shape), dtype) for name, t in weights.items()]


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    return plan_units([[m] for m in metas], bucket_bytes)


def plan_units(units: list[list[TensorMeta]], bucket_bytes: int) -> list[Bucket]:
    """As plan_buckets, for units of tensors that always travel in one bucket (a LoRA layer's A and B):
    a unit that would overflow the open bucket starts the next; one larger than the size travels alone."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    used = 0  # elements in the open bucket
    for unit in units:
        dtype, numel = unit[0].dtype, sum(m.numel for m in unit)
        overflow = (used + numel) * dtype.itemsize > bucket_bytes
        if slots and (overflow or slots[0].meta.dtype != dtype):
            buckets.append(Bucket(tuple(slots), used, slots[0].meta.dtype))
            slots, used = [], 0
        for meta in unit:
            slots.append(Slot(meta, used))
            used += meta.numel
    if slots:
        buckets.append(Bucket(tuple(slots), used, slots[0].meta.dtype))
    return buckets


def greedy_groups(sizes: list[int], cap: int | None, *, breaks=lambda i: False) -> list[list[int]]:
    """Indices of `sizes` (in order) packed greedily into consecutive groups of at most `cap`.

    A new group starts when the next size would overflow the cap or `breaks(i)` says so (a dtype
    change, say); a size over the cap is a group of its own; `cap=None` never overflows.
    """
    groups: list[list[int]] = []
    current, filled = [], 0
    for i, size in enumerate(sizes):
        if current and ((cap is not None and filled + size > cap) or breaks(i)):
            groups.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        groups.append(current)
    return groups


def largest_bucket_bytes(buckets: list[Bucket]) -> int:
    return max((b.nbytes for b in buckets), default=0)
