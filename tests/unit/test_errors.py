"""Bad input gets one line on stderr and exit 2, before any model is built; faults cost one line, never files.

The CLI cases run through the entry points in this process, all at once (each stops before building a
model, so they are cheap), then each parametrized test reads its own result; a few run as real
`python -m` processes too (tests/process/test_errors.py).
"""

from __future__ import annotations

import errno
import json
import os
import signal
from typing import Optional

import pytest
import torch
from conftest import FAST, ROOT, check_one_line, run_main

from rlsync.config.apps import BenchAppConfig, EngineAppConfig
from rlsync.config.rules import ANY, Choices, Rule
from rlsync.config.schema import Config, UpdateConfig
from rlsync.config.validate import leaves, validate
from rlsync.errors import ConfigError, Interrupted, StopOnSignals, UpdateOutOfMemory
from rlsync.shell import JobFailed, job_errors

CUDA = torch.cuda.is_available()

# (overrides, what the line must name): every kind of bad input the runner rejects, one case each.
BAD_INPUTS = [
    (["model=qwen9"], "model=qwen9"),  # unknown group choice (Hydra)
    (["run.stepz=3"], "run.stepz=3"),  # unknown key (Hydra)
    (["+foo=1"], "foo=1"),  # unknown key added with + (the schema check)
    (["run.steps=abc"], "run.steps=abc"),  # wrong type (Hydra)
    (["update.bucket_mb=0"], "update.bucket_mb=0"),
    (["run.steps=0"], "run.steps=0"),
    (["rollout.samples_per_prompt=1"], "rollout.samples_per_prompt=1"),
    (["rollout.max_response_len=0"], "rollout.max_response_len=0"),
    (["rollout.temperature=-0.5"], "rollout.temperature=-0.5"),
    (["run.steps=3", "run.warmup_steps=3"], "run.warmup_steps=3"),
    (["update.transport=pigeon"], "update.transport=pigeon"),
    (["update.strategy=zip"], "update.strategy=zip"),
    (["update.source=disk"], "update.source=disk"),
    (["update.inflight_buckets=3"], "update.inflight_buckets=3"),
    (["trainer.offload=sometimes"], "trainer.offload=sometimes"),
    (["rollout.engine=sglang"], "rollout.engine=sglang"),
    (["rollout.dtype=int8"], "rollout.dtype=int8"),
    (["wandb.mode=loud"], "wandb.mode=loud"),
    (["model.pretrained=/no/such/checkpoint"], "model.pretrained=/no/such/checkpoint"),
    (["run.device=cuda:99"], "run.device=cuda:99"),
    (["update.engine_address=enginehost"], "update.engine_address=enginehost"),  # no port
    (["update.engine_address=127.0.0.1:29610"], "update.transport=direct"),  # a standalone engine needs broadcast
    (["update.bucket_mb=1e-9"], "update.bucket_mb=1e-09"),  # rounds to 0 bytes
    (["update.bucket_mb=1e20"], "update.bucket_mb=1e+20"),  # over 2^63 bytes
    (["trainer.offload_segment_mb=1e-9"], "trainer.offload_segment_mb=1e-09"),
    (["run.seed=18446744073709551616"], "run.seed=18446744073709551616"),  # 2^64
    (["wandb.project=team/rlsync"], "wandb.project=team/rlsync"),
    ([f"wandb.tags=[ok,{'x' * 65}]"], "wandb.tags=[ok,xxxx"),
    pytest.param(
        ["run.device=cuda"],
        "run.device=cuda",
        marks=pytest.mark.skipif(CUDA, reason="this machine has CUDA: run.device=cuda is valid"),
    ),
]
# The benchmark calls the same checks (rlsync.config.validate.checked_config): one case per layer, plus its own keys.
BENCH_BAD_INPUTS = [
    (["model=qwen9"], "model=qwen9"),
    (["update.bucket_mb=0"], "update.bucket_mb=0"),
    (["bench.repeats=0"], "bench.repeats=0"),
]
# The standalone engine (python -m rlsync.serve) too, with its own key.
ENGINE_BAD_INPUTS = [
    (["model=qwen9"], "model=qwen9"),
    (["serve.sessions=-1"], "serve.sessions=-1"),
    (["update.engine_address=host:99999"], "update.engine_address=host:99999"),
]
# More Hydra-side errors, translated in-process (the same `from_hydra` the CLI calls): override -> line start.
HYDRA_ERRORS = [
    ("update.verify=maybe", "update.verify=maybe: wrong type (allowed: true or false)"),
    ("wandb.tags=x", "wandb.tags=x: wrong type (allowed: a list such as [a,b])"),
    ("model.hidden_size=1.5", "model.hidden_size=1.5: wrong type (allowed: an integer)"),
    ("run.steps=[1", "run.steps=[1: cannot parse"),
    ("update=fast", "update=fast: unknown"),
    ("rollout=huge", "rollout=huge: unknown choice (allowed: reference, short"),
    ("run.seeds=1", "run.seeds=1: unknown key (allowed: steps, warmup_steps, seed"),
]


