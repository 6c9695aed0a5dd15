"""The payload interface (`Payload`, its trainer-side `Encoder`, what one bucket's encoding is: `Encoded`)
and the registry of payloads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from rlsync.engines.base import Engine
from rlsync.fmt import fmt_seconds, fmt_sig
from rlsync.measure.limits import crosses_host_link
from rlsync.registry import Registry
from rlsync.update.buckets import Bucket, TensorMeta, plan_buckets

FULL, SPARSE = 0, 1  # Encoded.mode: the bucket's every element, or (positions, values) of the changed ones


@dataclass(frozen=True)
class Floor:
    """The bytes a payload's kernels must read and write in memory for one bucket, as its class declares
    them (`Payload.floor`): the encode on the trainer's side, the decode into the engine's weights. Over
    the copy bandwidth measured in the same run they are each side's floor (`payload_floor_metrics`)."""

    encode_read: int = 0
    encode_written: int = 0
    decode_read: int = 0
    decode_written: int = 0

    @property
    def encode(self) -> int:
        return self.encode_read + self.encode_written

    @property
    def decode(self) -> int:
        return self.decode_read + self.decode_written


@dataclass(frozen=True)
class Encoded:
    """What one bucket's encoding put in the staging buffer; it travels beside the buffer (in the request
    that names the bucket, or a header broadcast) so the engine side knows what to read."""

    mode: int  # FULL or SPARSE
    count: int  # elements carried: the bucket's numel (FULL) or the changed ones (SPARSE)
    nbytes: int  # bytes of the buffer that carry it, from its start
    changed: int | None  # elements whose engine-dtype value changed since the last update; None: not compared
    floor: Floor | None = None  # the trainer's side only: not in the header

    def header(self) -> list[int]:
        """As four integers (a broadcast's header tensor, a request's fields)."""
        return [self.mode, self.count, self.nbytes, -1 if self.changed is None else self.changed]

    @classmethod
    def from_header(cls, values) -> Encoded:
        mode, count, nbytes, changed = (int(v) for v in values)
        return cls(mode, count, nbytes, None if changed < 0 else changed)

    def row(self, bucket: Bucket) -> dict:
        """A bucket's row of the update: the bytes that crossed and, from a compared bucket, what changed."""
        row = {"bytes": self.nbytes}
        if self.changed is not None:
            row.update(elements=bucket.numel, changed=self.changed)
        if self.floor is not None:
            row.update(encode_floor_bytes=self.floor.encode, decode_floor_bytes=self.floor.decode)
        return row


class Encoder(ABC):
    """The trainer's side of a payload, for one transport's bucket plan: it may keep state across updates."""

    # memory it holds between updates, and at most during one bucket's encoding (the memory check counts both)
    held_bytes: int = 0

    @abstractmethod
    def encode(
        self, index: int, bucket: Bucket, weights: dict[str, torch.Tensor], buffer: torch.Tensor, timer, row: dict
    ) -> Encoded:
        """Bucket `index` of the plan from the trainer's `weights` into `buffer` (the engine's dtype, at least
        the bucket's numel); `timer(phase, row)` times its parts ("pack", "encode") into `row`."""


