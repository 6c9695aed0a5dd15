"""The delta's two implementations of one compaction agree: numpy's on a CPU, torch's (CUDA's, and the one
tests/unit/test_payload_floors.py counts the bytes of) element for element, and both are bit for bit."""

from __future__ import annotations

import pytest
import torch

from rlsync.update.payload import kernels
from rlsync.update.payload.kernels import Scratch, changed_in_chunk, scatter_changed

BF16 = torch.bfloat16


def changed_pair(share: float, numel: int, offset: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(numel + offset, generator=g).to(BF16)[offset:]
    new = old.clone()
    flips = torch.rand(numel, generator=g) < share
    new[flips] = -new[flips]
    if numel > 3:  # the comparisons a value compare would miss: -0.0 against 0.0, a NaN kept
        old[1], new[1] = 0.0, -0.0
        old[2] = new[2] = float("nan")
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


@pytest.mark.parametrize("on_host", [True, False])
def test_the_apply_writes_the_changed_elements_of_whole_tensors_and_of_views_into_fused_ones(monkeypatch, on_host):
    monkeypatch.setattr(kernels, "NUMPY_ON_CPU", on_host)
    fused = torch.zeros(4, 6, 8, dtype=BF16)
    expert = fused[2]  # contiguous rows of a fused tensor
    strided = fused[:, 1]  # a view with gaps
    for target in (torch.zeros(6, 8, dtype=BF16), expert, strided):
        where = torch.tensor([0, 5, 17, target.numel() - 1], dtype=torch.int32)
        values = torch.tensor([1.0, -2.0, 3.0, 4.5], dtype=BF16)
        scatter_changed(target, where, values)
        assert torch.equal(target.reshape(-1)[where.long()], values)
        assert int((target != 0).sum()) == 4
    assert int((fused != 0).sum()) == 8  # the expert's four and the strided view's four, nothing else


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
