"""Each payload's declared floor (Payload.floor: the bytes its kernels must read and write per bucket) against
the bytes its kernels touch, counted op by op.

`Touched` watches every aten op (a TorchDispatchMode) and marks, per byte of the tensors that live in memory
(the trainer's weights, the staging buffer, the delta's last values, the engine's weights), whether an op read
or wrote it: a byte counts once however often it is touched (a re-read of a chunk just read hits the cache), a
gather only the elements it indexes, a scatter the 64-byte lines of the elements it writes (each line read and
written whole by the memory: the delta's floor counts them, kernels.LINE_BYTES), a view nothing. The kernels' own chunk scratch is cache, not
counted. One torch thread, so the kernels run in this thread where the mode sees them."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlsync.measure.devices import copy_into
from rlsync.measure.timing import HostTimer
from rlsync.update.buckets import TensorMeta, plan_buckets
from rlsync.update.payload import kernels
from rlsync.update.payload.base import Floor
from rlsync.update.payload.delta import DeltaEncoder, DeltaPayload
from rlsync.update.payload.fp8 import Fp8Encoder, Fp8Payload
from rlsync.update.payload.full import FullEncoder, FullPayload
from rlsync.update.payload.kernels import Compiled
from rlsync.update.payload.lora import LoraAdapterPayload

BF16 = torch.bfloat16
aten = torch.ops.aten
SCATTERS = {aten.index_copy_.default: 2, aten.index_copy.default: 2}  # op -> position of its index argument
GATHERS = {aten.index_select.default: 2, aten.index_select.out: 2}
UNCOUNTED = {aten.searchsorted.Tensor, aten._local_scalar_dense.default}  # a binary search; one scalar


def element_offsets(t: torch.Tensor) -> torch.Tensor:
    """Every element of the view `t` as an element offset into its storage (flat, in `t`'s dtype)."""
    numel = t.untyped_storage().nbytes() // t.element_size()
    return torch.arange(numel).as_strided(t.shape, t.stride(), t.storage_offset())


class Touched(TorchDispatchMode):
    """Marks every byte any op reads or writes, per storage; `floor(memory)` sums those of the tensors that
    live in memory, named after the call (the delta's last values are allocated inside its first encode)."""

    def __init__(self):
        super().__init__()
        self.marks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def mark(self, t: torch.Tensor, write: bool, offsets: torch.Tensor | None = None, lines: bool = False) -> None:
        if t.device.type != "cpu" or not t.numel():
            return
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())  # a freed temporary's address may come back, another size
        if key not in self.marks:
            self.marks[key] = tuple(torch.zeros(storage.nbytes(), dtype=torch.bool) for _ in "rw")
        read_mask, write_mask = self.marks[key]
        offsets = element_offsets(t).reshape(-1) if offsets is None else offsets.reshape(-1)
        size = t.element_size()
        index = ((offsets * size).unsqueeze(1) + torch.arange(size)).reshape(-1)
        if lines:  # every byte of the lines they fall in (the storage starts on a line), read and written
            line = kernels.LINE_BYTES["cpu"]
            index = ((index // line).unique().unsqueeze(1) * line + torch.arange(line)).reshape(-1)
            index = index[index < storage.nbytes()]
            read_mask[index] = True
        (write_mask if write else read_mask)[index] = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if func in UNCOUNTED or (schema.returns and schema.returns[0].alias_info is not None and not writes):
            return out  # a view reads nothing
        values = {a.name: v for a, v in zip(schema.arguments, args)} | kwargs
        for arg in schema.arguments:
            value = values.get(arg.name)
            write = arg.alias_info is not None and arg.alias_info.is_write
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if not isinstance(t, torch.Tensor) or not t.numel():
                    continue
                if func in SCATTERS and write:  # only the indexed elements' lines are read and written
                    self.mark(t, True, element_offsets(t).reshape(t.shape[0], -1)[values["index"].long()], lines=True)
                elif func in GATHERS and arg.name == "self":  # only the indexed elements are read
                    self.mark(t, False, element_offsets(t).reshape(t.shape[0], -1)[values["index"].long()])
                elif not ((func in SCATTERS or func in GATHERS) and arg.name == "index"):
                    self.mark(t, write)
        return out

    def floor(self, memory: list[torch.Tensor]) -> tuple[int, int]:
        """Bytes read and written of the storages of `memory`."""
        held = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in memory}
        marks = [m for ptr, m in self.marks.items() if ptr in held]
        return int(sum(r.sum() for r, _ in marks)), int(sum(w.sum() for _, w in marks))


class Engine:
    """The engine side as a decode sees it: bf16 weights by trainer name, held in place."""

    holds_flat_weights = True

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = {n: torch.zeros(t.shape, dtype=BF16) for n, t in weights.items()}

    def load_weights(self, named):
        for name, tensor in named:
            copy_into(self.weights[name], tensor)


@pytest.fixture(autouse=True)
def eager_in_one_thread(monkeypatch):
    """The kernels' chunks in this thread, where the mode sees their ops, and FP8's eager kernels (a compiled
    kernel's loops run outside the dispatcher: tests/unit/test_fp8.py checks them against the reference)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(Compiled, "enabled", False)
    monkeypatch.setattr(kernels, "NUMPY_ON_CPU", False)  # numpy's loops run outside the dispatcher too
    yield
    torch.set_num_threads(before)


def trainer(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "model.embed_tokens.weight": (96, 64),  # FP8 keeps it in bf16
        "model.layers.0.self_attn.q_proj.weight": (256, 384),  # whole 128x128 blocks
        "model.layers.0.mlp.down_proj.weight": (200, 300),  # partial blocks, padded
        "model.layers.0.input_layernorm.weight": (64,),  # 1-D
    }
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def count(encoder, payload, weights, buckets, engine) -> list[tuple[Floor, Floor]]:
    """Per bucket: (declared, touched) floors of one encode and its decode."""
    out = []
    buffer = torch.zeros(max(b.numel for b in buckets), dtype=BF16)
    for i, bucket in enumerate(buckets):
        with Touched() as encode_mode:
            encoded = encoder.encode(i, bucket, weights, buffer, HostTimer(), {})
        with Touched() as decode_mode:
            payload.decode(engine, bucket, buffer, encoded)
        last = [t for t in getattr(encoder, "last", []) if t is not None]
        er, ew = encode_mode.floor([*weights.values(), buffer, *last])
        dr, dw = decode_mode.floor([buffer, *engine.weights.values()])
        out.append((encoded.floor, Floor(er, ew, dr, dw)))
    return out


def plan(weights, bucket_bytes=1 << 16):
    return plan_buckets([TensorMeta(n, tuple(t.shape), BF16) for n, t in weights.items()], bucket_bytes)


def test_the_full_payloads_floor_is_what_its_pack_and_load_touch():
    weights = trainer()
    buckets = plan(weights)
    for declared, touched in count(FullEncoder(), FullPayload, weights, buckets, Engine(weights)):
        assert declared == touched
        assert declared.encode_read == sum(weights[n].nbytes for n in buckets[0].names) or len(buckets) > 1


@pytest.mark.parametrize("share", [0.0, 0.01, 0.1])
def test_the_deltas_floor_is_what_its_one_pass_touches(share):
    """The first update (whole, kept), then one with `share` of the elements changed (sparse): each bucket's
    encode reads the trainer's tensors and the last values once, and writes what crosses and the lines of the
    changed last values; the apply reads what crossed and reads and writes the lines of the changed elements."""
    weights = trainer()
    buckets = plan(weights)
    engine, encoder = Engine(weights), DeltaEncoder(buckets)
    for declared, touched in count(encoder, DeltaPayload, weights, buckets, engine):
        assert declared == touched
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in weights.values():
            t[torch.rand(t.shape, generator=g) < share] *= -1
    pairs = count(encoder, DeltaPayload, weights, buckets, engine)
    for declared, touched in pairs:
        assert declared == touched
    changed = sum(d.decode_written for d, _ in pairs) // 64
    assert (changed == 0) == (share == 0)
    for name, t in weights.items():
        assert torch.equal(engine.weights[name], t.to(BF16)), name


def test_a_delta_bucket_that_turns_whole_touches_no_less_than_its_floor():
    weights = trainer()
    buckets = plan(weights)
    engine, encoder = Engine(weights), DeltaEncoder(buckets)
    count(encoder, DeltaPayload, weights, buckets, engine)
    with torch.no_grad():
        for t in weights.values():
            t *= -1
    for declared, touched in count(encoder, DeltaPayload, weights, buckets, engine):
        assert (declared.encode_read, declared.decode_read, declared.decode_written) == (
            touched.encode_read,
            touched.decode_read,
            touched.decode_written,
        )
        assert touched.encode_written >= declared.encode_written


def test_fp8s_floor_is_what_its_quantize_and_dequantize_touch():
    """Whole and padded 128x128 blocks, a kept embedding and a norm: the trainer's tensors read once, the e4m3
    values, scales and kept tensors written once; the engine's every element written once."""
    weights = trainer()
    buckets = plan(weights, 1 << 20)
    pairs = count(Fp8Encoder(), Fp8Payload, weights, buckets, Engine(weights))
    for declared, touched in pairs:
        assert declared == touched
    assert sum(d.encode_written for d, _ in pairs) < sum(b.nbytes for b in buckets)  # FP8 did shrink it


def test_the_lora_adapter_payloads_floor_is_the_sent_buckets_only():
    weights = {
        "base.weight": torch.randn(64, 64),
        "base.lora_A.weight": torch.randn(4, 64),
        "base.lora_B.weight": torch.randn(64, 4),
    }
    metas = [TensorMeta(n, tuple(t.shape), BF16) for n, t in weights.items()]
    buckets = LoraAdapterPayload.plan(metas, 1 << 20)
    encoder, engine = LoraAdapterPayload.encoder(buckets, torch.device("cpu")), Engine(weights)
    count(encoder, LoraAdapterPayload, weights, buckets, engine)  # the first update: the base too
    pairs = count(encoder, LoraAdapterPayload, weights, buckets, engine)
    for declared, touched in pairs:
        assert declared == touched
    assert pairs[0][0] == Floor() and pairs[-1][0].encode_read == 2 * 4 * 64 * 4  # the base stays; A and B cross


def test_the_planned_lines_are_what_changes_at_random_places_touch():
    """The planner's delta floor (no encode to count them): the lines that `changed` elements at random places
    fall in on average, on the plan's device (a GPU's 32-byte sectors: fewer bytes than a CPU's 64-byte lines),
    within 3 % of what the encoder counts for such changes."""
    from rlsync.update.payload.base import PlanContext
    from rlsync.update.payload.delta import expected_lines

    g = torch.Generator().manual_seed(4)
    weights = {"w": torch.randn(512, 1024, generator=g)}
    buckets = plan(weights, 4 << 20)
    encoder = DeltaEncoder(buckets)
    count(encoder, DeltaPayload, weights, buckets, Engine(weights))
    with torch.no_grad():
        weights["w"][torch.rand(512, 1024, generator=g) < 0.01] *= -1
    encoded = encoder.encode(0, buckets[0], weights, torch.zeros(buckets[0].numel, dtype=BF16), HostTimer(), {})
    counted = encoded.floor.decode_written // 64
    assert counted == pytest.approx(expected_lines(buckets[0], encoded.count, 64), rel=0.03)
    rows = {}
    for grain in (64, 32):
        ctx = PlanContext(buckets, 4, 2, changed_ratio=0.01, line_bytes=grain)
        planned = DeltaPayload.planned_encoded(buckets[0], ctx)
        rows[grain] = planned.floor.decode_written
        assert rows[grain] == expected_lines(buckets[0], planned.count, grain) * grain
    assert rows[64] == pytest.approx(counted * 64, rel=0.03) and rows[32] < 0.6 * rows[64]  # 1 - 0.99^16 vs ^32
