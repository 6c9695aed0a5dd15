"""The payloads' kernels: each bucket in one pass over memory, in chunks that stay in cache.

A chunk (`chunk_elements`) is small enough that its intermediates (the engine-dtype cast, the changed
mask, the fp32 quotients) stay in the CPU's L2 while the chunk's source is read once from memory and its
result written once; on CUDA, where each op is a kernel launch and a count a sync, the chunk is large
(a few such per bucket). The same torch ops run on both, but for the delta's compaction and FP8's quantize and
dequantize on a CPU: C kernels (delta.c, fp8.c, built at first use by native.py) where a C compiler is found,
else numpy's steps (the delta) or torch's kernels (FP8). Chosen over
torch.compile by measurement (experiments/payloads/kernels.py, docs/payloads.md).

- `DeltaWriter`: cast, compare bit for bit with the last values, count, compact the changed positions
  and values into the staging buffer and remember them, chunk by chunk; a bucket whose changes would
  make the sparse form no smaller than the bucket switches to whole mid-way, without a second pass.
- `scatter_changed`: the delta's apply, one scatter per engine tensor (delta.c's on a CPU).
- FP8's block amax, scale, divide and e4m3 cast into the staging buffer; the multiply and the engine-dtype
  cast straight into the engine's weights. Bit for bit the reference block quantization
  (rlsync/update/payload/fp8.py). Which runs: on a CPU fp8.c (`native_quantize`, `native_dequantize`: one
  vectorised C pass, the block rows over the update's threads) where it built and the tensor is float32 (the
  engine's bf16 or float32), 2-D and contiguous, whole blocks or not (partial edge blocks too); else
  torch.compile's kernels on whole tensors of whole blocks (`quantize_whole`, `dequantize_whole`: on CUDA always);
  else the eager chunks (`quantize_rows`, `dequantize_rows`).
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from rlsync.measure.devices import copy_into
from rlsync.update.payload import native

CPU_CHUNK = 1 << 20  # elements: 4 MiB of fp32 read, its bf16 cast and mask in cache (measured: kernels.py)
CUDA_CHUNK = 1 << 24  # elements: launches and count syncs few per bucket; the GPU's L2 holds tens of MiB
BLOCK = 128  # FP8's scale block, each way
E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn
INDEX_BYTES = 4  # an int32 position within its bucket
# what memory moves per access, read and written whole: a CPU's cache line, a GPU's L2 sector (the delta's floor)
LINE_BYTES = {"cpu": 64, "cuda": 32}
SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bit-for-bit comparison
NUMPY_ON_CPU = True  # the delta's compaction and apply (C, else numpy) outside torch on a CPU (False: torch's ops,
# which a TorchDispatchMode sees one by one: tests/unit/test_payload_floors.py counts their bytes)


def chunk_elements(device: torch.device) -> int:
    return CUDA_CHUNK if device.type == "cuda" else CPU_CHUNK


def row_chunks(tensor: torch.Tensor, chunk: int):
    """(first element, rows view) over `tensor` by whole rows of its first dim, about `chunk` elements each
    (at least one row): a view of any strided or host tensor, so the copy into a scratch casts as it reads."""
    t = tensor.reshape(1) if tensor.dim() == 0 else tensor
    rows = t.shape[0]
    row = t[0].numel() if rows else 0
    step = max(1, chunk // max(row, 1))
    for r0 in range(0, rows, step):
        yield r0 * row, t[r0 : r0 + step]


class Scratch:
    """Per-device chunk buffers, grown on demand and reused across buckets and updates."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        have = self.buffers.get((key, dtype, device))
        if have is None or have.numel() < numel:
            have = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[(key, dtype, device)] = have
        return have[:numel]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())


