"""The memory fit check: parameter counts from the config alone, the estimate's arithmetic, the
refusal before any model is built, and the estimate against the measured peak of a real run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import FAST, cli_env, read_jsonl, run_cli, run_main

from rlsync.config.schema import Config
from rlsync.measure import memory as memory_use
from rlsync.run import memory_check as memory

QWEN3_0P6B_PARAMS = 596_049_920  # Qwen/Qwen3-0.6B's published count, the tied embedding once


def model_cfg(compose, name: str):
    return compose(f"model={name}").model


@pytest.mark.parametrize("name", ["tiny", "qwen3_0p6b", "qwen3_1p7b"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_parameter_shapes_are_the_models_own(compose, name, tied):
    """The analytic shapes are what transformers builds (on the meta device: nothing allocated)."""
    from transformers import Qwen3ForCausalLM

    from rlsync.model.build import hf_config

    cfg = model_cfg(compose, name)
    cfg.tie_word_embeddings = tied
    with torch.device("meta"):
        model = Qwen3ForCausalLM(hf_config(cfg))
    built = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # tied weights once
    assert memory.param_shapes(cfg) == built
    assert memory.param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_qwen3_0p6b_byte_counts(compose):
    cfg = compose("model=qwen3_0p6b", "update.bucket_mb=512")
    assert memory.param_count(cfg.model) == QWEN3_0P6B_PARAMS
    est = memory.estimate(cfg, cuda=False, runtime_bytes=0)
    # fp32 AdamW: weights, grads and two moments, 4 bytes each; the engine's copy in bf16
    assert est.process["trainer_state"] == QWEN3_0P6B_PARAMS * 16
    assert est.process["engine_weights"] == QWEN3_0P6B_PARAMS * 2
    # move offload on a CPU (128 MiB segments): one spare per segment size: the packed size and the
    # tied embedding in fp32 (151936 x 1024 x 4 bytes), the one tensor over the cap
    embedding = 151936 * 1024 * 4
    assert embedding < est.process["offload_extra"] < embedding + 2 * 128 * 2**20
    # the update's staging: the largest bucket, at most 512 MiB unless one tensor is larger
    assert est.process["staging"] <= 512 * 2**20
    bf16 = Config()
    bf16.model, bf16.trainer.dtype = cfg.model, "bfloat16"
    assert memory.estimate(bf16, cuda=False, runtime_bytes=0).process["trainer_state"] == QWEN3_0P6B_PARAMS * 8


def test_twin_offload_keeps_the_whole_travelling_state_beside_it(compose):
    cfg = compose("model=qwen3_0p6b", "trainer.offload_memory=twin", "trainer.offload=drop_grads")
    est = memory.estimate(cfg, cuda=False, runtime_bytes=0)
    assert est.process["offload_extra"] == QWEN3_0P6B_PARAMS * 12  # weights and moments travel, grads stay


def test_a_separate_engine_process_is_counted_on_the_host(compose):
    est = memory.estimate(compose("update.transport=ipc"), cuda=False, runtime_bytes=100)
    assert "engine_weights" not in est.process and est.engine_process["engine_weights"] > 0
    assert est.host_bytes == est.process_bytes + sum(est.engine_process.values())


def test_a_run_that_cannot_fit_is_refused_naming_what_to_change(compose, monkeypatch):
    cfg = compose("model=qwen3_1p7b", "update.bucket_mb=512")
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 20 * 2**30)  # a 24 GiB machine's MemAvailable
    with pytest.raises(memory.DoesNotFit) as caught:
        memory.check_fits(cfg, torch.device("cpu"))
    line = str(caught.value)
    assert caught.value.exit_code == 2 and "\n" not in line
    assert line.startswith("this run does not fit: host memory: estimated peak ")
    assert "trainer.dtype=bfloat16" in line and "python -m rlsync.bench" in line and "run.memory_check=false" in line
    est, available = memory.check_fits(cfg, torch.device("cpu"), memory_check=False)  # the switch skips it
    assert est.host_bytes > available["host_bytes"]


def test_the_missions_example_is_refused_before_any_model_is_built(tmp_path):
    """`python -m rlsync model=qwen3_1p7b update.bucket_mb=512`: 1.7B parameters in fp32 AdamW need
    about 32 GB for the trainer alone."""
    available = memory_use.host_available_bytes()
    result = run_main("model=qwen3_1p7b", "update.bucket_mb=512", "wandb.mode=disabled", f"hydra.run.dir={tmp_path}")
    if available is not None and available > 40 * 2**30:
        pytest.skip(f"this machine has {available / 2**30:.0f} GiB available: the example fits here")
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("rlsync: this run does not fit: host memory: estimated peak ")
    assert "trainer.dtype=bfloat16" in lines[0] and "python -m rlsync.bench" in lines[0]
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "summary.json").exists()


@pytest.mark.slow
def test_the_estimate_is_within_25_percent_of_the_measured_peak(tmp_path):
    """A real tiny run: summary.json holds the estimate beside the peak resident set it measured (a process
    of its own: in this one the peak would be the test process's)."""
    result = run_cli(*FAST, "wandb.mode=disabled", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == summary["steps_finished"] == 3
    record = summary["memory"]
    assert record["measured"]["peak_rss_bytes"] > 0 and record["estimate"]["process_bytes"] > 0
    assert record["process_estimate_over_peak_rss"] == pytest.approx(
        record["estimate"]["process_bytes"] / record["measured"]["peak_rss_bytes"]
    )
    assert 0.75 <= record["process_estimate_over_peak_rss"] <= 1.25, record


@pytest.mark.slow
def test_peak_rss_is_this_process_own_and_resets():
    """The peak is the process's own (a child of a large process does not report its parent's, as
    ru_maxrss would) and reset_peak_rss starts it again from now (each multirun job its own)."""
    code = "from rlsync.measure.memory import peak_rss_bytes; print(peak_rss_bytes())"
    ballast = bytearray(768 * 2**20)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # touch every page: this process's peak is > 768 MiB
    child = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=60)
    del ballast
    assert child.returncode == 0, child.stderr
    assert int(child.stdout) < 512 * 2**20  # the child imported torch: ~200-400 MiB, not its parent's peak

    before = memory_use.peak_rss_bytes()
    memory_use.reset_peak_rss()
    assert memory_use.peak_rss_bytes() <= before
    assert memory_use.peak_rss_bytes() >= memory_use.rss_bytes() - 2**20
