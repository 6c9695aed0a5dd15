"""TRL (huggingface/trl): GRPO and RLOO time the sync with their profiling decorator; AsyncGRPO logs its own."""

from typing import ClassVar

from rlsync.readers.frameworks.base import FrameworkMap, Phases


class TRL(FrameworkMap):
    title = "TRL (GRPO/RLOO)"
    update = (
        "profiling/Time taken: GRPOTrainer.sync_weights",
        "profiling/Time taken: RLOOTrainer.sync_weights",
        "profiling/Time taken: GRPOTrainer._move_model_to_vllm",
    )
    step = ()  # no step time is logged: the time between the trainer's logged steps
    phases: ClassVar[Phases] = {
        "rollout": ("profiling/Time taken: GRPOTrainer._generate", "profiling/Time taken: RLOOTrainer._generate")
    }
    axis = ("train/global_step",)
    carry_to_next = True
    spans = (
        "TRL's sync_weights is a load_weights per parameter and the prefix-cache reset; "
        "the step is the time between logged steps (TRL logs none)."
    )
    traps = (
        "the profiling rows are logged on W&B's own _step, not the trainer's step: each belongs to the next "
        "row that carries train/global_step",
        "the step comes from the clock, so a step that also evaluated or saved a checkpoint counts that too",
    )
    config_keys = ("num_generations", "use_vllm")
    model_keys = ("model_name_or_path", "_name_or_path")
    checked = "W&B key as TRL's profiling decorator writes it (users' notes), 2026-08"


class TRLAsync(FrameworkMap):
    title = "TRL AsyncGRPO"
    update = ("train/weight_sync_time_s", "weight_sync_time_s")
    step = ()
    axis = ("train/global_step",)
    spans = "TRL AsyncGRPO's weight_sync_time_s holds the pause, the barrier, the send and the resume."
    traps = ("the step comes from the clock (AsyncGRPO logs no step time)",)
    config_keys = ("num_generations",)
    model_keys = ("model_name_or_path", "_name_or_path")
    checked = "code (self._metrics['train']['weight_sync_time_s']), 2026-08"
