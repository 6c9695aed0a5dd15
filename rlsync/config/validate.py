"""Every config rule, applied once, before any model is built: a walk over the schema.

Hydra rejects unknown keys, wrong types and unknown group choices while composing (turned into one
line by `rlsync.errors.from_hydra`). The rules live with the schema, in rlsync/config/schema.py: each key's
value rule beside the key (`key(default, rule)`), each rule across keys in the `check(root)` method
of the node it is about. `validate(cfg)` applies them in that order: each leaf's type (for trees
built in code: Hydra's merge has enforced it already) and value rule, then the rules across keys,
then what this machine must offer (the checkpoint, the device, what the engine needs). An engine's
own rules are asked of its class (`Engine.check_config`, `Engine.check_machine`). It raises the first
`ConfigError(key, value, allowed)` (exit 2); every entry point calls `checked_config` on its tree.
"""

from __future__ import annotations

import os
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlsync.config.compose import to_config
from rlsync.config.files import CONFIG_JSON_MAX, UnreadableFile, read_json
from rlsync.config.launch import launched
from rlsync.config.rules import resolve
from rlsync.config.schema import Config
from rlsync.errors import CONF_DIR, ConfigError, renamed_key
from rlsync.fmt import is_number

OPEN_FILES_MIN, OPEN_FILES_WANTED = 256, 4096  # an engine process's file descriptors: refused below, raised to
REQUIRED_GROUPS = ("model", "rollout", "scheme")  # config groups a run cannot do without (null is refused)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
)  # one of them: AutoTokenizer loads it
# What a data-parallel run is built and tested with, by key: the names, or a function returning them (the
# transports whose class declares `data_parallel`)
DATA_PARALLEL_SUPPORTED = {
    "update.transport": lambda: resolve("rlsync.update.base:transports_with")(data_parallel=True),
    "rollout.engine": ("hf",),
}


def checked_config(dcfg, schema: type = Config):
    """The typed tree of a Hydra-composed config once every rule holds: what an entry point runs."""
    check_group_choices()
    check_known_keys(dcfg, schema)
    cfg = to_config(dcfg, schema)
    validate(cfg, types=False)  # OmegaConf's structured merge has enforced every leaf's type
    return cfg


