"""The delta's three implementations of one compaction agree: the C kernel's on a CPU (delta.c), numpy's where it
did not build, torch's (CUDA's, and the one tests/unit/test_payload_floors.py counts the bytes of) element for
element, all bit for bit; the C kernel's build falls back to numpy with its reason, and two builds at once both
load."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
import torch
from conftest import build_variants, cpu_flags, needs_cc

from rlsync.update.payload import kernels, native
from rlsync.update.payload.base import SPARSE
from rlsync.update.payload.kernels import Scratch, changed_in_chunk, compact_chunk, scatter_changed

BF16 = torch.bfloat16
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # signed: the sign bit is iinfo's min


def changed_pair(share: float, numel: int, offset: int, seed: int = 0, dtype: torch.dtype = BF16):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(numel + offset, generator=g).to(dtype)[offset:]
    new = old.clone()
    flips = torch.rand(numel, generator=g) < share
    bits = new.view(BITS[dtype.itemsize])
    bits[flips] ^= torch.iinfo(bits.dtype).min  # the sign bit: a negation (float8 has no neg)
    if numel > 3:  # the comparisons a value compare would miss: -0.0 against 0.0, a NaN kept
        zeros = torch.tensor([0.0, -0.0, float("nan")]).to(dtype)
        old[1], new[1] = zeros[0], zeros[1]
        old[2] = new[2] = zeros[2]
    return new, old


@pytest.mark.parametrize("share", [0.0, 0.01, 0.3, 1.0])
@pytest.mark.parametrize(("numel", "offset"), [(4096, 0), (4099, 0), (4096, 1), (1, 0)])
def test_numpy_and_torch_compactions_agree_bit_for_bit(monkeypatch, share, numel, offset):
    found = {}
    for on_host in (True, False):
        monkeypatch.setattr(kernels, "NUMPY_ON_CPU", on_host)
        new, old = changed_pair(share, numel, offset)
        before = old.clone()
        where, values = changed_in_chunk(new, old, Scratch())
        expect = torch.nonzero(new.view(torch.int16) != before.view(torch.int16)).view(-1)
        assert torch.equal(where, expect)
        assert torch.equal(values.view(torch.int16), new.view(torch.int16)[expect])
        assert torch.equal(old.view(torch.int16), new.view(torch.int16))  # the last values now the new ones
        found[on_host] = (where, values.view(torch.int16))
    assert all(torch.equal(a, b) for a, b in zip(found[True], found[False]))


@pytest.mark.parametrize("origin", [0, 1000])
@pytest.mark.parametrize(("on_host", "c"), [(True, True), (True, False), (False, False)])
def test_the_apply_writes_the_changed_elements_of_whole_tensors_and_of_views_into_fused_ones(
    monkeypatch, on_host, c, origin
):
    """delta.c's scatter (a contiguous target), numpy's and torch's: positions as they crossed (the tensor's
    offset in its bucket, `origin`, still in them), into whole tensors, an expert's rows and a strided view."""
    monkeypatch.setattr(kernels, "NUMPY_ON_CPU", on_host)
    monkeypatch.setattr(native, "ENABLED", c)
    fused = torch.zeros(4, 6, 8, dtype=BF16)
    expert = fused[2]  # contiguous rows of a fused tensor
    strided = fused[:, 1]  # a view with gaps
    for target in (torch.zeros(6, 8, dtype=BF16), expert, strided):
        where = torch.tensor([0, 5, 17, target.numel() - 1], dtype=torch.int32)
        values = torch.tensor([1.0, -2.0, 3.0, 4.5], dtype=BF16)
        scatter_changed(target, where + origin, values, origin)
        assert torch.equal(target.reshape(-1)[where.long()], values)
        assert int((target != 0).sum()) == 4
    assert int((fused != 0).sum()) == 8  # the expert's four and the strided view's four, nothing else


