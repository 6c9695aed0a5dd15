"""trainer.lora.rank > 0: PEFT's adapters train; the update sends them alone (adapter) or merged (merged)."""

import pytest
import torch
from conftest import FAST, lora_run, read_jsonl, run_main

from rlsync.config.schema import Config, LoraConfig, TrainerConfig, UpdateConfig
from rlsync.config.validate import validate
from rlsync.errors import ConfigError
from rlsync.model.architecture import model_shapes
from rlsync.model.build import named_weights
from rlsync.model.lora import (
    MergedWeights,
    adapted,
    adapter_shapes,
    is_adapter,
    merge_errors,
    scaling,
    update_name,
)
from rlsync.update import plan_for
from rlsync.update.buckets import plan_buckets

LORA = LoraConfig(rank=16)
LR = "trainer.lr=0.01"  # large enough that a stale engine's log-probs move far: the check below can fail


RANK = ("trainer.lora.rank=16", "update.payload=lora")  # adapters, sent alone


def lora_cfg(*, payload: str = "full", rank: int = 16, bucket_mb: float = 512.0, **lora) -> Config:
    update = UpdateConfig(payload=payload, bucket_mb=bucket_mb)
    return Config(trainer=TrainerConfig(lora=LoraConfig(rank=rank, **lora)), update=update)


def test_the_update_names_adapters_as_peft_saves_them(tiny):
    """PEFT's in-memory names (base_layer, the adapter's name) are dropped; only the adapters train."""
    assert update_name("m.layers.0.self_attn.q_proj.base_layer.weight") == "m.layers.0.self_attn.q_proj.weight"
    assert update_name("m.layers.0.mlp.up_proj.lora_A.default.weight") == "m.layers.0.mlp.up_proj.lora_A.weight"
    assert update_name("m.layers.0.input_layernorm.weight") == "m.layers.0.input_layernorm.weight"
    model = adapted(tiny.build(), LORA)
    names = named_weights(model)
    trainable = {update_name(n) for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in names if is_adapter(n)}
    assert {n for n in names if not is_adapter(n)} == {n for n, _ in model_shapes(tiny.model)}
    # the memory check and the planner size the adapters from the model's shapes alone: the same tensors
    assert adapter_shapes(list(model_shapes(tiny.model)), LORA) == [
        (n, tuple(t.shape)) for n, t in names.items() if is_adapter(n)
    ]


def test_each_layers_a_and_b_travel_in_one_bucket(tiny):
    """Buckets smaller than the adapters: a plain plan splits a pair, the adapter plan never does, and no
    bucket mixes base weights with adapters."""
    names = named_weights(adapted(tiny.build(), LORA))
    cfg = lora_cfg(payload="lora", bucket_mb=0.011)
    buckets = plan_for(names, cfg.update, torch.bfloat16)
    for bucket in buckets:
        kinds = {is_adapter(n) for n in bucket.names}
        assert len(kinds) == 1, bucket.names
        layers = [n.rsplit(".lora_", 1)[0] for n in bucket.names if is_adapter(n)]
        for layer in set(layers):
            assert layers.count(layer) == 2, (layer, bucket.names)
    adapter_names = [n for n in names if is_adapter(n)]
    assert sorted(n for b in buckets for n in b.names) == sorted(names)
    from rlsync.update.buckets import metas_of

    plain = plan_buckets(metas_of({n: names[n] for n in adapter_names}, torch.bfloat16), int(0.011 * 2**20))
    split = [b for b in plain if sum(".lora_A." in n for n in b.names) != sum(".lora_B." in n for n in b.names)]
    assert split, "this bucket size must split some pair in a plain plan, or the test shows nothing"


def test_merged_weights_are_the_base_plus_the_scaled_product(tiny):
    model = adapted(tiny.build(), LORA)
    names = named_weights(model)
    with torch.no_grad():
        for n, t in names.items():
            if n.endswith(".lora_B.weight"):
                t.normal_(0, 0.01)  # PEFT starts B at zero
    merged = MergedWeights(names, scaling(LORA))
    assert set(merged) == {n for n in names if not is_adapter(n)}
    q = "model.layers.0.self_attn.q_proj"
    want = names[q + ".weight"] + scaling(LORA) * names[q + ".lora_B.weight"] @ names[q + ".lora_A.weight"]
    assert torch.allclose(merged[q + ".weight"], want, atol=1e-6)
    assert merged["model.norm.weight"] is names["model.norm.weight"]  # untargeted: itself
    errors = merge_errors(names, scaling(LORA), torch.bfloat16)
    assert 0 < errors["update/lora_merge_error"] <= errors["update/lora_merge_error_in_dtype"] * 1.5
    assert 0 < errors["update/lora_merge_differ_ratio"] < 1


