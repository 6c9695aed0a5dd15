"""The `direct` transport: the engine lives in the trainer's process.

`bucketed` packs each bucket into one staging buffer (allocated once, the largest bucket's size,
reused) and the engine loads named views of it; `per_tensor` copies tensor by tensor, the baseline.
"""

from __future__ import annotations

import torch

from rlsync.rollout import Generation, HFEngine
from rlsync.sync import flat
from rlsync.sync.buckets import Bucket, largest_bucket_bytes
from rlsync.timing import Stopwatch


class LocalEngine:
    def __init__(self, engine: HFEngine, buckets: list[Bucket], *, strategy: str):
        self.engine, self.buckets, self.strategy = engine, buckets, strategy
        self.staging = None
        if strategy == "bucketed":
            numel = largest_bucket_bytes(buckets) // engine.dtype.itemsize
            self.staging = torch.empty(numel, dtype=engine.dtype, device=engine.device)

    def generate(self, prompts: list[list[int]], **kwargs) -> Generation:
        return self.engine.generate(prompts, **kwargs)

    def release(self) -> None:
        self.engine.release()

    def resume(self) -> None:
        self.engine.resume()

    @torch.no_grad()
    def update_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, float]:
        watch = Stopwatch(self.engine.device)
        if self.strategy == "per_tensor":
            for name, tensor in weights.items():
                with watch("load"):
                    self.engine.load_weights([(name, tensor)])
            return {**watch.totals("perf/update_weights_{}_time"), "perf/update_weights_staging_bytes": 0}
        for bucket in self.buckets:
            buffer = self.staging[: bucket.numel]
            with watch("pack"):
                flat.pack(bucket, weights, buffer)
            with watch("load"):
                self.engine.load_weights(flat.views(bucket, buffer))
        return {**watch.totals("perf/update_weights_{}_time"),
                "perf/update_weights_staging_bytes": self.staging.numel() * self.staging.element_size()}

    def weights(self) -> dict[str, torch.Tensor]:
        return self.engine.weights

    def close(self) -> None:
        self.staging = None
