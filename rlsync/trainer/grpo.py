"""The trainer: log-probs of sampled tokens, the GRPO loss, one AdamW step.

GRPO (Shao et al., 2024): each prompt is answered `group_size` times; a sample's advantage is its
reward normalised within its group; the loss is PPO's clipped surrogate per token, averaged over
all answer tokens of the batch, plus an optional KL penalty to a frozen reference model.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from rlsync.config.schema import TrainerConfig
from rlsync.engines.base import Generation, position_ids, token_logprobs
from rlsync.trainer.parallel import Parallel


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """[batch] rewards, groups contiguous -> [batch] (r - group mean) / (group std + eps)."""
    grouped = rewards.view(-1, group_size)  # [prompts, group_size]
    mean, std = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
):
    """Token-level clipped surrogate. logp, old_logp, ref_logp, mask: [batch, resp_len]; advantages: [batch].

    Returns (loss, metrics). The KL term is the k3 estimator exp(ref - logp) - (ref - logp) - 1.
    """
    ratio = torch.exp(logp - old_logp)  # [batch, resp_len]
    adv = advantages.unsqueeze(-1)  # [batch, 1]
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(pg_loss1, pg_loss2)
    kl = torch.zeros_like(per_token)
    if ref_logp is not None and kl_coef > 0:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
    n_tokens = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / n_tokens
    clipped = ((pg_loss2 > pg_loss1).float() * mask).sum() / n_tokens
    return loss, {"train/clip_frac": clipped.item(), "train/kl": ((kl * mask).sum() / n_tokens).item()}


def sequence_logprobs(
    model: nn.Module, gen: Generation, *, allowed: torch.Tensor, temperature: float, micro_batch_size: int
) -> torch.Tensor:
    """Log-probs of the answer tokens under `model`, micro-batched: [batch, resp_len]."""
    out = []
    for start in range(0, gen.sequences.shape[0], micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        out.append(_answer_logprobs(model, gen, rows, allowed=allowed, temperature=temperature))
    return torch.cat(out)


def _answer_logprobs(model, gen: Generation, rows: slice, *, allowed, temperature) -> torch.Tensor:
    ids, mask = gen.sequences[rows], gen.attention_mask[rows]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    # logits at position t predict token t + 1: the answer starts at prompt_len
    answer_logits = logits[:, gen.prompt_len - 1 : -1, :]  # [rows, resp_len, vocab]
    logp = token_logprobs(answer_logits, ids[:, gen.prompt_len :], allowed=allowed, temperature=temperature)
    return logp.masked_fill(gen.response_mask[rows] == 0, 0.0)  # padding after EOS scores -inf otherwise


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        cfg: TrainerConfig,
        *,
        allowed_ids: torch.Tensor,
        temperature: float,
        parallel: Parallel | None = None,
    ):
        self.cfg = cfg
        self.allowed = allowed_ids.to(next(model.parameters()).device)
        self.temperature = temperature
        self.reference = None
        if cfg.kl_coef > 0:  # before any sharding: a whole frozen copy on every rank
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        # trainer.parallel (rlsync.trainer.parallel): `module` trains (a DDP wrapper, or the model sharded in
        # place by fully_shard); `model` is the model itself, whose parameters the optimizer steps
        self.parallel = parallel or Parallel(1, self.allowed.device)
        self.module = self.parallel.wrap(model)
        self.model = model
        on_cuda = self.allowed.device.type == "cuda"
        # foreach (multi-tensor) AdamW is faster on CUDA but holds whole-model temporaries: on a CPU
        # run of Qwen3-0.6B those gigabytes are the difference between fitting 24 GiB and not.
        # what trains: every weight, or the LoRA adapters alone (trainer.lora.rank > 0 freezes the base)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=cfg.lr, betas=(0.9, 0.999), weight_decay=0.0, foreach=on_cuda
        )

    @torch.no_grad()
    def log_probs(self, gen: Generation, *, reference: bool = False) -> torch.Tensor:
        model = self.reference if reference else self.model
        return sequence_logprobs(
            model, gen, allowed=self.allowed, temperature=self.temperature, micro_batch_size=self.cfg.micro_batch_size
        )

    def train_step(
        self,
        gen: Generation,
        *,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
        batch_tokens: int | None = None,
    ) -> dict[str, float]:
        """One optimizer step over the whole batch (gradients accumulated over micro-batches).

        `batch_tokens`: answer tokens of the whole batch when `gen` is one data-parallel rank's share
        of it, so each rank's loss is its part of the batch's token mean; default: `gen`'s own.

        `train/loss` is the loss the gradient comes from, before the step: the token mean over the
        whole batch (its part of it on a data-parallel rank, which the ranks' metrics sum). The
        per-token metrics (`train/clip_frac`, `train/kl`) weight each micro-batch by its answer tokens,
        as the loss does, over this process's own tokens: the ranks' values are then merged weighted
        by each rank's tokens (rlsync.trainer.data_parallel.merge_ranks), which gives the whole batch's.
        """
        self.module.train()
        self.optimizer.zero_grad(set_to_none=False)
        total_tokens = gen.response_mask.sum() if batch_tokens is None else torch.tensor(batch_tokens)
        total_tokens = total_tokens.to(gen.response_mask.device).clamp(min=1)
        tokens_per_row = gen.response_mask.sum(dim=1).tolist()  # [batch]: one device sync serves all micro-batches
        loss_sum, token_sums = 0.0, {}  # per-token metric -> its sum over this process's answer tokens
        starts = range(0, gen.sequences.shape[0], self.cfg.micro_batch_size)
        for start in starts:
            rows = slice(start, start + self.cfg.micro_batch_size)
            with self.parallel.micro_batch(self.module, last=start == starts[-1]):  # data parallel: sync on the last
                logp = _answer_logprobs(self.module, gen, rows, allowed=self.allowed, temperature=self.temperature)
                mask = gen.response_mask[rows]
                loss, micro_means = grpo_loss(
                    logp,
                    old_logp[rows],
                    advantages[rows],
                    mask,
                    clip_eps=self.cfg.clip_eps,
                    ref_logp=None if ref_logp is None else ref_logp[rows],
                    kl_coef=self.cfg.kl_coef,
                )
                weight = mask.sum() / total_tokens  # token-level mean over the whole batch
                (loss * (weight * self.parallel.loss_scale)).backward()  # the wrappers average over ranks
            loss_sum += (loss * weight).item()
            micro_tokens = sum(tokens_per_row[rows])
            for key, mean in micro_means.items():
                token_sums[key] = token_sums.get(key, 0.0) + mean * micro_tokens
        own_tokens = max(sum(tokens_per_row), 1)
        metrics = {key: total / own_tokens for key, total in token_sums.items()}
        grad_norm = self.parallel.clip_grad_norm(self.trainable, self.cfg.grad_clip)
        self.optimizer.step()
        self.module.eval()
        return {"train/loss": loss_sum, "train/grad_norm": grad_norm, **metrics}
