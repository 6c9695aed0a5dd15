"""`python -m rlsync.bench [overrides]`: the weight update alone, timed against the copy floor.

    python -m rlsync.bench model=qwen3_0p6b update.transport=ipc
    python -m rlsync.bench -m model=qwen3_0p6b,qwen3_1p7b update.transport=direct,ipc,broadcast

The same config groups as the runner (conf/bench.yaml adds `bench.*`). Only what an update needs is
built: the trainer's weights (trainer dtype, no optimizer, no generation or training, so the 1.7B
model fits a 24 GiB machine) and the engine behind the configured transport, strategy, source and
bucket size. Then `bench.warmup` untimed updates (page faults, thread pools) and `bench.repeats`
timed ones, each through the same `rlsync.update.timed_update` the runner calls.

Written like a run: metrics.jsonl (one row per repeat, warm-up rows included and marked by "step"
< warmup_steps), summary.json (kind "bench": median/min/max, limits, the floor's spread, setup,
per-bucket breakdown, the machine's load and whether the update's times can be trusted), a W&B run,
and a closing table: time, floor, efficiency, bandwidth, peak bytes, pack/transfer/load. It runs on
the threads a run would take (`RunCpu`) and warns about a busy machine as a run does.
What is timed is a target (`bench.target`): each lives in a class with `setup`, `repeat()`,
`breakdown()` and `close()`, so another (the trainer's offload, say) can sit beside `UpdateTarget`.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rlsync.bench.offload import OffloadTarget
from rlsync.bench.stall import StallTarget
from rlsync.bench.vllm_paths import VllmPathsTarget
from rlsync.check.duration import dry_run
from rlsync.check.fit import memory_fit
from rlsync.check.record import memory_record
from rlsync.config.apps import BenchAppConfig
from rlsync.config.compose import CONFIG_PATH, register_configs, to_dict
from rlsync.config.launch import hydra_job, hydra_record
from rlsync.config.validate import checked_config
from rlsync.fmt import MIB, fmt_bytes, fmt_ratio, fmt_seconds, fmt_sig, fmt_spread, markdown_table, plural
from rlsync.measure.devices import resolve_device, select_device
from rlsync.measure.floors import cache_resident_elements, llc_bytes
from rlsync.measure.threads import RunCpu, machine_threads, pooled
from rlsync.measure.timing import settled_heap
from rlsync.model.architecture import update_tensors
from rlsync.model.build import build_model, build_tokenizer, named_weights, torch_dtype
from rlsync.model.lora import adapted
from rlsync.record import summary as summaries
from rlsync.record.recorder import Recorder, machine_info
from rlsync.record.summary import payload_line, stats_over
from rlsync.shell import cli, job_errors
from rlsync.trainer.offload import Offloader
from rlsync.update import timed_update
from rlsync.update.auto import copy_threads_used, resolved_setup
from rlsync.update.payload import payload_bandwidth, payload_floor_line, payload_name, payload_of
from rlsync.update.side import open_update_side

register_configs()


@torch.no_grad()
def change_elements(weights: dict[str, torch.Tensor], share: float, *, seed: int) -> None:
    """Flip the sign of about `share` of each tensor's elements, drawn at random (a zero stays zero)."""
    generator = torch.Generator().manual_seed(seed)
    for tensor in weights.values():
        count = round(share * tensor.numel())
        if count:
            drawn = torch.randint(tensor.numel(), (count,), generator=generator).to(tensor.device)
            picked = torch.unravel_index(drawn, tensor.shape)  # views too (a MoE model's per-expert tensors)
            tensor[picked] = -tensor[picked]  # positions drawn twice flip once: a little under `share`


