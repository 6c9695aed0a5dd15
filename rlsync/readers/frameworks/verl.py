"""verl (volcengine/verl): its trainer's `timing_s/*` keys, on the global step."""

from typing import ClassVar

from rlsync.readers.frameworks.base import FrameworkMap, Phases


class Verl(FrameworkMap):
    title = "verl"
    update = ("timing_s/update_weights",)
    step = ("timing_s/step",)
    phases: ClassVar[Phases] = {
        "rollout": ("timing_s/gen",),
        "log_probs": ("timing_s/old_log_prob",),
        "ref_log_probs": ("timing_s/ref",),
        "train": ("timing_s/update_actor",),
    }
    spans = (
        "verl's timing_s/update_weights also holds the trainer's offload and two wakes (weights, then KV cache) "
        "around the export and load; the rollout's sleep sits inside timing_s/gen."
    )
    traps = ('the file logger writes one {"step": N, "data": {...}} per line, on the global step',)
    config_keys = ("actor_rollout_ref",)
    model_keys = ("actor_rollout_ref.model.path",)
    checked = "code and logs (timing_s/update_weights, timing_s/step), 2026-08"
