"""What every transport is: the `Transport` (the weight channel), what an update returns, and the
registry of transports.

A transport is one way of moving the trainer's weights into a rollout engine: it says where its engine
lives (`start_engine`: built in this process, or an engine process given the transport's Receiver,
rlsync.engines.process), opens its channel on that engine (`connect`), then `update_weights` sends each
update and returns an `UpdateResult`. The step loop generates with the engine (rlsync.engines.base's
`EngineHandle`), never through the transport; rlsync.update's `open_update` returns both.

The registry maps `update.transport` to a transport class; the config rule for that key offers its
names. Adding a transport is one module holding a `Transport` subclass and one line:

    register_transport("mine", "mypackage.mine:MyTransport")   # resolved on first use: no import now
    register_transport("mine", MyTransport)                    # or the class itself

`register_transport("mine")` also works as a class decorator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from rlsync.config.schema import UpdateConfig
from rlsync.engines.base import EngineHandle, EngineSpec, own_strategy_names
from rlsync.registry import Registry

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


class Transport(ABC):
    """The weight channel: the trainer's half of one way of moving weights into an engine.

    Built as `cls(spec, buckets, cfg)` from the run's engine spec, the bucket plan and update config
    (its own buffers, a store, the Receiver it hands an engine process), before any engine; then
    `start_engine(spec)` starts the engine where this transport keeps it and `connect(engine)` opens the
    channel on it (rlsync.update.open_update does the three, and closes what opened if one fails).
    `update_weights` returns what the update measured and keeps it as `last_update`.
    """

    engine: EngineHandle | None = None  # the engine this channel updates (connect)
    last_update: UpdateResult | None = None

    # What the memory check, the planner and validation know of a transport without naming it.
    engine_in_process: ClassVar[bool] = True  # the engine lives in the trainer's process: its memory is the trainer's
    # with update.flat_engine_weights=true the engine's weights are memory shared with the trainer, which the
    # engine cannot free (so not with rollout.release_level=2)
    flat_weights_shared: ClassVar[bool] = False
    joins_address: ClassVar[bool] = False  # joins an engine started on its own at update.engine_address (rlsync.serve)
    data_parallel: ClassVar[bool] = False  # built and tested under data-parallel launches
    # plan.calibrate benchmarks it: its copies are what the planner's cost model describes
    calibrated: ClassVar[bool] = False

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

    @classmethod  # noqa: B027 - optional: most transports have no rules of their own
    def check_config(cls, cfg) -> None:
        """This transport's rules across the config's keys: a ConfigError naming the key; none by default."""

    @abstractmethod
    def start_engine(self, spec: EngineSpec) -> EngineHandle:
        """Start the engine `spec` describes where this transport keeps it: built in this process
        (`spec.build`), or an engine process given this transport's Receiver (rlsync.engines.process)."""

    def connect(self, engine: EngineHandle) -> None:
        """Open the channel on `engine` (bind buffers to its weights, join a process group); by default
        only keeps it, as `self.engine`."""
        self.engine = engine

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
    def close(self) -> None:
        """Free what the channel holds (buffers, a process group), after its engine is closed (an engine
        process leaves the group on its way out); safe to call twice."""


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


def transports_with(**facts: bool) -> tuple[str, ...]:
    """The update.transport values whose class declares each of `facts` (ClassVars of `Transport`) so, in order."""
    return tuple(name for name in TRANSPORTS if all(getattr(transport_class(name), f) is v for f, v in facts.items()))
