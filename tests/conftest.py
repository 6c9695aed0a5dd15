"""Shared helpers: run the real CLI as a subprocess, compose the real Hydra config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Small enough for seconds on two cores, large enough for two measured steps.
FAST = ["run.steps=3", "run.warmup_steps=1", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "rollout.max_response_len=8", "run.progress=false"]


def cli_env(**extra) -> dict:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": str(ROOT),
           "HYDRA_FULL_ERROR": "0", **extra}
    return env


def run_cli(*args: str, module: str = "rlsync", timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=cli_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def compose():
    """compose(*overrides) -> typed Config, through the real conf/ and schema."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rlsync.config import register_configs, to_config

    register_configs()

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
