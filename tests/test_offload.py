"""Trainer offload/onload: bit-exact round trips, training unchanged by sleep/wake, nothing copied by `none`."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from conftest import FAST, ROOT, read_jsonl, run_cli
from rlsync.config import ModelConfig, TrainerConfig
from rlsync.errors import ConfigError
from rlsync.models import build_model
from rlsync.offload import Offloader
from rlsync.rollout import Generation
from rlsync.trainer import Trainer

CPU = torch.device("cpu")
TINY = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=300)
SMALL_MODEL = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2", "model.head_dim=16",
               "model.vocab_size=300"]


def run_in_process(run_dir, *overrides: str) -> tuple[list[dict], dict]:
    """One real run through the composed config and the runner, without a new interpreter: (rows, summary)."""
    from hydra import compose, initialize_config_dir

    from rlsync.config import register_configs, to_config
    from rlsync.experiment import run_experiment
    from rlsync.validate import validate

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=[*FAST, *SMALL_MODEL, "wandb.mode=disabled", *overrides]))
    validate(cfg)
    run_experiment(cfg, run_dir, name="test", group="test")
    return read_jsonl(run_dir / "metrics.jsonl"), json.loads((run_dir / "summary.json").read_text())


def make_trainer(seed: int = 0) -> Trainer:
    model = build_model(TINY, dtype=torch.float32, device=CPU, seed=seed)
    return Trainer(model, TrainerConfig(lr=1e-2, micro_batch_size=2), allowed_ids=torch.ones(TINY.vocab_size, dtype=torch.bool),
                   temperature=1.0)


def make_batch(seed: int, batch: int = 4, prompt: int = 5, response: int = 6) -> tuple[Generation, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, TINY.vocab_size, (batch, prompt + response), generator=g)
    response_mask = torch.ones(batch, response, dtype=torch.long)
    response_mask[0, -2:] = 0  # one answer ended early
    gen = Generation(sequences=seqs, attention_mask=torch.cat([torch.ones(batch, prompt, dtype=torch.long), response_mask], 1),
                     response_mask=response_mask, logprobs=torch.zeros(batch, response), prompt_len=prompt,
                     truncated=torch.zeros(batch, dtype=torch.bool))
    return gen, torch.randn(batch, generator=g)


def train(trainer: Trainer, steps: int, offloader: Offloader | None = None) -> None:
    for step in range(steps):
        if offloader is not None:
            offloader.wake_up()
        gen, advantages = make_batch(step)
        trainer.train_step(gen, old_logp=trainer.log_probs(gen), advantages=advantages)
        if offloader is not None:
            offloader.sleep()
    if offloader is not None:
        offloader.wake_up()


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
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)


@pytest.mark.parametrize("mode,free_device", [("full", False), ("full", True), ("drop_grads", False), ("drop_grads", True)])
def test_round_trip_is_bit_exact_and_keeps_tensor_objects(mode, free_device):
    trainer = make_trainer()
    offloader = Offloader(trainer.model, trainer.optimizer, mode=mode, device=CPU, free_device=free_device)
    train(trainer, 2, offloader)  # real sleep/wake cycles, then a step: real grads and AdamW moments
    gen, advantages = make_batch(9)
    trainer.train_step(gen, old_logp=trainer.log_probs(gen), advantages=advantages)
    before = {k: v.clone() for k, v in state_of(trainer).items()}
    objects = {k: id(v) for k, v in state_of(trainer).items()}
    assert any(k.endswith(".grad") and v.abs().sum() > 0 for k, v in before.items())
    assert any(k.endswith("exp_avg_sq") and v.abs().sum() > 0 for k, v in before.items())

    moved = offloader.sleep()
    grads = sum(v.numel() * v.element_size() for k, v in before.items() if k.endswith(".grad"))
    state = sum(v.numel() * v.element_size() for v in before.values() if v.dim() > 0)
    assert moved == (state if mode == "full" else state - grads)
    assert offloader.sleep() == 0  # already asleep: nothing moves twice
    flat = offloader.groups[torch.float32].device_flat
    assert flat.untyped_storage().nbytes() == (0 if free_device else flat.numel() * 4)
    host = offloader.host_weights(dict(trainer.model.named_parameters()))
    assert all(same_bits(host[name], before[name]) for name in host)  # update.source=host reads these

    assert offloader.wake_up() == moved
    after = state_of(trainer)
    assert {k: id(v) for k, v in after.items()} == objects
    for key, value in before.items():
        if key.endswith(".grad") and mode == "drop_grads":
            assert not after[key].any(), key  # dropped, zeroed: the next backward rebuilds them
        else:
            assert same_bits(after[key], value), key


@pytest.mark.parametrize("mode,free_device", [("full", False), ("full", True), ("drop_grads", True)])
def test_training_through_sleep_wake_cycles_equals_training_without(mode, free_device):
    reference = make_trainer()
    train(reference, 4)
    cycled = make_trainer()
    train(cycled, 4, Offloader(cycled.model, cycled.optimizer, mode=mode, device=CPU, free_device=free_device))
    ref, got = state_of(reference), state_of(cycled)
    params = [name for name, _ in reference.model.named_parameters()]
    assert params and all(same_bits(got[name], ref[name]) for name in params)
    for name in params:  # the optimizer's moments and step counters too
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert same_bits(got[f"{name}.{key}"], ref[f"{name}.{key}"]), f"{name}.{key}"


def test_offload_none_copies_nothing_and_touches_nothing():
    trainer = make_trainer()
    pointers = [p.data_ptr() for p in trainer.model.parameters()]
    offloader = Offloader(trainer.model, trainer.optimizer, mode="none", device=CPU)
    assert offloader.sleep() == 0 and offloader.wake_up() == 0 and offloader.state_bytes == 0
    assert [p.data_ptr() for p in trainer.model.parameters()] == pointers
    assert all(p.grad is None for p in trainer.model.parameters()) and not trainer.optimizer.state
    with pytest.raises(RuntimeError, match="update.source=host"):
        offloader.host_weights(dict(trainer.model.named_parameters()))


def test_bad_mode_names_the_key():
    trainer = make_trainer()
    with pytest.raises(ConfigError, match=r"trainer.offload=half.*none, full, drop_grads"):
        Offloader(trainer.model, trainer.optimizer, mode="half", device=CPU)


def test_bench_offload_reports_bytes_time_and_limit():
    from rlsync.bench_offload import bench_offload, table

    result = bench_offload(TINY, repeats=2, warmup=1, device=CPU, mode="drop_grads")
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
            assert r[f"perf/{phase}_efficiency"] == pytest.approx(r[f"perf/{phase}_limit_time"] / r[f"perf/{phase}_time"])
        assert d["efficiency"] == pytest.approx(statistics.median(r[f"perf/{phase}_efficiency"] for r in rows[1:]))
    assert summary["offload"]["host_first_touch_time"] > 0
    assert "| onload |" in table([summary])


@pytest.fixture(scope="module")
def runner_runs(tmp_path_factory):
    """The real runner, in this process, with offload full and none: (rows, summary) by mode."""
    return {mode: run_in_process(tmp_path_factory.mktemp(mode), f"trainer.offload={mode}") for mode in ("full", "none")}


def test_runner_logs_offload_metrics_and_first_touch(runner_runs):
    rows, summary = runner_runs["full"]
    offload = summary["offload"]
    assert offload["mode"] == "full" and offload["host_bytes"] == offload["device_bytes"] > 0
    assert offload["host_first_touch_time"] > 0 and offload["first_sleep_time"] > 0
    for row in rows:
        for phase in ("sleep", "wake_up"):
            assert row[f"perf/{phase}_bytes"] == offload["host_bytes"]
            assert row[f"perf/{phase}_gbps"] == pytest.approx(row[f"perf/{phase}_bytes"] / row[f"perf/{phase}_time"] / 1e9)
            assert row[f"perf/{phase}_efficiency"] == pytest.approx(row[f"perf/{phase}_limit_time"] / row[f"perf/{phase}_time"])
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
    proc = run_cli(*SMALL_MODEL, "wandb.mode=disabled", f"hydra.run.dir={run_dir}", "bench.target=offload", "bench.warmup=1",
                   "bench.repeats=2", "trainer.offload=drop_grads", module="rlsync.bench")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["target"] == "offload" and summary["offload"]["mode"] == "drop_grads"
    assert summary["metrics"]["perf/sleep_bytes"]["median"] == 3 * summary["offload"]["weight_bytes"]
    assert "Trainer offload alone" in proc.stdout and "| onload |" in proc.stdout
