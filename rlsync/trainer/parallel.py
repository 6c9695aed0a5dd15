"""How the trainer's ranks share the model (trainer.parallel): a registry of strategies, as `rollout.engine`
and `update.transport` keep theirs.

- `none`: one process; nothing is wrapped.
- `ddp`: every rank holds the whole model and AdamW state. accelerate's `Accelerator.prepare_model` wraps it
  in torch's DistributedDataParallel (its bucketed gradient all-reduce, overlapped with the backward);
  accelerate's `no_sync` skips the all-reduce on all but a rank's last micro-batch.
- `fsdp2`: weights, gradients and AdamW state are DTensors sharded over the ranks, by torch's
  `fully_shard` applied as accelerate's FSDP2 plugin and verl's FSDP workers apply it (each decoder layer
  a unit, then the root). Not through accelerate: its FSDP2 plugin takes effect only for GPU-type launches
  (accelerate/state.py sets DistributedType.FSDP for MULTI_GPU and the like; a CPU launch stays
  MULTI_CPU, i.e. DDP), and this runs on a CPU too. The update gathers the full tensors from the shards
  (rlsync/update/gather.py).

Both wrappers average the ranks' gradients; each rank's loss is its part of the whole batch's token
mean, so `loss_scale` multiplies it by the ranks: the average is then the sum, the one-process gradient.

Adding one: subclass `Parallel` and `register_parallel("mine", "mypackage.mine:Mine")`. What validation, the
memory check and the planner need to know of it, it declares on its class (`spans_ranks`, `sharded`,
`grad_buckets`), so no module names a mode.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from functools import partial
from typing import ClassVar

import torch
from torch import nn

from rlsync.measure.floors import GatherFloor
from rlsync.model.architecture import Entry, update_tensors
from rlsync.registry import Registry
from rlsync.update.buckets import Bucket
from rlsync.update.gather import GatherBuffers, ShardedWeights, gather_shards


class Parallel:
    """One process's part of the trainer's parallelism; the base class is the single process (`none`)."""

    # What validation, the memory check and the planner know of a mode without naming it.
    spans_ranks: ClassVar[bool] = False  # runs data-parallel launches (the base: one process only)
    # weights, gradients and AdamW state are shards over the ranks: each rank holds 1/N of the state, the update
    # gathers whole tensors, and every forward is a collective (each rank must run as many micro-batches)
    sharded: ClassVar[bool] = False
    grad_buckets: ClassVar[bool] = False  # holds a copy of the gradients in its all-reduce buckets (DDP's)

    def __init__(self, world: int, device: torch.device):
        self.world, self.device = world, device

    def wrap(self, model: nn.Module) -> nn.Module:
        """`model` ready to train on the ranks: the module whose forward and backward train (a wrapper or `model`)."""
        return model

    @property
    def loss_scale(self) -> float:
        """What each rank's loss is multiplied by before backward, so the wrapper's averaged gradient is the sum."""
        return 1.0

    @contextlib.contextmanager
    def micro_batch(self, module: nn.Module, *, last: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: the gradients synchronize on a rank's last only."""
        yield

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        """Scale the gradients to at most `max_norm` in total; their norm before, as a number."""
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def update_source(
        self,
        params: dict[str, torch.Tensor],
        *,
        layout: str,
        plan: list[Entry],
        buckets: list[Bucket],
        gather: str,
        call_bytes: int | None = None,
    ) -> Mapping[str, torch.Tensor]:
        """The update's tensors by name: the parameters (or views of them), or shards gathered as they are read
        (in all-gathers of `call_bytes`, the size the run's gather floor found fastest)."""
        return update_tensors(params, layout, plan)


