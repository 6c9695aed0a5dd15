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

import torch

from rlsync.config.schema import MIB, Config, to_dict
from rlsync.engines.base import EngineSpec, Generation, answer_ids, engine_class
from rlsync.measure.devices import (
    device_memory_metrics,
    explicit_device,
    reset_run_peaks,
    resolve_device,
    run_device_peaks,
    sampler,
    select_device,
)
from rlsync.measure.limits import Limits
from rlsync.measure.memory import peak_rss_bytes, reset_peak_rss
from rlsync.measure.timing import Stopwatch
from rlsync.model.architecture import params_layout, update_tensors
from rlsync.model.build import build_model, build_tokenizer, named_weights, torch_dtype
from rlsync.record import summary as summaries
from rlsync.record.recorder import Recorder, machine_info
from rlsync.run.memory_check import check_fits, load_runtime
from rlsync.sync import WeightMismatch, is_out_of_memory, open_transport, out_of_memory, plan_for, update_weights
from rlsync.sync.auto import resolve_for_run, resolved_setup
from rlsync.trainer.data_parallel import DataParallel
from rlsync.trainer.grpo import Trainer, group_advantages
from rlsync.trainer.offload import Offloader, link_metrics
from rlsync.trainer.task import Prompt, make_prompts, reward


def run_experiment(cfg: Config, run_dir: Path, *, name: str, group: str, overrides: list[str] = ()) -> dict:
    with DataParallel.from_env() as dp:  # a single process, or one rank of a data-parallel launch
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
        ) as recorder:
            memory = (
                memory_fit(cfg, dp.device(resolve_device(cfg.run.device))) if dp.is_main else None
            )  # before any model
            recorder.start(console_steps=cfg.run.steps, progress=cfg.run.progress, warmup_steps=cfg.run.warmup_steps)
            return Experiment(cfg, recorder, dp=dp, memory=memory).run()


def memory_fit(cfg: Config, device: torch.device) -> dict:
    """The run's peak memory estimated from the config, and what the machine has (rlsync.run.memory_check);
    raises DoesNotFit (exit 2) when it cannot fit, unless run.memory_check=false."""
    reset_peak_rss()  # a multirun's jobs share this process: each job's peak is its own
    reset_run_peaks(device)
    load_runtime(cfg)
    estimate, available = check_fits(cfg, device, memory_check=cfg.run.memory_check)
    return {"estimate": estimate, "available": available}


