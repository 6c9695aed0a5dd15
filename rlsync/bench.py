"""`python -m rlsync.bench [overrides]`: the weight update alone, timed against the copy limit.

    python -m rlsync.bench model=qwen3_0p6b update.transport=ipc
    python -m rlsync.bench -m model=qwen3_0p6b,qwen3_1p7b update.transport=direct,ipc,broadcast

The same config groups as the runner (conf/bench.yaml adds `bench.*`). Only what an update needs is
built: the trainer's weights (trainer dtype, no optimizer, no generation or training, so the 1.7B
model fits a 24 GiB machine) and the engine behind the configured transport, strategy, source and
bucket size. Then `bench.warmup` untimed updates (page faults, thread pools) and `bench.repeats`
timed ones, each through the same `rlsync.sync.update_weights` the runner calls.

Written like a run: metrics.jsonl (one row per repeat, warm-up rows included and marked by "step"
< warmup_steps), summary.json (kind "bench": median/min/max, limits, setup, per-bucket breakdown),
a W&B run, and a closing table: time, limit, efficiency, bandwidth, peak bytes, pack/transfer/load.
What is timed is a target (`bench.target`): each lives in a class with `setup`, `repeat()`,
`breakdown()` and `close()`, so another (the trainer's offload, say) can sit beside `UpdateTarget`.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rlsync.config import BenchAppConfig, register_configs, to_dict
from rlsync.errors import cli, job_errors
from rlsync.fmt import MIB, error_line, fmt_bytes, fmt_seconds, fmt_spread, markdown_table
from rlsync.launcher import hydra_job

register_configs()


class UpdateTarget:
    """The weight update: the trainer's weights into the engine, through the configured transport."""

    name = "update"

    def __init__(self, cfg: BenchAppConfig, device: torch.device):
        from rlsync.limits import Limits
        from rlsync.models import build_model, build_tokenizer, named_weights, torch_dtype
        from rlsync.offload import Offloader
        from rlsync.devices import explicit_device
        from rlsync.engines.base import EngineSpec
        from rlsync.sync import open_engine, plan_for

        self.cfg, self.device = cfg, device
        self.engine = self.offloader = None
        t0 = time.perf_counter()
        model = build_model(cfg.model, dtype=torch_dtype(cfg.trainer.dtype), device=device, seed=cfg.run.seed)
        self.weights = named_weights(model)
        self.source = self.weights
        if cfg.update.source == "host":  # the runner's path: the offloader's host copies (pinned on CUDA)
            self.offloader = Offloader(model, None, mode="full", device=device,
                                       pin_chunk_bytes=int(cfg.trainer.offload_pin_chunk_mb * MIB))
            self.offloader.sleep()
            self.source = self.offloader.host_weights(self.weights)
        self.buckets = plan_for(self.weights, cfg.update, torch_dtype(cfg.rollout.dtype))
        tokenizer = build_tokenizer(cfg.model)
        spec = EngineSpec(model=cfg.model, rollout=cfg.rollout, device=str(explicit_device(device)),
                          allowed_ids=tokenizer.allowed_ids(cfg.model.vocab_size), eos_id=tokenizer.eos_id,
                          pad_id=tokenizer.pad_id)
        self.engine = open_engine(cfg.update, spec=spec, buckets=self.buckets)
        build_time = time.perf_counter() - t0

        update_bytes = sum(b.nbytes for b in self.buckets)
        read_bytes = sum(t.numel() * t.element_size() for t in self.weights.values())
        self.limits = Limits(device, update_bytes=update_bytes, state_bytes=read_bytes)
        self.limit_time = self.limits.update_time(read_bytes, update_bytes, source=cfg.update.source)
        self.probe = CopyProbe(device, update_bytes=update_bytes, read_bytes=read_bytes, source=cfg.update.source)
        self.setup = {
            "build_time": build_time, "update_bytes": update_bytes, "read_bytes": read_bytes,
            "tensors": len(self.weights), "params": sum(t.numel() for t in self.weights.values()),
            "buckets": len(self.buckets), "largest_bucket_bytes": max(b.nbytes for b in self.buckets),
            "limits": self.limits.as_dict(), "limit_time": self.limit_time,
        }

    def repeat(self) -> dict[str, float]:
        from rlsync.sync import update_weights

        return update_weights(self.engine, self.source, buckets=self.buckets, cfg=self.cfg.update, device=self.device,
                              limit_time=self.probe.limit_time())

    def breakdown(self) -> list[dict]:
        """Per bucket (or tensor) of the last update: bytes and pack/transfer/load seconds."""
        return list(getattr(self.engine, "last_update_buckets", []))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.offloader is not None:  # source=host: its pinned twin goes back before the next sweep job
            self.source = None
            self.offloader.close()
            self.offloader = None