@needs_cc
@pytest.mark.parametrize("dtype", [BF16, torch.float32, torch.float8_e4m3fn, torch.float64])
def test_the_c_apply_is_numpy_s_bit_for_bit(monkeypatch, dtype):
    """Every width, NaN and signed-zero bits among the values, the first and last element, a tensor's positions
    with its bucket offset in them."""
    bits = BITS[dtype.itemsize]
    g = torch.Generator().manual_seed(5)
    numel, origin = 50_000, 12_345
    where = torch.sort(torch.randperm(numel, generator=g)[:700]).values.to(torch.int32)
    where[0], where[-1] = 0, numel - 1
    where = torch.unique(where) + origin
    values = torch.randint(-128, 127, (where.numel(),), generator=g, dtype=torch.int8).to(bits).view(dtype)
    out = {}
    for enabled in (True, False):
        monkeypatch.setattr(native, "ENABLED", enabled)
        assert (native.scatter(dtype.itemsize) is not None) == enabled
        target = torch.zeros(numel, dtype=dtype).view(100, 500)
        scatter_changed(target, where, values, origin)
        out[enabled] = target.view(bits).clone()
    assert torch.equal(out[True], out[False])
    assert torch.equal(out[True].view(-1)[(where - origin).long()], values.view(bits))


def hard_values(rows: int, cols: int) -> torch.Tensor:
    """Magnitudes over 15 decades (e4m3's subnormals and its top, after scaling), signed zeros, an all-zero block."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-12, 3, rows * cols)[
        torch.randperm(rows * cols, generator=g)
    ].view(rows, cols)
    x[:128, :128] = 0.0
    x[128, :4] = torch.tensor([-0.0, 448.0, -448.0, 1e-30])
    return x


def test_the_compiled_fp8_kernels_are_the_reference_bit_for_bit():
    """The whole-tensor kernels torch.compile builds (their block views, the two-step amax) against fp8.py's
    reference quantization and dequantization, on every kind of value."""
    from rlsync.update.payload.fp8 import dequantize_blocks, quantize_blocks
    from rlsync.update.payload.kernels import DEQUANTIZE, FP8, QUANTIZE, dequantize_whole, quantize_whole

    x = hard_values(256, 384)
    q = torch.empty(x.shape, dtype=FP8)
    scale = torch.empty(2, 3)
    assert quantize_whole(x, q, scale, Scratch()), QUANTIZE.failed
    ref_q, ref_scale = quantize_blocks(x)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale, ref_scale)
    out = torch.empty(x.shape, dtype=BF16)
    assert dequantize_whole(q, scale, out), DEQUANTIZE.failed
    assert torch.equal(out.view(torch.int16), dequantize_blocks(ref_q, ref_scale, BF16).view(torch.int16))


# ---- the C kernel (delta.c through native.py) ----------------------------------------------------------------


@needs_cc
@pytest.mark.parametrize("dtype", [BF16, torch.float32, torch.float64, torch.float8_e4m3fn])
@pytest.mark.parametrize("share", [0.0, 0.01, 0.3, 1.0])
@pytest.mark.parametrize(("numel", "offset"), [(4096, 0), (4099, 0), (4096, 1), (1, 0), (70001, 3)])
def test_the_c_compaction_is_numpy_s_bit_for_bit(monkeypatch, dtype, share, numel, offset):
    """Whole runs of 64 words and a tail, an odd length, an unaligned chunk, every width; signed zeros and a NaN
    kept count as changed. Positions int32 with the chunk's offset in the bucket added, `old` left as `new`."""
    assert native.DELTA.why_not() is None  # a compiler is here: the kernel must build
    bits, at = BITS[dtype.itemsize], 1000
    found = {}
    for enabled in (True, False):
        monkeypatch.setattr(native, "ENABLED", enabled)
        new, old = changed_pair(share, numel, offset, dtype=dtype)
        assert (kernels.native_compaction(new, old) is not None) == enabled  # which path ran
        before = old.clone()
        where, values, lines = compact_chunk(new, old, Scratch(), at)
        expect = torch.nonzero(new.view(bits) != before.view(bits)).view(-1)
        assert where.dtype == torch.int32
        assert torch.equal(where.long(), expect + at)
        assert torch.equal(values.view(bits), new.view(bits)[expect])
        assert torch.equal(old.view(bits), new.view(bits))
        ids = ((expect + at) * dtype.itemsize) // 64  # the 64-byte lines of the bucket they fall in
        assert lines == ((len(set(ids.tolist())), int(ids[0]), int(ids[-1])) if len(ids) else (0, -1, -1))
        found[enabled] = (where, values.view(bits), lines)
    assert all(torch.equal(a, b) for a, b in zip(found[True][:2], found[False][:2]))
    assert found[True][2] == found[False][2]


