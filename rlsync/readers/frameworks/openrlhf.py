"""OpenRLHF (OpenRLHF/OpenRLHF): its PPO trainer's timing/* status, logged under train/ on train/global_step."""

from typing import ClassVar

from rlsync.readers.frameworks.base import FrameworkMap, Phases


class OpenRLHF(FrameworkMap):
    title = "OpenRLHF"
    update = ("train/timing/broadcast", "timing/broadcast")
    step = ("train/timing/step_total", "timing/step_total")
    phases: ClassVar[Phases] = {
        "rollout": ("train/timing/generation", "timing/generation"),
        "train": ("train/timing/ppo_train", "timing/ppo_train"),
    }
    axis = ("train/global_step",)
    spans = "OpenRLHF's timing/broadcast is the weights' wake and the broadcast; the KV cache's wake is in generation."
    traps = ("a run that syncs on its own schedule logs timing/broadcast = 0 on the steps between",)
    config_keys = ("pretrain",)
    model_keys = ("pretrain",)
    checked = "code (status['timing/broadcast'], timing/step_total), 2026-08"