class UpdateTarget:
    """The weight update: the trainer's weights into the engine, through the configured transport."""

    name = "update"

    def __init__(self, cfg: BenchAppConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.side = self.offloader = None  # the update's side: its engine and transport, once open
        t0 = time.perf_counter()
        model = build_model(cfg.model, dtype=torch_dtype(cfg.trainer.dtype), device=device, seed=cfg.run.seed)
        model = adapted(model, cfg.trainer.lora)  # trainer.lora.rank > 0: the update sends or merges its adapters
        params = named_weights(model)
        # the weights as built: detached, they keep their storage whatever the offload below does to the parameters
        weights = {name: p.detach() for name, p in params.items()}
        layout = cfg.model.update_layout
        source = None
        if cfg.update.source == "host":  # the runner's path: the offloader's host copies (pinned on CUDA)
            self.offloader = Offloader(
                model, None, mode="full", device=device, pin_chunk_bytes=int(cfg.trainer.offload_pin_chunk_mb * MIB)
            )
            self.offloader.offload()
            source = update_tensors(self.offloader.host_weights(params), layout)
        side = open_update_side(
            cfg,
            weights,
            device=device,
            tokenizer=build_tokenizer(cfg.model),
            state_bytes=sum(t.numel() * t.element_size() for t in weights.values()),  # the weights alone
            probe=(lambda weights: source) if source is not None else None,  # the auto knobs time what is read
        )  # update.*=null (auto) resolved before the engine opens
        self.weights = side.weights  # by the update's names (per-expert views in the checkpoint layout)
        self.changed = source if source is not None else self.weights  # what bench.changed_ratio flips
        self.source = payload_of(cfg.update).source(self.changed, cfg)  # a merging payload: W + s*BA, merged as read
        self.side, self.buckets, self.floors = side, side.buckets, side.floors
        self.update_cfg, self.resolved = side.update_cfg, side.resolved
        update_bytes, read_bytes = side.update_bytes, side.read_bytes
        build_time = time.perf_counter() - t0
        self.floor_time = self.floors.update_floor_time
        self.repeats = 0
        self.probe = self.floors.update_probe()  # the same floor, re-timed beside each repeat (a shared machine drifts)
        llc = llc_bytes() if device.type == "cpu" else None  # the CPU copies' last-level cache
        self.setup = {
            "build_time": build_time,
            "update_bytes": update_bytes,
            "read_bytes": read_bytes,
            **side.info,  # tensors, params
            "layout": layout,
            "pooled_tensors": sum(
                pooled(t.numel()) for t in self.weights.values()
            ),  # the planner's cost model reads it
            # the units whose staging fits in half the CPU's last-level cache (the cost model's moved bytes)
            "llc_bytes": llc,
            "cache_resident_elements": cache_resident_elements(
                cfg.update.strategy,
                [t.numel() for t in self.weights.values()],
                [b.numel for b in self.buckets],
                torch_dtype(cfg.rollout.dtype).itemsize,
                llc,
            ),
            "buckets": len(self.buckets),
            "largest_bucket_bytes": max(b.nbytes for b in self.buckets),
            # repeat_probes: how the floor beside each repeat was measured, and how often (filled as they run)
            "limits": {**self.floors.as_dict(), "repeat_probes": self.probe.wins},
            "limit_time": self.floor_time,
            "resolved": self.resolved,  # update.* nulls (auto) as the update ran them, with the reason
        }

    def repeat(self) -> dict[str, float]:
        if self.cfg.bench.changed_ratio:  # untimed: what a training step would have changed since the last repeat
            self.repeats += 1
            change_elements(self.changed, self.cfg.bench.changed_ratio, seed=self.cfg.run.seed + self.repeats)
        floor_time = self.probe.floor_time()
        return timed_update(
            self.side.transport,
            self.source,
            buckets=self.buckets,
            cfg=self.update_cfg,
            device=self.device,
            floor_time=floor_time,
            copy_bandwidth=payload_bandwidth(self.floors, floor_time),  # the same probe: a payload's own floors
        )

    def breakdown(self) -> list[dict]:
        """Per bucket (or tensor) of the last update: bytes and pack/transfer/load seconds."""
        return list(self.side.transport.last_update_buckets) if self.side is not None else []

    def close(self) -> None:
        if self.side is not None:
            self.side.close()  # the engine, then its transport
            self.side = None
        if self.offloader is not None:  # source=host: its pinned twin goes back before the next sweep job
            self.source = self.changed = None
            self.offloader.close()
            self.offloader = None


TARGETS = {
    "update": UpdateTarget,
    "offload": OffloadTarget,
    "stall": StallTarget,
    "vllm_paths": VllmPathsTarget,
}  # bench.target's choices (its rule in rlsync/config/schema.py)


def open_target(cfg: BenchAppConfig, device: torch.device):
    return TARGETS[cfg.bench.target](cfg, device)


# ----------------------------------------------------------------------------------------------
# The benchmark: repeats, files, summary, table
# ----------------------------------------------------------------------------------------------


def run_bench(
    cfg: BenchAppConfig,
    run_dir: Path,
    *,
    name: str,
    group: str,
    overrides: list[str] = (),
    hydra_record: Optional[dict[str, str]] = None,
) -> dict:
    try:
        with Recorder(
            run_dir,
            cfg.wandb,
            name=name,
            group=group,
            job_type="bench",
            config=to_dict(cfg),
            overrides=overrides,
            hydra_record=hydra_record,
        ) as recorder:  # one live run per directory, as the runner's
            device = resolve_device(cfg.run.device)
            memory = memory_fit(cfg, device, bench=True, overrides=list(overrides))  # before any model is built
            # the cores free now, as a run takes them; on a busy machine said before anything is timed
            cpu = RunCpu(cfg.run.cpu_threads, device, what="bench")
            if busy := cpu.start_warning():
                print(f"WARNING: {busy}", flush=True)
            recorder.start()  # W&B and metrics.jsonl; no per-repeat console lines: the table at the end
            with cpu.applied(device):  # its threads, and on a busy machine the update's copy on no more
                return Bench(cfg, recorder, memory=memory, cpu=cpu).run()
    finally:
        gc.collect()  # the next sweep job gets this one's memory back


class Bench:
    def __init__(
        self, cfg: BenchAppConfig, recorder: Recorder, *, memory: Optional[dict] = None, cpu: RunCpu | None = None
    ):
        self.cfg, self.recorder = cfg, recorder
        self.cpu = cpu  # the bench's CPU threads and the machine's load (run_bench)
        self.memory = memory  # the estimate (rlsync.check): summary.json puts the measured peak beside it
        self.device = resolve_device(cfg.run.device)
        self.breakdowns: list[list[dict]] = []  # per timed repeat
        self.setup: dict = {}
        self.target = None

    def run(self) -> dict:
        """`bench.warmup` untimed repeats, then `bench.repeats` timed ones, each recorded; the summary
        however the benchmark ends, the closing table when every repeat finished."""
        cfg = self.cfg
        select_device(self.device)  # cuda:N: N current before any CUDA work (syncs, events, the allocator)
        torch.manual_seed(cfg.run.seed)
        with self.recorder.steps(release=self.close, summarize=self.summary, closing=self.print_table) as record:
            self.target = target = open_target(cfg, self.device)
            self.setup = target.setup
            with settled_heap():  # setup's objects out of the collector's way while the repeats are timed
                for step in range(cfg.bench.warmup + cfg.bench.repeats):
                    row = {"step": step, **target.repeat()}
                    if step >= cfg.bench.warmup:
                        self.breakdowns.append(target.breakdown())
                    record(row)
        return self.recorder.result

    def close(self) -> None:
        if self.target is not None:
            self.target.close()

    def print_table(self, result: dict) -> None:
        if result["status"] == "finished":
            print(target_table(self.cfg.bench.target)(result))
            if "warning" in result:  # a busy machine, a floor that moved: as a run says it
                print(f"WARNING: {result['warning']}")

    def summary(self) -> dict:
        cfg, update, recorder = self.cfg, self.cfg.update, self.recorder
        stats = stats_over(recorder.rows, cfg.bench.warmup)
        cpu = self.cpu.as_dict() if self.cpu else None
        floor = summaries.floor_record(stats)
        result = {
            "kind": "bench",
            "target": cfg.bench.target,
            **recorder.progress(steps=cfg.bench.warmup + cfg.bench.repeats, warmup_steps=cfg.bench.warmup),
            "model": {
                "name": cfg.model.name,
                **{k: self.setup.get(k) for k in ("params", "tensors", "pooled_tensors", "update_bytes")},
            },
            "setup": {
                "scheme": update.scheme,
                "transport": self.setup.get("transport") or update.transport,  # stall: always broadcast
                "payload": payload_name(update),  # what each bucket carried (rlsync/update/payload)
                "payload_kernels": payload_of(update).kernels(str(self.device)),  # which encoded it, and why
                "strategy": update.strategy,
                "bucket_mb": update.bucket_mb,
                "source": update.source,
                "inflight_buckets": update.inflight_buckets,
                **resolved_setup(self.setup.get("resolved"), update),
                "device": str(self.device),
                "engine": cfg.rollout.engine,
                "vllm_reload_mode": cfg.rollout.vllm_reload_mode,  # VLLM_RELOAD_MODE (vLLM 0.34+); null: its default
                "engine_address": update.engine_address,
                "engine_dtype": cfg.rollout.dtype,
                "trainer_dtype": cfg.trainer.dtype,
                "buckets": self.setup.get("buckets"),
                "tensors": self.setup.get("tensors"),
                "layout": self.setup.get("layout"),
                "llc_bytes": self.setup.get("llc_bytes"),
                "cache_resident_elements": self.setup.get("cache_resident_elements"),
                "largest_bucket_bytes": self.setup.get("largest_bucket_bytes"),
                "build_time": self.setup.get("build_time"),
                "copy_threads_used": copy_threads_used(self.setup.get("resolved"), self.device, cpu),
                "cores": machine_threads(),  # the CPU threads this process may run on (its affinity)
            },
            "limits": self.setup.get("limits"),
            "offload": self.setup.get("offload"),  # bench.target=offload: state, bytes, first-touch cost
            "pause": self.setup.get("pause"),  # bench.target=stall: its policies and clients (the recorded key)
            "vllm_paths": self.setup.get("vllm_paths"),  # bench.target=vllm_paths: each path's calls and copies
            "metrics": stats,
            "floor": floor,  # the update's copy floor over the timed repeats, with its spread
            # false: the update ran far below its floor on a busy machine, a broken measurement (no ranking on it)
            **summaries.trust_record(stats, cpu),
            "cpu": cpu,  # the bench's threads and why, the cores, the others' busy cores at start and over it
            "buckets": bucket_medians(self.breakdowns),
            "machine": machine_info(self.device),
            "overrides": recorder.overrides,
            "config": to_dict(cfg),
        }
        if self.memory is not None:
            result["memory"] = memory_record(self.memory, self.device)
        warnings = []
        if result["measured_steps"] < cfg.bench.repeats:
            warnings.append(
                f"only {result['measured_steps']} of {cfg.bench.repeats} timed repeats finished ({recorder.status})"
            )
        warnings += [w for w in ((cpu or {}).get("warning"), summaries.floor_warning(floor, "timed repeats")) if w]
        if (own := getattr(TARGETS.get(cfg.bench.target), "warning", None)) and (line := own(stats)):
            warnings.append(line)  # a target's own (vllm_paths: a path whose update failed its check)
        if not result["verdict_trusted"]:
            warnings.append(f"not trustworthy: {result['verdict_untrusted_reason']} (rerun on a quiet machine)")
        if warnings:
            result["warning"] = "; ".join(warnings)
        return result


def bucket_medians(breakdowns: list[list[dict]]) -> list[dict]:
    """Per bucket: its bytes and the median over the timed repeats of each of its times."""
    if not breakdowns:
        return []
    out = []
    for i, first in enumerate(breakdowns[0]):
        rows = [b[i] for b in breakdowns if i < len(b)]
        entry = {"bucket": i, "bytes": first["bytes"]}
        for key in ("pack_time", "transfer_time", "load_time"):
            values = [r[key] for r in rows if key in r]
            if values:
                entry[key] = statistics.median(values)
        out.append(entry)
    return out


# ----------------------------------------------------------------------------------------------
# The closing table
# ----------------------------------------------------------------------------------------------


def target_table(target: str):
    """The closing table of a target: its class's own `table` where it has one (offload, stall, vllm_paths)."""
    return getattr(TARGETS.get(target), "table", None) or update_table


def peak_phrase(nbytes) -> str:
    """The update's staging peak: "0 (no staging)" where it packs straight into the engine's weights."""
    return "0 (no staging)" if nbytes == 0 else fmt_bytes(nbytes)


def update_table(result: dict) -> str:
    m, s = result["metrics"], result["setup"]

    def med(key: str, which: str = "median"):
        return m.get(key, {}).get(which)

    eff = med("perf/update_weights_efficiency")
    head = [
        "model",
        "transport",
        "strategy",
        "bucket",
        "source",
        "time (median, min to max)",
        "floor (median, min to max)",
        "time / floor",
        "efficiency",
        "GB/s",
        "peak bytes",
        "pack",
        "transfer",
        "load",
    ]
    engine = "" if s.get("engine", "hf") == "hf" else f" ({s['engine']})"  # the engine, where not the default
    row = [
        result["model"]["name"],
        s["transport"] + (" flat" if s["flat_engine_weights"] else "") + engine,
        s["strategy"],
        f"{s['bucket_mb']:g} MiB x{s['buckets']}" if s["strategy"] == "bucketed" else f"per tensor x{s['tensors']}",
        s["source"],
        fmt_spread(*(med("perf/update_weights_time", w) for w in ("median", "min", "max"))),
        fmt_spread(*(med("perf/update_weights_limit_time", w) for w in ("median", "min", "max"))),
        fmt_ratio(1 / eff) if eff else "n/a",
        fmt_sig(eff) if eff else "n/a",  # never "0.00" for an update far from its floor
        fmt_sig(med("perf/update_weights_gbps"), decimals=1),
        peak_phrase(med("perf/update_weights_peak_bytes", "max")),
        *(
            fmt_seconds(med(f"perf/update_weights_{k}_time"))
            if med(f"perf/update_weights_{k}_time") is not None
            else "-"
            for k in ("pack", "transfer", "load")
        ),
    ]
    scheme = f", scheme {s['scheme']}" if s.get("scheme") else ""  # scheme=NAME (rlsync/conf/scheme/)
    out = [
        f"\nWeight update alone{scheme}: {plural(result['measured_steps'], 'timed repeat')} after "
        f"{result['warmup_steps']} warm-up",
        markdown_table(head, [row]),
    ]
    other = med("perf/update_weights_full_bytes") is not None  # a payload other than full
    if s.get("tensors") is not None:
        out.append(
            f"{'A full update sends' if other else 'Each update sent'} {s['tensors']:,} tensors, "
            f"{fmt_bytes(result['model'].get('update_bytes'))} (model.update_layout={s.get('layout')})."
        )
    if other:  # update.payload other than full: what crossed, against the full update
        out.append(payload_line(m, s.get("payload"), s.get("payload_kernels")))
        if floors := payload_floor_line(m):  # its encode and decode against their own floors
            out.append(floors)
    if auto := summaries.auto_line(s):
        out.append(auto)
    buckets = result["buckets"]
    if buckets and s["strategy"] == "bucketed":
        shown = buckets if len(buckets) <= 12 else buckets[:6] + buckets[-6:]
        out.append(f"\nPer bucket (median over repeats){'' if len(shown) == len(buckets) else ', first and last 6'}:")
        out.append(
            markdown_table(
                ["bucket", "bytes", "pack", "transfer", "load"],
                [
                    [
                        str(b["bucket"]),
                        fmt_bytes(b["bytes"]),
                        *(fmt_seconds(b[k]) if k in b else "-" for k in ("pack_time", "transfer_time", "load_time")),
                    ]
                    for b in shown
                ],
            )
        )
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="bench")
def hydra_main(dcfg: DictConfig) -> None:
    hc = HydraConfig.get()
    with job_errors(None):  # an empty hydra.run.dir: one line, nothing written
        run_dir, sweep_dir, name = hydra_job(hc)
    record = hydra_record(dcfg)  # .hydra/: written once the run holds its directory
    with job_errors(
        run_dir, sweep_job=f"{hc.job.num} ({name})" if hc.mode == RunMode.MULTIRUN else None, hydra_record=record
    ):
        cfg = checked_config(dcfg, BenchAppConfig)
        if cfg.run.dry_run:
            dry_run(cfg, " ".join(hc.overrides.task), bench=True)
            return
        run_bench(
            cfg,
            run_dir,
            name=name,
            group=cfg.wandb.group or sweep_dir.name,
            overrides=list(hc.overrides.task),
            hydra_record=record,
        )


def main() -> None:
    cli(hydra_main)


if __name__ == "__main__":
    sys.exit(main())
