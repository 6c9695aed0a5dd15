"""SkyRL (NovaSky-AI/SkyRL): its trainer's timing/* keys."""

from typing import ClassVar

from rlsync.readers.frameworks.base import FrameworkMap, Phases


class SkyRL(FrameworkMap):
    title = "SkyRL"
    update = ("timing/sync_weights",)
    step = ("timing/step",)
    phases: ClassVar[Phases] = {
        "rollout": ("timing/generate",),
        "log_probs": ("timing/fwd_logprobs_values_reward",),
        "train": ("timing/policy_train", "timing/train_critic_and_policy"),
    }
    spans = (
        "SkyRL's timing/sync_weights brackets the prepare, the weights' wake, the broadcast, the finish and "
        "the KV cache's wake."
    )
    traps = ("an async run that publishes every other update logs timing/sync_weights = 0 between",)
    config_keys = ("generator",)
    model_keys = ("trainer.policy.model.path",)
    checked = "code and docs (timing/sync_weights, timing/step), 2026-08"