@needs_cc
def test_the_c_cast_in_the_compaction_is_torch_s_float32_to_bfloat16_bit_for_bit():
    """Every bf16 value's float32 neighbours (its ties, just below and above them: rounding to even either way, the
    carries into the next exponent and into infinity, NaN payloads, subnormals, signed zeros) and random bit
    patterns: the last values left as torch's cast, the changed ones' positions and values as it gives them."""
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    low = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
    g = torch.Generator().manual_seed(9)
    patterns = torch.cat([(top.unsqueeze(1) | low).reshape(-1), torch.randint(0, 1 << 32, (1 << 20,), generator=g)])
    new = (patterns - ((patterns >= 1 << 31).long() << 32)).to(torch.int32).view(torch.float32)  # the uint32 bits
    expect = new.to(BF16)
    old = torch.zeros_like(expect)
    old[::3] = expect[::3]  # a third unchanged
    before = old.clone()
    n = new.numel()
    pos, val = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=BF16)
    fn = native.cast_compaction()
    count = fn(new.data_ptr(), old.data_ptr(), n, 5, pos.data_ptr(), val.data_ptr(), 6, None)
    assert torch.equal(old.view(torch.int16), expect.view(torch.int16))
    changed = torch.nonzero(expect.view(torch.int16) != before.view(torch.int16)).view(-1)
    assert count == changed.numel()
    assert torch.equal(pos[:count].long(), changed + 5)
    assert torch.equal(val[:count].view(torch.int16), expect.view(torch.int16)[changed])


@needs_cc
@pytest.mark.parametrize(("numel", "offset"), [(4099, 1), (1 << 16, 0)])
def test_the_c_count_counts_and_remembers_as_the_mask_does(monkeypatch, numel, offset):
    """A bucket already going whole: its chunks counted (no positions) and `old` overwritten, as the mask's sum."""
    counts = {}
    for enabled in (True, False):
        monkeypatch.setattr(native, "ENABLED", enabled)
        new, old = changed_pair(0.3, numel, offset)
        counts[enabled] = int(kernels.count_chunk(new, old, Scratch()))
        assert torch.equal(old.view(torch.int16), new.view(torch.int16))
    assert counts[True] == counts[False] > 0


