"""The weight update: the trainer's new weights into the rollout engine.

`open_engine` starts the engine behind the configured transport and returns a handle with one
interface whatever the transport: `generate`, `release`, `resume`, `update_weights`, `weights` (or
`checksums` across a process boundary), `close`.
`update_weights` here wraps a transport's update with what every transport reports: bytes,
buckets, bandwidth, the limit and the efficiency against it, and the optional verification.
"""

from __future__ import annotations

import torch

from rlsync.config import UpdateConfig, bucket_bytes
from rlsync.sync.buckets import Bucket, metas_of, plan_buckets
from rlsync.timing import DeviceMemory, Stopwatch

TRANSPORTS = ("direct",)
STRATEGIES = ("bucketed", "per_tensor")
SOURCES = ("device",)


class WeightMismatch(RuntimeError):
    pass


def plan_for(weights: dict[str, torch.Tensor], cfg: UpdateConfig, engine_dtype: torch.dtype) -> list[Bucket]:
    return plan_buckets(metas_of(weights, engine_dtype), bucket_bytes(cfg))


def open_engine(cfg: UpdateConfig, *, spec, buckets: list[Bucket]):
    """Start the engine described by `spec` behind the configured transport; returns its handle."""
    if cfg.transport == "direct":
        from rlsync.sync.direct import LocalEngine

        return LocalEngine(spec.build(), buckets, strategy=cfg.strategy)
    raise ValueError(f"update.transport={cfg.transport!r}: expected one of {TRANSPORTS}")


def checksum(t: torch.Tensor) -> int:
    """Order-sensitive integer checksum of a tensor's bits (equal bits <=> equal checksum, practically)."""
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    bits = t.detach().contiguous().view(-1).view(int_dtype).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return int((bits * weights).sum())


def verify(trainer_weights: dict[str, torch.Tensor], engine_checksums: dict[str, int], dtype: torch.dtype) -> None:
    for name, tensor in trainer_weights.items():
        if checksum(tensor.to(dtype)) != engine_checksums[name]:
            raise WeightMismatch(f"weight update verification failed: engine tensor {name!r} differs from the trainer's")


def update_weights(engine, weights: dict[str, torch.Tensor], *, buckets: list[Bucket], cfg: UpdateConfig,
                   device: torch.device, limit_time: float) -> dict[str, float]:
    """One timed weight update; the metrics family `perf/update_weights_*`."""
    watch, memory = Stopwatch(device), DeviceMemory(device)
    with memory.track(), watch("update"):
        split = engine.update_weights(weights)
    seconds = watch.seconds["update"]
    nbytes = sum(b.nbytes for b in buckets)
    staging = split.pop("perf/update_weights_staging_bytes", 0)
    metrics = {
        "perf/update_weights_time": seconds,
        "perf/update_weights_bytes": nbytes,
        "perf/update_weights_buckets": len(buckets) if cfg.strategy == "bucketed" else len(weights),
        "perf/update_weights_gbps": nbytes / seconds / 1e9,
        "perf/update_weights_limit_time": limit_time,
        "perf/update_weights_efficiency": limit_time / seconds,
        "perf/update_weights_peak_bytes": memory.peak_extra if device.type == "cuda" else staging,
        **split,
    }
    if cfg.verify:
        verify(weights, engine_checksums(engine), buckets[0].dtype)
    return metrics


def engine_checksums(engine) -> dict[str, int]:
    if hasattr(engine, "checksums"):
        return engine.checksums()
    return {name: checksum(t) for name, t in engine.weights().items()}
