"""Flatten a bucket into one contiguous buffer, and rebuild named views from it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rlsync.measure.devices import copy_into
from rlsync.update.buckets import Bucket


def views(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) for every tensor of `bucket` inside `flat` (no copy)."""
    for slot in bucket.slots:
        yield slot.meta.name, flat[slot.offset : slot.offset + slot.meta.numel].view(slot.meta.shape)


@torch.no_grad()
def pack(bucket: Bucket, weights: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
    """Copy each tensor of `bucket` from `weights` into `flat`, casting to the wire dtype in the copy."""
    for name, view in views(bucket, flat):
        copy_into(view, weights[name])


def allocate(buckets: list[Bucket], device: torch.device, *, shared: bool = False) -> list[torch.Tensor]:
    """One flat buffer per bucket, laid out as the plan says. `shared`: CPU shared memory, so another
    process can map the same pages (CUDA memory is shared through CUDA IPC when pickled anyway)."""
    return [empty(b.numel, b.dtype, device, shared=shared) for b in buckets]


def empty(numel: int, dtype: torch.dtype, device: torch.device, *, shared: bool = False) -> torch.Tensor:
    buffer = torch.empty(numel, dtype=dtype, device=device)
    return buffer.share_memory_() if shared and device.type == "cpu" else buffer


@torch.no_grad()
def bind(engine_weights: dict[str, torch.Tensor], buckets: list[Bucket], buffers: list[torch.Tensor]) -> None:
    """Make every engine weight a view into its bucket's flat buffer, keeping its current values.

    Afterwards `pack(bucket, trainer_weights, buffers[i])` writes the engine's weights themselves: an
    update is one copy. Needs an engine whose weights have the trainer's names, shapes and dtype
    (the HF engine; not a fused-layout engine such as vLLM's).
    """
    planned = {s.meta.name: s.meta for b in buckets for s in b.slots}
    if set(planned) != set(engine_weights):
        missing, extra = sorted(set(planned) - set(engine_weights)), sorted(set(engine_weights) - set(planned))
        raise ValueError(
            "update.flat_engine_weights=true needs the engine's weights to match the trainer's names; "
            f"not in the engine: {missing[:3]}, not in the trainer: {extra[:3]}"
        )
    for bucket, buffer in zip(buckets, buffers, strict=True):
        for name, view in views(bucket, buffer):
            param = engine_weights[name]
            if tuple(param.shape) != tuple(view.shape) or param.dtype != view.dtype:
                raise ValueError(
                    f"update.flat_engine_weights=true: engine weight {name!r} is {tuple(param.shape)} "
                    f"{param.dtype}, the plan says {tuple(view.shape)} {view.dtype}"
                )
            view.copy_(param.data)
            param.data = view  # the parameter object stays (modules and tied weights keep pointing at it)