def test_the_fp32_merge_is_the_nearest_and_a_large_contribution_lands(tiny):
    """Cast once, the fp32 merge is the nearest engine-dtype weight: never farther than a bf16 merge;
    where s*BA is large against bf16's resolution of W, little of it is lost either way."""
    names = named_weights(adapted(tiny.build(), LORA))
    for std in (1e-7, 1e-3, 1.0):
        with torch.no_grad():
            for n, t in names.items():
                if n.endswith(".lora_B.weight"):
                    t.normal_(0, std, generator=torch.Generator().manual_seed(0))
        errors = merge_errors(names, scaling(LORA), torch.bfloat16)
        assert errors["update/lora_merge_error"] <= errors["update/lora_merge_error_in_dtype"], (std, errors)
    assert errors["update/lora_merge_error"] < 0.05, errors  # std 1.0: s*BA dwarfs W's rounding


def test_no_merge_error_while_the_adapters_add_nothing(tiny):
    assert merge_errors(named_weights(adapted(tiny.build(), LORA)), scaling(LORA), torch.bfloat16) == {}


def adapter_bytes(model_cfg) -> int:
    return sum(a * b for _, (a, b) in adapter_shapes(list(model_shapes(model_cfg)), LORA)) * 2  # bf16


@pytest.mark.parametrize(
    "payload, transport",
    [
        ("lora", "direct"),
        ("lora_merged", "direct"),
    ],  # the engine processes: tests/process/test_lora.py
)
def test_a_lora_run_keeps_the_engine_on_the_trainers_log_probs(tmp_path, tiny, payload, transport):
    """3 steps at a learning rate that moves the adapters far: the engine's log-probs of its own samples stay
    on the trainer's (a stale engine's are off by 0.1 or more: the control test), every update verified;
    the adapter mode sends exactly the adapters after the first update, the merged one the whole model."""
    proc, rows = lora_run(tmp_path, payload, transport)
    if payload == "lora":
        assert all(row["perf/update_weights_bytes"] == adapter_bytes(tiny.model) for row in rows)
        assert "LoRA adapters only" in proc.stdout
    else:
        base = sum(2 * torch.Size(s).numel() for _, s in model_shapes(tiny.model))
        assert all(row["perf/update_weights_bytes"] == base for row in rows)
        assert all(row["update/lora_merge_error"] > 0 for row in rows[1:])  # once B has moved off zero
        assert "against the exact W + s*BA" in proc.stdout


def test_a_stale_engine_is_caught_at_that_learning_rate(tmp_path):
    """The control: without updates the engine's log-probs leave the trainer's by far more than the bound."""
    proc = run_main(*FAST, *RANK, "update.enabled=false", LR, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert max(r["train/logprob_abs_diff"] for r in rows[1:]) > 0.1


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["update.payload=lora"], "update.payload"),  # no adapters at rank 0
        (["update.payload=lora_merged"], "update.payload"),
        (["trainer.lora.rank=16"], "update.payload"),  # the default, full, sends no adapters: choose
        (["trainer.lora.rank=16", "update.payload=delta"], "update.payload"),
        (["trainer.lora.rank=16", "update.payload=fp8"], "update.payload"),
        (["trainer.lora.rank=16", "update.lora=merged"], "update.lora"),  # the key update.payload replaced
        ([*RANK, "rollout.release_level=2"], "rollout.release_level"),
        ([*RANK, "update.strategy=per_tensor"], "update.strategy"),
        ([*RANK, "trainer.lora.target_modules=[nothing_here]"], "trainer.lora.target_modules"),
        ([*RANK, "rollout.engine=vllm"], "rollout.engine"),
        ([*RANK, "trainer.lora.alpha=1e308"], "trainer.lora.alpha"),  # P07: inf scale, nan at step 0
        # P11: PEFT's Embedding LoRA keeps lora_embedding_A/B, which the update neither names nor sends
        ([*RANK, "trainer.lora.target_modules=[embed_tokens]"], "trainer.lora.target_modules"),
        ([*RANK, "trainer.lora.target_modules=[q_proj,embed_tokens]"], "trainer.lora.target_modules"),
        ([*RANK, "trainer.lora.target_modules=[lm_head]"], "trainer.lora.target_modules"),  # tied
        (["update.payload=lora", "trainer.lora.rank=4096"], "trainer.lora.rank"),  # P33: above the model's layers
    ],
)
def test_what_lora_cannot_do_is_refused_in_one_line(tmp_path, overrides, key):
    proc = run_main(*overrides, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"rlsync: config error: {key}="), line


