"""How long a run (or a benchmark) will take, roughly, before it starts: for a sweep's plan and dry run.

A step is the model's work at this machine's rates, measured in a fraction of a second before the
sweep (`Rates.measure`: a matmul in the trainer's dtype, a large copy): generation reads the engine's
weights once per new token and does 2 FLOPs per parameter and token; log-probs 2, training 6 (the
backward twice the forward); the offload and the update move their bytes at the copy rate. Small
models are dominated by per-layer overheads instead (Python, kernel launches, thread wake-ups),
calibrated on this project's 2-core CPU with the tiny model (OVERHEAD_S). The estimate is a plan,
not a measurement: a sweep's ETA replaces it with the jobs' measured durations as they finish.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rlsync.check.estimate import DTYPE_BYTES, param_count, prompt_tokens
from rlsync.config.schema import Config
from rlsync.model.build import torch_dtype

STARTUP_S = 12.0  # imports, W&B, the engine, the first copy-floor probe (the tiny default run: 13 s in all)
# Per layer: each generated token (decode), each micro-batch's log-probs and its training step. Calibrated on
# 2 CPU cores with the tiny model (4 layers: 0.18 s rollout, 0.05 s log-probs, 0.17 s train per step).
# A model's matmuls reach about this share of a square 1024 matmul's rate (attention, norms, narrower
# shapes): Qwen3-0.6B bf16 on 2 CPU cores trained at 0.37 of it and scored log-probs at 0.55.
MODEL_FLOP_SHARE = 0.4
OVERHEAD_S = {
    "cpu": {"decode": 1.4e-3, "logprobs": 6e-3, "train": 20e-3},
    "cuda": {"decode": 2e-4, "logprobs": 1e-3, "train": 3e-3},
}


@dataclass
class Rates:
    """The FLOP/s a model's matmuls reach here (in a dtype) and copy bytes/s, measured on `device`."""

    flops: float
    copy_bytes_s: float
    device: str

    @classmethod
    def measure(cls, device: torch.device, dtype: str = "float32") -> Rates:
        n = 1024
        a = torch.randn(n, n, device=device, dtype=torch_dtype(dtype))
        a @ a  # warm-up: thread pools, kernels
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < 0.15:
            a @ a
            sync()
            reps += 1
        flops = MODEL_FLOP_SHARE * 2 * n**3 * reps / elapsed
        src = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        sync()
        start = time.perf_counter()
        for _ in range(3):
            dst.copy_(src)
        sync()
        return cls(flops=flops, copy_bytes_s=3 * src.numel() / (time.perf_counter() - start), device=device.type)


def step_seconds(cfg: Config, rates: Rates) -> float:
    """One step of `cfg`: generation, log-probs, training, the update and the offload both ways."""
    m, r, t = cfg.model, cfg.rollout, cfg.trainer
    params = param_count(m)
    batch = r.prompts_per_step * r.samples_per_prompt
    prompt = prompt_tokens()
    tokens = batch * (prompt + r.max_response_len)
    micro_batches = -(-batch // t.micro_batch_size)
    over = OVERHEAD_S["cuda" if rates.device == "cuda" else "cpu"]
    layers = m.num_hidden_layers
    engine_bytes = params * DTYPE_BYTES[r.dtype]
    state_bytes = params * DTYPE_BYTES[t.dtype] * 4  # weights, grads, two AdamW moments
    decode = r.max_response_len * (
        max(engine_bytes / rates.copy_bytes_s, 2 * params * batch / rates.flops) + layers * over["decode"]
    )
    prefill = 2 * params * batch * prompt / rates.flops
    passes = 2 if t.kl_coef > 0 else 1  # the reference's log-probs too
    logprobs = passes * (2 * params * tokens / rates.flops + micro_batches * layers * over["logprobs"])
    train = (
        6 * params * tokens / rates.flops
        + micro_batches * layers * over["train"]
        + 2 * state_bytes / rates.copy_bytes_s
    )
    moves = (2 * state_bytes if t.offload != "none" else 0) + engine_bytes  # offload, onload, the update
    return decode + prefill + logprobs + train + moves / rates.copy_bytes_s


def job_seconds(cfg: Config, rates: Rates, *, bench: bool = False) -> float:
    """A whole job: start-up, the build, and its steps (a benchmark: its warm-up and timed updates)."""
    build = param_count(cfg.model) * DTYPE_BYTES[cfg.trainer.dtype] * 6 / rates.copy_bytes_s  # init, state, engine
    if bench:
        repeats = cfg.bench.warmup + cfg.bench.repeats
        update = param_count(cfg.model) * DTYPE_BYTES[cfg.rollout.dtype] * 3 / rates.copy_bytes_s
        return STARTUP_S + build + repeats * update
    return STARTUP_S + build + cfg.run.steps * step_seconds(cfg, rates)


_MACHINES: dict = {}  # device -> Machine, and (device, dtype) -> Rates: measured once per process


def preview(cfg: Config, *, bench: bool = False, fresh: bool = False) -> tuple[str | None, float | None]:
    """(why the job would be refused for memory now, or None; its estimated seconds) for a validated `cfg`.
    The memory available is measured once per process (a sweep's plan checks its jobs against one moment);
    `fresh` measures it again: on a shared machine it moves, and a job checks again when it starts."""
    from rlsync.check.estimate import bench_estimate, estimate
    from rlsync.check.fit import machine_for
    from rlsync.measure.devices import resolve_device

    device = resolve_device(cfg.run.device)
    if fresh or str(device) not in _MACHINES:
        _MACHINES[str(device)] = machine_for(device)
    machine = _MACHINES[str(device)]
    est = (bench_estimate if bench else estimate)(cfg, cuda=machine.cuda, runtime_bytes=machine.runtime_bytes)
    if cfg.run.memory_check and (short := machine.shortfalls(est, str(device))):
        return f"does not fit: {'; '.join(short)}", None
    key = (str(device), cfg.trainer.dtype)
    if key not in _MACHINES:
        _MACHINES[key] = Rates.measure(device, cfg.trainer.dtype)
    return None, job_seconds(cfg, _MACHINES[key], bench=bench)


def fmt_duration(seconds: float) -> str:
    """ "45 s", "12 min", "2.5 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def dry_run(cfg: Config, overrides: str, *, bench: bool = False) -> None:
    """run.dry_run=true on one job: whether it fits and how long it would take; nothing is built."""
    import sys

    from rlsync.check.fit import load_runtime

    load_runtime(cfg)  # the runtime the job would have, so the memory check is the job's own
    refused, seconds = preview(cfg, bench=bench)
    what = f"({overrides or 'defaults'})"
    if refused:
        print(f"rlsync: dry run {what}: would be refused: {refused}", file=sys.stderr, flush=True)
    else:
        print(
            f"rlsync: dry run {what}: fits; estimated {fmt_duration(seconds)} (rough: rlsync.check.duration); "
            f"nothing started",
            file=sys.stderr,
            flush=True,
        )
