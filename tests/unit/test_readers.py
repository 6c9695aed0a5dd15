"""Other frameworks' runs, written by the real writers (wandb offline, TensorBoard's SummaryWriter, verl's
and Miles' JSONL as their loggers write it), read and answered by rlsync.readers and python -m rlsync.report:
each framework's key layout and step axis, a warm-up, the verdict on both sides of the threshold, and bad
input refused in one line with exit 2 and the input untouched."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from rlsync.config.schema import VERDICT_THRESHOLD
from rlsync.readers import ReadRefused, find_sources, imported_runs
from rlsync.readers import base as readers_base
from rlsync.readers.base import History
from rlsync.readers.frameworks.base import FrameworkMap, detect, framework_class, framework_names
from rlsync.record.summary import share_verdict

OVER = "worth tuning"  # share_verdict's two endings
UNDER = "not the step to tune"
WARM = 100.0  # a warm-up step's update: were it measured, every verdict would be "worth tuning"


def steps_of(n: int, update: float, step: float) -> list[tuple[float, float]]:
    """n logged steps: two slow warm-up steps, then (update, step) with a small spread."""
    return [(WARM, step) if i < 2 else (update * (1 + 0.01 * (i % 3)), step * (1 + 0.01 * (i % 2))) for i in range(n)]


def fingerprint(path: Path) -> dict[str, str]:
    """Every file under `path` with its bytes' hash: the input untouched."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


# ----------------------------------------------------------------------------------------------
# Inputs written by the real writers
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wandb_runs(tmp_path_factory) -> dict[str, Path]:
    """Two W&B offline runs written by wandb itself: Miles' layout (perf/*, on rollout/step, under the
    threshold) and TRL's (the sync on W&B's own _step between the trainer's rows, over it)."""
    import wandb

    root = tmp_path_factory.mktemp("wandb_runs")
    old = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_SILENT", "WANDB_SERVICE")}
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    # a service another test of this worker started (and may have stopped) is not this fixture's: its own
    os.environ.pop("WANDB_SERVICE", None)
    try:
        run = wandb.init(project="miles", dir=str(root / "miles"), config={"hf_checkpoint": "Qwen/Qwen3-1.7B"})
        run.define_metric("rollout/step")
        run.define_metric("perf/*", step_metric="rollout/step")
        for i, (update, step) in enumerate(steps_of(8, 0.2, 20.0)):
            run.log({"rollout/step": i, "perf/update_weights_time": update, "perf/step_time": step})
            run.log({"rollout/step": i, "perf/sleep_time": 1.5, "perf/wake_up_time": 0.7, "perf/rollout_time": 9.0})
        run.finish()
        run = wandb.init(project="trl", dir=str(root / "trl"), config={"model_name_or_path": "Qwen/Qwen3-0.6B"})
        for i, (update, _) in enumerate(steps_of(8, 0.2, 0)):
            run.log({"profiling/Time taken: GRPOTrainer.sync_weights": update})  # W&B's own _step, no trainer step
            time.sleep(0.1)  # the step: TRL logs none, W&B stamps each row with its own clock
            run.log({"train/global_step": i + 1, "train/loss": 0.1})
        run.finish()
    finally:
        wandb.teardown()  # stops the service this fixture started; the next user starts its own
        for key, value in old.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    return {name: next((root / name / "wandb").glob("offline-run-*")) for name in ("miles", "trl")}


def tensorboard_run(path: Path, scalars: dict[str, list[float]]) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(path))
    for tag, values in scalars.items():
        for step, value in enumerate(values, start=1):  # verl and NeMo-RL count steps from 1
            writer.add_scalar(tag, value, step)
    writer.close()
    return path