class Workers:
    """A bucket's chunks over the update's CPU threads, one torch thread each.

    On a CPU each chunk's ops are too short for torch's own parallel regions: every op waits at a barrier
    for its slowest thread, which a busy machine keeps off a core (measured on this project's loaded 2-core
    machine: 64 M elements' cast, compare and compaction in 256 Ki chunks took 1.1 s on 2 torch threads,
    0.03 s on 1). So the chunks are split in contiguous runs, one per thread of `torch.get_num_threads()` (the
    update's copy threads), each on a Python thread whose torch ops run single-threaded (they release the
    GIL). On CUDA one run: the kernels queue on the device's stream in order."""

    def __init__(self):
        self.scratch: list[Scratch] = []

    def run(self, device: torch.device, items: list, size, work) -> None:
        """`work(run_of_items, scratch)` over `items` split in contiguous runs of about equal `size(item)`."""
        total = sum(size(i) for i in items)
        # a thread per chunk's worth of work at most: starting and joining one costs more than a small bucket's ops
        enough = -(-total // chunk_elements(device))
        n = max(1, min(torch.get_num_threads() if device.type == "cpu" else 1, len(items), enough))
        while len(self.scratch) < n:
            self.scratch.append(Scratch())
        if n == 1:
            work(items, self.scratch[0])
            return
        runs, total, done = [[] for _ in range(n)], total or 1, 0
        for item in items:
            runs[min(n - 1, done * n // total)].append(item)
            done += size(item)
        errors: list[BaseException] = []

        def guarded(run, scratch):
            try:
                with torch.no_grad():  # grad mode is per thread
                    work(run, scratch)
            except BaseException as err:  # noqa: BLE001 - raised again in the caller's thread
                errors.append(err)

        before = torch.get_num_threads()
        torch.set_num_threads(1)  # a new thread's torch ops take this count at their first op
        try:
            threads = [threading.Thread(target=guarded, args=(r, self.scratch[k])) for k, r in enumerate(runs) if r]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            torch.set_num_threads(before)
        if errors:
            raise errors[0]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.scratch)


def chunks_of(bucket, weights, device: torch.device) -> tuple[list[tuple[int, int, list]], int]:
    """The chunks of `bucket` (sized for `device`, where the kernels run): (element offset in the bucket, elements,
    [(offset in the chunk, rows of a trainer's tensor)]), small tensors side by side in one chunk (a MoE model's
    thousands of per-expert tensors cost a chunk's ops once, not once each); and the trainer's bytes read."""
    size = chunk_elements(device)
    out, read = [], 0
    for slot in bucket.slots:
        source = weights[slot.meta.name]
        read += source.numel() * source.element_size()
        for at, part in row_chunks(source, size):
            at, k = slot.offset + at, part.numel()
            if out and out[-1][0] + out[-1][1] == at and out[-1][1] + k <= size:
                first, numel, pieces = out[-1]
                pieces.append((numel, part))
                out[-1] = (first, numel + k, pieces)
            else:
                out.append((at, k, [(0, part)]))
    return out, read


# ----------------------------------------------------------------------------------------------
# The delta
# ----------------------------------------------------------------------------------------------


def flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """The positions (int64, ascending) of a 1-D bool mask's true elements (on CUDA a sync: the result's size
    is read back)."""
    return mask.nonzero().view(-1)


def changed_in_chunk(new: torch.Tensor, old: torch.Tensor, scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """Where `new` and `old` (one dtype, one chunk) differ bit for bit (-0.0 against 0.0 and NaNs count as
    changed): (positions in the chunk, int64 ascending; their new values), the changed elements of `old`
    overwritten. Compared as 8-byte words (4 bf16 elements each: 2.5x faster than element by element, the
    mask and its scan 4x smaller), then within the changed words only; element by element where the chunk
    is not whole aligned words. On a CPU the same steps through numpy (`changed_on_host`)."""
    if new.device.type == "cpu" and NUMPY_ON_CPU:
        return changed_on_host(new, old, scratch)
    k, itemsize = new.numel(), new.element_size()
    bits = SAME_WIDTH_INT[itemsize]
    group = 8 // itemsize
    if aligned_words(new, old):
        mask = scratch.get("mask", k // group, torch.bool, new.device)
        torch.ne(new.view(torch.int64), old.view(torch.int64), out=mask)
        words = flat_nonzero(mask)
        fresh = new.view(torch.int64).index_select(0, words)
        differ = fresh.view(bits) != old.view(torch.int64).index_select(0, words).view(bits)
        lane = flat_nonzero(differ.view(-1))  # word-major: ascending (gathers below: a boolean index costs 10x)
        where = words.index_select(0, lane // group).mul_(group).add_(lane % group)
        values = fresh.view(new.dtype).index_select(0, lane)
    else:
        mask = scratch.get("mask", k, torch.bool, new.device)
        torch.ne(new.view(bits), old.view(bits), out=mask)
        where = flat_nonzero(mask)
        values = new.index_select(0, where)
    if where.numel():
        old.index_copy_(0, where, values)
    return where, values


def aligned_words(new: torch.Tensor, old: torch.Tensor) -> bool:
    """Whether both chunks are whole, aligned 8-byte words of elements narrower than a word."""
    group = 8 // new.element_size()
    return (
        group > 1
        and new.numel() % group == 0
        and old.storage_offset() % group == 0
        and new.storage_offset() % group == 0
    )


def changed_on_host(new: torch.Tensor, old: torch.Tensor, scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """`changed_in_chunk` on a CPU, through numpy on the same memory: its comparison is vectorised (2x torch's
    on this project's CPU: 69 against 146 us for 1 Mi bf16 elements), its scan branch-free (torch's branches
    on every element: 2 to 5x slower), and each of its small gathers and the scatter into `old` costs
    microseconds, not torch's per-op dispatch (the whole compaction at 1 % changed: 0.30 against 0.45 ms)."""
    k, itemsize = new.numel(), new.element_size()
    bits = SAME_WIDTH_INT[itemsize]
    a, b = new.view(bits).numpy(), old.view(bits).numpy()
    if aligned_words(new, old):
        group = 8 // itemsize
        mask = scratch.get("mask", k // group, torch.bool, new.device).numpy()
        np.not_equal(a.view(np.int64), b.view(np.int64), out=mask)
        words = np.flatnonzero(mask)
        fresh = a.view(np.int64)[words].view(a.dtype)  # the changed words' elements, word-major
        lane = np.flatnonzero(fresh != b.view(np.int64)[words].view(b.dtype))
        where = words[lane // group] * group + lane % group
        values = fresh[lane]
    else:
        mask = scratch.get("mask", k, torch.bool, new.device).numpy()
        np.not_equal(a, b, out=mask)
        where = np.flatnonzero(mask)
        values = a[where]
    if where.size:
        b[where] = values
    return torch.from_numpy(where), torch.from_numpy(values).view(new.dtype)


def native_compaction(new: torch.Tensor, old: torch.Tensor):
    """delta.c's compaction for this chunk (`native.compaction`), or None: off a CPU, with NUMPY_ON_CPU off, on a
    chunk that is not contiguous (it reads pointers), or where it did not build (`native.DELTA.why_not()`)."""
    if new.device.type != "cpu" or not NUMPY_ON_CPU or not (new.is_contiguous() and old.is_contiguous()):
        return None
    return native.compaction(new.element_size())


def line_bytes(device: torch.device) -> int:
    return LINE_BYTES.get(device.type, LINE_BYTES["cpu"])


def line_shift(device: torch.device) -> int:
    """log2 of `line_bytes`: a byte offset shifted right by it is its line's index (delta.c's `shift`)."""
    return line_bytes(device).bit_length() - 1


def lines_of(where: torch.Tensor, itemsize: int) -> tuple[int, int, int]:
    """The memory lines (`line_bytes`, counted from the bucket's start) that the ascending positions `where` fall
    in: (how many, the first one, the last one); (0, -1, -1) for none. delta.c counts them in its pass; this is
    its fallback's (numpy on a CPU, torch's ops and one sync elsewhere)."""
    if not where.numel():
        return 0, -1, -1
    shift = line_shift(where.device)
    if where.device.type == "cpu":
        ids = (where.numpy().astype(np.int64) * itemsize) >> shift
        return 1 + int(np.count_nonzero(ids[1:] != ids[:-1])), int(ids[0]), int(ids[-1])
    ids = (where.long() * itemsize) >> shift
    ends = torch.stack([(ids[1:] != ids[:-1]).sum() + 1, ids[0], ids[-1]])
    return tuple(int(v) for v in ends.tolist())


def join_lines(spans) -> tuple[int, int, int]:
    """Consecutive runs' lines (`lines_of`'s (how many, first, last), in the bucket's order) as one: a line where
    one run ends and the next begins counted once."""
    total, first, last = 0, -1, -1
    for k, a, b in spans:
        if k:
            total, first, last = total + k - (a == last), a if first < 0 else first, b
    return total, first, last


def compact_chunk(
    new: torch.Tensor, old: torch.Tensor, scratch: Scratch, at: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """`changed_in_chunk` with the positions in the bucket (int32, the chunk's first element `at` added), and the
    memory lines they fall in (`lines_of`).

    Which runs: on a CPU delta.c's one pass (compare, count, compact and remember, no mask, the positions written
    as int32 with `at` added and their lines counted: 1.3x less CPU time than numpy's steps at 0 % changed, 2 to
    2.6x at 1 to 5 %, experiments/payloads/kernels.py --compaction) where it built; else `changed_in_chunk`:
    numpy's steps on a CPU (no C compiler: `native.DELTA.why_not()` says why), torch's ops on CUDA and where
    NUMPY_ON_CPU is off, its int64 positions then offset and narrowed here (by numpy on a CPU)."""
    fn = native_compaction(new, old)
    if fn is not None:
        return compact_pieces([(0, new)], [fn], old, scratch, at)
    where, values = changed_in_chunk(new, old, scratch)
    if where.device.type == "cpu" and NUMPY_ON_CPU:  # numpy's add and narrowing: no torch threads (above)
        where = torch.from_numpy((where.numpy() + at).astype(np.int32))
    else:
        where = torch.add(where, at).to(torch.int32)
    return where, values, lines_of(where, new.element_size())


def source_compaction(pieces: list, old: torch.Tensor):
    """delta.c's compaction straight from each of a chunk's trainer tensors (`pieces`: (offset in the chunk, rows of
    a trainer's tensor)), one per piece: float32 cast to bfloat16 in its pass (`native.cast_compaction`), a tensor
    already in the engine's dtype compared as it is; no cast into the chunk's scratch first (its read and write
    stay in L1: 1.3x less time a chunk, experiments/payloads). None where any piece cannot: another pair of
    dtypes, a piece off the CPU or not contiguous, or where `native_compaction` would not run."""
    if native_compaction(old, old) is None:
        return None
    fns = []
    for _, part in pieces:
        if part.device.type != "cpu" or not part.is_contiguous():
            return None
        if part.dtype == old.dtype:
            fn = native.compaction(old.element_size())
        elif (part.dtype, old.dtype) == (torch.float32, torch.bfloat16):
            fn = native.cast_compaction()
        else:
            return None
        if fn is None:
            return None
        fns.append(fn)
    return fns


def compact_pieces(
    pieces: list, fns: list, old: torch.Tensor, scratch: Scratch, at: int, *, count_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]] | int:
    """delta.c's compaction of a chunk given as pieces (offset in the chunk, contiguous elements), `fns` one a piece
    (`source_compaction`'s straight from the trainer's tensors, or `compact_chunk`'s one over the cast chunk), into
    one scratch: (int32 positions, values, `join_lines` of the pieces' lines); `count_only`: the count alone, `old`
    left holding the new values (`count_chunk`'s)."""
    k, size = old.numel(), old.element_size()
    if count_only:
        return sum(
            fn(part.data_ptr(), old.data_ptr() + offset * size, part.numel(), 0, None, None, 0, None)
            for (offset, part), fn in zip(pieces, fns)
        )
    where = scratch.get("where", k, torch.int32, old.device)
    values = scratch.get("values", k, old.dtype, old.device)
    spans = scratch.get("lines", 3, torch.int64, old.device)
    shift, ends = line_shift(old.device), spans.numpy()
    count, lines = 0, []
    for (offset, part), fn in zip(pieces, fns):
        found = fn(
            part.data_ptr(),
            old.data_ptr() + offset * size,
            part.numel(),
            at + offset,
            where.data_ptr() + count * INDEX_BYTES,
            values.data_ptr() + count * size,
            shift,
            spans.data_ptr(),
        )
        if found:
            lines.append(tuple(int(v) for v in ends))
        count += found
    # copied out (the scratch serves the next chunk) by numpy: torch's copy of over 32 Ki elements takes torch's
    # threads, whose barrier a busy machine stalls for milliseconds (Workers' note)
    kept = values.view(SAME_WIDTH_INT[size]).numpy()[:count].copy()
    return torch.from_numpy(where.numpy()[:count].copy()), torch.from_numpy(kept).view(old.dtype), join_lines(lines)


def count_chunk(new: torch.Tensor, old: torch.Tensor, scratch: Scratch) -> int | torch.Tensor:
    """How many elements of `new` differ bit for bit from `old`, which then holds `new` (a bucket already going
    whole: counted, not compacted). delta.c's pass where it runs (no mask); else a mask and its sum (on CUDA kept
    on the device: no sync per chunk)."""
    fn = native_compaction(new, old)
    if fn is not None:
        return compact_pieces([(0, new)], [fn], old, scratch, 0, count_only=True)
    mask = scratch.get("mask", new.numel(), torch.bool, new.device)
    bits = SAME_WIDTH_INT[new.element_size()]
    torch.ne(new.view(bits), old.view(bits), out=mask)
    old.copy_(new)
    return mask.sum()


@torch.no_grad()
def delta_encode(bucket, weights, buffer: torch.Tensor, last: torch.Tensor, workers: Workers, *, first: bool):
    """One bucket's delta into `buffer` against `last`, which it leaves holding the new values: each chunk of
    the trainer's tensors cast into cache, compared bit for bit with its last values, its changed positions
    and values compacted there and scattered into `last`; then the positions (int32, ascending) and values
    written from the buffer's start. Where they would be no smaller than the bucket, the bucket goes whole
    (the buffer from `last`, now the new values). `first`: nothing kept yet, every element whole and kept.
    Each chunk's compaction is `compact_chunk` (which kernel runs where, and why: its docstring).

    Returns (whole, changed elements, the trainer's bytes read, the memory lines the changed elements fall in:
    `lines_of` over the bucket, a line two chunks share counted once; None where it goes whole)."""
    n, itemsize = last.numel(), last.element_size()
    most = (n * itemsize - 1) // (INDEX_BYTES + itemsize)  # sparse below this many changed: smaller
    items, read = chunks_of(bucket, weights, buffer.device)
    found: dict[int, tuple | int | torch.Tensor] = {}  # per chunk: (int32 positions, values), or (whole) a count
    changed = [0]  # so far, over every run: once past `most` the chunks are counted, not compacted
    if first and buffer.device.type == "cpu" and NUMPY_ON_CPU:
        native.DELTA.get()  # the C kernel built (once a process) in the first update, which compacts nothing

    def work(run, scratch: Scratch) -> None:
        for at, k, pieces in run:
            if not k:
                continue
            old = last[at : at + k]
            fns = None if first else source_compaction(pieces, old)
            if fns is not None:  # compared straight from the trainer's tensors (delta.c): no cast into scratch
                if changed[0] > most:
                    found[at] = compact_pieces(pieces, fns, old, scratch, at, count_only=True)
                    continue
                where, values, lines = compact_pieces(pieces, fns, old, scratch, at)
                if where.numel():
                    found[at] = (where, values, lines)
                    changed[0] += where.numel()
                continue
            new = scratch.get("new", k, last.dtype, last.device)
            for offset, part in pieces:  # the cast, into cache
                copy_into(new[offset : offset + part.numel()].view(part.shape), part)
            if first:
                buffer[at : at + k].copy_(new)
                old.copy_(new)
                continue
            if changed[0] > most:  # whole anyway: counted, not compacted
                found[at] = count_chunk(new, old, scratch)
                continue
            where, values, lines = compact_chunk(new, old, scratch, at)  # on CUDA a sync: sized by it
            if where.numel():
                found[at] = (where, values, lines)
                changed[0] += where.numel()

    workers.run(buffer.device, items, lambda item: item[1], work)
    if first:
        return True, n, read, None
    parts = [found[at] for at, _, _ in items if at in found]
    count = sum(p[1].numel() if isinstance(p, tuple) else int(p) for p in parts)
    if count > most:  # no smaller than the bucket: whole, from the last values (now the new ones)
        buffer[:n].copy_(last)
        return True, count, read, None
    lines = join_lines(p[2] for p in parts)[0]  # the chunks in the bucket's order
    if count:
        raw = buffer.view(torch.uint8)
        torch.cat([p[0] for p in parts], out=raw[: count * INDEX_BYTES].view(torch.int32))
        values = raw[count * INDEX_BYTES : count * (INDEX_BYTES + itemsize)].view(last.dtype)
        torch.cat([p[1] for p in parts], out=values)
    return False, count, read, lines


def scatter_changed(target: torch.Tensor, where: torch.Tensor, values: torch.Tensor, origin: int = 0) -> None:
    """`target`'s elements at flat positions `where - origin` (`where` int32 or int64, ascending) set to `values`,
    in one scatter: on a CPU delta.c's (`native.scatter`: the int32 positions as they crossed, no offset
    subtracted first) where it built and `target` is contiguous, else numpy's (its fancy assignment takes int32
    positions: 1.4x torch's index_copy_, which wants them widened to int64 first); elsewhere torch's."""
    if target.device.type == "cpu" and NUMPY_ON_CPU:
        fn = native.scatter(target.element_size()) if where.dtype == torch.int32 else None
        if fn is not None and target.is_contiguous() and where.is_contiguous() and values.is_contiguous():
            fn(target.data_ptr(), where.data_ptr(), values.data_ptr(), where.numel(), origin)
            return
        bits = SAME_WIDTH_INT[target.element_size()]
        into = target.detach().view(bits).numpy()  # the engine's own memory, strided or not
        changed = values.view(bits).numpy()
        at = where.numpy() - origin if origin else where.numpy()
        if target.is_contiguous():
            into.reshape(-1)[at] = changed  # a view: the array is contiguous
        else:  # a view into a fused tensor (per-expert weights of a MoE model)
            into[np.unravel_index(at, into.shape)] = changed
        return
    at = where.long() - origin if origin else where.long()
    if target.is_contiguous():
        target.view(-1).index_copy_(0, at, values)
    else:  # a view into a fused tensor (per-expert weights of a MoE model)
        target[torch.unravel_index(at, target.shape)] = values


# ----------------------------------------------------------------------------------------------
# FP8 blocks
# ----------------------------------------------------------------------------------------------


def blocks_of(shape: tuple[int, ...]) -> tuple[int, int]:
    return math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)


def block_rows(rows: int, cols: int, chunk: int) -> int:
    """Rows per chunk: whole 128-row blocks, about `chunk` elements (at least one block row)."""
    return BLOCK * max(1, chunk // (BLOCK * max(cols, 1)))


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """A block's scale: its largest magnitude over 448 (so it is exact in e4m3), 1 for an all-zero block."""
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def as_blocks(x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
    """`x` (h x w) as (h/128, 128, w/128, 128) where both divide; else padded with zeros into `out`
    (float32) first. Returns (blocks, padded)."""
    h, w = x.shape
    bh, bw = math.ceil(h / BLOCK), math.ceil(w / BLOCK)
    if h % BLOCK == 0 and w % BLOCK == 0:
        return x.view(bh, BLOCK, bw, BLOCK), False
    padded = torch.zeros(bh * BLOCK, bw * BLOCK, dtype=torch.float32, device=x.device)
    padded[:h, :w] = x
    return padded.view(bh, BLOCK, bw, BLOCK), True


def block_row_groups(rows: int, cols: int, device: torch.device) -> list[tuple[int, int]]:
    """(first row, rows) of each group of whole 128-row blocks a 2-D tensor's kernels take at a time."""
    step = block_rows(rows, cols, chunk_elements(device))
    return [(r0, min(step, rows - r0)) for r0 in range(0, rows, step)]


def block_view(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor of whole 128x128 blocks as (block rows, 128, block columns, 128): the compiled kernels take
    this view, so that their loops index a block by its own two counters (given the 2-D tensor, inductor's loops
    with dynamic shapes recover the block from each element's index by integer divisions: 10 % slower)."""
    return t.view(t.shape[0] // BLOCK, BLOCK, t.shape[1] // BLOCK, BLOCK)


def quantize_blocks_whole(blocks: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """`blocks` (float32, `block_view`) as e4m3 values into `q` (its view) and its block scales into `scale`:
    FP8's quantization, one expression for torch.compile to fuse. The amax in two steps, each row's largest
    magnitude per block, then over the block's 128 rows: the first streams through memory in order (the amax of
    whole blocks at once reads 128 short runs 12 KiB apart: 1.3x slower with the divide, measured)."""
    amax = blocks.abs().amax(dim=3).amax(dim=1)
    s = scale_of(amax)
    q.copy_((blocks / s[:, None, :, None]).to(FP8))
    scale.copy_(s)


def dequantize_blocks_whole(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """e4m3 `q` (`block_view`) times its block scales, cast into `out` (its view): one expression for torch.compile."""
    out.copy_((q.to(torch.float32) * scale[:, None, :, None]).to(out.dtype))


class Compiled:
    """A kernel through torch.compile (dynamic shapes: one compile serves most tensor sizes), where it
    compiles: inductor's vectorised C++ on a CPU (it needs a C++ compiler), Triton on CUDA. ATen's eager
    float8 casts are scalar loops on a CPU (3 ns an element for e4m3 -> float32, 0.5 for float32 -> e4m3 on
    this project's machine, against 0.1 for the float32 <-> bf16 casts), which the compiled kernels vectorise.
    Called on whole tensors from the caller's thread (inductor's loops take the update's threads): faster
    than compiled per chunk over Python threads, measured (experiments/payloads/kernels.py). On a CPU only where
    fp8.c does not run (`native_quantize`: no C compiler, NUMPY_ON_CPU off); on CUDA always. Where the compile
    fails (no compiler), `failed` says why after the first call and the eager chunks serve. The quantize
    writes into scratch tensors, then copied into the staging buffer: aot_autograd refuses input mutations on
    views of one storage with two dtypes (the buffer's values and scales)."""

    enabled = True  # False: the eager chunks only (tests/unit/test_payload_floors.py watches their ops one by one)

    def __init__(self, fn):
        self.source, self.fn, self.failed = fn, None, None

    def __call__(self, *args):
        """The compiled kernel's result, or None where it is off or failed (the caller runs its eager path)."""
        if not self.enabled or self.failed is not None:
            return None
        if self.fn is None:
            self.fn = torch.compile(self.source, dynamic=True)
        try:
            return self.fn(*args) or True
        except Exception as err:  # noqa: BLE001 - no compiler, an unsupported op: the eager chunks serve
            self.failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            return None


QUANTIZE = Compiled(quantize_blocks_whole)
DEQUANTIZE = Compiled(dequantize_blocks_whole)
NATIVE_TARGETS = {torch.bfloat16: "bf16", torch.float32: "f32"}  # fp8.c's dequantize targets (native.FP8_TARGETS)


def whole_blocks(t: torch.Tensor) -> bool:
    """Whether a 2-D tensor is whole 128x128 blocks: what the compiled kernels' `block_view` needs."""
    return t.shape[0] % BLOCK == 0 and t.shape[1] % BLOCK == 0


def native_fp8(q: torch.Tensor, scale: torch.Tensor, *tensors: torch.Tensor):
    """fp8.c's library (`native.fp8_kernels`) for e4m3 values `q` (2-D, any shape: partial edge blocks too), their
    float32 block `scale` and `tensors` of q's shape, or None: off a CPU, with NUMPY_ON_CPU off (torch's ops only:
    tests/unit/test_payload_floors.py watches them), on a tensor that is not contiguous or whose shape is not q's
    or its blocks' (it reads and writes through pointers), or where it did not build (`native.FP8.why_not()`)."""
    if q.device.type != "cpu" or not NUMPY_ON_CPU or q.dim() != 2 or q.dtype != FP8:
        return None
    if scale.dtype != torch.float32 or tuple(scale.shape) != blocks_of(q.shape):
        return None
    if any(t.shape != q.shape for t in tensors):
        return None
    if any(t.device != q.device or not t.is_contiguous() for t in (q, scale, *tensors)):
        return None
    return native.fp8_kernels()


def native_quantize(source: torch.Tensor, q: torch.Tensor, scale: torch.Tensor):
    """fp8.c's quantize of `source` (float32, 2-D, contiguous, any shape) into `q` (e4m3, its shape) and `scale`
    (its blocks, a partial edge block's scale that of its values alone) as `job(b0, b1)` over its block rows
    [b0, b1) (ctypes releases the GIL: the encoder's Workers run the jobs of a bucket's block rows on its threads;
    the last block row may be partial), or None where `native_fp8` says no or `source` is not float32 (the caller
    runs `quantize_whole`, else `quantize_rows`)."""
    lib = native_fp8(q, scale, source) if source.dtype == torch.float32 else None
    if lib is None:
        return None
    rows, cols = source.shape
    x, out, s = source.data_ptr(), q.data_ptr(), scale.data_ptr()
    return lambda b0, b1: lib.rlsync_fp8_quantize(x, rows, cols, b0, b1, out, s)


def native_dequantize(q: torch.Tensor, scale: torch.Tensor, target: torch.Tensor):
    """fp8.c's dequantize of e4m3 `q` times its block `scale` into `target` (bf16 or float32, contiguous, q's shape,
    whole blocks or not) as `job(b0, b1)` over block rows, as `native_quantize`; None where it does not apply (the
    caller runs `dequantize_whole`, else `dequantize_rows`)."""
    name = NATIVE_TARGETS.get(target.dtype)
    lib = native_fp8(q, scale, target) if name is not None else None
    if lib is None:
        return None
    fn = getattr(lib, f"rlsync_fp8_dequantize_{name}")
    rows, cols = q.shape
    src, s, out = q.data_ptr(), scale.data_ptr(), target.data_ptr()
    return lambda b0, b1: fn(src, s, rows, cols, b0, b1, out)


@torch.no_grad()
def quantize_whole(source: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scratch: Scratch) -> bool:
    """A whole tensor of whole 128x128 blocks (float32, on `q`'s device) quantized by the compiled kernel into `q`
    and `scale`, through `scratch` (the kernel cannot write into the staging buffer itself: Compiled's note;
    reused scratch, not a fresh tensor per call, whose first touch faults its pages in); False where it does not
    apply or did not compile (the caller's chunks serve). The encoder asks `native_quantize` first (fp8.c)."""
    fits = source.dtype == torch.float32 and source.device == q.device and whole_blocks(source)
    if not fits or not source.is_contiguous():  # block_view needs the rows in order
        return False
    values = scratch.get("q", q.numel(), FP8, q.device).view(q.shape)
    scales = scratch.get("scale", scale.numel(), torch.float32, q.device).view(scale.shape)
    if QUANTIZE(block_view(source), block_view(values), scales) is None:
        return False
    q.copy_(values)  # a byte an element, from cache where the tensor fits
    scale.copy_(scales)
    return True


@torch.no_grad()
def dequantize_whole(q: torch.Tensor, scale: torch.Tensor, target: torch.Tensor) -> bool:
    """A whole tensor of whole blocks dequantized by the compiled kernel straight into `target` (the engine's
    weight); False where it does not apply or did not compile. The decode asks `native_dequantize` first."""
    if target.device != q.device or not whole_blocks(q) or not target.is_contiguous():
        return False
    return DEQUANTIZE(block_view(q), scale, block_view(target)) is not None


@torch.no_grad()
def quantize_rows(source: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scratch: Scratch) -> None:
    """A group of block rows of a 2-D tensor, `source` (any float dtype and device), as e4m3 values into `q`
    (float8, its shape) and a float32 scale per 128x128 block into `scale` (its blocks): read from memory once
    (cast to float32 in cache where it is not float32 on `q`'s device), its amax, the divide and the cast there."""
    h, cols = source.shape
    device = q.device
    if source.dtype != torch.float32 or source.device != device:
        x = scratch.get("x", h * cols, torch.float32, device).view(h, cols)
        copy_into(x, source)
    else:
        x = source
    blocks, padded = as_blocks(x)
    amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg_())  # |x|'s max, no |x| temp
    s = scale_of(amax)
    scale.copy_(s)
    quotient = scratch.get("quotient", blocks.numel(), torch.float32, device).view(blocks.shape)
    torch.div(blocks, s[:, None, :, None], out=quotient)
    flat = quotient.view(blocks.shape[0] * BLOCK, blocks.shape[2] * BLOCK)
    q.copy_(flat[:h, :cols] if padded else flat)


@torch.no_grad()
def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, target: torch.Tensor, scratch: Scratch) -> None:
    """A group of block rows: e4m3 `q` times its block scales, cast into `target` (the engine's tensor's rows,
    its dtype), widened to float32 in cache, multiplied there and written once."""
    h, cols = q.shape
    x = scratch.get("wide", h * cols, torch.float32, q.device).view(h, cols)
    x.copy_(q)  # e4m3 -> float32, exact
    blocks, padded = as_blocks(x)
    blocks.mul_(scale[:, None, :, None])
    flat = blocks.view(blocks.shape[0] * BLOCK, blocks.shape[2] * BLOCK)
    copy_into(target, flat[:h, :cols] if padded else flat)
