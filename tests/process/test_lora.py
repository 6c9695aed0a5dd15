"""LoRA through the engine-process transports: the engine process stays on the trainer's log-probs at a learning
rate that moves the adapters far, every update verified (tests/unit/test_lora.py: the payloads, direct)."""

import pytest
from conftest import lora_run


@pytest.mark.parametrize("payload, transport", [("lora", "ipc"), ("lora_merged", "ipc"), ("lora", "broadcast")])
def test_a_lora_run_keeps_the_engine_on_the_trainers_log_probs(tmp_path, payload, transport):
    """3 steps, as tests/unit/test_lora.py's direct cases (which also check the bytes each mode sends)."""
    lora_run(tmp_path, payload, transport)
