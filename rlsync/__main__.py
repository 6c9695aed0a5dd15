"""`python -m rlsync [overrides]`: one run, or a sweep with `-m`. Hydra composes conf/ over the schema."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rlsync.config import register_configs, to_config

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    from rlsync.experiment import run_experiment

    hc = HydraConfig.get()
    cfg = to_config(dcfg)
    run_dir = Path(hc.runtime.output_dir)
    sweep_dir = Path(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else run_dir
    name = ",".join(hc.overrides.task) or "defaults"
    run_experiment(cfg, run_dir, name=name, group=cfg.wandb.group or sweep_dir.name)


if __name__ == "__main__":
    main()
