"""Every value rule of the config, checked before any model is built.

Hydra rejects unknown keys, wrong types and unknown group choices while composing (turned into
one line by `rlsync.errors.from_hydra`); this module checks what a type cannot say: ranges,
choices and rules across keys. `validate(cfg)` raises the first `ConfigError(key, value, allowed)`;
the runner and the benchmark both call it on their typed tree. Choices are imported from the
module that implements them, so a new transport or engine is allowed as soon as it exists.
"""

from __future__ import annotations

import math
import os
import typing
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from rlsync.config import BENCH_TARGETS, Config, to_config
from rlsync.errors import ConfigError
from rlsync.launcher import check_data_parallel


@dataclass(frozen=True)
class Rule:
    ok: Callable[[Any], bool]
    allowed: str  # what the error message offers instead


def number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def note(why: str) -> str:
    return f" ({why})" if why else ""


def at_least(low: float, why: str = "") -> Rule:
    return Rule(lambda v: number(v) and v >= low, f"a number >= {low:g}{note(why)}")


def above(low: float, why: str = "") -> Rule:
    return Rule(lambda v: number(v) and v > low, f"a number > {low:g}{note(why)}")


def between(low: float, high: float, why: str = "") -> Rule:
    return Rule(lambda v: number(v) and low <= v <= high, f"{low:g} to {high:g}{note(why)}")


def one_of(choices: typing.Iterable[str]) -> Rule:
    choices = tuple(choices)
    return Rule(lambda v: v in choices, ", ".join(choices))


ANY = Rule(lambda v: True, "any value of the key's type")
NAME = Rule(lambda v: isinstance(v, str) and bool(v.strip()), "a non-empty string")
OPTIONAL_NAME = Rule(lambda v: v is None or bool(v.strip()), "null or a non-empty string")


INT64_MAX = 2**63 - 1  # torch sizes and offsets are int64
SEED_MAX = 2**64 - 1  # torch.manual_seed takes an unsigned 64-bit seed
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"  # wandb.Settings.validate_project (wandb 0.2x/0.3x); also at most 128 chars
WANDB_PROJECT_MAX, WANDB_TAG_MAX = 128, 64  # characters; a tag must be 1 to 64 (wandb.Settings.validate_run_tags)


def mebibytes(why: str) -> Rule:
    """A size in MiB that is a whole number of bytes from 1 to INT64_MAX once multiplied out (int(v * MIB))."""
    from rlsync.config import MIB

    return Rule(lambda v: number(v) and 1 <= int(v * MIB) <= INT64_MAX,
                f"a number of MiB from {1 / MIB:.3g} (1 byte) to {INT64_MAX / MIB:.3g} (2^63 - 1 bytes){note(why)}")


def wandb_project_ok(v) -> bool:
    return isinstance(v, str) and bool(v.strip()) and len(v) <= WANDB_PROJECT_MAX \
        and not any(c in v for c in WANDB_PROJECT_FORBIDDEN)


def wandb_tags_ok(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, str) and 1 <= len(t) <= WANDB_TAG_MAX for t in v)


def address_ok(text: str) -> bool:
    from rlsync.sync.remote import parse_address

    try:
        parse_address(text)
    except ValueError:
        return False
    return True


