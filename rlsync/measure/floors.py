"""The physical floor, measured in the same run on the same machine.

A copy cannot beat the memory (or link) bandwidth. We time the copy the real transfer does, over
the path it takes, and report the real transfer as a ratio to it:

- same device:  bandwidth = (bytes read + bytes written) / time, so a copy of N bytes moves 2N and
  an fp32 -> bf16 copy of n elements moves 4n + 2n;
- across devices (host <-> GPU): bandwidth = bytes sent / time, one direction.

On a CPU-only machine the "device" is host memory and both formulas measure memcpy.

Where the engine's receiving side must copy the update's bytes again (vLLM's IPC consumer clones every
tensor, then loads it: `Engine.receiver_copies`), the floor adds those copies, each a same-dtype copy of
the update's bytes in the engine's dtype at the bandwidth of such a copy (`receiver_floor_bytes`).

A floor must be a floor: no update may beat it beyond noise. So each probe is the fastest of the
ways this machine has to do that copy (`copy_candidates`: one CPU thread and all of them, each
method of `COPY_METHODS`) on the dtypes the update really reads and writes (a converting copy
writes fewer bytes per byte read than memcpy, and runs at another speed), timed side by side in
one loop (`best_copy`) and recorded with the way that won (summary.json's `limits.update_probe`).
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from rlsync.fmt import fmt_bytes, plural
from rlsync.measure.devices import copy_into
from rlsync.measure.threads import cpu_threads, thread_candidates
from rlsync.measure.timing import synchronize

PROBE_MIN_BYTES, PROBE_CAP_BYTES = 1 << 20, 1 << 30  # each buffer's range: above the cap the bandwidth is the same
MAX_ROUNDS = 50
CLOCK = time.perf_counter  # best_copy's clock (a test's fake machine replaces it)


def copy_whole(dst: torch.Tensor, src: torch.Tensor) -> None:
    copy_into(dst, src)  # as the update copies: a host source is cast on the device


# The ways of copying a probe tries, by name; a method worth trying goes here, and every probe takes
# it in turn with the others (chunked copies and `src.to(dtype)` were tried and never faster:
# experiments/transports/README.md).
COPY_METHODS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {"copy_": copy_whole}


class Way(NamedTuple):
    """One way to copy: a method of COPY_METHODS on `threads` CPU threads (0: not a CPU copy, threads n/a)."""

    method: str
    threads: int


class BestCopy(NamedTuple):
    """The fastest copy `best_copy` timed, and what it was."""

    seconds: float
    way: Way
    src_dtype: torch.dtype
    dst_dtype: torch.dtype
    src_device: torch.device
    dst_device: torch.device

    def describe(self) -> str:
        """e.g. "float32->bfloat16, 2 threads, copy_" or "float32 cpu->bfloat16 cuda:0, copy_"."""
        s, d = str(self.src_dtype).removeprefix("torch."), str(self.dst_dtype).removeprefix("torch.")
        what = f"{s}->{d}" if self.src_device == self.dst_device else f"{s} {self.src_device}->{d} {self.dst_device}"
        threads = f", {self.way.threads} thread{'s' if self.way.threads > 1 else ''}" if self.way.threads else ""
        return f"{what}{threads}, {self.way.method}"


def llc_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The CPU's last-level cache in bytes (Linux sysfs: the highest cache level's size), None where unknown."""
    best = (0, None)
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            with open(os.path.join(root, entry, "level")) as f:
                level = int(f.read())
            with open(os.path.join(root, entry, "size")) as f:
                size = f.read().strip()
            nbytes = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError, IndexError):
            continue
        if level >= best[0]:
            best = (level, nbytes)
    return best[1]


