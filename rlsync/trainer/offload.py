"""Trainer offload and onload (the trainer's state to host memory and back) in a few large copies.

The trainer's parameters, gradients and optimizer state are laid out once, at start-up, in a few
flat buffers ("segments": consecutive tensors of one dtype) that the tensors are views of. Offload and
onload then copy whole segments, never tensor by tensor, and the model, the optimizer and autograd
keep their tensor objects throughout (twin keeps their storage too; move re-points them with
`.data`). Order within a dtype: parameters, optimizer state, gradients.
`drop_grads` leaves the gradients out of the copies and zeroes them on onload: the trainer zeroes
them before every backward anyway, so they carry nothing across steps (a quarter of an fp32 AdamW
state).

Two ways to hold the state (`memory`, the config's trainer.offload_memory; `auto` picks per device):

- `twin` (auto on CUDA): one segment per dtype, and a persistent host twin of it, allocated and
  touched once (pinned on CUDA) and reused every step. The twin is allocated in chunks of at most
  `pin_chunk_bytes` (1 GiB by default), cut at tensor boundaries, as checkpoint-engine pins its
  host buckets (pin_memory.py: buckets of max(4 GiB, largest tensor), never splitting a tensor):
  PyTorch's caching host allocator rounds every pinned block up to a power of two and keeps it
  cached for the life of the process (CachingHostAllocator: `PowerOf2Ceil`), so one 9.5 GB twin
  pins 16 GiB, and one huge cudaHostAlloc is slow and holds the driver's lock. `empty_host_cache`
  hands freed blocks back between jobs. Offload is one asynchronous copy per chunk and
  a single synchronize; on CUDA the device storage is then resized to 0 (every view stays valid
  metadata) and the allocator's cache emptied, so the engine really gets the memory; onload
  re-allocates the same storage and copies back. Cost: host memory = the whole travelling state, all
  the time, beside the device copy. On a CPU, where the "device" is host RAM too, that is the state
  twice: Qwen3-0.6B's fp32 AdamW state is 9.5 GB, so 19 GB before the engine and activations, which
  a 24 GiB machine does not survive. There the device side is kept resident (freeing it returns
  nothing, and re-faulting fresh pages costs about 6x the copy: `free_device=True` measures that).
- `move` (auto on a CPU): segments of at most `segment_bytes` (128 MiB by default; a tensor larger
  than that is a segment of its own), moved one by one: copy the segment into a destination buffer,
  point its tensors there, release the source. Packed segments share one buffer size (the largest
  of them), so the state exists once, plus one spare buffer per segment size, plus the slack that
  sharing leaves in the smaller ones: Qwen3-0.6B in fp32 holds 0.7 GB beside its 9.5 GB state
  (spares of 120 and 594 MiB, the tied embedding being the one tensor over the cap), where twin
  holds another 9.5 GB. On a CPU the released source is the next segment's destination, so the
  spares are allocated and touched once and every step's copies hit resident pages: memcpy speed,
  as fast as twin's one copy per dtype (rlsync.bench.offload measures both). On CUDA nothing is
  kept: each offload allocates pageable host buffers and frees the device ones (empty_cache), each
  onload the reverse: host memory only while offloaded, for pageable, synchronous copies.

AdamW creates its state lazily in its first step; we create it up front, exactly as that first
step would (zeros, step 0), so the layout and the buffers exist before step 0 and the first steps
cost no more than later ones.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from rlsync.fmt import MIB
from rlsync.measure.timing import synchronize
from rlsync.update.buckets import greedy_groups

OFFLOAD_MODES = (
    "none",
    "full",
    "drop_grads",
)  # trainer.offload's choices (its rule in rlsync/config/schema.py names them)
OFFLOAD_MEMORY = ("auto", "twin", "move")  # trainer.offload_memory's choices
PIN_CHUNK_BYTES = 1024 * MIB  # a power of two: the caching host allocator rounds each chunk up to one


def fsdp_params(model: nn.Module) -> dict[int, object]:
    """id(sharded parameter) -> its FSDPParam, for a model torch's fully_shard sharded (empty otherwise)."""
    found = {}
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        for group in getattr(state, "_fsdp_param_groups", None) or ():
            for fsdp_param in group.fsdp_params:
                found[id(fsdp_param.sharded_param)] = fsdp_param
    return found


