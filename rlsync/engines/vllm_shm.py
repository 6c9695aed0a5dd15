"""update.strategy=vllm_shm: vLLM's own four-phase weight transfer (init, start, update, finish) on the CPU.

vLLM accepts any weight-transfer engine registered with `WeightTransferEngineFactory.register_engine`,
and its CPU worker inherits the four weight-transfer methods, so the protocol a GPU user runs through
the `ipc` or `nccl` backend runs here through this one, over shared memory:

- init (`trainer_init`, once per engine): the trainer maps `SLOTS` files in /dev/shm of the largest
  bucket's size and sends their paths; vLLM's worker maps the same files (`torch.from_file(shared=True)`).
- start (`start_weight_update`): vLLM's reload begins, as the installed release's own IPC engine begins it
  (0.32, 0.33: `initialize_layerwise_reload`; 0.34: `start_reload`, which follows VLLM_RELOAD_MODE).
- update (`update_weights`, once per chunk): the trainer packs a chunk (tensors in metadata order,
  greedy up to the buffer's size, as vLLM's packed producer does) into a slot; the worker hands views of
  it to the model's `load_weights`. Whatever vLLM still holds at the end of the call (a layer split
  across chunks) is detached from the slot before the trainer rewrites it (rlsync/engines/vllm_held.py).
- finish (`finish_weight_update`): vLLM finalizes the layers still open (0.34: `finish_reload`).

Only the bytes and a few names cross the RPC, so the engine core could live in its own process; rlsync
runs it in the trainer's (VLLM_ENABLE_V1_MULTIPROCESSING=0), as the reload path does. Importing this
module imports vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer import base
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from rlsync.engines.vllm_held import LoadLedger, held_arguments, repack_tied_head

BACKEND = "rlsync_shm"  # the name vLLM's factories know this engine by
SLOTS = 1  # the calls are synchronous (update_weights returns after the load): one buffer is enough


@dataclass
class ShmInitInfo(base.WeightTransferInitInfo):
    """Worker side, sent once: the shared files, their size, the engine dtype, whether to record reads."""

    paths: list[str] = field(default_factory=list)
    buffer_bytes: int = 0
    dtype_name: str = "bfloat16"
    verify: bool = False


@dataclass
class ShmUpdateInfo(base.WeightTransferUpdateInfo):
    """One chunk: which slot, and each tensor's name, dtype, shape and byte offset in it."""

    slot: int = 0
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    detach_held: bool = True  # false only to show what a reused buffer does to a held layer


@dataclass
class ShmTrainerInitInfo(base.TrainerInitInfo):
    """Trainer side: the buffer size (the largest bucket), the engine dtype, update.verify."""

    backend: ClassVar[str] = BACKEND
    buffer_bytes: int = 64 << 20
    dtype_name: str = "bfloat16"
    verify: bool = False


def map_file(path: str, nbytes: int) -> torch.Tensor:
    """The shared file as a byte tensor (MAP_SHARED: both sides see each other's writes)."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class SharedMemoryWeightTransferEngine(base.WeightTransferEngine):
    """vLLM's worker side: maps the trainer's files, loads views of them through the model's loaders."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        from rlsync.engines.vllm_api import installed_shape

        self.shape = installed_shape()  # the release's reload calls
        self.slots = [map_file(p, init_info.buffer_bytes) for p in init_info.paths]
        self.ledger = LoadLedger(getattr(torch, init_info.dtype_name), verify=init_info.verify)

    def start_weight_update(self) -> None:
        self.ledger.start()
        self.embedding_loaded = False
        self.shape.start_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base synchronizes torch.accelerator after the receive; a CPU has nothing to wait for
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        slot = self.slots[update_info.slot]
        named = []
        for name, dtype_name, shape, offset in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, update_info.offsets
        ):
            dtype = getattr(torch, dtype_name)
            numel = int(torch.Size(shape).numel())
            named.append((name, slot[offset : offset + numel * dtype.itemsize].view(dtype).view(shape)))
        known = held_arguments(self.model) is not None  # else: clone, as vLLM's own IPC consumer does
        handed = named if known else [(n, t.clone()) for n, t in named]
        self.model.load_weights(handed)
        self.embedding_loaded |= any(n.endswith("embed_tokens.weight") for n in update_info.names)
        self.ledger.after_call(self.model, handed, reused=known, detach=update_info.detach_held)

    def finish_weight_update(self) -> None:
        self.shape.finish_reload(self.model, self.model_config, self.device)
        self.ledger.finish()
        if self.embedding_loaded:  # vLLM's finalize leaves a tied lm_head packed from the old embedding
            repack_tied_head(self.model)

    def shutdown(self) -> None:
        self.slots = []


