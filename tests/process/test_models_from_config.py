"""The 30B MoE preset refused on a 24 GiB machine without allocating it (its config built on the meta device),
and a MoE model's checkpoint layout through an engine process, tensor by tensor
(tests/unit/test_models_from_config.py: the rest, in this process)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FAST, run_main

from rlsync.measure.memory import rss_bytes


def test_the_30b_moe_preset_is_refused_on_a_24_gib_machine_without_allocating(compose, monkeypatch):
    from rlsync.check import estimate as memory
    from rlsync.check import fit
    from rlsync.config.validate import validate

    cfg = compose("model=qwen3_30b_a3b")
    validate(cfg)
    monkeypatch.setattr(fit, "host_available_bytes", lambda: 20 * 2**30)  # a 24 GiB machine's MemAvailable
    before = rss_bytes()
    with pytest.raises(fit.DoesNotFit) as caught:
        fit.check_fits(cfg, torch.device("cpu"))
    assert rss_bytes() - before < 256 * 2**20
    line = str(caught.value)
    assert "\n" not in line and line.startswith("this run does not fit: host memory: estimated peak ")
    assert "(model qwen3_30b_a3b, 30.53B parameters," in line
    est = memory.estimate(cfg, cuda=False, runtime_bytes=0)
    assert est.process["trainer_state"] == 30_532_122_624 * 4 * 4  # fp32 weights, grads, two AdamW moments
    assert est.process["engine_weights"] == 30_532_122_624 * 2


def test_a_qwen3_moe_checkpoint_layout_crosses_to_an_engine_process_tensor_by_tensor(tmp_path, compose):
    """The tiny MoE preset's per-expert tensors, each sent alone over ipc: every step verified, each update all
    of the checkpoint layout's tensors."""
    from rlsync.model.architecture import update_shapes

    overrides = [
        "model=tiny_moe",
        "model.update_layout=checkpoint",
        "update.transport=ipc",
        "update.strategy=per_tensor",
    ]
    proc = run_main(
        *FAST, "run.steps=2", *overrides, "update.verify=true", "wandb.mode=disabled", f"hydra.run.dir={tmp_path}"
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["verification"] == "passed" and summary["measured_steps"] == 1
    tensors = len(update_shapes(compose(*overrides).model))
    assert summary["setup"]["update_layout"] == "checkpoint" and summary["setup"]["update_tensors"] == tensors
