"""`serve.update_policy=pause`: generation is held for the whole receive, which lands in the live weights.

Clients wait the whole receive; nothing is held beyond the transport's own buffers. An update cut off
after any of it landed tears the weights (`UpdatePolicy.cut`): no answer is served from them, and none
claims a version, until a complete update lands; cut off before anything landed, the old version serves on.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Optional

import torch

from rlsync.engines.base import Engine
from rlsync.serve.policies.base import UpdatePolicy


class Landing:
    """The engine as the receive sees it: counts the tensors handed to its `load_weights`, so that an update
    cut off says how much of it may have landed in the live weights."""

    def __init__(self, engine: Engine):
        self.engine, self.loaded = engine, 0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = list(named)
        self.loaded += len(named)  # counted before the copy: a copy that fails midway may have written
        self.engine.load_weights(named)

    def touched(self, receiver) -> Optional[str]:
        """How much of the update may be in the live weights ("N of M tensors landed"), or None if nothing is."""
        total = sum(len(b.slots) for b in getattr(receiver, "buckets", ()))
        if getattr(receiver, "flat", None) is not None and not getattr(receiver, "slots", None):
            return f"part of its {total} tensors landed (flat engine weights receive in place)"
        return f"{self.loaded} of {total} tensors landed" if self.loaded else None


class PausePolicy(UpdatePolicy):
    title = (
        "generation is held for the whole receive, which lands in the live weights; no memory beyond the transport's"
    )
    holds_whole_receive = True

    @classmethod
    def swap_phrase(cls, pointer: Optional[float]) -> str:
        return "in-place receive"

    def update(self, server, request) -> dict:
        with self.hold() as stopped:
            _, cpu = self.started()  # the receive starts as generation stops: clients wait all of it
            landing = Landing(server.engine)
            try:
                result = server.receiver.handle(landing, request)
            except BaseException as err:
                raise self.cut(err, landing.touched(server.receiver)) from err
            done, split = time.perf_counter(), cpu.done()
            self.swapped((stopped, done), (stopped, done), split)
        return result
