"""The machine check: the estimate (rlsync.check.estimate) against what this machine has, before any
model is built; refused in one line (DoesNotFit, exit 2) with the overrides that would fit."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from rlsync.check.estimate import (
    MARGIN_FRACTION,
    MARGIN_MIN,
    Estimate,
    Ranks,
    bench_estimate,
    estimate,
    param_count,
)
from rlsync.config.schema import Config, ModelConfig
from rlsync.errors import BadInput
from rlsync.fmt import GIB
from rlsync.measure.devices import reset_run_peaks
from rlsync.measure.memory import (
    device_available_bytes,
    host_available_bytes,
    reset_peak_rss,
    rss_bytes,
)
from rlsync.model.install_check import check_companions
from rlsync.trainer.parallel import parallel_class, parallels_with


def load_runtime(cfg: Config) -> None:
    """Import what the run imports before it builds anything, so the resident set measured next is
    the runtime the run will have (the engine process loads the same)."""
    check_companions()  # a torchvision built for another torch breaks the import below: say so in one line
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM  # noqa: F401 - the lazy module is most of it

    import rlsync.engines.hf
    import rlsync.trainer.grpo
    import rlsync.update  # noqa: F401

    if cfg.wandb.mode != "disabled":
        with contextlib.suppress(ImportError):
            import wandb  # noqa: F401


# ----------------------------------------------------------------------------------------------
# The check
# ----------------------------------------------------------------------------------------------


class DoesNotFit(BadInput):
    """The run's estimated peak exceeds what the machine has: refused before any model is built."""


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def margin_bytes(nbytes: int) -> int:
    """What is kept free beside an estimate of `nbytes`."""
    return max(MARGIN_MIN, int(nbytes * MARGIN_FRACTION))


@dataclass
class Machine:
    """What a configuration is checked against: the memory available and the runtime already loaded."""

    cuda: bool
    runtime_bytes: int
    host_bytes: int | None  # available (MemAvailable), the runtime already taken out of it
    device_bytes: int | None  # free on the device
    ranks: Ranks = Ranks()  # the data-parallel launch: ranks on this machine share its RAM

    def shortfalls(self, est: Estimate, device_name: str = "device") -> list[str]:
        """Where `est` (with its margin) does not fit, one phrase each; empty when it fits."""
        where = []
        # this process's runtime is loaded: not part of what is available (the other ranks' may not be yet)
        loaded = est.process["runtime"]
        need_host = est.host_bytes - loaded
        if self.host_bytes is not None and need_host + margin_bytes(est.host_bytes) > self.host_bytes:
            trainer = est.process.get("trainer_state", 0) + est.device.get("trainer_state", 0)
            state = f" (trainer state {gib(trainer)}{' per rank' if self.ranks.world > 1 else ''})" if trainer else ""
            ranks = (
                f" for its {1 + est.other_ranks} ranks here (rank 0 {gib(est.host_bytes - est.other_ranks * sum(est.other_rank.values()))}, "
                f"each other {gib(sum(est.other_rank.values()))})"
                if est.other_ranks
                else ""
            )
            where.append(
                f"host memory: estimated peak {gib(est.host_bytes)}{ranks}{state} + "
                f"{gib(margin_bytes(est.host_bytes))} margin, {gib(self.host_bytes + loaded)} available"
            )
        if self.device_bytes is not None and est.device_bytes + margin_bytes(est.device_bytes) > self.device_bytes:
            where.append(
                f"{device_name} memory: estimated peak {gib(est.device_bytes)} + "
                f"{gib(margin_bytes(est.device_bytes))} margin, {gib(self.device_bytes)} free"
            )
        return where

    def fits(self, est: Estimate) -> bool:
        return not self.shortfalls(est)

    def estimate(self, cfg: Config, *, bench: bool = False) -> Estimate:
        """`cfg`'s estimate on this machine (the run's, or the benchmark's: one process)."""
        if bench:
            return bench_estimate(cfg, cuda=self.cuda, runtime_bytes=self.runtime_bytes)
        return estimate(cfg, cuda=self.cuda, runtime_bytes=self.runtime_bytes, ranks=self.ranks)


