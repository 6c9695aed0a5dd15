"""Will the run fit? Its peak memory estimated from the config, before any model is built.

The mission's own example, `python -m rlsync model=qwen3_1p7b` on a 24 GiB machine, was killed by
the kernel a minute in with nothing but "Killed": the trainer's fp32 AdamW state alone is 16 bytes
per parameter. `check_fits` refuses such a run in one line (exit 2) with what to change;
`run.memory_check=false` skips it. The estimate goes into summary.json beside the measured peak
(`memory`), so its accuracy is visible in every run.

Everything is arithmetic on the config: parameter shapes come from a meta-device build of the
architecture (rlsync.model.architecture: the same model `build_model` allocates, in the update's layout),
the activations from the model.* keys (model.config's values once validated), the bucket plan from the same planner the update uses.
Where the bytes live:

- this process: the runtime already loaded (the resident set measured now, after importing what
  the run imports) and what it grows by in the first steps (STEP_WORKSPACE, calibrated), the trainer (weights, gradients, AdamW's two moments, all in trainer.dtype; a
  frozen reference with kl_coef > 0), what the offload keeps beside the state (twin: a host copy;
  move on a CPU: one spare buffer per segment size and the slack of shared sizes), the engine's
  weights in rollout.dtype (transport=direct), the staging buffers of the update, and the largest
  transient: the trainer's activations and logits, the rollout's KV cache, or the copy-floor probe
  (two buffers of up to 1 GiB, rlsync.measure.limits);
- the engine process (transport ipc or broadcast): a runtime like this one, its weights, KV cache
  and staging;
- on CUDA the device holds the trainer state while awake, the engine, the staging and the
  transients; the host holds the runtime and the offloaded state (twin: pinned in the chunks
  rlsync.trainer.offload allocates, each rounded up to a power of two by torch's caching host allocator).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from rlsync.config.schema import MIB, Config, ModelConfig, bucket_bytes, flat_engine_weights_choice
from rlsync.engines.base import engine_class
from rlsync.errors import BadInput
from rlsync.measure.memory import device_available_bytes, host_available_bytes, rss_bytes
from rlsync.model.architecture import model_shapes, update_shapes
from rlsync.model.build import torch_dtype
from rlsync.sync.buckets import TensorMeta, plan_buckets
from rlsync.trainer.offload import plan_pin_chunks, plan_segments, resolve_memory
from rlsync.trainer.task import make_prompts

GIB = 2**30
PROBE_MIN, PROBE_CAP = MIB, GIB  # rlsync.measure.limits.copy_bandwidth clamps its buffers to this range
ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq, in the parameter's dtype
LOGIT_COPIES = 4  # logits, their float32 log-softmax, its gradient, the gathered log-probs' graph
LAYER_ACTIVATIONS = 10  # hidden-size-wide tensors kept per layer and token for the backward (norms, q/k/v/o, residuals)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What the runtime grows by in the first steps whatever the model's size: kernels' workspaces, thread
# pools and the allocator's arenas. Calibrated, not derived: a tiny-model run on the CPU build grew
# 76 MiB in step 0 and peaked about 130 MiB above the rest of this estimate.
STEP_WORKSPACE = 128 * MIB


def param_shapes(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor the update sends for the model `m` describes, in order, a tied
    lm_head once: the update layout's (model.update_layout; a dense model's parameters, a MoE model's
    experts one tensor per expert and projection in the checkpoint layout). Read off a meta-device
    build of the architecture (rlsync.model.architecture.update_shapes): nothing is allocated."""
    return update_shapes(m)


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def param_count(m: ModelConfig) -> int:
    return sum(numel(s) for _, s in param_shapes(m))


@dataclass
class Estimate:
    """Peak bytes by part: this process, the engine process (ipc, broadcast) and the CUDA device."""

    process: dict[str, int] = field(default_factory=dict)
    engine_process: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)  # empty on a CPU run

    @property
    def process_bytes(self) -> int:
        return sum(self.process.values())

    @property
    def host_bytes(self) -> int:
        """Host memory of the whole run: what the machine's RAM must hold."""
        return self.process_bytes + sum(self.engine_process.values())

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    def as_dict(self) -> dict:
        return {
            "host_bytes": self.host_bytes,
            "process_bytes": self.process_bytes,
            "device_bytes": self.device_bytes or None,
            "process": self.process,
            "engine_process": self.engine_process or None,
            "device": self.device or None,
        }


def prompt_tokens() -> int:
    """Tokens of the longest prompt the task makes, with the byte tokenizer (BOS + one per byte);
    a checkpoint's own tokenizer needs fewer."""
    return 1 + max(len(p.text.encode("utf-8")) for p in make_prompts(4, rng=random.Random(0)))


