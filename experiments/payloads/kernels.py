"""Micro-benchmark of the payloads' kernels on Qwen3-0.6B-sized buffers: each variant against its own floor.

    python experiments/payloads/kernels.py                 # the whole model's 2-D and 1-D tensors, 3 rounds
    python experiments/payloads/kernels.py --share 0.25 --rounds 5 --no-compile
    python experiments/payloads/kernels.py --compaction --rounds 9   # delta.c against numpy's steps, A/B

The trainer's fp32 tensors have Qwen3-0.6B's shapes (model=qwen3_0p6b, its checkpoint layout), packed into
512 MiB buckets as the bench plans them. Each round times the copy probe first (rlsync.measure.floors: the
fastest fp32 -> bf16 copy at the update's size, bytes read + written per second) and then every variant once,
so a drift of a shared machine's load falls on all alike; each variant's time is divided by its floor (the
bytes its payload class declares, rlsync.update.payload: Payload.floor, over that round's probe) and the
median over rounds printed with its spread (min to max).

Variants: `eager` (the kernels before issue 45: whole-bucket ops, each a pass over memory), `chunked`
(rlsync.update.payload.kernels at several chunk sizes, FP8's with its eager casts; `cast first`: delta.c after
torch's cast of each chunk into scratch, as before it read the trainer's tensors itself), `payload` (FP8 as the
payload runs it: fp8.c's block rows over the update's threads, or on the caller's thread alone; with fp8.c off
(native.ENABLED) whole tensors through its compiled kernels; the kept and padded ones in chunks), `compile`
(torch.compile over whole tensors, dynamic shapes, the inductor CPU backend: its compile time is printed; the
delta's compaction stays eager, inductor cannot size it). Each row's ns per element is over all the buckets'
elements; the load average before and after is printed. The chunked
delta runs delta.c's compaction (rlsync.update.payload.native) where it built; `chunked 1024K, numpy` the same
with numpy's steps (native.ENABLED off), beside it in every round.

`--compaction`: the compaction alone, delta.c's against numpy's steps (kernels.compact_chunk with native.ENABLED
on and off: the positions int32 with the chunk's offset, as delta_encode takes them), alternating in one process
(the first of each round alternates too) on 1 Mi-element bf16 chunks at 0, 1 and 5 % changed at random places,
on one thread with one torch thread (as each of the update's chunk threads):
each chunk copied into cache first, untimed (as the encode's cast leaves it), the last values read from memory;
the median (min to max) of each round's ns per element and per changed element, the load average beside them.
Results: experiments/payloads/README.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlsync.config.compose import register_configs, to_config
from rlsync.measure.floors import copy_bandwidth
from rlsync.measure.timing import HostTimer
from rlsync.model.architecture import update_shapes
from rlsync.update import flat
from rlsync.update.buckets import TensorMeta, plan_buckets
from rlsync.update.payload import kernels, native
from rlsync.update.payload.base import FULL, SPARSE, Encoded
from rlsync.update.payload.delta import DeltaEncoder, DeltaPayload, sparse_bytes
from rlsync.update.payload.fp8 import FP8, Fp8Encoder, Fp8Payload, layout, quantize_blocks

BF16, CPU = torch.bfloat16, torch.device("cpu")


class Engine:
    """The engine side as the decodes see it: bf16 weights by trainer name, written in place."""

    holds_flat_weights = True

    def __init__(self, weights):
        self.weights = {n: t.to(BF16) for n, t in weights.items()}

    def load_weights(self, named):
        for name, tensor in named:
            self.weights[name].copy_(tensor)


def config_dir() -> str:
    import importlib.resources

    return str(importlib.resources.files("rlsync") / "conf")


def model_weights(share: float) -> dict[str, torch.Tensor]:
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=["model=qwen3_0p6b"]))
    shapes = update_shapes(cfg.model)
    layers = [s for s in shapes if ".layers." in s[0]]
    others = [s for s in shapes if ".layers." not in s[0]]
    keep = max(1, round(len(layers) * share))
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(tuple(s), generator=g) * 0.02 for n, s in others + layers[:keep]}


def flip(weights: dict[str, torch.Tensor], share: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in weights.values():
        count = round(share * t.numel())
        if count:
            v = t.view(-1)
            idx = torch.randint(t.numel(), (count,), generator=g)
            v[idx] = -v[idx]


# ---- the kernels before issue 45 (the baseline): whole-bucket ops -------------------------------


class EagerDelta:
    def __init__(self, buckets):
        self.last = [None] * len(buckets)

    def encode(self, index, bucket, weights, buffer):
        new = buffer[: bucket.numel]
        flat.pack(bucket, weights, new)
        last = self.last[index]
        if last is None:
            self.last[index] = new.clone()
            return Encoded(FULL, bucket.numel, bucket.nbytes, bucket.numel)
        changed = new.view(torch.int16) != last.view(torch.int16)
        count = int(torch.count_nonzero(changed))
        nbytes = sparse_bytes(count, 2)
        if count:
            positions = changed.nonzero().view(-1)
            values = new.index_select(0, positions)
            last.index_copy_(0, positions, values)
            raw = buffer.view(torch.uint8)
            raw[: count * 4].view(torch.int32).copy_(positions)
            raw[count * 4 : nbytes].view(BF16).copy_(values)
        return Encoded(SPARSE, count, nbytes, count)


def eager_fp8_encode(bucket, weights, buffer):
    parts, nbytes = layout(bucket)
    raw = buffer.view(torch.uint8)
    for slot, fp8, values, scales in parts:
        source = weights[slot.meta.name]
        if fp8:
            q, scale = quantize_blocks(source)
            raw[values : values + slot.meta.numel].copy_(q.view(torch.uint8).view(-1))
            raw[scales : scales + 4 * scale.numel()].view(torch.float32).copy_(scale.view(-1))
        else:
            raw[values : values + slot.meta.nbytes].view(BF16).copy_(source.reshape(-1))
    return Encoded(2, bucket.numel, nbytes, None)


def eager_fp8_decode(engine, bucket, buffer):
    from rlsync.update.payload.fp8 import dequantize_blocks

    parts, _ = layout(bucket)
    raw = buffer.view(torch.uint8)
    named = []
    for slot, fp8, values, scales in parts:
        meta = slot.meta
        if fp8:
            q = raw[values : values + meta.numel].view(FP8).view(meta.shape)
            scale = raw[scales : scales + 4 * kernels.math.prod(kernels.blocks_of(meta.shape))].view(torch.float32)
            tensor = dequantize_blocks(q, scale.view(kernels.blocks_of(meta.shape)), BF16)
        else:
            tensor = raw[values : values + meta.nbytes].view(BF16).view(meta.shape)
        named.append((meta.name, tensor))
    engine.load_weights(named)


# ---- torch.compile variants ---------------------------------------------------------------------


def compiled_variants():
    @torch.compile(dynamic=True)
    def cast_compare_count(src, last, out):
        new = src.to(out.dtype)
        out.copy_(new)
        return (new.view(torch.int16) != last.view(torch.int16)).sum()

    @torch.compile(dynamic=True)
    def quantize(x):  # x: (R*128, C*128) float32; returned, not written in place: the values and scales share
        br, bc = x.shape[0] // 128, x.shape[1] // 128  # one buffer, and aot_autograd refuses input mutations
        b = x.view(br, 128, bc, 128)  # on views of one storage with different dtypes
        amax = b.abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        return (b / scale[:, None, :, None]).to(FP8).view(x.shape), scale

    @torch.compile(dynamic=True)
    def dequantize(q, s, out):
        br, bc = q.shape[0] // 128, q.shape[1] // 128
        out.copy_((q.view(br, 128, bc, 128).float() * s[:, None, :, None]).view(q.shape).to(out.dtype))

    return cast_compare_count, quantize, dequantize


class CompiledDelta(EagerDelta):
    """cast + compare + count fused by inductor per tensor (dynamic shapes), the positions from an eager pass."""

    def __init__(self, buckets, fn):
        super().__init__(buckets)
        self.fn = fn

    def encode(self, index, bucket, weights, buffer):
        last = self.last[index]
        if last is None:
            return super().encode(index, bucket, weights, buffer)
        new = buffer[: bucket.numel]
        count = 0
        for slot in bucket.slots:
            a, k = slot.offset, slot.meta.numel
            count += int(self.fn(weights[slot.meta.name].view(-1), last[a : a + k], new[a : a + k]))
        if count:  # the compaction: a second pass (the mask again, then nonzero)
            changed = new.view(torch.int16) != last.view(torch.int16)
            positions = changed.nonzero().view(-1)
            values = new.index_select(0, positions)
            last.index_copy_(0, positions, values)
            raw = buffer.view(torch.uint8)
            raw[: count * 4].view(torch.int32).copy_(positions)
            raw[count * 4 : count * 6].view(BF16).copy_(values)
            return Encoded(SPARSE, count, count * 6, count)
        return Encoded(SPARSE, 0, 0, 0)


def compiled_fp8_encode(fn, bucket, weights, buffer):
    parts, nbytes = layout(bucket)
    raw = buffer.view(torch.uint8)
    for slot, fp8, values, scales in parts:
        meta = slot.meta
        source = weights[meta.name]
        if fp8:
            q = raw[values : values + meta.numel].view(FP8).view(meta.shape)
            s = raw[scales : scales + 4 * kernels.math.prod(kernels.blocks_of(meta.shape))].view(torch.float32)
            values, scale = fn(source)
            q.copy_(values)
            s.view(kernels.blocks_of(meta.shape)).copy_(scale)
        else:
            raw[values : values + meta.nbytes].view(BF16).view(meta.shape).copy_(source)
    return Encoded(2, bucket.numel, nbytes, None)


def compiled_fp8_decode(fn, engine, bucket, buffer):
    parts, _ = layout(bucket)
    raw = buffer.view(torch.uint8)
    for slot, fp8, values, scales in parts:
        meta = slot.meta
        if fp8:
            q = raw[values : values + meta.numel].view(FP8).view(meta.shape)
            s = raw[scales : scales + 4 * kernels.math.prod(kernels.blocks_of(meta.shape))].view(torch.float32)
            fn(q, s.view(kernels.blocks_of(meta.shape)), engine.weights[meta.name])
        else:
            engine.weights[meta.name].copy_(raw[values : values + meta.nbytes].view(BF16).view(meta.shape))


# ---- the compaction alone: delta.c against numpy's steps ----------------------------------------


def compaction_ab(rounds: int, numel: int, shares=(0.0, 0.01, 0.05)) -> None:
    """`--compaction`: kernels.compact_chunk with delta.c and with numpy's steps, alternating, on one thread."""
    why = native.DELTA.why_not()
    print(f"delta.c: {'built, ' + str(native.DELTA.path) if why is None else 'unavailable: ' + why}")
    if why is not None:
        return
    chunk = kernels.CPU_CHUNK
    torch.set_num_threads(1)  # as each of the update's chunk threads runs (kernels.Workers)
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(numel, generator=g) * 0.02).to(BF16)
    last, scratch = base.clone(), kernels.Scratch()
    new = scratch.get("cached", chunk, BF16, CPU)
    print(
        f"{numel / 2**20:.0f} Mi bf16 elements in {chunk // 1024}K chunks, {rounds} rounds; load average before: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print("| changed | kernel | ns / element, median (min to max) | ns / changed element | CPU time / element |")
    print("|---|---|---|---|---|")
    for share in shares:
        source = base.clone()
        picked = torch.randperm(numel, generator=g)[: round(share * numel)]
        source.view(torch.int16)[picked] ^= -32768  # the sign bit: every pick changes
        changed = len(picked)
        times: dict[str, list[tuple[float, float]]] = {"delta.c": [], "numpy": []}
        for r in range(rounds):
            order = list(times) if r % 2 == 0 else list(times)[::-1]
            for name in order:
                native.ENABLED = name == "delta.c"
                last.copy_(base)  # untimed: the last values are the old ones again (and leave the cache)
                wall = cpu = 0.0
                found = 0
                for at in range(0, numel, chunk):
                    k = min(chunk, numel - at)
                    new[:k].copy_(source[at : at + k])  # in cache, as the cast leaves a chunk
                    w0, c0 = time.perf_counter(), time.thread_time()
                    where, _, _ = kernels.compact_chunk(new[:k], last[at : at + k], scratch, at)
                    wall += time.perf_counter() - w0
                    cpu += time.thread_time() - c0
                    found += where.numel()
                assert found == changed and torch.equal(last.view(torch.int16), source.view(torch.int16))
                times[name].append((wall, cpu))
        native.ENABLED = True
        for name, ts in times.items():
            per = [w * 1e9 / numel for w, _ in ts]
            per_cpu = [c * 1e9 / numel for _, c in ts]
            per_changed = [w * 1e9 / changed for w, _ in ts] if changed else None
            cell = (
                f"{statistics.median(per_changed):.1f} ({min(per_changed):.1f} to {max(per_changed):.1f})"
                if per_changed
                else "-"
            )
            print(
                f"| {share:.0%} | {name} | {statistics.median(per):.3f} ({min(per):.3f} to {max(per):.3f}) | {cell} "
                f"| {statistics.median(per_cpu):.3f} |"
            )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


# ---- the benchmark ------------------------------------------------------------------------------


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--share", type=float, default=0.5, help="share of the decoder layers kept (1: the model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--changed", type=float, default=0.01, help="share of elements flipped per round")
    parser.add_argument("--chunks", default="65536,262144,1048576", help="chunk sizes (elements)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--compaction", action="store_true", help="only the delta's compaction: delta.c against numpy")
    parser.add_argument("--elements", type=int, default=64 << 20, help="--compaction's elements (bf16)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if args.compaction:
        compaction_ab(args.rounds, args.elements)
        return
    weights = model_weights(args.share)
    metas = [TensorMeta(n, tuple(t.shape), BF16) for n, t in weights.items()]
    buckets = plan_buckets(metas, 512 << 20)
    numel = sum(b.numel for b in buckets)
    read = sum(t.numel() * t.element_size() for t in weights.values())
    print(
        f"{len(weights)} tensors, {numel / 1e6:.0f} M elements, {len(buckets)} buckets; threads {torch.get_num_threads()}"
    )
    buffer = torch.empty(max(b.numel for b in buckets), dtype=BF16)
    buffer.fill_(0)
    engine = Engine(weights)
    chunks = [int(c) for c in args.chunks.split(",")]
    compiled = None
    if not args.no_compile:
        start = time.perf_counter()
        try:
            compiled = compiled_variants()
            small = dict(list(weights.items())[:6])
            sb = plan_buckets([TensorMeta(n, tuple(t.shape), BF16) for n, t in small.items()], 512 << 20)
            d = CompiledDelta(sb, compiled[0])
            d.encode(0, sb[0], small, buffer)
            d.encode(0, sb[0], small, buffer)
            compiled_fp8_encode(compiled[1], sb[0], small, buffer)
            compiled_fp8_decode(compiled[2], Engine(small), sb[0], buffer)
            print(f"torch.compile: the three kernels compiled in {time.perf_counter() - start:.1f} s")
        except Exception as err:  # noqa: BLE001 - report and go on without
            print(f"torch.compile failed here: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            compiled = None

    def delta_variants():
        out = {"eager": EagerDelta(buckets)}
        for c in chunks:
            out[f"chunked {c // 1024}K"] = (c, DeltaEncoder(buckets))
            if c == 1 << 20:  # the default chunk with numpy's compaction: delta.c's gain within each round
                out[f"chunked {c // 1024}K, numpy"] = (c, DeltaEncoder(buckets), False)
                # delta.c after torch's cast into the chunk's scratch (before it read the trainer's tensors)
                out[f"chunked {c // 1024}K, cast first"] = (c, DeltaEncoder(buckets), True, False)
        if compiled:
            out["compile"] = CompiledDelta(buckets, compiled[0])
        return out

    variants = delta_variants()
    timer = HostTimer()
    source_compaction = kernels.source_compaction

    def run_delta(name, v, index, bucket):
        if isinstance(v, tuple):
            kernels.CPU_CHUNK, native.ENABLED = v[0], v[2] if len(v) > 2 else True
            kernels.source_compaction = source_compaction if len(v) < 4 or v[3] else lambda pieces, old: None
            return v[1].encode(index, bucket, weights, buffer, timer, {})
        return v.encode(index, bucket, weights, buffer)

    # first updates (untimed): every variant keeps its last values
    for name, v in variants.items():
        for i, b in enumerate(buckets):
            run_delta(name, v, i, b)
    results: dict[str, list[float]] = {}
    bw_seen = []
    native.ENABLED = True  # the delta's variants left it as their last one wants
    print(f"fp8.c: {'built, ' + str(native.FP8.path) if native.FP8.why_not() is None else native.FP8.why_not()}")
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())

    def record(key, seconds, floor_bytes, bw, elements=numel):
        results.setdefault(key, []).append(seconds / (floor_bytes / bw))
        results.setdefault(key + " [s]", []).append(seconds)
        results.setdefault(key + " [ns]", []).append(seconds / elements * 1e9)

    for r in range(args.rounds):
        bw = copy_bandwidth(read + numel * 2, src=CPU, dst=CPU, dtypes=(torch.float32, BF16)).per_second
        bw_seen.append(bw)
        for share, label in ((0.0, "0 %"), (args.changed, f"{args.changed:.0%}")):
            if share:
                flip(weights, share, seed=r)
            for name, v in variants.items():
                total, floor, dec_floor, dec_total = 0.0, 0, 0, 0.0
                for i, b in enumerate(buckets):
                    source = sum(weights[n].numel() * 4 for n in b.names)
                    t0 = time.perf_counter()
                    enc = run_delta(name, v, i, b)
                    total += time.perf_counter() - t0
                    declared = enc.floor or DeltaPayload.floor(b, enc, source)  # the lines it counted, else expected
                    floor += declared.encode
                    if (
                        isinstance(v, tuple) and v[0] == 1 << 20 and len(v) == 2
                    ):  # the apply once per round, after the default chunk
                        dec_total += timed(DeltaPayload.decode, engine, b, buffer, enc)
                        dec_floor += declared.decode
                record(f"delta encode {label}, {name}", total, floor, bw)
                if dec_floor:
                    record(f"delta apply {label}", dec_total, dec_floor, bw)
            if share:  # the same share, flipped back: the next round starts where this one began
                flip(weights, share, seed=r)
                for name, v in variants.items():
                    for i, b in enumerate(buckets):
                        run_delta(name, v, i, b)
        # FP8: quantize and dequantize each bucket
        # (chunk, kernels.Compiled.enabled, native.ENABLED, threads: None the update's, 1 the caller's alone)
        fp8_variants = {"eager": None, **{f"chunked {c // 1024}K, eager casts": (c, False, False) for c in chunks}}
        fp8_variants["payload: fp8.c, block rows over the threads"] = (1 << 20, True, True, None)
        fp8_variants["payload: fp8.c, the caller's thread"] = (1 << 20, True, True, 1)
        if compiled:  # the payload's whole-tensor compiled kernels (fp8.c off), the chunks for the rest; the same
            fp8_variants["payload: compiled whole tensors, 1024K chunks for the rest"] = (1 << 20, True, False)
            fp8_variants["compile, whole tensors (this script's)"] = "compile"  # kernels, outside the payload
        enc8 = Fp8Encoder()
        for name, v in fp8_variants.items():
            te = td = 0.0
            fe = fd = 0
            for b in buckets:
                source = sum(weights[n].numel() * 4 for n in b.names)
                if v is None:
                    te += timed(eager_fp8_encode, b, weights, buffer)
                    enc = Encoded(2, b.numel, layout(b)[1], None)
                    td += timed(eager_fp8_decode, engine, b, buffer)
                elif v == "compile":
                    te += timed(compiled_fp8_encode, compiled[1], b, weights, buffer)
                    enc = Encoded(2, b.numel, layout(b)[1], None)
                    td += timed(compiled_fp8_decode, compiled[2], engine, b, buffer)
                else:
                    kernels.CPU_CHUNK, kernels.Compiled.enabled, native.ENABLED = v[:3]
                    threads = torch.get_num_threads()
                    torch.set_num_threads(v[3] if len(v) > 3 and v[3] else threads)  # Workers' count
                    try:
                        t0 = time.perf_counter()
                        enc = enc8.encode(0, b, weights, buffer, timer, {})
                        te += time.perf_counter() - t0
                        td += timed(Fp8Payload.decode, engine, b, buffer, enc)
                    finally:
                        torch.set_num_threads(threads)
                floor = Fp8Payload.floor(b, enc, source)
                fe, fd = fe + floor.encode, fd + floor.decode
            record(f"fp8 quantize, {name}", te, fe, bw, numel)
            record(f"fp8 dequantize, {name}", td, fd, bw, numel)
        # the full update's copy, for the goals' ratios: pack (fp32 -> bf16) then load (bf16 -> bf16)
        t_full = 0.0
        for b in buckets:
            t_full += timed(flat.pack, b, weights, buffer[: b.numel])
            t_full += timed(engine.load_weights, flat.views(b, buffer[: b.numel]))
        record("full update (pack + load)", t_full, read + 3 * numel * 2, bw)
    kernels.CPU_CHUNK, kernels.Compiled.enabled, native.ENABLED = 1 << 20, True, True
    gbps = [b / 1e9 for b in bw_seen]
    print(f"load average before: {load_before}, after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"copy probe (fp32 -> bf16, read + written): {statistics.median(gbps):.1f} GB/s ({min(gbps):.1f} to {max(gbps):.1f})"
    )
    print("| kernel | time, median (min to max) | ns/element | time / its floor, median (min to max) | efficiency |")
    print("|---|---|---|---|---|")
    for key, ratios in results.items():
        if key.endswith((" [s]", " [ns]")):
            continue
        secs, ns = results[key + " [s]"], results[key + " [ns]"]
        m = statistics.median(ratios)
        print(
            f"| {key} | {statistics.median(secs):.3f} s ({min(secs):.3f} to {max(secs):.3f}) "
            f"| {statistics.median(ns):.2f} | {m:.2f}x ({min(ratios):.2f} to {max(ratios):.2f}) | {1 / m:.2f} |"
        )


if __name__ == "__main__":
    main()
