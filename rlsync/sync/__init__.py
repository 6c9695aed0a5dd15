"""The weight update: the trainer's new weights into the rollout engine.

`open_engine` starts the engine described by an `EngineSpec` behind the configured transport and
returns a handle with one interface whatever the transport: `generate`, `release`, `resume`,
`update_weights`, `weights`, `checksums`, `close`.

- `direct` (sync/direct.py): the engine lives in the trainer's process;
- `ipc` (sync/ipc.py): the engine in its own process; buckets travel through staging buffers shared
  with it (shared memory on the CPU, CUDA IPC on a GPU);
- `broadcast` (sync/broadcast.py): the engine in its own process joined to the trainer in a
  torch.distributed group; one broadcast per bucket.

`update_weights` here wraps a transport's update with what every transport reports: bytes, buckets,
bandwidth, the limit and the efficiency against it, the memory peak, and the optional verification.
"""

from __future__ import annotations

import torch

from rlsync.config import MIB, UpdateConfig, bucket_bytes
from rlsync.engines.base import checksum  # the engines' weight fingerprint, which verify compares
from rlsync.errors import UpdateOutOfMemory
from rlsync.sync.buckets import Bucket, metas_of, plan_buckets
from rlsync.sync.threads import cpu_threads
from rlsync.timing import DeviceMemory, Stopwatch

TRANSPORTS = ("direct", "ipc", "broadcast")
STRATEGIES = ("bucketed", "per_tensor", "vllm_ipc")  # vllm_ipc: vLLM's own transfer (rollout.engine=vllm, CUDA)
SOURCES = ("device", "host")
BACKENDS = ("auto", "gloo")  # not nccl: it refuses two ranks on one GPU, where the colocated engine sits


class WeightMismatch(RuntimeError):
    pass


def check_update_config(cfg: UpdateConfig) -> None:
    """Reject wrong values early, naming the key (the entry points' validation says the same, earlier)."""
    from rlsync.errors import ConfigError

    for key, value, allowed in (("transport", cfg.transport, TRANSPORTS), ("strategy", cfg.strategy, STRATEGIES),
                                ("source", cfg.source, SOURCES), ("backend", cfg.backend, BACKENDS)):
        if value not in allowed:
            raise ConfigError(f"update.{key}", value, ", ".join(allowed))
    if cfg.inflight_buckets not in (1, 2):
        raise ConfigError("update.inflight_buckets", cfg.inflight_buckets, "1, 2")
    if cfg.bucket_mb <= 0:
        raise ConfigError("update.bucket_mb", cfg.bucket_mb, "a number > 0 (MiB)", "out of range")
    if cfg.copy_threads < 0:
        raise ConfigError("update.copy_threads", cfg.copy_threads, "0 (torch's default) or a count >= 1", "out of range")
    if cfg.engine_timeout_s <= 0:
        raise ConfigError("update.engine_timeout_s", cfg.engine_timeout_s, "a number > 0 (seconds)", "out of range")


def plan_for(weights: dict[str, torch.Tensor], cfg: UpdateConfig, engine_dtype: torch.dtype) -> list[Bucket]:
    return plan_buckets(metas_of(weights, engine_dtype), bucket_bytes(cfg))


def open_engine(cfg: UpdateConfig, *, spec, buckets: list[Bucket]):
    """Start the engine described by `spec` behind the configured transport; returns its handle."""
    check_update_config(cfg)
    if cfg.transport == "ipc" and cfg.flat_engine_weights and spec.rollout.release_weights:
        from rlsync.errors import ConfigError

        raise ConfigError("update.flat_engine_weights", True, "false with rollout.release_weights=true (with ipc the "
                          "engine's weights are shared memory, which the engine cannot free)",
                          "not allowed with rollout.release_weights=true")
    if cfg.transport == "direct":
        from rlsync.sync.direct import LocalEngine

        return LocalEngine(spec.build(strategy=cfg.strategy), buckets, strategy=cfg.strategy, flat_weights=cfg.flat_engine_weights)
    if cfg.transport == "ipc":
        from rlsync.sync.ipc import IpcEngine

        return IpcEngine(spec, buckets, cfg)
    from rlsync.sync.broadcast import BroadcastEngine

    return BroadcastEngine(spec, buckets, cfg)


def verify(trainer_weights: dict[str, torch.Tensor], engine_checksums: dict[str, int], dtype: torch.dtype) -> None:
    for name, tensor in trainer_weights.items():
        if checksum(tensor.to(dtype)) != engine_checksums[name]:
            raise WeightMismatch(f"weight update verification failed: engine tensor {name!r} differs from the trainer's")


def update_weights(engine, weights: dict[str, torch.Tensor], *, buckets: list[Bucket], cfg: UpdateConfig,
                   device: torch.device, limit_time: float) -> dict[str, float]:
    """One timed weight update; the metrics family `perf/update_weights_*`.

    Peak bytes: the staging buffers the update holds (the transport's own accounting, both sides of a
    process boundary) plus, on CUDA, what the allocators handed out beyond that during the update
    (the trainer's here, the engine's as the transport reports it).
    """
    watch, memory = Stopwatch(device), DeviceMemory(device)
    try:
        with cpu_threads(cfg.copy_threads, device), memory.track(), watch("update"):
            split = engine.update_weights(weights)
    except Exception as err:  # out of memory, here or in the engine process: name the knob, the bucket size
        if is_out_of_memory(err):
            raise out_of_memory(buckets, cfg) from err
        raise
    seconds = watch.seconds["update"]
    nbytes = sum(b.nbytes for b in buckets)
    staging = split.pop("perf/update_weights_staging_bytes", 0)
    engine_extra = split.pop("perf/update_weights_engine_peak_bytes", 0)
    metrics = {
        "perf/update_weights_time": seconds,
        "perf/update_weights_bytes": nbytes,
        "perf/update_weights_buckets": len(buckets) if cfg.strategy == "bucketed" else len(weights),
        "perf/update_weights_gbps": nbytes / seconds / 1e9,
        "perf/update_weights_limit_time": limit_time,
        "perf/update_weights_efficiency": limit_time / seconds,
        "perf/update_weights_peak_bytes": staging + memory.peak_extra + engine_extra,
        **split,
    }
    if cfg.verify:
        verify(weights, engine_checksums(engine), buckets[0].dtype)
    return metrics


def is_out_of_memory(err: BaseException) -> bool:
    """torch's OOM, or an engine process's (it arrives as an error whose message names it)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    first = (str(err).splitlines() or [""])[0]
    return "OutOfMemoryError" in first or "CUDA out of memory" in first


def out_of_memory(buckets: list[Bucket], cfg: UpdateConfig, phase: str = "during the weight update") -> UpdateOutOfMemory:
    return UpdateOutOfMemory(bucket_mb=cfg.bucket_mb, largest_bucket_mb=max(b.nbytes for b in buckets) / MIB,
                             largest_tensor_mb=max(s.meta.nbytes for b in buckets for s in b.slots) / MIB,
                             inflight=cfg.inflight_buckets, phase=phase)


def engine_checksums(engine) -> dict[str, int]:
    if hasattr(engine, "checksums"):
        return engine.checksums()
    return {name: checksum(t) for name, t in engine.weights().items()}
