"""update.payload: one key chooses what each bucket carries, its choices are the payload registry's, the keys it
replaced are refused in one line naming it, each payload class describes itself, and nothing outside the payload
package names a payload (issue 45, item 3)."""

import json
import re
import shutil

import pytest
from conftest import CPU, ROOT, run_main

from rlsync.config.schema import Config, UpdateConfig
from rlsync.config.validate import validate
from rlsync.errors import ConfigError
from rlsync.measure.metrics import declared
from rlsync.record.summary import payload_line
from rlsync.update.payload import (
    Payload,
    payload_class,
    payload_names,
    recorded_class,
    recorded_payload,
    register_payload,
)
from rlsync.update.payload.base import PAYLOADS
from rlsync.update.payload.full import FullPayload

CHOICES = "update.payload=full|delta|fp8|lora|lora_merged"


def test_the_choices_are_the_registrys():
    assert payload_names() == ("full", "delta", "fp8", "lora", "lora_merged")
    assert Config().update.payload == "full"
    with pytest.raises(ConfigError, match=r"^update.payload=nope: not allowed \(allowed: full, delta, fp8, lora"):
        validate(Config(update=UpdateConfig(payload="nope")))


def test_a_payload_registered_outside_rlsync_is_a_choice():
    class Toy(FullPayload):
        name = "toy"
        title = "Toy"

    register_payload("toy", Toy)
    try:
        cfg = Config(update=UpdateConfig(payload="toy"))
        validate(cfg)
        assert payload_class(cfg.update.payload) is Toy and "toy" in payload_names()
    finally:
        del PAYLOADS["toy"]


@pytest.mark.parametrize(
    "old, problem",
    [
        ("update.delta=true", "replaced by update.payload=delta"),
        ("update.wire_dtype=float8_e4m3fn", "replaced by update.payload=fp8"),
        ("update.lora=adapter", "replaced by update.payload=lora"),
        ("update.lora=merged", "replaced by update.payload=lora_merged"),
        ("update.delta=false", "replaced by update.payload=full (its default: drop update.delta)"),
        ("+update.delta=true", "replaced by update.payload=delta"),  # added to the tree: the schema's own check
    ],
)
@pytest.mark.parametrize("module", ["rlsync", "rlsync.bench"])
def test_a_replaced_key_is_refused_in_one_line_naming_the_new_one(tmp_path, old, problem, module):
    proc = run_main(old, f"hydra.run.dir={tmp_path}", module=module)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    key = old.lstrip("+").partition("=")[0]
    assert line.startswith(f"rlsync: config error: {key}="), line
    assert f": {problem} (allowed: {CHOICES} ({key} is no longer read))" in line, line
    assert not list(tmp_path.rglob("*.jsonl")) and not list(tmp_path.rglob("summary.json"))  # nothing ran


def test_a_payload_refuses_what_it_cannot_carry_naming_both_keys():
    """LoRA's payloads need adapters; the others cannot carry them (the default included: a user chooses)."""
    with pytest.raises(ConfigError) as no_rank:
        validate(Config(update=UpdateConfig(payload="lora")))
    assert str(no_rank.value).startswith("update.payload=lora: not allowed with trainer.lora.rank=0 (allowed: ")
    from rlsync.config.schema import LoraConfig, TrainerConfig

    with pytest.raises(ConfigError) as rank:
        validate(Config(trainer=TrainerConfig(lora=LoraConfig(rank=16))))
    assert str(rank.value).startswith("update.payload=full: not allowed with trainer.lora.rank=16 (allowed: ")
    assert "update.payload=lora|lora_merged" in str(rank.value)


def test_each_payload_describes_itself():
    """Its title and key in the closing line, what a verified run says, and metrics the catalogue knows."""
    for name in payload_names():
        cls = payload_class(name)
        assert issubclass(cls, Payload) and cls.name == name and cls.title
        assert cls.key() == f"update.payload={name}" and cls.phrase().startswith(f"{cls.title} (update.payload={name}")
        assert cls.verified.startswith("the ")
        for metric in cls.metrics:
            assert metric in declared(), (name, metric)  # labelled, merged over ranks (rlsync/measure/metrics.py)
        assert bool(cls.metrics) == cls.beside_full
        if cls.after_update_phase:
            assert f"perf/{cls.after_update_phase}_time" in cls.metrics


@pytest.mark.parametrize("name", ["delta", "fp8"])
def test_an_update_adds_the_metrics_its_payload_declares(tiny, name, eager_kernels):
    """Over direct, with the copy probe's bandwidth: the first update's metrics are the full update's and the
    payload's declared ones (a delta's decode of a first, whole, update has a floor to rate)."""
    from rlsync.update import close_update, timed_update

    def metrics_of(payload: str) -> set[str]:
        update = UpdateConfig(payload=payload, bucket_mb=0.05, flat_engine_weights=False)
        weights = tiny.weights(seed=1)
        engine, transport, buckets = tiny.open(update, weights)
        try:
            kw = {"buckets": buckets, "cfg": update, "device": CPU, "floor_time": 1.0, "copy_bandwidth": 1e10}
            return set(timed_update(transport, weights, **kw))
        finally:
            close_update(engine, transport)

    assert metrics_of(name) - metrics_of("full") == set(payload_class(name).metrics)


