import math

import pytest
import torch

from rlsync.tasks import longest_common_subsequence, make_prompts, reward
from rlsync.trainer import group_advantages, grpo_loss


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


def test_reward_partial_credit():
    assert reward("hello", "hello") == 1.0
    assert reward("xhxexlx", "hello") == pytest.approx(3 / 5)
    assert reward("", "hello") == 0.0
    assert longest_common_subsequence("abcbdab", "bdcaba") == 4


def test_prompts_are_seeded():
    import random

    a, b = make_prompts(3, rng=random.Random(7)), make_prompts(3, rng=random.Random(7))
    assert a == b and all(p.target in p.text for p in a)
