"""The payload interface (`Payload`, its trainer-side `Encoder`, what one bucket's encoding is: `Encoded`)
and the registry of payloads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from rlsync.engines.base import Engine
from rlsync.errors import ConfigError, show
from rlsync.fmt import fmt_seconds, fmt_sig
from rlsync.measure.floors import crosses_host_link
from rlsync.registry import Registry
from rlsync.update.buckets import Bucket, TensorMeta, plan_buckets
from rlsync.update.payload.kernels import LINE_BYTES

FULL, SPARSE = 0, 1  # Encoded.mode: the bucket's every element, or (positions, values) of the changed ones
KEY = "update.payload"  # the one key that chooses a payload (rlsync/config/schema.py)
# what a payload other than full adds to the update's metrics, wherever the transport times that side and the
# copy probe ran (timed_update: payload_metrics and payload_floor_metrics); each class declares its own
BESIDE_FULL = ("perf/update_weights_full_bytes", "perf/update_weights_sent_limit_time")
ENCODE_FLOOR = tuple(f"perf/update_weights_encode_{m}" for m in ("time", "limit_time", "efficiency"))
DECODE_FLOOR = tuple(f"perf/update_weights_decode_{m}" for m in ("time", "limit_time", "efficiency"))


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

    name: ClassVar[str]  # its value of update.payload (the registry's key)
    title: ClassVar[str]  # what the closing line, the bench and the planner call it
    note: ClassVar[str] = ""  # said after its key in the closing line
    # every bucket whole in the engine's dtype, every update: a transport may post its receives ahead, bind
    # the engine's weights to the buckets or hand the trainer's tensors to the engine's loader
    whole: ClassVar[bool] = False
    # its bytes and each side's work reported beside the full update's (perf/update_weights_full_bytes, ...)
    beside_full: ClassVar[bool] = True
    adapters: ClassVar[bool] = False  # carries the trainer's LoRA adapters: needs trainer.lora.rank > 0
    verified: ClassVar[str] = "the trainer's"  # update.verify: what the engine's weights matched after every update
    # the metrics it adds to the full update's, where the transport times that side (docs/metrics.md)
    metrics: ClassVar[tuple[str, ...]] = BESIDE_FULL + DECODE_FLOOR
    # the phase a check after each update is timed as (perf/<phase>_time, outside the update), or None
    after_update_phase: ClassVar[str | None] = None
    # the terms of its encode's and decode's time the planner fits from runs that timed them (FIT_TERMS,
    # rlsync/plan/payload_fit.py): "floor" (a multiple of its floor), "tensors" (a cost per tensor), "changed" (per
    # changed element, a payload that compares what changed); () where its work is the transport's own copies
    # (the pack and the load), whose cost model is its time
    fit_terms: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def key(cls) -> str:
        """How a user chooses it: update.payload=NAME."""
        return f"{KEY}={cls.name}"

    @classmethod
    def phrase(cls) -> str:
        """Its name in a closing line: the title, the key, the note."""
        return f"{cls.title} ({cls.key()}{'; ' + cls.note if cls.note else ''})"

    @classmethod
    def kernels(cls, device: str) -> str | None:
        """Which kernels encode and decode it on `device` ("cpu", "cuda:0"), with why where a faster one could
        not run (summary.json's setup `payload_kernels`, the payload's closing line): times from other kernels
        are other measurements. None: the transport's own copies."""
        return None

    @classmethod
    def check_config(cls, cfg) -> None:
        """This payload's rules across the config's keys: a ConfigError naming the key. Every payload's: the
        LoRA ones need trainer.lora.rank > 0, the others refuse it (a payload that ignored the adapters would
        send weights the engine cannot hold). A subclass with rules of its own calls this first."""
        rank = cfg.trainer.lora.rank
        if cls.adapters and not rank:
            raise ConfigError(
                KEY,
                cls.name,
                f"{choices_phrase(adapters=False)} with trainer.lora.rank=0, or set trainer.lora.rank "
                "(e.g. trainer.lora.rank=16: there are no adapters to send or merge)",
                "not allowed with trainer.lora.rank=0",
            )
        if rank and not cls.adapters:
            raise ConfigError(
                KEY,
                cls.name,
                f"{choices_phrase(adapters=True)} with trainer.lora.rank={rank} (the trainer trains adapters on a "
                "frozen base: send them, or merge them into the weights), or trainer.lora.rank=0",
                f"not allowed with trainer.lora.rank={rank}",
            )

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

    @classmethod
    def planned_encoded(cls, bucket: Bucket, ctx: PlanContext) -> Encoded:
        """What one later update's encoding of `bucket` would be, from the config alone: whole by default."""
        return Encoded(FULL, bucket.numel, bucket.nbytes, None)

    @classmethod
    def planned(cls, ctx: PlanContext) -> dict[str, Any] | None:
        """The planner's row for this payload, from the config alone (plan.json's kinds, rlsync/plan/kinds.py):
        `bytes`, what one update sends (`planned_encoded`), its floor's bytes as the class declares them for each
        bucket (`floor`: `encode_floor_bytes`, `decode_floor_bytes`), what its copies span (`elements`,
        `tensors`, `buckets`), with what its label needs; None where it has no row of its own."""
        sent = encode = decode = 0
        for bucket in ctx.buckets:
            encoded = cls.planned_encoded(bucket, ctx)  # its floor where the payload declared one for the plan
            floor = encoded.floor or cls.floor(bucket, encoded, bucket.numel * ctx.trainer_itemsize)
            sent, encode, decode = sent + encoded.nbytes, encode + floor.encode, decode + floor.decode
        return {
            "bytes": sent,
            "encode_floor_bytes": encode,
            "decode_floor_bytes": decode,
            "elements": ctx.elements,
            "tensors": sum(len(b.slots) for b in ctx.buckets),
            "buckets": len(ctx.buckets),
        }

    @classmethod
    def plan_lines(cls, row: dict[str, Any]) -> tuple[str, list[str]]:
        """Its label in the plan's payload table, and lines under the table (none by default)."""
        return cls.phrase(), []

    @classmethod
    def after_update(cls, params: dict[str, torch.Tensor], cfg) -> dict[str, float]:
        """Metrics of a check after each update (`after_update_phase` times it), from the trainer's `params`."""
        return {}