def fresh_library(monkeypatch, cache, cls=native.Library) -> native.Library:
    """delta.c's library as a new process sees it, building into `cache` (the user's cache dir)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    library = cls(native.DELTA.source, check=native.bind_delta)
    monkeypatch.setattr(native, "DELTA", library)
    return library


def test_without_a_compiler_numpy_s_steps_run_and_the_reason_names_it(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    library = fresh_library(monkeypatch, tmp_path / "cache")
    new, old = changed_pair(0.01, 4096, 0)
    before = old.clone()
    where, values, _ = compact_chunk(new, old, Scratch(), 7)
    assert library.lib is None and "no-such-cc" in library.why_not() and "no C compiler" in library.why_not()
    assert kernels.native_compaction(new, old) is None
    expect = torch.nonzero(new.view(torch.int16) != before.view(torch.int16)).view(-1)
    assert torch.equal(where.long(), expect + 7)  # numpy's steps, offset and narrowed
    assert torch.equal(values.view(torch.int16), new.view(torch.int16)[expect])
    assert not (tmp_path / "cache").exists()  # nothing built


@needs_cc
def test_a_source_that_does_not_compile_is_unavailable_with_the_compiler_s_line(monkeypatch, tmp_path):
    source = tmp_path / "broken.c"
    source.write_text("int broken( {\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    library = native.Library(source)
    assert library.get() is None
    assert "broken.c" in library.why_not() and "exit" in library.why_not()
    assert not list((tmp_path / "cache").rglob("*broken*"))  # its temporary file removed


def test_turned_off_the_kernel_is_not_built_and_says_so(monkeypatch, tmp_path):
    library = fresh_library(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(native, "ENABLED", False)
    assert native.compaction(2) is None and library.why_not() == native.OFF
    assert not library.tried and not (tmp_path / "cache").exists()


@needs_cc
def test_a_process_without_path_still_builds_and_shares_the_build_of_one_with_it(monkeypatch, tmp_path):
    """Without PATH gcc's collect2 found no `ld` (a whole-suite run hit it): the compiler's environment gets the
    system's default path; the build is named by the compiler's real file, so both processes share one."""
    library = fresh_library(monkeypatch, tmp_path / "cache")
    assert library.why_not() is None
    monkeypatch.delenv("PATH")
    again = native.Library(library.source, check=native.bind_delta)
    assert again.why_not() is None and again.path == library.path and not again.compiled
    library.path.unlink()
    rebuilt = native.Library(library.source, check=native.bind_delta)
    assert rebuilt.why_not() is None and rebuilt.compiled


@needs_cc
def test_two_builds_at_once_into_one_empty_cache_both_load(monkeypatch, tmp_path):
    """Two processes' first use at once (two libraries, as two processes hold): both compile, each to its own
    temporary name renamed into place, and both load the one build; no temporary file is left."""
    both = threading.Barrier(2, timeout=60)

    class AtOnce(native.Library):
        def compile(self, command, path):
            both.wait()  # each has seen no build in the cache: both compile
            super().compile(command, path)

    first = fresh_library(monkeypatch, tmp_path, AtOnce)
    second = AtOnce(native.DELTA.source, check=native.bind_delta)
    threads = [threading.Thread(target=lib.get) for lib in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert first.why_not() is None and second.why_not() is None
    assert first.compiled and second.compiled and first.path == second.path
    assert [p.name for p in (tmp_path / "rlsync" / "kernels").iterdir()] == [first.path.name]


class Engine:
    """The engine side as the delta's apply sees it: bf16 weights by trainer name, written in place."""

    holds_flat_weights = True

    def __init__(self, shapes: dict):
        self.weights = {n: torch.zeros(s, dtype=BF16) for n, s in shapes.items()}

    def load_weights(self, named):
        for name, tensor in named:
            self.weights[name].copy_(tensor)


@needs_cc
def test_a_home_shared_by_another_cpu_or_compiler_gets_its_own_build(monkeypatch, tmp_path):
    """The build's name hashes the CPU's model and features and the compiler's version: another node's CPU (a
    -march=native build would fault here) or compiler never loads this one's build."""
    here = fresh_library(monkeypatch, tmp_path)
    assert here.get() is not None and here.flags  # compiled here, with the flags it took
    monkeypatch.setattr(native, "cpu_identity", lambda: "model name : another CPU")
    other = native.Library(native.DELTA.source, check=native.bind_delta)
    assert other.get() is not None and other.compiled and other.path != here.path
    monkeypatch.setattr(native, "version_of", lambda command: "another compiler 1.0")
    third = native.Library(native.DELTA.source, check=native.bind_delta)
    assert third.get() is not None and len({here.path, other.path, third.path}) == 3


