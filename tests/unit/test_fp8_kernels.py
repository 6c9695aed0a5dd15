"""fp8.c (FP8's block quantize and dequantize on a CPU, built by native.py) is fp8.py's reference bit for bit: its
e4m3 conversions are torch's, its blocks' scales and values and its bf16 and float32 dequantize the reference's on
every kind of value, on whole blocks and on tensors with partial edge blocks, and an FP8 update through the payload
runs it over the threads; without a C compiler the torch path runs and the reason says why."""

from __future__ import annotations

import ctypes
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import build_variants, cpu_flags, needs_cc

import rlsync
from rlsync.update.payload import kernels, native
from rlsync.update.payload.fp8 import dequantize_blocks, quantize_blocks

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def library() -> ctypes.CDLL:
    lib = native.fp8_kernels()
    assert lib is not None, native.FP8.why_not()  # a compiler is here: the kernel must build
    return lib


def e4m3_values() -> torch.Tensor:
    """Every finite e4m3fn value, ascending, as float32."""
    every = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    return every[torch.isfinite(every)].unique()


def hard_values(rows: int, cols: int) -> torch.Tensor:
    """Magnitudes over 15 decades (e4m3's subnormal results and its top, after scaling), signed zeros, and per
    block (as many as fit): exact ties between two e4m3 values (scale 1: the block's amax is 448), values that
    round up to 448, a NaN, an infinity, an all-zero block."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-12, 3, rows * cols)[
        torch.randperm(rows * cols, generator=g)
    ].view(rows, cols)
    x[0, :6] = torch.tensor([-0.0, 0.0, 1e-30, -1e-30, 1e-12, -3e-9])
    e4m3 = e4m3_values()
    ties = (e4m3[1:] + e4m3[:-1]) / 2  # exact in float32: round to even decides
    ties = ties[ties.abs() < 448]
    k = min(ties.numel(), 128 * 128 - 8)
    tie_block = torch.zeros(128 * 128)
    tie_block[:k] = ties[torch.randperm(ties.numel(), generator=g)[:k]]
    tie_block[-8:] = torch.tensor([448.0, -448.0, 432.0, -432.0, 447.9, 440.0, 1e-3 * 2**-3, 2**-9 * 1.5])
    blocks = [tie_block.view(128, 128)]
    nan_block = x[:128, :128].clone()
    nan_block[7, 9] = float("nan")
    inf_block = x[:128, :128].clone()
    inf_block[3, 5], inf_block[100, 2] = float("inf"), -float("inf")
    blocks += [nan_block, inf_block, torch.zeros(128, 128)]
    for i, block in enumerate(blocks[: (rows // 128) * (cols // 128) - 1]):
        r, c = divmod(i + 1, cols // 128)  # block (0, 0) keeps the spread of magnitudes
        x[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128] = block
    return x


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.view(BITS.get(a.dtype, torch.uint8)), b.view(BITS.get(b.dtype, torch.uint8))
    )


@needs_cc
def test_the_e4m3_conversions_are_torch_s_for_every_byte_and_many_floats():
    lib = library()
    every = torch.arange(256, dtype=torch.uint8)
    wide = torch.empty(256)
    lib.rlsync_fp8_to_float(every.data_ptr(), 256, wide.data_ptr())
    assert torch.equal(wide.view(torch.int32), every.view(FP8).float().view(torch.int32))  # NaNs' bits too
    g = torch.Generator().manual_seed(1)
    e4m3 = e4m3_values()
    ties = (e4m3[1:] + e4m3[:-1]) / 2
    near = torch.cat([ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])
    random_bits = torch.randint(-(2**31), 2**31, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    specials = torch.tensor([0.0, -0.0, 448.0, 464.0, 480.0, 1e38, float("inf"), -float("inf"), float("nan")])
    x = torch.cat([near, -near, random_bits.view(torch.float32), specials])
    q = torch.empty(x.numel(), dtype=torch.uint8)
    lib.rlsync_fp8_from_float(x.data_ptr(), x.numel(), q.data_ptr())
    assert torch.equal(q, x.to(FP8).view(torch.uint8))


@needs_cc
@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (1024, 128), (128, 8448)])
def test_the_quantize_and_dequantize_are_the_reference_bit_for_bit(shape):
    """Over its block rows in two calls (as two threads split them), into bf16 and float32; 8448 columns: a band
    read by 64 block columns, then one (fp8.c's GROUP)."""
    library()
    x = hard_values(*shape)
    q, scale = torch.empty(shape, dtype=FP8), torch.empty(shape[0] // 128, shape[1] // 128)
    job = kernels.native_quantize(x, q, scale)
    assert job is not None
    half = scale.shape[0] // 2
    job(half, scale.shape[0])
    job(0, half)
    ref_q, ref_scale = quantize_blocks(x)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32))
    if shape == (256, 384):  # the kinds of value the blocks hold: each reached
        assert torch.isnan(q.float()).any() and (q.view(torch.uint8) == 0x7E).any()  # NaN; 448
        assert ((q.view(torch.uint8) & 0x78) == 0).logical_and(q.float() != 0).any()  # subnormal results
        assert (scale == 1).sum() >= 3  # the ties' (amax 448), the NaN's and the all-zero block's
        assert torch.isinf(scale).any()
    for dtype in (BF16, torch.float32):
        out = torch.empty(shape, dtype=dtype)
        job = kernels.native_dequantize(q, scale, out)
        assert job is not None
        job(0, half)
        job(half, scale.shape[0])
        assert bits_equal(out, dequantize_blocks(ref_q, ref_scale, dtype)), dtype


