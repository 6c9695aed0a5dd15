"""`python -m rlsync rollout.sleep_level=1` as a user types it: one line naming rollout.release_level, exit 2
(the same refusal in this process, per entry point: tests/unit/test_renamed.py)."""

from conftest import run_cli


def test_the_old_key_is_refused_in_one_line_by_the_command(tmp_path):
    proc = run_cli("rollout.sleep_level=1", "wandb.mode=disabled", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "rlsync: config error: rollout.sleep_level=1: renamed to rollout.release_level "
        "(allowed: rollout.release_level=1)"
    ]
    assert not (tmp_path / "run").exists()
