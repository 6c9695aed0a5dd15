"""The model's architecture: its transformers config, its parameter shapes, and the update's layout.

One module owns "which model": `hf_config(m)` is the transformers config the trainer, the HF engine
and the memory estimate all build from (the JSON at `model.config`, else a Qwen3Config from the
model.* keys, as the Qwen3 presets always were); `build_empty` builds it on the meta device and then
gives it storage (no initializer runs); `param_shapes` reads the names and shapes off a meta build
(no allocation: Qwen3-235B-A22B in about a second, well under 1 GB resident).

The update's layout (`model.update_layout`). transformers 5 holds a MoE layer's experts fused in two
3-D parameters, `mlp.experts.gate_up_proj` (E, 2 * moe_I, H) and `mlp.experts.down_proj`
(E, H, moe_I): 531 tensors for Qwen3-30B-A3B. Trainers send, and vLLM and SGLang load, one tensor
per expert and projection, named as the published checkpoints name them:

    model.layers.{i}.mlp.experts.{e}.gate_proj.weight  (moe_I, H) = gate_up_proj[e, :moe_I]
    model.layers.{i}.mlp.experts.{e}.up_proj.weight    (moe_I, H) = gate_up_proj[e, moe_I:]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight  (H, moe_I) = down_proj[e]

(18,867 tensors for 30B-A3B, 36,945 for 235B-A22B). `checkpoint` (the default) sends those,
contiguous views of the fused parameters, so nothing is copied to make them; `fused` sends
transformers' in-memory tensors. Both sides use the same `layout_plan`: the trainer's views are what
is sent, the engine's views (of its own fused parameters) are where they land, so buckets, verify
and checksums work by name unchanged. A dense model is the same in both layouts.
"""

from __future__ import annotations

from dataclasses import fields
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple, get_type_hints

import torch
from torch import nn

from rlsync.config.files import CONFIG_JSON_MAX, MAX_DEPTH, UnreadableFile, read_json
from rlsync.config.schema import ModelConfig
from rlsync.errors import ConfigError
from rlsync.fmt import fmt_bytes, is_number

LAYOUTS = ("checkpoint", "fused")  # model.update_layout's choices
EXPERTS = "experts."
FUSED_GATE_UP, FUSED_DOWN = "experts.gate_up_proj", "experts.down_proj"
# The model.* keys that describe the architecture: read from model.config's JSON (through its
# transformers config, so defaults and aliases such as GPT-2's n_embd apply; a key the architecture
# lacks keeps its value), and what a checkpoint's config.json must agree with (rlsync.model.build)
ARCHITECTURE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
)
DEFAULT_NAME = "tiny"  # the default preset's name: with model.config it becomes the config's own name


# ----------------------------------------------------------------------------------------------
# model.config: the JSON, and the transformers config
# ----------------------------------------------------------------------------------------------


def config_path(path: str) -> Path:
    """The config.json `model.config` names: the file, or config.json in the folder."""
    p = Path(path).expanduser()
    return p / "config.json" if p.is_dir() else p


