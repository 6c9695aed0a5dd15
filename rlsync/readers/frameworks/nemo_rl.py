"""NeMo-RL (NVIDIA-NeMo/RL): its GRPO loop's timer, logged under timing/train/."""

from typing import ClassVar

from rlsync.readers.frameworks.base import FrameworkMap, Phases


class NemoRL(FrameworkMap):
    title = "NeMo-RL"
    update = ("timing/train/prepare_for_generation/transfer_and_update_weights",)
    step = ("timing/train/total_step_time",)
    phases: ClassVar[Phases] = {
        "rollout": ("timing/train/generation",),
        "log_probs": ("timing/train/policy_and_reference_logprobs", "timing/train/get_logprobs"),
        "train": ("timing/train/policy_training",),
    }
    spans = (
        "NeMo-RL's transfer_and_update_weights is the transfer alone; the offload before it and the wakes are "
        "in timing/train/prepare_for_generation/total."
    )
    traps = ("the refit before the first step is timed apart (setup), not in step 1",)
    config_keys = ("policy", "grpo")
    model_keys = ("policy.model_name",)
    checked = "code (timer.time('prepare_for_generation/transfer_and_update_weights')), 2026-08"