def resolve_memory(memory: str, device: torch.device) -> str:
    """twin or move: `auto` is move where the device is host memory (a CPU run), twin on CUDA."""
    if memory == "auto":
        return "move" if device.type == "cpu" else "twin"
    return memory


def plan_segments(sizes: Sequence[int], cap: int | None) -> list[list[int]]:
    """Indices of `sizes` (bytes, in order) packed into consecutive segments of at most `cap` bytes.

    A size over the cap is a segment of its own (a view cannot span two buffers); `cap=None`: one segment.
    """
    return greedy_groups(list(sizes), cap)


def plan_pin_chunks(sizes: Sequence[int], cap: int) -> list[tuple[int, int]]:
    """Byte ranges [start, end) covering a segment whose tensors take `sizes` bytes (in order): chunks
    of at most `cap` bytes, cut between tensors (a tensor over the cap is a chunk of its own: the
    update reads each tensor as one view of the host copy)."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0 bytes, got {cap}")
    ranges, start = [], 0
    for group in greedy_groups(list(sizes), cap):
        end = start + sum(sizes[i] for i in group)
        ranges.append((start, end))
        start = end
    return ranges


def empty_host_cache(device: torch.device) -> None:
    """Hand the caching host allocator's free pinned blocks back to the driver (CUDA only).

    Freed pinned memory stays cached for the process otherwise: in a sweep the next job would pin
    beside the last one's twin. `torch.accelerator.empty_host_cache` (torch >= 2.10), else the
    private `torch._C._host_emptyCache` (torch 2.5+; vLLM's gpu_worker calls it when it sleeps).
    """
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(
        torch._C, "_host_emptyCache", None
    )
    if empty is not None:
        empty()


@dataclass
class SegmentSlot:
    """Where one tensor lives in its segment."""

    tensor: torch.Tensor
    offset: int  # elements from the segment's start
    shape: torch.Size
    follow: Callable[[torch.Tensor], None] | None = None  # re-points a tensor that views this one (an FSDP2 shard)


@dataclass
class TwinChunk:
    """One pinned (CUDA) or plain host allocation of a segment's twin: bytes [start, start + len)."""

    start: int  # bytes from the segment's start
    host: torch.Tensor  # uint8

    @property
    def end(self) -> int:
        return self.start + self.host.numel()


@dataclass
class Segment:
    """Consecutive tensors of one dtype viewing one byte buffer: the unit that moves."""

    dtype: torch.dtype
    travels: bool  # copied by offload/onload (False: gradients under drop_grads)
    slots: list[SegmentSlot]
    numel: int
    capacity: int  # bytes of its buffer (>= nbytes: move mode rounds segments up to shared sizes)
    buffer: torch.Tensor | None = None  # uint8 [capacity]: where the tensors live now
    twin: list[TwinChunk] = field(default_factory=list)  # twin mode's persistent host copy, chunked

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def typed(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[: self.nbytes].view(self.dtype)  # [numel]

    def view(self, buffer: torch.Tensor, slot: SegmentSlot) -> torch.Tensor:
        return self.typed(buffer)[slot.offset : slot.offset + slot.shape.numel()].view(slot.shape)

    def slot_bytes(self) -> list[int]:
        return [slot.shape.numel() * self.dtype.itemsize for slot in self.slots]

    def twin_view(self, slot: SegmentSlot) -> torch.Tensor:
        """The tensor of `slot` in the host twin: a view of the one chunk that holds it."""
        start = slot.offset * self.dtype.itemsize
        chunk = next(c for c in self.twin if c.start <= start < c.end)
        nbytes = slot.shape.numel() * self.dtype.itemsize
        return chunk.host[start - chunk.start : start - chunk.start + nbytes].view(self.dtype).view(slot.shape)

    def point_at(self, buffer: torch.Tensor) -> None:
        """Make `buffer` the segment's home: every tensor (same object) now views it."""
        for slot in self.slots:
            slot.tensor.data = self.view(buffer, slot)
            if slot.follow is not None:
                slot.follow(slot.tensor)
        self.buffer = buffer


@dataclass
class Placement:
    """A tensor to be: its shape and dtype, and how a view of a segment takes its place."""

    shape: torch.Size
    dtype: torch.dtype
    install: Callable[[torch.Tensor], torch.Tensor]  # view -> the tensor that now lives there
    follow: Callable[[torch.Tensor], None] | None = None  # after each move: re-point what views the tensor

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @staticmethod
    def move(t: torch.Tensor, follow: Callable[[torch.Tensor], None] | None = None) -> Placement:
        """An existing tensor: copied in, then re-pointed (same object; its old storage is freed now)."""

        def install(view: torch.Tensor) -> torch.Tensor:
            view.copy_(t)
            t.data = view
            if follow is not None:
                follow(t)
            return t

        return Placement(t.shape, t.dtype, install, follow)

    @staticmethod
    def shard(fsdp_param) -> Placement:
        """An FSDP2 parameter's shard (torch fully_shard's FSDPParam): its padded flat storage moves (what the
        all-gather reads), and the DTensor's local tensor, a narrow view of it, follows (what AdamW updates)."""
        if fsdp_param.fsdp_placement.dim != 0:
            raise ValueError("offload of FSDP2 shards: parameters sharded on dim 0 only")
        local = fsdp_param.sharded_param._local_tensor
        padded, length = fsdp_param.padded_sharded_param_size, local.size(0) if local.numel() else 0

        def follow(flat: torch.Tensor) -> None:
            local.data = flat.view(padded).narrow(0, 0, length)

        return Placement.move(fsdp_param._sharded_param_data, follow)

    @staticmethod
    def create(like: torch.Tensor, assign: Callable, where) -> Placement:
        """A missing tensor (a gradient, an optimizer moment): zeros, made in place, as `assign(where, zeros)`."""

        def install(view: torch.Tensor) -> torch.Tensor:
            assign(where, view.zero_())
            return view

        return Placement(like.shape, like.dtype, install)

    @staticmethod
    def create_shard(like, assign: Callable, where) -> Placement:
        """A missing DTensor (an FSDP2 shard's gradient or moment): zeros made in place as its local tensor,
        wrapped with `like`'s mesh, placements and global shape. Making it elsewhere and copying it in would
        leave its first copy in the C heap: 1.8 GB per rank for Qwen3-0.6B in bf16 over 2 ranks."""
        from torch.distributed.tensor import DTensor

        local = like._local_tensor

        def install(view: torch.Tensor) -> torch.Tensor:
            made = DTensor.from_local(
                view.zero_(), like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
            )
            assign(where, made)
            return made._local_tensor  # what moves: the DTensor keeps this object, re-pointed with .data

        return Placement(local.shape, local.dtype, install)


def adam_state_keys(optimizer: torch.optim.Optimizer, group: dict) -> tuple[str, ...]:
    """The per-parameter tensors Adam/AdamW keep (the keys of their lazy first-step initialisation)."""
    if not isinstance(optimizer, torch.optim.Adam):
        raise TypeError(
            f"offload lays out the optimizer state up front and knows Adam/AdamW, not {type(optimizer).__name__}"
        )
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")


def adam_step(group: dict, p: torch.Tensor) -> torch.Tensor:
    """Adam's step counter as its first step creates it: a CPU scalar unless capturable or fused."""
    if group["capturable"] or group["fused"]:
        return torch.zeros((), dtype=torch.float32, device=p.device)
    return torch.tensor(0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32)


class Offloader:
    """Moves the trainer's state to host memory (`offload`) and back (`onload`); see the module doc."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        mode: str,
        device: torch.device,
        memory: str = "auto",
        segment_bytes: int = 128 * MIB,
        free_device: bool | None = None,
        pin_chunk_bytes: int = PIN_CHUNK_BYTES,
    ):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.mode = (
            mode  # trainer.offload* values are checked once, before any model is built (rlsync/config/schema.py)
        )
        self.memory = resolve_memory(memory, device)
        self.segment_bytes, self.pin_chunk_bytes = segment_bytes, pin_chunk_bytes
        # what does not travel (twin: the whole device side; move: dropped gradients) is freed while offloaded
        self.free_device = device.type == "cuda" if free_device is None else free_device
        self.pinned = device.type == "cuda" and self.memory == "twin"
        self.host = torch.device("cpu")
        self.reuse = self.memory == "move" and device.type == "cpu"  # a released source is the next destination
        self.segments: list[Segment] = []
        self.slots: dict[int, tuple[Segment, SegmentSlot]] = {}  # id(tensor) -> where it lives
        self.spares: dict[int, list[torch.Tensor]] = defaultdict(list)  # capacity -> free uint8 buffers
        self.offloaded = False
        self.info: dict = {"mode": mode}
        if mode == "none":
            return
        start = time.perf_counter()
        self._lay_out()
        synchronize(device)
        laid_out = time.perf_counter()
        self._first_touch()
        touched = time.perf_counter()
        spare_bytes = sum(b.numel() for bufs in self.spares.values() for b in bufs)
        twin_bytes = sum(c.host.numel() for s in self.segments for c in s.twin)
        touched_bytes = spare_bytes + twin_bytes
        self.info.update(
            {
                "memory": self.memory,
                "free_device": self.free_device,
                "pinned": self.pinned,
                "dtypes": list(dict.fromkeys(str(s.dtype).removeprefix("torch.") for s in self.segments)),
                "segments": len(self.segments),
                "largest_segment_bytes": max(s.nbytes for s in self.segments),
                "segment_cap_bytes": self.segment_bytes if self.memory == "move" else None,
                "twin_chunks": sum(len(s.twin) for s in self.segments),  # host allocations (pinned on CUDA)
                "largest_twin_chunk_bytes": max((c.host.numel() for s in self.segments for c in s.twin), default=0),
                "device_bytes": self.state_bytes,
                "host_bytes": sum(s.nbytes for s in self.segments if s.travels),  # on the host while offloaded
                # memory beyond the state itself: the host twins, or move's spares and segment slack
                "extra_bytes": twin_bytes
                if self.memory == "twin"
                else spare_bytes + sum(s.capacity - s.nbytes for s in self.segments),
                "layout_time": laid_out - start,  # segments, tensors moved in, state created
                "host_first_touch_time": touched - laid_out,  # allocate + touch (pin) the twins or spares
                "host_first_touch_gbps": touched_bytes / max(touched - laid_out, 1e-9) / 1e9,
            }
        )

    @torch.no_grad()
    def _lay_out(self) -> None:
        """Give every tensor its place in a segment of its dtype, gradients last."""
        travelling, grads = [], []
        shards = fsdp_params(self.model)  # trainer.parallel=fsdp2: each rank lays out its own shards
        travelling += [
            Placement.shard(shards[id(p)]) if id(p) in shards else Placement.move(p)
            for p in dict.fromkeys(self.model.parameters())  # tied weights once
        ]
        for group in self.optimizer.param_groups if self.optimizer is not None else []:
            keys = adam_state_keys(self.optimizer, group)
            for p in (p for p in group["params"] if p.requires_grad):  # Adam skips the frozen ones
                state = self.optimizer.state[p]
                state.setdefault("step", adam_step(group, p))
                if id(p) in shards:  # a DTensor's state and gradient are DTensors whose local shards move
                    travelling += [
                        Placement.move(state[k]._local_tensor)
                        if k in state
                        else Placement.create_shard(p, state.__setitem__, k)
                        for k in keys
                    ]
                    grads.append(
                        Placement.move(p.grad._local_tensor)
                        if p.grad is not None
                        else Placement.create_shard(p, partial(setattr, p), "grad")
                    )
                    continue
                travelling += [
                    Placement.move(state[k]) if k in state else Placement.create(p, state.__setitem__, k) for k in keys
                ]
                grads.append(
                    Placement.move(p.grad) if p.grad is not None else Placement.create(p, partial(setattr, p), "grad")
                )
        if self.mode == "full":  # grads travel with the rest: one run of segments per dtype
            travelling, grads = travelling + grads, []
        cap = self.segment_bytes if self.memory == "move" else None
        for dtype in dict.fromkeys(pl.dtype for pl in travelling + grads):
            for travels, placements in ((True, travelling), (False, grads)):
                own = [pl for pl in placements if pl.dtype == dtype]
                plan = plan_segments([pl.nbytes for pl in own], cap)
                shared = None  # move mode: travelling segments of one size share a spare, so the packed ones
                if cap is not None and travels:  # get the largest one's size (one over the cap is one tensor)
                    packed = [sum(own[i].nbytes for i in indices) for indices in plan]
                    shared = max((b for b in packed if b <= cap), default=None)
                for indices in plan:
                    self._add_segment(dtype, travels, [own[i] for i in indices], shared)

    def _add_segment(self, dtype: torch.dtype, travels: bool, placements: list[Placement], shared: int | None) -> None:
        numel = sum(pl.numel for pl in placements)
        nbytes = numel * dtype.itemsize
        capacity = shared if shared is not None and nbytes <= shared else nbytes
        segment = Segment(
            dtype, travels, [], numel, capacity, buffer=torch.empty(capacity, dtype=torch.uint8, device=self.device)
        )
        segment.buffer[nbytes:].zero_()  # slack touched now, not in some later step's copy
        offset = 0
        for pl in placements:
            tensor = pl.install(segment.typed(segment.buffer)[offset : offset + pl.numel].view(pl.shape))
            slot = SegmentSlot(tensor, offset, pl.shape, pl.follow)
            segment.slots.append(slot)
            self.slots[id(slot.tensor)] = (segment, slot)
            offset += pl.numel
        self.segments.append(segment)

    def _first_touch(self) -> None:
        """Allocate and touch, once, what every step's copies write into: twins, or move's spares."""
        if self.memory == "twin":
            for s in self.segments:
                if s.travels:
                    for start, end in plan_pin_chunks(s.slot_bytes(), self.pin_chunk_bytes):
                        s.twin.append(
                            TwinChunk(start, torch.empty(end - start, dtype=torch.uint8, pin_memory=self.pinned))
                        )
                        s.twin[-1].host.zero_()
        elif self.reuse:
            for capacity in dict.fromkeys(s.capacity for s in self.segments if s.travels):
                self.spares[capacity].append(torch.zeros(capacity, dtype=torch.uint8))

    def _take(self, capacity: int, device: torch.device) -> torch.Tensor:
        """A destination buffer: a spare of that size (CPU), else a new one."""
        if self.spares[capacity]:
            return self.spares[capacity].pop()
        return torch.empty(capacity, dtype=torch.uint8, device=device)

    def _release(self, buffer: torch.Tensor) -> None:
        """A source that was just copied: the next destination (CPU), else freed once unreferenced."""
        if self.reuse:
            self.spares[buffer.numel()].append(buffer)

    @property
    def state_bytes(self) -> int:
        """Bytes of the laid-out state (parameters, optimizer state and gradients)."""
        return sum(s.nbytes for s in self.segments)

    @property
    def travelling_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments if s.travels)

    @torch.no_grad()
    def offload(self) -> int:
        """Move the state to the host and free the device side. Returns bytes moved."""
        if self.mode == "none" or self.offloaded:
            return 0
        if self.memory == "twin":
            for s in self.segments:
                for c in s.twin if s.travels else []:
                    c.host.copy_(s.buffer[c.start : c.end], non_blocking=self.pinned)
            synchronize(self.device)
        else:
            for s in (s for s in self.segments if s.travels):
                destination = self._take(s.capacity, self.host)
                destination[: s.nbytes].copy_(s.buffer[: s.nbytes])
                source = s.buffer
                s.point_at(destination)
                self._release(source)
                del source  # on CUDA the last reference: empty_cache below returns it
        for s in self.segments:
            if self.free_device and (self.memory == "twin" or not s.travels):
                s.buffer.untyped_storage().resize_(0)  # every view of it now holds no memory
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.empty_cache()
        self.offloaded = True
        return self.travelling_bytes

    @torch.no_grad()
    def onload(self) -> int:
        """Bring the state back to the device; zero dropped gradients. Returns bytes moved."""
        if self.mode == "none" or not self.offloaded:
            return 0
        for s in self.segments:
            if self.free_device and (self.memory == "twin" or not s.travels):
                s.buffer.untyped_storage().resize_(s.capacity)
            if not s.travels:
                s.typed(s.buffer).zero_()  # dropped gradients: the next backward rebuilds them
            elif self.memory == "twin":
                for c in s.twin:
                    s.buffer[c.start : c.end].copy_(c.host, non_blocking=self.pinned)
            else:
                destination = self._take(s.capacity, self.device)
                destination[: s.nbytes].copy_(s.buffer[: s.nbytes])
                source = s.buffer
                s.point_at(destination)
                self._release(source)
                del source  # on CUDA: the pageable host buffer is freed here
        synchronize(self.device)
        self.offloaded = False
        return self.travelling_bytes

    def host_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The host copies of `weights` (valid while offloaded): what `update.source=host` sends from."""
        if not self.offloaded:
            raise RuntimeError(
                "update.source=host needs the trainer offloaded first (trainer.offload=full or drop_grads)"
            )
        out = {}
        for name, t in weights.items():
            segment, slot = self.slots[id(t)]
            out[name] = segment.twin_view(slot) if segment.twin else segment.view(segment.buffer, slot)
        return out

    def close(self) -> None:
        """Drop the host twins and hand their pinned blocks back (a sweep's next job pins its own)."""
        for s in self.segments:
            s.twin = []
        empty_host_cache(self.device)


def device_memory_gb(device: torch.device) -> float | None:
    """Device memory this process holds from the driver (tensors + allocator cache), in GB; None off CUDA.

    Reserved, not allocated: it is what an engine in another process cannot have."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_reserved(device) / 1e9


def link_metrics(m: dict, floors) -> dict[str, float]:
    """perf/{sleep,wake_up}_{gbps,floor_time,efficiency} (the offload's and the onload's metric keys) from their
    _time and _bytes in `m`.

    The floor is the payload over the one-way copy bandwidth measured in the same run (`floors.to_host`,
    `floors.to_device`: pinned PCIe on CUDA, memcpy on a CPU); efficiency = floor / time (1 = at the floor).
    """
    out = {}
    for phase, bandwidth in (("sleep", floors.to_host), ("wake_up", floors.to_device)):
        nbytes, seconds = m.get(f"perf/{phase}_bytes", 0), m.get(f"perf/{phase}_time")
        if nbytes and seconds:
            floor = nbytes / bandwidth
            out.update(
                {
                    f"perf/{phase}_gbps": nbytes / seconds / 1e9,
                    f"perf/{phase}_limit_time": floor,
                    f"perf/{phase}_efficiency": floor / seconds,
                }
            )
    return out
