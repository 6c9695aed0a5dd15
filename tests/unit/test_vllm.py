"""vLLM as the rollout engine: its log-probs match the trainer's after an update, through the real step.

One engine serves the whole module (starting vLLM takes seconds); every test loads its own weights
first, so the tests do not depend on their order. Skipped, with the reason shown, only where vLLM is
not installed (`pip install -e '.[vllm]'`); a broken install fails instead of hiding.

Tolerance: the engine holds bf16 weights, the trainer fp32. bf16 keeps 8 significant bits, a relative
error up to 2**-9 per weight, and vLLM's kernels sum in another order than torch's. On the tiny model at
temperature 0.7 that moved a token's log-prob by at most 0.013 and 0.0037 on average (10 random
models); another model's weights (a missed update) leave a gap of 0.43 or more on average. The
tolerances sit at 2-3x the first and 50x below the second.
"""

from __future__ import annotations

import pytest
import torch
from conftest import Tiny

from rlsync.config.schema import ModelConfig, UpdateConfig
from rlsync.engines.vllm import FusedLayers
from rlsync.model.build import named_weights
from rlsync.update import plan_for

CPU = torch.device("cpu")


def trainer_model(seed: int):
    """A trainer model in fp32; each seed gives different weights, so a missed update shows."""
    return Tiny().build(seed=seed)


