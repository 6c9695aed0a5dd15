"""The update's tensors from a sharded trainer (trainer.parallel=fsdp2): full tensors gathered from the shards.

FSDP2 holds each parameter as a DTensor, one shard per rank; the engine needs whole tensors. verl's and
TRL's colocated updates gather each parameter with `DTensor.full_tensor()` (one all-gather each) shortly
before it is sent. Here `gather_shards` gathers a unit's shards as FSDP2's own forward does (its copy-in,
one all-gather, copy-out): this rank's shards packed into one buffer, all-gathered in calls of the size the
run's gather floor found fastest (rlsync.measure.floors.GatherFloor), each full tensor copied out of the
result. Per-parameter calls pay a call per tensor, and a large tensor in one call runs where the
collective is slow (gloo: 0.48 GB/s in 64 MiB to 1 GiB calls, 1.1 GB/s in 1 to 16 MiB ones). When:

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

import bisect
import math
import time
from collections.abc import Callable, Iterator, Mapping

import torch

from rlsync.measure.timing import synchronize
from rlsync.model.architecture import Entry, update_tensors
from rlsync.update.buckets import Bucket

GATHER_MODES = ("per_bucket", "per_tensor", "all_at_once")  # update.gather's choices


class GatherBuffers:
    """The gather's buffers, kept from one unit (and one update) to the next: this rank's packed shards, one
    call's output and, unless the full tensors must outlive the next unit (all_at_once), the full tensors.
    On a CPU every fresh allocation of the update's size is first-touched again (page faults: measured on
    Qwen3-0.6B over 2 ranks, the gather at 0.46 of its floor with fresh buffers); a run on CUDA drops them
    after each update (`clear`), so the engine gets that memory back for the rollout."""

    def __init__(self, *, reuse_full: bool = True):
        self.reuse_full = reuse_full
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if role == "full" and not self.reuse_full:
            return torch.empty(numel, dtype=dtype, device=device)
        key = (role, dtype, device)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            self.buffers.pop(key, None)  # the smaller one goes first
            buffer = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]

    def clear(self) -> None:
        self.buffers = {}


def copy_out(padded: list, starts: list[int], sizes: list[int], chunk: torch.Tensor, lo: int, hi: int) -> None:
    """One call's output [ranks, hi - lo] into the padded full tensors ([ranks, padded size]) it covers: from
    the one holding element `lo` (`starts` ascending) to the first that starts at or after `hi`."""
    k = bisect.bisect_right(starts, lo) - 1
    while k < len(starts) and starts[k] < hi:
        start, size = starts[k], sizes[k]
        a, b = max(lo, start), min(hi, start + size)
        if a < b:
            padded[k][:, a - start : b - start].copy_(chunk[:, a - lo : b - lo])
        k += 1


def gather_shards(shards: list, *, call_bytes: int, buffers: GatherBuffers | None = None) -> list[torch.Tensor]:
    """The full tensors of `shards` (DTensors sharded on dim 0 over one mesh dimension, as fully_shard makes
    them; anything else is gathered with `full_tensor()`), in all-gathers of at most `call_bytes` gathered.

    Each rank packs its shards, each padded to ceil(rows / ranks) rows as FSDP2 pads them, into one buffer
    per dtype; every rank's buffer has the same layout, so rank r's part of a call's output lands in rank
    r's rows of each full tensor. With `buffers` the full tensors are views of a reused buffer: valid until
    the next call."""
    buffers = buffers or GatherBuffers(reuse_full=False)
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    full: list[torch.Tensor | None] = [None] * len(shards)
    packable: dict[tuple, list[int]] = {}  # (dtype, mesh) -> indices
    for i, t in enumerate(shards):
        if t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),) and t.dim() > 0:
            packable.setdefault((t.dtype, t.device_mesh), []).append(i)
        else:
            full[i] = t.full_tensor()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name in torch >= 2.13
    for (dtype, mesh), indices in packable.items():
        group, world = mesh.get_group(), mesh.size()
        local0 = shards[indices[0]]._local_tensor
        rows = [-(-shards[i].shape[0] // world) for i in indices]  # each rank's padded rows
        per_row = [math.prod(shards[i].shape[1:]) for i in indices]
        sizes = [r * w for r, w in zip(rows, per_row)]  # each tensor's padded elements per rank
        device = local0.device
        packed = buffers.get("packed", sum(sizes), dtype, device)
        whole = buffers.get("full", world * sum(sizes), dtype, device)
        padded, starts = [], []  # each full tensor, padded: [world, padded elements per rank]; its offset
        offset = 0
        for i, size in zip(indices, sizes):
            local = shards[i]._local_tensor.reshape(-1)
            packed[offset : offset + local.numel()].copy_(local)  # a short last shard leaves padding unwritten
            padded.append(whole[world * offset : world * (offset + size)].view(world, size))
            starts.append(offset)
            offset += size
        step = max(1, call_bytes // dtype.itemsize // world)  # elements each rank sends per call
        width = min(step, packed.numel())
        outs = [buffers.get(f"out{j}", world * width, dtype, device).view(world, width) for j in range(2)]

        # Two output buffers: call j+1 runs in the collective's own threads (gloo) or stream (NCCL) while this
        # thread copies call j's result out (Qwen3-0.6B's shapes over 2 gloo ranks: 1.0 s -> 0.76 s)
        pending = None
        for j, lo in enumerate(range(0, packed.numel(), step)):
            hi = min(lo + step, packed.numel())
            chunk = outs[j % 2] if hi - lo == width else torch.empty(world, hi - lo, dtype=dtype, device=device)
            work = gather(chunk.view(-1), packed[lo:hi], group=group, async_op=True)
            if pending is not None:
                pending[0].wait()
                copy_out(padded, starts, sizes, *pending[1:])
            pending = (work, chunk, lo, hi)
        if pending is not None:
            pending[0].wait()
            copy_out(padded, starts, sizes, *pending[1:])
        for k, i in enumerate(indices):
            t = shards[i]
            full[i] = padded[k].view(world * rows[k], *t.shape[1:])[: t.shape[0]]
    return full


class ShardedWeights(Mapping):
    """The update's tensors by name, gathered from `shards` (parameter name -> DTensor) bucket by bucket.

    `gather(shards)` makes a list of shards whole (`gather_shards`); `layout`/`plan` turn the gathered
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
        gather: Callable[[list], list[torch.Tensor]],
        mode: str,
        device: torch.device,
        buffers: GatherBuffers | None = None,
    ):
        if mode not in GATHER_MODES:
            raise ValueError(f"update.gather={mode!r}: expected one of {', '.join(GATHER_MODES)}")
        self.shards, self.layout, self.gather, self.mode, self.device = shards, layout, gather, mode, device
        self.buffers = buffers  # what `gather` gathers into, kept between updates off CUDA
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
        full = dict(zip(params, self.gather([self.shards[p] for p in params])))
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
        self.release()

    def release(self) -> None:
        """Drop what is held (the update is over); on CUDA the gather's buffers too, for the engine's rollout."""
        self.held = {}
        if self.buffers is not None and self.device.type == "cuda":
            self.buffers.clear()

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
    probe of the update's copy (rlsync.update.auto's thread count) reads where the trainer holds shards."""

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