def test_what_fp8_c_does_not_take_goes_elsewhere(monkeypatch):
    """Not contiguous, shapes that are not the values' and their blocks' (it writes through pointers), not float32
    at the source or an engine dtype it has no kernel for, and NUMPY_ON_CPU off (tests/unit/test_payload_floors.py's
    torch ops): None, the torch path serves."""
    x, q, scale = torch.zeros(256, 256), torch.empty(256, 256, dtype=FP8), torch.empty(2, 2)
    assert kernels.native_quantize(x.t().contiguous().t()[:, :128], q[:, :128], scale[:, :1]) is None
    assert kernels.native_quantize(torch.zeros(256, 200), torch.empty(256, 200, dtype=FP8), torch.empty(2, 1)) is None
    assert kernels.native_quantize(torch.zeros(256, 200), q, scale) is None
    assert kernels.native_dequantize(q[:, :100].contiguous(), scale, torch.empty(256, 100, dtype=BF16)) is None
    assert kernels.native_dequantize(q, scale, torch.empty(256, 200, dtype=BF16)) is None
    assert kernels.native_quantize(x.to(BF16), q, scale) is None
    assert kernels.native_dequantize(q, scale, torch.empty(256, 256, dtype=torch.float16)) is None
    monkeypatch.setattr(kernels, "NUMPY_ON_CPU", False)
    assert kernels.native_quantize(x, q, scale) is None
    assert kernels.native_dequantize(q, scale, torch.empty(256, 256, dtype=BF16)) is None


def tiny_moe_expert_shapes() -> list[tuple[int, int]]:
    """The tiny_moe model's expert projections (rlsync/conf/model/hf/tiny_moe.json): its 3,072 expert tensors,
    each one partial 128x128 block."""
    config = json.loads((Path(rlsync.__file__).parent / "conf" / "model" / "hf" / "tiny_moe.json").read_text())
    inner, hidden = config["moe_intermediate_size"], config["hidden_size"]
    return [(inner, hidden), (hidden, inner)]


@needs_cc
def test_tiny_moe_s_expert_tensors_of_one_partial_block_take_fp8_c():
    """Each way through kernels' jobs (what the payload runs), bit for bit, not the eager chunks."""
    library()
    g = torch.Generator().manual_seed(5)
    for shape in tiny_moe_expert_shapes():
        assert not kernels.whole_blocks(torch.empty(shape)), shape
        x = torch.randn(shape, generator=g) * 0.02
        q, scale = torch.empty(shape, dtype=FP8), torch.empty(kernels.blocks_of(shape))
        job = kernels.native_quantize(x, q, scale)
        assert job is not None, shape
        job(0, 1)
        ref_q, ref_scale = quantize_blocks(x)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and bits_equal(scale, ref_scale), shape
        for dtype in (BF16, torch.float32):
            out = torch.empty(shape, dtype=dtype)
            job = kernels.native_dequantize(q, scale, out)
            assert job is not None, (shape, dtype)
            job(0, 1)
            assert bits_equal(out, dequantize_blocks(ref_q, ref_scale, dtype)), (shape, dtype)


class Engine:
    holds_flat_weights = True

    def __init__(self, shapes: dict[str, tuple], dtype: torch.dtype):
        self.weights = {n: torch.zeros(s, dtype=dtype) for n, s in shapes.items()}