class CopyProbe:
    """The plain copy the limit is made of, re-timed right before every repeat.

    On a shared machine the memory bandwidth drifts with the neighbours' load (the limit measured
    once at setup varied 2x between runs here), so each repeat is compared with a copy timed next
    to it: the ratio then speaks about the update, not about the load. Same formulas as
    rlsync.limits (read + written bytes over the same-memory copy bandwidth; the host copy's bytes,
    as they cross the link, over the host->device bandwidth for `source=host` on a GPU); buffers
    allocated and touched once.
    """

    def __init__(self, device: torch.device, *, update_bytes: int, read_bytes: int, source: str):
        from rlsync.limits import PROBE_CAP_BYTES, crosses_host_link, update_floor_bytes

        self.device = device
        host_link = crosses_host_link(source, device.type)
        n = max(MIB, min(update_bytes, PROBE_CAP_BYTES))
        self.src = torch.empty(n, dtype=torch.uint8, device="cpu" if host_link else device, pin_memory=host_link)
        self.src.fill_(1)
        self.dst = torch.empty(n, dtype=torch.uint8, device=device)
        self.dst.copy_(self.src)
        self.moved = n if host_link else 2 * n  # bytes per copy, counted as the bandwidth is
        self.floor_bytes = update_floor_bytes(read_bytes, update_bytes, source=source, device_type=device.type)

    def limit_time(self, tries: int = 3) -> float:
        from rlsync.sync.threads import cpu_threads
        from rlsync.timing import synchronize

        best = float("inf")
        with cpu_threads(1, self.device):  # one thread reaches memcpy speed (rlsync.sync.threads)
            for _ in range(tries):
                synchronize(self.device)
                start = time.perf_counter()
                self.dst.copy_(self.src, non_blocking=True)
                synchronize(self.device)
                best = min(best, time.perf_counter() - start)
        return self.floor_bytes / (self.moved / best)


def _offload_target(cfg: BenchAppConfig, device: torch.device):
    from rlsync.bench_offload import OffloadTarget  # the trainer's sleep + wake-up (rlsync/bench_offload.py)

    return OffloadTarget(cfg, device)


TARGETS = {"update": UpdateTarget, "offload": _offload_target}  # bench.target's choices (its rule in rlsync/config.py)


def open_target(cfg: BenchAppConfig, device: torch.device):
    return TARGETS[cfg.bench.target](cfg, device)


# ----------------------------------------------------------------------------------------------
# The benchmark: repeats, files, summary, table
# ----------------------------------------------------------------------------------------------


def run_bench(cfg: BenchAppConfig, run_dir: Path, *, name: str, group: str, overrides: list[str] = ()) -> dict:
    from rlsync.runlock import RunLock
    from rlsync.sinks import wandb_run

    try:
        with RunLock(run_dir), wandb_run(cfg.wandb, run_dir=run_dir, name=name, group=group, config=to_dict(cfg),
                                         job_type="bench") as wb:  # one live run per directory, as the runner's
            return Bench(cfg, run_dir, overrides=list(overrides)).run(wb)
    finally:
        gc.collect()  # the next sweep job gets this one's memory back


