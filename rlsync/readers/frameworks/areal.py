"""AReaL (inclusionAI/AReaL): its stats tracker's timeperf/* scopes, each phase apart."""

from typing import ClassVar

from rlsync.readers.frameworks.base import FrameworkMap, Phases


class AReaL(FrameworkMap):
    title = "AReaL"
    update = ("timeperf/update_weights",)
    step = ()  # no whole-step time: the time between steps
    offload = ("timeperf/actor_offload",)
    onload = ("timeperf/actor_onload",)
    phases: ClassVar[Phases] = {
        "rollout": ("timeperf/rollout",),
        "log_probs": ("timeperf/recompute_logp",),
        "ref_log_probs": ("timeperf/ref_logp",),
        "train": ("timeperf/train_step",),
        "rollout_pause": ("timeperf/rollout_pause",),
    }
    spans = (
        "AReaL times each phase apart: timeperf/update_weights is the update alone, the offload and pause beside it."
    )
    traps = (
        "the step comes from the clock (AReaL logs no whole-step time)",
        "timeperf/actor_offload, actor_onload and rollout_pause are the issue's reading of 2026-08, not verified here",
    )
    config_keys = ("gconfig",)
    model_keys = ("actor.path",)
    checked = "code for timeperf/update_weights, train_step, rollout, recompute_logp (2026-08); the rest from the issue"
