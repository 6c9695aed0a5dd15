"""Trainer offload/onload: bit-exact round trips, training unchanged by offload/onload, nothing copied by `none`."""

from __future__ import annotations

import itertools
import json
import statistics

import pytest
import torch
from conftest import CPU, SMALL, SMALL_MODEL, Tiny, run_in_process, run_main

from rlsync.config.schema import TrainerConfig
from rlsync.engines.base import Generation
from rlsync.errors import ConfigError
from rlsync.trainer.grpo import Trainer
from rlsync.trainer.offload import Offloader, empty_host_cache, plan_pin_chunks, plan_segments, resolve_memory


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models on a shared 2-core machine: one thread is 2-3x faster than two stalling at every op's
    barrier when other processes hold a core. Bits do not depend on it (both sides of a comparison share it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_trainer(seed: int = 0) -> Trainer:
    model = Tiny().build(model=SMALL, seed=seed)
    return Trainer(
        model,
        TrainerConfig(lr=1e-2, micro_batch_size=2),
        allowed_ids=torch.ones(SMALL.vocab_size, dtype=torch.bool),
        temperature=1.0,
    )


def make_batch(seed: int, batch: int = 4, prompt: int = 5, response: int = 6) -> tuple[Generation, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, SMALL.vocab_size, (batch, prompt + response), generator=g)
    response_mask = torch.ones(batch, response, dtype=torch.long)
    response_mask[0, -2:] = 0  # one answer ended early
    gen = Generation(
        sequences=seqs,
        attention_mask=torch.cat([torch.ones(batch, prompt, dtype=torch.long), response_mask], 1),
        response_mask=response_mask,
        logprobs=torch.zeros(batch, response),
        prompt_len=prompt,
        truncated=torch.zeros(batch, dtype=torch.bool),
    )
    return gen, torch.randn(batch, generator=g)


def train(trainer: Trainer, steps: int, offloader: Offloader | None = None) -> None:
    for step in range(steps):
        if offloader is not None:
            offloader.onload()
        gen, advantages = make_batch(step)
        trainer.train_step(gen, old_logp=trainer.log_probs(gen), advantages=advantages)
        if offloader is not None:
            offloader.offload()
    if offloader is not None:
        offloader.onload()


def state_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every tensor of the trainer state by a readable key (params, grads, optimizer moments)."""
    out = {}
    for name, p in trainer.model.named_parameters():
        out[name] = p
        if p.grad is not None:
            out[f"{name}.grad"] = p.grad
        for key, value in trainer.optimizer.state.get(p, {}).items():
            out[f"{name}.{key}"] = value
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)
    )


SEGMENT = 40 * 1024  # bytes: SMALL's embedding (75 KiB) is over it, so move mode has oversized and packed segments
# (and twin's host copy, pinned in chunks of at most this, has oversized and packed chunks too)
# (memory, mode, free_device): twin as on CUDA and as on a CPU; move, the CPU default, with and without dropped grads
LAYOUTS = [
    ("twin", "full", False),
    ("twin", "full", True),
    ("twin", "drop_grads", False),
    ("twin", "drop_grads", True),
    ("move", "full", None),
    ("move", "drop_grads", None),
    ("move", "drop_grads", True),
]


def offloader_for(trainer: Trainer, memory: str, mode: str, free_device: bool | None = None) -> Offloader:
    return Offloader(
        trainer.model,
        trainer.optimizer,
        mode=mode,
        device=CPU,
        memory=memory,
        segment_bytes=SEGMENT,
        free_device=free_device,
        pin_chunk_bytes=SEGMENT,
    )


@pytest.mark.parametrize("memory,mode,free_device", LAYOUTS)
def test_round_trip_is_bit_exact_and_keeps_tensor_objects(memory, mode, free_device):
    trainer = make_trainer()
    offloader = offloader_for(trainer, memory, mode, free_device)
    train(trainer, 2, offloader)  # real offload/onload cycles, then a step: real grads and AdamW moments
    gen, advantages = make_batch(9)
    trainer.train_step(gen, old_logp=trainer.log_probs(gen), advantages=advantages)
    before = {k: v.clone() for k, v in state_of(trainer).items()}
    objects = {k: id(v) for k, v in state_of(trainer).items()}
    assert any(k.endswith(".grad") and v.abs().sum() > 0 for k, v in before.items())
    assert any(k.endswith("exp_avg_sq") and v.abs().sum() > 0 for k, v in before.items())

    moved = offloader.offload()
    grads = sum(v.numel() * v.element_size() for k, v in before.items() if k.endswith(".grad"))
    state = sum(v.numel() * v.element_size() for v in before.values() if v.dim() > 0)
    assert moved == (state if mode == "full" else state - grads)
    assert offloader.offload() == 0  # already offloaded: nothing moves twice
    for s in offloader.segments:  # what is freed while offloaded: twin's device side, move's dropped grads if asked
        freed = bool(free_device) and (memory == "twin" or not s.travels)
        assert s.buffer.untyped_storage().nbytes() == (0 if freed else s.capacity)
    host = offloader.host_weights(dict(trainer.model.named_parameters()))
    assert all(same_bits(host[name], before[name]) for name in host)  # update.source=host reads these

    assert offloader.onload() == moved
    after = state_of(trainer)
    assert {k: id(v) for k, v in after.items()} == objects
    for key, value in before.items():
        if key.endswith(".grad") and mode == "drop_grads":
            assert not after[key].any(), key  # dropped, zeroed: the next backward rebuilds them
        else:
            assert same_bits(after[key], value), key


@pytest.mark.parametrize(
    "memory,mode,free_device",
    [
        ("twin", "full", False),
        ("twin", "full", True),
        ("twin", "drop_grads", True),
        ("move", "full", None),
        ("move", "drop_grads", None),
    ],
)
def test_training_through_offload_onload_cycles_equals_training_without(memory, mode, free_device):
    reference = make_trainer()
    train(reference, 4)
    cycled = make_trainer()
    train(cycled, 4, offloader_for(cycled, memory, mode, free_device))
    ref, got = state_of(reference), state_of(cycled)
    params = [name for name, _ in reference.model.named_parameters()]
    assert params and all(same_bits(got[name], ref[name]) for name in params)
    for name in params:  # the optimizer's moments and step counters too
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert same_bits(got[f"{name}.{key}"], ref[f"{name}.{key}"]), f"{name}.{key}"


@pytest.mark.parametrize(
    "sizes,cap,expected",
    [
        ([10, 10, 10], 25, [[0, 1], [2]]),
        ([10, 15, 10], 25, [[0, 1], [2]]),  # exactly the cap fits
        ([10, 40, 10], 25, [[0], [1], [2]]),  # over the cap: alone, between its neighbours' segments
        ([40, 40], 25, [[0], [1]]),
        ([5, 5, 5], None, [[0, 1, 2]]),  # twin: one segment
        ([], 25, []),
    ],
)
def test_plan_segments(sizes, cap, expected):
    assert plan_segments(sizes, cap) == expected


@pytest.mark.parametrize("seed", range(20))
def test_pin_chunk_plan_covers_every_byte_and_keeps_the_cap(seed):
    """Chunks of a twin: contiguous, every byte once, cut between tensors, none over the cap unless one
    tensor is (alone), and greedy (two neighbours would not fit together)."""
    import random

    rng = random.Random(seed)
    cap = rng.choice([1, 64, 1000, 4096])
    sizes = [rng.choice([rng.randint(1, cap), rng.randint(cap, 3 * cap)]) for _ in range(rng.randint(0, 40))]
    chunks = plan_pin_chunks(sizes, cap)
    bounds = {0}
    for size in sizes:
        bounds.add(max(bounds) + size)
    assert [c[0] for c in chunks] == [0, *(c[1] for c in chunks[:-1])][: len(chunks)]  # contiguous, in order
    assert (chunks[-1][1] if chunks else 0) == sum(sizes)  # every byte covered, once
    for start, end in chunks:
        assert start in bounds and end in bounds and end > start  # cut between tensors
        inside = [b for b in bounds if start < b < end]
        assert end - start <= cap or not inside, (start, end, cap)  # over the cap: one tensor alone
    for (a, _b), (_, c) in itertools.pairwise(chunks):
        assert c - a > cap  # greedy: no two neighbours fit one chunk


def test_pin_chunk_plan_rejects_a_zero_cap():
    with pytest.raises(ValueError, match="cap"):
        plan_pin_chunks([1, 2], 0)


def test_twin_is_allocated_in_chunks_whose_views_are_the_host_weights():
    trainer = make_trainer()
    offloader = offloader_for(trainer, "twin", "full")
    train(trainer, 1, offloader)
    weights = dict(trainer.model.named_parameters())
    expected = {name: t.clone() for name, t in weights.items()}
    chunks = [c for s in offloader.segments for c in s.twin]
    assert offloader.info["twin_chunks"] == len(chunks) > len(offloader.segments)  # split, not one per dtype
    for s in offloader.segments:
        sizes = s.slot_bytes()
        assert [(c.start, c.end) for c in s.twin] == plan_pin_chunks(sizes, SEGMENT)
        assert all(c.end - c.start <= SEGMENT or c.end - c.start in sizes for c in s.twin)
    assert offloader.info["largest_twin_chunk_bytes"] == max(c.host.numel() for c in chunks)
    offloader.offload()
    host = offloader.host_weights(weights)
    owners = {c.host.untyped_storage().data_ptr() for c in chunks}
    for name, t in host.items():  # each one a view of one chunk, holding the weight's bits
        assert same_bits(t, expected[name]) and t.untyped_storage().data_ptr() in owners, name
    offloader.onload()
    offloader.close()  # drops the twins (and, on CUDA, hands torch's cached pinned blocks back)
    assert all(not s.twin for s in offloader.segments)
    empty_host_cache(CPU)  # a no-op off CUDA (torch's own call raises without an accelerator)


def test_move_segments_respect_the_cap_and_the_state_exists_once():
    trainer = make_trainer()
    offloader = offloader_for(trainer, "move", "full")
    train(trainer, 1, offloader)
    segments = offloader.segments
    state = {k: v for k, v in state_of(trainer).items() if v.dim() > 0}
    assert sum(s.nbytes for s in segments) == sum(v.numel() * v.element_size() for v in state.values())
    assert len(segments) > 3 and any(len(s.slots) > 1 for s in segments)
    for s in segments:  # at most the cap, unless one tensor is larger on its own (the embedding)
        assert s.nbytes <= SEGMENT or (len(s.slots) == 1 and s.nbytes > SEGMENT), (s.nbytes, len(s.slots))
    packed = max(s.nbytes for s in segments if s.nbytes <= SEGMENT)  # packed segments share one buffer size
    assert all(s.capacity == (packed if s.nbytes <= SEGMENT else s.nbytes) for s in segments)
    assert any(s.nbytes > SEGMENT for s in segments)
    for t in state.values():  # every tensor of the state is a view of its segment's buffer
        segment, slot = offloader.slots[id(t)]
        start = segment.buffer.data_ptr() + slot.offset * t.element_size()
        assert t.data_ptr() == start and t.untyped_storage().data_ptr() == segment.buffer.data_ptr()

    def buffers() -> set[int]:
        return {s.buffer.data_ptr() for s in segments} | {b.data_ptr() for bs in offloader.spares.values() for b in bs}

    spare_sizes = sorted(b.numel() for bs in offloader.spares.values() for b in bs)
    assert spare_sizes == sorted({s.capacity for s in segments})  # one spare per segment size
    assert offloader.info["extra_bytes"] == sum(spare_sizes) + sum(s.capacity - s.nbytes for s in segments)
    owned, homes = buffers(), [s.buffer.data_ptr() for s in segments]
    for _ in range(2):  # every segment moves, into a buffer that already exists: no allocation, no page faults
        for phase in (offloader.offload, offloader.onload):
            phase()
            moved_to = [s.buffer.data_ptr() for s in segments]
            assert buffers() == owned and all(a != b for a, b in zip(homes, moved_to))
            homes = moved_to


def test_move_host_weights_are_the_params_while_offloaded():
    """update.source=host in move mode: the host copies are where the weights live while offloaded."""
    trainer = make_trainer()
    offloader = offloader_for(trainer, "move", "drop_grads")
    weights = dict(trainer.model.named_parameters())
    train(trainer, 1, offloader)
    expected = {name: t.clone() for name, t in weights.items()}
    offloader.offload()
    host = offloader.host_weights(weights)
    assert all(same_bits(host[name], expected[name]) for name in weights)
    assert all(host[name].data_ptr() == t.data_ptr() for name, t in weights.items())


@pytest.mark.parametrize(
    "override,line",
    [
        ("trainer.offload_memory=halfway", "trainer.offload_memory=halfway"),
        ("trainer.offload_segment_mb=0", "trainer.offload_segment_mb=0"),
        ("trainer.offload_pin_chunk_mb=-1", "trainer.offload_pin_chunk_mb=-1"),
    ],
)
def test_bad_offload_memory_keys_are_named(compose, override, line):
    from rlsync.config.validate import validate

    with pytest.raises(ConfigError, match=line):
        validate(compose(override))


def test_memory_auto_is_move_on_a_cpu_and_twin_on_cuda():
    assert resolve_memory("auto", CPU) == "move" and resolve_memory("auto", torch.device("cuda")) == "twin"
    assert resolve_memory("twin", CPU) == "twin"
    trainer = make_trainer()
    assert Offloader(trainer.model, trainer.optimizer, mode="full", device=CPU).info["memory"] == "move"


def test_bad_memory_names_the_choices(compose):
    from rlsync.config.validate import validate  # checked once, before any model is built: not by the Offloader

    with pytest.raises(ConfigError, match=r"trainer.offload_memory=halfway.*auto, twin, move"):
        validate(compose("trainer.offload_memory=halfway"))


def test_offload_none_copies_nothing_and_touches_nothing():
    trainer = make_trainer()
    pointers = [p.data_ptr() for p in trainer.model.parameters()]
    offloader = Offloader(trainer.model, trainer.optimizer, mode="none", device=CPU)
    assert offloader.offload() == 0 and offloader.onload() == 0 and offloader.state_bytes == 0
    assert [p.data_ptr() for p in trainer.model.parameters()] == pointers
    assert all(p.grad is None for p in trainer.model.parameters()) and not trainer.optimizer.state
    with pytest.raises(RuntimeError, match="update.source=host"):
        offloader.host_weights(dict(trainer.model.named_parameters()))


def test_bad_mode_names_the_key(compose):
    from rlsync.config.validate import validate  # checked once, before any model is built: not by the Offloader

    with pytest.raises(ConfigError, match=r"trainer.offload=half.*none, full, drop_grads"):
        validate(compose("trainer.offload=half"))


def test_bench_offload_reports_bytes_time_and_floor():
    from rlsync.bench.offload import bench_offload, table

    result = bench_offload(SMALL, repeats=2, warmup=1, device=CPU, mode="drop_grads")
    summary, rows = result["summary"], result["rows"]
    assert len(rows) == 3 and summary["offload"]["state"] == "trainer"
    state = summary["offload"]["state_bytes"]
    params = summary["params"] * 4
    assert state == 4 * params  # params, grads, exp_avg, exp_avg_sq in fp32
    for phase in ("sleep", "wake_up"):
        d = summary[phase]
        assert d["bytes"] == 3 * params  # drop_grads: everything but the grads
        assert d["min"] <= d["time"] <= d["max"] and d["limit_time"] > 0
        for r in rows:  # each repeat against the copy probed beside it
            assert r[f"perf/{phase}_bytes"] == d["bytes"]
            assert r[f"perf/{phase}_efficiency"] == pytest.approx(
                r[f"perf/{phase}_limit_time"] / r[f"perf/{phase}_time"]
            )
        assert d["efficiency"] == pytest.approx(statistics.median(r[f"perf/{phase}_efficiency"] for r in rows[1:]))
    assert summary["offload"]["host_first_touch_time"] > 0
    assert "| onload |" in table([summary])


@pytest.fixture(scope="module")
def runner_runs(tmp_path_factory):
    """The real runner, in this process, with offload full and none: (rows, summary) by mode."""
    # full: memory=auto (move on a CPU), in 0.1 MiB segments (the state is 1.5 MB); none: nothing laid out
    runs = {"full": ("trainer.offload=full", "trainer.offload_segment_mb=0.1"), "none": ("trainer.offload=none",)}
    runs.update(
        {f"host_{memory}": ("update.source=host", f"trainer.offload_memory={memory}") for memory in ("move", "twin")}
    )
    return {name: run_in_process(tmp_path_factory.mktemp(name), *overrides) for name, overrides in runs.items()}


def test_runner_logs_offload_metrics_and_first_touch(runner_runs):
    rows, summary = runner_runs["full"]
    offload = summary["offload"]
    assert offload["mode"] == "full" and offload["host_bytes"] == offload["device_bytes"] > 0
    assert offload["memory"] == "move" and offload["segment_cap_bytes"] == int(0.1 * 2**20)
    assert offload["segments"] > 10 and offload["largest_segment_bytes"] <= offload["segment_cap_bytes"]
    assert offload["extra_bytes"] < offload["device_bytes"] / 2  # the state once, plus a spare and some slack
    twin = runner_runs["host_twin"][1]["offload"]
    assert twin["memory"] == "twin" and twin["extra_bytes"] == twin["host_bytes"]  # a CPU run holds it twice
    assert offload["host_first_touch_time"] > 0 and offload["first_sleep_time"] > 0
    for row in rows:
        for phase in ("sleep", "wake_up"):
            assert row[f"perf/{phase}_bytes"] == offload["host_bytes"]
            assert row[f"perf/{phase}_gbps"] == pytest.approx(
                row[f"perf/{phase}_bytes"] / row[f"perf/{phase}_time"] / 1e9
            )
            assert row[f"perf/{phase}_efficiency"] == pytest.approx(
                row[f"perf/{phase}_limit_time"] / row[f"perf/{phase}_time"]
            )
    assert "perf/sleep_time" in summary["metrics"] and "perf/wake_up_efficiency" in summary["metrics"]


def test_runner_with_offload_none_moves_nothing_and_trains_the_same(runner_runs):
    rows, _ = runner_runs["none"]
    assert all(r["perf/sleep_bytes"] == 0 and r["perf/wake_up_bytes"] == 0 for r in rows)
    assert not any("perf/sleep_gbps" in r or "perf/wake_up_efficiency" in r for r in rows)
    full_rows, _ = runner_runs["full"]
    for key in ("train/loss", "train/grad_norm", "train/logprob_abs_diff", "rollout/reward_mean"):
        assert [r[key] for r in rows] == [r[key] for r in full_rows], key


def test_bench_cli_offload_target(tmp_path):
    run_dir = tmp_path / "bench"
    proc = run_main(
        *SMALL_MODEL,
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
        "bench.target=offload",
        "bench.warmup=1",
        "bench.repeats=2",
        "trainer.offload=drop_grads",
        module="rlsync.bench",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["target"] == "offload" and summary["offload"]["mode"] == "drop_grads"
    assert summary["metrics"]["perf/sleep_bytes"]["median"] == 3 * summary["offload"]["weight_bytes"]
    assert "Trainer offload alone" in proc.stdout and "| onload |" in proc.stdout


def test_runner_update_from_host_copies_in_move_mode(runner_runs):
    """update.source=host sends from the offloaded copy: move's segments (the weights themselves while offloaded)
    and twin's host twin carry the same bits, so the two runs are the same run, and the engine gets the weights."""
    move, twin = runner_runs["host_move"][0], runner_runs["host_twin"][0]
    for key in ("train/loss", "train/grad_norm", "train/logprob_abs_diff", "rollout/reward_mean"):
        assert [r[key] for r in move] == [r[key] for r in twin], key
    assert all(r["train/logprob_abs_diff"] < 0.05 and r["perf/sleep_bytes"] > 0 for r in move)


@pytest.mark.parametrize("probe", ["every_step", "start"])
def test_runner_measures_the_floors_before_each_step(tmp_path, monkeypatch, probe):
    """run.limit_probe=every_step: each step's floors come from a probe taken just before it (here a
    fake probe that reports a faster machine every time); start: every step shares set-up's."""
    import rlsync.measure.floors

    probes = []

    def faster_each_time(nbytes, *, src, dst, repeats=3, dtypes=None):
        probes.append(nbytes)
        return rlsync.measure.floors.Bandwidth(1e9 * len(probes), "fake")

    monkeypatch.setattr(rlsync.measure.floors, "copy_bandwidth", faster_each_time)
    rows, summary = run_in_process(tmp_path, f"run.limit_probe={probe}")
    assert summary["setup"]["limit_probe"] == probe
    for key in ("perf/update_weights_limit_time", "perf/sleep_limit_time", "perf/wake_up_limit_time"):
        floors = [r[key] for r in rows]
        if probe == "start":
            assert len(set(floors)) == 1, key
        else:
            assert floors == sorted(floors, reverse=True) and len(set(floors)) == len(rows), key
    for r in rows:
        assert r["perf/update_weights_efficiency"] == pytest.approx(
            r["perf/update_weights_limit_time"] / r["perf/update_weights_time"]
        )
