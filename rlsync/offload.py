"""Trainer offload ("sleep") and onload ("wake up").

After its step the trainer moves parameters, gradients and optimizer state to host memory so the
rollout engine has the device to itself; before the next log-probs it brings them back. Tensors
keep their identity (we swap `.data`), so the model and the optimizer never notice. Host buffers
are allocated once (pinned when CUDA is present) and reused every step. On a CPU-only machine the
"device" is host memory too: the copies still happen, tensor by tensor (copy, then free the
source), so a CPU run measures memcpy and never holds two full copies of the state at once.
"""

from __future__ import annotations

import torch
from torch import nn

from rlsync.timing import synchronize

OFFLOAD_MODES = ("full", "none")


class Offloader:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, mode: str, device: torch.device):
        self.model, self.optimizer, self.mode, self.device = model, optimizer, mode, device
        self.host: dict[int, torch.Tensor] = {}  # id(tensor) -> host buffer, reused across steps
        self.asleep = False

    def state_tensors(self) -> list[torch.Tensor]:
        """Parameters, gradients and optimizer state that live on the device."""
        tensors = []
        for p in self.model.parameters():
            tensors.append(p)
            if p.grad is not None:
                tensors.append(p.grad)
        for state in self.optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return tensors

    @torch.no_grad()
    def sleep(self) -> int:
        """Move the state to host memory, free the device copies. Returns bytes moved."""
        if self.mode == "none" or self.asleep:
            return 0
        moved = 0
        pin = self.device.type == "cuda"
        for t in self.state_tensors():
            host = self.host.get(id(t))
            if host is None:
                host = self.host[id(t)] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            host.copy_(t.data, non_blocking=pin)
            moved += t.numel() * t.element_size()
            if not pin:
                t.data = host  # the source storage is freed here, tensor by tensor
        if pin:
            synchronize(self.device)
            for t in self.state_tensors():
                t.data = self.host[id(t)]
            torch.cuda.empty_cache()
        self.asleep = True
        return moved

    def host_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The host copies of `weights` (valid while asleep): what `update.source=host` sends from."""
        if not self.asleep:
            raise RuntimeError("update.source=host needs the trainer offloaded first (trainer.offload=full)")
        return {name: self.host[id(t)] for name, t in weights.items()}

    @torch.no_grad()
    def wake_up(self) -> int:
        """Bring the state back onto the device, into the same tensor objects. Returns bytes moved."""
        if self.mode == "none" or not self.asleep:
            return 0
        moved = 0
        for t in self.state_tensors():
            host = t.data
            t.data = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            t.data.copy_(host, non_blocking=True)
            moved += host.numel() * host.element_size()
        synchronize(self.device)
        self.asleep = False
        return moved
