"""Data parallel: N trainer ranks from `accelerate launch` or `torchrun`, one rollout engine or one per rank.

    accelerate launch --multi_gpu --num_processes N -m rlsync ...   (also on a CPU: it runs torchrun)
    torchrun --nproc_per_node N -m rlsync ...

This module joins the launch's process group and moves what the step needs between ranks; how the ranks
share the model (trainer.parallel: accelerate's DDP, torch's FSDP2) is rlsync/trainer/parallel.py.

With one engine (rollout.placement=rank0), rank 0 generates the whole batch and sends each rank whole
prompt groups (GRPO advantages are normalised within a group, so a group never straddles ranks); with
one engine per rank (every_rank, the colocated layout) each rank generates its own groups. Every rank
scores and trains on its share; each rank's loss is its tokens' part of the *whole batch's* token
mean, so the ranks' gradients add up to exactly the gradient one process computes on the whole batch
(up to float summation order). Each step's metrics are gathered from every rank: a phase's time is
the slowest rank's (the step waits for it), with the spread beside it (`perf/<phase>_time_rank_min`,
`_rank_max`). Only rank 0 writes: files, W&B, console.

A process started without the launchers' environment (WORLD_SIZE unset or 1) is a single process:
no process group, and every call here returns its input untouched.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import fields
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from rlsync.config.launch import launched
from rlsync.engines.base import Generation
from rlsync.errors import ConfigError, Interrupted, RlsyncError
from rlsync.fmt import error_line
from rlsync.measure.metrics import Merge, merge_rule
from rlsync.update import WeightMismatch, checksum

FAILURES = "rlsync/failed_ranks"  # store prefix: rank -> the error line it failed with
PF_EXITING = 0x4  # /proc/PID/stat's flags: the process is exiting
RANKS = "rlsync/ranks"  # store prefix: rank -> its process (pid and host), and whether a signal stopped it


class RankFailed(RlsyncError):
    """Another data-parallel rank failed, and that is what stopped this one (exit 1)."""


def split_evenly(count: int, parts: int) -> list[int]:
    """`count` items over `parts` ranks, the first ranks one more when it does not divide."""
    return [count // parts + (1 if i < count % parts else 0) for i in range(parts)]


def generation_rows(gen: Generation, rows: slice) -> Generation:
    """The rows `rows` of a batch; prompt padding and answer width stay the whole batch's."""
    values = {f.name: getattr(gen, f.name) for f in fields(gen)}
    return Generation(**{k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in values.items()})


def merge_ranks(rows: list[dict], tokens: list[float], answers: list[int] | None = None) -> dict:
    """One step's metrics of every rank (rank 0 first) -> the row rank 0 records, each key merged as
    the catalogue (rlsync/measure/metrics.py) says.

    A phase time measured on several ranks becomes the slowest rank's (what the step waits for),
    with `_rank_min` and `_rank_max` beside it; the loss is summed, per-token averages weighted by
    each rank's answer tokens (`tokens`), per-answer rollout averages by each generating rank's answers
    (`answers`), memory peaks the largest; the rest (the update, bytes per rank, the grad norm every rank
    shares) is rank 0's, or the first rank's that has it.
    """
    answers = answers or [1] * len(rows)
    merged = dict(rows[0])
    keys = dict.fromkeys(k for r in rows for k in r)  # rank 0's order first
    total_tokens = sum(tokens) or 1.0
    for key in keys:
        values = [r[key] for r in rows if key in r]
        rule = merge_rule(key)
        if rule is Merge.SUM:
            merged[key] = sum(values)
        elif rule is Merge.TOKEN_MEAN:
            merged[key] = sum(r[key] * n for r, n in zip(rows, tokens) if key in r) / total_tokens
        elif rule is Merge.ANSWER_MEAN:
            weights = [(r[key], n) for r, n in zip(rows, answers) if key in r]
            merged[key] = sum(v * n for v, n in weights) / (sum(n for _, n in weights) or 1)
        elif rule is Merge.SLOWEST and len(values) > 1:
            merged[key] = max(values)
            merged[f"{key}_rank_min"], merged[f"{key}_rank_max"] = min(values), max(values)
        elif rule is Merge.LARGEST:  # device memory after a phase: each rank has its own device
            merged[key] = max(values)
        else:
            merged.setdefault(key, values[0])
    return merged