def case_id(case) -> str:
    values = case.values if hasattr(case, "values") else case
    return " ".join(values[0])


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    """Every bad-input case of the three entry points, each through its entry point in this process
    (each stops before building a model): (module, overrides) -> CompletedProcess."""
    cases = (
        [("rlsync", c) for c in BAD_INPUTS]
        + [("rlsync.bench", c) for c in BENCH_BAD_INPUTS]
        + [("rlsync.serve", c) for c in ENGINE_BAD_INPUTS]
    )
    cases = [(m, list((c.values if hasattr(c, "values") else c)[0])) for m, c in cases]
    root = tmp_path_factory.mktemp("bad_inputs")
    return {
        (m, tuple(o)): run_main("wandb.mode=disabled", f"hydra.run.dir={root / str(i)}", *o, module=m)
        for i, (m, o) in enumerate(cases)
    }


@pytest.mark.parametrize("overrides,names", BAD_INPUTS, ids=[case_id(c) for c in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(cli_results, overrides, names):
    check_one_line(cli_results[("rlsync", tuple(overrides))], names)


@pytest.mark.parametrize("overrides,names", BENCH_BAD_INPUTS, ids=[case_id(c) for c in BENCH_BAD_INPUTS])
def test_bench_bad_input_is_one_line_and_exit_2(cli_results, overrides, names):
    check_one_line(cli_results[("rlsync.bench", tuple(overrides))], names)


@pytest.mark.parametrize("overrides,names", ENGINE_BAD_INPUTS, ids=[case_id(c) for c in ENGINE_BAD_INPUTS])
def test_engine_bad_input_is_one_line_and_exit_2(cli_results, overrides, names):
    check_one_line(cli_results[("rlsync.serve", tuple(overrides))], names)


def test_the_lines_say_what_is_allowed(cli_results):
    line = cli_results[("rlsync", ("model=qwen9",))].stderr
    assert "qwen3_0p6b" in line and "tiny" in line
    assert "steps, warmup_steps" in cli_results[("rlsync", ("run.stepz=3",))].stderr
    assert "an integer" in cli_results[("rlsync", ("run.steps=abc",))].stderr
    assert "direct" in cli_results[("rlsync", ("update.transport=pigeon",))].stderr
    assert "0 to run.steps - 1 = 2" in cli_results[("rlsync", ("run.steps=3", "run.warmup_steps=3"))].stderr


def test_debug_switch_shows_the_traceback(tmp_path):
    result = run_main("wandb.mode=disabled", f"hydra.run.dir={tmp_path}", "update.bucket_mb=0", RLSYNC_DEBUG="1")
    assert result.returncode == 2
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("rlsync: config error: update.bucket_mb=0")


# ----------------------------------------------------------------------------------------------
# The rules themselves, without a subprocess
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override,line", HYDRA_ERRORS, ids=[o for o, _ in HYDRA_ERRORS])
def test_hydra_errors_become_one_config_error(override, line):
    from hydra import compose, initialize_config_dir

    from rlsync.config.compose import register_configs
    from rlsync.errors import from_hydra

    register_configs()

    with pytest.raises(Exception) as caught, initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        compose(config_name="config", overrides=[override])
    error = from_hydra(caught.value)
    assert isinstance(error, ConfigError) and error.exit_code == 2
    assert str(error).startswith(line), str(error)
    assert "\n" not in str(error)


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["+update.speed=2"], "update.speed=2: unknown key"),
        (["update.bucket_mb=-1"], "update.bucket_mb=-1.0: out of range (allowed: a number of MiB from 9.54e-07"),
        (["update.bucket_mb=nan"], "update.bucket_mb=nan: not allowed"),
        (["update.bucket_mb=inf"], "update.bucket_mb=inf: not allowed"),
        (["model.num_key_value_heads=3"], "model.num_key_value_heads=3: not allowed (allowed: a divisor of"),
        (["model.vocab_size=100"], "model.vocab_size=100: out of range"),
        (["update.source=host", "trainer.offload=none"], "update.source=host: not allowed with trainer.offload=none"),
        (["rollout.max_response_len=50000"], "rollout.max_response_len=50000: out of range"),
        (["run.verdict_threshold=1.5"], "run.verdict_threshold=1.5: out of range"),
        (["wandb.project=''"], "wandb.project='': not allowed"),
        (["wandb.init_timeout=0"], "wandb.init_timeout=0.0: out of range"),
        (
            ["update.bucket_mb=1e-7"],
            "update.bucket_mb=1e-07: out of range (allowed: a number of MiB from 9.54e-07 (1 byte) "
            "to 8.8e+12 (2^63 - 1 bytes) (the bucket's size))",
        ),
        (
            ["update.bucket_mb=1e13"],
            "update.bucket_mb=10000000000000.0: out of range (allowed: a number of MiB from 9.54e-07",
        ),
        (
            ["trainer.offload_segment_mb=0.0000001"],
            "trainer.offload_segment_mb=1e-07: out of range (allowed: a number of MiB from 9.54e-07",
        ),
        (
            ["run.seed=18446744073709551616"],
            "run.seed=18446744073709551616: out of range (allowed: 0 to 2^64 - 1 = 18446744073709551615",
        ),
        (["run.seed=-1"], "run.seed=-1: out of range"),
        (
            ["wandb.project=a:b"],
            "wandb.project=a:b: not allowed (allowed: a non-empty name of at most 128 characters, "
            "without any of / \\ # ? % : (W&B refuses them))",
        ),
        ([f"wandb.project={'p' * 129}"], f"wandb.project={'p' * 129}: not allowed"),
        (
            [f"wandb.tags=[{'t' * 65}]"],
            f"wandb.tags=[{'t' * 65}]: not allowed (allowed: a list of tags of 1 to 64 characters each (W&B's limit))",
        ),
        (["wandb.tags=['']"], "wandb.tags=['']: not allowed"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_more_value_rules(overrides, line):
    from hydra import compose, initialize_config_dir

    from rlsync.config.compose import register_configs
    from rlsync.config.validate import checked_config

    register_configs()

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        dcfg = compose(config_name="config", overrides=overrides)
    with pytest.raises(ConfigError) as caught:
        checked_config(dcfg)
    assert str(caught.value).startswith(line), str(caught.value)


def test_the_largest_seed_and_smallest_sizes_pass():
    cfg = Config()
    cfg.run.seed, cfg.update.bucket_mb, cfg.trainer.offload_segment_mb = 2**64 - 1, 1 / 2**20, 1 / 2**20
    validate(cfg)
    torch.Generator().manual_seed(cfg.run.seed)  # the bound is torch's: one more does not fit
    with pytest.raises((RuntimeError, ValueError), match="Overflow"):
        torch.Generator().manual_seed(2**64)
    cfg.wandb.tags = ["t" * 64]
    validate(cfg)


def test_every_key_a_user_can_set_has_a_rule():
    """Each leaf of every entry point's schema declares its value rule beside it (`key(default, rule)` in
    rlsync/config/schema.py; `ANY` says so explicitly), so a key cannot be added without one."""
    for schema in (Config, BenchAppConfig, EngineAppConfig):
        missing = [key for key, _, _, rule in leaves(schema()) if not isinstance(rule, (Rule, Choices))]
        assert missing == [], (
            f"{schema.__name__} keys without a rule: use key(default, rule) in rlsync/config/schema.py"
        )
    # ANY only where the type says everything (a switch): a number or a name always has a range or choices
    anything = [(key, hint) for key, _, hint, rule in leaves(BenchAppConfig()) if rule is ANY]
    assert anything and all(hint in (bool, Optional[bool]) for _, hint in anything), anything


def test_choices_are_looked_up_when_checked(monkeypatch):
    """A choice an implementation owns is named by import path and resolved at check time: the schema imports
    nothing above it, and a name the implementation gains later is accepted."""
    from rlsync.update.base import TRANSPORTS

    rule = next(rule for key, _, _, rule in leaves(Config()) if key == "update.transport")
    assert isinstance(rule, Choices) and rule.allowed == ", ".join(TRANSPORTS) and not rule.ok("pigeon")
    monkeypatch.setitem(TRANSPORTS, "pigeon", "nowhere:Pigeon")  # removed again after the test
    assert rule.ok("pigeon") and rule.allowed.endswith(", pigeon")


PRESETS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize(
    "overrides",
    [[], ["model=qwen3_0p6b"], ["model=qwen3_8b"], ["rollout=reference"], ["run.steps=2", "run.warmup_steps=1"]]
    + [[f"experiment={name}"] for name in PRESETS],
    ids=lambda o: " ".join(o) or "defaults",
)
def test_the_shipped_configs_pass(compose, overrides):
    validate(compose(*overrides))


def test_a_tree_built_in_code_is_type_checked_too():
    cfg = Config()
    cfg.run.steps = "3"
    with pytest.raises(ConfigError, match=r"run.steps=3: wrong type \(allowed: an integer\)"):
        validate(cfg)
    cfg = Config()
    cfg.update.verify = 1
    with pytest.raises(ConfigError, match="update.verify=1: wrong type"):
        validate(cfg)


def test_an_existing_checkpoint_directory_passes(tmp_path):
    cfg = Config()
    cfg.model.pretrained = str(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        validate(cfg)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no tokenizer files in that directory"):
        validate(cfg)
    (tmp_path / "tokenizer.json").write_text("{}")  # what the rollouts sample with
    validate(cfg)


# ----------------------------------------------------------------------------------------------
# Faults: out of memory in the update, errors inside a job, signals, W&B
# ----------------------------------------------------------------------------------------------


def test_out_of_memory_in_the_update_names_the_bucket_size(monkeypatch, capsys, tmp_path, tiny):
    from rlsync.update import close_update, flat, timed_update

    update = UpdateConfig(bucket_mb=0.05)
    weights = tiny.weights()
    engine, transport, buckets = tiny.open(update, weights)
    timed_update(transport, weights, buckets=buckets, cfg=update, device=torch.device("cpu"), floor_time=1.0)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    monkeypatch.setattr(flat, "pack", out_of_memory)
    with pytest.raises(UpdateOutOfMemory) as caught:
        timed_update(transport, weights, buckets=buckets, cfg=update, device=torch.device("cpu"), floor_time=1.0)
    close_update(engine, transport)
    message = str(caught.value)
    assert "update.bucket_mb=0.05" in message and "smaller update.bucket_mb" in message
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)

    with pytest.raises(SystemExit) as exited, job_errors(tmp_path):
        raise caught.value
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlsync: out of device memory during the weight update")


def test_a_failed_job_is_one_line_and_keeps_its_traceback_in_the_run_dir(capsys, tmp_path):
    with pytest.raises(SystemExit) as exited, job_errors(tmp_path):
        raise RuntimeError("the engine exploded\nsecond line of detail")
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rlsync: failed: RuntimeError: the engine exploded"]
    log = (tmp_path / "error.log").read_text()
    assert "Traceback" in log and log.strip().endswith("Error: failed: RuntimeError: the engine exploded")


def test_a_failed_sweep_job_lets_hydra_go_on(capsys, tmp_path):
    with pytest.raises(JobFailed) as failed, job_errors(tmp_path, sweep_job="3"):
        raise ValueError("bad")
    assert failed.value.exit_code == 1
    assert capsys.readouterr().err.strip() == "rlsync: job 3: failed: ValueError: bad"


@pytest.mark.parametrize(
    "sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)], ids=["SIGTERM", "SIGINT", "SIGHUP"]
)
def test_a_signal_stops_the_step_but_never_a_record_in_progress(sig, code):
    before = signal.getsignal(sig)
    recorded = []
    with pytest.raises(Interrupted) as caught, StopOnSignals() as stop:
        with stop.deferred():
            os.kill(os.getpid(), sig)
            recorded.append("the whole row")
        recorded.append("the next step")  # never reached
    assert recorded == ["the whole row"]
    assert caught.value.exit_code == code and str(caught.value) == f"stopped by {sig.name}"
    assert signal.getsignal(sig) is before  # handlers restored

    with pytest.raises(Interrupted), StopOnSignals():  # outside a record: at once
        os.kill(os.getpid(), sig)
        recorded.append("the rest of the step")
    assert recorded == ["the whole row"]


def test_an_interrupted_job_exits_128_plus_the_signal(capsys, tmp_path):
    with pytest.raises(SystemExit) as exited, job_errors(tmp_path, sweep_job="0"):  # a sweep stops as a whole
        raise Interrupted(signal.SIGINT)
    assert exited.value.code == 130
    with pytest.raises(SystemExit) as exited, job_errors(tmp_path):
        raise KeyboardInterrupt  # Ctrl-C before the run installed its handlers
    assert exited.value.code == 130
    assert capsys.readouterr().err.splitlines() == [
        "rlsync: job 0: interrupted: stopped by SIGINT",
        "rlsync: interrupted: stopped by SIGINT",
    ]


def test_a_failed_verification_is_said_in_the_summary_and_the_closing_table(tmp_path, capsys):
    from rlsync.record.recorder import Recorder
    from rlsync.run.loop import Experiment, print_closing
    from rlsync.update import WeightMismatch

    cfg = Config()
    cfg.run.steps, cfg.run.warmup_steps, cfg.update.verify = 4, 1, True
    recorder = Recorder(tmp_path)
    experiment = Experiment(cfg, recorder)
    recorder.rows = [
        {"step": s, "perf/step_time": 1.0 + s, "perf/update_weights_time": 0.1, "perf/update_weights_buckets": 2}
        for s in range(3)
    ]
    recorder.status, recorder.failure = "failed", WeightMismatch("engine tensor 'lm_head.weight' differs")
    summary = experiment.summary()
    recorder.write_summary(summary)
    assert summary["verification"] == "failed"
    assert "verification failed at step 3" in summary["warning"] and "only 2 of 3" in summary["warning"]
    assert json.loads((tmp_path / "summary.json").read_text())["verification"] == "failed"
    print_closing(summary)
    out = capsys.readouterr().out
    assert "Measured steps: 2 of 3, failed" in out and "WARNING: " in out and "verification failed" in out

    recorder.status, recorder.failure = "finished", None
    assert experiment.summary()["verification"] == "passed"
    cfg.update.verify = False
    assert experiment.summary()["verification"] == "off"


def test_out_of_memory_while_opening_the_engine_names_the_bucket_size_too(monkeypatch):
    import rlsync.run.loop as experiment
    import rlsync.update.side as side
    from rlsync.update import is_out_of_memory

    def out_of_memory(*args, **kwargs):  # the staging buffers are allocated when the engine opens
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")

    monkeypatch.setattr(side, "open_update", out_of_memory)
    with pytest.raises(UpdateOutOfMemory, match=r"opening the engine and its update buffers with update.bucket_mb=512"):
        experiment.Experiment(Config()).setup()
    # an engine process's OOM arrives as its own error type, named in the first line
    assert is_out_of_memory(
        RuntimeError(
            "the engine process failed during 'update': torch.OutOfMemoryError: CUDA out of memory\nTraceback ..."
        )
    )
    assert not is_out_of_memory(RuntimeError("the engine process failed during 'update': KeyError\nOutOfMemoryError"))


# ----------------------------------------------------------------------------------------------
# model.pretrained whose architecture is not the model.* keys'
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    """A Qwen3 checkpoint saved here (nothing downloaded): 2 layers, hidden 64, not the tiny preset's 4 x 256.

    Its weights file is then overwritten with garbage: a run that loaded it would fail differently,
    so a refusal naming the keys proves the check came before any weight was read."""
    from transformers import Qwen3ForCausalLM

    from rlsync.config.schema import ModelConfig
    from rlsync.model.build import hf_config

    cfg = ModelConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=512,
    )
    path = tmp_path_factory.mktemp("checkpoint")
    Qwen3ForCausalLM(hf_config(cfg)).save_pretrained(path)
    weights = next(path.glob("*.safetensors"))
    weights.write_bytes(b"not a safetensors file")
    (path / "tokenizer.json").write_text("{}")  # validation asks for the tokenizer's files, not their contents
    return path, cfg


def test_a_checkpoint_of_another_architecture_is_refused_naming_the_keys(small_checkpoint, tmp_path):
    path, _ = small_checkpoint
    result = run_main("wandb.mode=disabled", f"hydra.run.dir={tmp_path}", f"model.pretrained={path}")
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr
    line = lines[0]
    assert line.startswith(f"rlsync: config error: model.pretrained={path}: its architecture differs (")
    for key, theirs, ours in [
        ("hidden_size", 64, 256),
        ("intermediate_size", 128, 512),
        ("num_hidden_layers", 2, 4),
        ("num_attention_heads", 2, 4),
        ("num_key_value_heads", 1, 2),
        ("head_dim", 32, 64),
    ]:
        assert f"{key}={theirs} in the checkpoint but model.{key}={ours}" in line
        assert f"model.{key}={theirs}" in line.split("allowed: ")[1]  # the overrides that fix it
    assert "vocab_size" not in line  # equal keys are not named
    assert not (tmp_path / "metrics.jsonl").exists()


def test_build_model_checks_the_checkpoint_before_loading_weights(small_checkpoint):
    """A hub id's config.json is only seen when it arrives: build_model checks it before the weights."""
    from rlsync.model.build import build_model

    path, cfg = small_checkpoint
    wrong = Config().model
    wrong.pretrained = str(path)
    with pytest.raises(ConfigError, match="its architecture differs"):
        build_model(wrong, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    right = Config().model
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    ):
        setattr(right, key, getattr(cfg, key))
    right.pretrained = str(path)
    validate(Config(model=right))  # matching keys pass; the engine is then built from the same architecture
    with pytest.raises(Exception) as caught:  # and only then are the (garbage) weights read
        build_model(right, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    assert not isinstance(caught.value, ConfigError)


def test_a_checkpoint_of_another_model_type_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 256}))
    cfg = Config()
    cfg.model.pretrained = str(tmp_path)
    with pytest.raises(ConfigError, match="model.pretrained=.*: its config.json has model_type=llama"):
        validate(cfg)