class Ddp(Parallel):
    """accelerate's DistributedDataParallel: whole replicas, gradients all-reduced in the backward."""

    spans_ranks = grad_buckets = True

    def wrap(self, model: nn.Module) -> nn.Module:
        from accelerate import Accelerator  # here: a single process never imports it
        from accelerate.utils import DistributedDataParallelKwargs

        # The process group is rlsync's (rlsync.trainer.data_parallel): accelerate adopts an initialised one.
        # broadcast_buffers=False: the rotary buffers are the same everywhere, and a broadcast in every
        # forward would be a collective that ranks with fewer micro-batches never join.
        self.accelerator = Accelerator(
            cpu=self.device.type == "cpu", kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)]
        )
        with warnings.catch_warnings():  # torch prefers forward_sync_buffers=False, which accelerate cannot pass yet
            warnings.filterwarnings("ignore", message=".*broadcast_buffers. is deprecated", category=FutureWarning)
            return self.accelerator.prepare_model(model, device_placement=False)

    @property
    def loss_scale(self) -> float:
        return float(self.world)

    @contextlib.contextmanager
    def micro_batch(self, module: nn.Module, *, last: bool) -> Iterator[None]:
        with contextlib.nullcontext() if last else self.accelerator.no_sync(module):
            yield


class Fsdp2(Parallel):
    """torch's fully_shard over every rank: each decoder layer a unit, then the root (every forward reshards)."""

    spans_ranks = sharded = True
    buffers: GatherBuffers | None = None  # the update's gather buffers (rlsync.update.gather), made at the first update

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world,))
        layer_types = tuple(getattr(model, "_no_split_modules", None) or ())  # HF: the decoder layer's class
        layers = [m for m in model.modules() if m is not model and type(m).__name__ in layer_types]
        for module in layers:
            fully_shard(module, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)  # the root: embeddings, norm, head (tied once)
        return model

    @property
    def loss_scale(self) -> float:
        return float(self.world)

    @contextlib.contextmanager
    def micro_batch(self, module: nn.Module, *, last: bool) -> Iterator[None]:
        module.set_requires_gradient_sync(last)  # reduce-scatter once, after the last micro-batch
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    @torch.no_grad()
    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        """The global norm from each rank's shards (their squares summed over the ranks), and every shard scaled
        by the one coefficient it gives, as clip_grad_norm_ does in one process (given DTensor gradients,
        torch's clip_grad_norm_ applied a coefficient that did not match the one-process step here)."""
        import torch.distributed as dist

        grads = [p.grad._local_tensor for p in params if p.grad is not None]  # this rank's shard of each
        squares = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        dist.all_reduce(squares)
        norm = float(squares.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
        return norm

    def update_source(
        self,
        params: dict[str, torch.Tensor],
        *,
        layout: str,
        plan: list[Entry],
        buckets: list[Bucket],
        gather: str,
        call_bytes: int | None = None,
    ) -> Mapping[str, torch.Tensor]:
        if self.buffers is None:  # one set for the run: all_at_once's full tensors must outlive the next unit
            self.buffers = GatherBuffers(reuse_full=gather != "all_at_once")
        call_bytes = call_bytes or GatherFloor.CALL_SIZES[-1]
        return ShardedWeights(
            params,
            layout=layout,
            plan=plan,
            buckets=buckets,
            gather=partial(gather_shards, call_bytes=call_bytes, buffers=self.buffers),
            mode=gather,
            device=self.device,
            buffers=self.buffers,
        )


PARALLELS: Registry[Parallel] = Registry(
    "trainer.parallel",
    {
        "none": Parallel,
        "ddp": Ddp,
        "fsdp2": Fsdp2,
    },
)
register_parallel = PARALLELS.register
parallel_names = PARALLELS.names  # the values trainer.parallel accepts
parallel_class = PARALLELS.resolve


def parallels_with(**facts: bool) -> tuple[str, ...]:
    """The trainer.parallel values whose class declares each of `facts` (ClassVars of `Parallel`) so, in order."""
    return tuple(name for name in PARALLELS if all(getattr(parallel_class(name), f) is v for f, v in facts.items()))


def parallel_for(name: str, *, world: int, device: torch.device) -> Parallel:
    """trainer.parallel as this process runs it: a single process is `none` whatever the config says."""
    return parallel_class(name if world > 1 else "none")(world, device)
