import pytest
import torch

from rlsync.update.buckets import TensorMeta, largest_bucket_bytes, plan_buckets

BF16 = torch.bfloat16


def metas(*sizes, dtype=BF16):
    return [TensorMeta(f"t{i}", (n,), dtype) for i, n in enumerate(sizes)]


@pytest.mark.parametrize(
    "sizes,bucket_bytes,expected",
    [
        ((10, 10, 10), 40, [["t0", "t1"], ["t2"]]),  # 2 bytes each: 20 + 20 fits 40, the third overflows
        ((10, 10, 10), 60, [["t0", "t1", "t2"]]),  # exactly full
        ((10, 50, 10), 40, [["t0"], ["t1"], ["t2"]]),  # 100-byte tensor alone in its own bucket
        ((50,), 40, [["t0"]]),  # a single oversized tensor still travels
        ((5, 5, 5, 5), 1 << 30, [["t0", "t1", "t2", "t3"]]),  # everything in one
    ],
)
def test_plan_by_bytes(sizes, bucket_bytes, expected):
    buckets = plan_buckets(metas(*sizes), bucket_bytes)
    assert [b.names for b in buckets] == expected


def test_offsets_are_contiguous_and_sizes_add_up():
    buckets = plan_buckets(metas(3, 4, 5, 6), 20)
    for b in buckets:
        offsets = [s.offset for s in b.slots]
        assert offsets[0] == 0
        assert all(s.offset + s.meta.numel == nxt for s, nxt in zip(b.slots, offsets[1:]))
        assert b.numel == sum(s.meta.numel for s in b.slots)
    assert sum(b.nbytes for b in buckets) == 2 * (3 + 4 + 5 + 6)
    assert largest_bucket_bytes(buckets) == max(b.nbytes for b in buckets)


def test_dtype_change_starts_a_new_bucket():
    ms = [*metas(2, 2), TensorMeta("f", (2,), torch.float32)]
    assert [b.names for b in plan_buckets(ms, 1 << 20)] == [["t0", "t1"], ["f"]]


def test_plan_is_deterministic_and_rejects_nonpositive_size():
    assert plan_buckets(metas(7, 9, 3), 16) == plan_buckets(metas(7, 9, 3), 16)
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(metas(1), 0)
