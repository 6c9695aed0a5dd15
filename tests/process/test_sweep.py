"""A real sweep with a failed and a refused job still writes its report
(tests/unit/test_sweep.py: its plan, dry runs and progress)."""

from __future__ import annotations

import pytest
from conftest import FAST, run_main

SHORT = [*FAST[:1], "run.steps=2", "run.warmup_steps=1", *FAST[3:], "wandb.mode=disabled"]


HUGE = "qwen3_4b"  # refused for memory: the tests give the machine 8 GiB (small_machine)


@pytest.fixture(autouse=True)
def small_machine(monkeypatch):
    """An 8 GiB machine, whatever this one has: qwen3_4b never fits, the tiny model always does."""
    from rlsync.check import fit

    monkeypatch.setattr(fit, "host_available_bytes", lambda: 8 * 2**30)


def test_a_sweep_with_a_failed_and_a_refused_job_still_writes_its_report(tmp_path, monkeypatch):
    """Hydra skips on_multirun_end when a job fails: the report is written from the entry point's error
    handling instead, listing the failed job and the refused one beside the run that finished."""
    from rlsync.run.loop import Experiment

    step = Experiment.step

    def fails_at_bucket_2(self, *args, **kwargs):
        if self.cfg.update.bucket_mb == 2:
            raise RuntimeError("an injected failure")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Experiment, "step", fails_at_bucket_2)
    sweep = tmp_path / "sweep"
    result = run_main("-m", *SHORT, f"model=tiny,{HUGE}", "update.bucket_mb=1,2", f"hydra.sweep.dir={sweep}")
    assert result.returncode != 0
    err = result.stderr
    assert "rlsync: sweep of 4 jobs: 2 fit, 2 refused" in err
    assert "rlsync: sweep job 0 (1 of 4: " in err and "rlsync: sweep job 1 (2 of 4: " in err
    assert "1 done in " in err  # the ETA from the measured job
    assert "RuntimeError: an injected failure" in err
    assert "Error executing job with overrides" not in err  # Hydra's repeat of the job's own line
    assert "rlsync: sweep ended with failed jobs" in err
    report = (sweep / "report.md").read_text()
    assert "an injected failure" in report and "does not fit" in report
    out = result.stdout
    assert "(1 run, 3 failed)" in out and "failed: 1 (" in out and "failed: 2 (" in out and "failed: 3 (" in out
