"""What this process does in each phase of a step, given its rank: the step loop calls it once per phase.

A single process does everything. Under data parallel (rlsync.trainer.data_parallel) every rank trains
its share of whole prompt groups; where the engines live (rollout.placement) decides the rest:

- `rank0`: rank 0 alone holds the engine, generates the whole batch and scatters prompt groups;
  under fsdp2 the other ranks take part in the update's gathers (each one a collective);
- `every_rank`: each rank holds an engine, generates its own groups and updates its own engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlsync.engines.base import Generation
from rlsync.measure.timing import Stopwatch
from rlsync.trainer.data_parallel import DataParallel


@dataclass
class Batch:
    """This rank's part of a step's batch, and what its own engine generated."""

    gen: Generation
    advantages: torch.Tensor  # [batch] GRPO advantages, on the trainer's device
    batch_tokens: int | None  # the loss's token-mean denominator: the whole batch's; None: this process's batch
    rollout_metrics: dict[str, float] = field(default_factory=dict)  # this rank's engine's, if it generated
    generated: int = 0  # answers this rank's engine generated


Rollout = Callable[[slice], tuple[Generation, torch.Tensor, dict[str, float]]]  # prompt groups -> batch


class Roles:
    """This rank's part in each phase (module docstring); a single process's is every part."""

    def __init__(self, dp: DataParallel, *, placement: str):
        self.dp = dp
        self.every_rank = dp.enabled and placement == "every_rank"  # one engine per rank
        self.has_engine = dp.is_main or self.every_rank
        self.sharded = False  # trainer.parallel shards the weights (fsdp2): set once the trainer is built

    def takes_update(self) -> bool:
        """Whether this rank takes part in the weight update: it holds an engine, or gathers shards."""
        return self.has_engine or self.sharded

    def rollout(self, rollout: Rollout, watch: Stopwatch, *, prompts: int, group_size: int, device) -> Batch:
        """Generate where the engines are, then give each rank its share of whole prompt groups
        (GRPO's advantages are per group): timed as the rollout and batch_scatter."""
        dp = self.dp
        if self.every_rank:  # each rank generates its own groups; the loss counts every rank's tokens
            gen, advantages, metrics = rollout(dp.share(prompts))
            with watch("batch_scatter"):
                tokens = dp.all_sum(int(gen.response_mask.sum()))
            return Batch(gen, advantages, tokens, metrics, generated=gen.sequences.shape[0])
        gen = advantages = None
        metrics: dict[str, float] = {}
        if dp.is_main:  # rank 0 owns the engine: it generates the whole batch
            gen, advantages, metrics = rollout(slice(None))
        generated = gen.sequences.shape[0] if gen is not None else 0
        if not dp.enabled:
            return Batch(gen, advantages, None, metrics, generated=generated)
        with watch("batch_scatter"):
            gen, advantages, tokens = dp.scatter_groups(gen, advantages, group_size=group_size, device=device)
        return Batch(gen, advantages, tokens, metrics, generated=generated)

    def check_replicas(self, params: dict[str, torch.Tensor], *, verify: bool) -> None:
        """update.verify under ddp: every replica holds rank 0's weights after the step (fsdp2's shards
        are checked by the update's own verification, as they are gathered)."""
        if self.dp.enabled and verify and not self.sharded:
            self.dp.check_same_weights(params)

    def agree(self, error: BaseException | None, *, verify: bool) -> None:
        """After the update: under data parallel with update.verify every rank learns the verdict (the
        first failing rank's mismatch is raised on every rank); otherwise this rank's own error."""
        if self.dp.enabled and verify:
            self.dp.agree(error)
        elif error is not None:
            raise error

    def merge_metrics(self, metrics: dict, *, tokens: float, answers: int) -> dict:
        """The step's metrics of every rank, merged for rank 0's record: each phase the slowest rank's,
        the rollout's averages over every rank's answers (a single process's as they are)."""
        return self.dp.gather_metrics(metrics, tokens=tokens, answers=answers)
