import pytest
import torch

from rlsync.config.derived import bucket_bytes
from rlsync.config.schema import Config
from rlsync.model.build import build_model, hf_config, model_bytes, named_weights

# (model, hidden, layers, heads, tied, bf16 bytes with tied weights counted once)
MODELS = [
    ("tiny", 256, 4, 4, True, None),
    ("qwen3_0p6b", 1024, 28, 16, True, 1_192_099_840),
    ("qwen3_1p7b", 2048, 28, 16, True, None),
    ("qwen3_4b", 2560, 36, 32, True, None),
    ("qwen3_8b", 4096, 36, 32, False, None),
]


@pytest.mark.parametrize("name,hidden,layers,heads,tied,nbytes", MODELS)
def test_every_model_composes_to_its_published_architecture(compose, name, hidden, layers, heads, tied, nbytes):
    cfg = compose(f"model={name}")
    assert isinstance(cfg, Config)
    m = cfg.model
    assert (m.name, m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.tie_word_embeddings) == (
        name,
        hidden,
        layers,
        heads,
        tied,
    )
    if name != "tiny":
        assert (m.vocab_size, m.head_dim, m.num_key_value_heads) == (151936, 128, 8)
    if nbytes:
        from transformers import Qwen3ForCausalLM

        with torch.device("meta"):
            model = Qwen3ForCausalLM(hf_config(m))
        assert model_bytes(model, torch.bfloat16) == nbytes
        assert len(named_weights(model)) == 310  # 28 layers x 11 + embedding + final norm; lm_head tied


def test_sizes_match_design_notes(compose):
    from transformers import Qwen3ForCausalLM

    for name, gib in [("qwen3_1p7b", 3.20), ("qwen3_4b", 7.49), ("qwen3_8b", 15.26)]:
        with torch.device("meta"):
            model = Qwen3ForCausalLM(hf_config(compose(f"model={name}").model))
        assert model_bytes(model, torch.bfloat16) / 2**30 == pytest.approx(gib, abs=0.01)


def test_overrides_reach_the_typed_tree(compose):
    cfg = compose("update.bucket_mb=128", "rollout.max_response_len=256", "trainer.kl_coef=0.1")
    assert cfg.update.bucket_mb == 128 and bucket_bytes(cfg.update) == 128 * 2**20
    assert cfg.rollout.max_response_len == 256 and cfg.trainer.kl_coef == 0.1
    assert compose("rollout=reference").rollout.max_response_len == 256


def test_default_bucket_is_the_reference_buffer_size(compose):
    assert bucket_bytes(compose().update) == 536870912


@pytest.mark.parametrize("override", ["update.bucket_size=3", "model.hidden_size=big", "model=qwen9"])
def test_schema_rejects_unknown_keys_and_wrong_types(compose, override):
    with pytest.raises(Exception):  # noqa: B017 - Hydra raises a different error type for each case
        compose(override)


def test_random_build_is_seeded_and_tied():
    cfg = Config().model
    a = build_model(cfg, dtype=torch.float32, device=torch.device("cpu"), seed=1)
    b = build_model(cfg, dtype=torch.float32, device=torch.device("cpu"), seed=1)
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name
    assert a.lm_head.weight is a.model.embed_tokens.weight
    w = a.model.layers[0].mlp.up_proj.weight
    assert 0.015 < w.std().item() < 0.025 and torch.isfinite(w).all()