@needs_cc
def test_a_delta_update_through_the_payload_is_numpy_s_byte_for_byte(monkeypatch, tmp_path):
    """DeltaEncoder over several buckets of small chunks on 2 threads: the first update, 1 % changed, nothing
    changed, half changed (the buckets turn whole part-way: counted, not compacted) and 2 %, with the C kernel
    and with numpy's steps: the same encodings (their floors' lines too), bytes sent and last values, and the
    engine where the trainer is. The C kernel casts the float32 tensors in its pass (`bits`: every float32 bit
    pattern, NaNs, infinities, subnormals and bf16 ties among them, as torch's cast rounds them) and compares the
    bfloat16 one as it is."""
    from rlsync.measure.timing import HostTimer
    from rlsync.update.buckets import TensorMeta, plan_buckets
    from rlsync.update.payload.delta import DeltaEncoder, DeltaPayload

    library = fresh_library(monkeypatch, tmp_path)  # built by the first update: none of the later ones waits for it
    monkeypatch.setattr(kernels, "CPU_CHUNK", 4096)  # many chunks a bucket, split over the threads
    straight = []  # the chunks compared straight from the trainer's tensors
    compact_pieces = kernels.compact_pieces
    monkeypatch.setattr(kernels, "compact_pieces", lambda *a, **k: straight.append(1) or compact_pieces(*a, **k))
    g = torch.Generator().manual_seed(5)
    shapes = {"embed": (300, 64), "q": (128, 129), "norm": (65,), "down": (77, 300), "odd": (3, 5, 7)}
    weights = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    weights["bits"] = torch.randint(-(2**31), 2**31 - 1, (90, 70), generator=g, dtype=torch.int32).view(torch.float32)
    weights["bits"][0, :4] = torch.tensor([1.00390625, 1.01171875, -0.0, float("inf")])  # bf16 ties either way
    weights["bf16"] = torch.randn(40, 33, generator=g).to(BF16)  # the engine's dtype already
    shapes.update(bits=(90, 70), bf16=(40, 33))
    buckets = plan_buckets([TensorMeta(n, tuple(t.shape), BF16) for n, t in weights.items()], 48 << 10)
    assert len(buckets) > 1
    encoders = {on: DeltaEncoder(buckets) for on in (True, False)}
    buffers = {on: torch.zeros(max(b.numel for b in buckets), dtype=BF16) for on in (True, False)}
    engine = Engine(shapes)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for step, share in enumerate((0.0, 0.01, 0.0, 0.5, 0.02)):
            for t in weights.values():
                t[torch.rand(t.shape, generator=g) < share] *= -1
            for i, bucket in enumerate(buckets):
                encoded, sent = {}, {}
                for on in (True, False):
                    monkeypatch.setattr(native, "ENABLED", on)
                    assert (kernels.native.cast_compaction() is not None) == on  # which path ran
                    encoded[on] = encoders[on].encode(i, bucket, weights, buffers[on], HostTimer(), {})
                    sent[on] = buffers[on].view(torch.uint8)[: encoded[on].nbytes].clone()
                assert encoded[True] == encoded[False], (step, i)
                assert torch.equal(sent[True], sent[False]), (step, i)
                last = [encoders[on].last[i].view(torch.int16) for on in (True, False)]
                assert torch.equal(*last), (step, i)
                DeltaPayload.decode(engine, bucket, buffers[True], encoded[True])
            for name, t in weights.items():
                assert torch.equal(engine.weights[name].view(torch.int16), t.to(BF16).view(torch.int16)), (step, name)
            assert library.lib is not None, library.why_not()  # from the first update on
        assert encoded[True].mode == SPARSE and encoded[True].count > 0  # the last step's 2 % went sparse
        assert len(straight) > 4 * len(buckets)
    finally:
        torch.set_num_threads(before)


