"""The step loop. Each step, as in a colocated GRPO run on one device:

1. the rollout engine generates `samples_per_prompt` answers per prompt;
2. the trainer is loaded back onto the device (onload, "wake up");
3. the trainer computes log-probs of the sampled tokens, then trains one step;
4. the trainer copies its new weights into the rollout engine (the weight update);
5. the trainer moves its state to host memory (offload, "sleep").

Every phase is timed with the device synchronized at its boundaries.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from rlsync.check.fit import memory_fit
from rlsync.check.record import memory_record
from rlsync.config.compose import to_dict
from rlsync.config.schema import Config
from rlsync.engines.base import EngineHandle, Generation, answer_ids, engine_class
from rlsync.fmt import MIB
from rlsync.measure.devices import (
    device_memory_metrics,
    resolve_device,
    sampler,
    select_device,
)
from rlsync.measure.floors import Floors, GatherFloor, LinkShare
from rlsync.measure.memory import peak_rss_bytes
from rlsync.measure.threads import RunCpu, machine_threads
from rlsync.measure.timing import Stopwatch, settled_heap
from rlsync.model.architecture import update_tensors
from rlsync.model.build import build_model, build_tokenizer, named_weights, torch_dtype
from rlsync.model.lora import adapted
from rlsync.record import summary as summaries
from rlsync.record.recorder import Recorder, machine_info
from rlsync.run.roles import Roles
from rlsync.trainer.data_parallel import DataParallel
from rlsync.trainer.grpo import Trainer, group_advantages
from rlsync.trainer.offload import Offloader, link_metrics
from rlsync.trainer.parallel import Parallel, parallel_class, parallel_for
from rlsync.trainer.task import Prompt, make_prompts, reward
from rlsync.update import (
    WeightMismatch,
    follow_update,
    timed_update,
)
from rlsync.update.auto import copy_threads_used, resolved_setup
from rlsync.update.base import Transport
from rlsync.update.gather import StandIns
from rlsync.update.payload import payload_bandwidth, payload_name, payload_of, recorded_class
from rlsync.update.side import UpdateSide, open_update_side


def run_experiment(
    cfg: Config,
    run_dir: Path,
    *,
    name: str,
    group: str,
    overrides: list[str] = (),
    hydra_record: Optional[dict[str, str]] = None,
) -> dict:
    with DataParallel.from_env() as dp:  # noqa: SIM117 - a single process, or one rank of a data-parallel launch
        # Ranks > 0 train their share and write nothing: rank 0 records every step. Rank 0 holds the
        # run directory: a second live run in it stops here, touching nothing.
        with Recorder(
            run_dir,
            cfg.wandb,
            name=name,
            group=group,
            job_type="run",
            config=to_dict(cfg),
            overrides=overrides,
            enabled=dp.is_main,
            hydra_record=hydra_record,  # .hydra/, once the directory is held
        ) as recorder:
            memory = (
                memory_fit(cfg, dp.device(resolve_device(cfg.run.device)), overrides=list(overrides))
                if dp.is_main
                else None
            )  # before any model
            device = dp.device(resolve_device(cfg.run.device))
            cpu = RunCpu(cfg.run.cpu_threads, device)  # the cores free now: a busy machine is not oversubscribed
            if dp.is_main and (busy := cpu.start_warning()):  # with the numbers it is about, as the closing WARNING
                print(f"WARNING: {busy}", flush=True)
            recorder.start(console_steps=cfg.run.steps, progress=cfg.run.progress, warmup_steps=cfg.run.warmup_steps)
            with cpu.applied(device):  # its threads, and on a busy machine the update's copy on no more
                return Experiment(cfg, recorder, dp=dp, memory=memory, cpu=cpu).run()


class Experiment:
    def __init__(
        self,
        cfg: Config,
        recorder: Recorder | None = None,
        *,
        dp: DataParallel | None = None,
        memory: dict | None = None,
        cpu: RunCpu | None = None,
    ):
        self.cfg = cfg
        self.cpu = cpu  # the run's CPU threads and the machine's load (run_experiment)
        self.recorder = recorder or Recorder(Path("."), enabled=False)  # run dir, files, W&B, signals, summary.json
        self.memory = memory  # run_experiment's estimate: summary.json puts the measured peak beside it
        self.dp = dp or DataParallel()
        self.roles = Roles(self.dp, placement=cfg.rollout.placement)  # this rank's part in each phase
        self.device = self.dp.device(resolve_device(cfg.run.device))
        self.side: UpdateSide | None = None  # the update's tensors, plan, floors, knobs, engine and transport: setup()
        self.setup_info: dict = {}
        self.offloader: Offloader | None = None  # set by setup()
        self.parallel: Parallel | None = None  # trainer.parallel as this process runs it, set by setup()
        self.gather_floor: GatherFloor | None = None  # fsdp2: the gather's floor, measured by every rank
        self.link_share: LinkShare | None = None  # data parallel: the offload's floor, every rank copying at once

    @property
    def floors(self) -> Floors | None:
        """The copy floors, measured by the ranks with an engine in setup()."""
        return self.side.floors if self.side else None

    def run(self) -> dict:
        """Set up, then the steps, each recorded once finished; the summary however the run ends.

        SIGINT / SIGTERM raise Interrupted here: the step in progress is dropped, the finished ones kept."""
        with self.recorder.steps(
            release=self.close, summarize=self.summary, closing=print_closing, cause=self.dp.failed_rank
        ) as record:  # data parallel: stopped by another rank?
            engine, transport = self.setup()
            with settled_heap():  # setup's objects out of the collector's way while the steps are timed
                for step in range(self.cfg.run.steps):
                    if step > 0 and self.cfg.run.limit_probe == "every_step":  # outside the step's timing
                        probed = time.perf_counter()
                        self.probe_floors()
                        self.probe_time = time.perf_counter() - probed  # left out of the engine's idle time
                    record({"step": step, **self.step(step, engine, transport)})
        return self.recorder.result

    def setup(self) -> Transport | None:
        """Build trainer and engine, measure the copy floors, do the first update, offload the trainer.

        Data parallel: every rank builds a trainer and takes rank 0's weights (before trainer.parallel wraps
        or shards the model); rank 0 alone opens the engine (every rank its own with rollout.placement=
        every_rank), measures the copy floors (the other ranks wait, so the probe has the memory to itself)
        and does the first update. Under fsdp2 every rank then measures the gather's floor and gathers.
        """
        cfg, device = self.cfg, self.device
        select_device(device)  # cuda:N: N current before any CUDA work (syncs, events, the allocator)
        self.dp.start(device, timeout_s=cfg.run.rank_timeout_s)  # a single process: nothing to join
        torch.manual_seed(cfg.run.seed)
        self.rng = random.Random(cfg.run.seed)
        self.generation_ended: float | None = None  # when the last rollout's last token came (perf_counter)
        # From then to this step's first token: perf/engine_idle_time and the parts this step's row carries
        # (the engine's release and resumes, the time between the steps: docs/metrics.md, "The engine's idle time")
        self.engine_idle: dict[str, float] | None = None
        self.idle_release = self.idle_wake = 0.0  # since the last token: the release, the wake before the update
        self.step_ended: float | None = None  # when the last step's clock stopped (perf_counter)
        self.probe_time: float | None = None  # the floors' probe before this step (run.limit_probe=every_step)
        # on the engine's device (the same as the trainer's); one engine per rank: each samples its own stream
        self.sampler = sampler(device, cfg.run.seed + (self.dp.rank if self.roles.every_rank else 0))
        self.tokenizer = build_tokenizer(cfg.model)

        t0 = time.perf_counter()
        model = build_model(cfg.model, dtype=torch_dtype(cfg.trainer.dtype), device=device, seed=cfg.run.seed)
        model = adapted(model, cfg.trainer.lora)  # trainer.lora.rank > 0: PEFT's adapters train, the base is frozen
        self.dp.broadcast_weights(model)  # data parallel: every rank starts from rank 0's weights, before any sharding
        self.parallel = parallel_for(cfg.trainer.parallel, world=self.dp.world, device=device)
        self.roles.sharded = self.parallel.sharded
        self.trainer = Trainer(
            model,
            cfg.trainer,
            allowed_ids=self.tokenizer.allowed_ids(cfg.model.vocab_size),
            temperature=cfg.rollout.temperature,
            parallel=self.parallel,
        )
        self.offloader = Offloader(
            model,
            self.trainer.optimizer,
            mode=cfg.trainer.offload,
            device=device,
            memory=cfg.trainer.offload_memory,
            segment_bytes=int(cfg.trainer.offload_segment_mb * MIB),
            free_device=cfg.trainer.offload_free_device,
            pin_chunk_bytes=int(cfg.trainer.offload_pin_chunk_mb * MIB),
        )
        self.params = named_weights(model)  # by parameter name: what the offload moves and data parallel compares
        # The update's names and views (model.update_layout), planned once; the views are made anew for
        # each update (update_source) and never kept: a view would hold the storage the offload frees.
        self.side = side = open_update_side(
            cfg,
            self.params,
            device=device,
            tokenizer=self.tokenizer,
            state_bytes=self.offloader.state_bytes,
            probe=StandIns if self.parallel.sharded else None,  # shards: the probe copies whole stand-ins
            engine=self.roles.has_engine,
            cpu_threads=torch.get_num_threads(),  # an engine process uses the run's threads (run.cpu_threads)
        )  # run() closes its engine and transport, even if the rest of the setup fails
        if self.parallel.sharded:  # every rank, once the engines are open: an all-gather of the update's bytes
            self.gather_floor = GatherFloor(side.read_bytes, dtype=torch_dtype(cfg.trainer.dtype), device=device)
        if self.dp.enabled and self.offloader.state_bytes:  # every rank: its share of the link, all at once
            self.link_share = LinkShare(self.offloader.state_bytes, device=device)
        build_time = time.perf_counter() - t0

        self.setup_info = {
            "build_time": build_time,
            **side.info,
            "layout": cfg.model.update_layout,
            "resolved": side.resolved,
        }
        side.release_views()  # held past here, a view would keep storage the offload frees
        source = self.update_source(live=True)  # fsdp2: shards, gathered as the engine reads them (every rank alike)
        if side.transport is not None:
            side.transport.update_weights(source)  # the engine starts from the trainer's weights
            self.setup_info.update(
                {
                    "update_bytes": side.update_bytes,
                    "buckets": len(side.buckets),
                    "limits": {
                        **side.floors.as_dict(),
                        **(self.gather_floor.as_dict() if self.gather_floor else {}),
                        **(self.link_share.as_dict() if self.link_share else {}),
                    },
                    "update_limit_time": side.floors.update_floor_time,
                }
            )
        elif self.parallel.sharded:
            source.drain()  # the gathers rank 0's engine reads, in step with it
        del source
        # The first sleep moves the whole laid-out state (grads and optimizer state exist, as zeros), so
        # it warms every page of both sides: steps 0 and 1 then cost what later steps cost.
        watch = Stopwatch(device)
        with watch("first_sleep"):
            self.offloader.offload()
        self.setup_info["offload"] = {**self.offloader.info, "first_sleep_time": watch.seconds["first_sleep"]}
        return side.engine, side.transport

    def probe_floors(self) -> None:
        """run.limit_probe=every_step: the floors again before a step, as the machine is now."""
        if self.floors is not None:  # the ranks with an engine
            self.floors.measure()  # the copy floors
        if self.gather_floor is not None:  # every rank at once: a collective
            self.gather_floor.measure()
        if self.link_share is not None:  # every rank at once: each one's share of the host link
            self.link_share.measure()

    def step(self, step: int, engine: EngineHandle | None, transport: Transport | None) -> dict:
        """One GRPO step: rollout, wake the trainer, log-probs, train, then the update and the offload."""
        cfg, watch = self.cfg, Stopwatch(self.device)
        metrics: dict[str, float] = {}
        with watch("step"):
            self.step_started = time.perf_counter()  # the device synchronized: the step's clock runs
            batch = self.roles.rollout(
                lambda groups: self.rollout(engine, watch, groups),
                watch,
                prompts=cfg.rollout.prompts_per_step,
                group_size=cfg.rollout.samples_per_prompt,
                device=self.device,
            )
            gen = batch.gen
            with watch("wake_up"):
                metrics["perf/wake_up_bytes"] = self.offloader.onload()
            metrics.update(self.device_memory("wake_up"))
            with watch("log_probs"):
                old_logp = self.trainer.log_probs(gen)  # [batch, resp_len]
            ref_logp = None
            if self.trainer.reference is not None:
                with watch("ref_log_probs"):
                    ref_logp = self.trainer.log_probs(gen, reference=True)
            with watch("train"):
                metrics.update(
                    self.trainer.train_step(
                        gen,
                        old_logp=old_logp,
                        advantages=batch.advantages,
                        ref_logp=ref_logp,
                        batch_tokens=batch.batch_tokens,
                    )
                )
            self.roles.check_replicas(self.params, verify=cfg.update.verify)  # ddp: the replicas must agree
            if cfg.update.source == "host":  # Miles/slime's colocated order: offload, then update
                self.trainer_offload(watch, metrics)
            if cfg.update.enabled:
                self.update(engine, transport, watch, metrics)
            if cfg.update.source == "device":
                self.trainer_offload(watch, metrics)
        self.step_ended = time.perf_counter()  # from here to the next step's start: perf/engine_idle_between_time

        mask = gen.response_mask.float()
        # The update's own clock wins over the phase clock: the phase also holds the optional verification.
        metrics = {**watch.totals("perf/{}_time"), **metrics}
        if self.engine_idle is not None:  # this rank's engine, since the previous step's rollout ended
            metrics.update(self.engine_idle)
            self.engine_idle = None
        # engine vs trainer log-prob of the same sampled tokens: ~0 iff the last update landed
        metrics["train/logprob_abs_diff"] = ((gen.logprobs - old_logp).abs() * mask).sum().item() / mask.sum().item()
        metrics["perf/host_peak_rss_gb"] = peak_rss_bytes() / 1e9  # ranks: the largest rank's
        metrics.update(batch.rollout_metrics)
        metrics = self.roles.merge_metrics(metrics, tokens=mask.sum().item(), answers=batch.generated)
        metrics.update(self.offload_metrics(metrics))
        return metrics

    def update(self, engine: EngineHandle | None, transport: Transport | None, watch: Stopwatch, metrics: dict) -> None:
        """The weight update into this rank's engine, if it has one; from shards (fsdp2) every rank gathers."""
        cfg, error = self.cfg, None
        if self.roles.takes_update():
            # The update writes into the engine's weights: wake them first where the engine's release
            # took them off the device at this rollout.release_level (timed as the engine's resume, not
            # inside the update).
            if engine is not None and engine_class(cfg.rollout.engine).release_takes_weights(
                cfg.rollout.release_level, self.device.type
            ):
                with watch("engine_resume"):
                    engine.resume()
                self.idle_wake += watch.last  # a part of the engine's idle time (the next row's)
            with watch("update_layout"):  # the update's tensors: per-expert views cost ~10 us each
                source = self.update_source()
            with watch("update_weights"):
                try:
                    metrics.update(self.send(transport, source))
                except WeightMismatch as err:
                    error = err
            del source  # no view outlives the update (the offload frees what it points at)
            payload = payload_of(cfg.update)
            if payload.after_update_phase:  # the payload's own check after the update (Payload.after_update)
                with watch(payload.after_update_phase):
                    metrics.update(payload.after_update(self.params, cfg))
        self.roles.agree(error, verify=cfg.update.verify)

    def send(self, transport: Transport | None, source: dict[str, torch.Tensor]) -> dict[str, float]:
        """The update's own metrics: through the transport, or (no engine here) the same gathers as the
        engines' ranks take part in."""
        side = self.side
        gather_floor_time = self.gather_floor.time(side.read_bytes) if self.gather_floor is not None else 0.0
        if transport is None:
            return follow_update(source, cfg=side.update_cfg, gather_floor_time=gather_floor_time)
        metrics = timed_update(
            transport,
            source,
            buckets=side.buckets,
            cfg=side.update_cfg,
            device=self.device,
            floor_time=side.floors.update_floor_time,
            gather_floor_time=gather_floor_time,
            copy_bandwidth=payload_bandwidth(side.floors),  # a payload's encode and decode against their floors
        )
        if self.cfg.update.verify:
            metrics["update/verified_engines"] = 1
        return metrics

    def trainer_offload(self, watch: Stopwatch, metrics: dict) -> None:
        with watch("sleep"):
            metrics["perf/sleep_bytes"] = self.offloader.offload()
        metrics.update(self.device_memory("sleep"))

    def rollout(self, engine: EngineHandle, watch: Stopwatch, groups: slice = slice(None)):
        """Generate `samples_per_prompt` answers per prompt and score them: (batch, advantages, rollout metrics).
        `groups`: this rank's prompts (one engine per rank); every rank draws the same prompts, then takes its own."""
        cfg = self.cfg
        prompts = make_prompts(cfg.rollout.prompts_per_step, rng=self.rng)[groups]
        prompt_ids = [self.tokenizer.encode(p.text) for p in prompts for _ in range(cfg.rollout.samples_per_prompt)]
        with watch("engine_resume"):
            engine.resume()  # the engine gets its memory (KV cache, released weights) back
        resumed = watch.last
        started = time.perf_counter()  # the engine resumed (synchronized): generation starts now
        with watch("rollout"):
            gen = engine.generate(
                prompt_ids,
                max_new_tokens=cfg.rollout.max_response_len,
                temperature=cfg.rollout.temperature,
                generator=self.sampler,
            ).to(self.device)
        if self.generation_ended is not None:  # the engine generated nothing since the last rollout's end
            # rlsync's own floor probe (run.limit_probe=every_step) is left out: a framework does not pay it
            self.engine_idle = {
                "perf/engine_idle_time": started - self.generation_ended - (self.probe_time or 0.0),
                "perf/engine_idle_release_time": self.idle_release,  # the last step's, after its rollout
                "perf/engine_idle_resume_time": self.idle_wake + resumed,  # before the last update, and now
                "perf/engine_idle_between_time": self.step_started - self.step_ended - (self.probe_time or 0.0),
            }  # the last step's trainer phases in between are its own row's (metrics.IDLE_PARTS)
            if self.probe_time is not None:  # beside the idle time, not a part of it
                self.engine_idle["perf/engine_idle_probe_time"] = self.probe_time
        self.generation_ended = time.perf_counter()
        with watch("engine_release"):
            engine.release()  # ... and hands it to the trainer until the next rollout
        self.idle_release, self.idle_wake = watch.last, 0.0
        rewards, advantages = score_rollout(
            gen, prompts, self.tokenizer, group_size=cfg.rollout.samples_per_prompt, device=self.device
        )
        return gen, advantages, rollout_stats(gen, rewards)

    def update_source(self, *, live: bool = False) -> dict[str, torch.Tensor]:
        """The trainer's weights by the update's names: live on the device, or their offloaded host copies.

        Laid out anew each time, from the plan made once (timed as perf/update_layout_time, beside the
        update's own clock): the offload moves each parameter's `.data`, and a per-expert view
        (model.update_layout=checkpoint) keeps the storage it was made of. `live`: the live weights whatever
        update.source says (the first update, before the trainer ever slept)."""
        layout, payload = self.cfg.model.update_layout, payload_of(self.cfg.update)
        if self.cfg.update.source == "host" and not live:
            weights = update_tensors(self.offloader.host_weights(self.params), layout, self.side.layout)
            return payload.source(weights, self.cfg)  # a merging payload: W + s*BA, merged as read
        weights = self.parallel.update_source(  # fsdp2: the shards, gathered bucket by bucket as they are read
            self.params,
            layout=layout,
            plan=self.side.layout,
            buckets=self.side.buckets,
            gather=self.cfg.update.gather,
            call_bytes=self.gather_floor.call_bytes if self.gather_floor is not None else None,
        )
        return payload.source(weights, self.cfg)

    def device_memory(self, phase: str) -> dict[str, float]:
        """On CUDA, what the trainer's offload hands the engine, and takes back: this process's reserved
        memory and the whole device's used memory (rlsync.measure.devices.device_memory_metrics)."""
        return device_memory_metrics(self.device, phase)

    def offload_metrics(self, m: dict) -> dict:
        """Beside perf/sleep_time and perf/wake_up_time: GB/s, the floor (bytes over the host-link copy
        bandwidth measured in this run; memcpy on a CPU) and the efficiency (floor / time). Data parallel:
        against the rank's share of the link."""
        if not self.dp.is_main:  # rank 0 alone records
            return {}
        return link_metrics(m, self.link_share or self.floors)

    def close(self) -> None:
        """The engine (its process too), then the trainer's pinned twin: a sweep's next job pins its own."""
        try:
            if self.side is not None and self.side.engine is not None:
                engine = self.side.engine
                self.side.close()  # the engine, then its transport
                self.setup_info["engine_peak_rss_bytes"] = engine.peak_rss_bytes  # as its close() answered
        finally:
            if self.offloader is not None:
                self.offloader.close()

    def summary(self) -> dict:
        """summary.json from what the recorder kept and what setup() found."""
        return run_summary(
            self.cfg,
            self.recorder,
            setup_info=self.setup_info,
            device=self.device,
            ranks=self.dp.world,
            memory=self.memory,
            cpu=self.cpu.as_dict() if self.cpu else None,
        )