def test_the_lora_refusals_name_the_layer_and_the_widths(tmp_path):
    def line(*overrides: str) -> str:
        return run_main(*RANK, *overrides, f"hydra.run.dir={tmp_path}").stderr.strip()

    assert "embed_tokens names model.embed_tokens (Embedding), which takes no adapter" in line(
        "trainer.lora.target_modules=[embed_tokens]"
    )
    rank = line("trainer.lora.rank=129")  # the tiny model's k_proj and v_proj are 256 -> 128
    assert "trainer.lora.rank=129: out of range (allowed: 0, or 1 to 128:" in rank
    assert "model.layers.0.self_attn.k_proj, is 256 -> 128" in rank
    alpha = line("trainer.lora.alpha=16384.5")
    assert "trainer.lora.alpha=16384.5: out of range (allowed: a number > 0 and at most 16384" in alpha


def test_the_widest_alpha_and_rank_allowed_validate():
    """The bounds themselves pass: rank min(in, out) of the narrowest targeted layer (k_proj: 128), alpha 2^14."""
    from rlsync.config.schema import ALPHA_MAX

    validate(lora_cfg(payload="lora", rank=128, alpha=ALPHA_MAX))
    validate(lora_cfg(payload="lora", rank=129, target_modules=["q_proj", "down_proj"]))
    with pytest.raises(ConfigError, match=r"^trainer.lora.rank=257: out of range"):
        validate(lora_cfg(payload="lora", rank=257, target_modules=["q_proj", "down_proj"]))


def test_inject_wraps_the_layers_validation_accepts(tiny):
    """The check and the injection pick the same layers (wrapped_layers): here the tied lm_head is not one."""
    from rlsync.model.lora import wrapped_layers

    model = tiny.build()
    names = [name for name, _ in wrapped_layers(model, ["q_proj", "lm_head", "embed_tokens"])]
    assert names == [f"model.layers.{i}.self_attn.q_proj" for i in range(4)]
    wrapped = adapted(model, LoraConfig(rank=4, target_modules=["q_proj", "lm_head"]))
    assert {update_name(n) for n, p in wrapped.named_parameters() if p.requires_grad} == {
        f"model.layers.{i}.self_attn.q_proj.lora_{ab}.weight" for i in range(4) for ab in "AB"
    }


def test_a_rank_asks_for_a_lora_payload_and_a_lora_payload_for_a_rank():
    """Adapters are sent alone or merged, chosen by update.payload; the default, full, would send neither."""
    for payload in ("lora", "lora_merged"):
        validate(lora_cfg(payload=payload, rank=8))
    with pytest.raises(ConfigError, match=r"^update.payload=full: not allowed with trainer.lora.rank=8 .*lora\|lo"):
        validate(lora_cfg(rank=8))
    with pytest.raises(ConfigError, match=r"^update.payload=lora_merged: not allowed with trainer.lora.rank=0"):
        validate(Config(update=UpdateConfig(payload="lora_merged")))


def test_the_planner_sizes_each_kind_from_the_config(tiny):
    """plan.json's kinds: the adapter row is the bytes a LoRA run sends after its first update; a delta at a
    changed ratio of 0 sends nothing; FP8 is smaller than the full update."""
    from rlsync.config.apps import PlanAppConfig, PlanConfig
    from rlsync.plan.planner import make_plan

    cfg = PlanAppConfig(plan=PlanConfig(changed_ratio=0.0))
    validate(cfg)
    rows = make_plan(cfg, calibration=None, calibration_where="none", bucket_sizes=[512.0])["kinds"]["rows"]
    assert rows["lora"]["bytes"] == adapter_bytes(tiny.model)
    assert rows["delta"]["bytes"] == 0
    assert (
        rows["fp8"]["bytes"]
        < rows["full"]["bytes"]
        == sum(2 * torch.Size(s).numel() for _, s in model_shapes(tiny.model))
    )