class Bench:
    def __init__(self, cfg: BenchAppConfig, run_dir: Path, *, overrides: list[str]):
        from rlsync.experiment import resolve_device

        self.cfg, self.run_dir, self.overrides = cfg, run_dir, overrides
        self.device = resolve_device(cfg.run.device)
        self.rows: list[dict] = []
        self.breakdowns: list[list[dict]] = []  # per timed repeat
        self.status, self.error = "running", None
        self.setup: dict = {}

    def run(self, wb) -> dict:
        from rlsync.sinks import MetricsFile

        from rlsync.devices import select_device

        cfg = self.cfg
        select_device(self.device)  # cuda:N: N current before any CUDA work (syncs, events, the allocator)
        torch.manual_seed(cfg.run.seed)
        metrics_file = MetricsFile(self.run_dir)
        target = None
        try:
            target = open_target(cfg, self.device)
            self.setup = target.setup
            for step in range(cfg.bench.warmup + cfg.bench.repeats):
                row = {"step": step, **target.repeat()}
                if step >= cfg.bench.warmup:
                    self.breakdowns.append(target.breakdown())
                self.rows.append(row)
                metrics_file.write(row)
                wb.log(row)
            self.status = "finished"
        except BaseException as err:
            self.status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
            self.error = error_line(err)
            raise
        finally:
            metrics_file.close()
            try:
                if target is not None:
                    target.close()
            finally:
                result = self.write_summary()
                wb.summarize(result)
                if self.status == "finished":
                    print(target_table(cfg.bench.target)(result))
        return result

    def write_summary(self) -> dict:
        from rlsync.experiment import machine_info
        from rlsync.sinks import write_json
        from rlsync.summary import stats_over

        cfg, update = self.cfg, self.cfg.update
        measured = sum(1 for r in self.rows if r["step"] >= cfg.bench.warmup)
        result = {
            "kind": "bench",
            "target": cfg.bench.target,
            "status": self.status,
            "error": self.error,
            "steps_requested": cfg.bench.warmup + cfg.bench.repeats,
            "steps_finished": len(self.rows),
            "warmup_steps": cfg.bench.warmup,
            "measured_steps": measured,
            "model": {"name": cfg.model.name, **{k: self.setup.get(k) for k in ("params", "tensors", "update_bytes")}},
            "setup": {"transport": update.transport, "strategy": update.strategy, "bucket_mb": update.bucket_mb,
                      "source": update.source, "inflight_buckets": update.inflight_buckets,
                      "flat_engine_weights": update.flat_engine_weights, "device": str(self.device),
                      "engine": cfg.rollout.engine, "engine_address": update.engine_address,
                      "engine_dtype": cfg.rollout.dtype, "trainer_dtype": cfg.trainer.dtype,
                      "buckets": self.setup.get("buckets"), "tensors": self.setup.get("tensors"),
                      "largest_bucket_bytes": self.setup.get("largest_bucket_bytes"),
                      "build_time": self.setup.get("build_time")},
            "limits": self.setup.get("limits"),
            "offload": self.setup.get("offload"),  # bench.target=offload: state, bytes, first-touch cost
            "metrics": stats_over(self.rows, cfg.bench.warmup),
            "buckets": bucket_medians(self.breakdowns),
            "machine": machine_info(self.device),
            "overrides": self.overrides,
            "config": to_dict(cfg),
        }
        if measured < cfg.bench.repeats:
            result["warning"] = f"only {measured} of {cfg.bench.repeats} timed repeats finished ({self.status})"
        write_json(self.run_dir / "summary.json", result)
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
    """The closing table of a target: its own where it has one."""
    if target == "offload":
        from rlsync.bench_offload import OffloadTarget

        return OffloadTarget.closing_table
    return closing_table


def closing_table(result: dict) -> str:
    m, s = result["metrics"], result["setup"]

    def med(key: str, which: str = "median"):
        return m.get(key, {}).get(which)

    eff = med("perf/update_weights_efficiency")
    head = ["model", "transport", "strategy", "bucket", "source", "time (median, min to max)", "limit",
            "time / limit", "efficiency", "GB/s", "peak bytes", "pack", "transfer", "load"]
    engine = "" if s.get("engine", "hf") == "hf" else f" ({s['engine']})"  # the engine, where not the default
    row = [result["model"]["name"], s["transport"] + (" flat" if s["flat_engine_weights"] else "") + engine, s["strategy"],
           f"{s['bucket_mb']:g} MiB x{s['buckets']}" if s["strategy"] == "bucketed" else f"per tensor x{s['tensors']}",
           s["source"], fmt_spread(*(med("perf/update_weights_time", w) for w in ("median", "min", "max"))),
           fmt_seconds(med("perf/update_weights_limit_time")), f"{1 / eff:.2f}x" if eff else "n/a",
           f"{eff:.2f}" if eff else "n/a", f"{med('perf/update_weights_gbps') or 0:.1f}",
           fmt_bytes(med("perf/update_weights_peak_bytes", "max")),
           *(fmt_seconds(med(f"perf/update_weights_{k}_time")) if med(f"perf/update_weights_{k}_time") is not None else "-"
             for k in ("pack", "transfer", "load"))]
    out = [f"\nWeight update alone: {result['measured_steps']} timed repeats after {result['warmup_steps']} warm-up",
           markdown_table(head, [row])]
    buckets = result["buckets"]
    if buckets and s["strategy"] == "bucketed":
        shown = buckets if len(buckets) <= 12 else buckets[:6] + buckets[-6:]
        out.append(f"\nPer bucket (median over repeats){'' if len(shown) == len(buckets) else ', first and last 6'}:")
        out.append(markdown_table(["bucket", "bytes", "pack", "transfer", "load"],
                                  [[str(b["bucket"]), fmt_bytes(b["bytes"]),
                                    *(fmt_seconds(b[k]) if k in b else "-" for k in ("pack_time", "transfer_time", "load_time"))]
                                   for b in shown]))
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench")
def hydra_main(dcfg: DictConfig) -> None:
    from rlsync.validate import checked_config

    hc = HydraConfig.get()
    run_dir, sweep_dir, name = hydra_job(hc)
    with job_errors(run_dir, sweep_job=f"{hc.job.num} ({name})" if hc.mode == RunMode.MULTIRUN else None):
        cfg = checked_config(dcfg, BenchAppConfig)
        run_bench(cfg, run_dir, name=name, group=cfg.wandb.group or sweep_dir.name, overrides=list(hc.overrides.task))


def main() -> None:
    cli(hydra_main)


if __name__ == "__main__":
    sys.exit(main())
