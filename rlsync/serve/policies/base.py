"""What every update policy is, and the registry keyed by serve.update_policy.

A policy is what the standalone engine does around a trainer's update so that clients streaming answers
(rlsync/serve/streams.py) see as short a stall as it can give them, and never weights that are neither
the old version nor the new one served under a version. It is made once per trainer session
(`policy_for`); the session's work thread calls `open(server)` once and `update(server, request)` for
each update (`server`: rlsync.engines.process.EngineServer, its engine and its receiver).

What is specific to a policy it declares on its class, so that no module outside this package names one:

- `title`: one line, what streaming clients see during an update (docs/serve.md lists each policy so);
- `check_config(serve, root)`: its rules across keys, a ConfigError naming the key (validation calls it
  before anything is built; so does the stall bench for each engine it would start);
- `holds_whole_receive`: generation is held for the whole receive: the stall bench's baseline, every
  other policy's longest gap is given over its;
- `staged_copies`: copies of the engine's weights (rollout.dtype) it holds beside them (the memory check);
- `fresh_after_swap`: every answer started after its swap is the new weights' alone, which the stall bench
  verifies (each such answer teacher-forced under the new and the old weights; its tokens' version);
- `swap_phrase(pointer)`: how an update reached the weights, in the bench's and the report's tables.

Adding one is a module with an `UpdatePolicy` subclass and one line (resolved on first use):

    register_update_policy("mine", "mypackage.mine:MyPolicy")
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar, Optional

from rlsync.client.stream import SwapRecord
from rlsync.registry import Registry
from rlsync.serve.streams import CpuSplit, Decoder, UpdateCut


class UpdatePolicy(ABC):
    """How an update reaches the weights the decoder generates with, for one trainer session."""

    title: ClassVar[str] = ""
    holds_whole_receive: ClassVar[bool] = False
    staged_copies: ClassVar[int] = 0
    fresh_after_swap: ClassVar[bool] = True

    def __init__(self, decoder: Decoder, serve, *, name: str):
        self.decoder, self.serve, self.name = decoder, serve, name
        self.wait_s = serve.max_wait_s  # the longest a hold (or one of the receive's waits) may take
        self.staged_bytes = 0  # the side copy it holds, once open
        self.swap = self.swap_phrase(None)  # how the last update reached the weights (SwapRecord.swap)

    # -- what it declares ------------------------------------------------------------------------

    @classmethod
    def check_config(cls, serve, root) -> None:
        """Its rules across keys (`serve`: the serve.* node, `root`: the whole config): a ConfigError naming the key.
        None by default."""
        return None

    @classmethod
    @abstractmethod
    def swap_phrase(cls, pointer: Optional[float]) -> str:
        """How an update reached the weights ("pointer swap"); `pointer`: the stall bench's swap_pointer median
        (None where unknown)."""

    # -- around an update ------------------------------------------------------------------------

    def open(self, server) -> dict:
        """The session's receiver opened; by default while generation is held (flat engine weights are rebound
        there: never under a token)."""
        with self.hold():
            return server.open()

    @abstractmethod
    def update(self, server, request) -> dict:
        """One update received and swapped in (`swapped`), or an UpdateCut saying what the engine serves now."""

    # -- what every policy shares ----------------------------------------------------------------

    @contextmanager
    def hold(self) -> Iterator[float]:
        """Generation held for the block (bounded by serve.max_wait_s); yields when it stopped."""
        with self.decoder.hold(self.wait_s) as stopped:
            yield stopped

    def swapped(self, receive: tuple[float, float], hold: tuple[float, float], split: dict[str, float]) -> None:
        """(inside `hold`) The new weights are in: the next version, and its record (`receive`, `hold`: the
        perf_counter spans of the receive and of the hold the swap ran in; `split`: the receive's CpuSplit)."""
        self.decoder.swapped(
            lambda version: SwapRecord(
                version=version,
                policy=self.name,
                swap=self.swap,
                receive_start=receive[0],
                receive_end=receive[1],
                pause_start=hold[0],
                pause_end=hold[1],
                staged_bytes=self.staged_bytes,
                **split,
            )
        )

    def cut(self, err: BaseException, touched: Optional[str]) -> UpdateCut:
        """(inside `hold`) An update into the live weights failed: they are torn if any of it may have landed
        (`touched`: how much), else the old version serves on."""
        version, cause = self.decoder.version, cause_line(err)
        if touched is None:
            return UpdateCut(f"the update was cut off before any tensor landed ({cause}); version {version} serves on")
        self.decoder.tear(
            f"Torn: the last update was cut off with {touched}; this engine's weights are neither version "
            f"{version} nor the next: waiting for a complete update"
        )
        return UpdateCut(
            f"the update was cut off with {touched} ({cause}): generation is refused until a complete update lands"
        )

    def started(self) -> tuple[float, CpuSplit]:
        """The receive's start: its perf_counter, and the CPU counters it is measured from (`done()` at its end)."""
        return time.perf_counter(), CpuSplit(self.decoder)


def cause_line(err: BaseException) -> str:
    """An exception as a short line: its name and its message's first sentence, less the source location
    gloo's errors start with ("[.../pair.cc:537] Read error ...: Connection reset by peer. This is ...")."""
    first = re.sub(r"^\[[^\]]*\]\s*", "", (str(err).strip().splitlines() or [""])[0]).split(". ", 1)[0]
    return f"{type(err).__name__}: {first}"[:300] if first else type(err).__name__


UPDATE_POLICIES: Registry[UpdatePolicy] = Registry(
    "serve.update_policy",
    {
        "pause": "rlsync.serve.policies.pause:PausePolicy",
        "stage": "rlsync.serve.policies.stage:StagePolicy",
    },
)
register_update_policy = UPDATE_POLICIES.register  # register_update_policy("mine", "pkg.mod:Cls"), or a decorator
update_policy_class = UPDATE_POLICIES.resolve  # the class registered under a name, imported the first time
update_policy_names = UPDATE_POLICIES.names  # serve.update_policy's choices, in registration order


def policy_for(cfg, decoder: Decoder) -> UpdatePolicy:
    """The policy serve.update_policy names, for one trainer session."""
    name = cfg.serve.update_policy
    decoder.policy = name
    return update_policy_class(name)(decoder, cfg.serve, name=name)
