"""Data parallel through Hydra's submitit launcher: `-m hydra/launcher=local|slurm hydra.launcher.tasks_per_node=N`.

Each sweep point is one submitit job of N tasks; each task takes its rank and the rendezvous from
submitit's job environment as torchrun's variables (rlsync.config.launch.submitit_ranks). The translation,
on fake job environments (submitit's local executor, SLURM on two nodes, a SLURM array), the refusal of a
launcher's ranks without -m, and the sbatch script the documented SLURM command submits run in this
process; a two-rank sweep through submitit's local executor, and a combination it refuses, start real
processes: tests/process/test_submitit_ranks.py.
"""

import logging
import os
import random
from pathlib import Path

import pytest
from conftest import ROOT, run_main

from rlsync.config.launch import adopt_submitit_ranks, submitit_ranks

# What a job environment sets: each case clears all of these first
JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def job_env(monkeypatch, **env: str) -> None:
    """This process's environment as a submitit task's: only `env` of the job variables. Each job variable
    is set through monkeypatch first, so the ones adopt_submitit_ranks exports are undone after the test."""
    for key in {*JOB_VARS, *(k for k in os.environ if k.startswith(("SUBMITIT_", "SLURM_")))}:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def local_task(rank: int, tasks: int = 2, job_id: str = "4321") -> dict[str, str]:
    """What submitit's local executor sets in task `rank` of a job of `tasks` (submitit/local/local.py)."""
    return {
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_NTASKS": str(tasks),
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_LOCAL_NODEID": "0",
        "SUBMITIT_LOCAL_GLOBALID": str(rank),
        "SUBMITIT_LOCAL_LOCALID": str(rank),
        "SUBMITIT_LOCAL_JOB_ID": job_id,
    }


def slurm_task(rank: int, nodes: int = 2, per_node: int = 8, **extra: str) -> dict[str, str]:
    """What srun sets in task `rank` of a batch job of `nodes` x `per_node` tasks."""
    return {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "777",
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NODEID": str(rank // per_node),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % per_node),
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        **extra,
    }


def submitit_port(job_id: str) -> str:
    """The port a job's tasks draw from its id: below the ephemeral range, where no client socket holds one."""
    port = random.Random(job_id).randint(20000, 32767)
    assert port < int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return str(port)


def test_a_local_task_gets_torchruns_variables_on_loopback(monkeypatch):
    job_env(monkeypatch, **local_task(1))
    assert submitit_ranks() == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",  # one node: whatever this host's name resolves to
        "MASTER_PORT": submitit_port("4321"),  # every task of the job draws the same
        "OMP_NUM_THREADS": "1",  # as torchrun sets it with several ranks per node
    }
    job_env(monkeypatch, **local_task(0))
    assert submitit_ranks()["RANK"] == "0" and submitit_ranks()["MASTER_PORT"] == submitit_port("4321")


def test_a_slurm_task_of_two_nodes_meets_the_others_on_the_first_node(monkeypatch):
    job_env(monkeypatch, **slurm_task(9), OMP_NUM_THREADS="4")
    found = submitit_ranks()
    assert found == {
        "RANK": "9",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "gpu07",  # the first host of the job's node list
        "MASTER_PORT": submitit_port("777"),
    }  # OMP_NUM_THREADS set by the user: kept
    # the points of a sweep are tasks of one SLURM array: each job draws its own port
    job_env(monkeypatch, **slurm_task(0, SLURM_ARRAY_JOB_ID="500", SLURM_ARRAY_TASK_ID="0"))
    first = submitit_ranks()["MASTER_PORT"]
    job_env(monkeypatch, **slurm_task(0, SLURM_ARRAY_JOB_ID="500", SLURM_ARRAY_TASK_ID="1"))
    assert first == submitit_port("500_0") != submitit_ranks()["MASTER_PORT"] == submitit_port("500_1")
    job_env(monkeypatch, **slurm_task(0), MASTER_PORT="29400")  # a port the user chose
    assert submitit_ranks()["MASTER_PORT"] == "29400"


@pytest.mark.parametrize(
    "env",
    [
        {},  # not a submitit job
        local_task(0, tasks=1),  # a sweep point of one process, as hydra/launcher=local runs by default
        {**local_task(1), "RANK": "1", "WORLD_SIZE": "2"},  # torchrun inside a submitit job: torchrun's ranks
    ],
    ids=["no-job", "one-task", "torchrun"],
)
def test_nothing_is_exported_outside_a_job_of_several_tasks(monkeypatch, env):
    job_env(monkeypatch, **env)
    assert submitit_ranks() == {}


def test_rank_1_closes_the_log_file_hydra_opened_in_rank_0s_run_dir(monkeypatch, tmp_path):
    root = logging.getLogger()
    console = logging.StreamHandler()
    for rank, kept in ((0, True), (1, False)):
        job_env(monkeypatch, **local_task(rank))
        log_file = logging.FileHandler(tmp_path / "rlsync.log", delay=True)  # as Hydra's job logging configures it
        monkeypatch.setattr(root, "handlers", [console, log_file])
        adopt_submitit_ranks()
        assert os.environ["RANK"] == str(rank) and os.environ["WORLD_SIZE"] == "2"
        assert (log_file in root.handlers) is kept and console in root.handlers
    assert not (tmp_path / "rlsync.log").exists()


def test_a_launchers_ranks_without_a_sweep_are_refused(tmp_path):
    """Without -m Hydra runs one process and never calls the launcher: refused, not run as one rank."""
    cwd, run_dir = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    args = ["hydra/launcher=local", "hydra.launcher.tasks_per_node=2", f"hydra.run.dir={run_dir}"]
    proc = run_main(*args, "wandb.mode=disabled", cwd=cwd)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "rlsync: hydra.launcher.tasks_per_node x nodes = 2 ranks take effect only through the launcher: "
        "add -m (one data-parallel job per sweep point), or launch the ranks with torchrun"
    )
    assert list(cwd.iterdir()) == [] and list(run_dir.iterdir()) == []  # Hydra made the directory; nothing in it


def test_the_documented_slurm_command_asks_for_two_nodes_of_eight_ranks(registered_schemas, monkeypatch, tmp_path):
    """The sbatch script submitit writes for `hydra/launcher=slurm hydra.launcher.nodes=2
    hydra.launcher.tasks_per_node=8`: 8 tasks and 8 GPUs (one per rank) on each of 2 nodes, started by srun."""
    import submitit
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    overrides = ["hydra/launcher=slurm", "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=8"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    cfg.hydra.sweep.dir = str(tmp_path)
    launcher = instantiate(cfg.hydra.launcher)
    # the executor's parameters as the plugin's launch() passes them (hydra_submitit_launcher/submitit_launcher.py)
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    params = {k if k in shared else f"slurm_{k}": v for k, v in launcher.params.items() if k != "submitit_folder"}
    params.pop("slurm_max_num_timeout")
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # no srun on this machine
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    executor.update_parameters(**params)
    script = executor._executor._make_submission_file_text("python -u -m submitit.core._submit", "uid")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8"):
        assert line in script.splitlines(), script
    assert "srun" in script


def test_a_check_before_the_launch_sees_the_jobs_ranks(monkeypatch):
    """The sweep's plan checks each job as the launcher will run it: rank 0 of tasks_per_node x nodes ranks."""
    from rlsync.check.estimate import Ranks
    from rlsync.config.launch import as_launched, launched

    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with as_launched(16, 8):
        assert launched()[:2] == (0, 16) and Ranks.launched() == Ranks(16, 8)
    assert launched() == (0, 1, 0) and Ranks.launched() == Ranks()
