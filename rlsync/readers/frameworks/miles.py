"""Miles / slime (radixark/miles, THUDM/slime): rlsync took its metric names from Miles."""

from typing import ClassVar

from rlsync.readers.frameworks.base import FrameworkMap, Phases


class Miles(FrameworkMap):
    title = "Miles / slime"
    update = ("perf/update_weights_time",)
    step = ("perf/step_time",)
    offload = ("perf/sleep_time",)
    onload = ("perf/wake_up_time",)
    phases: ClassVar[Phases] = {
        "rollout": ("perf/rollout_time",),
        "log_probs": ("perf/log_probs_time",),
        "ref_log_probs": ("perf/ref_log_probs_time",),
        "train": ("perf/train_time", "perf/actor_train_time"),
    }
    axis = ("rollout/step",)
    spans = (
        "Miles' perf/update_weights_time is the whole update with its pause, flush and barriers "
        "(21-26 s around a ~3 s transfer on Qwen3-30B-A3B, vllm-project/vime #175), not the transfer alone."
    )
    traps = (
        "step N's row reports the previous step's publication (radixark/miles #3217): medians are unaffected, "
        "per-step pairs are one step apart",
        "train metrics are on train/step, rollout and perf metrics on rollout/step: the axis is rollout/step",
    )
    config_keys = ("hf_checkpoint", "rollout_batch_size", "use_miles_dashboard")
    model_keys = ("hf_checkpoint",)
    checked = "code (perf/* keys, the dashboard's phases/ files), 2026-08"
