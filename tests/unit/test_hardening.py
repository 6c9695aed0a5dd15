"""Nothing a config or a file can do hangs a run, ends in a traceback or touches another run's files
(issue 26, items 2 to 8): each case is one line on stderr with its exit code, through the real entry
points in this process (run_main); the two that need a pipe to a reader that goes away start processes
(tests/process/test_hardening.py).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import FAST, QUIET, ROOT, read_jsonl, run_main

from rlsync.record.run_lock import RunLock
from rlsync.record.sinks import MetricsFile
from rlsync.shell import PipeSafe

LLAMA = {  # a tiny llama config.json (tests/unit/test_models_from_config.py's)
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


def one_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The command's one line on stderr, after checking its exit code and that there is nothing else."""
    assert proc.returncode == code, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and lines[0].startswith("rlsync"), proc.stderr
    return lines[0]


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `root`: its bytes and mtime."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".rlsync.lock"
    }


# ----------------------------------------------------------------------------------------------
# 2. a refused run touches nothing
# ----------------------------------------------------------------------------------------------


def test_a_run_refused_at_a_live_runs_directory_touches_none_of_its_files(tmp_path):
    live = tmp_path / "live"
    (live / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (live / ".hydra" / name).write_text(f"the live run's {name}\n")
    (live / "metrics.jsonl").write_text('{"step": 0}\n')
    (live / "error.log").write_text("the live run's error.log\n")
    before = snapshot(live)
    with RunLock(live):  # a live run holds the directory (a second flock conflicts within one process too)
        busy = run_main(*FAST, *QUIET, "update.bucket_mb=64", f"hydra.run.dir={live}")
        bad = run_main(*FAST, *QUIET, "update.bucket_mb=0", f"hydra.run.dir={live}")  # bad input there too
        bench = run_main(*QUIET, "bench.repeats=1", f"hydra.run.dir={live}", module="rlsync.bench")
    assert "is in use by another run" in one_line(busy)
    assert "update.bucket_mb=0.0: out of range" in one_line(bad)
    assert "is in use by another run" in one_line(bench)
    assert snapshot(live) == before


def test_a_run_writes_hydras_record_once_it_holds_its_directory(tmp_path):
    run = tmp_path / "run"
    proc = run_main(
        *QUIET, "bench.repeats=1", "bench.warmup=0", "update.bucket_mb=1", f"hydra.run.dir={run}", module="rlsync.bench"
    )
    assert proc.returncode == 0, proc.stderr
    assert (run / ".hydra" / "overrides.yaml").read_text().count("- ") == 5
    assert "update.bucket_mb=1" in (run / ".hydra" / "overrides.yaml").read_text()
    assert "bucket_mb: 1" in (run / ".hydra" / "config.yaml").read_text()
    assert "run:" in (run / ".hydra" / "hydra.yaml").read_text()


@pytest.mark.parametrize(
    "where, key, why",
    [
        ("/dev/null/run", "cannot create /dev/null/run", "a part of the path is a file, not a directory"),
        ("LONG", "cannot create", "the path is too long"),
    ],
)
def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path, where, key, why):
    where = str(tmp_path / ("d" * 300)) if where == "LONG" else where
    line = one_line(run_main(*FAST, *QUIET, f"hydra.run.dir={where}"))
    assert line.startswith(f"rlsync: {key}") and why in line and "hydra.run.dir=" in line


def test_a_read_only_run_directory_names_the_file(tmp_path):
    """(As root a read-only mount cannot be made here: its error, at the lock file's creation.)"""
    from rlsync.record.run_lock import RunDirUnusable

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "open", read_only)
        with pytest.raises(RunDirUnusable) as caught:
            RunLock(tmp_path).__enter__()
    assert str(caught.value) == (
        f"cannot use run directory {tmp_path}: the file system is read-only (Read-only file system): "
        f"give the run a directory it can write (hydra.run.dir=...)"
    )
    assert caught.value.exit_code == 2


def test_an_empty_run_directory_is_refused_and_the_current_directory_untouched(tmp_path):
    line = one_line(run_main(*FAST, *QUIET, "hydra.run.dir=", cwd=tmp_path))
    assert line.startswith("rlsync: config error: hydra.run.dir='': not allowed (allowed: a directory")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------
# 3. unknown (and missing) choices of a config group
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["rlsync", "rlsync.bench", "rlsync.plan", "rlsync.serve"])
def test_a_misspelt_experiment_is_an_unknown_choice(tmp_path, module):
    line = one_line(run_main("experiment=bucket_swep", f"hydra.run.dir={tmp_path / 'run'}", module=module))
    assert line.startswith("rlsync: config error: experiment=bucket_swep: unknown choice (allowed: bucket_sweep, ")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("group", ["model", "rollout"])
def test_a_group_every_run_needs_cannot_be_null(tmp_path, group):
    line = one_line(run_main(f"{group}=null", *QUIET, f"hydra.run.dir={tmp_path / 'run'}"))
    assert line.startswith(f"rlsync: config error: {group}=null: no choice (the run needs one) (allowed: ")