# ----------------------------------------------------------------------------------------------
# Scoring a rollout
# ----------------------------------------------------------------------------------------------


def score_rollout(
    gen: Generation, prompts: list[Prompt], tokenizer, *, group_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards ([batch], host: they come from decoded text) and GRPO advantages ([batch], on `device`,
    where the loss meets them), for `gen` (on any device) answering each prompt `group_size` times."""
    answers = [tokenizer.decode(ids) for ids in answer_ids(gen)]
    targets = [p.target for p in prompts for _ in range(group_size)]
    rewards = torch.tensor([reward(a, t) for a, t in zip(answers, targets)], device="cpu")  # [batch]
    return rewards, group_advantages(rewards, group_size).to(device)


def rollout_stats(gen: Generation, rewards: torch.Tensor) -> dict[str, float]:
    """The rollout's mean reward, mean answer length and share of answers cut at max_response_len."""
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/response_len_mean": gen.response_mask.float().sum(1).mean().item(),
        "rollout/truncated_ratio": gen.truncated.float().mean().item(),
    }


# ----------------------------------------------------------------------------------------------
# The run's summary.json and closing lines
# ----------------------------------------------------------------------------------------------


def run_summary(
    cfg: Config,
    recorder: Recorder,
    *,
    setup_info: dict,
    device: torch.device,
    ranks: int = 1,
    memory: dict | None = None,
    cpu: dict | None = None,
) -> dict:
    """summary.json of a run (kind "run"): medians after warm-up, shares, verdict, verification, warnings."""
    rows, status = recorder.rows, recorder.status
    stats = summaries.stats_over(rows, cfg.run.warmup_steps)
    share = summaries.shares(stats)
    setup = {
        "scheme": cfg.update.scheme,
        "transport": cfg.update.transport,
        "strategy": cfg.update.strategy,
        "bucket_mb": cfg.update.bucket_mb,
        "source": cfg.update.source,
        "inflight_buckets": cfg.update.inflight_buckets,
        **resolved_setup(setup_info.get("resolved"), cfg.update),
        "device": str(device),
        "engine": cfg.rollout.engine,
        "vllm_reload_mode": cfg.rollout.vllm_reload_mode,  # VLLM_RELOAD_MODE (vLLM 0.34+); null: vLLM's default
        "release_level": cfg.rollout.release_level,  # what the engine's release gives back (vLLM's levels)
        "payload": payload_name(cfg.update),  # what each bucket carried: update.payload (rlsync/update/payload)
        "payload_kernels": payload_of(cfg.update).kernels(str(device)),  # which encoded and decoded it, and why
        "engine_address": cfg.update.engine_address,  # null: the engine ran on this machine, started by the run
        "max_response_len": cfg.rollout.max_response_len,
        "offload": cfg.trainer.offload,
        "ranks": ranks,  # data-parallel trainer ranks
        "parallel": cfg.trainer.parallel if ranks > 1 else "none",  # how they share the model (trainer.parallel)
        "placement": cfg.rollout.placement if ranks > 1 else "rank0",  # rank0: one engine | every_rank: one per rank
        "gather": cfg.update.gather if ranks > 1 and parallel_class(cfg.trainer.parallel).sharded else None,
        "limit_probe": cfg.run.limit_probe,
        "update_layout": cfg.model.update_layout,  # checkpoint: per-expert tensors (as published) | fused
        "update_tensors": setup_info.get("tensors") if cfg.update.enabled else None,
        "adapter_tensors": setup_info.get("adapter_tensors"),  # update.payload=lora: what each later update sends
        "copy_threads_used": copy_threads_used(setup_info.get("resolved"), device, cpu),
        "cores": machine_threads(),  # the CPU threads this process may run on (its affinity)
    }
    trust = summaries.trust_record(stats, cpu)
    floor = summaries.floor_record(stats)
    result = {
        "kind": "run",
        **recorder.progress(steps=cfg.run.steps, warmup_steps=cfg.run.warmup_steps),
        "model": {"name": cfg.model.name, **{k: setup_info.get(k) for k in ("params", "tensors", "update_bytes")}},
        "setup": setup,
        "limits": setup_info.get("limits"),  # at start-up; per step: perf/*_limit_time
        "build_time": setup_info.get("build_time"),
        "offload": setup_info.get("offload"),  # layout, bytes, the buffers' first-touch cost
        "metrics": stats,
        "engine_idle": summaries.engine_idle(rows, cfg.run.warmup_steps),  # its parts from the same intervals
        "share": share,
        "verdict": summaries.verdict(
            share,
            stats,
            threshold=cfg.run.verdict_threshold,
            setup=setup,
            untrusted=trust["verdict_untrusted_reason"],
        ),
        **trust,  # verdict_trusted, verdict_untrusted_reason
        "floor": floor,  # the update's copy floor over the measured steps, with its spread
        "machine": machine_info(device),
        "overrides": recorder.overrides,
        "config": to_dict(cfg),
    }
    result["verification"] = verification(cfg, recorder)
    warnings = []
    measured, planned = result["measured_steps"], cfg.run.steps - cfg.run.warmup_steps
    if measured < planned:
        warnings.append(f"only {measured} of {planned} measured steps finished ({status}): these numbers are partial")
    if result["verification"] == "failed":
        warnings.append(
            f"the weight update's verification failed at step {len(rows)} ({recorder.failure}): "
            f"the engine did not get the trainer's weights, so do not trust this run's update numbers"
        )
    if cpu is not None:
        result["cpu"] = cpu
        if cpu.get("warning"):
            warnings.append(cpu["warning"])
    if noisy := summaries.noise_warning(stats):
        warnings.append(noisy)
    if moved := summaries.floor_warning(floor, "measured steps"):
        warnings.append(moved)
    if warnings:
        result["warning"] = "; ".join(warnings)
    if memory is not None:
        rank_peaks = [row["perf/host_peak_rss_gb"] for row in rows if "perf/host_peak_rss_gb" in row]
        result["memory"] = memory_record(
            memory,
            device,
            engine_peak=setup_info.get("engine_peak_rss_bytes"),
            rank_peak=int(max(rank_peaks) * 1e9) if ranks > 1 and rank_peaks else None,
        )
    return result


