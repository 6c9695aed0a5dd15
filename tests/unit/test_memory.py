"""The memory fit check: parameter counts from the config alone, the estimate's arithmetic, the
refusal before any model is built (the estimate against the measured peak of a real run:
tests/process/test_memory.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT, run_main

from rlsync.check import estimate as memory
from rlsync.check import fit
from rlsync.config.schema import Config

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
    monkeypatch.setattr(fit, "host_available_bytes", lambda: 20 * 2**30)  # a 24 GiB machine's MemAvailable
    with pytest.raises(fit.DoesNotFit) as caught:
        fit.check_fits(cfg, torch.device("cpu"))
    line = str(caught.value)
    assert caught.value.exit_code == 2 and "\n" not in line
    assert line.startswith("this run does not fit: host memory: estimated peak ")
    # 20 GiB: not even bf16 with every saving fits 1.7B; the largest smaller preset and the update alone do
    assert "try model=qwen3_0p6b; " in line and "python -m rlsync.bench model=qwen3_1p7b" in line
    assert line.endswith("run.memory_check=false skips this check")
    est, available = fit.check_fits(cfg, torch.device("cpu"), memory_check=False)  # the switch skips it
    assert est.host_bytes > available["host_bytes"]


CHECKED = [  # (overrides, GiB available): configurations refused on a 24 GiB machine, and ones that fit
    (["model=qwen3_1p7b", "update.bucket_mb=512"], 21.5),
    (["model=qwen3_1p7b", "trainer.dtype=bfloat16"], 21.5),
    (["model=qwen3_1p7b", "trainer.dtype=bfloat16"], 12.0),
    (["model=qwen3_0p6b"], 12.0),
    (["model=qwen3_0p6b", "trainer.offload_memory=twin"], 16.0),
    (["model=qwen3_4b", "update.transport=ipc"], 21.5),
    (["model=qwen3_8b"], 6.0),
    (["model=tiny"], 0.1),
]


@pytest.mark.parametrize(("overrides", "gib"), CHECKED, ids=[" ".join(o) + f" @{g}" for o, g in CHECKED])
def test_every_suggestion_is_a_configuration_the_same_check_accepts(compose, overrides, gib):
    """The refusal's advice is checked, not guessed: each suggestion, composed through Hydra as a user would
    type it, fits the same machine with the margin (the bench's through the bench's own estimate)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rlsync.config.compose import to_config

    machine = fit.Machine(cuda=False, runtime_bytes=500 * 2**20, host_bytes=int(gib * 2**30), device_bytes=None)
    cfg = compose(*overrides)
    found = fit.suggestions(cfg, machine, overrides=overrides)
    text = fit.advice(cfg, machine, overrides=overrides)
    for suggestion in found:
        assert str(suggestion) in text
        if suggestion.command == "python -m rlsync.bench":
            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
                bench = to_config(hydra_compose(config_name="bench", overrides=suggestion.overrides))
            est = memory.bench_estimate(bench, cuda=False, runtime_bytes=machine.runtime_bytes)
        else:  # the suggestion's overrides after the run's own: what the user would type
            est = memory.estimate(
                compose(*overrides, *suggestion.overrides), cuda=False, runtime_bytes=machine.runtime_bytes
            )
        assert machine.fits(est), (suggestion, machine.shortfalls(est))
    if not machine.fits(memory.estimate(cfg, cuda=False, runtime_bytes=machine.runtime_bytes)):
        assert text.startswith(("try ", "nothing smaller")), text
    if gib == 0.1:  # nothing fits: said so, nothing suggested
        assert not found and text.startswith("nothing smaller in this configuration fits")


def test_the_margin_refuses_what_would_only_just_fit(compose):
    cfg = compose("model=qwen3_0p6b", "trainer.dtype=bfloat16")
    est = memory.estimate(cfg, cuda=False, runtime_bytes=0)
    exact = fit.Machine(cuda=False, runtime_bytes=0, host_bytes=est.host_bytes, device_bytes=None)
    assert not exact.fits(est)  # no room for the margin
    roomy = fit.Machine(
        cuda=False, runtime_bytes=0, host_bytes=est.host_bytes + fit.margin_bytes(est.host_bytes), device_bytes=None
    )
    assert roomy.fits(est)
    assert fit.margin_bytes(est.host_bytes) >= memory.MARGIN_MIN


def test_the_step_transients_add_up_on_a_cpu_and_the_probe_on_top_between_steps(compose):
    """The C heap keeps what a phase freed: the rollout's and the step's transients add up, and a probe
    between steps (run.limit_probe=every_step) comes on top; probed once at start, it is the larger alone."""
    every = memory.estimate(compose("model=qwen3_0p6b", "trainer.dtype=bfloat16"), cuda=False, runtime_bytes=0)
    start = memory.estimate(
        compose("model=qwen3_0p6b", "trainer.dtype=bfloat16", "run.limit_probe=start"), cuda=False, runtime_bytes=0
    )
    probe = 2 * 2**30  # two 1 GiB buffers: the probe's cap
    assert every.process["transient"] == start.process["transient"] + probe
    # AdamW's temporaries and the tied embedding's gradient: three of its largest tensor (the embedding)
    largest = 151936 * 1024 * 2
    cfg = compose("model=qwen3_0p6b", "trainer.dtype=bfloat16")
    assert memory.optimizer_bytes(cfg, memory.param_shapes(cfg.model), cuda=False) == 3 * largest


