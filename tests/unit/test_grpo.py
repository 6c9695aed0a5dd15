import math

import pytest
import torch
from conftest import SMALL, Tiny

from rlsync.trainer.grpo import group_advantages, grpo_loss
from rlsync.trainer.task import longest_common_subsequence, make_prompts, reward


def test_group_advantages_by_hand():
    # group 1: rewards 0, 1 -> mean 0.5, sample std 0.7071; group 2: all equal -> zeros
    adv = group_advantages(torch.tensor([0.0, 1.0, 0.3, 0.3]), group_size=2)
    s = math.sqrt(0.5)
    assert adv.tolist() == pytest.approx([-0.5 / s, 0.5 / s, 0.0, 0.0], abs=1e-5)


def test_grpo_loss_unclipped_ratio_one_is_minus_mean_advantage():
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, m = grpo_loss(logp, logp, torch.tensor([2.0, -1.0]), mask, clip_eps=0.2)
    # tokens: 2, 2 (row 0), -1 (row 1): loss = -(2 + 2 - 1) / 3
    assert loss.item() == pytest.approx(-1.0)
    assert m["train/clip_frac"] == 0.0


def test_grpo_loss_clips_by_hand():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 and 0.5
    mask = torch.ones(1, 2)
    # advantage +1: token 0 clipped to 1.2 (min of 1.5, 1.2), token 1 keeps 0.5 -> loss = -(1.2 + 0.5) / 2
    loss, m = grpo_loss(logp, old, torch.tensor([1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-(1.2 + 0.5) / 2)
    assert m["train/clip_frac"] == pytest.approx(0.5)
    # advantage -1: -A*ratio = ratio; max(1.5, 1.2) = 1.5 and max(0.5, 0.8) = 0.8
    loss, _ = grpo_loss(logp, old, torch.tensor([-1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx((1.5 + 0.8) / 2)


def test_grpo_loss_kl_k3_by_hand():
    logp = torch.zeros(1, 1)
    ref = torch.log(torch.tensor([[2.0]]))  # delta = log 2: k3 = 2 - log 2 - 1
    loss, m = grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), clip_eps=0.2, ref_logp=ref, kl_coef=0.5)
    assert m["train/kl"] == pytest.approx(1 - math.log(2))
    assert loss.item() == pytest.approx(0.5 * (1 - math.log(2)))


def test_grpo_loss_gradient_pushes_up_positive_advantage():
    logp = torch.zeros(1, 1, requires_grad=True)
    loss, _ = grpo_loss(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), clip_eps=0.2)
    loss.backward()
    assert logp.grad.item() < 0  # descending the loss raises logp


# ----------------------------------------------------------------------------------------------
# The train step's metrics over micro-batches
# ----------------------------------------------------------------------------------------------

PROMPT_LEN, RESPONSE_LEN = 4, 6
ANSWER_LENS = [6, 2, 5, 3]  # uneven: a micro-batch's token count, not its row count, must weight it


def uneven_batch():
    """(batch, advantages, logp, old_logp, ref_logp), logp the fresh trainer's own.

    old_logp and ref_logp are logp perturbed in every row but the last, so ratios clip and the KL is
    non-zero there: a micro-batch holding the last row alone reads 0 for both.
    """
    from rlsync.engines.base import Generation

    gen = torch.Generator().manual_seed(11)
    rows = len(ANSWER_LENS)
    sequences = torch.randint(3, 256, (rows, PROMPT_LEN + RESPONSE_LEN), generator=gen)
    response_mask = (torch.arange(RESPONSE_LEN) < torch.tensor(ANSWER_LENS)[:, None]).long()
    attention_mask = torch.cat([torch.ones(rows, PROMPT_LEN, dtype=torch.long), response_mask], dim=1)
    batch = Generation(
        sequences=sequences,
        attention_mask=attention_mask,
        response_mask=response_mask,
        logprobs=torch.zeros(rows, RESPONSE_LEN),
        prompt_len=PROMPT_LEN,
        truncated=torch.tensor(ANSWER_LENS) == RESPONSE_LEN,
    )
    logp = fresh_trainer(rows).log_probs(batch)  # [rows, resp_len]
    perturbed = torch.tensor([1.0, 1.0, 1.0, 0.0])[:, None]  # [rows, 1]
    old_logp = (logp + torch.randn(rows, RESPONSE_LEN, generator=gen) * perturbed) * response_mask
    ref_logp = (logp + torch.randn(rows, RESPONSE_LEN, generator=gen) * perturbed) * response_mask
    return batch, torch.tensor([1.0, -1.0, 0.5, 2.0]), logp, old_logp, ref_logp


def fresh_trainer(micro_batch_size: int):
    """The same seeded weights every call, so every train step starts from the same model (the SMALL one: the
    metrics' arithmetic over micro-batches does not depend on the model's size)."""
    from rlsync.config.schema import TrainerConfig
    from rlsync.trainer.grpo import Trainer

    model = Tiny().build(seed=3, model=SMALL)
    cfg = TrainerConfig(micro_batch_size=micro_batch_size, kl_coef=0.1)
    return Trainer(model, cfg, allowed_ids=torch.ones(SMALL.vocab_size, dtype=torch.bool), temperature=1.0)


def train_metrics(micro_batch_size: int, batch, advantages, old_logp, ref_logp, batch_tokens=None) -> dict:
    return fresh_trainer(micro_batch_size).train_step(
        batch, old_logp=old_logp, advantages=advantages, ref_logp=ref_logp, batch_tokens=batch_tokens
    )


@pytest.mark.parametrize("micro_batch_size", [1, 3], ids=["four-micro-batches", "micro-batches-of-3-and-1"])
def test_train_step_metrics_are_the_whole_batch_over_micro_batches(micro_batch_size):
    batch, advantages, logp, old_logp, ref_logp = uneven_batch()
    whole = train_metrics(len(ANSWER_LENS), batch, advantages, old_logp, ref_logp)  # one micro-batch
    split = train_metrics(micro_batch_size, batch, advantages, old_logp, ref_logp)
    # the last micro-batch alone (the last row, unperturbed) reads 0: its value cannot pass for the batch's
    _, last = grpo_loss(
        logp[-1:],
        old_logp[-1:],
        advantages[-1:],
        batch.response_mask[-1:],
        clip_eps=0.2,
        ref_logp=ref_logp[-1:],
        kl_coef=0.1,
    )
    assert last["train/clip_frac"] == 0.0 and last["train/kl"] == pytest.approx(0.0, abs=1e-6)
    assert whole["train/clip_frac"] > 0.1 and whole["train/kl"] > 0.1
    for key in ("train/loss", "train/clip_frac", "train/kl"):
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key


def test_train_step_metrics_of_data_parallel_shares_merge_to_the_whole_batch():
    """Each rank passes the whole batch's tokens for its loss; its per-token metrics stay its own tokens' means."""
    from rlsync.trainer.data_parallel import generation_rows, merge_ranks

    batch, advantages, _, old_logp, ref_logp = uneven_batch()
    whole = train_metrics(len(ANSWER_LENS), batch, advantages, old_logp, ref_logp)
    batch_tokens = sum(ANSWER_LENS)
    shares = [slice(0, 3), slice(3, 4)]  # uneven shares, the first one in two micro-batches
    ranks = [
        train_metrics(
            2, generation_rows(batch, rows), advantages[rows], old_logp[rows], ref_logp[rows], batch_tokens=batch_tokens
        )
        for rows in shares
    ]
    merged = merge_ranks(ranks, [sum(ANSWER_LENS[rows]) for rows in shares])
    for key in ("train/loss", "train/clip_frac", "train/kl"):
        assert merged[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key


def test_reward_partial_credit():
    assert reward("hello", "hello") == 1.0
    assert reward("xhxexlx", "hello") == pytest.approx(3 / 5)
    assert reward("", "hello") == 0.0
    assert longest_common_subsequence("abcbdab", "bdcaba") == 4


def test_prompts_are_seeded():
    import random

    a, b = make_prompts(3, rng=random.Random(7)), make_prompts(3, rng=random.Random(7))
    assert a == b and all(p.target in p.text for p in a)
