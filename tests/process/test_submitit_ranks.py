"""Data parallel through Hydra's submitit launcher, real processes: a two-rank sweep through submitit's local
executor, and a combination it refuses (the translation of a job's environment: tests/unit/test_submitit_ranks.py).
"""

import json

from conftest import FAST, run_cli

# a failed rank 0 must not leave rank 1 waiting at the rendezvous for the default hour
TWO_RANKS = ["-m", "hydra/launcher=local", "hydra.launcher.tasks_per_node=2", "run.rank_timeout_s=120"]


def test_a_sweep_through_submitit_runs_each_point_as_one_two_rank_job(tmp_path):
    """Two points (ddp, fsdp2), each a submitit job of 2 tasks on 127.0.0.1: one run per point, of 2 ranks,
    every engine verified; only rank 0 wrote its run directory, W&B (offline) and the console."""
    sweep = tmp_path / "sweep"
    proc = run_cli(
        *TWO_RANKS,
        "trainer.parallel=ddp,fsdp2",
        *FAST,
        "wandb.mode=offline",  # rank 0's W&B run alone (FAST runs without W&B)
        "update.verify=true",
        f"hydra.sweep.dir={sweep}",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for job, parallel in (("0", "ddp"), ("1", "fsdp2")):
        run = sweep / job
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["verification"] == "passed"
        assert (summary["setup"]["ranks"], summary["setup"]["parallel"]) == (2, parallel)
        # rank 0's files alone: rank 1 wrote no .hydra, error.log or W&B run of its own
        assert sorted(p.name for p in run.iterdir()) == [
            ".hydra",
            ".rlsync.lock",
            "metrics.jsonl",
            "rlsync.log",  # submitit's "job completed" lines, through Hydra's job logging: rank 0's
            "summary.json",
            "wandb",
        ]
        assert len(list((run / "wandb").glob("offline-run-*"))) == 1
        assert (run / "rlsync.log").read_text().count("Job completed successfully") == 1
    # each job's 2 tasks kept their logs: rank 0's holds the run's console, rank 1's none of it
    jobs = sorted(p for p in (sweep / ".submitit").iterdir() if p.name != "%j")
    assert len(jobs) == 2
    for job in jobs:
        assert "Measured steps:" in (job / f"{job.name}_0_log.out").read_text()
        assert "Measured steps:" not in (job / f"{job.name}_1_log.out").read_text()
    assert "(2 runs, 0 failed)" in proc.stdout  # the sweep's report


def test_a_submitit_job_of_two_ranks_refuses_a_single_process_trainer(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(*TWO_RANKS, "trainer.parallel=none", "wandb.mode=disabled", f"hydra.sweep.dir={sweep}", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = "config error: trainer.parallel=none: not allowed (allowed: ddp, fsdp2 (with 2 data-parallel ranks))"
    assert f"rlsync: a sweep job failed: {line}" in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert (sweep / "0" / "error.log").read_text().rstrip().endswith(line)  # rank 0's; rank 1 wrote none
    # the sweep's plan, made before the launch on the submitting host, checked the job as 2 ranks
    assert (
        "0 fit, 1 refused" in proc.stderr
        and "trainer.parallel=none: not allowed" in proc.stderr.split("rlsync: sweep job")[0]
    )