def test_the_closing_line_is_the_payloads_own_also_for_a_run_recorded_before_the_key():
    stats = {
        "perf/update_weights_full_bytes": {"median": 100.0},
        "perf/update_weights_bytes": {"median": 10.0},
    }
    assert payload_line(stats, "fp8").startswith("FP8 on the wire (update.payload=fp8): ")
    old = payload_line(stats, "lora_adapter")  # setup.payload as recorded before update.payload
    assert old.startswith("LoRA adapters only (update.payload=lora; the first update also sent the base): ")
    assert recorded_class("lora_adapter") is payload_class("lora") and recorded_class("gone") is None
    assert payload_class("fp8").verified == "the same block quantization of the trainer's"


@pytest.mark.parametrize(
    "setup, config, payload",
    [
        ({"payload": "lora_adapter"}, {}, "lora"),  # the name summary.json gave it before
        ({"payload": "delta"}, {}, "delta"),
        ({}, {"update.payload": "fp8"}, "fp8"),
        ({}, {"update.delta": True, "update.wire_dtype": None}, "delta"),
        ({}, {"update.delta": False, "update.wire_dtype": "float8_e4m3fn"}, "fp8"),
        ({}, {"update.lora": "merged", "trainer.lora.rank": 16}, "lora_merged"),
        ({}, {"update.lora": None, "trainer.lora.rank": 16}, "lora"),  # null meant the adapters, with a rank
        ({}, {"update.delta": False}, "full"),
    ],
)
def test_a_run_recorded_before_the_key_reads_its_payload(setup, config, payload):
    assert recorded_payload(setup, config.get) == payload


def test_the_report_reads_runs_recorded_with_the_old_keys(tmp_path):
    """The study's runs (experiments/payloads) recorded LoRA as lora_adapter, and an FP8 run rewritten as runs
    before update.payload recorded it (no setup.payload, update.wire_dtype in its config) is read as fp8."""
    from rlsync.report import write_report

    runs = ROOT / "experiments/payloads/results_cpu/runs"
    older = tmp_path / "older"
    shutil.copytree(runs / "fp8" / "0", older / "0")
    summary = json.loads((older / "0" / "summary.json").read_text())
    assert summary["setup"].pop("payload") == "fp8"
    update = summary["config"]["update"]
    del update["payload"]
    update["wire_dtype"] = "float8_e4m3fn"
    (older / "0" / "summary.json").write_text(json.dumps(summary))
    result = write_report([runs / "lora_vs_full", older], tmp_path / "report", log_wandb=False)
    assert {r["payload"] for r in result.rows} == {"full", "lora", "fp8"}
    assert "lora" in {f.label.rpartition("payload ")[2] for f in result.fits}


# ----------------------------------------------------------------------------------------------
# No module outside the payload package names a payload (the grep of issue 45)
# ----------------------------------------------------------------------------------------------

NAMES = re.compile(r"delta|fp8|lora_merged")  # as `grep -rn "delta\|fp8\|lora_merged" rlsync --include=*.py`
PAYLOAD_PACKAGE = ROOT / "rlsync/update/payload"
# (file, a piece of the line) -> why it may say one of those words
ALLOWED = {
    ("rlsync/config/schema.py", "renamed_keys = dict.fromkeys"): "the keys update.payload replaced, by their old names",
    ("rlsync/config/schema.py", "lora_merged: W + alpha/rank*BA"): "update.payload's line in --help: its choices",
    ("rlsync/trainer/grpo.py", "delta"): "the KL estimator's log-prob difference",
    ("rlsync/model/lora.py", "delta"): "the adapters' contribution s*BA in the merge error (PEFT's LoRA)",
}


def payload_words_outside_the_package() -> list[str]:
    found = []
    for path in sorted((ROOT / "rlsync").rglob("*.py")):
        if PAYLOAD_PACKAGE in path.parents:
            continue
        rel = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not NAMES.search(line.replace("timedelta", "")):  # datetime's
                continue
            if not any(rel == f and piece in line for f, piece in ALLOWED):
                found.append(f"{rel}:{number}: {line.strip()}")
    return found


def test_no_module_outside_the_payload_package_names_a_payload():
    assert payload_words_outside_the_package() == []


def test_the_names_are_found_where_they_live():
    """The search itself finds them: in the payload package, and in an allowed line."""
    inside = [p for p in PAYLOAD_PACKAGE.rglob("*.py") if NAMES.search(p.read_text())]
    assert len(inside) >= 3
    schema = (ROOT / "rlsync/config/schema.py").read_text()
    assert any(NAMES.search(line) for line in schema.splitlines() if "renamed_keys = dict.fromkeys" in line)


def test_the_engine_side_rules_are_asked_of_the_engine_class():
    """What a payload needs of the engine is the engine class's declaration, not its name."""
    from rlsync.engines.base import Engine, engine_class

    assert engine_class("hf").holds_flat_weights and engine_class("hf").takes_adapters
    assert not Engine.takes_adapters