def test_fused_layer_parts_are_held_until_the_layer_is_complete():
    fused = FusedLayers({"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]})
    attn = "model.layers.3.self_attn"
    q, k, v, norm = torch.ones(4), torch.full((4,), 2.0), torch.full((4,), 3.0), torch.zeros(2)
    ready = fused.ready([(f"{attn}.q_proj.weight", q), ("model.norm.weight", norm)])
    assert [n for n, _ in ready] == ["model.norm.weight"]  # unfused tensors pass through at once
    assert fused.held_bytes == q.numel() * q.element_size()
    q.fill_(-1.0)  # the caller reuses its buffer: the held part must be a copy
    ready = dict(fused.ready([(f"{attn}.k_proj.weight", k), (f"{attn}.v_proj.weight", v)]))
    assert list(ready) == [f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"]
    assert torch.equal(ready[f"{attn}.q_proj.weight"], torch.ones(4))
    assert ready[f"{attn}.k_proj.weight"] is k  # complete in this call: no copy
    assert fused.pending == {} and fused.held_bytes == 0
    whole = fused.ready([("model.layers.0.mlp.gate_proj.weight", k), ("model.layers.0.mlp.up_proj.weight", v)])
    assert len(whole) == 2 and fused.held_bytes == 0


# -- CUDA-only logic, checked on the CPU: memory budget, sleep levels, one engine per process, API guard --


def test_gpu_memory_utilization_passes_vllms_startup_check():
    """vLLM starts only if free >= ceil(utilization x total): the utilization is a share of what is free now."""
    from rlsync.engines.vllm import gpu_memory_utilization

    gib = 2**30
    for free, total, need in ((60 * gib, 140 * gib, 5 * gib), (3 * gib, 80 * gib, gib), (139 * gib, 140 * gib, 0)):
        u = gpu_memory_utilization(free, total, need_bytes=need)
        assert 0 < u <= 1 and -(-int(u * total) // 1) <= free  # vLLM's request_memory check holds
        assert u * total >= need and u * total >= 0.9 * free  # the engine's weights and KV cache fit; little wasted
    assert gpu_memory_utilization(60 * gib, 140 * gib, need_bytes=gib) == 0.407  # floor(0.95 x 60 / 140, 3 digits)


def test_gpu_memory_utilization_says_when_the_engine_cannot_fit():
    from rlsync.engines.vllm import gpu_memory_utilization
    from rlsync.errors import RlsyncError

    with pytest.raises(RlsyncError, match=r"^rollout.engine=vllm: 2.00 GiB of 80.00 GiB are free .* about 4.00 GiB"):
        gpu_memory_utilization(2 * 2**30, 80 * 2**30, need_bytes=4 * 2**30)


def test_weight_bytes_counts_the_engine_weights_once():
    """The memory budget's weights: the trainer's tensors in the engine dtype, a tied embedding once."""
    from rlsync.engines.vllm import model_config, weight_bytes

    cfg = ModelConfig()
    trainer = named_weights(trainer_model(0))
    buckets = plan_for(trainer, UpdateConfig(), torch.bfloat16)
    assert weight_bytes(model_config(cfg, torch.bfloat16), torch.bfloat16) == sum(b.nbytes for b in buckets)


class FakeLLM:
    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))


def fake_cuda_engine(release_level: int):
    """A VLLMEngine's release/resume logic around a recording LLM, as on CUDA (no vLLM started)."""
    from rlsync.engines.vllm import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.device, engine.llm, engine.asleep, engine.native = torch.device("cuda"), FakeLLM(), set(), False
    engine.release_level = release_level
    return engine


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_levels_and_the_wake_before_the_update(level):
    """release sleeps at rollout.release_level (vLLM's level: 2 when the update refills every weight); the
    runner's resume before the update wakes everything, so the update itself wakes nothing."""
    engine = fake_cuda_engine(level)
    engine.release()
    engine.release()  # asleep already: once
    assert engine.llm.calls == [("sleep", level)]
    engine.resume()  # the runner's engine_resume before the update
    assert engine.llm.calls[-1] == ("wake_up", ("kv_cache", "weights")) and not engine.asleep
    engine._wake_weights()  # inside the update: nothing left to wake
    engine.resume()  # the rollout's resume: nothing either
    assert len(engine.llm.calls) == 2


def test_sleep_level_0_never_sleeps_and_the_cpu_backend_never_does():
    from rlsync.engines.vllm import VLLMEngine

    engine = fake_cuda_engine(0)
    engine.release()
    engine._wake_weights()
    engine.resume()
    assert engine.llm.calls == [] and not engine.asleep
    for level in (1, 2):  # vLLM's CPU backend has no sleep mode: a no-op at every level
        cpu = fake_cuda_engine(level)
        cpu.device = torch.device("cpu")
        cpu.release()
        cpu.resume()
        assert cpu.llm.calls == []
    assert [VLLMEngine.release_takes_weights(level, "cuda") for level in (0, 1, 2)] == [False, True, True]


def test_a_second_sleep_mode_engine_in_one_process_is_refused(monkeypatch):
    import rlsync.engines.vllm as ve
    from rlsync.errors import BadInput

    monkeypatch.setattr(ve, "_sleep_mode_engines", 0)
    for device_type, native in (("cpu", False), ("cuda", True)):  # no sleep mode here / engine core in its own process
        ve.check_sleep_mode(device_type, native)
        ve.count_sleep_mode(device_type, native)
    assert ve._sleep_mode_engines == 0
    ve.check_sleep_mode("cuda", False)  # the first one starts
    ve.count_sleep_mode("cuda", False)
    with pytest.raises(
        BadInput,
        match=r"^rollout.engine=vllm on CUDA: vLLM's sleep mode allows one engine per process"
        r".*hydra/launcher=local.*update.transport=ipc$",
    ):
        ve.check_sleep_mode("cuda", False)
    ve.check_sleep_mode("cpu", False)  # the CPU backend: as many as wanted
    assert ve.sleep_mode_refusal(device_type="cuda", native=False, started_before=0) is None


@pytest.mark.parametrize(
    "version, missing, refused",
    [
        ("0.32.0", [], None),
        ("0.33.1", [], None),
        ("0.34.0+cu128", [], None),
        ("0.31.2", [], "the installed vllm 0.31.2 is outside vllm>=0.32,<0.35"),
        ("0.35.0.dev4+gabc", [], r"the installed vllm 0\.35\.0\.dev4\+gabc is outside"),
        ("1.0.0", [], "outside vllm>=0.32,<0.35"),
        ("not-a-version", [], "the installed vllm not-a-version is outside"),
        (
            "0.32.0",
            ["IPCTrainerInitInfo(packed=...)"],
            "the installed vllm 0.32.0 lacks IPCTrainerInitInfo\\(packed=...\\)",
        ),
    ],
)
def test_vllm_api_version_guard(version, missing, refused):
    import re

    from rlsync.engines.vllm import api_refusal

    reason = api_refusal(version, missing)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and "\n" not in reason
        assert re.search(refused, reason), reason


# -- vLLM's own four phases on the CPU (update.strategy=vllm_shm), and buckets far smaller than a layer --