def test_a_run_names_the_kernels_that_timed_its_payload_and_why_a_faster_one_did_not_run(monkeypatch, tmp_path):
    """summary.json's setup `payload_kernels` and the payload's closing line: numpy's steps time another delta
    than delta.c's, so a run says which ran (and, where the C kernel could not, why)."""
    from rlsync.record.summary import payload_line
    from rlsync.update.payload import payload_class

    stats = {"perf/update_weights_full_bytes": {"median": 100.0}, "perf/update_weights_bytes": {"median": 10.0}}
    assert payload_class("full").kernels("cpu") is None and payload_class("delta").kernels("cuda:0") == "torch's ops"
    assert payload_line(stats, "delta", None).endswith("(10.0 %).")  # a run recorded before the key: as it was
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    fresh_library(monkeypatch, tmp_path / "cache")
    kernels = payload_class("delta").kernels("cpu")
    assert kernels.startswith("numpy's steps (delta.c: no C compiler: $CC=") and "no-such-cc" in kernels
    assert payload_line(stats, "delta", kernels).endswith(f" Kernels: {kernels}.")
    monkeypatch.setattr(native, "ENABLED", False)
    assert payload_class("fp8").kernels("cpu").endswith(f"(fp8.c: {native.OFF})")


# ---- delta.c's implementations: the AVX-512 compaction where this CPU has it, the portable C, each bit for bit ----

# what a build is given before delta.c's source: the portable C throughout; nothing (this CPU's, as native.DELTA's)
DELTA_BUILDS = {"portable": "#define RLSYNC_DELTA_PORTABLE 1\n", "native": ""}
AVX512_DELTA = ("avx512f", "avx512bw", "avx512_vbmi2")  # the AVX-512 compaction's features (widths 2 and 4)
NP_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
GUARD = 8  # elements past n in pos[] and val[]: never written


