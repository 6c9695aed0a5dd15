"""`serve.update_policy=stage`: the update is received into a side copy while the decoder goes on with the
live weights, then swapped in while generation is held for the swap alone.

The swap is a pointer swap (each parameter takes the side copy's storage and the side copy the retired
one, which the next update fills) where the engine's weights are plain tensors by the update's names (the
HF engine: `Engine.holds_flat_weights`), else a local copy of the side copy into the weights
(`serve.stage_swap=copy` forces it). It holds one more copy of the engine's weights, in rollout.dtype
(rlsync/check/estimate.py `staged_copy_bytes`). The receive runs on a thread `serve.stage_nice` below
generation. An update cut off wrote the side copy alone: the old version serves on.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Optional

import torch

import rlsync.update.flat as flat
from rlsync.measure.devices import copy_into
from rlsync.serve.policies.base import UpdatePolicy, cause_line
from rlsync.serve.streams import UpdateCut


class SideCopy:
    """The staged weights, as the transport's receiver sees an engine: where an update lands by name."""

    def __init__(self, live: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self._weights = {name: torch.empty_like(t) for name, t in live.items()}

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self._weights

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            copy_into(self._weights[name], tensor)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._weights.values())


class StagePolicy(UpdatePolicy):
    title = (
        "the update is received into a side copy while generation goes on, then swapped in while generation is "
        "held for the swap alone; one more copy of the engine's weights"
    )
    staged_copies = 1

    @classmethod
    def swap_phrase(cls, pointer: Optional[float]) -> str:
        if pointer is None:
            return "n/a"
        return "pointer swap" if pointer else "local copy"

    def __init__(self, decoder, serve, *, name: str):
        super().__init__(decoder, serve, name=name)
        # the receive (and the group's threads, started by it) at a lower priority than generation
        self.receiving = decoder.receive_thread(serve.stage_nice)
        self.pointer = serve.stage_swap == "auto" and type(decoder.engine).holds_flat_weights
        self.swap = self.swap_phrase(self.pointer)
        self.side: Optional[SideCopy] = None
        self.retired: Optional[list[torch.Tensor]] = None  # flat weights: the bank the live weights are views of

    def open(self, server) -> dict:
        engine, receiver = server.engine, server.receiver
        live = engine.weights
        if self.pointer and not all(isinstance(t, torch.nn.Parameter) for t in live.values()):
            # views of fused parameters (a MoE's experts, checkpoint layout): rebinding a view's data would leave
            # the parameter as it was, so the swap copies
            self.pointer = False
            self.swap = self.swap_phrase(self.pointer)
        self.side = SideCopy(live, engine.device, engine.dtype)
        # on the receive's thread: the group's threads start there and inherit its nice value
        result = self.receiving.run(lambda: receiver.open(self.side), self.bound(receiver))
        # flat weights: the side copy is now views of the receiver's buffers
        self.staged_bytes = self.side.nbytes
        if self.pointer and receiver.flat is not None:
            # the live weights as views of a second bank laid out alike: a swap trades the banks whole
            with self.hold():
                self.retired = flat.allocate(receiver.buckets, engine.device)
                flat.bind(live, receiver.buckets, self.retired)
        return result

    def update(self, server, request) -> dict:
        r0, cpu = self.started()
        receiver = server.receiver
        try:
            result = self.receiving.run(lambda: receiver.handle(self.side, request), self.bound(receiver))
        except BaseException as err:  # only the side copy was written: the live weights are untouched
            raise UpdateCut(
                f"the staged update was cut off ({cause_line(err)}); version {self.decoder.version} serves on"
            ) from err
        r1, split = time.perf_counter(), cpu.done()
        with self.hold() as stopped:
            try:
                self._swap(server)
            except BaseException as err:
                raise self.cut(err, "part of its tensors swapped in") from err
            self.swapped((r0, r1), (stopped, time.perf_counter()), split)
        return result

    def bound(self, receiver) -> float:
        """The longest a receive may take: each of its waits is cut to serve.max_wait_s."""
        return self.wait_s * (len(getattr(receiver, "buckets", ())) + 2)

    @torch.no_grad()
    def _swap(self, server) -> None:
        live, staged = server.engine.weights, self.side.weights
        if not self.pointer:
            server.engine.load_weights(staged.items())
            return
        for name, param in live.items():
            side = staged[name]
            old = param.data
            param.data = side.data  # the parameter object stays: modules and tied weights keep pointing at it
            side.data = old
        receiver = server.receiver
        if self.retired is not None:  # the receiver fills the retired bank next
            receiver.flat, self.retired = self.retired, receiver.flat