def offload_extra(cfg: Config, shapes: list[tuple[str, tuple[int, ...]]], cuda: bool) -> int:
    """Bytes the offload keeps beside the state (rlsync.trainer.offload): twin's host copy, move's spares and slack."""
    t = cfg.trainer
    if t.offload == "none":
        return 0
    memory = resolve_memory(t.offload_memory, torch.device("cuda" if cuda else "cpu"))
    itemsize = DTYPE_BYTES[t.dtype]
    params = [numel(s) * itemsize for _, s in shapes]
    # rlsync.trainer.offload._lay_out: within a dtype, parameters, then AdamW's moment pair of each, then
    # the gradients (travelling under offload=full; their own segments under drop_grads)
    travelling = params + [b for b in params for _ in range(ADAM_MOMENTS)] + (params if t.offload == "full" else [])
    if memory == "twin":  # allocated in chunks cut between tensors, each pinned (and rounded) on its own
        chunks = plan_pin_chunks(travelling, int(t.offload_pin_chunk_mb * MIB))
        return sum(pinned_bytes(end - start) if cuda else end - start for start, end in chunks)
    if cuda:  # move on CUDA: pageable host buffers while asleep, nothing kept awake
        return sum(travelling)
    cap = int(t.offload_segment_mb * MIB)
    packed = [sum(travelling[i] for i in group) for group in plan_segments(travelling, cap)]
    shared = max((b for b in packed if b <= cap), default=None)
    capacities = [shared if shared is not None and b <= shared else b for b in packed]
    spares = sum(dict.fromkeys(capacities))  # one spare per distinct capacity
    return spares + sum(c - b for c, b in zip(capacities, packed))


def pinned_bytes(nbytes: int) -> int:
    """torch's caching host allocator rounds a pinned block up to a power of two."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes else 0


def largest_bucket_bytes(cfg: Config, shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    """The update's largest bucket, planned by the planner the update uses (rlsync.sync.buckets)."""
    dtype = torch_dtype(cfg.rollout.dtype)
    buckets = plan_buckets([TensorMeta(n, s, dtype) for n, s in shapes], bucket_bytes(cfg.update))
    return max(b.nbytes for b in buckets)


def staging_bytes(cfg: Config, shapes) -> tuple[int, int]:
    """(trainer side, engine side) bytes of the update's staging buffers."""
    u = cfg.update
    if not u.enabled or u.strategy in engine_class(cfg.rollout.engine).own_strategies:
        return 0, 0  # the engine's own transfer: nothing staged by rlsync
    slot = (
        max(numel(s) for _, s in shapes) * DTYPE_BYTES[cfg.rollout.dtype]
        if u.strategy == "per_tensor"
        else largest_bucket_bytes(cfg, shapes)
    )
    flat_weights, _ = flat_engine_weights_choice(
        u, cfg.rollout, cfg.model
    )  # null (auto) resolved as the update resolves it
    if flat_weights:
        slot = 0 if u.transport != "broadcast" else slot  # packing writes the engine's weights
    if u.transport == "direct":
        if u.strategy == "bucketed" and not flat_weights and engine_class(cfg.rollout.engine).loads_trainer_tensors:
            return 0, 0  # the engine's loader takes the trainer's tensors (vLLM): no staging buffer (sync/direct.py)
        return slot, 0
    if u.transport == "ipc":  # shared: the same pages on both sides, counted once
        return slot * u.inflight_buckets, 0
    return slot * u.inflight_buckets, (0 if flat_weights else slot * u.inflight_buckets)


def activation_bytes(cfg: Config, prompt_len: int) -> tuple[int, int]:
    """(trainer step, rollout) transient bytes: logits and saved activations of one micro-batch;
    the KV cache and per-token logits of the generation."""
    m, r = cfg.model, cfg.rollout
    batch = r.prompts_per_step * r.samples_per_prompt
    seq = prompt_len + r.max_response_len
    micro = min(cfg.trainer.micro_batch_size, batch)
    t, e = DTYPE_BYTES[cfg.trainer.dtype], DTYPE_BYTES[r.dtype]
    logits = micro * seq * m.vocab_size * 4 * LOGIT_COPIES
    layers = m.num_hidden_layers * micro * seq * (LAYER_ACTIVATIONS * m.hidden_size + 3 * m.intermediate_size) * t
    kv = 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * batch * seq * e
    return logits + layers, kv + batch * m.vocab_size * 4 * LOGIT_COPIES


def probe_bytes(state: int, update: int) -> int:
    """The copy-floor probe's two buffers (rlsync.measure.limits), at the larger of its two sizes."""
    return 2 * max(min(max(n, PROBE_MIN), PROBE_CAP) for n in (state, update))