def fp8_update(weights: dict[str, torch.Tensor], dtype: torch.dtype, threads: int):
    """Every bucket of `weights` encoded by Fp8Encoder and decoded into an engine of `dtype` on `threads` threads
    (small chunks: each tensor's block rows split over them); the engine's weights and the reference's."""
    from rlsync.measure.timing import HostTimer
    from rlsync.update.buckets import TensorMeta, plan_buckets
    from rlsync.update.payload.fp8 import Fp8Encoder, Fp8Payload, reference

    buckets = plan_buckets([TensorMeta(n, tuple(t.shape), dtype) for n, t in weights.items()], 1 << 20)
    engine = Engine({n: tuple(t.shape) for n, t in weights.items()}, dtype)
    encoder = Fp8Encoder()
    buffer = torch.zeros(max(b.numel for b in buckets), dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, bucket in enumerate(buckets):
            encoded = encoder.encode(i, bucket, weights, buffer, HostTimer(), {})
            Fp8Payload.decode(engine, bucket, buffer, encoded)
    finally:
        torch.set_num_threads(before)
    slots = {s.meta.name: s for b in buckets for s in b.slots}
    return engine.weights, {n: reference(slots[n], t, dtype) for n, t in weights.items()}


SHAPES = {
    "q_proj": (512, 256),
    "down_proj": (256, 640),
    "odd_proj": (200, 130),
    "norm": (256,),
    "wide": (128, 1152),
    "experts.0.up_proj": (32, 64),  # tiny_moe's experts: one partial block each
    "experts.0.down_proj": (64, 32),
}


@needs_cc
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_an_fp8_update_through_the_payload_runs_fp8_c_on_the_threads_and_is_the_reference(
    monkeypatch, eager_kernels, dtype
):
    library()
    monkeypatch.setattr(kernels, "CPU_CHUNK", 128 * 128)  # a block row a chunk: several per tensor, split
    ran = []  # the calls fp8.c took (a job, not None)

    def spy(real, name):
        def call(*args):
            job = real(*args)
            if job is not None:
                ran.append(name)
            return job

        return call

    for name in ("native_quantize", "native_dequantize"):
        monkeypatch.setattr(f"rlsync.update.payload.fp8.{name}", spy(getattr(kernels, name), name))
    g = torch.Generator().manual_seed(4)
    weights = {n: torch.randn(s, generator=g) * 0.02 for n, s in SHAPES.items()}
    weights["wide"][5, 7] = float("nan")
    got, expected = fp8_update(weights, dtype, threads=2)
    for name in SHAPES:
        assert bits_equal(got[name], expected[name]), name
    two_d = sum(len(s) == 2 for s in SHAPES.values())
    assert ran.count("native_quantize") == ran.count("native_dequantize") == two_d  # partial blocks' too


@needs_cc
def test_without_a_compiler_the_torch_kernels_run_and_the_reason_names_it(monkeypatch, tmp_path, eager_kernels):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fresh = native.Library(native.FP8.source, check=native.bind_fp8)
    monkeypatch.setattr(native, "FP8", fresh)
    g = torch.Generator().manual_seed(6)
    weights = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    got, expected = fp8_update(weights, BF16, threads=1)
    for name in SHAPES:
        assert bits_equal(got[name], expected[name]), name
    assert fresh.lib is None and "no C compiler" in fresh.why_not() and "no-such-cc" in fresh.why_not()
    assert kernels.native_quantize(weights["q_proj"], torch.empty(512, 256, dtype=FP8), torch.empty(4, 2)) is None
    assert not (tmp_path / "cache").exists()  # nothing built


@needs_cc
def test_a_build_whose_self_check_fails_is_not_used(monkeypatch, tmp_path):
    """fp8.c with its saturation at 448 broken (the portable C's and the AVX-512 one's): built, loaded, refused by
    bind_fp8's check, the reason given."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    text = native.FP8.source.read_text()
    scalar, vector = "normal = normal == 0x7F ? 0x7E : normal;", "r = _mm512_min_epu32(r, SPLAT(0x7E));"
    assert scalar in text and vector in text
    broken = text.replace(scalar, "").replace(vector, "")
    source = tmp_path / "fp8.c"
    source.write_text(broken)
    wrong = native.Library(source, check=native.bind_fp8)
    assert wrong.get() is None and "self-check" in wrong.why_not()


# ---- fp8.c's implementations: the AVX-512 ones where this CPU has them, the portable C, each bit for bit ----

AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
# what a build is given before fp8.c's source: the portable C throughout; the AVX-512 quantize with the portable
# bf16 dequantize (a CPU without VBMI's byte permutes); nothing (this CPU's build, as native.FP8 builds it)
BUILDS = {
    "portable": "#define RLSYNC_FP8_PORTABLE 1\n",
    "avx512 without vbmi": "#define RLSYNC_FP8_NO_VBMI 1\n",
    "native": "",
}


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    """fp8.c built as each of BUILDS says (conftest's build_variants)."""
    return build_variants(tmp_path_factory, native.FP8, native.bind_fp8, BUILDS)


@needs_cc
def test_this_cpu_s_build_runs_the_avx512_paths_where_it_has_them(builds):
    """rlsync_fp8_paths: 1 the AVX-512 quantize and float32 dequantize, 2 the VBMI lookup of the bf16 one; the
    portable build neither, the build without VBMI the first alone, and the cached build native.FP8 loads is
    this CPU's."""
    flags = cpu_flags()
    avx512 = all(f in flags for f in AVX512)
    expected = int(avx512) | int(avx512 and "avx512vbmi" in flags) << 1
    paths = {name: lib.rlsync_fp8_paths() for name, lib in builds.items()}
    assert paths == {"portable": 0, "avx512 without vbmi": int(avx512), "native": expected}
    assert library().rlsync_fp8_paths() == expected


def edge_blocks() -> torch.Tensor:
    """One band of blocks whose scale is not a normal float or whose values sit at the range's ends: a subnormal
    scale (amax 1e-41, 1e-37), a zero one (amax 1e-44: x / 0), float32's largest magnitudes, an all-zero block,
    and a block of e4m3's subnormal results beside 448 (their quotients' smallest and largest)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(128, 128 * 7, generator=g)
    for j, amax in enumerate([1e-41, 1e-37, 1e-44, 3.0e38, 0.0, 1.0]):
        block = x[:, j * 128 : (j + 1) * 128]
        block.mul_(amax / block.abs().max())
    last = x[:, 6 * 128 :]
    last.mul_(2.0**-12)  # quotients near e4m3's subnormals, some below its smallest
    last[0, 0] = 448.0
    return x


@needs_cc
@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("shape", [(256, 384), (128, 8448), (512, 1024), "edges"])
def test_each_build_s_quantize_and_dequantize_are_the_reference_bit_for_bit(builds, build, shape):
    """Each build over its block rows in two calls, into outputs 64-byte aligned (streaming stores) and not (an
    element further: regular stores), into bf16 and float32."""
    lib = builds[build]
    x = edge_blocks() if shape == "edges" else hard_values(*shape)
    rows, cols = x.shape
    nb, half = rows // 128, rows // 256
    ref_q, ref_scale = quantize_blocks(x)
    for skew in (0, 1):
        store = torch.empty(x.numel() + 64, dtype=torch.uint8)
        q, scale = store[skew : skew + x.numel()], torch.empty(nb, cols // 128)
        lib.rlsync_fp8_quantize(x.data_ptr(), rows, cols, half, nb, q.data_ptr(), scale.data_ptr())
        lib.rlsync_fp8_quantize(x.data_ptr(), rows, cols, 0, half, q.data_ptr(), scale.data_ptr())
        assert torch.equal(q.view(rows, cols), ref_q.view(torch.uint8)), skew
        assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32)), skew
        for dtype, name in ((BF16, "bf16"), (torch.float32, "f32")):
            out = torch.empty(x.numel() + 64, dtype=dtype)[skew : skew + x.numel()].view(rows, cols)
            fn = getattr(lib, f"rlsync_fp8_dequantize_{name}")
            fn(ref_q.data_ptr(), ref_scale.data_ptr(), rows, cols, half, nb, out.data_ptr())
            fn(ref_q.data_ptr(), ref_scale.data_ptr(), rows, cols, 0, half, out.data_ptr())
            assert bits_equal(out, dequantize_blocks(ref_q, ref_scale, dtype)), (name, skew)


@needs_cc
@pytest.mark.parametrize("build", list(BUILDS))
def test_each_build_s_e4m3_conversions_are_torch_s(builds, build):
    """Every byte to float32 and back, and 2^18 random float32 bit patterns (NaNs, infinities, subnormals), over
    a count that leaves a tail past the vectors' 16."""
    lib = builds[build]
    every = torch.arange(256, dtype=torch.uint8)
    wide = torch.empty(256)
    lib.rlsync_fp8_to_float(every.data_ptr(), 256, wide.data_ptr())
    assert torch.equal(wide.view(torch.int32), every.view(FP8).float().view(torch.int32))
    g = torch.Generator().manual_seed(8)
    bits = torch.randint(-(2**31), 2**31, ((1 << 18) + 7,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat([wide, bits.view(torch.float32)])
    q = torch.empty(x.numel(), dtype=torch.uint8)
    lib.rlsync_fp8_from_float(x.data_ptr(), x.numel(), q.data_ptr())
    assert torch.equal(q, x.to(FP8).view(torch.uint8))


KINDS = ("spread", "zero", "nan", "inf", "ties")  # what ragged_values' blocks hold


def ragged_values(rows: int, cols: int, offset: int) -> torch.Tensor:
    """A tensor whose blocks, whole and partial, each hold one of KINDS, cycling from `offset`: hard_values' spread
    of magnitudes (e4m3's subnormal results among them), all zero, a NaN, both infinities, exact ties between e4m3
    values beside 448 (scale 1); the NaN and an infinity at the block's last row and column in the tensor, beside
    the reference's padding."""
    g = torch.Generator().manual_seed(9 + offset)
    n = rows * cols
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-12, 3, n)[torch.randperm(n, generator=g)].view(
        rows, cols
    )
    e4m3 = e4m3_values()
    ties = (e4m3[1:] + e4m3[:-1]) / 2
    ties = ties[ties.abs() < 448]
    bc = kernels.blocks_of((rows, cols))[1]
    for i in range(math.prod(kernels.blocks_of((rows, cols)))):
        r, c = divmod(i, bc)
        block = x[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128]
        kind = KINDS[(i + offset) % len(KINDS)]
        if kind == "zero":
            block.zero_()
        elif kind == "nan":
            block[-1, -1] = float("nan")
        elif kind == "inf":
            block[0, 0], block[-1, -1] = float("inf"), -float("inf")
        elif kind == "ties":
            block.copy_(ties[torch.randint(ties.numel(), block.shape, generator=g)])
            block[0, 0] = -448.0
    return x


# rows or columns not multiples of 128: one partial block (tiny_moe's experts), a partial block row and column, a
# partial column alone, a partial row alone, whole blocks beside a partial column of 64-byte rows (streaming stores)
RAGGED = [(32, 64), (64, 32), (1, 1), (127, 129), (130, 257), (128, 300), (300, 128), (130, 192)]


@needs_cc
@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("shape", [*RAGGED, "edges"], ids=lambda s: s if isinstance(s, str) else "x".join(map(str, s)))
def test_each_build_takes_partial_edge_blocks_bit_for_bit(builds, build, shape):
    """Tensors with partial edge blocks: every kind of block at every position (ragged_values, each offset), and
    edge_blocks' scales cut to 100 rows and 6 block columns and 77 values ("edges"). Each build over its block rows
    in two calls, the first the later block rows (the partial last one among them), into outputs 64-byte aligned
    and not; each call writes its block rows alone, and nothing is written either side of the tensor."""
    lib = builds[build]
    if shape == "edges":
        tensors = [edge_blocks()[:100, : 6 * 128 + 77].contiguous()]
    else:
        tensors = [ragged_values(*shape, offset) for offset in range(len(KINDS))]
    for x in tensors:
        rows, cols = x.shape
        nb, nc = kernels.blocks_of(x.shape)
        half, n = nb // 2, x.numel()
        ref_q, ref_scale = quantize_blocks(x)
        for skew in (0, 1):
            store = torch.full((n + 64,), 0xA5, dtype=torch.uint8)
            q, scale = store[skew : skew + n], torch.full((nb, nc), -1.0)
            lib.rlsync_fp8_quantize(x.data_ptr(), rows, cols, half, nb, q.data_ptr(), scale.data_ptr())
            assert (q[: half * 128 * cols] == 0xA5).all() and (scale[:half] == -1).all(), skew  # its block rows alone
            lib.rlsync_fp8_quantize(x.data_ptr(), rows, cols, 0, half, q.data_ptr(), scale.data_ptr())
            assert torch.equal(q.view(rows, cols), ref_q.view(torch.uint8)), skew
            assert bits_equal(scale, ref_scale), skew
            assert (store[:skew] == 0xA5).all() and (store[skew + n :] == 0xA5).all(), skew
            for dtype, name in ((BF16, "bf16"), (torch.float32, "f32")):
                fill = torch.full((n + 64,), 3.0, dtype=dtype)
                out = fill[skew : skew + n].view(rows, cols)
                fn = getattr(lib, f"rlsync_fp8_dequantize_{name}")
                fn(ref_q.data_ptr(), ref_scale.data_ptr(), rows, cols, half, nb, out.data_ptr())
                assert (out[: half * 128] == 3).all(), (name, skew)
                fn(ref_q.data_ptr(), ref_scale.data_ptr(), rows, cols, 0, half, out.data_ptr())
                assert bits_equal(out, dequantize_blocks(ref_q, ref_scale, dtype)), (name, skew)
                assert (fill[:skew] == 3).all() and (fill[skew + n :] == 3).all(), (name, skew)
