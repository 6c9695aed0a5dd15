"""A CUDA device's bookkeeping on a CPU: which tensors live on `cuda:0`, and PyTorch's rules for mixing them.

Inside `SimulatedCuda()`, every op really runs on the host, but a tensor created on or moved to
`cuda:0` comes back as an `OnCuda` tensor that reports `device == cuda:0`, and an op is refused as
CUDA refuses it:

- every tensor operand must be on the op's device, except a 0-dim CPU tensor (a scalar);
- indexing: a CUDA tensor may be indexed by CPU or CUDA indices, a CPU tensor by CPU indices only
  ("indices should be either on cpu or on the same device as the indexed tensor");
- copies (`.to`, `.cpu()`, `copy_`) cross devices; `.item()` / `.tolist()` read a CUDA tensor (a sync).

So the device plumbing of real functions (scoring, advantages, log-probs, the scatter) is checked
on a CPU, with real values: what would fail on a GPU for mixing devices fails here.
"""

from __future__ import annotations

import torch
from conftest import CPU
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

DEVICE = torch.device("meta")  # stands for cuda:0: a device type that needs no driver to be named
aten = torch.ops.aten
MOVES = {
    aten._to_copy.default,
    aten.copy_.default,
    aten._copy_from_and_resize.default,
    aten.copy.default,
    aten._local_scalar_dense.default,
}
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class DeviceMismatch(RuntimeError):
    pass


class OnCuda(torch.Tensor):
    """A host tensor that says it lives on cuda:0."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            host.shape,
            dtype=host.dtype,
            device=DEVICE,
            strides=host.stride(),
            storage_offset=host.storage_offset(),
            requires_grad=host.requires_grad,
        )
        out.host = host
        return out

    def tolist(self):  # a read of device memory, as on CUDA (subclasses lack their own)
        return self.host.tolist()

    def __repr__(self) -> str:
        return f"OnCuda({self.host!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return SimulatedCuda.run(func, args, kwargs or {})


def device_of(t: torch.Tensor) -> torch.device:
    return DEVICE if isinstance(t, OnCuda) else t.device


def target_device(kwargs: dict) -> torch.device | None:
    device = kwargs.get("device")
    return None if device is None else torch.device(device)


class SimulatedCuda(TorchDispatchMode):
    @staticmethod
    def run(func, args, kwargs):
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        asked = target_device(kwargs)
        if func in MOVES:
            out_device = asked or device_of(args[0]) if func is aten._to_copy.default else device_of(args[0])
        elif func in INDEXING:
            out_device = device_of(args[0])
            for index in tree_leaves(args[1]):
                if isinstance(index, torch.Tensor) and device_of(index) not in (CPU, out_device):
                    raise DeviceMismatch(
                        f"{func}: indices should be either on cpu or on the same device as the "
                        f"indexed tensor ({out_device}), got {device_of(index)}"
                    )
        elif not tensors:  # a factory: where it is asked to put its result
            out_device = asked or CPU
        else:
            operands = [t for t in tensors if not (device_of(t) == CPU and t.dim() == 0)]  # CPU scalars mix freely
            devices = {device_of(t) for t in operands} or {CPU}
            if len(devices) > 1:
                raise DeviceMismatch(
                    f"{func}: expected all tensors to be on the same device, found {sorted(map(str, devices))}"
                )
            out_device = devices.pop()

        def unwrap(x):
            if isinstance(x, OnCuda):
                return x.host
            if isinstance(x, torch.device) and x == DEVICE:
                return CPU
            return x

        host_kwargs = {k: unwrap(v) for k, v in kwargs.items()}
        if "device" in host_kwargs and host_kwargs["device"] is not None:
            host_kwargs["device"] = CPU
        out = func(*tree_map(unwrap, args), **host_kwargs)
        originals = {id(t.host): t for t in tensors if isinstance(t, OnCuda)}  # in-place ops return their input

        def wrap(x):
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) in originals:
                return originals[id(x)]
            return OnCuda(x) if out_device == DEVICE else x

        return tree_map(wrap, out)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.run(func, args, kwargs or {})


class SimulatedAllocator:
    """The CUDA caching allocator's counters as torch.cuda reports them, without a driver.

    `install(monkeypatch)` routes torch.cuda's memory-stat calls here; `alloc`/`free` move the
    counters as tensors would. One set of peaks per process, cleared whole by
    `reset_peak_memory_stats`, as in c10/cuda/CUDACachingAllocator.cpp.
    """

    def __init__(self):
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.resets = 0

    def alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)  # the cache keeps what it got from the driver
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved
        self.resets += 1

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak_allocated)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self.reset_peak_memory_stats)