class SharedMemoryTrainerEngine(base.TrainerWeightTransferEngine):
    """The trainer's side: packs each chunk of the source into the shared buffer, drives the four phases."""

    init_info_cls = ShmTrainerInitInfo

    def __init__(self, *, client, source, info: ShmTrainerInitInfo, shape) -> None:
        super().__init__(client=client, source=source, **shape.trainer_engine_fields(info))
        self.shape, self.buffer_bytes, self.detach_held = shape, info.buffer_bytes, True
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.paths, self.slots = [], []
        for _ in range(SLOTS):
            handle, path = tempfile.mkstemp(prefix="rlsync-vllm-shm-", dir=folder)
            os.close(handle)
            self.paths.append(path)
            self.slots.append(map_file(path, info.buffer_bytes))
            self.slots[-1].fill_(0)  # touch every page once, outside the timed update

    @classmethod
    def trainer_init(cls, init_info: ShmTrainerInitInfo, *, client, source=None, shape=None):
        from rlsync.engines.vllm_api import installed_shape

        engine = cls(client=client, source=source, info=init_info, shape=shape or installed_shape())
        info = {"paths": engine.paths, "buffer_bytes": init_info.buffer_bytes, "dtype_name": init_info.dtype_name}
        engine.client.init_weight_transfer_engine({**info, "verify": init_info.verify})
        return engine

    def chunks(self) -> list[list]:
        """The source's metadata in order, cut greedily into chunks of at most the buffer's bytes."""
        out: list[list] = [[]]
        used = 0
        for meta in self.shape.source_metadata(self.source):
            nbytes = int(torch.Size(meta.shape).numel()) * meta.dtype.itemsize
            if nbytes > self.buffer_bytes:
                raise ValueError(f"vllm_shm: {meta.name} ({nbytes} bytes) exceeds the {self.buffer_bytes}-byte buffer")
            if used + nbytes > self.buffer_bytes and out[-1]:
                out.append([])
                used = 0
            out[-1].append(meta)
            used += nbytes
        return [c for c in out if c]

    def send_weights(self) -> None:
        self.client.start_weight_update()
        pairs: Iterator = self.shape.walk(self.source)
        for index, chunk in enumerate(self.chunks()):
            slot, offsets, offset = index % SLOTS, [], 0
            for meta in chunk:
                name, tensor = next(pairs)
                if name != meta.name:
                    raise RuntimeError(f"vllm_shm: the source yielded {name!r} where its metadata has {meta.name!r}")
                numel = tensor.numel()
                dst = self.slots[slot][offset : offset + numel * meta.dtype.itemsize].view(meta.dtype)
                dst.copy_(tensor.detach().reshape(-1))  # the cast to the engine's dtype is this copy
                offsets.append(offset)
                offset += numel * meta.dtype.itemsize
            update = ShmUpdateInfo(
                slot=slot,
                names=[m.name for m in chunk],
                dtype_names=[str(m.dtype).removeprefix("torch.") for m in chunk],
                shapes=[list(m.shape) for m in chunk],
                offsets=offsets,
                detach_held=self.detach_held,
            )
            self.client.update_weights(dataclasses.asdict(update))
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.slots = []
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.paths = []


def register() -> None:
    """Make BACKEND known to vLLM's two factories (once per process)."""
    for factory, cls in (
        (WeightTransferEngineFactory, "SharedMemoryWeightTransferEngine"),
        (WeightTransferTrainerFactory, "SharedMemoryTrainerEngine"),
    ):
        with contextlib.suppress(ValueError):  # registered already in this process
            factory.register_engine(BACKEND, __name__, cls)
