"""LoRA through the engine-process transports: the engine process stays on the trainer's log-probs at a learning
rate that moves the adapters far, every update verified (tests/unit/test_lora.py: the payloads, direct)."""

import json

import pytest
from conftest import FAST, read_jsonl, run_main

LR = "trainer.lr=0.01"  # large enough that a stale engine's log-probs move far: the check below can fail


@pytest.mark.parametrize("payload, transport", [("lora", "ipc"), ("lora_merged", "ipc"), ("lora", "broadcast")])
def test_a_lora_run_keeps_the_engine_on_the_trainers_log_probs(tmp_path, payload, transport):
    """3 steps, as tests/unit/test_lora.py's direct cases (which also check the bytes each mode sends)."""
    proc = run_main(
        *FAST,
        "trainer.lora.rank=16",
        f"update.payload={payload}",
        f"update.transport={transport}",
        "update.verify=true",
        LR,
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