def check_group_choices() -> None:
    """`model=null` or `~model` (or rollout, scheme): a group every run needs, left without a choice or deleted
    (Hydra then composes the schema's defaults alone: the default model would run under no one's choice)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    choices = hydra_cfg.runtime.choices
    deleted = {o[1:].partition("=")[0] for o in hydra_cfg.overrides.task if o.startswith("~")}
    for group in REQUIRED_GROUPS:
        options = ", ".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))
        if group in choices and choices[group] is None:
            raise ConfigError(group, None, options, "no choice (the run needs one)")
        if group in deleted:
            raise ConfigError(group, None, options, f"deleted by ~{group} (the run needs one)")


def check_known_keys(node, schema: type, prefix: str = "") -> None:
    """Keys added with `+key=value` that the schema lacks (merging into the schema would drop them silently)."""
    hints = typing.get_type_hints(schema)
    for key in node:
        if not prefix and key == "hydra":
            continue
        if key not in hints:
            value = OmegaConf.to_container(node, resolve=False).get(key)
            raise renamed_key(schema, prefix + str(key), value) or ConfigError(
                prefix + str(key),
                value,
                ", ".join(f.name for f in fields(schema)),
                "unknown key",
            )
        if is_dataclass(hints[key]) and isinstance(node.get(key), DictConfig):
            check_known_keys(node.get(key), hints[key], f"{prefix}{key}.")


def validate(cfg, *, types: bool = True) -> None:
    """Raise the first ConfigError in `cfg` (a Config, or a tree that extends it); return None if it can run.
    `types=False` skips the type check, for a tree OmegaConf has typed."""
    # value rules first, then the choices (these import their providers: torch): a bad value is answered fast
    for key, value, hint, rule in sorted(leaves(cfg), key=lambda leaf: hasattr(leaf[3], "provider")):
        if types and not type_ok(value, hint):
            raise ConfigError(key, value, hint_phrase(hint), "wrong type")
        if not rule.ok(value):
            allowed = rule.allowed.replace("a number", "an integer") if hint is int else rule.allowed
            raise ConfigError(key, value, allowed, "out of range" if is_number(value) else "not allowed")
    engine = resolve("rlsync.engines.base:engine_class")(cfg.rollout.engine)
    engine.check_config(cfg)  # the engine's own rules across keys (Engine.check_config)
    resolve("rlsync.update.payload.base:payload_of")(cfg.update).check_config(
        cfg
    )  # the payload's (Payload.check_config)
    resolve("rlsync.update.base:transport_class")(cfg.update.transport).check_config(cfg)  # the transport's
    for node in nodes(cfg):
        check = getattr(node, "check", None)  # the rules across keys of this node (rlsync/config/schema.py)
        if check is not None:
            check(cfg)
    check_pretrained(cfg.model)
    check_device(cfg.run.device)
    check_open_files(cfg.update)
    engine.check_machine(cfg)  # what the engine needs of this machine (installed, its API, the device)
    check_data_parallel(cfg)


def check_pretrained(model) -> None:
    """A local checkpoint directory must exist and describe the model.* architecture; an `org/name`
    that is no local path is a hub id (its config.json is checked as it arrives, in build_model)."""
    path = model.pretrained
    if not path:
        return
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(
                "model.pretrained",
                path,
                "a checkpoint directory with config.json, or a hub id",
                "no config.json in that directory",
            )
        check_checkpoint_architecture(model, local / "config.json")
        if not any((local / name).is_file() for name in TOKENIZER_FILES):
            raise ConfigError(
                "model.pretrained",
                path,
                f"a checkpoint directory with its tokenizer ({', '.join(TOKENIZER_FILES)}): rlsync samples with it",
                "no tokenizer files in that directory",
            )
        return
    if looks_like_hub_id(path) and os.environ.get("HF_HUB_OFFLINE", "") in ("", "0"):
        return
    raise ConfigError(
        "model.pretrained",
        path,
        "an existing checkpoint directory, or a hub id such as Qwen/Qwen3-0.6B",
        "no such directory",
    )


def check_checkpoint_architecture(model, config_json: Path) -> None:
    """The engine is built from the model.* keys, the trainer from the checkpoint: they must agree."""
    check_architecture = resolve("rlsync.model.build:check_architecture")  # torch: only when a checkpoint is named

    try:
        ckpt = read_json(config_json, max_bytes=CONFIG_JSON_MAX)  # a regular file only: a FIFO would block
    except (OSError, UnreadableFile) as err:
        raise ConfigError(
            "model.pretrained",
            model.pretrained,
            "a checkpoint directory whose config.json is a regular JSON file",
            f"cannot read {config_json} ({err})",
        ) from None
    if not isinstance(ckpt, dict):
        raise ConfigError(
            "model.pretrained",
            model.pretrained,
            "a checkpoint directory whose config.json is a JSON object",
            f"{config_json} holds a {type(ckpt).__name__}",
        )
    check_architecture(model, ckpt)


def looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~")) and not Path(path).exists()


def check_open_files(update) -> None:
    """An engine in its own process (ipc, broadcast) takes file descriptors: the pipe, and one per shared
    buffer. The soft open-file limit is raised to the hard one where it is low; a hard limit too low for
    it is refused here, not met as an engine that exits without a word mid-run."""
    if resolve("rlsync.update.base:transport_class")(update.transport).engine_in_process:
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= OPEN_FILES_WANTED:
        return
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    if wanted > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        soft = wanted
    if soft < OPEN_FILES_MIN:
        raise ConfigError(
            "update.transport",
            update.transport,
            f"direct, or an open-file limit of at least {OPEN_FILES_MIN} (ulimit -n 4096): the engine's "
            f"process receives its buffers as file descriptors",
            f"needs more open files than this shell allows (ulimit -n {soft}, hard limit {hard})",
        )


def check_device(name: str) -> None:
    if name in ("auto", "cpu"):
        return
    import torch  # here, not at the top: importing this module (python -m rlsync --help) stays light

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError("run.device", name, "auto, cpu (this machine has no CUDA device)", "not available")
    index = name.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= count):
        allowed = ", ".join(["auto", "cpu", "cuda"] + [f"cuda:{i}" for i in range(count)])
        raise ConfigError("run.device", name, allowed, "not available")


# ----------------------------------------------------------------------------------------------
# The tree, and the types of its leaves (checked for trees that did not come through Hydra)
# ----------------------------------------------------------------------------------------------


def leaves(node, prefix: str = ""):
    """(dotted key, value, type hint, value rule) for every leaf of a dataclass tree."""
    hints = typing.get_type_hints(type(node))
    for f in fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            yield from leaves(value, key + ".")
        else:
            yield key, value, hints[f.name], f.metadata.get("rule")


def nodes(node):
    """The tree's nodes, the root first, in schema order."""
    yield node
    for f in fields(node):
        if is_dataclass(getattr(node, f.name)):
            yield from nodes(getattr(node, f.name))


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


def hint_phrase(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return " or ".join(hint_phrase(a) for a in args)
    if origin is list:
        return "a list such as [a,b]"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}.get(
        hint, str(hint)
    )


def check_data_parallel(cfg) -> None:
    """What a data-parallel launch needs from the config; nothing to check in a single process."""
    _, world, _ = launched()
    if world <= 1:
        return
    if cfg.rollout.prompts_per_step < world:
        raise ConfigError(
            "rollout.prompts_per_step",
            cfg.rollout.prompts_per_step,
            f">= the {world} data-parallel ranks (each rank trains whole prompt groups)",
            "out of range",
        )
    for key, needed in DATA_PARALLEL_SUPPORTED.items():
        needed = needed() if callable(needed) else needed
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in needed:
            raise ConfigError(
                key,
                value,
                f"{', '.join(needed)} (what a data-parallel run is built and tested with)",
                f"not supported with {world} data-parallel ranks",
            )
