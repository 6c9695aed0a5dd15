"""Device bookkeeping: where each tensor of a step lives, checked on a CPU.

The batch, its masks, the log-probs and the advantages are placed where they are on a GPU (the
simulated device of tests/simulated_cuda.py, which refuses what CUDA refuses), and the real scoring,
sampling and loss functions run on them. Plus what decides the CUDA device a process selects and
the device memory it reports, and the HF engine's tokens, which moving sampling to the engine's
device must leave as they were on the CPU.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import CPU, SMALL, Ids
from simulated_cuda import DEVICE, DeviceMismatch, SimulatedCuda

from rlsync.config.schema import RolloutConfig
from rlsync.engines.base import Generation, answer_ids, token_logprobs
from rlsync.engines.hf import sample_tokens
from rlsync.engines.process import generator_here
from rlsync.measure.devices import (
    cuda_index_to_select,
    device_memory_metric_names,
    device_memory_metrics,
    explicit_device,
)
from rlsync.model.build import ByteTokenizer
from rlsync.run.loop import score_rollout
from rlsync.trainer.data_parallel import generation_rows
from rlsync.trainer.grpo import grpo_loss
from rlsync.trainer.task import make_prompts


def batch(tokenizer, group_size: int = 2) -> tuple[list, Generation]:
    """A generated batch as the engine returns it: 2 prompts x `group_size` answers, EOS-terminated or cut."""
    prompts = make_prompts(2, rng=random.Random(0))
    prompt_ids = [tokenizer.encode(p.text) for p in prompts for _ in range(group_size)]
    answers = [[*list(b"abc"), tokenizer.eos_id], list(prompts[0].target.encode()), list(b"q"), list(b"zzzzz")]
    width, plen = max(map(len, answers)), max(map(len, prompt_ids))
    seqs, alive = [], []
    for p, a in zip(prompt_ids, answers):
        seqs.append([tokenizer.pad_id] * (plen - len(p)) + p + a + [tokenizer.pad_id] * (width - len(a)))
        alive.append([1] * len(a) + [0] * (width - len(a)))
    response_mask = torch.tensor(alive)
    attention = torch.cat([torch.tensor([[0] * (plen - len(p)) + [1] * len(p) for p in prompt_ids]), response_mask], 1)
    gen = Generation(
        sequences=torch.tensor(seqs),
        attention_mask=attention,
        response_mask=response_mask,
        logprobs=-torch.rand(len(answers), width, generator=torch.Generator().manual_seed(0)) * response_mask,
        prompt_len=plen,
        truncated=torch.tensor([False, True, False, True]),
    )
    return prompts, gen


def test_the_simulated_device_refuses_the_old_scoring_pattern():
    """What a GPU run hit at step 0: a host row indexed with a device mask. The simulation must refuse it."""
    tokenizer = ByteTokenizer()
    _, gen = batch(tokenizer)
    with SimulatedCuda():
        on_device = gen.to(DEVICE)
        assert on_device.response_mask.device == DEVICE
        with pytest.raises(DeviceMismatch, match="indices should be either on cpu"):
            [
                row[on_device.response_mask[i].bool()]
                for i, row in enumerate(on_device.sequences[:, gen.prompt_len :].cpu())
            ]
        with pytest.raises(DeviceMismatch, match="same device"):
            torch.tensor([0.5, 0.25, 0.0, 1.0]) * on_device.response_mask.float().sum(1)


def test_scoring_takes_the_batch_on_the_device_and_puts_advantages_there():
    tokenizer = ByteTokenizer()
    prompts, gen = batch(tokenizer)
    want_rewards, want_adv = score_rollout(gen, prompts, tokenizer, group_size=2, device=CPU)
    assert answer_ids(gen)[0] == [*b"abc", tokenizer.eos_id] and want_rewards[1] == 1.0  # the exact echo
    with SimulatedCuda():
        rewards, advantages = score_rollout(gen.to(DEVICE), prompts, tokenizer, group_size=2, device=DEVICE)
        assert rewards.device == CPU and advantages.device == DEVICE
        assert torch.equal(rewards, want_rewards) and torch.equal(advantages.cpu(), want_adv)


def test_loss_and_log_probs_run_with_every_operand_on_the_device():
    tokenizer = ByteTokenizer()
    _, gen = batch(tokenizer)
    allowed = tokenizer.allowed_ids(SMALL.vocab_size)
    logits = torch.randn(*gen.response_mask.shape, SMALL.vocab_size, generator=torch.Generator().manual_seed(1))
    tokens = gen.sequences[:, gen.prompt_len :]
    want_logp = token_logprobs(logits, tokens, allowed=allowed, temperature=0.7)
    want_loss, want_metrics = grpo_loss(
        want_logp, gen.logprobs, torch.tensor([1.0, -1.0, 0.5, -0.5]), gen.response_mask, clip_eps=0.2
    )
    with SimulatedCuda():
        d = gen.to(DEVICE)
        logp = token_logprobs(
            logits.to(DEVICE), d.sequences[:, d.prompt_len :], allowed=allowed.to(DEVICE), temperature=0.7
        )
        loss, metrics = grpo_loss(
            logp, d.logprobs, torch.tensor([1.0, -1.0, 0.5, -0.5]).to(DEVICE), d.response_mask, clip_eps=0.2
        )
        assert logp.device == DEVICE and loss.device == DEVICE
        assert torch.equal(logp.cpu(), want_logp) and loss.item() == want_loss.item() and metrics == want_metrics
        # the data-parallel scatter: rank 0 cuts whole groups of the device batch and pickles host copies
        share = generation_rows(d, slice(2, 4)).to(CPU)
        assert share.sequences.device == CPU and torch.equal(share.sequences, gen.sequences[2:4])


def test_sampling_draws_where_the_generator_is():
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(2)), -1)
    want = sample_tokens(probs, torch.Generator().manual_seed(0))
    with SimulatedCuda():  # a CPU generator serving a device engine: drawn on the host, returned on the device
        got = sample_tokens(probs.to(DEVICE), torch.Generator().manual_seed(0))
        assert got.device == DEVICE and torch.equal(got.cpu(), want)


# Drawn by the engine before sampling moved to the engine's device (host multinomial, CPU generator):
# the CPU stream must not change. Engine: SMALL, bf16, trainer weights of seed 0, ids >= 280 masked, EOS 188.
RECORDED = {
    1.0: [
        [251, 135, 47, 206, 91, 255, 11, 171, 243, 33],
        [136, 15, 80, 188, 258, 258, 258, 258, 258, 258],
        [99, 63, 145, 245, 269, 104, 271, 38, 205, 211],
        [7, 114, 68, 192, 130, 44, 188, 258, 258, 258],
    ],
    0.7: [
        [154, 69, 212, 12, 65, 224, 253, 241, 61, 42],
        [117, 218, 208, 143, 242, 242, 203, 264, 127, 165],
        [83, 128, 59, 250, 28, 100, 82, 218, 167, 57],
        [264, 167, 268, 74, 271, 182, 176, 31, 276, 206],
    ],
}


def test_hf_engine_draws_the_same_tokens_on_the_cpu_as_before(tiny):
    ids = Ids(torch.arange(300) < 280, eos_id=188, pad_id=258)
    engine = tiny.spec(model=SMALL, rollout=RolloutConfig(), tokenizer=ids).build()
    weights = tiny.weights(model=SMALL)
    engine.load_weights((n, t.to(engine.dtype)) for n, t in weights.items())
    generator = torch.Generator().manual_seed(0)
    prompts = [[256, 72, 105], [256, 50, 43, 50, 61], [256, 33], [256, 40, 41, 42]]
    for temperature, tokens in RECORDED.items():  # one stream through both: the second continues the first
        gen = engine.generate(prompts, max_new_tokens=10, temperature=temperature, generator=generator)
        assert gen.sequences[:, gen.prompt_len :].tolist() == tokens


def test_the_cuda_device_a_process_selects():
    assert cuda_index_to_select(torch.device("cuda:1")) == 1
    assert cuda_index_to_select(torch.device("cuda", 0)) == 0
    assert cuda_index_to_select(torch.device("cuda")) is None  # the current device: nothing to change
    assert cuda_index_to_select(CPU) is None
    assert explicit_device(CPU) == CPU and explicit_device(torch.device("cuda:1")) == torch.device("cuda:1")


def test_the_engine_rebuilds_the_sampler_on_its_own_device_of_the_same_type():
    assert generator_here(torch.device("cuda:1"), torch.device("cuda:0")) == torch.device("cuda:0")
    assert generator_here(CPU, torch.device("cuda:0")) == CPU  # a host stream stays a host stream
    assert generator_here(CPU, CPU) == CPU


def test_device_memory_is_reported_on_cuda_only_under_two_names():
    assert device_memory_metrics(CPU, "sleep") == {}
    assert device_memory_metric_names("sleep") == (
        "perf/device_mem_after_sleep_gb",
        "perf/device_mem_used_after_sleep_gb",
    )
