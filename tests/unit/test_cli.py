"""The runner end to end on the tiny model: its entry point in this process (run_main); real
`python -m rlsync` processes, where the process is what is tested (SIGKILL, W&B as a user sees it), are in
tests/process/test_cli.py."""

import json
import statistics

import pytest
from conftest import FAST, ROOT, read_jsonl, run_main

from rlsync.config.apps import SCHEMAS
from rlsync.config.help import key_comment
from rlsync.config.validate import leaves

STEP_METRICS = [
    "perf/step_time",
    "perf/rollout_time",
    "perf/wake_up_time",
    "perf/log_probs_time",
    "perf/train_time",
    "perf/update_weights_time",
    "perf/sleep_time",
    "perf/update_weights_bytes",
    "perf/update_weights_buckets",
    "perf/update_weights_gbps",
    "perf/update_weights_limit_time",
    "perf/update_weights_efficiency",
    "perf/sleep_bytes",
    "perf/wake_up_bytes",
    "rollout/reward_mean",
    "rollout/response_len_mean",
    "rollout/truncated_ratio",
    "train/loss",
    "train/grad_norm",
    "train/logprob_abs_diff",
]


def test_run_prints_table_and_verdict_and_writes_files(tmp_path):
    proc = run_main(*FAST, "wandb.mode=disabled", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    header = (
        "| model | update setup | weight update median (range) | trainer offload median (range) "
        "| trainer onload median (range) | step median (range) | update share of step |"
    )
    assert header in proc.stdout and "| tiny | direct, bucketed 512 MiB, scheme rlsync | " in proc.stdout
    assert "Measured steps: 2 (warm-up step 0 left out)" in proc.stdout
    assert "of the step" in proc.stdout.splitlines()[-1]  # the verdict closes the output
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in STEP_METRICS:
        assert all(isinstance(r[key], (int, float)) for r in rows), key
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["measured_steps"] == 2
    measured = [r["perf/update_weights_time"] for r in rows[1:]]  # warm-up step 0 left out
    assert summary["metrics"]["perf/update_weights_time"] == {
        "median": statistics.median(measured),
        "min": min(measured),
        "max": max(measured),
    }
    assert summary["share"]["update_weights"] == pytest.approx(
        summary["metrics"]["perf/update_weights_time"]["median"] / summary["metrics"]["perf/step_time"]["median"]
    )
    assert summary["config"]["update"]["bucket_mb"] == 512
    assert not (tmp_path / "rlsync.log").exists()  # nothing was logged: no empty Hydra job log
    # what one step offloads (params, grads, optimizer state) the next step brings back
    assert rows[0]["perf/sleep_bytes"] > 0
    assert rows[1]["perf/wake_up_bytes"] == rows[0]["perf/sleep_bytes"]


def test_every_schema_key_has_its_one_line_comment():
    missing = [key for schema in SCHEMAS.values() for key, *_ in leaves(schema()) if not key_comment(schema, key)]
    assert not missing, f"keys without a trailing # comment in rlsync/config/schema.py: {missing}"


@pytest.mark.parametrize(
    "module, schema",
    [
        ("rlsync", "rlsync_schema"),
        ("rlsync.bench", "rlsync_bench_schema"),
        ("rlsync.serve", "rlsync_engine_schema"),
        ("rlsync.plan", "rlsync_plan_schema"),
    ],
)
def test_help_lists_every_key_with_its_value_and_comment(module, schema):
    proc = run_main("update.bucket_mb=64", "--help", module=module)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for key, *_ in leaves(SCHEMAS[schema]()):
        assert any(
            line.split()[:1]
            and line.split()[0].startswith(key + "=")
            and line.endswith(key_comment(SCHEMAS[schema], key))
            for line in lines
        ), key
    bucket = next(line for line in lines if line.strip().startswith("update.bucket_mb="))
    assert bucket.split()[0] == "update.bucket_mb=64.0" and "bucket size in MiB" in bucket  # the composed value
    assert "model: qwen3_0p6b, qwen3_1p7b" in proc.stdout  # the config groups, Hydra's own listing
    assert "--hydra-help" in proc.stdout
    assert "Hydra (" in run_main("--hydra-help", module=module).stdout  # Hydra's help is still there


def test_completion_offers_the_keys_of_the_schema():
    proc = run_main("--shell-completion", "query=bash", COMP_LINE="rlsync update.tr")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["update.transport="]
    proc = run_main("--shell-completion", "install=bash")
    assert "complete -o nospace -o default -F hydra_bash_completion" in proc.stdout


@pytest.mark.parametrize(
    "module,overrides", [("rlsync.plan", []), ("rlsync.serve", ["update.engine_address=127.0.0.1:0"])]
)
def test_every_command_takes_the_run_lock_before_anything_is_written(tmp_path, module, overrides):
    """F10: the planner and the engine pointed at a live run's directory are refused, its .hydra/ untouched (they
    take the run lock, as the runner and the bench do, before Hydra's record is written)."""
    from rlsync.record.run_lock import RunLock

    run_dir = tmp_path / "live"
    with RunLock(run_dir):  # held as a live run holds it, its record written
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "overrides.yaml").write_text("- the live run's\n")
        proc = run_main("wandb.mode=disabled", *overrides, f"hydra.run.dir={run_dir}", module=module)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith(f"rlsync: run directory {run_dir} is in use by another run"), proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", ".rlsync.lock"]
    assert [p.name for p in (run_dir / ".hydra").iterdir()] == ["overrides.yaml"]
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == "- the live run's\n"


def test_every_entry_points_config_leaves_hydras_record_to_the_run_lock():
    for name in ("config", "bench", "plan", "engine"):
        text = (ROOT / "rlsync" / "conf" / f"{name}.yaml").read_text()
        assert "\n  output_subdir: null\n" in text, f"conf/{name}.yaml: Hydra would write .hydra/ before the lock"
