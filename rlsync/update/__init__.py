"""The weight update: the trainer's new weights into the rollout engine.

`open_update` starts the engine described by an `EngineSpec` where the configured transport keeps it
and returns both: the engine (an `EngineHandle`, rlsync/engines/base.py: `generate`, `release`,
`resume`, `weights`, `checksums`, `close`, wherever it runs) and the transport, the weight channel to
it (`Transport`, update/base.py: `update_weights`, `close`). The transports are a registry there
(`register_transport`), whose built-ins are:

- `direct` (update/direct.py): the engine lives in the trainer's process;
- `ipc` (update/ipc.py): the engine in its own process; buckets travel through staging buffers shared
  with it (shared memory on the CPU, CUDA IPC on a GPU);
- `broadcast` (update/broadcast.py): the engine in its own process joined to the trainer in a
  torch.distributed group; one broadcast per bucket.

`timed_update` here wraps a transport's update (its `UpdateResult`) with what every transport
reports: bytes, buckets, bandwidth, the limit and the efficiency against it, the memory peak, and
the optional verification.
"""

from __future__ import annotations

import dataclasses

import torch

from rlsync.config.derived import bucket_bytes
from rlsync.config.schema import UpdateConfig
from rlsync.engines.base import EngineHandle, EngineSpec, checksum  # checksum: what verify compares
from rlsync.errors import UpdateOutOfMemory
from rlsync.fmt import MIB
from rlsync.measure.threads import cpu_threads
from rlsync.measure.timing import DeviceMemory, Stopwatch
from rlsync.update.auto import resolve_update
from rlsync.update.base import (  # noqa: F401 - also rlsync.update's names, for its callers
    BACKENDS,
    SOURCES,
    STRATEGIES,
    TRANSPORTS,
    Transport,
    UpdateResult,
    register_transport,
    transport_class,
    transport_names,
)
from rlsync.update.buckets import Bucket, metas_of
from rlsync.update.gather import ShardedWeights, full_weights
from rlsync.update.payload import payload_floor_metrics, payload_of


class WeightMismatch(RuntimeError):
    pass


def plan_for(weights: dict[str, torch.Tensor], cfg: UpdateConfig, engine_dtype: torch.dtype) -> list[Bucket]:
    """The update's buckets over the trainer's `weights`, as the update's payload lays them out."""
    return payload_of(cfg).plan(metas_of(weights, engine_dtype), bucket_bytes(cfg))


def open_update(cfg: UpdateConfig, *, spec: EngineSpec, buckets: list[Bucket]) -> tuple[EngineHandle, Transport]:
    """(engine, transport): the engine described by `spec`, started where update.transport keeps it (the
    registry: update/base.py), and the transport's channel to it, for the update `buckets` plans.

    The config was validated before any model was built (rlsync/config/validate.py), its cross-key rules too.
    The transports take its nulls (auto) resolved: the entry points resolve them with the thread probe
    (rlsync.update.auto.resolve_for_run); what is still null here is resolved without it.
    """
    if cfg.flat_engine_weights is None or cfg.copy_threads is None:
        cfg, _ = resolve_update(cfg, spec.rollout, probe_threads=0, model=spec.model)
    if cfg.verify and not spec.verify:  # the engine learns it will be checked (EngineSpec.verify)
        spec = dataclasses.replace(spec, verify=True)
    transport = transport_class(cfg.transport)(spec, buckets, cfg)  # its buffers, before the engine takes memory
    engine = None
    try:
        engine = transport.start_engine(spec)
        transport.connect(engine)
    except BaseException:
        close_update(engine, transport)
        raise
    return engine, transport


def close_update(engine: EngineHandle | None, transport: Transport | None) -> None:
    """The engine first (an engine process leaves the transport's group on its way out), then the channel;
    the channel is closed whatever the engine's close raised. Either may be None (not opened)."""
    try:
        if engine is not None:
            engine.close()
    finally:
        if transport is not None:
            transport.close()


def verify(trainer_weights: dict[str, torch.Tensor], engine_checksums: dict[str, int], dtype: torch.dtype) -> None:
    # every tensor is read before raising: from shards each read is a collective the other ranks take part in
    differing = [n for n, t in trainer_weights.items() if checksum(t.to(dtype)) != engine_checksums[n]]
    if differing:
        raise WeightMismatch(
            f"weight update verification failed: engine tensor {differing[0]!r} differs from the trainer's"
        )