def verification(cfg: Config, recorder: Recorder) -> str:
    """off | passed | failed | not run: whether every update was checked to land the trainer's weights."""
    if isinstance(recorder.failure, WeightMismatch):
        return "failed"
    if not (cfg.update.verify and cfg.update.enabled):
        return "off"
    return "passed" if recorder.rows else "not run"


def print_closing(result: dict) -> None:
    """After the last step: the measured steps, the closing table, any warning and the verdict (none if no step finished)."""
    if not result["steps_finished"]:
        return
    out = sys.stdout
    warmup = {0: "no warm-up", 1: "warm-up step 0 left out"}.get(
        result["warmup_steps"], f"warm-up steps 0-{result['warmup_steps'] - 1} left out"
    )
    planned = result["steps_requested"] - result["warmup_steps"]
    partial = f" of {planned}, {result['status']}" if result["measured_steps"] < planned else ""
    print(f"\nMeasured steps: {result['measured_steps']}{partial} ({warmup})", file=out)
    print(
        summaries.closing_table(
            result["model"]["name"], result["metrics"], result["share"], result["setup"], result.get("engine_idle")
        ),
        file=out,
    )
    if auto := summaries.auto_line(result["setup"], ("copy_threads",)):  # the copy's threads and why
        print(auto, file=out)
    if "warning" in result:
        print(f"WARNING: {result['warning']}", file=out)
    print(result["verdict"], file=out)
    line = summaries.payload_line(
        result["metrics"], result["setup"].get("payload"), result["setup"].get("payload_kernels")
    )
    if line:
        print(line, file=out)
    if result.get("verification") == "passed":
        payload = recorded_class(result["setup"].get("payload"))
        matched = payload.verified if payload else "the trainer's"  # FP8: quantized, then dequantized
        print(f"Verified: after every update the engine's weights matched {matched} (update.verify=true).", file=out)
