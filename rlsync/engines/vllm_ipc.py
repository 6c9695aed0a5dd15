"""update.strategy=vllm_ipc: vLLM's own weight transfer (its `ipc` backend, CUDA IPC), timed.

CUDA only, and untested on the CPU machine this was written on (verified by reading vLLM's
weight_transfer package). vLLM is imported inside the functions, as in rlsync/engines/vllm.py.
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

    def finish_weight_update(self) -> None:
        with self.watch("load"):
            self.llm.finish_weight_update()


def vllm_ipc_update(engine, weights: dict[str, torch.Tensor], *, bucket_bytes: int) -> tuple[dict[str, float], int]:
    """The trainer side of vLLM's `ipc` backend into `engine` (a rlsync.engines.vllm.VLLMEngine): pack into a CUDA IPC buffer, the engine process loads.

    The split: `load` is the time inside the engine's RPCs (open handles, load, re-pack); `pack` the rest
    (the trainer casting and packing into the shared buffer). The `nccl` backend is not offered: it joins
    trainer and engine as two NCCL ranks, which cannot share the one GPU of a colocated run.
    """
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

    class Source(WeightSource):
        def metadata(self):
            return [ParamMeta(name=n, shape=tuple(t.shape), dtype=engine.dtype) for n, t in weights.items()]

        def __iter__(self):
            return ((n, t.detach().to(engine.dtype)) for n, t in weights.items())

    watch = Stopwatch(engine.device)
    client = _TimedClient(engine.llm, watch)
    with watch("total"):
        transfer = IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=bucket_bytes, rank=0),
            client=client,
            source=Source(),
        )
        transfer.send_weights()
    load = watch.seconds.get("load", 0.0)
    return {"pack": watch.seconds["total"] - load, "load": load}, bucket_bytes  # staging: the one packed buffer
