"""The engine registry in a fresh interpreter: rlsync's run modules import no engine's dependency."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, CountingEngine, cli_env, run_in_process


@pytest.mark.slow  # what a fresh interpreter imports
def test_the_registry_and_the_run_modules_import_no_engine_dependency():
    """vLLM is imported when its engine starts, not when rlsync (or the vLLM engine's class) is loaded."""
    code = (
        "import sys, rlsync.run.loop, rlsync.config.validate, rlsync.serve, rlsync.bench\n"
        "from rlsync.engines.base import engine_class\n"
        "assert engine_class('vllm').__name__ == 'VLLMEngine'\n"
        "print(sorted(m for m in ('vllm', 'rlsync.engines.vllm') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[-2] == "['rlsync.engines.vllm']"


def test_a_registered_engine_runs_in_an_engine_process_too(counting, tmp_path):
    """The engine process never ran this file's registration: the spec carries the engine's class there."""
    rows, summary = run_in_process(
        tmp_path, f"rollout.engine={counting}", "update.verify=true", "update.transport=ipc", "run.steps=2"
    )
    assert summary["status"] == "finished" and summary["verification"] == "passed"
    assert len(rows) == 2
    assert CountingEngine.generate_calls == 0  # it generated in the engine process, not here
