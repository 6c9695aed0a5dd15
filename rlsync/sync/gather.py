"""The update's tensors from a sharded trainer (trainer.parallel=fsdp2): full tensors gathered from the shards.

FSDP2 holds each parameter as a DTensor, one shard per rank; the engine needs whole tensors. As verl's
and TRL's colocated updates do, each parameter is gathered with `DTensor.full_tensor()` (one all-gather
over the trainer's group) shortly before it is sent:

- `per_bucket` (the lazy, bucket by bucket gather of TRL PR #6386): a bucket's parameters are gathered
  just before the transport packs it, and dropped when it moves on: the gathered bytes held at once are
  one bucket's (in the trainer's dtype);
- `per_tensor` (verl's fsdp_workers.py `rollout_mode`: a generator of `full_tensor()`'d parameters feeding
  the bucket; TRL's `_sync_fsdp2_params_to_vllm`: `full_tensor()` then `load_weights`, one by one): each
  tensor gathered when read, one held at a time (inside the transport's pack or load);
- `all_at_once` (a full state dict first, as FSDP1's FULL_STATE_DICT gives it): every parameter is
  gathered at the first read: the whole model is held at once.

Every gather is a collective: every rank must gather the same buckets in the same order. Ranks whose
engine reads the tensors go through `ShardedWeights` in plan order (transports read in bucket order);
ranks without an engine `drain()` it, which gathers the same sequence. A read out of order is an error,
not a hang. `rewind()` starts a new pass (update.verify compares the engine with a second gather).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

import torch

from rlsync.measure.timing import synchronize
from rlsync.model.architecture import Entry, update_tensors
from rlsync.sync.buckets import Bucket

GATHER_MODES = ("per_bucket", "per_tensor", "all_at_once")  # update.gather's choices


class ShardedWeights(Mapping):
    """The update's tensors by name, gathered from `shards` (parameter name -> DTensor) bucket by bucket.

    `gather(tensor)` makes a shard whole (`DTensor.full_tensor`); `layout`/`plan` turn the gathered
    parameters into the update's tensors (model.update_layout: per-expert views of a fused parameter).
    `seconds`, `rows` (per bucket: bytes and gather_time), `gathered_bytes` and `peak_bytes` say what the
    passes so far cost.
    """

    def __init__(
        self,
        shards: dict[str, torch.Tensor],
        *,
        layout: str,
        plan: list[Entry],
        buckets: list[Bucket],
        gather: Callable[[torch.Tensor], torch.Tensor],
        mode: str,
        device: torch.device,
    ):
        if mode not in GATHER_MODES:
            raise ValueError(f"update.gather={mode!r}: expected one of {', '.join(GATHER_MODES)}")
        self.shards, self.layout, self.gather, self.mode, self.device = shards, layout, gather, mode, device
        self.entries = {e.name: e for e in plan}
        # the units gathered at once, in plan order: a bucket's tensors, or one tensor (per_tensor)
        names = [[n] for b in buckets for n in b.names] if mode == "per_tensor" else [b.names for b in buckets]
        self.units = names
        self.bucket_of = {name: k for k, unit in enumerate(self.units) for name in unit}
        missing = set(self.entries) - set(self.bucket_of)
        if missing:
            raise ValueError(f"update tensors not in the bucket plan: {sorted(missing)[:3]}")
        self.seconds, self.gathered_bytes, self.peak_bytes = 0.0, 0, 0
        self.rows: list[dict] = []
        self.rewind()

    def rewind(self) -> None:
        """Start a new pass: the next read gathers from bucket 0 again (on every rank alike)."""
        self.current = -1  # the last bucket gathered in this pass
        self.held: dict[str, torch.Tensor] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)  # names only: iterating gathers nothing

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.entries:
            raise KeyError(name)
        if name not in self.held:
            self.advance(self.bucket_of[name])
        if name not in self.held:  # per_bucket dropped it: the collectives' order would differ between ranks
            raise RuntimeError(
                f"update.gather={self.mode}: {name!r} (unit {self.bucket_of[name]}) read after unit "
                f"{self.current}: a transport must read the tensors in plan order"
            )
        return self.held[name]

    def before(self, bucket: Bucket) -> None:
        """Gather what `bucket` sends now (a transport calls it before timing its pack, so the pack excludes the
        gather); per_tensor gathers each tensor as it is read instead."""
        if self.mode != "per_tensor":
            self.advance(self.bucket_of[bucket.names[-1]])

    def advance(self, k: int) -> None:
        """Gather the units after the last one gathered, up to `k` (all of them for all_at_once)."""
        last = len(self.units) - 1 if self.mode == "all_at_once" else k
        while self.current < last:
            self.current += 1
            self._gather(self.current, keep=self.mode == "all_at_once")

    @torch.no_grad()
    def _gather(self, k: int, *, keep: bool) -> None:
        if not keep:
            self.held = {}  # the previous unit's full tensors go before this one's arrive
        entries = [self.entries[n] for n in self.units[k]]
        params = dict.fromkeys(e.param for e in entries)
        synchronize(self.device)
        start = time.perf_counter()
        full = {p: self.gather(self.shards[p]) for p in params}
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.held.update(update_tensors(full, self.layout, entries))
        nbytes = sum(t.numel() * t.element_size() for t in full.values())
        self.seconds += elapsed
        self.gathered_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, sum(t.numel() * t.element_size() for t in self.held.values()))
        self.rows.append({"bytes": nbytes, "gather_time": elapsed})

    def drain(self) -> None:
        """Gather every bucket of this pass in order and keep none: a rank without an engine, in step with the others."""
        for k in range(self.current + 1, len(self.units)):
            self._gather(k, keep=False)
            self.current = k
        self.held = {}

    def release(self) -> None:
        """Drop what is held (the update is over)."""
        self.held = {}

    def metrics(self) -> dict[str, float]:
        """perf/update_weights_gather_* of the passes so far."""
        return {
            "perf/update_weights_gather_time": self.seconds,
            "perf/update_weights_gather_bytes": self.gathered_bytes,
            "perf/update_weights_gather_peak_bytes": self.peak_bytes,
        }


def gather_bucket(weights: Mapping, bucket: Bucket) -> None:
    """Before a transport packs `bucket`: gather it now if `weights` are shards (a plain dict: nothing to do)."""
    if isinstance(weights, ShardedWeights):
        weights.before(bucket)


def full_weights(weights: Mapping) -> Mapping:
    """The whole tensors for a check after the update (update.verify): a new pass over the shards, or `weights`."""
    if isinstance(weights, ShardedWeights):
        weights.rewind()
    return weights


class StandIns(Mapping):
    """Plain tensors shaped like `weights`' whole tensors (a DTensor's global shape), made when read: what a
    probe of the update's copy (rlsync.sync.auto's thread count) reads where the trainer holds shards."""

    def __init__(self, weights: Mapping):
        self.weights = weights

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.weights[name]
        local = getattr(t, "_local_tensor", t)
        return torch.ones(t.shape, dtype=t.dtype, device=local.device)