def test_an_ipv6_engine_address_gets_the_quoting_hint(tmp_path, compose):
    line = one_line(
        run_main("update.transport=broadcast", "update.engine_address=[::1]:29610", f"hydra.run.dir={tmp_path}")
    )
    assert "update.engine_address=[::1]:29610: cannot parse" in line
    assert "'update.engine_address=\"[::1]:29610\"'" in line
    assert compose('update.engine_address="[::1]:29610"').update.engine_address == "[::1]:29610"  # the hint works


# ----------------------------------------------------------------------------------------------
# 5. files that would block or are too large or deep; 6. their values under the key rules
# ----------------------------------------------------------------------------------------------


def deep(levels: int) -> list:
    """A list nested `levels` deep."""
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def write_config(tmp_path: Path, config: dict | str, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file"),
        (lambda p: p.open("wb").truncate(120 << 20), "over the limit of 4.00 MiB"),  # sparse: no disk used
        (lambda p: p.write_text("[" * 200_000 + "]" * 200_000), "nests deeper than 64 levels"),
        (lambda p: p.write_text(json.dumps({**LLAMA, "x": deep(70)})), "nests deeper than 64 levels"),
        (lambda p: p.write_text("{not json"), "is not valid JSON"),
    ],
    ids=["fifo", "120MB", "200k-deep", "65-deep", "not-json"],
)
def test_a_model_config_that_is_no_readable_json_file_is_one_line(tmp_path, make, why):
    path = tmp_path / "config.json"
    make(path)
    line = one_line(run_main(f"model.config={path}", *QUIET, f"hydra.run.dir={tmp_path / 'run'}"))
    assert line.startswith(f"rlsync: config error: model.config={path}: cannot read it: ") and why in line


def test_a_fifo_as_the_calibration_is_one_line(tmp_path):
    fifo = tmp_path / "calibration.json"
    os.mkfifo(fifo)
    line = one_line(run_main(f"plan.calibration={fifo}", f"hydra.run.dir={tmp_path / 'plan'}", module="rlsync.plan"))
    assert f"plan.calibration={fifo}: cannot read it: {fifo} is a FIFO (named pipe), not a regular file" in line


@pytest.mark.parametrize(
    "calibration, why",
    [
        ("[1, 2, 3]", "it holds a JSON list, not an object"),
        ('{"kind": "something"}', "not an rlsync calibration file (kind='something')"),
        ('{"kind": "rlsync_calibration", "coefficients": [1]}', "its coefficients is not an object of objects"),
        (
            '{"kind": "rlsync_calibration", "coefficients": {"direct/bucketed": {"per_call_s": "x", "per_tensor_s": 0, "per_byte_s": 0}}}',
            "coefficients['direct/bucketed'].per_call_s is 'x', not a number",
        ),
        ("[" * 100 + "]" * 100, "nests deeper than 64 levels"),
        ("{", "is not valid JSON"),
    ],
    ids=["array", "kind", "shape", "number", "deep", "malformed"],
)
def test_a_bad_calibration_file_is_one_line(tmp_path, calibration, why):
    path = write_config(tmp_path, calibration, "calibration.json")
    line = one_line(run_main(f"plan.calibration={path}", f"hydra.run.dir={tmp_path / 'plan'}", module="rlsync.plan"))
    assert line.startswith(f"rlsync: config error: plan.calibration={path}: ") and why in line


@pytest.mark.parametrize(
    "key, value, line",
    [
        ("head_dim", 3, "model.head_dim=3: out of range in model.config="),
        ("rope_theta", 1e-300, "model.rope_theta=1e-300: out of range in model.config="),
        ("rope_theta", float("nan"), "model.rope_theta=nan: not allowed in model.config="),
        ("rms_norm_eps", float("inf"), "model.rms_norm_eps=inf: not allowed in model.config="),
        ("num_hidden_layers", 0, "model.num_hidden_layers=0: out of range in model.config="),
        ("num_attention_heads", "four", "model.num_attention_heads=four: not allowed in model.config="),
    ],
)
def test_values_read_from_a_model_config_pass_the_key_rules(tmp_path, key, value, line):
    path = write_config(tmp_path, {**LLAMA, key: value})  # json.dumps writes NaN and Infinity as JSON5 does
    got = one_line(run_main(f"model.config={path}", *QUIET, f"hydra.run.dir={tmp_path / 'run'}"))
    assert got.startswith(f"rlsync: config error: {line}{path}"), got


@pytest.mark.parametrize(
    "override, line",
    [
        ("trainer.kl_coef=1e308", "trainer.kl_coef=1e+308: out of range (allowed: 0 to 1000"),
        ("update.copy_threads=100000", "update.copy_threads=100000: out of range (allowed: null or 0 to 1024"),
        ("model.head_dim=3", "model.head_dim=3: out of range (allowed: an even integer >= 2"),
        ("model.rope_theta=1e-300", "model.rope_theta=1e-300: out of range (allowed: a number >= 1"),
    ],
)
def test_numbers_that_fail_at_run_time_are_refused_before_anything_is_built(tmp_path, override, line):
    got = one_line(run_main(override, *QUIET, f"hydra.run.dir={tmp_path / 'run'}"))
    assert got.startswith(f"rlsync: config error: {line}"), got