class Experiment:
    def __init__(
        self,
        cfg: Config,
        recorder: Recorder | None = None,
        *,
        dp: DataParallel | None = None,
        memory: dict | None = None,
    ):
        self.cfg = cfg
        self.recorder = recorder or Recorder(Path("."), enabled=False)  # run dir, files, W&B, signals, summary.json
        self.memory = memory  # run_experiment's estimate: summary.json puts the measured peak beside it
        self.dp = dp or DataParallel()
        self.engine = None  # set by setup() as soon as the engine is open
        self.device = self.dp.device(resolve_device(cfg.run.device))
        self.setup_info: dict = {}
        self.limits: Limits | None = None  # the copy floors, measured by rank 0 in setup()
        self.update_cfg = cfg.update  # rank 0: with its nulls (auto) resolved in setup() (rlsync.sync.auto)
        self.resolved: dict | None = None  # those resolved values and why, for summary.json
        self.offloader: Offloader | None = None  # set by setup()

    def run(self) -> dict:
        """Set up, then the steps, each recorded once finished; the summary however the run ends.

        SIGINT / SIGTERM raise Interrupted here: the step in progress is dropped, the finished ones kept."""
        with self.recorder.steps(
            release=self.close, summarize=self.summary, closing=print_closing, cause=self.dp.failed_rank
        ) as record:  # data parallel: stopped by another rank?
            engine = self.setup()
            for step in range(self.cfg.run.steps):
                if step > 0 and self.limits is not None and self.cfg.run.limit_probe == "every_step":  # rank 0's
                    self.limits.measure()  # the copy floors as the machine is now, outside the step's timing
                record({"step": step, **self.step(step, engine)})
        return self.recorder.result

    def setup(self):
        """Build trainer and engine, measure the copy limits, do the first update, put the trainer to sleep.

        Data parallel: every rank builds a trainer and takes rank 0's weights; rank 0 alone opens the
        engine, measures the limits (the other ranks wait, so the probe has the memory to itself)
        and does the first update.
        """
        cfg, device = self.cfg, self.device
        select_device(device)  # cuda:N: N current before any CUDA work (syncs, events, the allocator)
        self.dp.start(device, timeout_s=cfg.run.rank_timeout_s)  # a single process: nothing to join
        torch.manual_seed(cfg.run.seed)
        self.rng = random.Random(cfg.run.seed)
        self.sampler = sampler(device, cfg.run.seed)  # on the engine's device (the same as the trainer's)
        self.tokenizer = build_tokenizer(cfg.model)
        allowed = self.tokenizer.allowed_ids(cfg.model.vocab_size)

        t0 = time.perf_counter()
        model = build_model(cfg.model, dtype=torch_dtype(cfg.trainer.dtype), device=device, seed=cfg.run.seed)
        self.trainer = Trainer(
            model,
            cfg.trainer,
            allowed_ids=allowed,
            temperature=cfg.rollout.temperature,
            grad_sync=self.dp.all_reduce_grads if self.dp.enabled else None,
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
        self.layout = params_layout(self.params, cfg.model.update_layout)
        weights = update_tensors(self.params, cfg.model.update_layout, self.layout)
        read_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        engine = (
            self.open_transport(allowed, weights, read_bytes) if self.dp.is_main else None
        )  # rank 0 owns the engine and the update
        build_time = time.perf_counter() - t0

        self.setup_info = {
            "build_time": build_time,
            "tensors": len(weights),
            "layout": cfg.model.update_layout,
            "params": sum(t.numel() for t in weights.values()),
            "resolved": self.resolved,
        }
        if engine is not None:
            update_bytes = sum(b.nbytes for b in self.buckets)
            engine.update_weights(weights)  # the engine starts from the trainer's weights
            self.setup_info.update(
                {
                    "update_bytes": update_bytes,
                    "buckets": len(self.buckets),
                    "limits": self.limits.as_dict(),
                    "update_limit_time": self.limits.update_limit,
                }
            )
        del weights  # held past here, a view would keep storage the offload frees
        self.dp.broadcast_weights(model)  # data parallel: every rank starts from rank 0's weights
        # The first sleep moves the whole laid-out state (grads and optimizer state exist, as zeros), so
        # it warms every page of both sides: steps 0 and 1 then cost what later steps cost.
        watch = Stopwatch(device)
        with watch("first_sleep"):
            self.offloader.sleep()
        self.setup_info["offload"] = {**self.offloader.info, "first_sleep_time": watch.seconds["first_sleep"]}
        return engine

    def open_transport(self, allowed: torch.Tensor, weights: dict[str, torch.Tensor], read_bytes: int):
        """The bucket plan of the update, the copy floors, the update's auto knobs resolved (rlsync.sync.auto:
        before the engine opens, so its process gets them), then the rollout engine behind the transport."""
        cfg = self.cfg
        self.buckets = plan_for(weights, cfg.update, torch_dtype(cfg.rollout.dtype))
        self.limits = Limits(
            self.device,
            update_bytes=sum(b.nbytes for b in self.buckets),
            state_bytes=self.offloader.state_bytes or 2 * read_bytes,
            read_bytes=read_bytes,
            source=cfg.update.source,
            dtypes=(torch_dtype(cfg.trainer.dtype), torch_dtype(cfg.rollout.dtype)),
        )
        self.update_cfg, self.resolved = resolve_for_run(
            cfg.update, cfg.rollout, weights=weights, buckets=self.buckets, device=self.device, model=cfg.model
        )
        spec = EngineSpec(
            model=cfg.model,
            rollout=cfg.rollout,
            device=str(explicit_device(self.device)),
            allowed_ids=allowed,
            eos_id=self.tokenizer.eos_id,
            pad_id=self.tokenizer.pad_id,
        )
        try:
            self.engine = open_transport(self.update_cfg, spec=spec, buckets=self.buckets)
        except Exception as err:  # the staging buffers are allocated here: name the bucket size
            if is_out_of_memory(err):
                raise out_of_memory(self.buckets, cfg.update, "opening the engine and its update buffers") from err
            raise
        return self.engine  # run() closes it, even if the rest of the setup fails

    def step(self, step: int, engine) -> dict:
        cfg, watch, dp = self.cfg, Stopwatch(self.device), self.dp
        metrics: dict[str, float] = {}
        gen = advantages = None
        with watch("step"):
            if dp.is_main:  # rank 0 owns the engine: it generates the whole batch
                gen, advantages, rollout_metrics = self.rollout(engine, watch)
            batch_tokens = None  # the loss's token-mean denominator; None: this process's whole batch
            if dp.enabled:  # data parallel: each rank trains whole prompt groups (advantages are per group)
                with watch("batch_scatter"):
                    gen, advantages, batch_tokens = dp.scatter_groups(
                        gen, advantages, group_size=cfg.rollout.samples_per_prompt, device=self.device
                    )

            with watch("wake_up"):
                metrics["perf/wake_up_bytes"] = self.offloader.wake_up()
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
                        gen, old_logp=old_logp, advantages=advantages, ref_logp=ref_logp, batch_tokens=batch_tokens
                    )
                )
            if dp.enabled and cfg.update.verify:  # rank 0's update speaks for every rank only if they agree
                dp.check_same_weights(self.params)
            if cfg.update.source == "host":  # Miles/slime's colocated order: offload, then update
                self.trainer_sleep(watch, metrics)
            if cfg.update.enabled and dp.is_main:
                # The update writes into the engine's weights: allocate them first (release_weights), or
                # wake them where the engine's release always takes them off the device (timed as the
                # engine's resume, not inside the update).
                if cfg.rollout.release_weights or engine_class(cfg.rollout.engine).release_takes_weights:
                    with watch("engine_resume"):
                        engine.resume()
                with watch("update_layout"):  # the update's tensors: per-expert views cost ~10 us each
                    source = self.update_source()
                with watch("update_weights"):
                    metrics.update(
                        update_weights(
                            engine,
                            source,
                            buckets=self.buckets,
                            cfg=self.update_cfg,
                            device=self.device,
                            limit_time=self.limits.update_limit,
                        )
                    )
                del source  # no view outlives the update (the offload frees what it points at)
            if cfg.update.source == "device":
                self.trainer_sleep(watch, metrics)

        mask = gen.response_mask.float()
        # The update's own clock wins over the phase clock: the phase also holds the optional verification.
        metrics = {**watch.totals("perf/{}_time"), **metrics}
        # engine vs trainer log-prob of the same sampled tokens: ~0 iff the last update landed
        metrics["train/logprob_abs_diff"] = ((gen.logprobs - old_logp).abs() * mask).sum().item() / mask.sum().item()
        metrics = dp.gather_metrics(metrics, tokens=mask.sum().item())  # data parallel: each phase the slowest rank's
        if dp.is_main:
            metrics.update(self.offload_metrics(metrics))
            metrics.update(rollout_metrics)
        return metrics

    def trainer_sleep(self, watch: Stopwatch, metrics: dict) -> None:
        with watch("sleep"):
            metrics["perf/sleep_bytes"] = self.offloader.sleep()
        metrics.update(self.device_memory("sleep"))

    def rollout(self, engine, watch: Stopwatch):
        """Generate `samples_per_prompt` answers per prompt and score them: (batch, advantages, rollout metrics)."""
        cfg = self.cfg
        prompts = make_prompts(cfg.rollout.prompts_per_step, rng=self.rng)
        prompt_ids = [self.tokenizer.encode(p.text) for p in prompts for _ in range(cfg.rollout.samples_per_prompt)]
        with watch("engine_resume"):
            engine.resume()  # the engine gets its memory (KV cache, released weights) back
        with watch("rollout"):
            gen = engine.generate(
                prompt_ids,
                max_new_tokens=cfg.rollout.max_response_len,
                temperature=cfg.rollout.temperature,
                generator=self.sampler,
            ).to(self.device)
        with watch("engine_release"):
            engine.release()  # ... and hands it to the trainer until the next rollout
        rewards, advantages = score_rollout(
            gen, prompts, self.tokenizer, group_size=cfg.rollout.samples_per_prompt, device=self.device
        )
        return gen, advantages, rollout_stats(gen, rewards)

    def update_source(self) -> dict[str, torch.Tensor]:
        """The trainer's weights by the update's names: live on the device, or their offloaded host copies.

        Laid out anew each time, from the plan made once (timed as perf/update_layout_time, beside the
        update's own clock): the offload moves each parameter's `.data`, and a per-expert view
        (model.update_layout=checkpoint) keeps the storage it was made of."""
        layout = self.cfg.model.update_layout
        if self.cfg.update.source == "host":
            return update_tensors(self.offloader.host_weights(self.params), layout, self.layout)
        return update_tensors(self.params, layout, self.layout)

    def device_memory(self, phase: str) -> dict[str, float]:
        """On CUDA, what the trainer's sleep hands the engine, and takes back: this process's reserved
        memory and the whole device's used memory (rlsync.measure.devices.device_memory_metrics)."""
        return device_memory_metrics(self.device, phase)

    def offload_metrics(self, m: dict) -> dict:
        """Beside perf/sleep_time and perf/wake_up_time: GB/s, the limit (bytes over the host-link copy
        bandwidth measured in this run; memcpy on a CPU) and the efficiency (limit / time)."""
        return link_metrics(m, self.limits)

    def close(self) -> None:
        """The engine (its process too), then the trainer's pinned twin: a sweep's next job pins its own."""
        try:
            if self.engine is not None:
                self.engine.close()
                self.setup_info["engine_peak_rss_bytes"] = self.engine.engine_peak_rss_bytes
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
        "engine_address": cfg.update.engine_address,  # null: the engine ran on this machine, started by the run
        "max_response_len": cfg.rollout.max_response_len,
        "offload": cfg.trainer.offload,
        "ranks": ranks,  # data-parallel trainer ranks (rank 0 holds the engine)
        "limit_probe": cfg.run.limit_probe,
        "update_layout": cfg.model.update_layout,  # checkpoint: per-expert tensors (as published) | fused
        "update_tensors": setup_info.get("tensors") if cfg.update.enabled else None,
    }
    result = {
        "kind": "run",
        **recorder.progress(steps=cfg.run.steps, warmup_steps=cfg.run.warmup_steps),
        "model": {"name": cfg.model.name, **{k: setup_info.get(k) for k in ("params", "tensors", "update_bytes")}},
        "setup": setup,
        "limits": setup_info.get("limits"),  # at start-up; per step: perf/*_limit_time
        "build_time": setup_info.get("build_time"),
        "offload": setup_info.get("offload"),  # layout, bytes, the buffers' first-touch cost
        "metrics": stats,
        "share": share,
        "verdict": summaries.verdict(share, stats, threshold=cfg.run.verdict_threshold, setup=setup),
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
    if warnings:
        result["warning"] = "; ".join(warnings)
    if memory is not None:
        result["memory"] = memory_record(memory, device, engine_peak=setup_info.get("engine_peak_rss_bytes"))
    return result


def verification(cfg: Config, recorder: Recorder) -> str:
    """off | passed | failed | not run: whether every update was checked to land the trainer's weights."""
    if isinstance(recorder.failure, WeightMismatch):
        return "failed"
    if not (cfg.update.verify and cfg.update.enabled):
        return "off"
    return "passed" if recorder.rows else "not run"


def memory_record(fit: dict, device: torch.device, *, engine_peak: int | None = None) -> dict:
    """The estimate beside the measured peaks, for summary.json: how far off the estimate was.
    `engine_peak`: the engine process's own peak resident set, as its close answered."""
    estimate = fit["estimate"]
    peak = peak_rss_bytes()
    measured = {"peak_rss_bytes": peak}
    if estimate.engine_process and engine_peak:
        measured["engine_peak_rss_bytes"] = engine_peak
    if device_peaks := run_device_peaks(device):  # the whole run's, not the last update's
        measured["device_peak_bytes"] = device_peaks["reserved"]
        measured["device_peak_allocated_bytes"] = device_peaks["allocated"]
    return {
        "estimate": estimate.as_dict(),
        "available": fit["available"],
        "measured": measured,
        "process_estimate_over_peak_rss": estimate.process_bytes / peak if peak else None,
    }


def print_closing(result: dict) -> None:
    """After the last step: the measured steps, the closing table, any warning and the verdict (none if no step finished)."""
    if not result["steps_finished"]:
        return
    out = sys.stdout
    warmup = f"warm-up steps 0-{result['warmup_steps'] - 1} left out" if result["warmup_steps"] else "no warm-up"
    planned = result["steps_requested"] - result["warmup_steps"]
    partial = f" of {planned}, {result['status']}" if result["measured_steps"] < planned else ""
    print(f"\nMeasured steps: {result['measured_steps']}{partial} ({warmup})", file=out)
    print(summaries.closing_table(result["model"]["name"], result["metrics"], result["share"]), file=out)
    if "warning" in result:
        print(f"WARNING: {result['warning']}", file=out)
    print(result["verdict"], file=out)
