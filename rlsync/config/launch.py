"""What `torchrun` or `accelerate launch` tells this process, read without importing torch.

Both launchers start N copies of `python -m rlsync ...` with RANK, WORLD_SIZE and LOCAL_RANK set.
Rank 0 is the run a user sees (its Hydra run dir, files, W&B, console); the other ranks get Hydra
overrides that keep them from writing anything. The collectives live in rlsync/trainer/data_parallel.py.
"""

from __future__ import annotations

import os
from pathlib import Path

from hydra.types import RunMode
from omegaconf import OmegaConf

from rlsync.errors import BadInput, ConfigError

# Hydra overrides of ranks > 0: no .hydra/ dir, no log file, no dated run dir of their own
QUIET_HYDRA = [
    "hydra.output_subdir=null",
    "hydra/job_logging=disabled",
    "hydra/hydra_logging=disabled",
    "hydra.run.dir=.",
]


def launched() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun and accelerate launch set them; (0, 1, 0) otherwise."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def rank_argv(argv: list[str]) -> list[str]:
    """The command line Hydra parses in this rank: ranks > 0 get overrides that keep their output away."""
    rank, world, _ = launched()
    if world > 1 and any(a in ("-m", "--multirun") for a in argv[1:]):
        raise BadInput(
            f"a sweep (-m) cannot run under a data-parallel launch ({world} ranks): "
            f"launch one data-parallel run per configuration"
        )
    return argv + QUIET_HYDRA if rank > 0 else argv


def hydra_job(hc):
    """(run dir, sweep dir, run name) of the Hydra job `hc` (HydraConfig.get()): the sweep dir is the
    run dir outside a multirun; the name is the job's overrides, as W&B and the report show it.
    An empty hydra.run.dir (or hydra.sweep.dir) is refused: the run would write into the current directory."""
    multirun = hc.mode == RunMode.MULTIRUN
    given = hc.sweep.dir if multirun else hc.run.dir
    if given is None or not str(given).strip():
        key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
        raise ConfigError(key, given, "a directory for the run's files (default: outputs/...)", "not allowed")
    run_dir = Path(hc.runtime.output_dir)
    sweep_dir = Path(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else run_dir
    return run_dir, sweep_dir, ",".join(hc.overrides.task) or "defaults"


def hydra_record(dcfg) -> dict[str, str]:
    """The files Hydra keeps in a run's `.hydra/` (config.yaml, hydra.yaml, overrides.yaml), as text: the
    configs set hydra.output_subdir=null and the run writes them once it holds its directory
    (rlsync.record.recorder), so a run refused there rewrites nothing of the run that holds it."""
    from hydra.core.hydra_config import HydraConfig  # the job's Hydra node, {"hydra": ...}

    hydra_cfg = HydraConfig.instance().cfg
    return {
        "config.yaml": OmegaConf.to_yaml(dcfg),
        "hydra.yaml": OmegaConf.to_yaml(hydra_cfg),
        "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task),
    }
