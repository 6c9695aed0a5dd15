"""`--help`: every key of the schema, read from it, so the help cannot go stale.

`${rlsync_keys:}` (rlsync/conf/hydra/help/rlsync.yaml; registered by rlsync.config.compose) lists the
composed app config's keys from its schema: a header per node, then `  key=value  comment` per key,
the comment being the key's doc (`key(default, rule, doc)`, rlsync/config/rules.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, get_type_hints

from omegaconf import DictConfig, OmegaConf

from rlsync.config.apps import SCHEMAS
from rlsync.config.schema import Config
from rlsync.errors import show

HELP_KEY_WIDTH = 40  # `--help`: the column the comments start in


def key_comment(schema: type, key: str) -> str:
    """The one-line doc of `key` (dotted: "update.bucket_mb") in `schema`: what `--help` shows beside it."""
    *path, name = key.split(".")
    for part in path:
        schema = get_type_hints(schema)[part]
    return next((f.metadata.get("doc", "") for f in fields(schema) if f.name == name), "")


def schema_lines(schema: type, values: Any, prefix: str = "") -> Iterator[str]:
    """`--help`'s listing of `schema`: a header per node, then `  key=value  comment` per key, with the
    value from `values` (the composed config) where it has the key, else the schema's default."""
    hints = get_type_hints(schema)
    for f in fields(schema):
        name, comment = prefix + f.name, key_comment(schema, f.name)
        if values is not None and f.name in values:
            value = values[f.name]
        else:
            value = f.default_factory() if f.default is MISSING else f.default
        if is_dataclass(hints[f.name]):
            yield from ("", f"{name}: {comment}")
            yield from schema_lines(hints[f.name], value, prefix=name + ".")
        else:
            value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            yield f"  {name}={show(value)}".ljust(HELP_KEY_WIDTH) + f"  {comment}".rstrip()


def help_keys(*, _root_: DictConfig) -> str:
    """`${rlsync_keys:}` (conf/hydra/help/rlsync.yaml): the composed app config's keys, listed from its schema."""
    keys = {k for k in _root_ if k != "hydra"}
    schema = next((s for s in SCHEMAS.values() if {f.name for f in fields(s)} == keys), Config)
    return (
        "\n".join(schema_lines(schema, _root_)).strip("\n").replace("$", "$$")
    )  # Hydra's template is a string.Template
