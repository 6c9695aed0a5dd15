"""`python -m rlsync [overrides]`: one run, or a sweep with `-m`. Hydra composes conf/ over the schema.

Every error ends as one line on stderr (rlsync.errors): a bad value exits 2 before any model is
built, a failed run 1, an interrupted run 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP: the terminal
closed). In a sweep a failed job fails alone: the others run, and the sweep exits non-zero at the end.
"""

from __future__ import annotations

if __name__ == "__main__":  # python -m rlsync: the stop signals from the first line; one that arrives during
    from rlsync.errors import EARLY  # the imports below is acted on as cli starts (one line, 128 + the signal)

    EARLY.install()

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rlsync.config.compose import CONFIG_PATH, register_configs
from rlsync.config.launch import adopt_submitit_ranks, check_launcher, hydra_job, hydra_record, launched, rank_argv
from rlsync.config.validate import checked_config
from rlsync.shell import cli, job_errors

register_configs()


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def hydra_main(dcfg: DictConfig) -> None:
    hc = HydraConfig.get()
    with job_errors(None):  # an empty hydra.run.dir, or a launcher's ranks without -m: one line, nothing written
        adopt_submitit_ranks()  # a task of a submitit job of several tasks: its rank, as torchrun would set it
        check_launcher(hc)
        run_dir, sweep_dir, name = hydra_job(hc)
    rank = launched()[0]
    log_dir = run_dir if rank == 0 else None  # data-parallel ranks > 0 write no error.log: stderr only
    record = hydra_record(dcfg) if rank == 0 else None  # .hydra/: written once the run holds its directory
    sweep_job = f"{hc.job.num} ({run_dir})" if hc.mode == RunMode.MULTIRUN else None
    with job_errors(log_dir, sweep_job=sweep_job, rank=rank, hydra_record=record):
        cfg = checked_config(dcfg)  # every key and value, before any model is built
        if cfg.run.dry_run:  # a sweep's jobs never get here: its plan stopped it (rlsync.report.sweep_callback)
            from rlsync.check.duration import dry_run

            dry_run(cfg, " ".join(hc.overrides.task))
            return
        from rlsync.run.loop import run_experiment

        run_experiment(
            cfg,
            run_dir,
            name=name,
            group=cfg.wandb.group or sweep_dir.name,
            overrides=list(hc.overrides.task),
            hydra_record=record,
        )


def main() -> None:
    """The entry point (`python -m rlsync`, the `rlsync` script): Hydra, with one-line errors."""
    cli(rank_main)


def rank_main() -> None:
    """Hydra in this process; under `accelerate launch` or `torchrun`, ranks > 0 keep Hydra's output away
    (under the submitit launcher each task is started by submitit and runs hydra_main alone)."""
    sys.argv = rank_argv(sys.argv)
    if not any(a.startswith(("-", "hydra.mode=")) for a in sys.argv[1:]):  # a run: no -m, --help, --cfg, -sc
        sys.argv = [*sys.argv, SINGLE_RUN]
    hydra_main()


# A single run has no sweep to report: without the sweep's callback (rlsync.report, which imports torch), a value
# refused by validation is answered before torch, transformers or wandb is imported
SINGLE_RUN = "~hydra.callbacks.sweep_report"


if __name__ == "__main__":
    main()
