"""What `torchrun`, `accelerate launch` or a submitit job tells this process, read without importing torch.

torchrun and accelerate start N copies of `python -m rlsync ...` with RANK, WORLD_SIZE and LOCAL_RANK
set. Rank 0 is the run a user sees (its Hydra run dir, files, W&B, console); the other ranks get Hydra
overrides that keep them from writing anything. The collectives live in rlsync/trainer/data_parallel.py.

Hydra's submitit launcher (`-m hydra/launcher=slurm|local hydra.launcher.tasks_per_node=N`) instead
runs each sweep point as one job of N tasks (times `nodes`), every task the same Hydra job with the same
run directory, composed once on the submitting host: each task takes its rank and the rendezvous from
submitit's job environment and exports torchrun's variables (`adopt_submitit_ranks`), so the process
group is joined as under torchrun; ranks > 0 drop the log file Hydra's job logging opened for them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
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


RENDEZVOUS_PORTS = (20000, 32767)  # below Linux's ephemeral range (32768-60999): no client socket holds one


def rendezvous_port(job_id: str) -> int:
    """The rendezvous port of a submitit job, the same in every task: drawn from the job id, as submitit draws
    it, but below the ephemeral range. submitit's own (20000-60000) can be a port another connection on the
    node holds: a 2-job sweep here failed to listen (EADDRINUSE) while the other job's gloo sockets were open."""
    import random

    return random.Random(str(job_id)).randint(*RENDEZVOUS_PORTS)


def submitit_ranks() -> dict[str, str]:
    """torchrun's variables for this task of a submitit job of several tasks, from submitit's own
    `TorchDistributedEnvironment`: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, the rendezvous
    (MASTER_ADDR: the job's first node; MASTER_PORT: drawn from the job id, `rendezvous_port`, unless set)
    and OMP_NUM_THREADS as torchrun sets it.
    {} under torchrun or accelerate (RANK set), outside a submitit job, or in a job of one task."""
    env = os.environ
    if "RANK" in env or not env.get("SUBMITIT_EXECUTOR"):
        return {}
    from submitit.helpers import TorchDistributedEnvironment  # reads SUBMITIT_LOCAL_* or SLURM_*

    dist = TorchDistributedEnvironment()
    if dist.world_size <= 1:
        return {}
    # One node: every task is on this host, so loopback, whatever the host's name resolves to
    addr = "127.0.0.1" if dist.world_size == dist.local_world_size else dist.master_addr
    found = {
        "RANK": str(dist.rank),
        "WORLD_SIZE": str(dist.world_size),
        "LOCAL_RANK": str(dist.local_rank),
        "LOCAL_WORLD_SIZE": str(dist.local_world_size),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(env["MASTER_PORT"] if "MASTER_PORT" in env else rendezvous_port(dist._job_env.job_id)),
    }
    # One thread per rank unless set, as torchrun does with several ranks per node (accelerate's DDP would
    # otherwise reset torch's threads when it joins the group)
    if dist.local_world_size > 1 and "OMP_NUM_THREADS" not in env:
        found["OMP_NUM_THREADS"] = "1"
    return found


def adopt_submitit_ranks() -> None:
    """In a task of a submitit job of several tasks: export torchrun's variables (submitit_ranks), and in
    ranks > 0 close the log file Hydra's job logging opened in the run directory, which is rank 0's.
    CUDA_VISIBLE_DEVICES stays as the job has it: each rank takes cuda:LOCAL_RANK, as under torchrun."""
    found = submitit_ranks()
    os.environ.update(found)
    if int(found.get("RANK", 0)) > 0:
        root = logging.getLogger()
        for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
            root.removeHandler(handler)
            handler.close()


def launcher_ranks(hc) -> int:
    """The ranks of each job the Hydra launcher starts: tasks_per_node x nodes (1 for Hydra's own launchers)."""
    launcher = hc.launcher
    return int(launcher.get("tasks_per_node", 1) or 1) * int(launcher.get("nodes", 1) or 1)


def tasks_per_machine(hc) -> int:
    """The ranks of one machine in each job the Hydra launcher starts (its tasks_per_node; 1 for Hydra's own)."""
    return int(hc.launcher.get("tasks_per_node", 1) or 1)


@contextlib.contextmanager
def as_launched(world: int, local: int) -> Iterator[None]:
    """Within the block this process looks like rank 0 of `world` ranks, `local` per machine (the variables a
    submitit task exports), so a check made before the launch (the sweep's plan) sees the job's ranks."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    before = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local))
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_launcher(hc) -> None:
    """A launcher of several tasks per job acts only in a sweep: without -m Hydra runs one process and
    ignores it, so that is refused rather than run as a single process."""
    ranks = launcher_ranks(hc)
    if hc.mode != RunMode.MULTIRUN and ranks > 1:
        raise BadInput(
            f"hydra.launcher.tasks_per_node x nodes = {ranks} ranks take effect only through the launcher: "
            f"add -m (one data-parallel job per sweep point), or launch the ranks with torchrun"
        )


def rank_argv(argv: list[str]) -> list[str]:
    """The command line Hydra parses in this rank: ranks > 0 get overrides that keep their output away."""
    rank, world, _ = launched()
    if world > 1 and any(a in ("-m", "--multirun") for a in argv[1:]):
        raise BadInput(
            f"a sweep (-m) cannot run under a data-parallel launch ({world} ranks): launch one data-parallel "
            f"run per configuration, or sweep with -m hydra/launcher=local|slurm hydra.launcher.tasks_per_node={world}"
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