class DataParallel:
    """This process's rank in a data-parallel launch; `DataParallel()` is the single process."""

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.object_group = None  # gloo group for pickled objects (the default group is NCCL on CUDA)
        self.failures = None  # the launch's store, under FAILURES: each failed rank's error line
        self.ranks = None  # the launch's store, under RANKS: each rank's process, and the signal that stopped it
        self.started = False

    @classmethod
    def from_env(cls) -> DataParallel:
        return cls(*launched())

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """Each rank trains on its own GPU (cuda:LOCAL_RANK); on a CPU they share the host."""
        if self.enabled and device.type == "cuda":
            if self.local_rank >= torch.cuda.device_count():  # NCCL refuses two ranks on one GPU
                raise ConfigError(
                    "run.device",
                    str(device),
                    f"cpu, or one GPU per rank (local rank {self.local_rank}, {torch.cuda.device_count()} GPUs here)",
                    "not enough GPUs for the ranks",
                )
            return torch.device("cuda", self.local_rank)
        return device

    def start(self, device: torch.device, *, timeout_s: float) -> None:
        """Join the process group: NCCL between GPUs, gloo on a CPU (and for objects everywhere)."""
        if not self.enabled or self.started:
            return
        timeout = timedelta(seconds=timeout_s)
        # The launch's store, at MASTER_ADDR:MASTER_PORT: torchrun's agent hosts it; in a submitit job, rank 0
        store, _, _ = next(rendezvous("env://", timeout=timeout))
        self.failures = dist.PrefixStore(FAILURES, store)
        self.ranks = dist.PrefixStore(RANKS, store)
        self.ranks.set(f"process/{self.rank}", f"{os.getpid()} {socket.gethostname()}")  # rank 0 asks if it lives
        common = {"store": store, "rank": self.rank, "world_size": self.world, "timeout": timeout}
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, **common)
            self.object_group = dist.new_group(backend="gloo", timeout=timeout)
        else:
            dist.init_process_group("gloo", **common)
        self.started = True

    def failed_rank(self, err: BaseException) -> Optional[BaseException]:
        """What stopped this rank, if it was another rank's failure; ranks > 0 record their own here.

        When one rank fails, the others end with an error of their own that does not say why: a
        collective's "connection closed by peer", or the launcher's SIGTERM (torchrun stops every
        rank once one has exited). So a rank > 0 that fails leaves its error line in the launch's
        store before it exits (a signal that stopped it, its name), and rank 0, stopped, reports the
        first such line as the run's error. A rank that left no word and whose process is gone (on this
        machine: SIGKILL, the OOM killer, a crash) died: rank 0 says so, rather than the launcher's
        SIGTERM that followed (the user stopped nothing).
        """
        if self.failures is None:
            return None
        try:
            if not self.is_main:
                if isinstance(err, KeyboardInterrupt):  # a signal stopped it: the launcher's, or the user's
                    self.ranks.set(f"stopped/{self.rank}", str(getattr(err, "signum", signal.SIGINT)))
                else:
                    self.failures.set(str(self.rank), error_line(err))
                return None
            for rank in range(1, self.world):
                if self.failures.check([str(rank)]):
                    line = self.failures.get(str(rank)).decode()
                    return RankFailed(f"data-parallel rank {rank} failed: {line}")
            for rank in range(1, self.world):
                if self.ranks.check([f"stopped/{rank}"]):  # a signal to that rank alone stopped the run
                    signum = int(self.ranks.get(f"stopped/{rank}").decode())
                    if getattr(err, "signum", None) != signum:  # (one to every rank: this rank's own says it)
                        return Interrupted(signum, f"(sent to data-parallel rank {rank})")
                elif self.died(rank):
                    return RankFailed(
                        f"data-parallel rank {rank} died (its process ended without a word: killed by SIGKILL, "
                        f"the out-of-memory killer, or a crash)"
                    )
        except Exception:  # noqa: BLE001 - the store went with the launch: keep this rank's own error
            return None
        return None

    def died(self, rank: int) -> bool:
        """Whether rank `rank`'s process, on this machine, is gone (or a zombie its launcher has not reaped yet);
        False for a rank on another machine, or one that never said which process it is."""
        if not self.ranks.check([f"process/{rank}"]):
            return False
        pid, _, host = self.ranks.get(f"process/{rank}").decode().partition(" ")
        if host != socket.gethostname():
            return False
        if not Path("/proc/self/stat").exists():  # no procfs: alive or a zombie look the same
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                return True
            except (OSError, ValueError):
                return False
            return False
        deadline = time.monotonic() + 5.0  # a killed process closes its sockets (rank 0's error) as it exits
        while True:
            try:
                fields_ = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                return True  # no such process
            # ended and not yet reaped, or exiting (PF_EXITING in its flags: its sockets are closing)
            if fields_[0] in ("Z", "X") or int(fields_[6]) & PF_EXITING:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def close(self) -> None:
        if self.started and dist.is_initialized():
            dist.destroy_process_group()
        self.started, self.failures, self.ranks = False, None, None

    def __enter__(self) -> DataParallel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @torch.no_grad()
    def broadcast_weights(self, model: torch.nn.Module) -> None:
        """Every rank starts from rank 0's weights (a random init or a checkpoint alike)."""
        if not self.enabled:
            return
        for param in model.parameters():
            dist.broadcast(param.data, src=0)

    def scatter_groups(
        self, gen: Generation | None, advantages: torch.Tensor | None, *, group_size: int, device: torch.device
    ) -> tuple[Generation, torch.Tensor, int]:
        """Rank 0's whole batch -> this rank's share of whole prompt groups, on `device`.

        Also returns the batch's answer-token count: the denominator of every rank's loss, so the
        ranks' gradients add up to the whole batch's token mean.
        """
        shares = None
        if self.is_main:
            batch_tokens = int(gen.response_mask.sum())
            shares, start = [], 0
            for groups in split_evenly(gen.sequences.shape[0] // group_size, self.world):
                rows = slice(start, start + groups * group_size)  # [groups * group_size] whole groups
                share = generation_rows(gen, rows).to(torch.device("cpu"))  # pickled: CPU tensors
                shares.append((share, advantages[rows].cpu(), batch_tokens))
                start = rows.stop
        received = [None]
        dist.scatter_object_list(received, shares, src=0, group=self.object_group)
        share, share_advantages, batch_tokens = received[0]
        return share.to(device), share_advantages.to(device), batch_tokens

    def share(self, count: int) -> slice:
        """This rank's part of `count` prompt groups (split_evenly's order: rank 0 first)."""
        sizes = split_evenly(count, self.world)
        start = sum(sizes[: self.rank])
        return slice(start, start + sizes[self.rank])

    def all_sum(self, value: int) -> int:
        """`value` summed over the ranks (every rank's answer tokens: the whole batch's); a single process's own."""
        if not self.enabled:
            return value
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, value, group=self.object_group)
        return sum(gathered)

    def agree(self, error: BaseException | None) -> None:
        """update.verify on every rank's engine: every rank raises the first failing rank's mismatch, or none does."""
        if not self.enabled:
            if error is not None:
                raise error
            return
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, None if error is None else str(error), group=self.object_group)
        for rank, line in enumerate(gathered):
            if line is not None:
                raise WeightMismatch(f"rank {rank}'s engine: {line}" if self.world > 1 else line)

    def gather_metrics(self, metrics: dict, *, tokens: float, answers: int = 0) -> dict:
        """Every rank's step metrics (all_gather) merged as `merge_ranks` says; a single process's as they are.
        `tokens`: this rank's answer tokens trained on; `answers`: the answers its engine generated."""
        if not self.enabled:
            return metrics
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, (metrics, tokens, answers), group=self.object_group)
        return merge_ranks([m for m, _, _ in gathered], [n for _, n, _ in gathered], [a for _, _, a in gathered])

    def check_same_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """update.verify: every rank must hold rank 0's trainer weights, or rank 0's update would speak for it alone."""
        mine = {name: checksum(t) for name, t in weights.items()}
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, mine, group=self.object_group)
        for rank, theirs in enumerate(gathered[1:], start=1):
            differing = [name for name in gathered[0] if theirs.get(name) != gathered[0][name]]
            if differing:
                raise WeightMismatch(
                    f"data-parallel rank {rank} holds different trainer weights from rank 0 after "
                    f"the step ({len(differing)} tensors, first {differing[0]!r})"
                )
