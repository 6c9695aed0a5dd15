"""Shared helpers: run the real CLI in this process (run_main) or as a subprocess (run_cli), compose the
real Hydra config.

Two tiers: `pytest -m "not slow"` runs in-process (pure functions, and the real entry points through
run_main with real Hydra composition); tests marked `slow` start real processes (CLI smoke tests,
signals, data-parallel launches, engine processes, the standalone engine server, wheel installs) or
run a whole calibration.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
]


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
    """`python -m <module> *args` in a new interpreter: for the slow tier only (the unit tier calls run_main)."""
    assert _in_slow_test[0], "run_cli starts an interpreter: mark the test slow, or call run_main (in this process)"
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
        os.environ.clear()
        os.environ.update(environ if environ is not None else cli_env(**env))
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
        os.environ.clear()
        os.environ.update(saved_env)
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


@pytest.fixture(scope="session")
def registered_schemas() -> None:
    """The schemas in Hydra's ConfigStore, once per process (as each entry point registers them on import)."""
    from rlsync.config.compose import register_configs

    register_configs()


@pytest.fixture
def compose(registered_schemas):
    """compose(*overrides) -> typed Config, through the real conf/ and schema."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rlsync.config.compose import to_config

    def _compose(*overrides: str):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return to_config(hydra_compose(config_name="config", overrides=list(overrides)))

    return _compose


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
        """(transport, bucket plan): the engine behind `update`'s transport, planned for `weights`."""
        import torch

        from rlsync.update import open_transport, plan_for

        buckets = plan_for(weights, update, engine_dtype or torch.bfloat16)
        return open_transport(update, spec=spec or self.spec(), buckets=buckets), buckets


@pytest.fixture(scope="session")
def tiny() -> Tiny:
    """The tiny model, its engine spec and transports (Tiny)."""
    return Tiny()
