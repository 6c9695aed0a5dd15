"""The rollout engine's release/resume at each rollout.release_level (vLLM's levels): 0 and 1 on a CPU keep
the weights where they are, bit-exact; 1 with a host apart (CUDA) frees them and copies them back; 2 frees
them, and after resume + the weight update they equal the trainer's (cast to the engine dtype)."""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL, Ids, Tiny

from rlsync.config.schema import RolloutConfig, UpdateConfig
from rlsync.update import close_update

PROMPTS = [[256, 72, 105], [256, 50, 43, 50, 61]]


IDS = Ids(torch.ones(SMALL.vocab_size, dtype=torch.bool), eos_id=257, pad_id=258)  # every id may be sampled


def spec(release_level: int):
    return Tiny().spec(model=SMALL, rollout=RolloutConfig(release_level=release_level), tokenizer=IDS)


def trainer_weights(seed: int) -> dict[str, torch.Tensor]:
    return Tiny().weights(model=SMALL, seed=seed)


def generate(engine, seed: int = 0):
    return engine.generate(PROMPTS, max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(seed))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def loaded(level: int):
    engine = spec(level).build()
    engine.load_weights((name, t.to(engine.dtype)) for name, t in trainer_weights(0).items())
    return engine


@pytest.mark.parametrize("level", [0, 1])
def test_levels_0_and_1_on_a_cpu_keep_the_weights_where_they_are_bit_exact(level):
    """Level 0 releases nothing; level 1 offloads the weights to host memory, which on a CPU is where
    they are: both keep every weight in place, and the round trip generates the same answers."""
    engine = loaded(level)
    before = {name: t.clone() for name, t in engine.weights.items()}
    where = {name: p.data_ptr() for name, p in engine.model.named_parameters()}
    first = generate(engine)
    engine.release()
    assert all(p.untyped_storage().nbytes() > 0 for p in engine.model.parameters())  # only the KV cache went
    assert {name: p.data_ptr() for name, p in engine.model.named_parameters()} == where and not engine.host_copies
    engine.resume()
    assert all(same_bits(engine.weights[name], t) for name, t in before.items())
    again = generate(engine)
    assert torch.equal(first.sequences, again.sequences) and torch.equal(first.logprobs, again.logprobs)


def test_level_1_with_a_host_apart_offloads_the_weights_and_copies_them_back():
    """Level 1 where the host is not the device (CUDA), its copy path run on a CPU: the weights' storage
    is freed while asleep, its bytes held in host copies made once, and resume brings them back."""
    engine = loaded(1)
    engine.host_is_device = False  # as on CUDA: the copies go to (unpinned, here) host storages
    before = {name: t.clone() for name, t in engine.weights.items()}
    first = generate(engine)
    for _ in range(2):  # the host copies are made at the first release and reused
        engine.release()
        assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
        copies = [id(h) for h in engine.host_copies]
        assert sum(h.nbytes() for h in engine.host_copies) == sum(t.nbytes for t in before.values())
        engine.resume()
        engine.resume()  # idempotent: the loop resumes before the update and again before the rollout
        assert all(same_bits(engine.weights[name], t) for name, t in before.items())
    assert [id(h) for h in engine.host_copies] == copies
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()  # still tied
    again = generate(engine)
    assert torch.equal(first.sequences, again.sequences) and torch.equal(first.logprobs, again.logprobs)


@pytest.mark.parametrize("strategy", ["bucketed", "per_tensor"])
def test_level_2_frees_the_weights_and_the_update_refills_them(strategy):
    weights = trainer_weights(0)
    cfg = UpdateConfig(strategy=strategy, bucket_mb=0.05)  # several buckets
    engine, transport, _buckets = Tiny().open(cfg, weights, spec=spec(2))
    reference = spec(0).build()  # never released: what the same weights generate
    try:
        transport.update_weights(weights)
        reference.load_weights((name, t.to(reference.dtype)) for name, t in weights.items())
        model = engine.model
        nbytes = {name: p.untyped_storage().nbytes() for name, p in model.named_parameters()}
        params = {name: id(p) for name, p in model.named_parameters()}
        engine.release()
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        engine.release()  # twice is harmless
        engine.resume()
        assert {name: p.untyped_storage().nbytes() for name, p in model.named_parameters()} == nbytes
        assert {name: id(p) for name, p in model.named_parameters()} == params
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
        engine.resume()  # idempotent: the loop resumes before the update and again before the rollout

        new = trainer_weights(1)  # a later step's weights: nothing of the old ones can survive by luck
        transport.update_weights(new)
        assert all(same_bits(engine.weights[name], t.to(torch.bfloat16)) for name, t in new.items())
        reference.load_weights((name, t.to(reference.dtype)) for name, t in new.items())
        got, want = generate(engine), generate(reference)
        assert torch.equal(got.sequences, want.sequences) and torch.equal(got.logprobs, want.logprobs)
    finally:
        close_update(engine, transport)


def test_level_2_refuses_weights_it_does_not_own_and_level_1_leaves_them():
    engine = spec(2).build()
    for p in engine.model.parameters():
        p.data.share_memory_()  # as a transport's shared flat buffers would be
    with pytest.raises(RuntimeError, match=r"rollout.release_level=2: .*set rollout.release_level=1 or 0"):
        engine.release()
    engine.release_level, engine.host_is_device = 1, False  # level 1 as on CUDA: the trainer side's memory stays
    engine.release()
    assert all(p.untyped_storage().nbytes() > 0 for p in engine.model.parameters()) and not engine.released


def test_which_levels_take_the_weights_before_an_update():
    """The loop wakes the engine before the update where its release took the weights off the device."""
    from rlsync.engines.hf import HFEngine

    assert [HFEngine.release_takes_weights(level, "cpu") for level in (0, 1, 2)] == [False, False, True]
    assert [HFEngine.release_takes_weights(level, "cuda") for level in (0, 1, 2)] == [False, True, True]


def test_sleep_level_2_needs_the_update(compose):
    from rlsync.config.validate import validate
    from rlsync.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.release_level=2.*update.enabled=false"):
        validate(compose("rollout.release_level=2", "update.enabled=false"))
    validate(compose("rollout.release_level=1", "update.enabled=false"))  # level 1 brings the weights back itself


@pytest.mark.parametrize("value", ["3", "-1"])
def test_a_sleep_level_outside_0_to_2_is_refused_in_one_line(tmp_path, value):
    from conftest import run_main

    proc = run_main(f"rollout.release_level={value}", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"rlsync: config error: rollout.release_level={value}: out of range"), line
    assert "0 to 2" in line, line
