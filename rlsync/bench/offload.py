"""The trainer's offload and onload alone, timed against the host-link floor.

    python -m rlsync.bench bench.target=offload model=qwen3_0p6b
    python -m rlsync.bench bench.target=offload model=qwen3_0p6b trainer.offload=drop_grads
    python -m rlsync.bench bench.target=offload model=qwen3_0p6b trainer.offload_memory=twin  # CUDA's layout on a CPU
    python -m rlsync.bench bench.target=offload model=qwen3_1p7b bench.offload_state=params  # fits 24 GiB

Only the state is built: the model in the trainer dtype, AdamW, and the offloader's layout (grads
and optimizer state created up front, then filled from the weights so nothing is a zero page; no
forward, backward or optimizer step, so a 1.7B state costs seconds to build, not minutes). One
repeat is one sleep and one wake-up, each with the device synchronized, and reported exactly like
the runner's step: perf/sleep_time, perf/wake_up_time, _bytes, _gbps, _limit_time, _efficiency;
each against a plain copy probed just before it (`LinkProbe`), since a shared machine's bandwidth
drifts. summary.json's `limits` keep the runner's start-up probe beside them.

`OffloadTarget` is the `bench.target=offload` of `python -m rlsync.bench` (files, W&B, sweeps);
`bench_offload()` is the same measurement as a plain function for scripts and tests.
"""

from __future__ import annotations

import gc
import statistics
import time
from types import SimpleNamespace

import torch

from rlsync.config.schema import ModelConfig
from rlsync.fmt import MIB, fmt_bytes, fmt_seconds, fmt_spread, markdown_table
from rlsync.measure.devices import device_memory_metrics
from rlsync.measure.floors import Floors, best_copy_seconds
from rlsync.measure.metrics import phase_named
from rlsync.measure.timing import Stopwatch
from rlsync.model.build import build_model, torch_dtype
from rlsync.trainer.offload import PIN_CHUNK_BYTES, Offloader, empty_host_cache, link_metrics

STATES = ("trainer", "params")
PROBE_BYTES = 256 * 2**20  # well above a CPU's last-level cache (a DRAM copy), and little memory beside a 19 GB state
PHASES = (phase_named("sleep"), phase_named("wake_up"))  # the table calls each by its short name


class LinkProbe:
    """A plain copy of PROBE_BYTES each way, timed right before each sleep and wake-up (best of 3).

    The bandwidth of a shared machine drifts with what other processes copy, so a floor probed once
    at start-up can sit in a quiet moment while the repeats do not. Probing beside
    each repeat compares the offload with the copy the machine can do at that moment.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.on_device = torch.ones(PROBE_BYTES, dtype=torch.uint8, device=device)
        self.on_host = torch.ones(PROBE_BYTES, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def bandwidth(self, dst: torch.Tensor, src: torch.Tensor, tries: int = 3) -> float:
        """Payload bytes per second, one way."""
        return PROBE_BYTES / best_copy_seconds(dst, src, tries, budget_s=0.0, warm_up=False)  # touched at init

    def to_host(self) -> float:
        return self.bandwidth(self.on_host, self.on_device)

    def to_device(self) -> float:
        return self.bandwidth(self.on_device, self.on_host)


class OffloadState:
    """A trainer's state on `device`, laid out by an Offloader, with the floors measured beside it."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        *,
        device: torch.device,
        trainer_dtype: str = "float32",
        mode: str = "full",
        state: str = "trainer",
        memory: str = "auto",
        segment_bytes: int = 128 * MIB,
        free_device: bool | None = None,
        seed: int = 0,
        pin_chunk_bytes: int = PIN_CHUNK_BYTES,
    ):
        self.device = device
        t0 = time.perf_counter()
        self.model = build_model(model_cfg, dtype=torch_dtype(trainer_dtype), device=device, seed=seed)
        weights = list(dict.fromkeys(self.model.parameters()))
        weight_bytes = sum(p.numel() * p.element_size() for p in weights)
        # Probed before the state exists, so the probe's buffers never sit beside two copies of it.
        self.floors = Floors(
            device, update_bytes=weight_bytes, state_bytes=weight_bytes * (4 if state == "trainer" else 1)
        )
        self.optimizer = torch.optim.AdamW(weights, lr=1e-5) if state == "trainer" else None
        self.offloader = Offloader(
            self.model,
            self.optimizer,
            mode=mode,
            device=device,
            memory=memory,
            segment_bytes=segment_bytes,
            free_device=free_device,
            pin_chunk_bytes=pin_chunk_bytes,
        )
        fill_state_(self.model, self.optimizer)
        self.probe = LinkProbe(device)
        self.setup = {
            "build_time": time.perf_counter() - t0,
            "params": sum(p.numel() for p in weights),
            "tensors": len(weights),
            "limits": self.floors.as_dict(),
            "offload": {
                "state": state,
                "trainer_dtype": trainer_dtype,
                "weight_bytes": weight_bytes,
                "state_bytes": self.offloader.state_bytes,
                "threads": torch.get_num_threads(),
                **self.offloader.info,
            },
        }

    def cycle(self) -> dict[str, float]:
        """One sleep and one wake-up: the runner's perf/sleep_* and perf/wake_up_* metrics, each against
        the copy bandwidth probed just before it."""
        watch, m = Stopwatch(self.device), {}
        link = SimpleNamespace(to_host=self.probe.to_host())
        with watch("sleep"):
            m["perf/sleep_bytes"] = self.offloader.offload()
        m.update(device_memory_metrics(self.device, "sleep"))
        link.to_device = self.probe.to_device()
        with watch("wake_up"):
            m["perf/wake_up_bytes"] = self.offloader.onload()
        m.update(device_memory_metrics(self.device, "wake_up"))
        m.update(watch.totals("perf/{}_time"))
        return {**m, **link_metrics(m, link)}

    def close(self) -> None:
        self.model = self.optimizer = self.offloader = self.probe = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        empty_host_cache(self.device)  # the twin's pinned chunks, cached by torch until handed back