def read_config_json(path: str) -> dict:
    """model.config's JSON object, with a model_type; ConfigError (one line) otherwise. Only a regular
    file is opened (a FIFO would block), of at most CONFIG_JSON_MAX bytes, nested at most MAX_DEPTH deep."""
    file = config_path(path)
    try:
        data = read_json(file, max_bytes=CONFIG_JSON_MAX)
    except FileNotFoundError:
        raise ConfigError("model.config", path, "a config.json, or a folder holding one", "no such file") from None
    except UnreadableFile as err:
        raise ConfigError(
            "model.config",
            path,
            f"a regular file holding a config.json of at most {fmt_bytes(CONFIG_JSON_MAX)}, nested at most {MAX_DEPTH} deep",
            f"cannot read it: {err}",
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(
            "model.config", path, "a transformers config.json (a JSON object with a model_type)", "no model_type in it"
        )
    return data


def causal_lm_types() -> tuple[str, ...]:
    """The model_type values transformers builds a causal LM for (AutoModelForCausalLM)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def check_supported(m: ModelConfig) -> None:
    """model.config names a causal-LM architecture transformers can build and whose update rlsync can
    lay out; raise ConfigError naming its model_type otherwise. Builds it on the meta device."""
    data = read_config_json(m.config)
    model_type = data["model_type"]
    if model_type not in causal_lm_types():
        raise ConfigError(
            "model.config",
            m.config,
            "a config.json of a causal-LM architecture transformers builds "
            "(AutoModelForCausalLM: llama, qwen3, qwen3_moe, mistral, ...)",
            f"unsupported model_type={model_type}",
        )
    rope = data.get("rope_parameters") if isinstance(data.get("rope_parameters"), dict) else {}
    check_values(m, {**{k: data[k] for k in ARCHITECTURE_KEYS if k in data}, **_rope_theta(rope)})  # as written
    try:
        check_values(m, {k: config_value(hf_config(m), k) for k in ARCHITECTURE_KEYS})  # as transformers reads them
        update_shapes(m)
    except UnsupportedLayout as err:
        raise ConfigError(
            "model.update_layout", m.update_layout, f"fused ({err})", f"not supported for model_type={model_type}"
        ) from None
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever transformers raises on a config it cannot build
        first = (str(err).splitlines() or [""])[0][:200]
        raise ConfigError(
            "model.config",
            m.config,
            "a config.json transformers can build",
            f"model_type={model_type} failed to build ({type(err).__name__}: {first})",
        ) from None


def _rope_theta(rope: dict) -> dict:
    return {"rope_theta": rope["rope_theta"]} if rope.get("rope_theta") is not None else {}


def check_values(m: ModelConfig, values: dict[str, Any]) -> None:
    """model.config's architecture values under the rules of the model.* keys they replace
    (rlsync/config/schema.py), before anything is built: a ConfigError naming the key and the file."""
    hints = get_type_hints(ModelConfig)
    rules = {f.name: f.metadata.get("rule") for f in fields(ModelConfig)}
    for key, value in values.items():
        if value is None:
            continue
        hint, rule = hints[key], rules[key]
        if hint is bool:
            typed = isinstance(value, bool)
        elif hint is int:
            typed = (isinstance(value, int) and not isinstance(value, bool)) or (
                isinstance(value, float) and value.is_integer()
            )
        else:
            typed = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not typed or not rule.ok(value):
            allowed = rule.allowed.replace("a number", "an integer") if hint is int else rule.allowed
            problem = "out of range" if typed and is_number(value) else "not allowed"
            raise ConfigError(f"model.{key}", value, allowed, f"{problem} in model.config={m.config}")


def hf_config(m: ModelConfig):
    """The transformers config of the model `m` describes: model.config's JSON, else Qwen3 from the keys."""
    if m.config:
        from transformers import AutoConfig

        data = read_config_json(m.config)
        data.pop("dtype", None), data.pop("torch_dtype", None)  # the dtype is the run's (trainer.dtype, rollout.dtype)
        return AutoConfig.for_model(data.pop("model_type"), **data)
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        head_dim=m.head_dim,
        max_position_embeddings=m.max_position_embeddings,
        rope_theta=m.rope_theta,
        rms_norm_eps=m.rms_norm_eps,
        tie_word_embeddings=m.tie_word_embeddings,
        architectures=["Qwen3ForCausalLM"],
    )


def config_value(hf, key: str):
    """`key` of a transformers config (None when the architecture has no such value)."""
    if key == "rope_theta":
        rope = getattr(hf, "rope_parameters", None)
        if isinstance(rope, dict) and rope.get("rope_theta") is not None:
            return rope["rope_theta"]
    if key == "num_key_value_heads" and getattr(hf, key, None) is None:
        return getattr(hf, "num_attention_heads", None)
    if key == "head_dim" and getattr(hf, key, None) is None:
        heads, width = getattr(hf, "num_attention_heads", None), getattr(hf, "hidden_size", None)
        return width // heads if heads and width else None
    return getattr(hf, key, None)


def fill_keys(m: ModelConfig) -> None:
    """With model.config: the model.* architecture keys take the config's values (what the rest of
    rlsync reads: the vocabulary, the sequence limit, the memory estimate), and the default name
    `tiny` becomes the config's folder name (or its file's stem); model.config becomes the file's
    absolute path."""
    if not m.config:
        return
    m.config = str(config_path(m.config).resolve())  # the file itself, wherever an engine process starts
    hf = hf_config(m)
    for key in ARCHITECTURE_KEYS:
        value = config_value(hf, key)
        if value is None:
            continue
        current = getattr(m, key)
        setattr(m, key, float(value) if isinstance(current, float) else type(current)(value))
    if m.name == DEFAULT_NAME:
        file = config_path(m.config)
        m.name = file.parent.name if file.name == "config.json" and file.parent.name else file.stem


# ----------------------------------------------------------------------------------------------
# Building it
# ----------------------------------------------------------------------------------------------


def meta_model(config) -> nn.Module:
    """The causal LM of `config` on the meta device: shapes and names, no storage."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def build_empty(m: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model `m` describes in `dtype` on `device`, its weights allocated but not initialized (the
    caller fills them, or the first weight update does); rotary buffers computed for real."""
    config = hf_config(m)
    config.dtype = dtype
    model = meta_model(config)
    model.to_empty(device=device)
    model.to(dtype)
    # Non-persistent buffers (rotary inv_freq) were computed on meta: rebuild them for real
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if "RotaryEmbedding" in type(child).__name__:
                setattr(parent, child_name, type(child)(config=child.config).to(device))
    model.tie_weights()
    return model