def verl_jsonl(path: Path, rows: list[dict]) -> Path:
    """As verl's FileLogger writes it: one {"step": N, "data": {...}} per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for step, data in enumerate(rows, start=1):
            f.write(json.dumps({"step": step, "data": data}) + "\n")
    return path


def miles_dashboard(root: Path, steps: list[tuple[float, float]], ranks: int = 2) -> Path:
    """As Miles' MetricStore flushes it: dashboard/phases/<hour>.jsonl, one PhaseEvent per line and rank,
    an open interval (t1 = -1) written before its closing one; rank r takes (1 + r/10) x the time."""
    phases = root / "dashboard" / "phases"
    phases.mkdir(parents=True)
    (root / "dashboard" / "meta.json").write_text(json.dumps({"run_name": "m", "start_ts": 0, "args": {}}))
    lines, t = [], 1000.0
    for update, step in steps:
        step = step if update < step else step + update  # a warm-up step holds its slow update
        for rank in range(ranks):
            scale = 1 + rank / 10
            base = {"node": "n0", "gpus": [rank], "rank": rank, "role": "train"}
            train_end = t + (step - update) * 0.9 * scale
            lines.append({"name": "train", "t0": t, "t1": -1.0, **base})
            lines.append({"name": "train", "t0": t, "t1": train_end, **base})
            lines.append({"name": "update_weights", "t0": train_end, "t1": train_end + update * scale, **base})
            lines.append({"name": "step", "t0": t, "t1": t + step * scale, **base})
        t += step * 2
    (phases / "20260801_10.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


# ----------------------------------------------------------------------------------------------
# Each format, each framework's layout, the verdict on both sides of the threshold
# ----------------------------------------------------------------------------------------------


def only(path: Path, **kw):
    found = imported_runs(path, **kw)
    assert len(found) == 1, found
    return found[0]


def test_wandb_offline_miles_layout_under_the_threshold(wandb_runs):
    a = only(wandb_runs["miles"])
    assert a.framework == "miles" and a.history.source == "wandb"
    assert a.measured == 6 and a.warmup == 2  # the two slow warm-up steps left out
    assert a.stats["perf/update_weights_time"]["max"] < WARM
    assert a.share == pytest.approx(0.2 / 20.0, rel=0.05) and a.share < VERDICT_THRESHOLD
    assert a.verdict.startswith(share_verdict(a.share, VERDICT_THRESHOLD)) and UNDER in a.verdict
    assert "largest phase is generation" in a.verdict and "pause, flush and barriers" in a.verdict
    assert a.stats["perf/sleep_time"]["median"] == 1.5 and a.stats["perf/wake_up_time"]["median"] == 0.7
    assert a.model == "Qwen/Qwen3-1.7B"
    # --warmup 0: the slow first steps are measured too
    counted = only(wandb_runs["miles"], warmup=0)
    assert counted.measured == 8 and counted.stats["perf/update_weights_time"]["max"] == WARM


def test_wandb_offline_trl_sync_on_wandb_step_over_the_threshold(wandb_runs):
    a = only(wandb_runs["trl"])
    assert a.framework == "trl" and a.keys["perf/step_time"] == "clock"
    # each sync row (on W&B's own _step) joins the trainer's next row; the step is the time between its logs
    assert 0.1 <= a.stats["perf/step_time"]["median"] < 5
    assert a.stats["perf/update_weights_time"]["median"] == pytest.approx(0.202, rel=0.02)
    assert a.share > VERDICT_THRESHOLD and OVER in a.verdict and "time between logged steps" in a.verdict


def test_tensorboard_verl_and_nemo_rl(tmp_path):
    updates = [u for u, _ in steps_of(6, 0.1, 0)]
    verl = tensorboard_run(
        tmp_path / "verl",
        {"timing_s/update_weights": updates, "timing_s/step": [30.0] * 6, "timing_s/gen": [20.0] * 6},
    )
    a = only(verl)
    assert (a.framework, a.history.source, a.measured) == ("verl", "tensorboard", 4)
    assert UNDER in a.verdict and "offload and two wakes" in a.verdict and "largest phase is generation" in a.verdict
    nemo = tensorboard_run(
        tmp_path / "nemo",
        {
            "timing/train/prepare_for_generation/transfer_and_update_weights": [WARM, WARM, 4.0, 4.1, 4.2],
            "timing/train/total_step_time": [50.0] * 5,
            "timing/train/policy_training": [30.0] * 5,
        },
    )
    b = only(nemo)
    assert b.framework == "nemo_rl" and b.share == pytest.approx(4.1 / 50.0) and OVER in b.verdict
    assert "largest phase is training" in b.verdict and "transfer alone" in b.verdict


def test_verl_file_logger_jsonl(tmp_path):
    rows = [{"timing_s/update_weights": u, "timing_s/step": 10.0, "actor/pg_loss": 0.1} for u, _ in steps_of(7, 1.0, 0)]
    a = only(verl_jsonl(tmp_path / "proj" / "exp.jsonl", rows))
    assert (a.framework, a.history.source, a.measured) == ("verl", "verl_jsonl", 5)
    assert a.share == pytest.approx(0.101, rel=0.02) and OVER in a.verdict
    rows = [{**r, "timing_s/update_weights": 0.01} for r in rows]
    assert UNDER in only(verl_jsonl(tmp_path / "proj2" / "exp.jsonl", rows)).verdict


def test_miles_dashboard_phases_slowest_rank(tmp_path):
    a = only(miles_dashboard(tmp_path / "dump", steps_of(6, 0.5, 10.0)))
    assert (a.framework, a.history.source, a.measured) == ("miles", "miles_phases", 4)
    # the slowest of two ranks (rank 1 takes 1.1x): per phase, not per rank
    assert a.stats["perf/update_weights_time"]["min"] == pytest.approx(0.55)
    assert a.stats["perf/step_time"]["median"] == pytest.approx(11.0, rel=0.02)
    assert OVER in a.verdict and "largest phase is training" in a.verdict
    b = only(miles_dashboard(tmp_path / "dump2", steps_of(6, 0.05, 10.0)))
    assert UNDER in b.verdict


def test_history_exports_csv_skyrl_and_jsonl_areal(tmp_path):
    path = tmp_path / "skyrl.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["_step", "timing/sync_weights", "timing/step", "timing/generate", "note"])
        for i, (update, _) in enumerate(steps_of(6, 3.0, 0)):
            writer.writerow([i, update, 40.0, 25.0, "" if i else "x"])
    a = only(path)
    assert (a.framework, a.history.source, a.measured) == ("skyrl", "history", 4) and OVER in a.verdict
    areal = tmp_path / "areal.jsonl"  # AReaL logs no whole step: the time between rows' _timestamp
    lines = [
        {"_step": i, "_timestamp": 100.0 + 60.0 * i, "timeperf/update_weights": u, "timeperf/actor_offload": 2.0}
        for i, (u, _) in enumerate(steps_of(6, 0.6, 0))
    ]
    areal.write_text("".join(json.dumps(x) + "\n" for x in lines))
    b = only(areal)
    assert b.framework == "areal" and b.stats["perf/step_time"]["median"] == 60.0
    assert b.share == pytest.approx(0.6 / 60, rel=0.05) and UNDER in b.verdict
    assert "largest phase is trainer offload" in b.verdict


@pytest.mark.parametrize("name", framework_names())
def test_every_framework_is_a_declared_map_detected_from_its_own_keys(name):
    cls = framework_class(name)
    assert issubclass(cls, FrameworkMap) and cls.title and cls.update and cls.spans and cls.checked
    row = {cls.update[0]: 1.0, readers_base.STEP: 0.0, readers_base.CLOCK: 0.0}
    row.update({cls.step[0]: 10.0} if cls.step else {})
    row.update({ks[0]: 2.0 for ks in cls.phases.values()})
    row.update(dict.fromkeys(cls.axis[:1], 0.0))
    assert detect(History(Path("x"), "history", "x", [row]))[0] == name


# ----------------------------------------------------------------------------------------------
# The report: rlsync's own run beside other frameworks', one table, a verdict each
# ----------------------------------------------------------------------------------------------


def rlsync_run(path: Path) -> Path:
    """A run directory as rlsync's recorder leaves one (metrics.jsonl, no summary: reported as incomplete)."""
    path.mkdir(parents=True)
    rows = [{"step": i, "perf/update_weights_time": 0.3, "perf/step_time": 2.0} for i in range(4)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_side_by_side(wandb_runs, tmp_path, capsys):
    from rlsync.report import main

    verl = tensorboard_run(
        tmp_path / "tb" / "verl", {"timing_s/update_weights": [5.0] * 5, "timing_s/step": [20.0] * 5}
    )
    own = rlsync_run(tmp_path / "runs" / "mine")
    inputs = {p: fingerprint(p) for p in (wandb_runs["miles"], verl)}
    out = tmp_path / "out"
    assert main([str(wandb_runs["miles"]), str(tmp_path / "tb"), str(own), "--out", str(out), "--no-wandb"]) == 0
    printed = capsys.readouterr().out
    assert "source (framework)" in printed and "W&B offline run (Miles / slime)" in printed
    assert "TensorBoard events (verl)" in printed and "rlsync run" in printed
    verdicts = [line for line in printed.splitlines() if line.startswith("verdict: ")]
    assert len(verdicts) == 3 and sum(OVER in v for v in verdicts) == 2 and sum(UNDER in v for v in verdicts) == 1
    with (out / "report.csv").open() as f:
        table = list(csv.DictReader(f))
    assert sorted(r["framework"] for r in table) == ["", "Miles / slime", "verl"]
    best = [line for line in printed.splitlines() if line.startswith("best:")]
    assert best and not [line for line in best if "offline-run" in line or "run verl" in line]  # not ranked
    assert all(fingerprint(p) == before for p, before in inputs.items())


def test_report_refuses_unrecognised_keys_in_one_line(tmp_path, capsys):
    from rlsync.report import main

    rows = [{"timing_s/gen": 1.0, "custom/sync": 0.5} for _ in range(4)]
    path = verl_jsonl(tmp_path / "p" / "e.jsonl", rows)
    before = fingerprint(path)
    assert main([str(path), "--no-wandb", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("rlsync.report: ")
    assert "custom/sync, timing_s/gen" in err and "miles, verl, trl" in err
    assert not (tmp_path / "out").exists() and fingerprint(path) == before
    # forced onto a map whose keys it lacks: the same one line
    assert main([str(path), "--framework", "skyrl", "--no-wandb", "--out", str(tmp_path / "out")]) == 2
    assert "--framework skyrl reads its update from timing/sync_weights" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Bad input: one line, exit 2 (ReadRefused is BadInput), the input untouched
# ----------------------------------------------------------------------------------------------


def refused(path: Path, match: str, **kw) -> str:
    before = fingerprint(path) if path.exists() and not path.is_fifo() else None
    with pytest.raises(ReadRefused, match=match) as info:
        imported_runs(path, **kw)
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 2
    if before is not None:
        assert fingerprint(path) == before
    return message


def test_truncated_and_corrupt_wandb_file(wandb_runs, tmp_path):
    source = next(wandb_runs["miles"].glob("*.wandb"))
    data = source.read_bytes()
    cut = tmp_path / "cut" / "run-x.wandb"
    cut.parent.mkdir()
    cut.write_bytes(data[: len(data) - 5])
    refused(cut, "truncated|corrupt")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    bad = tmp_path / "bad" / "run-x.wandb"
    bad.parent.mkdir()
    bad.write_bytes(bytes(flipped))
    refused(bad, "corrupt")
    (tmp_path / "junk.wandb").write_bytes(b"not a wandb file")
    refused(tmp_path / "junk.wandb", "not a W&B run file")


def test_torn_last_jsonl_line(tmp_path):
    path = verl_jsonl(tmp_path / "p" / "e.jsonl", [{"timing_s/update_weights": 1.0, "timing_s/step": 9.0}] * 5)
    with path.open("a") as f:
        f.write('{"step": 6, "data": {"timing_s/upd')
    refused(path, "line 6 is not JSON .a torn last line")


def test_tensorboard_without_scalars_and_corrupt(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "text"))
    writer.add_text("note", "no scalars here", 0)
    writer.close()
    refused(tmp_path / "text", "hold no scalars")
    run = tensorboard_run(tmp_path / "tb", {"timing_s/update_weights": [1.0] * 5, "timing_s/step": [9.0] * 5})
    events = next(run.glob("*tfevents*"))
    events.write_bytes(events.read_bytes()[:-7])
    refused(run, "corrupt or truncated")


def test_fifo_symlink_loop_and_too_many_files(tmp_path, monkeypatch):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    refused(fifo, "FIFO")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    refused(tmp_path / "loop_a", "cannot read")
    tree = tmp_path / "tree"  # a folder linking to itself: the walk does not follow links
    tree.mkdir()
    (tree / "self").symlink_to(tree)
    (tree / "fifo.jsonl").symlink_to(fifo)
    assert find_sources(tree) == []
    many = tmp_path / "many"
    many.mkdir()
    monkeypatch.setattr(readers_base, "MAX_ENTRIES", 50)  # 100,000 files read as 51: the same refusal
    for i in range(51):
        (many / f"{i}.csv").touch()
    refused(many, "over 50 files and folders")


@pytest.mark.parametrize("value", ["NaN", "-1.5", "Infinity"])
def test_not_a_time(tmp_path, value):
    path = tmp_path / "e.jsonl"
    lines = [
        f'{{"step": {i}, "data": {{"timing_s/update_weights": {value if i == 3 else 1.0}, "timing_s/step": 9.0}}}}'
        for i in range(5)
    ]
    path.write_text("\n".join(lines) + "\n")
    refused(path, "timing_s/update_weights is .* at step 3: a time must be a finite number")


def test_no_measured_step_after_the_warmup(tmp_path):
    path = verl_jsonl(tmp_path / "e.jsonl", [{"timing_s/update_weights": 1.0, "timing_s/step": 9.0}] * 2)
    refused(path, "none after the 2 warm-up step")
    assert only(path, warmup=0).measured == 2


def test_docs_list_every_map_as_its_class_declares_it():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "report.md").read_text()
    for name in framework_names():
        cls = framework_class(name)
        assert f"| `{name}` | {cls.title} | {' or '.join(f'`{k}`' for k in cls.update)} | {cls.spans} |" in docs


# ----------------------------------------------------------------------------------------------
# The update's floor on a GPU, from the planner: the run's model and device, or --model and --device
# ----------------------------------------------------------------------------------------------


def with_gpu(run_dir: Path, gpu: str, out: Path) -> Path:
    """A copy of a W&B offline run whose .wandb file ends with W&B's own environment record naming `gpu` (as
    wandb writes on a GPU machine), padded to a new 32 KiB block as its log format allows."""
    import shutil
    import struct
    import zlib

    from wandb.proto import wandb_internal_pb2 as pb

    from rlsync.readers import wandb_offline

    shutil.copytree(run_dir, out)
    source = next(out.glob("*.wandb"))
    data = bytearray(source.read_bytes())
    data += bytes(-len(data) % wandb_offline.BLOCK)  # zero padding to the block's end
    record = pb.Record(environment=pb.EnvironmentRecord(gpu_type=gpu)).SerializeToString()
    crc = zlib.crc32(record, wandb_offline.CRC[wandb_offline.FULL]) & 0xFFFFFFFF
    source.write_bytes(bytes(data) + struct.pack("<IHB", crc, len(record), wandb_offline.FULL) + record)
    return out


def report_csv(out: Path) -> list[dict]:
    with (out / "report.csv").open() as f:
        return list(csv.DictReader(f))


def test_floor_from_the_runs_model_and_recorded_gpu(wandb_runs, tmp_path, capsys):
    from rlsync.plan.planner import preset_model, update_floor
    from rlsync.report import main

    run = with_gpu(wandb_runs["miles"], "NVIDIA H200", tmp_path / "offline-run-gpu")
    assert only(run).history.device == "NVIDIA H200"
    floor = update_floor(preset_model("qwen3_1p7b"), "h200")  # Qwen/Qwen3-1.7B in its config: the preset
    assert floor["update_bytes"] == 1_720_574_976 * 2  # every tensor the update sends, the tied embedding once
    out = tmp_path / "out"
    assert main([str(run), "--out", str(out), "--no-wandb"]) == 0
    printed = capsys.readouterr().out
    (row,) = report_csv(out)
    update = float(row["update_time_median"])
    assert float(row["update_limit_time_median"]) == pytest.approx(floor["floor_s"]) and row["device"] == "h200"
    assert float(row["update_efficiency_median"]) == pytest.approx(floor["floor_s"] / update, rel=0.02)
    verdict = next(line for line in printed.splitlines() if line.startswith("verdict: "))
    assert "Floor: 1.60 ms on NVIDIA H200 (the run recorded NVIDIA H200): 3.20 GiB of Qwen/Qwen3-1.7B" in verdict
    assert f"is {update / floor['floor_s']:.1f}x it" in verdict and "x floor)" in printed  # the table's column
    assert "floor: n/a" not in printed


def test_floor_from_model_and_device_flags_and_one_note_where_neither_is_known(wandb_runs, tmp_path, capsys):
    from rlsync.plan.planner import config_json_model, preset_model, update_floor
    from rlsync.report import main

    verl = [
        tensorboard_run(tmp_path / "tb" / name, {"timing_s/update_weights": [5.0] * 5, "timing_s/step": [20.0] * 5})
        for name in ("a", "b")
    ]
    assert main([str(tmp_path / "tb"), str(wandb_runs["miles"]), "--out", str(tmp_path / "o1"), "--no-wandb"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "floor: n/a" in line]
    # neither the model nor the GPU known: said once for both verl runs; the W&B run names its model, not its GPU
    assert notes == [
        "note: a, b: floor: n/a (name the model with --model and the device with --device)",
        f"note: {wandb_runs['miles'].name}: floor: n/a (name the device with --device)",
    ]
    assert all(r["update_limit_time_median"] == "" for r in report_csv(tmp_path / "o1"))
    # --model PRESET --device a100: every imported run sized so
    args = [str(verl[0]), "--model", "qwen3_0p6b", "--device", "a100", "--no-wandb"]
    assert main([*args, "--out", str(tmp_path / "o2")]) == 0
    assert "floor: n/a" not in capsys.readouterr().out
    (row,) = report_csv(tmp_path / "o2")
    expected = update_floor(preset_model("qwen3_0p6b"), "a100")["floor_s"]
    assert float(row["update_limit_time_median"]) == pytest.approx(expected)
    assert float(row["update_efficiency_median"]) == pytest.approx(expected / 5.0)
    # --model path/to/config.json: any causal-LM architecture
    config = tmp_path / "m" / "config.json"
    config.parent.mkdir()
    config.write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "vocab_size": 1024,
                "tie_word_embeddings": True,
            }
        )
    )
    args = [str(verl[0]), "--model", str(config), "--device", "h100", "--no-wandb"]
    assert main([*args, "--out", str(tmp_path / "o3")]) == 0
    (row,) = report_csv(tmp_path / "o3")
    expected = update_floor(config_json_model(str(config)), "h100")
    assert float(row["update_limit_time_median"]) == pytest.approx(expected["floor_s"]) and expected["params"] > 0


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--device", "h300"], "--device h300: not a GPU the planner knows (allowed: h200, h100, a100)"),
        (["--model", "qwen9"], "--model qwen9: not a model preset (qwen3_0p6b"),
        (["--model", "missing/config.json"], "--model missing/config.json: no such file"),
    ],
)
def test_a_model_or_device_that_names_nothing_is_one_line(tmp_path, capsys, flags, says):
    from rlsync.report import main

    path = verl_jsonl(tmp_path / "p" / "e.jsonl", [{"timing_s/update_weights": 1.0, "timing_s/step": 9.0}] * 5)
    assert main([str(path), *flags, "--no-wandb", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "model_id, preset",
    [
        ("Qwen/Qwen3-1.7B", "qwen3_1p7b"),
        ("Qwen/Qwen3-8B-Base", "qwen3_8b"),
        ("/models/Qwen3-30B-A3B-Instruct-2507/", "qwen3_30b_a3b"),
        ("Qwen/Qwen3-235B-A22B", "qwen3_235b_a22b"),
        ("meta-llama/Llama-3.1-8B", None),
        ("Qwen/Qwen3-14B", None),
    ],
)
def test_a_hugging_face_id_names_its_preset(model_id, preset):
    from rlsync.report.imported import preset_for

    assert preset_for(model_id) == preset


def test_a_recorded_gpu_names_its_profile():
    from rlsync.report.imported import device_of

    recorded = ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla T4", None)
    assert [device_of(g) for g in recorded] == ["h200", "h100", "a100", None, None]


# ----------------------------------------------------------------------------------------------
# A W&B run path read through wandb's public API: a stand-in API here (no network on this machine)
# ----------------------------------------------------------------------------------------------


class FakeRun:
    """What wandb.Api().run(path) returns, as far as the reader uses it."""

    def __init__(self, path: str, rows: list[dict]):
        self.id = path.rsplit("/", 1)[-1]
        self.config = {"hf_checkpoint": {"value": "Qwen/Qwen3-1.7B"}, "_wandb": {"value": {}}}
        self.metadata = {"gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 8}
        self.rows = rows

    def scan_history(self):
        yield from (dict(r) for r in self.rows)


def fake_api(rows: list[dict], asked: list[str]):
    class FakeApi:
        def run(self, path: str) -> FakeRun:
            asked.append(path)
            return FakeRun(path, rows)

    return FakeApi


def miles_history(n: int, update: float, step: float) -> list[dict]:
    """Miles' keys on rollout/step as scan_history yields them (W&B's _step, _timestamp, _runtime in each row)."""
    rows = []
    for i, (u, s) in enumerate(steps_of(n, update, step)):
        rows.append({"_step": 2 * i, "_timestamp": 1e9 + 60 * i, "rollout/step": i, "perf/update_weights_time": u})
        rows.append({"_step": 2 * i + 1, "_timestamp": 1e9 + 60 * i, "rollout/step": i, "perf/step_time": s})
    return rows


def test_wandb_run_path_through_the_api(tmp_path, monkeypatch, capsys):
    from rlsync.readers.wandb_api import WandbApiReader
    from rlsync.report import main

    asked: list[str] = []
    monkeypatch.setenv("WANDB_MODE", "online")  # the API is asked only when W&B is not offline
    history = WandbApiReader.read(Path("ent/proj/abc123"), api_factory=fake_api(miles_history(8, 3.0, 30.0), asked))
    assert asked == ["ent/proj/abc123"] and history.config == {"hf_checkpoint": "Qwen/Qwen3-1.7B"}
    assert history.device == "NVIDIA H100 80GB HBM3" and history.name == "abc123"
    monkeypatch.setattr(WandbApiReader, "api_factory", fake_api(miles_history(8, 3.0, 30.0), asked))
    a = only(Path("ent/proj/abc123"))
    assert (a.framework, a.history.source, a.measured, a.model) == ("miles", "wandb_api", 6, "Qwen/Qwen3-1.7B")
    assert a.share == pytest.approx(3.03 / 30.0, rel=0.02) and OVER in a.verdict
    # its run URL names the same run; an under-threshold run says so
    monkeypatch.setattr(WandbApiReader, "api_factory", fake_api(miles_history(8, 0.1, 30.0), asked))
    assert UNDER in only(Path("https://wandb.ai/ent/proj/runs/xyz9")).verdict and asked[-1] == "ent/proj/xyz9"
    assert main(["ent/proj/xyz9", "--out", str(tmp_path / "out"), "--no-wandb"]) == 0
    printed = capsys.readouterr().out
    assert "W&B run (API) (Miles / slime)" in printed and "(the run recorded NVIDIA H100 80GB HBM3)" in printed


def test_wandb_run_path_offline_or_without_a_key_is_one_line(tmp_path, monkeypatch, capsys):
    from rlsync.readers.wandb_api import WandbApiReader
    from rlsync.report import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(["ent/proj/abc123", "--no-wandb", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("rlsync.report: ent/proj/abc123: no such file or directory")
    assert "needs the network and an API key (WANDB_API_KEY" in err and "WANDB_MODE=offline" in err

    def no_key():
        import wandb

        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setattr(WandbApiReader, "api_factory", no_key)
    assert main(["ent/proj/abc123", "--no-wandb", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "WANDB_API_KEY" in err and "UsageError: No API key configured" in err
    assert not (tmp_path / "out").exists()
    # a path of another shape is no W&B run: the plain missing path
    refused(tmp_path / "nowhere", "no such file or directory$")