# ----------------------------------------------------------------------------------------------
# Signals from the first instant; what the system refused (disk, memory, processes), named
# ----------------------------------------------------------------------------------------------


def swallowing_checked_config(monkeypatch, sig: int, *, swallow: bool) -> None:
    """The runner's validation sends `sig` to this process, as a Ctrl-C during Hydra's or torch's start would
    arrive; `swallow`: library code on the way catches the KeyboardInterrupt and goes on (G01: a run that ran
    all its steps after a Ctrl-C)."""
    import rlsync.__main__ as entry

    real = entry.checked_config

    def checked(dcfg):
        try:
            os.kill(os.getpid(), sig)
        except KeyboardInterrupt:
            if not swallow:
                raise
        return real(dcfg)

    monkeypatch.setattr(entry, "checked_config", checked)


def test_a_signal_before_the_run_is_one_line_and_128_plus_it(monkeypatch, tmp_path):
    swallowing_checked_config(monkeypatch, signal.SIGINT, swallow=False)
    before = signal.getsignal(signal.SIGTERM)
    proc = run_main("wandb.mode=disabled", *FAST, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "rlsync: interrupted: stopped by SIGINT before the run started"
    assert not (tmp_path / "metrics.jsonl").exists()
    assert signal.getsignal(signal.SIGTERM) is before  # this process's handlers back once the command ended


def test_a_signal_swallowed_on_the_way_still_stops_the_run(monkeypatch, tmp_path):
    swallowing_checked_config(monkeypatch, signal.SIGINT, swallow=True)
    proc = run_main("wandb.mode=disabled", *FAST, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 130, proc.stdout[-2000:] + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"rlsync: interrupted: stopped by SIGINT; 0 finished step(s) kept in {tmp_path} (summary.json status interrupted)"
    )
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "interrupted"


def test_sigusr1_stops_a_run_as_sigterm_does_unless_something_else_claimed_it():
    from rlsync.errors import stop_signals

    assert signal.SIGUSR1 in stop_signals() and signal.SIGQUIT not in stop_signals()
    with pytest.raises(Interrupted) as caught, StopOnSignals():
        os.kill(os.getpid(), signal.SIGUSR1)
    assert caught.value.exit_code == 128 + signal.SIGUSR1 and str(caught.value) == "stopped by SIGUSR1"
    before = signal.signal(signal.SIGUSR2, lambda *_: None)  # a launcher's own (submitit requeues on SIGUSR2)
    try:
        assert signal.SIGUSR2 not in stop_signals()
    finally:
        signal.signal(signal.SIGUSR2, before)


@pytest.fixture
def file_size_limit():
    """This process may write files of at most 1 KiB (ulimit -f 1): a write past it fails with EFBIG."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_write_past_the_file_size_limit_names_the_file(capsys, tmp_path, file_size_limit):
    target = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as exited, job_errors(tmp_path / "run"):
        target.write_text("x" * 4096)  # the OSError names no file: the line still does
    assert exited.value.code == 1
    assert capsys.readouterr().err.strip() == (
        f"rlsync: cannot write {target}: the file is too large for this file system or its size limit "
        f"(ulimit -f) (File too large)"
    )


def test_the_planner_past_the_file_size_limit_names_the_file(tmp_path, file_size_limit):
    proc = run_main("wandb.mode=disabled", f"hydra.run.dir={tmp_path}", module="rlsync.plan")
    assert proc.returncode == 1, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("rlsync:")]
    assert line.startswith(f"rlsync: cannot write {tmp_path}/") and "(ulimit -f)" in line, line
    assert not (tmp_path / "plan.tmp").exists()


def test_out_of_memory_while_importing_is_not_a_bad_config(tmp_path, monkeypatch):
    """M07: under `ulimit -v` a library's shared object cannot be mapped; Hydra reports the callback it was
    importing as "Error locating target" (was: exit 2, "bad config")."""
    from hydra.utils import instantiate

    from rlsync.errors import exit_code, translate

    pkg = tmp_path / "mappedlib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise ImportError('libgfortran.so.5: failed to map segment from shared object')\nclass Thing: pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(Exception) as caught:
        instantiate({"_target_": "mappedlib.Thing"})
    shown = translate(caught.value)
    assert exit_code(shown) == 1
    assert str(shown).startswith(
        "out of memory while importing mappedlib (ImportError: libgfortran.so.5: failed to map segment from shared "
        "object): "
    )


def test_a_thread_that_cannot_start_names_the_process_limit(monkeypatch):
    import resource

    from rlsync.errors import translate

    monkeypatch.setattr(resource, "getrlimit", lambda which: (40, 40))
    try:
        raise RuntimeError("the engine failed") from RuntimeError("Resource temporarily unavailable")
    except RuntimeError as err:
        shown = translate(err)
    assert str(shown) == (
        "cannot start a thread or process (RuntimeError: Resource temporarily unavailable): this user may run 40 "
        "processes and threads (ulimit -u 40): raise the limit or stop some"
    )
    assert translate(BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")) is None  # a socket's


def test_rlsyncs_own_callback_failing_to_import_is_a_failure_not_bad_config():
    """A broken import inside rlsync (not the user's input) behind Hydra's 'Error locating target' is exit 1."""
    from hydra.errors import InstantiationException

    from rlsync.errors import RlsyncError, translate

    try:
        try:
            raise ImportError("cannot import name 'X' from 'rlsync.report.rows'")
        except ImportError as inner:
            raise InstantiationException(
                "Error locating target 'rlsync.report.sweep_callback.SweepReport', set env var HYDRA_FULL_ERROR=1"
            ) from inner
    except InstantiationException as err:
        line = translate(err)
    assert type(line) is RlsyncError and line.exit_code == 1
    assert str(line) == (
        "failed: rlsync's own rlsync.report.sweep_callback.SweepReport could not be loaded: "
        "ImportError: cannot import name 'X' from 'rlsync.report.rows'"
    )
