"""Keys renamed (issue 44): the old key is refused in one line naming the new one, exit 2, before anything is
built, by every entry point that composes it (a schema class lists its old names in `renamed_keys`); the report
still reads runs recorded under the old name. The command as a new process: tests/process/test_renamed.py."""

from pathlib import Path

import pytest
from conftest import run_main

LINE = (
    "rlsync: config error: rollout.sleep_level=1: renamed to rollout.release_level (allowed: rollout.release_level=1)"
)


@pytest.mark.parametrize("override", ["rollout.sleep_level=1", "+rollout.sleep_level=1"])
@pytest.mark.parametrize("module", ["rlsync", "rlsync.bench", "rlsync.plan"])
def test_the_old_key_is_refused_naming_the_new_one(tmp_path, module, override):
    run_dir = tmp_path / "run"
    proc = run_main(override, "wandb.mode=disabled", f"hydra.run.dir={run_dir}", module=module, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [LINE]
    assert not (run_dir / "summary.json").exists() and not (run_dir / "plan.json").exists()


def test_a_key_never_renamed_is_still_an_unknown_key(tmp_path):
    proc = run_main("rollout.sleep_levels=1", "wandb.mode=disabled", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("rlsync: config error: rollout.sleep_levels=1: unknown key (allowed: ")


@pytest.mark.parametrize(
    "setup, config, level",
    [
        ({"release_level": 2}, {"rollout": {"release_level": 2}}, 2),
        ({"sleep_level": 0}, {"rollout": {"sleep_level": 0}}, 0),  # recorded before the rename
        ({}, {"rollout": {"sleep_level": 2}}, 2),  # only its config said it
        ({}, {"rollout": {"release_weights": True}}, 2),  # older still
        ({}, {}, None),
    ],
)
def test_the_report_reads_the_level_of_runs_recorded_before_the_rename(setup, config, level):
    from rlsync.report.rows import run_release_level
    from rlsync.report.runs import Run

    run = Run(Path("."), "0", [], "finished", None, {"setup": setup}, config, {}, 1)
    assert run_release_level(run) == level