# ----------------------------------------------------------------------------------------------
# The update's layout: one plan, read by both sides
# ----------------------------------------------------------------------------------------------


class UnsupportedLayout(ValueError):
    """Fused experts the checkpoint layout cannot split (an unknown pattern)."""


class Entry(NamedTuple):
    name: str  # as sent and received
    param: str  # the parameter it is (a view of)
    index: tuple  # () the whole parameter; (e,) or (e, slice) a contiguous view of it
    shape: tuple[int, ...]


def layout_plan(shapes: dict[str, tuple[int, ...]], layout: str) -> list[Entry]:
    """The update's tensors, in order, from the model's parameter (name -> shape), tied ones once."""
    if layout not in LAYOUTS:
        raise ValueError(f"update layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    plan = []
    for name, shape in shapes.items():
        shape = tuple(shape)
        if layout == "fused" or EXPERTS not in name:
            plan.append(Entry(name, name, (), shape))
            continue
        if name.endswith(FUSED_DOWN) and name[: -len(FUSED_DOWN)] + FUSED_GATE_UP in shapes:
            continue  # sent with its gate_up_proj, expert by expert
        if not name.endswith(FUSED_GATE_UP):
            if len(shape) <= 2 and name.endswith(".weight"):  # already one tensor per expert (or a router)
                plan.append(Entry(name, name, (), shape))
                continue
            raise UnsupportedLayout(f"{name} {shape} is no per-expert tensor rlsync can split")
        prefix = name[: -len(FUSED_GATE_UP)]
        down = shapes.get(prefix + FUSED_DOWN)
        if len(shape) != 3 or down is None or len(down) != 3:
            raise UnsupportedLayout(f"{name} {shape} has no 3-D {prefix + FUSED_DOWN} beside it")
        experts, two_i, hidden = shape
        moe_i = down[2]
        if tuple(down) != (experts, hidden, moe_i) or two_i != 2 * moe_i:
            raise UnsupportedLayout(
                f"{name} {shape} and {prefix + FUSED_DOWN} {tuple(down)} are not (E, 2I, H) and (E, H, I)"
            )
        down_name = prefix + FUSED_DOWN
        for e in range(experts):
            p = f"{prefix}{EXPERTS}{e}."
            plan += [
                Entry(p + "gate_proj.weight", name, (e, slice(0, moe_i)), (moe_i, hidden)),
                Entry(p + "up_proj.weight", name, (e, slice(moe_i, two_i)), (moe_i, hidden)),
                Entry(p + "down_proj.weight", down_name, (e,), (hidden, moe_i)),
            ]
    return plan


def params_layout(params: dict[str, torch.Tensor], layout: str) -> list[Entry]:
    """layout_plan of these parameters (by name, their shapes)."""
    return layout_plan({n: tuple(t.shape) for n, t in params.items()}, layout)


def update_tensors(
    params: dict[str, torch.Tensor], layout: str, plan: list[Entry] | None = None
) -> dict[str, torch.Tensor]:
    """The update's (name -> tensor) in `layout`, from the model's parameters by name (tied ones once):
    the parameters themselves, or contiguous views of them (no copy). Either side calls it: the
    trainer's are sent, the engine's are where they land. Rebuild after a parameter's `.data` moves
    (the offload), and hold no views across it: a view keeps the old storage alive. `plan`: the
    layout_plan of these parameters, made once by a caller that rebuilds every step."""
    if plan is None:
        plan = params_layout(params, layout)
    if all(not e.index for e in plan):
        return {e.name: params[e.param] for e in plan}
    with torch.no_grad():  # views of parameters that need no graph
        return {e.name: params[e.param][e.index] if e.index else params[e.param] for e in plan}


def has_fused_experts(m: ModelConfig) -> bool:
    """Whether the model holds experts fused (so the checkpoint layout sends views, not parameters)."""
    return any(e.index for e in layout_plan(dict(model_shapes(m)), "checkpoint"))


@lru_cache(maxsize=8)
def _model_shapes(key: tuple) -> tuple[tuple[str, tuple[int, ...]], ...]:
    m = ModelConfig(**{k: v for k, v in key if k != "__mtime__"})
    model = meta_model(hf_config(m))
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters())


def model_shapes(m: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter in named_parameters order, tied ones once: a meta build, cached."""
    key = tuple((k, v) for k, v in vars(m).items())
    if m.config:  # the file may change between calls of a long-lived process (tests write them)
        file = config_path(m.config)
        key += (("__mtime__", file.stat().st_mtime_ns if file.exists() else None),)
    return _model_shapes(key)


def update_shapes(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor the update sends, in `m.update_layout`, in order: no allocation."""
    return [(e.name, e.shape) for e in layout_plan(dict(model_shapes(m)), m.update_layout)]
