"""The update's side of a run or a benchmark, built once: the trainer's tensors in the update's layout,
the bucket plan, the copy floors, the auto knobs resolved, the engine's spec, the engine and the transport to it.

`python -m rlsync` (rlsync.run.loop), `python -m rlsync.bench` (rlsync.bench.runner) and their tests
build it here, in this order: the floors are probed before the engine takes its memory, and the auto
knobs (update.*=null) are resolved before the engine opens, so its process gets them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from rlsync.config.schema import Config, UpdateConfig
from rlsync.engines.base import EngineHandle, engine_class, engine_spec
from rlsync.measure.devices import explicit_device
from rlsync.measure.floors import Floors
from rlsync.model.architecture import Entry, params_layout, update_tensors
from rlsync.model.build import torch_dtype
from rlsync.model.lora import is_adapter
from rlsync.update import close_update, is_out_of_memory, open_update, out_of_memory, plan_for
from rlsync.update.auto import resolve_for_run
from rlsync.update.base import Transport
from rlsync.update.buckets import Bucket
from rlsync.update.payload import payload_of


@dataclass
class UpdateSide:
    """What the update needs, planned once. Without an engine here (a data-parallel rank that only
    follows the gathers) `floors`, `engine` and `transport` are None and `update_cfg` is update.* as configured."""

    layout: list[Entry]  # model.update_layout's plan over the trainer's parameters (views are made per update)
    weights: dict[str, torch.Tensor] | None  # the update's tensors as planned; release_views() drops them
    buckets: list[Bucket]
    read_bytes: int  # the trainer's bytes the update reads (fsdp2: the whole tensors', not a shard's)
    update_cfg: UpdateConfig  # update.* with its nulls (auto) resolved
    resolved: dict | None = None  # those resolved values and why (summary.json)
    floors: Floors | None = None  # the copy floors, probed before the engine opened
    engine: EngineHandle | None = None  # what the step generates with
    transport: Transport | None = None  # the weight channel to it
    info: dict = field(default_factory=dict)  # tensors, params: for summary.json

    @property
    def update_bytes(self) -> int:
        """The bytes one update sends, in the engine's dtype."""
        return sum(b.nbytes for b in self.buckets)

    def release_views(self) -> None:
        """Drop the planned tensors: held past the setup, a view would keep storage the offload frees."""
        self.weights = None

    def close(self) -> None:
        """The engine (its process too), then the transport; safe to call twice."""
        engine, transport, self.engine, self.transport = self.engine, self.transport, None, None
        close_update(engine, transport)


def open_update_side(
    cfg: Config,
    params: dict[str, torch.Tensor],
    *,
    device: torch.device,
    tokenizer,
    state_bytes: int | None = None,
    probe: Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]] | None = None,
    engine: bool = True,
    cpu_threads: int | None = None,
) -> UpdateSide:
    """The update's side for the trainer's `params` (by parameter name).

    `state_bytes`: what the trainer's offload moves, the size of the host-link floor's probe (None:
    twice the update's bytes read, the weights and their gradients). `probe`: the tensors the auto
    knobs' thread probe copies, made from the update's (None: those themselves; shards: whole
    stand-ins; a benchmark from host: the host copies). `engine`: open the engine here (False: a rank
    without one plans the buckets alone, for the gathers it takes part in). `cpu_threads`: an engine
    process's torch threads."""
    layout = params_layout(params, cfg.model.update_layout)
    weights = update_tensors(params, cfg.model.update_layout, layout)
    read_bytes = sum(t.numel() * t.element_size() for t in weights.values())  # fsdp2: the whole tensors'
    buckets = plan_for(weights, cfg.update, torch_dtype(cfg.rollout.dtype))  # every rank: the gather's order
    side = UpdateSide(layout=layout, weights=weights, buckets=buckets, read_bytes=read_bytes, update_cfg=cfg.update)
    planned = [s.meta for b in buckets for s in b.slots]  # a payload that merges the adapters: not sent
    side.info = {"tensors": len(planned), "params": sum(m.numel for m in planned)}
    if payload_of(cfg.update).engine_lora(cfg) is not None:  # the engine's adapters: all each later update sends
        side.info["adapter_tensors"] = sum(is_adapter(m.name) for m in planned)
    if not engine:
        return side
    side.floors = Floors(
        device,
        update_bytes=side.update_bytes,
        state_bytes=state_bytes or 2 * read_bytes,
        read_bytes=read_bytes,
        source=cfg.update.source,
        dtypes=(torch_dtype(cfg.trainer.dtype), torch_dtype(cfg.rollout.dtype)),
        receiver_copies=engine_class(cfg.rollout.engine).receiver_copies(cfg),  # the engine's own, for its floor
    )
    side.update_cfg, side.resolved = resolve_for_run(
        cfg.update,
        cfg.rollout,
        weights=probe(weights) if probe else weights,
        buckets=buckets,
        device=device,
        model=cfg.model,
    )
    spec = engine_spec(
        cfg.model,
        cfg.rollout,
        device=explicit_device(device),
        tokenizer=tokenizer,
        cpu_threads=cpu_threads,
        lora=payload_of(cfg.update).engine_lora(cfg),  # update.payload=lora: the engine holds the adapters too
    )
    try:
        side.engine, side.transport = open_update(side.update_cfg, spec=spec, buckets=buckets)
    except Exception as err:  # the staging buffers are allocated here: name the bucket size
        if is_out_of_memory(err):
            raise out_of_memory(buckets, cfg.update, "opening the engine and its update buffers") from err
        raise
    return side
