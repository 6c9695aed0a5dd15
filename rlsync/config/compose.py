"""Between Hydra and the schema: what Hydra composes over, and the typed tree of what it composed.

Hydra composes YAML from rlsync/conf/ (the top-level conf/ links there) on top of the schemas
`register_configs` puts in its ConfigStore (rlsync/config/schema.py SCHEMAS), with the resolvers the
YAML calls: `${rlsync_keys:}` (--help's listing, rlsync/config/help.py) and `${rlsync_conf:PATH}`.
`to_config` turns the composed DictConfig into plain dataclasses once, at the entry point; the rest of
the code only reads attributes of that tree (no `cfg.update` surprises: on a DictConfig that is the
`update` method, not the node).
"""

from __future__ import annotations

from hydra._internal.hydra import Hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from rlsync.config.apps import SCHEMAS
from rlsync.config.help import help_keys
from rlsync.config.schema import Config
from rlsync.errors import CONF_DIR

# Hydra deep-copies its repository, and with it the ConfigStore singleton holding every schema, once per composition
# and once per config group --help lists (hydra/_internal/config_repository.py, CachingConfigRepository): ~3 s of a
# `--help`, ~0.1 s of each composition. Nothing writes through that copy (ConfigStore.load copies the node it hands
# out), so the copy may be the store itself.
ConfigStore.__deepcopy__ = lambda self, memo: self

CONFIG_PATH = "pkg://rlsync.conf"  # every entry point's @hydra.main: the YAML configs inside the package (rlsync/conf)

# The config sources of an entry point's Hydra: Hydra's own configs, rlsync/conf, the ConfigStore's schemas
OWN_SOURCES = ("pkg://hydra.conf", CONFIG_PATH, "structured://")
MODE_KEYS = ("hydra.mode", "hydra.searchpath")  # the overrides that can set hydra.mode, or bring configs that do
compose_for_mode = Hydra.get_mode


def run_mode(self: Hydra, config_name, overrides: list[str]):
    """Hydra's `get_mode` (the hydra.mode its composition holds; None where unset or where composition fails)
    without composing the whole config, which Hydra then composes again for the run (~0.1 s of every command):
    no config under rlsync/conf sets hydra.mode (tests/unit/test_config.py checks), so it is None unless an
    override sets it or names other configs, or another config directory is searched: then Hydra composes."""
    keys = (o.lstrip("+~").split("=", 1)[0] for o in overrides)
    foreign = any(e.path not in OWN_SOURCES for e in self.config_loader.get_search_path().get_path())
    if foreign or any(k.startswith(MODE_KEYS) for k in keys):
        return compose_for_mode(self, config_name, overrides)
    return None


Hydra.get_mode = run_mode


def register_configs() -> None:
    for name, schema in SCHEMAS.items():
        ConfigStore.instance().store(name=name, node=schema)
    OmegaConf.register_new_resolver("rlsync_keys", help_keys, replace=True)
    OmegaConf.register_new_resolver("rlsync_conf", conf_file, replace=True)


def conf_file(path: str) -> str:
    """`${rlsync_conf:model/hf/x.json}` (the MoE presets): a file shipped in the package's configs."""
    return str(CONF_DIR / path)


def to_config(dcfg: DictConfig, schema: type = Config):
    """Resolve the composed config and turn it into the typed dataclass tree (`schema`'s)."""
    plain = OmegaConf.masked_copy(dcfg, [k for k in dcfg if k != "hydra"]) if "hydra" in dcfg else dcfg
    typed = OmegaConf.merge(OmegaConf.structured(schema), plain)
    return OmegaConf.to_object(typed)


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