def test_the_missions_example_is_refused_before_any_model_is_built(tmp_path, monkeypatch):
    """`python -m rlsync model=qwen3_1p7b update.bucket_mb=512`: 1.7B parameters in fp32 AdamW need
    about 32 GB for the trainer alone. On a 24 GiB machine (its MemAvailable fixed here: what the advice
    offers depends on it, and the suite's other worker changes it), bf16 with every saving is offered."""
    monkeypatch.setattr(fit, "host_available_bytes", lambda: int(23.5 * 2**30))
    result = run_main("model=qwen3_1p7b", "update.bucket_mb=512", "wandb.mode=disabled", f"hydra.run.dir={tmp_path}")
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("rlsync: this run does not fit: host memory: estimated peak ")
    assert "trainer.dtype=bfloat16" in lines[0] and "python -m rlsync.bench" in lines[0]
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "summary.json").exists()


# ----------------------------------------------------------------------------------------------
# Data parallel: each rank's part, and every rank on this machine
# ----------------------------------------------------------------------------------------------


def test_fsdp2_ranks_each_hold_a_shard_and_every_rank_on_the_machine_counts(compose):
    """Two ranks on one machine (torchrun --nproc_per_node 2): the check adds both ranks' estimates. Under
    fsdp2 each holds half the state (dim 0 shards, padded) and the gather's transients; with every_rank
    engines each has an engine, with rank0 only rank 0 has one."""
    two = memory.Ranks(world=2, local=2)
    single = memory.estimate(compose("model=qwen3_0p6b", "trainer.dtype=bfloat16"), cuda=False, runtime_bytes=0)
    cfg = compose(
        "model=qwen3_0p6b", "trainer.dtype=bfloat16", "trainer.parallel=fsdp2", "rollout.placement=every_rank"
    )
    est = memory.estimate(cfg, cuda=False, runtime_bytes=0, ranks=two)
    assert 0.5 <= est.process["trainer_state"] / single.process["trainer_state"] < 0.501  # a shard: half, padded
    assert est.other_ranks == 1 and est.other_rank["engine_weights"] == single.process["engine_weights"]
    assert est.host_bytes == est.process_bytes + sum(est.other_rank.values())
    assert est.process["transient"] > single.process["transient"]  # + the gather's held tensors and probe
    rank0 = memory.estimate(
        compose("model=qwen3_0p6b", "trainer.dtype=bfloat16", "trainer.parallel=fsdp2"),
        cuda=False,
        runtime_bytes=0,
        ranks=two,
    )
    assert "engine_weights" in rank0.process and rank0.other_rank["engine_weights"] == 0  # rank 1 holds no engine
    assert rank0.host_bytes < est.host_bytes
    # ranks on other machines are not this machine's: 2 ranks, 1 here
    assert memory.estimate(cfg, cuda=False, runtime_bytes=0, ranks=memory.Ranks(2, 1)).other_ranks == 0
    ddp = memory.estimate(
        compose("model=qwen3_0p6b", "trainer.dtype=bfloat16"), cuda=False, runtime_bytes=0, ranks=two
    )  # ddp (the default): the whole state on each rank, and DDP's gradient buckets beside it
    assert ddp.process["trainer_state"] == single.process["trainer_state"]
    assert ddp.process["ddp_buckets"] == QWEN3_0P6B_PARAMS * 2


def test_the_2_rank_fsdp2_run_that_was_killed_is_refused_with_checked_advice(compose):
    """Qwen3-0.6B in fp32 over 2 fsdp2 ranks, each with its engine, was killed by the kernel in setup (12.7
    and 11.5 GB resident); on a 24 GiB machine (23 GiB available) it is refused, and what it offers fits."""
    two = memory.Ranks(world=2, local=2)
    machine = fit.Machine(cuda=False, runtime_bytes=500 * 2**20, host_bytes=23 * 2**30, device_bytes=None, ranks=two)
    overrides = ["model=qwen3_0p6b", "trainer.parallel=fsdp2", "rollout.placement=every_rank"]
    cfg = compose(*overrides)
    est = machine.estimate(cfg)
    assert not machine.fits(est)
    assert "for its 2 ranks here" in machine.shortfalls(est)[0]
    found = [s for s in fit.suggestions(cfg, machine, overrides=overrides) if s.command == "python -m rlsync"]
    assert "trainer.dtype=bfloat16" in [o for s in found for o in s.overrides]
    for suggestion in found:
        assert machine.fits(machine.estimate(compose(*overrides, *suggestion.overrides))), suggestion
