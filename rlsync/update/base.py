"""What every transport is: the `Transport` handle, what an update returns, the engine-process half
(`Receiver`), and the registry of transports.

A transport is the engine as the step loop sees it: `generate`, `release`, `resume`, `update_weights`
(the trainer's weights into the engine, returning an `UpdateResult`), `weights`, `checksums`, `close`.
Where the engine lives (this process, its own) and how the weights travel are the transport's.

The registry maps `update.transport` to a transport class; the config rule for that key offers its
names. Adding a transport is one module holding a `Transport` subclass and one line:

    register_transport("mine", "mypackage.mine:MyTransport")   # resolved on first use: no import now
    register_transport("mine", MyTransport)                    # or the class itself

`register_transport("mine")` also works as a class decorator. A transport whose engine runs in its
own process plugs its engine-side half into `rlsync.update.engine_process` as a `Receiver`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from rlsync.config.schema import UpdateConfig
from rlsync.engines.base import Engine, EngineSpec, Preloaded, Rollout, checksum, own_strategy_names
from rlsync.registry import Registry
from rlsync.update.buckets import Bucket

STRATEGIES = ("bucketed", "per_tensor")  # every transport's; an engine may add its own (Engine.own_strategies)
SOURCES = ("device", "host")
BACKENDS = ("auto", "gloo")  # not nccl: it refuses two ranks on one GPU, where the colocated engine sits


def strategy_names() -> tuple[str, ...]:
    """The values update.strategy accepts: the transports' strategies, then the engines' own."""
    return STRATEGIES + own_strategy_names()


@dataclass
class UpdateResult:
    """What one weight update measured, beside the time the caller takes around it."""

    seconds: dict[str, float]  # per phase a transport can tell apart: "pack", "transfer", "load"
    buckets: list[dict] = field(default_factory=list)  # per bucket (or tensor): "bytes" and "<phase>_time"
    staging_bytes: int = 0  # staging buffers held for the update, both sides of a process boundary, each once
    engine_peak_bytes: int = 0  # what the engine process's allocator handed out beyond them (CUDA)

    def split_metrics(self) -> dict[str, float]:
        """`perf/update_weights_<phase>_time` per phase."""
        return {f"perf/update_weights_{phase}_time": s for phase, s in self.seconds.items()}


class Transport(Rollout):
    """The rollout engine behind one way of moving weights to it, as the step loop drives it.

    `open` builds it from the run's engine spec, the bucket plan and update config (every transport
    the same way); `generate`, `release` and `resume` are the engine's (`Rollout`), wherever it runs;
    `update_weights` returns what the update measured and keeps it as `last_update`.
    """

    last_update: UpdateResult | None = None

    # What the memory check, the planner and validation know of a transport without naming it.
    engine_in_process: ClassVar[bool] = True  # the engine lives in the trainer's process: its memory is the trainer's
    # with update.flat_engine_weights=true the engine's weights are memory shared with the trainer, which the
    # engine cannot free (so not with rollout.sleep_level=2)
    flat_weights_shared: ClassVar[bool] = False

    @classmethod
    def staging_slots(cls, cfg: UpdateConfig, flat_weights: bool) -> tuple[int, int]:
        """Staging buffers of the largest bucket's (per_tensor: tensor's) size on each side (trainer, engine),
        each counted once (memory both sides map is the trainer's). By default: one on the trainer's side
        (pack, then load), none where packing writes the engine's flat weights."""
        return (0 if flat_weights else 1), 0

    @classmethod
    def copies(cls, strategy: str, flat_weights: bool) -> int:
        """How many times the update copies each element (the planner's cost model): by default the pack
        and the engine's load, one copy where either is the whole update (per_tensor, flat weights)."""
        return 1 if strategy == "per_tensor" or flat_weights else 2

    @classmethod
    def check_config(cls, cfg) -> None:  # noqa: B027 - optional: most transports have no rules of their own
        """This transport's rules across the config's keys: a ConfigError naming the key; none by default."""

    @classmethod
    def open(cls, spec: EngineSpec, buckets: list[Bucket], cfg: UpdateConfig) -> Transport:
        """Start the engine `spec` describes behind this transport, for the update `buckets` plans."""
        return cls(spec, buckets, cfg)

    def update_weights(self, weights: dict[str, torch.Tensor]) -> UpdateResult:
        """The trainer's `weights` (trainer names and dtype) into the engine, by the bucket plan."""
        self.last_update = self.send_weights(weights)
        return self.last_update

    @abstractmethod
    def send_weights(self, weights: dict[str, torch.Tensor]) -> UpdateResult:
        """The transport's update: what `update_weights` does, without keeping the result."""

    @property
    def last_update_buckets(self) -> list[dict]:
        """The last update's rows, per bucket (or tensor): bytes and seconds per phase."""
        return self.last_update.buckets if self.last_update is not None else []

    @abstractmethod
    def weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights by the trainer's names (an engine in its own process: CPU copies)."""

    def checksums(self) -> dict[str, int]:
        """One checksum per engine weight (update.verify); a transport may compute them where the engine is."""
        return {name: checksum(t) for name, t in self.weights().items()}

    @abstractmethod
    def close(self) -> None:
        """Stop the engine and free what the transport holds; safe to call twice."""

    @property
    def engine_peak_rss_bytes(self) -> int | None:
        """After close: the engine process's own peak resident set; None for an engine in the trainer's
        process (its memory is the trainer's) or one that did not say (a standalone engine)."""
        return None


class Receiver(Preloaded, ABC):
    """The engine-side half of a transport whose engine runs in its own process (update/engine_process.py).

    It is pickled to the engine process, which calls `open` once the engine is built, `handle` for each
    update request, and `close` on its way out. Results travel back to the trainer as plain dicts.
    """

    @abstractmethod
    def open(self, engine: Engine) -> dict:
        """Set up this side of the transport for `engine` (buffers, a process group); the reply's result."""

    @abstractmethod
    def handle(self, engine: Engine, request: tuple) -> dict:
        """One update request from the trainer's side, into `engine`; the reply's result."""

    @abstractmethod
    def close(self) -> None:
        """Free what `open` took; called once, as the engine process ends."""


# ----------------------------------------------------------------------------------------------
# The registry: update.transport -> transport class
# ----------------------------------------------------------------------------------------------

TRANSPORTS: Registry[Transport] = Registry(
    "update.transport",
    {
        "direct": "rlsync.update.direct:DirectTransport",  # the engine in the trainer's process
        "ipc": "rlsync.update.ipc:IpcTransport",  # the engine in its own process; buckets through shared staging buffers
        "broadcast": "rlsync.update.broadcast:BroadcastTransport",  # the engine in its own process; one broadcast per bucket
    },
)
register_transport = TRANSPORTS.register  # register_transport("mine", "mypackage.mine:Mine"), or as a decorator
transport_names = TRANSPORTS.names  # the values update.transport accepts, in registration order
transport_class = TRANSPORTS.resolve  # the class registered under a name, imported the first time
