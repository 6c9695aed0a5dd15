"""Trainer offload ("sleep") and onload ("wake up") in a few large copies.

The trainer's parameters, gradients and optimizer state are gathered, per dtype, into one flat
"device" buffer that the tensors are views of (laid out once, at start-up), and each flat buffer
has a twin on the host, allocated and touched once (pinned when CUDA is present) and reused every
step. Sleep is then one asynchronous copy per dtype into the host twin and a single synchronize;
wake-up is the copy back. The tensors never change identity (nor their storage object), so the
model, the optimizer and autograd never notice.

Layout per dtype: parameters | optimizer state | gradients. `drop_grads` copies the prefix without
the gradients and zeroes them on wake-up: the trainer zeroes them before every backward anyway,
so they carry nothing across steps, and they are a quarter of an fp32 AdamW state.

Freeing the device side: on CUDA the flat buffers' storage is resized to 0 while asleep (every
view stays valid metadata) and the allocator's cache emptied, so the engine really gets the
memory; on wake-up the same storage is re-allocated and filled. On a CPU the "device" is host RAM:
freeing it returns nothing to anyone (the host twins are resident anyway, so the peak is two
copies of the state either way) while re-faulting fresh pages on every wake-up costs several times
the copy (measured in rlsync.bench_offload); so by default a CPU keeps both sides resident and
sleep/wake are pure memcpys, the CPU's analogue of the GPU's link copy. `free_device=True` frees
the device side on a CPU too (less resident memory while asleep, a slower wake-up: measured 7x
the copy limit for Qwen3-0.6B). Either way a CPU run holds the state twice: Qwen3-0.6B's fp32
AdamW state is 9.5 GB, so 19 GB (16.6 GB with drop_grads) before the engine and activations,
too much for a 24 GiB machine; there, run it with trainer.offload=none, or time the offload
alone with `python -m rlsync.bench bench.target=offload` (rlsync/bench_offload.py).

AdamW creates its state lazily in its first step; we create it up front, exactly as that first
step would (zeros, step 0), so the layout and the host buffers exist before step 0 and the first
steps cost no more than later ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from rlsync.timing import synchronize

OFFLOAD_MODES = ("none", "full", "drop_grads")


def validate_mode(mode: str) -> str:
    if mode not in OFFLOAD_MODES:
        from rlsync.errors import ConfigError

        raise ConfigError("trainer.offload", mode, ", ".join(OFFLOAD_MODES))
    return mode


@dataclass
class FlatGroup:
    """One dtype's state: a flat device buffer the tensors view, and its host twin."""

    dtype: torch.dtype
    device_flat: torch.Tensor  # [numel] the tensors' storage
    copied: int  # elements at the front that travel (all, or all but the gradients)
    host: torch.Tensor | None = None  # [copied] pinned on CUDA, allocated once
    slots: dict[int, tuple[int, torch.Size]] = field(default_factory=dict)  # id(tensor) -> (offset, shape)

    @property
    def numel(self) -> int:
        return self.device_flat.numel()

    @property
    def copied_bytes(self) -> int:
        return self.copied * self.dtype.itemsize

    def host_view(self, tensor: torch.Tensor) -> torch.Tensor:
        offset, shape = self.slots[id(tensor)]
        return self.host[offset : offset + shape.numel()].view(shape)


@dataclass
class Placement:
    """A tensor to be: its shape and dtype, and how a view of the flat buffer takes its place."""

    shape: torch.Size
    dtype: torch.dtype
    install: Callable[[torch.Tensor], torch.Tensor]  # view -> the tensor that now lives there

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @staticmethod
    def move(t: torch.Tensor) -> "Placement":
        """An existing tensor: copied in, then re-pointed (same object; its old storage is freed now)."""
        def install(view: torch.Tensor) -> torch.Tensor:
            view.copy_(t)
            t.data = view
            return t
        return Placement(t.shape, t.dtype, install)

    @staticmethod
    def create(like: torch.Tensor, assign: Callable, where) -> "Placement":
        """A missing tensor (a gradient, an optimizer moment): zeros, made in place, as `assign(where, zeros)`."""
        def install(view: torch.Tensor) -> torch.Tensor:
            assign(where, view.zero_())
            return view
        return Placement(like.shape, like.dtype, install)


def adam_state_keys(optimizer: torch.optim.Optimizer, group: dict) -> tuple[str, ...]:
    """The per-parameter tensors Adam/AdamW keep (the keys of their lazy first-step initialisation)."""
    if not isinstance(optimizer, torch.optim.Adam):
        raise TypeError(f"offload lays out the optimizer state up front and knows Adam/AdamW, not {type(optimizer).__name__}")
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")


def adam_step(group: dict, p: torch.Tensor) -> torch.Tensor:
    """Adam's step counter as its first step creates it: a CPU scalar unless capturable or fused."""
    if group["capturable"] or group["fused"]:
        return torch.zeros((), dtype=torch.float32, device=p.device)
    return torch.tensor(0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32)