def value_rules() -> dict[str, Rule]:
    """One rule per config key a user can set (dotted key -> rule)."""
    from rlsync.bench_offload import STATES as OFFLOAD_STATES
    from rlsync.limits import PROBES as LIMIT_PROBES
    from rlsync.models import DTYPES
    from rlsync.offload import OFFLOAD_MEMORY, OFFLOAD_MODES
    from rlsync.engines.base import engine_names
    from rlsync.sinks import WANDB_MODES
    from rlsync.sync.base import BACKENDS, SOURCES, STRATEGIES, transport_names

    dtypes = one_of(DTYPES)
    return {
        "model.name": NAME,
        "model.hidden_size": at_least(1),
        "model.intermediate_size": at_least(1),
        "model.num_hidden_layers": at_least(1),
        "model.num_attention_heads": at_least(1),
        "model.num_key_value_heads": at_least(1),
        "model.head_dim": at_least(1),
        "model.vocab_size": at_least(1),
        "model.tie_word_embeddings": ANY,
        "model.max_position_embeddings": at_least(1),
        "model.rope_theta": above(0),
        "model.rms_norm_eps": above(0),
        "model.pretrained": OPTIONAL_NAME,  # and it must exist: see check_pretrained
        "update.enabled": ANY,
        "update.bucket_mb": mebibytes("the bucket's size"),
        "update.strategy": one_of(STRATEGIES),
        "update.transport": one_of(transport_names()),  # the registry: rlsync/sync/base.py
        "update.source": one_of(SOURCES),
        "update.inflight_buckets": between(1, 2, "2 overlaps packing one bucket with loading the other"),
        "update.verify": ANY,
        "update.flat_engine_weights": ANY,
        "update.backend": one_of(BACKENDS),
        "update.engine_timeout_s": above(0, "seconds"),
        "update.engine_address": Rule(lambda v: v is None or address_ok(v), "null or HOST:PORT (port 1 to 65535; "
                                      "0 lets python -m rlsync.engine pick a free one)"),
        "update.engine_connect_timeout_s": above(0, "seconds"),
        "update.copy_threads": at_least(0, "0 keeps torch's default"),
        "rollout.engine": one_of(engine_names()),  # the registry: rlsync/engines/base.py
        "rollout.max_response_len": at_least(1, "tokens"),
        "rollout.prompts_per_step": at_least(1),
        "rollout.samples_per_prompt": at_least(2, "GRPO normalises rewards within a group: one sample has no spread"),
        "rollout.temperature": at_least(0, "0 is greedy"),
        "rollout.dtype": dtypes,
        "rollout.release_weights": ANY,
        "trainer.lr": at_least(0),
        "trainer.dtype": dtypes,
        "trainer.micro_batch_size": at_least(1),
        "trainer.clip_eps": above(0),
        "trainer.kl_coef": at_least(0),
        "trainer.offload": one_of(OFFLOAD_MODES),
        "trainer.offload_memory": one_of(OFFLOAD_MEMORY),
        "trainer.offload_segment_mb": mebibytes("the largest segment"),
        "trainer.offload_pin_chunk_mb": mebibytes("the largest pinned chunk"),
        "trainer.offload_free_device": ANY,
        "trainer.grad_clip": above(0),
        "run.steps": at_least(1),
        "run.warmup_steps": at_least(0),  # and below run.steps: see check_across
        "run.seed": Rule(lambda v: number(v) and 0 <= v <= SEED_MAX,
                         f"0 to 2^64 - 1 = {SEED_MAX} (torch seeds are unsigned 64-bit)"),
        "run.device": Rule(lambda v: v in ("auto", "cpu") or v == "cuda" or v.startswith("cuda:"),
                           "auto, cpu, cuda, cuda:N"),  # and present: see check_device
        "run.verdict_threshold": Rule(lambda v: number(v) and 0 < v < 1, "a share of the step between 0 and 1"),
        "run.progress": ANY,
        "run.rank_timeout_s": above(0, "seconds"),
        "run.limit_probe": one_of(LIMIT_PROBES),
        "run.memory_check": ANY,
        "wandb.mode": one_of(WANDB_MODES),
        "wandb.project": Rule(wandb_project_ok, f"a non-empty name of at most {WANDB_PROJECT_MAX} characters, "
                              f"without any of {' '.join(WANDB_PROJECT_FORBIDDEN)} (W&B refuses them)"),
        "wandb.entity": OPTIONAL_NAME,
        "wandb.group": OPTIONAL_NAME,
        "wandb.tags": Rule(wandb_tags_ok, f"a list of tags of 1 to {WANDB_TAG_MAX} characters each (W&B's limit)"),
        "wandb.init_timeout": above(0, "seconds"),
        "bench.target": one_of(BENCH_TARGETS),
        "bench.warmup": at_least(0),
        "bench.repeats": at_least(1),
        "bench.offload_state": one_of(OFFLOAD_STATES),
        "serve.sessions": at_least(0, "0 serves until stopped"),
        "serve.request_timeout_s": above(0, "seconds"),
        "serve.max_request_mb": between(0.01, 1024, "MiB"),
    }


