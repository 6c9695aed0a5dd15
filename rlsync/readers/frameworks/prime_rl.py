"""prime-rl (PrimeIntellect-ai/prime-rl): the trainer's time/* keys (the orchestrator logs its own run)."""

from typing import ClassVar

from rlsync.readers.frameworks.base import FrameworkMap, Phases


class PrimeRL(FrameworkMap):
    title = "prime-rl"
    update = ("time/broadcast_weights", "watcher/last_update_weights_time")
    step = ("time/step",)
    phases: ClassVar[Phases] = {"train": ("time/forward_backward",), "wait_for_batch": ("time/wait_for_batch",)}
    spans = (
        "prime-rl's time/broadcast_weights is the trainer's send; the engine's load is the orchestrator's "
        "watcher/last_update_weights_time, in its own run."
    )
    traps = ("trainer and orchestrator log separate runs, each with its own time/step",)
    config_keys = ("ckpt", "optim")
    model_keys = ("model.name",)
    checked = "code (time_metrics in the trainer's loop), 2026-08"