@pytest.fixture(scope="module")
def delta_builds(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    """delta.c built as each of DELTA_BUILDS says (conftest's build_variants)."""
    return build_variants(tmp_path_factory, native.DELTA, native.bind_delta, DELTA_BUILDS)


@needs_cc
def test_this_cpu_s_delta_build_runs_the_avx512_compaction_where_it_has_it(delta_builds):
    """rlsync_delta_paths: 1 the AVX-512 compaction of widths 2 and 4; the portable build never, the cached build
    native.DELTA loads this CPU's."""
    expected = int(all(f in cpu_flags() for f in AVX512_DELTA))
    assert {name: lib.rlsync_delta_paths() for name, lib in delta_builds.items()} == {
        "portable": 0,
        "native": expected,
    }
    assert native.DELTA.get().rlsync_delta_paths() == expected


def reference(new: np.ndarray, old: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray, tuple[int, int, int]]:
    """numpy's compaction: the changed elements' positions (base + index) and bits, and their 64-byte lines."""
    where = np.flatnonzero(new != old)
    lines = (where + base) * new.itemsize // 64
    return (
        (where + base).astype(np.int32),
        new[where],
        (len(np.unique(lines)), *lines[[0, -1]]) if len(lines) else (0, -1, -1),
    )


@needs_cc
@pytest.mark.parametrize("build", list(DELTA_BUILDS))
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("share", [0.0, 0.01, 0.05, 0.3, 1.0])
def test_each_delta_build_s_compaction_is_numpy_s_bit_for_bit(delta_builds, build, width, share):
    """Lengths around the vectors (32 and 16 lanes) and the runs of 64 words, at element offsets that leave the
    pointers unaligned; signed zeros and a NaN kept count as changed (bits compared); positions and values
    written up to the count and never past n, `old` left as `new` and nothing around it touched; without
    positions a count and the copy alone."""
    lib = delta_builds[build]
    fn = getattr(lib, f"rlsync_delta_w{width}")
    bits = NP_BITS[width]
    dtype = {1: torch.float8_e4m3fn, 2: BF16, 4: torch.float32, 8: torch.float64}[width]
    for numel in (1, 15, 16, 17, 31, 32, 33, 255, 256, 257, 1000, 4099, 70001):
        for offset in (0, 1, 3):
            new_t, old_t = changed_pair(share, numel + 2 * offset, 0, seed=numel + offset, dtype=dtype)
            new = new_t.view(BITS[width]).numpy().view(bits)[offset : offset + numel]  # offset from both ends
            whole = old_t.view(BITS[width]).numpy().view(bits)
            before = whole.copy()
            old = whole[offset : offset + numel]
            at = 12_345 + offset
            where, values, lines = reference(new, old, at)
            pos = np.full(numel + GUARD, -7, dtype=np.int32)
            val = np.full(numel + GUARD, 0x5A, dtype=bits)
            got_lines = (ctypes.c_int64 * 3)()
            count = fn(new.ctypes.data, old.ctypes.data, numel, at, pos.ctypes.data, val.ctypes.data, 6, got_lines)
            case = (numel, offset)
            assert count == len(where), case
            assert np.array_equal(pos[:count], where) and np.array_equal(val[:count], values), case
            assert tuple(got_lines) == lines, case
            assert (pos[numel:] == -7).all() and (val[numel:] == 0x5A).all(), case  # nothing past n
            assert np.array_equal(old, new), case
            assert np.array_equal(whole[:offset], before[:offset]) and np.array_equal(
                whole[offset + numel :], before[offset + numel :]
            ), case
            old[:] = before[offset : offset + numel]
            assert fn(new.ctypes.data, old.ctypes.data, numel, at, None, None, 6, None) == len(where), case
            assert np.array_equal(old, new), case
            if numel == 70001 and share in (0.01, 0.3):
                assert 0 < count < numel  # the shares reached: some changed, some not


@needs_cc
@pytest.mark.parametrize("build", list(DELTA_BUILDS))
@pytest.mark.parametrize("share", [0.0, 0.01, 0.05, 0.3, 1.0])
def test_each_delta_build_s_cast_compaction_is_torch_s_cast_then_numpy_s(delta_builds, build, share):
    """float32 against bfloat16 last values: each element cast as torch casts it (NaNs among them), then compared
    and compacted, over lengths past the cast's stage of 2048 and around the vectors, at unaligned offsets."""
    fn = delta_builds[build].rlsync_delta_f32_bf16
    g = torch.Generator().manual_seed(11)
    for numel in (1, 33, 257, 2048, 2049, 4099, 70001):
        for offset in (0, 1):
            src = torch.randn(numel + offset, generator=g)[offset:]
            src[torch.rand(numel, generator=g) < 0.01] = float("nan")
            cast = src.to(BF16).view(torch.int16).numpy().view(np.uint16)
            old_t = torch.empty(numel + 1, dtype=BF16)[1 - offset : 1 - offset + numel]
            old = old_t.view(torch.int16).numpy().view(np.uint16)
            old[:] = cast
            flips = torch.rand(numel, generator=g).numpy() < share
            old[flips] ^= 0x8000  # the last values differ where flipped: those elements changed
            where, values, lines = reference(cast, old, 7)
            pos = np.full(numel + GUARD, -7, dtype=np.int32)
            val = np.full(numel + GUARD, 0x5A, dtype=np.uint16)
            got_lines = (ctypes.c_int64 * 3)()
            count = fn(src.data_ptr(), old.ctypes.data, numel, 7, pos.ctypes.data, val.ctypes.data, 6, got_lines)
            case = (numel, offset)
            assert count == len(where) and tuple(got_lines) == lines, case
            assert np.array_equal(pos[:count], where) and np.array_equal(val[:count], values), case
            assert (pos[numel:] == -7).all() and (val[numel:] == 0x5A).all(), case
            assert np.array_equal(old, cast), case