# What a run can change to need less, each a config override and what it saves; the check keeps the ones
# that fit (alone, or all together) and says so.
def _savings(cfg: Config, ranks: Ranks = Ranks()) -> list[tuple[str, str, object]]:
    out = []
    sharding = parallels_with(spans_ranks=True, sharded=True)  # the modes whose class declares a sharded state
    if ranks.world > 1 and not parallel_class(cfg.trainer.parallel).sharded and sharding:
        out.append(
            (
                f"trainer.parallel={sharding[0]}",
                "shards the trainer's state over the ranks",
                ("trainer", "parallel", sharding[0]),
            )
        )
    if ranks.local > 1 and cfg.rollout.placement == "every_rank":
        out.append(
            (
                "rollout.placement=rank0",
                "one engine on this machine, not one per rank",
                ("rollout", "placement", "rank0"),
            )
        )
    if cfg.trainer.dtype == "float32":
        out.append(
            (
                "trainer.dtype=bfloat16",
                "halves the trainer's weights, grads and AdamW state",
                ("trainer", "dtype", "bfloat16"),
            )
        )
    if cfg.trainer.offload_memory == "twin":
        out.append(("trainer.offload_memory=move", "no host twin of the state", ("trainer", "offload_memory", "move")))
    if cfg.run.limit_probe == "every_step":
        out.append(
            (
                "run.limit_probe=start",
                "the copy-floor probe once, before the first step",
                ("run", "limit_probe", "start"),
            )
        )
    if cfg.rollout.max_response_len > 256:  # long answers: the KV cache and the activations grow with them
        shorter = max(32, cfg.rollout.max_response_len // 4)
        out.append(
            (f"rollout.max_response_len={shorter}", "a smaller KV cache", ("rollout", "max_response_len", shorter))
        )
    if cfg.trainer.micro_batch_size > 1:
        micro = max(1, cfg.trainer.micro_batch_size // 4)
        out.append(
            (
                f"trainer.micro_batch_size={micro}",
                "fewer activations per backward",
                ("trainer", "micro_batch_size", micro),
            )
        )
    return out


def _with(cfg: Config, changes) -> Config:
    new = copy.deepcopy(cfg)
    for part, name, value in changes:
        setattr(getattr(new, part), name, value)
    return new


def shipped_models() -> list[ModelConfig]:
    """The model presets of conf/model/, smallest first (what `model=...` picks)."""
    from omegaconf import OmegaConf

    import rlsync.conf

    models = []
    for path in sorted((Path(rlsync.conf.__file__).parent / "model").glob("*.yaml")):
        node = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
        models.append(OmegaConf.to_object(node))
    return sorted(models, key=param_count)


@dataclass
class Suggestion:
    """A change the check tried and found to fit: overrides of the same command, or the benchmark's command."""

    overrides: list[str]
    why: str = ""
    command: str = "python -m rlsync"

    def __str__(self) -> str:
        if self.command != "python -m rlsync":
            return f"{self.why}: {self.command} {' '.join(self.overrides)}".strip()
        return " ".join(self.overrides) + (f" ({self.why})" if self.why else "")


def suggestions(cfg: Config, machine: Machine, *, bench: bool = False, overrides: list[str] = ()) -> list[Suggestion]:
    """What to change, each checked: the same estimate with the change fits `machine` with its margin.
    `overrides`: the command line's, which the benchmark's suggested command repeats (its config is the run's)."""

    def fits(c: Config) -> bool:
        return machine.fits(machine.estimate(c, bench=bench))

    savings = [] if bench else _savings(cfg, machine.ranks)
    found = [Suggestion([o], why) for o, why, change in savings if fits(_with(cfg, [change]))]
    if not found and len(savings) > 1 and fits(_with(cfg, [c for _, _, c in savings])):
        found.append(Suggestion([o for o, _, _ in savings], "together"))
    if not found:  # the model itself is the cost: the largest smaller preset that fits, alone or with the savings
        for model in reversed([m for m in shipped_models() if param_count(m) < param_count(cfg.model)]):
            alone = _with(cfg, [])
            alone.model = model
            if fits(alone):
                found.append(Suggestion([f"model={model.name}"]))
                break
            if fits(_with(alone, [c for _, _, c in savings])):
                found.append(Suggestion([f"model={model.name}", *(o for o, _, _ in savings)]))
                break
    if not bench and machine.fits(machine.estimate(cfg, bench=True)):
        same = [o for o in overrides if not o.lstrip("+~").startswith("hydra")] or [f"model={cfg.model.name}"]
        found.append(Suggestion(same, "the update alone", command="python -m rlsync.bench"))
    return found


def advice(cfg: Config, machine: Machine, *, bench: bool = False, overrides: list[str] = ()) -> str:
    found = suggestions(cfg, machine, bench=bench, overrides=overrides)
    if not found:
        return "nothing smaller in this configuration fits this machine; run it where more memory is free"
    return "try " + "; ".join(map(str, found))


def machine_for(device) -> Machine:
    """This process's machine, after `load_runtime`: the runtime measured now, what is available."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.init()  # its host-side context is part of the runtime
    return Machine(
        cuda=cuda,
        runtime_bytes=rss_bytes(),
        host_bytes=host_available_bytes(),
        device_bytes=device_available_bytes(device),
        ranks=Ranks.launched(),
    )


def check_fits(
    cfg: Config, device, *, memory_check: bool = True, bench: bool = False, overrides: list[str] = ()
) -> tuple[Estimate, dict]:
    """The run's estimate and what the machine has; raises DoesNotFit when it cannot fit with the margin.

    Call after `load_runtime` and before any model is built. `bench`: python -m rlsync.bench's estimate."""
    machine = machine_for(device)
    est = machine.estimate(cfg, bench=bench)
    available = {"host_bytes": machine.host_bytes, "device_bytes": machine.device_bytes}
    if memory_check:
        where = machine.shortfalls(est, str(device))
        if where:
            raise DoesNotFit(
                f"this {'benchmark' if bench else 'run'} does not fit: {'; '.join(where)} (model {cfg.model.name}, "
                f"{param_count(cfg.model) / 1e9:.2f}B parameters, trainer.dtype={cfg.trainer.dtype}): "
                f"{advice(cfg, machine, bench=bench, overrides=overrides)}; run.memory_check=false skips this check"
            )
    return est, {**available, "margin_bytes": margin_bytes(est.host_bytes)}


def memory_fit(cfg: Config, device: torch.device, *, bench: bool = False, overrides: list[str] = ()) -> dict:
    """The run's (or the benchmark's) peak memory estimated from the config, and what the machine has;
    raises DoesNotFit (exit 2) when it cannot fit, unless run.memory_check=false."""
    reset_peak_rss()  # a multirun's jobs share this process: each job's peak is its own
    reset_run_peaks(device)
    load_runtime(cfg)
    estimate, available = check_fits(cfg, device, memory_check=cfg.run.memory_check, bench=bench, overrides=overrides)
    return {"estimate": estimate, "available": available}