def timed_update(
    transport: Transport,
    weights: dict[str, torch.Tensor],
    *,
    buckets: list[Bucket],
    cfg: UpdateConfig,
    device: torch.device,
    floor_time: float,
    gather_floor_time: float = 0.0,
    copy_bandwidth: float | None = None,
) -> dict[str, float]:
    """One timed weight update; the metrics family `perf/update_weights_*`.

    `copy_bandwidth` (bytes read + written per second, the copy probe's: rlsync.update.payload.payload_bandwidth):
    a payload other than full is also timed against its own floors, encode and decode (payload_floor_metrics).

    Peak bytes: the staging buffers the update holds (the transport's own accounting, both sides of a
    process boundary) plus, on CUDA, what the allocators handed out beyond that during the update
    (the trainer's here, the engine's as the transport reports it).

    From a sharded trainer (`weights` a ShardedWeights, update/gather.py) the update includes the gather:
    its floor is the copy's (`floor_time`) plus the gather's (`gather_floor_time`, an all-gather of the
    same bytes), and each part is also reported against its own floor (`_gather_*`, `_copy_*`).
    """
    watch, memory = Stopwatch(device), DeviceMemory(device)
    try:
        with cpu_threads(cfg.copy_threads, device), memory.track(), watch("update"):
            result = transport.update_weights(weights)
    except Exception as err:  # out of memory, here or in the engine process: name the knob, the bucket size
        if is_out_of_memory(err):
            raise out_of_memory(buckets, cfg) from err
        raise
    seconds = watch.seconds["update"]
    nbytes = sum(b.nbytes for b in buckets)
    sharded = isinstance(weights, ShardedWeights)
    floor = floor_time + (gather_floor_time if sharded else 0.0)
    metrics = {
        "perf/update_weights_time": seconds,
        "perf/update_weights_bytes": nbytes,
        "perf/update_weights_buckets": len(buckets) if cfg.strategy == "bucketed" else len(weights),
        "perf/update_weights_gbps": nbytes / seconds / 1e9,
        "perf/update_weights_limit_time": floor,
        "perf/update_weights_efficiency": floor / seconds,
        "perf/update_weights_peak_bytes": result.staging_bytes + memory.peak_extra + result.engine_peak_bytes,
        **result.split_metrics(),
    }
    if payload_of(cfg).beside_full:  # a payload other than full (Payload.beside_full)
        metrics.update(payload_metrics(result, nbytes, seconds))
        metrics.update(payload_floor_metrics(result.buckets, result.seconds, copy_bandwidth))
        # the copy floor of what crossed (the limit scales with the bytes): the payload's own time / floor
        metrics["perf/update_weights_sent_limit_time"] = floor * metrics["perf/update_weights_bytes"] / nbytes
    if sharded:
        metrics.update(gather_metrics(weights, gather_floor_time))
        copy_time = max(seconds - weights.seconds, 1e-12)  # the update without its gather
        metrics["perf/update_weights_copy_limit_time"] = floor_time
        metrics["perf/update_weights_copy_efficiency"] = floor_time / copy_time
        weights.release()
    if cfg.verify:
        with torch.no_grad():
            checksums = transport.engine.checksums()  # where the engine is
            verify(payload_of(cfg).expected(buckets, full_weights(weights)), checksums, buckets[0].dtype)
        if sharded:
            weights.release()
    return metrics


def payload_metrics(result: UpdateResult, full_bytes: int, seconds: float) -> dict[str, float]:
    """From a payload other than full: the bytes that crossed (perf/update_weights_bytes,
    beside the full update's _full_bytes) and, from one that compares each bucket with the last update, the
    share of elements whose engine-dtype value changed (_changed_ratio)."""
    sent = sum(r["bytes"] for r in result.buckets)
    metrics = {
        "perf/update_weights_bytes": sent,
        "perf/update_weights_gbps": sent / seconds / 1e9,
        "perf/update_weights_full_bytes": full_bytes,
    }
    compared = [r for r in result.buckets if "changed" in r]
    if compared:
        metrics["perf/update_weights_changed_ratio"] = sum(r["changed"] for r in compared) / sum(
            r["elements"] for r in compared
        )
    return metrics


def gather_metrics(weights: ShardedWeights, gather_floor_time: float) -> dict[str, float]:
    """perf/update_weights_gather_*: time, bytes, peak held, floor and efficiency (floor / time)."""
    metrics = weights.metrics()
    metrics["perf/update_weights_gather_limit_time"] = gather_floor_time
    if weights.seconds > 0:
        metrics["perf/update_weights_gather_efficiency"] = gather_floor_time / weights.seconds
    return metrics


def follow_update(weights: ShardedWeights, *, cfg: UpdateConfig, gather_floor_time: float) -> dict[str, float]:
    """A rank without an engine during a sharded update: the same gathers as the engine's ranks, kept by none
    (each one is a collective), and again for update.verify's check."""
    weights.drain()
    metrics = gather_metrics(weights, gather_floor_time)
    if cfg.verify:
        full_weights(weights)
        weights.drain()
    return metrics


def is_out_of_memory(err: BaseException) -> bool:
    """torch's OOM, or an engine process's (it arrives as an error whose message names it)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    first = (str(err).splitlines() or [""])[0]
    return "OutOfMemoryError" in first or "CUDA out of memory" in first


def out_of_memory(
    buckets: list[Bucket], cfg: UpdateConfig, phase: str = "during the weight update"
) -> UpdateOutOfMemory:
    return UpdateOutOfMemory(
        bucket_mb=cfg.bucket_mb,
        largest_bucket_mb=max(b.nbytes for b in buckets) / MIB,
        largest_tensor_mb=max(s.meta.nbytes for b in buckets for s in b.slots) / MIB,
        inflight=cfg.inflight_buckets,
        phase=phase,
    )
