"""Any causal LM from its config.json (model.config), the MoE presets, and the update's layout.

The published Qwen3-MoE configs count to the published parameter totals on the meta device; tiny
Llama- and Qwen3-MoE-style configs written here run whole steps through the real runner with
update.verify=true, sending the tensors and bytes counted here by hand from the config; an
architecture transformers builds no causal LM for is refused in one line, exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FAST, run_main

from rlsync.check.estimate import param_count, param_shapes
from rlsync.config.compose import conf_file
from rlsync.config.schema import ModelConfig
from rlsync.measure.memory import rss_bytes
from rlsync.model.architecture import layout_plan, update_tensors

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 300,
    "tie_word_embeddings": True,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 300,
    "tie_word_embeddings": False,
    "max_position_embeddings": 256,
    "bos_token_id": 256,
    "eos_token_id": 257,
}


def llama_by_hand(c: dict) -> tuple[int, int]:
    """(tensors, parameters) of a Llama causal LM, tied lm_head not sent."""
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    layer = q * h + 2 * kv * h + h * q + 3 * i * h + 2 * h  # q k v o, gate up down, two norms
    return 1 + 9 * c["num_hidden_layers"] + 1, c["vocab_size"] * h + c["num_hidden_layers"] * layer + h


def moe_by_hand(c: dict, layout: str) -> tuple[int, int]:
    """(tensors, parameters) of a Qwen3-MoE causal LM, untied; per-expert tensors in the checkpoint layout."""
    h, mi, e, hd = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    layer = (
        q * h + 2 * kv * h + h * q + 2 * hd + e * h + e * 3 * mi * h + 2 * h
    )  # attn, q/k norms, router, experts, norms
    per_layer = 6 + 1 + (3 * e if layout == "checkpoint" else 2) + 2
    return 2 + per_layer * c["num_hidden_layers"] + 1, 2 * c["vocab_size"] * h + c["num_hidden_layers"] * layer + h


@pytest.mark.parametrize(
    "preset, params, tensors",
    [
        ("qwen3_30b_a3b", 30_532_122_624, {"checkpoint": 18_867, "fused": 531}),
        ("qwen3_235b_a22b", 235_093_634_560, {"checkpoint": 36_945, "fused": 1_037}),
    ],
)
def test_published_moe_configs_count_to_the_published_totals_without_allocating(preset, params, tensors):
    before = rss_bytes()
    for layout, count in tensors.items():
        m = ModelConfig(config=conf_file(f"model/hf/{preset}.json"), update_layout=layout)
        shapes = param_shapes(m)
        assert len(shapes) == count
        assert param_count(m) == params  # to the parameter, in either layout
    assert rss_bytes() - before < 512 * 2**20  # the meta device: nothing of the 57 / 438 GiB is allocated
    names = dict(param_shapes(ModelConfig(config=conf_file(f"model/hf/{preset}.json"))))
    assert (
        names["model.layers.0.mlp.experts.127.up_proj.weight"] == names["model.layers.0.mlp.experts.0.gate_proj.weight"]
    )
    assert "model.layers.0.mlp.gate.weight" in names and "lm_head.weight" in names


def test_checkpoint_layout_is_contiguous_views_of_the_fused_experts():
    e, mi, h = 4, 3, 5
    gate_up, down = torch.randn(e, 2 * mi, h), torch.randn(e, h, mi)
    params = {
        "m.mlp.experts.gate_up_proj": gate_up,
        "m.mlp.experts.down_proj": down,
        "m.mlp.gate.weight": torch.randn(e, h),
    }
    out = update_tensors(params, "checkpoint")
    assert list(out)[:3] == [
        "m.mlp.experts.0.gate_proj.weight",
        "m.mlp.experts.0.up_proj.weight",
        "m.mlp.experts.0.down_proj.weight",
    ]
    assert len(out) == 3 * e + 1
    for i in range(e):
        for proj, want in (("gate", gate_up[i, :mi]), ("up", gate_up[i, mi:]), ("down", down[i])):
            view = out[f"m.mlp.experts.{i}.{proj}_proj.weight"]
            assert view.is_contiguous() and torch.equal(view, want)
            assert (
                view.untyped_storage().data_ptr() == (down if proj == "down" else gate_up).untyped_storage().data_ptr()
            )
    out["m.mlp.experts.2.up_proj.weight"].fill_(7.0)  # a write lands in the fused tensor (the engine's side)
    assert bool((gate_up[2, mi:] == 7.0).all())
    assert update_tensors(params, "fused") == params
    assert [x.name for x in layout_plan({"w": (3, 3)}, "checkpoint")] == ["w"]


def write_config(tmp_path: Path, name: str, config: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def run_step(tmp_path: Path, folder: Path, *extra: str) -> dict:
    run_dir = tmp_path / f"run_{folder.name}"
    proc = run_main(
        f"model.config={folder}",
        "update.verify=true",
        "wandb.mode=disabled",
        *FAST,
        "run.steps=2",
        f"hydra.run.dir={run_dir}",
        *extra,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["verification"] == "passed"
    assert summary["measured_steps"] == 1
    return summary | {"stdout": proc.stdout}


def test_a_llama_config_runs_a_verified_step(tmp_path):
    summary = run_step(tmp_path, write_config(tmp_path, "llama_tiny", LLAMA))
    tensors, params = llama_by_hand(LLAMA)
    assert summary["model"] == {"name": "llama_tiny", "params": params, "tensors": tensors, "update_bytes": 2 * params}
    assert summary["config"]["model"]["hidden_size"] == 64 and summary["config"]["model"]["vocab_size"] == 300
    assert f"Each update sent {tensors:,} tensors (model.update_layout=checkpoint)." in summary["stdout"]


@pytest.mark.parametrize(
    "layout, extra",
    [
        ("checkpoint", ()),
        ("checkpoint", ("update.strategy=per_tensor",)),
        ("fused", ("update.flat_engine_weights=true",)),
    ],
)  # per tensor over ipc, an engine process: tests/process/test_models_from_config.py
def test_a_qwen3_moe_config_runs_a_verified_step(tmp_path, layout, extra):
    summary = run_step(tmp_path, write_config(tmp_path, "moe_tiny", MOE), f"model.update_layout={layout}", *extra)
    tensors, params = moe_by_hand(MOE, layout)
    assert summary["model"] == {"name": "moe_tiny", "params": params, "tensors": tensors, "update_bytes": 2 * params}
    assert summary["setup"]["update_layout"] == layout and summary["setup"]["update_tensors"] == tensors
    assert f"Each update sent {tensors:,} tensors (model.update_layout={layout})." in summary["verdict"]


def test_an_unsupported_architecture_is_refused_in_one_line(tmp_path):
    folder = write_config(tmp_path, "other", {"model_type": "t5"})  # transformers builds no causal LM of T5
    proc = run_main(f"model.config={folder}", "wandb.mode=disabled", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        f"rlsync: config error: model.config={folder}: unsupported model_type=t5 (allowed: a config.json "
        f"of a causal-LM architecture transformers builds (AutoModelForCausalLM: llama, qwen3, qwen3_moe, "
        f"mistral, ...))"
    ], proc.stderr


@pytest.mark.parametrize(
    "config, overrides, key, why",
    [
        ({"model_type": "no_such_arch"}, (), "model.config", "unsupported model_type=no_such_arch"),
        ({"hidden_size": 8}, (), "model.config", "no model_type in it"),
        (
            MOE,
            ("update.flat_engine_weights=true",),
            "update.flat_engine_weights",
            "not allowed for a model with fused experts",
        ),
        (MOE, ("rollout.engine=vllm",), "model.config", "not supported with rollout.engine=vllm"),
        (MOE, ("model.pretrained=Qwen/Qwen3-0.6B",), "model.config", "not allowed with model.pretrained"),
    ],
)
def test_what_cannot_run_is_refused_at_validation(tmp_path, compose, config, overrides, key, why):
    from rlsync.config.validate import validate
    from rlsync.errors import ConfigError

    cfg = compose(f"model.config={write_config(tmp_path, 'c', config)}", *overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value).startswith(f"{key}=") and why in str(err.value)


def test_flat_engine_weights_bind_the_fused_layout_and_dense_models(tmp_path, compose):
    from rlsync.config.validate import validate

    validate(
        compose(
            f"model.config={write_config(tmp_path, 'moe', MOE)}",
            "model.update_layout=fused",
            "update.flat_engine_weights=true",
        )
    )
    validate(compose(f"model.config={write_config(tmp_path, 'llama', LLAMA)}", "update.flat_engine_weights=true"))


def test_model_keys_follow_the_config(tmp_path, compose):
    from rlsync.config.validate import validate

    cfg = compose(f"model.config={write_config(tmp_path, 'llama_x', LLAMA)}")
    validate(cfg)
    m = cfg.model
    assert (m.name, m.hidden_size, m.num_hidden_layers, m.vocab_size, m.tie_word_embeddings, m.rope_theta) == (
        "llama_x",
        64,
        2,
        300,
        True,
        10000.0,
    )
    cfg = compose("model=qwen3_30b_a3b")
    validate(cfg)
    assert (cfg.model.name, cfg.model.hidden_size, cfg.model.num_hidden_layers, cfg.model.tie_word_embeddings) == (
        "qwen3_30b_a3b",
        2048,
        48,
        False,
    )
