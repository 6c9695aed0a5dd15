"""The rollout engine's release/resume: the KV-cache-only round trip is bit-exact; released weights hold
no memory and, after resume + the weight update, equal the trainer's (cast to the engine dtype)."""

from __future__ import annotations

import pytest
import torch
from conftest import Ids, Tiny

from rlsync.config.schema import ModelConfig, RolloutConfig, UpdateConfig

CPU = torch.device("cpu")
TINY = ModelConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
)
PROMPTS = [[256, 72, 105], [256, 50, 43, 50, 61]]


IDS = Ids(torch.ones(TINY.vocab_size, dtype=torch.bool), eos_id=257, pad_id=258)  # every id may be sampled


def spec(release_weights: bool):
    return Tiny().spec(model=TINY, rollout=RolloutConfig(release_weights=release_weights), tokenizer=IDS)


def trainer_weights(seed: int) -> dict[str, torch.Tensor]:
    return Tiny().weights(model=TINY, seed=seed)


def generate(engine, seed: int = 0):
    return engine.generate(PROMPTS, max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(seed))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_release_resume_without_weight_release_is_bit_exact():
    engine = spec(release_weights=False).build()
    weights = trainer_weights(0)
    engine.load_weights((name, t.to(engine.dtype)) for name, t in weights.items())
    before = {name: t.clone() for name, t in engine.weights.items()}
    first = generate(engine)
    engine.release()
    assert all(p.untyped_storage().nbytes() > 0 for p in engine.model.parameters())  # only the KV cache went
    engine.resume()
    assert all(same_bits(engine.weights[name], t) for name, t in before.items())
    again = generate(engine)
    assert torch.equal(first.sequences, again.sequences) and torch.equal(first.logprobs, again.logprobs)


@pytest.mark.parametrize("strategy", ["bucketed", "per_tensor"])
def test_released_weights_free_their_memory_and_the_update_refills_them(strategy):
    weights = trainer_weights(0)
    cfg = UpdateConfig(strategy=strategy, bucket_mb=0.05)  # several buckets
    handle, buckets = Tiny().open(cfg, weights, spec=spec(release_weights=True))
    reference = spec(release_weights=False).build()  # never released: what the same weights generate
    try:
        handle.update_weights(weights)
        reference.load_weights((name, t.to(reference.dtype)) for name, t in weights.items())
        engine = handle.engine
        model = engine.model
        nbytes = {name: p.untyped_storage().nbytes() for name, p in model.named_parameters()}
        params = {name: id(p) for name, p in model.named_parameters()}
        handle.release()
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        handle.release()  # twice is harmless
        handle.resume()
        assert {name: p.untyped_storage().nbytes() for name, p in model.named_parameters()} == nbytes
        assert {name: id(p) for name, p in model.named_parameters()} == params
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
        handle.resume()  # idempotent: the loop resumes before the update and again before the rollout

        new = trainer_weights(1)  # a later step's weights: nothing of the old ones can survive by luck
        handle.update_weights(new)
        assert all(same_bits(engine.weights[name], t.to(torch.bfloat16)) for name, t in new.items())
        reference.load_weights((name, t.to(reference.dtype)) for name, t in new.items())
        got, want = generate(engine), generate(reference)
        assert torch.equal(got.sequences, want.sequences) and torch.equal(got.logprobs, want.logprobs)
    finally:
        handle.close()


def test_release_refuses_weights_it_does_not_own():
    engine = spec(release_weights=True).build()
    for p in engine.model.parameters():
        p.data.share_memory_()  # as a transport's shared flat buffers would be
    with pytest.raises(RuntimeError, match="rollout.release_weights=false"):
        engine.release()


def test_runner_with_released_engine_weights_trains_and_generates_the_same(tmp_path):
    """Same seed, release_weights on and off: the same samples, losses and log-prob agreement,
    with the pre-update resume timed as part of perf/engine_resume_time."""
    from test_offload import run_in_process

    rows = {
        flag: run_in_process(tmp_path / flag, f"rollout.release_weights={flag}", "update.source=host")[0]
        for flag in ("true", "false")
    }
    for key in (
        "train/loss",
        "train/grad_norm",
        "train/logprob_abs_diff",
        "rollout/reward_mean",
        "rollout/response_len_mean",
    ):
        assert [r[key] for r in rows["true"]] == [r[key] for r in rows["false"]], key
    assert all(r["train/logprob_abs_diff"] < 0.05 for r in rows["true"])  # the engine really has the trainer's weights
    assert all(r["perf/engine_resume_time"] > 0 and r["perf/engine_release_time"] > 0 for r in rows["true"])


def test_release_weights_needs_the_update(compose):
    from rlsync.config.validate import validate
    from rlsync.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.release_weights=true.*update.enabled=false"):
        validate(compose("rollout.release_weights=true", "update.enabled=false"))