@dataclass(frozen=True)
class PlanContext:
    """What the planner knows of an update from the config alone, for `Payload.planned`."""

    buckets: list[Bucket]  # the plan of the model's tensors in the engine's dtype
    trainer_itemsize: int
    engine_itemsize: int
    changed_ratio: float  # plan.changed_ratio: the share of elements one step changes
    floor_gbps: float | None = None  # the copy floor (GB/s read + written), where the plan has one
    model_shapes: list = field(default_factory=list)  # (name, shape) of the model's weights (rlsync.model)
    lora: Any = None  # trainer.lora (a LoraConfig)
    bucket_bytes: int = 0  # update.bucket_mb in bytes (a payload that plans buckets of its own)
    line_bytes: int = LINE_BYTES["cpu"]  # what the device's memory moves per access (a scatter's floor)

    @property
    def elements(self) -> int:
        return sum(b.numel for b in self.buckets)


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


def payload_bandwidth(floors, floor_time: float | None = None) -> float:
    """The copy bandwidth (bytes read + written per second) a payload's floors are counted at: the update's own
    probed copy (`floors.update_copy`, rescaled to the probe beside a benchmark's repeat: `floor_time`) where it
    stays in one memory, as a payload's kernels do; the device's copy where the update crosses the host link
    (source=host on a GPU: the kernels run in device memory after the transfer)."""
    if crosses_host_link(floors.source, floors.device.type):
        return floors.device_copy
    if floor_time:
        return floors.update_copy * floors.update_floor_time / floor_time
    return floors.update_copy


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
    KEY,
    {
        "full": "rlsync.update.payload.full:FullPayload",  # every element of every bucket (the default)
        "delta": "rlsync.update.payload.delta:DeltaPayload",  # only the changed elements
        "fp8": "rlsync.update.payload.fp8:Fp8Payload",  # 2-D weights in FP8 blocks
        "lora": "rlsync.update.payload.lora:LoraAdapterPayload",  # the adapters only (trainer.lora.rank > 0)
        "lora_merged": "rlsync.update.payload.lora:LoraMergedPayload",  # W + s*BA, whole
    },
)
register_payload = PAYLOADS.register
payload_names = PAYLOADS.names
payload_class = PAYLOADS.resolve


def payload_name(update) -> str:
    """Which payload the update config asks for: update.payload."""
    return update.payload


def payload_of(update) -> type[Payload]:
    return payload_class(payload_name(update))


def choices_phrase(*, adapters: bool) -> str:
    """update.payload's values that carry the trainer's adapters (or those that do not), as a user writes one."""
    names = [n for n in payload_names() if payload_class(n).adapters == adapters]
    return f"{KEY}={'|'.join(names)}"


# ----------------------------------------------------------------------------------------------
# Before update.payload: the keys it replaced (refused, naming it) and the runs recorded with them
# ----------------------------------------------------------------------------------------------

RECORDED_NAMES = {"lora_adapter": "lora"}  # summary.json's setup.payload before update.payload named it
# each key update.payload replaced: the value given (as written) -> the payload it chose; None: the default
REPLACED_KEYS: dict[str, dict[str, str | None]] = {
    "update.delta": {"true": "delta", "false": None},
    "update.wire_dtype": {"float8_e4m3fn": "fp8", "null": None},
    "update.lora": {"adapter": "lora", "merged": "lora_merged", "null": None},
}


def replaced_key(key: str, value: Any) -> tuple[str, str] | None:
    """(problem, allowed) of the one-line refusal of `key`=`value`, a key update.payload replaced: the value
    of update.payload to write instead; None for a key it did not replace."""
    given = REPLACED_KEYS.get(key)
    if given is None:
        return None
    written = show(value).lower() if not isinstance(value, str) else value.strip().lower()
    allowed = f"{KEY}={'|'.join(payload_names())} ({key} is no longer read)"
    if written not in given:
        return f"replaced by {KEY}", allowed
    chosen = given[written]
    if chosen is None:
        return f"replaced by {KEY}={payload_names()[0]} (its default: drop {key})", allowed
    return f"replaced by {KEY}={chosen}", allowed


def recorded_payload(setup: Mapping[str, Any], cfg: Callable[[str], Any]) -> str:
    """The payload a recorded run's buckets carried: summary.json's setup.payload (under its name then), else
    its config's update.payload, else the keys that chose it before (update.lora with trainer.lora.rank,
    update.delta, update.wire_dtype). `cfg(dotted)`: a value of the run's config, None where absent."""
    name = setup.get("payload") or cfg(KEY)
    if name:
        return RECORDED_NAMES.get(name, name)
    for key, given in REPLACED_KEYS.items():
        value = cfg(key)
        chosen = given.get(show(value).lower()) if value is not None else None
        if chosen:
            return chosen
    if cfg("trainer.lora.rank"):  # update.lora=null: the adapters, where the trainer had them
        return REPLACED_KEYS["update.lora"]["adapter"]
    return payload_names()[0]


def recorded_class(name: str | None) -> type[Payload] | None:
    """The class of a payload named in a recorded run (an earlier name as well); None for one not registered."""
    name = RECORDED_NAMES.get(name or "", name)
    return payload_class(name) if name in PAYLOADS else None