def estimate(cfg: Config, *, cuda: bool, runtime_bytes: int) -> Estimate:
    """The run's peak memory by part, from `cfg` alone (no tensor is allocated)."""
    shapes = param_shapes(cfg.model)
    params = sum(numel(s) for _, s in shapes)
    t, e = DTYPE_BYTES[cfg.trainer.dtype], DTYPE_BYTES[cfg.rollout.dtype]
    trainer = params * t * (2 + ADAM_MOMENTS)  # weights, grads, AdamW moments
    reference = params * t if cfg.trainer.kl_coef > 0 else 0
    engine_weights = params * e
    staging_trainer, staging_engine = staging_bytes(cfg, shapes)
    train_act, rollout_act = activation_bytes(cfg, prompt_tokens())
    probe = probe_bytes(trainer, engine_weights)
    extra = offload_extra(cfg, list(model_shapes(cfg.model)), cuda)  # the offload moves parameters, fused experts whole
    own_engine = cfg.update.transport == "direct"  # the engine's KV cache lives in this process
    remote = bool(cfg.update.engine_address)  # an engine on another machine: not this one's memory
    est = Estimate()
    est.process["runtime"] = runtime_bytes
    est.process["step_workspace"] = STEP_WORKSPACE
    if not cuda:
        est.process.update(
            {
                "trainer_state": trainer,
                "reference": reference,
                "offload_extra": extra,
                "staging": staging_trainer,
                "transient": max(train_act, rollout_act if own_engine else 0, probe),
            }
        )
        if cfg.update.transport == "direct":
            est.process["engine_weights"] = engine_weights
        elif not remote:
            est.engine_process = {
                "runtime": runtime_bytes,
                "step_workspace": STEP_WORKSPACE,
                "engine_weights": engine_weights,
                "staging": staging_engine,
                "kv_cache": rollout_act,
            }
    else:
        est.process.update(
            {"offload_host": extra, "probe_pinned": pinned_bytes(min(max(trainer, PROBE_MIN), PROBE_CAP))}
        )
        if cfg.update.transport != "direct" and not remote:
            est.engine_process = {"runtime": runtime_bytes}
        est.device = {
            "trainer_state": trainer,
            "reference": reference,
            "staging": staging_trainer + staging_engine,
            "transient": max(train_act, probe),
        }
        if not remote:
            est.device.update({"engine_weights": engine_weights, "kv_cache": rollout_act})
    return est


def load_runtime(cfg: Config) -> None:
    """Import what the run imports before it builds anything, so the resident set measured next is
    the runtime the run will have (the engine process loads the same)."""
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM  # noqa: F401 - the lazy module is most of it

    import rlsync.engines.hf  # noqa: F401
    import rlsync.sync  # noqa: F401
    import rlsync.trainer.grpo  # noqa: F401

    if cfg.wandb.mode != "disabled":
        try:
            import wandb  # noqa: F401
        except ImportError:
            pass


# ----------------------------------------------------------------------------------------------
# The check
# ----------------------------------------------------------------------------------------------


class DoesNotFit(BadInput):
    """The run's estimated peak exceeds what the machine has: refused before any model is built."""


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def advice(cfg: Config) -> str:
    options = []
    if cfg.trainer.dtype == "float32":
        options.append("trainer.dtype=bfloat16 (halves the trainer's weights, grads and AdamW state)")
    options.append("a smaller model (model=...)")
    if cfg.trainer.offload_memory == "twin":
        options.append("trainer.offload_memory=move")
    options.append("the update alone: python -m rlsync.bench (no optimizer state)")
    return "; ".join(options)


def check_fits(cfg: Config, device, *, memory_check: bool = True) -> tuple[Estimate, dict]:
    """The run's estimate and what the machine has; raises DoesNotFit when it cannot fit.

    Call after `load_runtime` and before any model is built."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.init()  # its host-side context is part of the runtime
    est = estimate(cfg, cuda=cuda, runtime_bytes=rss_bytes())
    available = {"host_bytes": host_available_bytes(), "device_bytes": device_available_bytes(device)}
    # the runtime is loaded already: it is part of the estimate, but no longer part of what is available
    need_host = est.host_bytes - est.process["runtime"]
    if memory_check:
        where = []
        if available["host_bytes"] is not None and need_host > available["host_bytes"]:
            where.append(
                f"host memory: estimated peak {gib(est.host_bytes)} (trainer state "
                f"{gib(est.process.get('trainer_state', 0) + est.device.get('trainer_state', 0))}), "
                f"{gib(available['host_bytes'] + est.process['runtime'])} available"
            )
        if available["device_bytes"] is not None and est.device_bytes > available["device_bytes"]:
            where.append(
                f"{device} memory: estimated peak {gib(est.device_bytes)}, {gib(available['device_bytes'])} free"
            )
        if where:
            raise DoesNotFit(
                f"this run does not fit: {'; '.join(where)} (model {cfg.model.name}, "
                f"{param_count(cfg.model) / 1e9:.2f}B parameters, trainer.dtype={cfg.trainer.dtype}): "
                f"try {advice(cfg)}; run.memory_check=false skips this check"
            )
    return est, available