def checked_config(dcfg, schema: type = Config):
    """The typed tree of a Hydra-composed config once every rule holds: what an entry point runs."""
    check_known_keys(dcfg, schema)
    cfg = to_config(dcfg, schema)
    validate(cfg)
    return cfg


def check_known_keys(node, schema: type, prefix: str = "") -> None:
    """Keys added with `+key=value` that the schema lacks (merging into the schema would drop them silently)."""
    hints = typing.get_type_hints(schema)
    for key in node.keys():
        if not prefix and key == "hydra":
            continue
        if key not in hints:
            raise ConfigError(prefix + str(key), OmegaConf.to_container(node, resolve=False).get(key),
                              ", ".join(f.name for f in fields(schema)), "unknown key")
        if is_dataclass(hints[key]) and isinstance(node.get(key), DictConfig):
            check_known_keys(node.get(key), hints[key], f"{prefix}{key}.")


def validate(cfg) -> None:
    """Raise the first ConfigError in `cfg` (a Config, or a tree that extends it); return None if it can run."""
    rules = value_rules()
    for key, value, hint in leaves(cfg):
        if not type_ok(value, hint):
            raise ConfigError(key, value, type_phrase(hint), "wrong type")
        rule = rules.get(key)
        if rule is not None and not rule.ok(value):
            allowed = rule.allowed.replace("a number", "an integer") if hint is int else rule.allowed
            raise ConfigError(key, value, allowed, "out of range" if number(value) else "not allowed")
    check_across(cfg)
    check_pretrained(cfg.model)
    check_device(cfg.run.device)
    check_data_parallel(cfg)


def check_across(cfg) -> None:
    """Rules that tie two keys together."""
    run, model, rollout = cfg.run, cfg.model, cfg.rollout
    if run.warmup_steps >= run.steps:
        raise ConfigError("run.warmup_steps", run.warmup_steps,
                          f"0 to run.steps - 1 = {run.steps - 1}, so that a step is measured", "leaves no step to measure")
    if model.num_attention_heads % model.num_key_value_heads:
        raise ConfigError("model.num_key_value_heads", model.num_key_value_heads,
                          f"a divisor of model.num_attention_heads={model.num_attention_heads}", "not allowed")
    if not model.pretrained:
        from rlsync.models import ByteTokenizer

        if model.vocab_size < ByteTokenizer.size:
            raise ConfigError("model.vocab_size", model.vocab_size,
                              f">= {ByteTokenizer.size} (the byte tokenizer's ids) unless model.pretrained is set",
                              "out of range")
    if rollout.max_response_len >= model.max_position_embeddings:
        raise ConfigError("rollout.max_response_len", rollout.max_response_len,
                          f"< model.max_position_embeddings={model.max_position_embeddings}", "out of range")
    if cfg.update.source == "host" and cfg.trainer.offload == "none":
        raise ConfigError("update.source", "host", "device (source=host sends from the offloaded copy, "
                          "which trainer.offload=none never makes)", "not allowed with trainer.offload=none")
    if cfg.update.transport == "ipc" and cfg.update.flat_engine_weights and rollout.release_weights:
        raise ConfigError("update.flat_engine_weights", True, "false with rollout.release_weights=true (with ipc the "
                          "engine's weights are then shared memory, which the engine cannot free)",
                          "not allowed with rollout.release_weights=true")
    if cfg.update.engine_address and cfg.update.transport != "broadcast":
        raise ConfigError("update.transport", cfg.update.transport, "broadcast (an engine started on its own, at "
                          "update.engine_address, is joined through the broadcast transport)",
                          "not allowed with update.engine_address")
    if rollout.release_weights and not cfg.update.enabled:
        raise ConfigError("rollout.release_weights", True, "false (released weights are refilled only by the weight "
                          "update, which update.enabled=false skips)", "not allowed with update.enabled=false")
    check_vllm(cfg)