class Offloader:
    """Moves the trainer's state to host memory (`sleep`) and back (`wake_up`); see the module doc."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, mode: str,
                 device: torch.device, free_device: bool | None = None):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.mode = validate_mode(mode)
        self.free_device = device.type == "cuda" if free_device is None else free_device
        self.pinned = device.type == "cuda"
        self.groups: dict[torch.dtype, FlatGroup] = {}
        self.asleep = False
        self.info: dict = {"mode": mode}
        if mode == "none":
            return
        start = time.perf_counter()
        self._lay_out()
        synchronize(device)
        laid_out = time.perf_counter()
        for g in self.groups.values():  # first touch, once: later copies hit resident (pinned) pages
            g.host = torch.empty(g.copied, dtype=g.dtype, pin_memory=self.pinned)
            g.host.zero_()
        touched = time.perf_counter()
        host_bytes = sum(g.copied_bytes for g in self.groups.values())
        self.info.update({
            "free_device": self.free_device, "pinned": self.pinned,
            "dtypes": [str(d).removeprefix("torch.") for d in self.groups],
            "device_bytes": sum(g.numel * g.dtype.itemsize for g in self.groups.values()),
            "host_bytes": host_bytes,
            "layout_time": laid_out - start,  # flat device buffers, tensors moved in, state created
            "host_first_touch_time": touched - laid_out,  # allocate + touch (pin) the host buffers
            "host_first_touch_gbps": host_bytes / max(touched - laid_out, 1e-9) / 1e9,
        })

    @torch.no_grad()
    def _lay_out(self) -> None:
        """Give every tensor its place in its dtype's flat buffer, gradients last."""
        travelling, grads = [], []
        travelling += [Placement.move(p) for p in dict.fromkeys(self.model.parameters())]  # tied weights once
        for group in self.optimizer.param_groups if self.optimizer is not None else []:
            keys = adam_state_keys(self.optimizer, group)
            for p in (p for p in group["params"] if p.requires_grad):  # Adam skips the frozen ones
                state = self.optimizer.state[p]
                state.setdefault("step", adam_step(group, p))
                travelling += [Placement.move(state[k]) if k in state else Placement.create(p, state.__setitem__, k)
                               for k in keys]
                grads.append(Placement.move(p.grad) if p.grad is not None else Placement.create(p, partial(setattr, p), "grad"))
        for dtype in dict.fromkeys(pl.dtype for pl in travelling + grads):
            kept = [pl for pl in travelling if pl.dtype == dtype]
            own_grads = [pl for pl in grads if pl.dtype == dtype]
            copied = sum(pl.numel for pl in kept + (own_grads if self.mode == "full" else []))
            numel = sum(pl.numel for pl in kept + own_grads)
            group = FlatGroup(dtype, torch.empty(numel, dtype=dtype, device=self.device), copied)
            offset = 0
            for pl in kept + own_grads:
                tensor = pl.install(group.device_flat[offset : offset + pl.numel].view(pl.shape))
                group.slots[id(tensor)] = (offset, pl.shape)
                offset += pl.numel
            self.groups[dtype] = group

    @property
    def state_bytes(self) -> int:
        """Bytes of the laid-out state (parameters, optimizer state and gradients)."""
        return sum(g.numel * g.dtype.itemsize for g in self.groups.values())

    @torch.no_grad()
    def sleep(self) -> int:
        """Copy the state to the host twins (one copy per dtype, one sync), free the device side. Returns bytes moved."""
        if self.mode == "none" or self.asleep:
            return 0
        for g in self.groups.values():
            g.host.copy_(g.device_flat[: g.copied], non_blocking=self.pinned)
        synchronize(self.device)
        if self.free_device:
            for g in self.groups.values():
                g.device_flat.untyped_storage().resize_(0)  # every view of it now holds no memory
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.asleep = True
        return sum(g.copied_bytes for g in self.groups.values())

    @torch.no_grad()
    def wake_up(self) -> int:
        """Refill the same device storage from the host twins; zero dropped gradients. Returns bytes moved."""
        if self.mode == "none" or not self.asleep:
            return 0
        for g in self.groups.values():
            if self.free_device:
                g.device_flat.untyped_storage().resize_(g.numel * g.dtype.itemsize)
            g.device_flat[: g.copied].copy_(g.host, non_blocking=self.pinned)
            if g.copied < g.numel:
                g.device_flat[g.copied :].zero_()  # dropped gradients: the next backward rebuilds them
        synchronize(self.device)
        self.asleep = False
        return sum(g.copied_bytes for g in self.groups.values())

    def host_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The host copies of `weights` (valid while asleep): what `update.source=host` sends from."""
        if not self.asleep:
            raise RuntimeError("update.source=host needs the trainer offloaded first (trainer.offload=full or drop_grads)")
        return {name: self.groups[t.dtype].host_view(t) for name, t in weights.items()}


def device_memory_gb(device: torch.device) -> float | None:
    """Device memory this process holds from the driver (tensors + allocator cache), in GB; None off CUDA.

    Reserved, not allocated: it is what an engine in another process cannot have."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_reserved(device) / 1e9


def link_metrics(m: dict, limits) -> dict[str, float]:
    """perf/{sleep,wake_up}_{gbps,limit_time,efficiency} from their _time and _bytes in `m`.

    The limit is the payload over the one-way copy bandwidth measured in the same run (`limits.to_host`,
    `limits.to_device`: pinned PCIe on CUDA, memcpy on a CPU); efficiency = limit / time (1 = at the limit).
    """
    out = {}
    for phase, bandwidth in (("sleep", limits.to_host), ("wake_up", limits.to_device)):
        nbytes, seconds = m.get(f"perf/{phase}_bytes", 0), m.get(f"perf/{phase}_time")
        if nbytes and seconds:
            limit = nbytes / bandwidth
            out.update({f"perf/{phase}_gbps": nbytes / seconds / 1e9, f"perf/{phase}_limit_time": limit,
                        f"perf/{phase}_efficiency": limit / seconds})
    return out
