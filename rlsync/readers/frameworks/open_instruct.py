"""open-instruct (allenai/open-instruct): grpo_fast's weight-sync thread."""

from rlsync.readers.frameworks.base import FrameworkMap


class OpenInstruct(FrameworkMap):
    title = "open-instruct"
    update = ("time/weight_sync",)
    step = ()  # the step from the clock
    spans = "open-instruct's time/weight_sync is the sync across every vLLM actor (its slowest)."
    traps = ("the step comes from the clock: the time between logged steps",)
    config_keys = ("vllm_num_engines",)
    model_keys = ("model_name_or_path",)
    checked = "code (sync_time_stats['time/weight_sync']), 2026-08; the step key from the issue's reading"