# ----------------------------------------------------------------------------------------------
# 7. checkpoints, fits and other inputs that ended in an internal error
# ----------------------------------------------------------------------------------------------


def test_a_checkpoint_without_its_tokenizer_is_one_line(tmp_path):
    from rlsync.config.schema import ModelConfig
    from rlsync.model.architecture import hf_config

    ckpt = tmp_path / "ckpt"
    hf_config(ModelConfig()).save_pretrained(ckpt)  # the tiny preset's architecture, and no tokenizer beside it
    line = one_line(run_main(f"model.pretrained={ckpt}", *QUIET, f"hydra.run.dir={tmp_path / 'run'}"))
    assert line.startswith(f"rlsync: config error: model.pretrained={ckpt}: no tokenizer files in that directory")


def test_a_fit_skips_a_bad_summary_with_a_line_naming_it(tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(ROOT / "experiments" / "bucket_sweep" / "results_cpu" / "runs", runs)
    (runs / "list").mkdir()
    (runs / "list" / "summary.json").write_text("[1, 2, 3]")
    (runs / "fifo").mkdir()
    os.mkfifo(runs / "fifo" / "summary.json")
    (runs / "cut").mkdir()
    (runs / "cut" / "summary.json").write_text('{"kind": "bench", "target": "update", "status": "finished"}')
    proc = run_main(
        f"plan.fit_from={runs}",
        f"plan.calibration={tmp_path / 'calibration.json'}",
        f"hydra.run.dir={tmp_path / 'plan'}",
        module="rlsync.plan",
    )
    assert proc.returncode == 0, proc.stderr
    warnings = proc.stderr.strip().splitlines()
    assert len(warnings) == 3 and all(w.startswith("rlsync: warning: skipped ") for w in warnings), proc.stderr
    assert any(f"{runs / 'fifo' / 'summary.json'} is a FIFO" in w for w in warnings)
    assert any(f"{runs / 'list' / 'summary.json'}: it holds a JSON list" in w for w in warnings)
    assert len(json.loads((tmp_path / "calibration.json").read_text())["observations"]) == 12


def test_a_fit_from_a_missing_folder_is_one_line(tmp_path):
    line = one_line(
        run_main(f"plan.fit_from={tmp_path / 'nope'}", f"hydra.run.dir={tmp_path / 'plan'}", module="rlsync.plan")
    )
    assert line == (
        f"rlsync: config error: plan.fit_from={tmp_path / 'nope'}: no such directory (allowed: a directory "
        f"holding rlsync.bench runs (their summary.json))"
    )


# ----------------------------------------------------------------------------------------------
# 8. stdout's reader going away; a full disk mid-line
# ----------------------------------------------------------------------------------------------


def test_a_stream_whose_reader_went_away_swallows_what_is_written(tmp_path):
    read, write = os.pipe()
    os.close(read)  # `| head` exited
    stream = PipeSafe(os.fdopen(write, "w"))
    stream.write("x" * 200_000)  # more than a pipe holds: the write itself fails underneath
    stream.flush()
    stream.write("and the run goes on\n")
    stream.flush()
    stream.close()


def test_a_full_disk_leaves_no_partial_line_in_metrics(tmp_path):
    metrics = MetricsFile(tmp_path)
    metrics.write({"step": 0, "perf/step_time": 1.0})
    calls = []

    def fills_up(fd, data):  # half of the line lands, then the disk is full
        calls.append(len(data))
        if len(calls) == 1:
            return os.write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    metrics._write = fills_up
    with pytest.raises(Exception, match=r"the disk is full .*the 1 step\(s\) finished before are kept in it"):
        metrics.write({"step": 1, "perf/step_time": 2.0})
    metrics.close()
    assert len(calls) == 2
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0, "perf/step_time": 1.0}]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n")


def test_an_open_file_limit_too_low_for_an_engine_process_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """`ulimit -n 24` with ipc: the engine process would die without a word; a low soft limit is raised."""
    import resource

    set_to = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (24, 24))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: set_to.append(limits))
    line = one_line(run_main(*FAST, *QUIET, "update.transport=ipc", f"hydra.run.dir={tmp_path / 'a'}"))
    assert line.startswith(
        "rlsync: config error: update.transport=ipc: needs more open files than this shell allows (ulimit -n 24, hard limit 24)"
    )
    assert set_to == []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (24, 1 << 20))  # only the soft limit is low: raised
    from rlsync.config.schema import UpdateConfig
    from rlsync.config.validate import check_open_files

    check_open_files(UpdateConfig(transport="ipc"))
    assert set_to == [(4096, 1 << 20)]
    check_open_files(UpdateConfig(transport="direct"))  # the engine in this process: nothing to check
    assert len(set_to) == 1
