"""vLLM's own trainer-to-engine weight transfer, timed: update.strategy=vllm_ipc (CUDA IPC) and vllm_shm (the CPU).

Both drive vLLM's four phases (init, start, update, finish) through a trainer engine of vLLM's
(`TrainerWeightTransferEngine.trainer_init(init_info, client=, source=)`, `send_weights()`), with the
trainer's weights as a `WeightSource` shaped for the installed release (rlsync/engines/vllm_api.py).
Each strategy's sender (`IpcSender`, `ShmSender`) opens vLLM's trainer engine once, in the first update (the
init phase), replays the one source every update after it, and declares what vLLM's receiving side copies
(`receiver_copies`, counted by the update's floor). vllm_ipc is CUDA only, verified by reading (docs/vllm.md);
vllm_shm runs here, through the shared-memory engine of rlsync/engines/vllm_shm.py. vLLM is imported inside
the functions, as in rlsync/engines/vllm.py.
"""

from __future__ import annotations

import torch

from rlsync.measure.timing import Stopwatch


class _TimedClient:
    """vLLM's weight-sync client protocol over the `LLM`'s own RL methods, timing the engine's side (the load)."""

    def __init__(self, llm, watch):
        self.llm, self.watch = llm, watch

    def init_weight_transfer_engine(self, init_info: dict) -> None:  # once per engine: the first update's
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        with self.watch("load"):
            self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        with self.watch("load"):
            self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        with self.watch("load"):
            self.llm.finish_weight_update()


class TrainerWeights:
    """The trainer's weights of the update under way, as a `WeightSource` of the installed release's shape:
    one source for the engine's life (vLLM's trainer engines replay theirs every round), fed each update.
    `cast`: the source yields each tensor cast to the engine's dtype (inside the timed send; IPC sends the
    bytes as they are), else the trainer's own (vllm_shm's copy into its buffer casts)."""

    def __init__(self, shape, dtype: torch.dtype, *, cast: bool):
        self.current: dict[str, torch.Tensor] = {}
        self.dtype, self.cast = dtype, cast
        self.metas: list = []
        self.source = None
        self.shape = shape

    def feed(self, weights: dict[str, torch.Tensor]) -> bool:
        """This update's weights; true where the source is new (first update, or another plan: 0.33+ caches
        a source's metadata, so a new plan needs a new source)."""
        metas = [(n, self.dtype, tuple(t.shape)) for n, t in weights.items()]
        fresh = self.source is None or metas != self.metas
        if fresh:
            self.metas = metas
            self.source = self.shape.source(metas, self.pairs)
        self.current = weights
        return fresh

    def pairs(self):
        if self.cast:
            return ((n, t.detach().to(self.dtype)) for n, t in self.current.items())
        return ((n, t.detach()) for n, t in self.current.items())


class NativeSender:
    """One of vLLM's trainer engines, opened by the first update (vLLM's init phase, once per engine) and
    sending every update after it (start, update per chunk, finish) from the same `WeightSource`."""

    cast: bool  # TrainerWeights(cast=): whether the source casts to the engine's dtype
    # What vLLM's receiving side copies of each byte, beyond the one copy every floor counts (the trainer's
    # bytes into the buffer the engine reads), before its reload's own (VLLMEngine.receiver_copies).
    receiver_copies: tuple[str, ...]

    def __init__(self, engine, *, bucket_bytes: int, verify: bool):
        from rlsync.engines.vllm_api import installed_shape

        self.engine, self.bucket_bytes, self.verify = engine, bucket_bytes, verify
        self.weights = TrainerWeights(installed_shape(), engine.dtype, cast=self.cast)
        self.watch = Stopwatch(engine.device)
        self.client = _TimedClient(engine.llm, self.watch)
        self.transfer = None

    def open(self):
        """The trainer engine, after vLLM's init phase (its `trainer_init`), over `self.weights.source`."""
        raise NotImplementedError

    def staging_bytes(self) -> int:
        raise NotImplementedError

    def update(self, weights: dict[str, torch.Tensor]) -> tuple[dict[str, float], int]:
        """One update: the seconds inside the engine's RPCs (`load`) and the rest (`pack`), the staging bytes."""
        self.watch.seconds.clear()
        with self.watch("total"):
            fresh = self.weights.feed(weights)
            if self.transfer is None:
                self.transfer = self.open()
            elif fresh:
                self.transfer.source = self.weights.source
            self.transfer.send_weights()
        load = self.watch.seconds.get("load", 0.0)
        return {"pack": self.watch.seconds["total"] - load, "load": load}, self.staging_bytes()

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.shutdown()
        self.transfer = None


class IpcSender(NativeSender):
    """update.strategy=vllm_ipc's trainer side: vLLM's `IPCTrainerWeightTransferEngine`, packed.

    The split: `load` is the time inside the engine's RPCs (open handles, clone, load); `pack` the rest
    (the trainer casting and packing into the shared buffer). The `nccl` backend is not offered: it joins
    trainer and engine as two NCCL ranks, which cannot share the one GPU of a colocated run.
    """

    cast = True
    # packed_ipc_consumer clones every tensor out of the reused IPC buffer, on purpose (packed_tensor.py,
    # 0.32 to 0.34), then the model's loaders copy the clone in
    receiver_copies = ("clone", "load")

    def open(self):
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

        shape = self.weights.shape
        info = shape.trainer_init_info(IPCTrainerInitInfo, packed=True, packed_buffer_size_bytes=self.bucket_bytes)
        return IPCTrainerWeightTransferEngine.trainer_init(info, client=self.client, source=self.weights.source)

    def staging_bytes(self) -> int:
        return self.bucket_bytes  # the one packed IPC buffer


class ShmSender(NativeSender):
    """update.strategy=vllm_shm's trainer side: rlsync's shared-memory engine, registered with vLLM's factories."""

    cast = False  # the copy into the shared buffer casts
    receiver_copies = ("load",)  # the loaders read views of the shared buffer (a clone only where vLLM holds one)

    def open(self):
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from rlsync.engines.vllm_shm import ShmTrainerInitInfo, register

        register()
        dtype_name = str(self.engine.dtype).removeprefix("torch.")
        info = self.weights.shape.trainer_init_info(
            ShmTrainerInitInfo, buffer_bytes=self.bucket_bytes, dtype_name=dtype_name, verify=self.verify
        )
        return WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.weights.source)

    def staging_bytes(self) -> int:
        return sum(s.numel() for s in self.transfer.slots)


SENDERS: dict[str, type[NativeSender]] = {"vllm_ipc": IpcSender, "vllm_shm": ShmSender}
