"""What the update runs with that the config alone decides but no key states as such.

`bucket_bytes`: update.bucket_mb in bytes. `flat_engine_weights_choice`: update.flat_engine_weights as
the update runs it, null (auto) resolved, with the reason; read by the update (rlsync.update.auto, which
resolves the auto knobs that need a measurement), the memory estimate and the planner.
"""

from __future__ import annotations

from typing import Optional

from rlsync.config.rules import resolve
from rlsync.config.schema import ModelConfig, RolloutConfig, UpdateConfig
from rlsync.fmt import MIB


def bucket_bytes(cfg: UpdateConfig) -> int:
    return int(cfg.bucket_mb * MIB)


def flat_engine_weights_choice(
    update: UpdateConfig, rollout: RolloutConfig, model: Optional[ModelConfig] = None
) -> tuple[bool, str]:
    """update.flat_engine_weights as the update runs it, and why: the one place null (auto) is resolved.

    Auto is on wherever the engine can hold its weights as views into bucket-shaped flat buffers (one
    copy per update); off where it cannot: the engine says why (Engine.flat_weights_refusal), strategies
    other than bucketed send no buckets, and with ipc plus rollout.release_level=2 the buffers would be shared
    memory the engine cannot free (UpdateConfig.check refuses an explicit true there).
    """
    if update.flat_engine_weights is not None:
        return bool(update.flat_engine_weights), "set explicitly"
    refusal = resolve("rlsync.engines.base:engine_class")(rollout.engine).flat_weights_refusal(rollout.engine)
    if refusal:
        return False, f"auto: off, {refusal}"
    if update.strategy != "bucketed":
        return False, f"auto: off, update.strategy={update.strategy} sends no buckets"
    payload = resolve("rlsync.update.payload.base:payload_of")(update)
    if not payload.whole:
        return False, f"auto: off, the {payload.name} payload sends through a staging buffer (the engine decodes it)"
    if (
        rollout.release_level == 2
        and resolve("rlsync.update.base:transport_class")(update.transport).flat_weights_shared
    ):
        return (
            False,
            f"auto: off, with {update.transport} and rollout.release_level=2 the weights would be shared memory "
            "the engine cannot free",
        )
    if (
        model is not None
        and model.update_layout == "checkpoint"
        and resolve("rlsync.model.architecture:has_fused_experts")(model)
    ):
        return (
            False,
            "auto: off, the per-expert tensors of model.update_layout=checkpoint are views of fused expert weights",
        )
    return True, f"auto: on, the {rollout.engine} engine holds its weights as bucket-shaped views (one copy)"
