"""Flatten a bucket into one contiguous buffer, and rebuild named views from it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rlsync.sync.buckets import Bucket


def views(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) for every tensor of `bucket` inside `flat` (no copy)."""
    for slot in bucket.slots:
        yield slot.meta.name, flat[slot.offset : slot.offset + slot.meta.numel].view(slot.meta.shape)


@torch.no_grad()
def pack(bucket: Bucket, weights: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
    """Copy each tensor of `bucket` from `weights` into `flat`, casting to the wire dtype in the copy."""
    for name, view in views(bucket, flat):
        view.copy_(weights[name], non_blocking=True)