def check_vllm(cfg) -> None:
    """What vLLM's engine cannot do: expose its weights by trainer name (it fuses and re-packs them)."""
    update = cfg.update
    if cfg.rollout.engine != "vllm":
        if update.strategy == "vllm_ipc":
            raise ConfigError("update.strategy", update.strategy, "bucketed, per_tensor (vllm_ipc is vLLM's own "
                              "transfer: set rollout.engine=vllm)",
                              f"not allowed with rollout.engine={cfg.rollout.engine}")
        return
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine", "vllm", "hf, or install the extra first: pip install -e '.[vllm]' "
                          "(see pyproject.toml)", "vllm is not installed")
    for key, value in (("update.verify", update.verify), ("update.flat_engine_weights", update.flat_engine_weights)):
        if value:
            raise ConfigError(key, value, "false (vLLM fuses q/k/v and gate/up and re-packs its weights: they cannot "
                              "be checked or bound by trainer name; train/logprob_abs_diff checks the update)",
                              "not supported with rollout.engine=vllm")
    if update.transport == "broadcast":
        raise ConfigError("update.transport", update.transport, "direct, ipc (vLLM takes the engine process's default "
                          "torch.distributed group, which broadcast needs for its own)", "not supported with rollout.engine=vllm")
    if update.strategy == "vllm_ipc":  # the installed vLLM's weight-transfer API, in the form rlsync calls it
        from rlsync.engines.vllm import check_vllm_ipc_api

        check_vllm_ipc_api()
    if update.strategy == "vllm_ipc" and (cfg.run.device == "cpu" or not cuda_present()):
        raise ConfigError("update.strategy", update.strategy, "bucketed, per_tensor (vLLM's own transfer needs CUDA; "
                          "not available on this machine)", "not available")
    if update.strategy == "vllm_ipc" and update.transport != "direct":
        raise ConfigError("update.transport", update.transport, "direct (vllm_ipc runs vLLM's engine core in its own "
                          "process already)", "not allowed with update.strategy=vllm_ipc")


def cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def check_pretrained(model) -> None:
    """A local checkpoint directory must exist and describe the model.* architecture; an `org/name`
    that is no local path is a hub id (its config.json is checked as it arrives, in build_model)."""
    path = model.pretrained
    if not path:
        return
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError("model.pretrained", path, "a checkpoint directory with config.json, or a hub id",
                              "no config.json in that directory")
        check_checkpoint_architecture(model, local / "config.json")
        return
    if looks_like_hub_id(path) and os.environ.get("HF_HUB_OFFLINE", "") in ("", "0"):
        return
    raise ConfigError("model.pretrained", path, "an existing checkpoint directory, or a hub id such as Qwen/Qwen3-0.6B",
                      "no such directory")


def check_checkpoint_architecture(model, config_json: Path) -> None:
    """The engine is built from the model.* keys, the trainer from the checkpoint: they must agree."""
    import json

    from rlsync.models import check_architecture

    try:
        ckpt = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError("model.pretrained", model.pretrained, "a checkpoint directory whose config.json is JSON",
                          f"cannot read {config_json} ({type(err).__name__}: {err})") from None
    if not isinstance(ckpt, dict):
        raise ConfigError("model.pretrained", model.pretrained, "a checkpoint directory whose config.json is a "
                          "JSON object", f"{config_json} holds a {type(ckpt).__name__}")
    check_architecture(model, ckpt)


def looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~")) and not Path(path).exists()


def check_device(name: str) -> None:
    if name in ("auto", "cpu"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError("run.device", name, "auto, cpu (this machine has no CUDA device)", "not available")
    index = name.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= count):
        allowed = ", ".join(["auto", "cpu", "cuda"] + [f"cuda:{i}" for i in range(count)])
        raise ConfigError("run.device", name, allowed, "not available")


# ----------------------------------------------------------------------------------------------
# Types: the schema's annotations, checked for trees that did not come through Hydra
# ----------------------------------------------------------------------------------------------


def leaves(node, prefix: str = ""):
    """(dotted key, value, type hint) for every leaf of a dataclass tree."""
    hints = typing.get_type_hints(type(node))
    for f in fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            yield from leaves(value, key + ".")
        else:
            yield key, value, hints[f.name]


def type_ok(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return any(type_ok(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(type_ok(v, args[0]) for v in value) if args else isinstance(value, list)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def type_phrase(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return " or ".join(type_phrase(a) for a in args)
    if origin is list:
        return "a list such as [a,b]"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            type(None): "null"}.get(hint, str(hint))