@torch.no_grad()
def fill_state_(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Grads and optimizer moments from the weights (memcpy speed): real bytes, as after a step."""
    if optimizer is None:
        return
    for p in dict.fromkeys(model.parameters()):
        if p.grad is not None:
            p.grad.copy_(p)
        for value in optimizer.state[p].values():
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                value.copy_(p)


def bench_offload(
    model_cfg: ModelConfig, *, repeats: int = 5, warmup: int = 1, device: torch.device | None = None, **state_kwargs
) -> dict:
    """Time `warmup` + `repeats` offload/onload cycles of a model's state; returns {"rows", "summary"}.

    `state_kwargs` go to OffloadState (trainer_dtype, mode, state, memory, segment_bytes, free_device, seed).
    """
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bench = OffloadState(model_cfg, device=device, **state_kwargs)
    try:
        rows = [{"step": i, **bench.cycle()} for i in range(warmup + repeats)]
    finally:
        bench.close()
    return {
        "rows": rows,
        "summary": {
            "model": model_cfg.name,
            "device": str(device),
            "warmup": warmup,
            "repeats": repeats,
            **bench.setup,
            **summarize(rows[warmup:]),
        },
    }


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per direction (sleep, wake_up): bytes, median/min/max seconds, GB/s at the median, the median floor
    and the median efficiency (each repeat against the floor probed beside it)."""
    out = {}
    for phase in (p.name for p in PHASES):
        times = [r[f"perf/{phase}_time"] for r in rows]
        median, nbytes = statistics.median(times), rows[0][f"perf/{phase}_bytes"]
        efficiency = statistics.median(r[f"perf/{phase}_efficiency"] for r in rows)  # each against its own probe
        out[phase] = {
            "bytes": nbytes,
            "time": median,
            "min": min(times),
            "max": max(times),
            "gbps": nbytes / median / 1e9,
            "limit_time": statistics.median(r[f"perf/{phase}_limit_time"] for r in rows),
            "efficiency": efficiency,
            "time_over_limit": 1 / efficiency,
        }
    return out


def table(summaries: list[dict]) -> str:
    """Markdown: one row per (model, direction) of `bench_offload` summaries."""
    head = [
        "model",
        "state",
        "mode",
        "memory",
        "direction",
        "bytes",
        "time (median, min to max)",
        "floor",
        "time / floor",
        "GB/s",
        "first touch",
    ]
    rows = []
    for s in summaries:
        o = s["offload"]
        for phase in PHASES:
            d = s[phase.name]
            rows.append(
                [
                    s["model"],
                    o.get("state", "?"),
                    o.get("mode", "?"),
                    o.get("memory", "?"),
                    phase.short,
                    fmt_bytes(d["bytes"]),
                    fmt_spread(d["time"], d["min"], d["max"]),
                    fmt_seconds(d["limit_time"]),
                    f"{d['time_over_limit']:.2f}x",
                    f"{d['gbps']:.1f}",
                    fmt_seconds(o.get("host_first_touch_time")),
                ]
            )
    return markdown_table(head, rows)


class OffloadTarget:
    """`bench.target=offload` for rlsync.bench: one repeat = one sleep + one wake-up."""

    name = "offload"

    def __init__(self, cfg, device: torch.device):
        self.state = OffloadState(
            cfg.model,
            device=device,
            trainer_dtype=cfg.trainer.dtype,
            mode=cfg.trainer.offload,
            state=cfg.bench.offload_state,
            memory=cfg.trainer.offload_memory,
            segment_bytes=int(cfg.trainer.offload_segment_mb * MIB),
            free_device=cfg.trainer.offload_free_device,
            seed=cfg.run.seed,
            pin_chunk_bytes=int(cfg.trainer.offload_pin_chunk_mb * MIB),
        )
        self.setup = self.state.setup

    def repeat(self) -> dict[str, float]:
        return self.state.cycle()

    def breakdown(self) -> list[dict]:
        return []  # whole-segment copies each way: nothing finer to show

    def close(self) -> None:
        self.state.close()

    @staticmethod
    def table(result: dict) -> str:
        """The bench's closing table for this target, from its summary.json (medians over the timed repeats)."""
        m = result["metrics"]

        def median(key: str, which: str = "median") -> float:
            return m.get(key, {}).get(which, float("nan"))

        summary = {"model": result["model"]["name"], "offload": result.get("offload") or {}}
        for phase in (p.name for p in PHASES):
            summary[phase] = {
                "bytes": median(f"perf/{phase}_bytes"),
                "time": median(f"perf/{phase}_time"),
                "min": median(f"perf/{phase}_time", "min"),
                "max": median(f"perf/{phase}_time", "max"),
                "gbps": median(f"perf/{phase}_gbps"),
                "limit_time": median(f"perf/{phase}_limit_time"),
                "time_over_limit": 1 / median(f"perf/{phase}_efficiency"),
            }
        return (
            f"\nTrainer offload alone: {result['measured_steps']} timed repeats after {result['warmup_steps']} "
            f"warm-up\n" + table([summary])
        )
