"""vLLM's own trainer-to-engine weight transfer, timed: update.strategy=vllm_ipc (CUDA IPC) and vllm_shm (the CPU).

Both drive vLLM's four phases (init, start, update, finish) through a trainer engine of vLLM's
(`TrainerWeightTransferEngine.trainer_init(init_info, client=, source=)`, `send_weights()`), with the
trainer's weights as a `WeightSource` shaped for the installed release (rlsync/engines/vllm_api.py).
vllm_ipc is CUDA only, verified by reading (docs/vllm.md); vllm_shm runs here, through the shared-memory
engine of rlsync/engines/vllm_shm.py. vLLM is imported inside the functions, as in rlsync/engines/vllm.py.
"""

from __future__ import annotations

import torch

from rlsync.measure.timing import Stopwatch


class _TimedClient:
    """vLLM's weight-sync client protocol over the `LLM`'s own RL methods, timing the engine's side (the load)."""

    def __init__(self, llm, watch):
        self.llm, self.watch = llm, watch

    def init_weight_transfer_engine(self, init_info: dict) -> None:
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
    one source for the engine's life (vLLM's trainer engines replay theirs every round), fed each update."""

    def __init__(self, shape, dtype: torch.dtype):
        self.current: dict[str, torch.Tensor] = {}
        self.dtype = dtype
        self.metas: list = []
        self.source = None
        self.shape = shape

    def feed(self, weights: dict[str, torch.Tensor]) -> None:
        metas = [(n, self.dtype, tuple(t.shape)) for n, t in weights.items()]
        if metas != self.metas:  # first update (or another plan): a new source (0.33+ caches its metadata)
            self.metas = metas
            self.source = self.shape.source(metas, self.pairs)
        self.current = weights

    def pairs(self):
        return ((n, t.detach()) for n, t in self.current.items())


def vllm_ipc_update(engine, weights: dict[str, torch.Tensor], *, bucket_bytes: int) -> tuple[dict[str, float], int]:
    """The trainer side of vLLM's `ipc` backend into `engine` (a rlsync.engines.vllm.VLLMEngine): pack into a CUDA IPC buffer, the engine process loads.

    The split: `load` is the time inside the engine's RPCs (open handles, load, re-pack); `pack` the rest
    (the trainer casting and packing into the shared buffer). The `nccl` backend is not offered: it joins
    trainer and engine as two NCCL ranks, which cannot share the one GPU of a colocated run.
    """
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

    from rlsync.engines.vllm_api import installed_shape

    shape = installed_shape()
    source = TrainerWeights(shape, engine.dtype)
    source.feed({n: t.to(engine.dtype) for n, t in weights.items()})  # IPC sends the bytes as they are
    watch = Stopwatch(engine.device)
    client = _TimedClient(engine.llm, watch)
    with watch("total"):
        info = shape.trainer_init_info(IPCTrainerInitInfo, packed=True, packed_buffer_size_bytes=bucket_bytes)
        transfer = IPCTrainerWeightTransferEngine.trainer_init(info, client=client, source=source.source)
        transfer.send_weights()
    load = watch.seconds.get("load", 0.0)
    return {"pack": watch.seconds["total"] - load, "load": load}, bucket_bytes  # staging: the one packed buffer


class ShmUpdater:
    """update.strategy=vllm_shm's trainer side, opened once per engine (the init phase), sending every update."""

    def __init__(self, engine, *, bucket_bytes: int, verify: bool):
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from rlsync.engines.vllm_api import installed_shape
        from rlsync.engines.vllm_shm import ShmTrainerInitInfo, register

        register()
        self.engine, self.bucket_bytes = engine, bucket_bytes
        self.weights = TrainerWeights(installed_shape(), engine.dtype)
        self.watch = Stopwatch(engine.device)
        self.client = _TimedClient(engine.llm, self.watch)
        dtype_name = str(engine.dtype).removeprefix("torch.")
        info = self.weights.shape.trainer_init_info(
            ShmTrainerInitInfo, buffer_bytes=bucket_bytes, dtype_name=dtype_name, verify=verify
        )
        self.weights.feed({})
        self.transfer = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=None)

    def update(self, weights: dict[str, torch.Tensor]) -> tuple[dict[str, float], int]:
        self.weights.feed(weights)
        self.transfer.source = self.weights.source
        self.watch.seconds.clear()
        with self.watch("total"):
            self.transfer.send_weights()
        load = self.watch.seconds.get("load", 0.0)
        staging = sum(s.numel() for s in self.transfer.slots)
        return {"pack": self.watch.seconds["total"] - load, "load": load}, staging

    def close(self) -> None:
        self.transfer.shutdown()