def cache_resident_elements(
    strategy: str, tensor_numels: Sequence[int], bucket_numels: Sequence[int], itemsize: int, llc: int | None
) -> int:
    """Elements of the update's units (its tensors for per_tensor, its buckets otherwise) whose staging
    copy fits in half the last-level cache: a copy that reads such a unit right after another wrote it
    reads the cache, not memory (rlsync.plan.cost.moved_bytes). 0 without an LLC figure."""
    if not llc:
        return 0
    units = tensor_numels if strategy == "per_tensor" else bucket_numels
    return sum(n for n in units if n * itemsize <= llc // 2)


def copy_candidates(dst: torch.Tensor, src: torch.Tensor) -> list[Way]:
    """The ways `best_copy` tries. A CPU copy: one thread (memcpy speed on an idle core, and no barrier
    to wait at when another core is busy), torch's thread count and every core the process may use
    (a converting copy, or a machine whose one core cannot fill the memory bus, goes faster on more),
    each with every method of COPY_METHODS. Anything else: the copy engine or kernels run it, one `copy_`."""
    if src.device.type != "cpu" or dst.device.type != "cpu":
        return [Way("copy_", 0)]
    return [Way(method, n) for n in thread_candidates() for method in COPY_METHODS]


def best_copy(
    dst: torch.Tensor,
    src: torch.Tensor,
    rounds: int,
    budget_s: float = 0.5,
    *,
    warm_up: bool = True,
    candidates: Sequence[Way] | None = None,
    clock: Callable[[], float] | None = None,
) -> BestCopy:
    """The fastest `dst <- src` copy over `candidates` (default `copy_candidates`): at least `rounds`
    rounds, each timing every candidate once, repeated while they took less than `budget_s` in all.

    Candidates take turns, so a drift of the machine's load falls on all of them alike. The first
    copies after an allocation can be 100x slow (page faults, in a VM also the host's), so one or
    two tries are not enough to see the bandwidth: a fresh pair of buffers is copied once first
    (`warm_up`); buffers touched already (a held probe's) need not be.
    """
    ways, clock = list(candidates or copy_candidates(dst, src)), clock or CLOCK
    devices = {dst.device, src.device}
    if warm_up:
        dst.copy_(src)  # first touch and warm-up
    best = dict.fromkeys(ways, math.inf)
    spent, done = 0.0, 0
    while done < rounds or (spent < budget_s and done < MAX_ROUNDS):
        done += 1
        for way in ways:
            copy = COPY_METHODS[way.method]
            with cpu_threads(way.threads, src.device):
                for d in devices:
                    synchronize(d)
                start = clock()
                copy(dst, src)
                for d in devices:
                    synchronize(d)
                elapsed = clock() - start
            best[way], spent = min(best[way], elapsed), spent + elapsed
    winner = min(ways, key=best.__getitem__)  # the first of equals: candidates are listed simplest first
    return BestCopy(best[winner], winner, src.dtype, dst.dtype, src.device, dst.device)


def best_copy_seconds(
    dst: torch.Tensor, src: torch.Tensor, repeats: int, budget_s: float = 0.5, *, warm_up: bool = True
) -> float:
    """Seconds of `best_copy` (the offload's link probe, rlsync.bench.offload)."""
    return best_copy(dst, src, repeats, budget_s, warm_up=warm_up).seconds


def moved_bytes(dst: torch.Tensor, src: torch.Tensor) -> int:
    """Bytes a copy moves, as its bandwidth counts them: read + written in one memory, sent across devices
    (the source's: a host -> GPU copy sends the source dtype and casts on the GPU, rlsync.measure.devices.copy_into)."""
    return src.nbytes + dst.nbytes if src.device == dst.device else src.nbytes


def probe_buffers(
    nbytes: int, *, src: torch.device, dst: torch.device, dtypes: tuple[torch.dtype, torch.dtype], pin: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A source (filled) and a destination of as many elements as `nbytes` of the destination dtype,
    each buffer within [PROBE_MIN_BYTES, PROBE_CAP_BYTES]; `pin`: the host side pinned."""
    src_dtype, dst_dtype = dtypes
    small, large = sorted((src_dtype.itemsize, dst_dtype.itemsize))
    n = max(PROBE_MIN_BYTES // small, min(nbytes // dst_dtype.itemsize, PROBE_CAP_BYTES // large))
    a = torch.empty(n, dtype=src_dtype, device=src, pin_memory=pin and src.type == "cpu")
    a.fill_(1)
    b = torch.empty(n, dtype=dst_dtype, device=dst, pin_memory=pin and dst.type == "cpu")
    return a, b


class Bandwidth(NamedTuple):
    """A probe's result: bytes per second (counted as `moved_bytes`), and how the fastest copy went."""

    per_second: float
    how: str


BYTES = (torch.uint8, torch.uint8)  # a same-dtype probe: memcpy


def copy_bandwidth(
    nbytes: int,
    *,
    src: torch.device,
    dst: torch.device,
    repeats: int = 3,
    dtypes: tuple[torch.dtype, torch.dtype] = BYTES,
) -> Bandwidth:
    """The best bandwidth over `copy_candidates` of a copy of about `nbytes` (of the destination,
    capped) from `src` to `dst`, reading dtypes[0] and writing dtypes[1]."""
    pin = src.type != dst.type  # host <-> GPU: from or to pinned memory, as the real copies are
    a, b = probe_buffers(nbytes, src=src, dst=dst, dtypes=dtypes, pin=pin)
    best = best_copy(b, a, repeats)
    moved = moved_bytes(b, a)
    del a, b
    if "cuda" in (src.type, dst.type):  # probed between steps: leave no device memory cached for the engine
        torch.cuda.empty_cache()
    return Bandwidth(moved / best.seconds, best.describe())


PROBES = ("every_step", "start")  # run.limit_probe: when the runner measures the floors


def crosses_host_link(source: str, device_type: str) -> bool:
    """Whether the update's bytes cross the host->device link: from the offloaded host copy to a GPU."""
    return source == "host" and device_type == "cuda"


def update_floor_bytes(read_bytes: int, written_bytes: int, *, source: str, device_type: str) -> int:
    """The bytes the update's floor counts on its path.

    Same memory (a device source, or any CPU run): the copy reads the trainer's bytes and writes the
    engine's. Host source on a GPU: the link carries the host copy's own bytes, in the trainer's dtype
    (fp32: twice the engine's bf16). Every transport copies from the host views with non_blocking=True,
    and PyTorch then sends the source dtype over PCIe and converts on the device (Copy.cu,
    copy_kernel_cuda: "If non_blocking is true - type conversions are performed on the GPU"); a
    blocking copy would convert on the CPU into pageable memory instead, and stage it.
    """
    if crosses_host_link(source, device_type):
        return read_bytes
    return read_bytes + written_bytes


def receiver_floor_bytes(written_bytes: int, copies: int) -> int:
    """The bytes `copies` copies of the update's engine-dtype bytes move on the engine's side (read + write
    each): what `Engine.receiver_copies` adds to the floor."""
    return 2 * copies * written_bytes


class Floors:
    """Bandwidths measured in the run: the floor every phase is reported against.

    - `update_copy`: the update's own copy, the trainer's dtype into the engine's (`dtypes`), on its
      path (device memory, or pinned host -> GPU for `source=host` on a GPU), in bytes per second
      counted as `update_floor_bytes` counts them; `update_probe` says how the fastest copy went;
    - `device_copy`: a same-dtype copy within the device's memory (read + write);
    - `engine_copy` (with `receiver_copies`, else None): a copy of the engine's dtype into itself on the
      device at the update's size, the bandwidth of the engine's own copies (read + write);
    - `to_host`, `to_device`: a same-dtype copy each way between host and device (payload; on a CPU,
      half the memcpy bandwidth at the offloaded state's size).

    `measure()` probes again: on a shared machine the bandwidth drifts with the load, and a floor
    measured in a quiet moment makes a later, loaded step look slow (or one measured under load
    makes it look faster than the floor). The runner re-measures before each step (run.limit_probe).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        update_bytes: int,
        state_bytes: int,
        read_bytes: int | None = None,
        source: str = "device",
        dtypes: tuple[torch.dtype, torch.dtype] = BYTES,
        receiver_copies: Sequence[str] = (),
    ):
        self.device, self.update_bytes, self.state_bytes = device, update_bytes, state_bytes
        # the engine's own copies of each byte, by name (Engine.receiver_copies)
        self.receiver_copies = tuple(receiver_copies)
        self.read_bytes, self.source = read_bytes, source  # the update's: the trainer's bytes, and where they are read
        self.dtypes = dtypes  # the update's: (trainer, engine)
        self.update_probe_how = ""
        self.measure()

    def measure(self) -> None:
        device, update_bytes, state_bytes = self.device, self.update_bytes, self.state_bytes
        host = torch.device("cpu")
        src = host if crosses_host_link(self.source, device.type) else device
        update = copy_bandwidth(update_bytes, src=src, dst=device, dtypes=self.dtypes)
        self.update_copy, self.update_probe_how = update
        self.engine_copy = None
        if self.receiver_copies:  # the engine's dtype into itself: the update's probe where that is the same copy
            same = src == device and self.dtypes[0] == self.dtypes[1]
            engine = (self.dtypes[1], self.dtypes[1])
            self.engine_copy = (
                update.per_second
                if same
                else copy_bandwidth(update_bytes, src=device, dst=device, dtypes=engine).per_second
            )
        if device.type == "cuda":
            self.device_copy = copy_bandwidth(update_bytes, src=device, dst=device).per_second  # read + write
            self.to_host = copy_bandwidth(state_bytes, src=device, dst=host).per_second  # payload, one direction
            self.to_device = copy_bandwidth(state_bytes, src=host, dst=device).per_second
        else:  # host memory both sides: a copy of N payload bytes reads N and writes N
            # the state's size when it differs: small copies run at cache (or thread wake-up) speed
            same = self.dtypes[0] == self.dtypes[1] and min(state_bytes, PROBE_CAP_BYTES) == min(
                update_bytes, PROBE_CAP_BYTES
            )
            self.device_copy = (
                update.per_second if same else copy_bandwidth(state_bytes, src=device, dst=device).per_second
            )
            self.to_host = self.to_device = self.device_copy / 2

    def update_time(self, read_bytes: int, written_bytes: int) -> float:
        """Floor of a weight update: `update_floor_bytes` on the update's path over the bandwidth of
        its own copy there (`update_copy`), plus the engine's own copies (`receiver_floor_bytes` over `engine_copy`)."""
        seconds = (
            update_floor_bytes(read_bytes, written_bytes, source=self.source, device_type=self.device.type)
            / self.update_copy
        )
        if self.receiver_copies:
            seconds += receiver_floor_bytes(written_bytes, len(self.receiver_copies)) / self.engine_copy
        return seconds

    @property
    def update_floor_time(self) -> float:
        """The update's floor (`update_time` of its read and written bytes) at the bandwidth last measured."""
        return self.update_time(self.update_bytes if self.read_bytes is None else self.read_bytes, self.update_bytes)

    def update_probe(self) -> CopyProbe:
        """The update's floor re-timed on demand, beside each repeat of a benchmark (CopyProbe)."""
        return CopyProbe(
            self.device,
            update_bytes=self.update_bytes,
            read_bytes=self.read_bytes,
            source=self.source,
            dtypes=self.dtypes,
            receiver_copies=len(self.receiver_copies),
        )

    def as_dict(self) -> dict[str, float | str | list[str]]:
        out = {
            "update_copy_gbps": self.update_copy / 1e9,
            "update_probe": self.update_probe_how,
            "device_copy_gbps": self.device_copy / 1e9,
            "to_host_gbps": self.to_host / 1e9,
            "to_device_gbps": self.to_device / 1e9,
        }
        if self.receiver_copies:
            out.update(receiver_copies=list(self.receiver_copies), engine_copy_gbps=self.engine_copy / 1e9)
        return out


class CopyProbe:
    """The copy the update's floor is made of, held and re-timed right before every repeat.

    On a shared machine the memory bandwidth drifts with the neighbours' load, so each repeat is
    compared with a copy timed next to it: the ratio then speaks about the update, not about the load. The same probe as `Floors`
    (the update's dtypes on its path, the fastest of `copy_candidates`, bytes counted as
    `update_floor_bytes` counts them); buffers allocated and touched once, each probe the best of
    `tries` rounds. `wins` counts which way was fastest, per probe (`describe()`).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        update_bytes: int,
        read_bytes: int | None,
        source: str,
        dtypes: tuple[torch.dtype, torch.dtype] = BYTES,
        receiver_copies: int = 0,
    ):
        self.device = device
        host_link = crosses_host_link(source, device.type)
        self.src, self.dst = probe_buffers(
            update_bytes, src=torch.device("cpu") if host_link else device, dst=device, dtypes=dtypes, pin=host_link
        )
        self.dst.copy_(self.src)
        self.moved = moved_bytes(self.dst, self.src)  # bytes per copy, counted as the floor's
        read_bytes = update_bytes if read_bytes is None else read_bytes
        self.floor_bytes = update_floor_bytes(read_bytes, update_bytes, source=source, device_type=device.type)
        # the engine's own copies (Floors.engine_copy): its dtype into itself, re-timed beside the update's copy
        self.receiver_bytes = receiver_floor_bytes(update_bytes, receiver_copies)
        self.engine_pair = None
        if receiver_copies:
            self.engine_pair = probe_buffers(update_bytes, src=device, dst=device, dtypes=(dtypes[1], dtypes[1]))
            self.engine_pair[1].copy_(self.engine_pair[0])
        self.wins: Counter[str] = Counter()
        self.last: BestCopy | None = None

    def floor_time(self, tries: int = 3) -> float:
        self.last = best_copy(self.dst, self.src, tries, budget_s=0.0, warm_up=False)
        self.wins[self.last.describe()] += 1
        seconds = self.floor_bytes / (self.moved / self.last.seconds)
        if self.engine_pair is not None:
            src, dst = self.engine_pair
            engine = best_copy(dst, src, tries, budget_s=0.0, warm_up=False)
            seconds += self.receiver_bytes / (moved_bytes(dst, src) / engine.seconds)
        return seconds


class LinkShare:
    """The host link as one data-parallel rank has it while every rank offloads at once: the floor of its
    offload and onload (`to_host`, `to_device`, payload bytes per second, as `Floors` has them).

    Each rank of the group copies a buffer of its offloaded state's size (capped) each way, every round at
    the same moment (a barrier), with the threads its offload copies with; a round lasts as long as its
    slowest rank, and the best round counts (ranks timing their own best rounds would each pick a moment
    when the others were not copying). The ranks of a machine
    share its memory bandwidth (a CPU run: the offload is a memcpy), or PCIe switches between GPUs; a
    probe alone on an idle machine would give one rank the whole machine's bandwidth, a floor no rank's
    offload can reach while the others offload too.
    """

    def __init__(self, nbytes: int, *, device: torch.device, group=None):
        import torch.distributed as dist  # here: a single process never needs it

        self.dist, self.group, self.nbytes, self.device = dist, group, nbytes, device
        self.to_host = self.to_device = math.inf
        self.how = ""
        self.measure()

    def measure(self, rounds: int = 5) -> None:
        host, device, dist = torch.device("cpu"), self.device, self.dist
        directions = [(device, host), (host, device)] if device.type == "cuda" else [(host, host)]
        rates = []
        for src, dst in directions:
            a, b = probe_buffers(self.nbytes, src=src, dst=dst, dtypes=BYTES, pin=src.type != dst.type)
            b.copy_(a)  # first touch
            seconds = torch.empty(rounds, dtype=torch.float64)
            for k in range(rounds):  # every round on every rank at once, with the threads the offload copies with
                dist.barrier(group=self.group)
                synchronize(device)
                start = CLOCK()
                b.copy_(a, non_blocking=src.type != dst.type)
                synchronize(device)
                seconds[k] = CLOCK() - start
            # a round lasts as long as its slowest rank: the best such round is the share each rank has
            slowest = seconds.to(device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
            rates.append(b.nbytes / float(slowest.min()))  # payload: each byte of the state crosses once
            probed = b.nbytes
            del a, b
        self.to_host, self.to_device = rates[0], rates[-1]
        world = dist.get_world_size(self.group)
        self.how = (
            f"{world} ranks copying at once, {fmt_bytes(probed)} each, {plural(torch.get_num_threads(), 'thread')}"
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def as_dict(self) -> dict[str, float | str]:
        return {
            "rank_to_host_gbps": self.to_host / 1e9,
            "rank_to_device_gbps": self.to_device / 1e9,
            "rank_link_probe": self.how,
        }


class GatherFloor:
    """The floor of the update's gather from shards (trainer.parallel=fsdp2): the update's bytes, in the
    trainer's dtype, all-gathered over the trainer's group (every rank takes part, at the same point).

    The floor is the fastest this group all-gathers: the same bytes in calls of each size in `CALL_SIZES`
    (up to the update's bytes), the fastest size kept (`call_bytes`; the update's gather then calls at that
    size, rlsync.update.gather). The size matters: gloo over loopback moved 1.1 GB/s in 1 to 16 MiB calls and
    0.48 GB/s in 64 MiB to 1 GiB ones on this project's CPU machine; NCCL gains up to a few hundred MiB.
    Each size's rounds walk `POOL_BYTES` (128 MiB, or one call), the best of `rounds` counts, each
    round started together (a barrier) so no rank times another's lateness. `per_second` counts the gathered
    (output) bytes: each rank receives (N-1)/N of them.
    """

    CALL_SIZES = tuple(1 << p for p in range(20, 29, 2))  # gathered bytes per call: 1, 4, 16, 64, 256 MiB
    POOL_BYTES = 128 << 20  # gathered bytes each round walks (the update's, if fewer)

    def __init__(self, nbytes: int, *, dtype: torch.dtype, device: torch.device, rounds: int = 3, group=None):
        import torch.distributed as dist  # here: a single process never needs it

        self.dist, self.group = dist, group
        self.world = dist.get_world_size(group)
        self.nbytes, self.dtype, self.device, self.rounds = nbytes, dtype, device, rounds
        self.per_second, self.how, self.call_bytes = math.inf, "", self.CALL_SIZES[-1]
        self.measure()

    def sizes(self) -> list[int]:
        """The call sizes probed: those up to the update's bytes (the update's bytes alone when smaller)."""
        top = max(self.world * self.dtype.itemsize, min(self.nbytes, self.CALL_SIZES[-1]))
        return [s for s in self.CALL_SIZES if s <= top] or [top]

    def call_size(self, size: int) -> int:
        """The gathered bytes of one call of `size`: whole elements from every rank."""
        return max(1, size // self.dtype.itemsize // self.world) * self.world * self.dtype.itemsize

    def measure(self) -> None:
        dist, world = self.dist, self.world
        # torch >= 2.13 names the one-tensor all-gather all_gather_single (all_gather_into_tensor before)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        sizes, seconds = self.sizes(), []
        # Each round walks a pool of the update's bytes (up to POOL_BYTES, 4x this project's CPU's 32 MiB
        # L3), a new slice per call, as the update reads each byte once: calls re-gathering one small buffer
        # ran from the cache (16 MiB calls: 2.0 GB/s) where the update's 1.2 GB ran at 1.1 GB/s.
        pool = max(sizes[-1], min(self.nbytes, self.POOL_BYTES)) // self.dtype.itemsize // world
        inp = torch.ones(pool, dtype=self.dtype, device=self.device)
        out = torch.empty(pool * world, dtype=self.dtype, device=self.device)
        for size in sizes:
            shard = max(1, size // self.dtype.itemsize // world)  # elements each rank contributes per call
            calls = max(1, pool // shard)
            gather(out[: shard * world], inp[:shard], group=self.group)  # first touch, the connections warm
            best = math.inf
            for _ in range(self.rounds):
                dist.barrier(group=self.group)
                synchronize(self.device)
                start = CLOCK()
                for k in range(calls):
                    gather(
                        out[k * shard * world : (k + 1) * shard * world],
                        inp[k * shard : (k + 1) * shard],
                        group=self.group,
                    )
                synchronize(self.device)
                best = min(best, CLOCK() - start)
            seconds.append(best / (calls * shard * world * self.dtype.itemsize))  # per gathered byte
        del inp, out
        # every rank must choose the same call size (the update's collectives must match): the slowest rank's
        # time per size decides
        per_byte = torch.tensor(seconds, dtype=torch.float64, device=self.device)  # NCCL reduces device tensors
        dist.all_reduce(per_byte, op=dist.ReduceOp.MAX, group=self.group)
        k = int(per_byte.argmin())
        self.per_second, self.call_bytes = 1.0 / float(per_byte[k]), self.call_size(sizes[k])
        self.how = (
            f"{gather.__name__} in {fmt_bytes(self.call_bytes)} calls (the fastest of {fmt_bytes(sizes[0])} to "
            f"{fmt_bytes(sizes[-1])}), {world} ranks, {dist.get_backend(self.group)}"
        )
        if self.device.type == "cuda":  # probed between steps: leave no device memory cached for the engine
            torch.cuda.empty_cache()

    def time(self, nbytes: int | None = None) -> float:
        """Seconds the floor gives `nbytes` (default: the update's) gathered."""
        return (self.nbytes if nbytes is None else nbytes) / self.per_second

    def as_dict(self) -> dict[str, float | str]:
        return {"gather_gbps": self.per_second / 1e9, "gather_probe": self.how, "gather_call_bytes": self.call_bytes}