class Payload(ABC):
    """One kind of update payload: its encoder, its decoding into an engine, its config rules and memory.

    Decoding runs wherever the engine is (the trainer's process, an engine process), so a payload
    class holds no state: `decode` is a class method, and the engine side needs nothing but the plan."""

    name: ClassVar[str]
    # every bucket whole in the engine's dtype, every update: a transport may post its receives ahead, bind
    # the engine's weights to the buckets or hand the trainer's tensors to the engine's loader
    whole: ClassVar[bool] = False

    @classmethod  # noqa: B027 - optional: most payloads have no rules of their own
    def check_config(cls, cfg) -> None:
        """This payload's rules across the config's keys: a ConfigError naming the key; none by default."""

    @classmethod
    def plan(cls, metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
        """The update's buckets over the tensors `metas` names (the trainer's, by the update's names)."""
        return plan_buckets(metas, bucket_bytes)

    @classmethod
    def source(cls, weights: Mapping[str, torch.Tensor], cfg) -> Mapping[str, torch.Tensor]:
        """What the update reads, by the plan's names, from the trainer's `weights`: they themselves by default."""
        return weights

    @classmethod
    def engine_lora(cls, cfg):
        """The LoRA adapters the engine must hold beside its weights (a LoraConfig), or None."""
        return None

    @classmethod
    @abstractmethod
    def encoder(cls, buckets: list[Bucket], device: torch.device) -> Encoder:
        """A fresh trainer-side encoder for `buckets`, its buffers on `device` (the engine's)."""

    @classmethod
    @abstractmethod
    def decode(cls, engine: Engine, bucket: Bucket, buffer: torch.Tensor, encoded: Encoded) -> None:
        """`encoded` (the first `encoded.nbytes` of `buffer`) into `engine`'s weights."""

    @classmethod
    @abstractmethod
    def floor(cls, bucket: Bucket, encoded: Encoded, read_bytes: int, *, first: bool = False) -> Floor:
        """The bytes this payload's kernels must read and write for `bucket` encoded as `encoded`, from
        `read_bytes` of the trainer's tensors (`first`: the first update, nothing kept yet); each payload
        declares its own, and tests/unit/test_payload_floors.py counts what its kernels touch against it."""

    @classmethod
    def expected(cls, buckets: list[Bucket], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the engine holds after the update, from the trainer's `weights` (update.verify compares its
        checksums in the engine's dtype): the weights themselves, for a payload that carries them exactly."""
        return weights

    @classmethod
    def memory_bytes(cls, total_bytes: int, largest_bucket_bytes: int, itemsize: int) -> tuple[int, int]:
        """(held between updates, transient during one bucket) on the trainer's side, for an update of
        `total_bytes` whose largest bucket is `largest_bucket_bytes` (the engine's dtype of `itemsize`)."""
        return 0, 0


def payload_floor_metrics(rows: list[dict], seconds: dict[str, float], bandwidth: float | None) -> dict[str, float]:
    """Each side of a payload against its own floor: the bytes its class declared for every bucket (`rows`,
    `Encoded.row`) over `bandwidth` (bytes read + written per second, the copy probe's in the same run):
    perf/update_weights_{encode,decode}_limit_time and _efficiency (floor / time), where that side was timed
    (`seconds`: the transport's phases; the engine's decode is its `load`). Nothing without a bandwidth."""
    if not bandwidth or not any("encode_floor_bytes" in r for r in rows):
        return {}
    metrics = {}
    timed = {"encode": seconds.get("encode"), "decode": seconds.get("load")}
    for side, took in timed.items():
        if took is None:
            continue
        floor = sum(r.get(f"{side}_floor_bytes", 0) for r in rows) / bandwidth
        metrics[f"perf/update_weights_{side}_time"] = took
        metrics[f"perf/update_weights_{side}_limit_time"] = floor
        if took > 0 and floor > 0:  # a delta that sent nothing has no decode to rate
            metrics[f"perf/update_weights_{side}_efficiency"] = floor / took
    return metrics


def payload_bandwidth(limits, limit_time: float | None = None) -> float:
    """The copy bandwidth (bytes read + written per second) a payload's floors are counted at: the update's own
    probed copy (`limits.update_copy`, rescaled to the probe beside a benchmark's repeat: `limit_time`) where it
    stays in one memory, as a payload's kernels do; the device's copy where the update crosses the host link
    (source=host on a GPU: the kernels run in device memory after the transfer)."""
    if crosses_host_link(limits.source, limits.device.type):
        return limits.device_copy
    if limit_time:
        return limits.update_copy * limits.update_limit / limit_time
    return limits.update_copy


def payload_floor_line(stats: dict) -> str | None:
    """The encode and decode against their floors (medians over the measured updates), for a closing table;
    None where the payload was not timed against them."""
    parts = []
    for side, what in (("encode", "encode (the trainer's side)"), ("decode", "decode (the engine's side)")):
        took = stats.get(f"perf/update_weights_{side}_time", {}).get("median")
        floor = stats.get(f"perf/update_weights_{side}_limit_time", {}).get("median")
        if took is None or floor is None:
            continue
        eff = stats.get(f"perf/update_weights_{side}_efficiency", {}).get("median")
        rate = f"efficiency {fmt_sig(eff)}, {fmt_sig(1 / eff)}x its floor" if eff else "nothing to move"
        parts.append(f"{what} {fmt_seconds(took)} against a floor of {fmt_seconds(floor)} ({rate})")
    if not parts:
        return None
    return (
        "Against its own floors (the bytes its kernels must read and write, over the copy probe's bandwidth): "
        + "; ".join(parts)
        + "."
    )


# ----------------------------------------------------------------------------------------------
# The registry: the update's payload -> payload class
# ----------------------------------------------------------------------------------------------

PAYLOADS: Registry[Payload] = Registry(
    "update payload",
    {
        "full": "rlsync.update.payload.full:FullPayload",  # every element of every bucket
        "delta": "rlsync.update.payload.delta:DeltaPayload",  # update.delta=true: only the changed elements
        "fp8": "rlsync.update.payload.fp8:Fp8Payload",  # update.wire_dtype=float8_e4m3fn: 2-D weights in FP8 blocks
        "lora_adapter": "rlsync.update.payload.lora:LoraAdapterPayload",  # update.lora=adapter: the adapters only
        "lora_merged": "rlsync.update.payload.lora:LoraMergedPayload",  # update.lora=merged: W + s*BA, whole
    },
)
register_payload = PAYLOADS.register
payload_names = PAYLOADS.names
payload_class = PAYLOADS.resolve


def payload_name(update) -> str:
    """Which payload the update config asks for (update.lora resolved: UpdateConfig.fill)."""
    lora = getattr(update, "lora", None)  # absent from runs recorded before LoRA
    if lora:
        return f"lora_{lora}"
    if update.delta:
        return "delta"
    return "fp8" if update.wire_dtype else "full"


def payload_of(update) -> type[Payload]:
    return payload_class(payload_name(update))
