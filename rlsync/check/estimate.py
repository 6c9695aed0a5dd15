"""Will the run fit? Its peak memory estimated from the config, before any model is built.

The mission's own example, `python -m rlsync model=qwen3_1p7b` on a 24 GiB machine, was killed by
the kernel a minute in with nothing but "Killed": the trainer's fp32 AdamW state alone is 16 bytes
per parameter. `rlsync.check.fit.check_fits` refuses such a run in one line (exit 2) with what to change;
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
  (two buffers of up to 1 GiB, rlsync.measure.floors);
- the engine process (transport ipc or broadcast): a runtime like this one, its weights, KV cache
  and staging;
- on CUDA the device holds the trainer state while awake, the engine, the staging and the
  transients; the host holds the runtime and the offloaded state (twin: pinned in the chunks
  rlsync.trainer.offload allocates, each rounded up to a power of two by torch's caching host allocator).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass, field

import torch

from rlsync.config.apps import update_policy_class
from rlsync.config.derived import bucket_bytes, flat_engine_weights_choice
from rlsync.config.schema import Config, ModelConfig
from rlsync.engines.base import engine_class
from rlsync.fmt import GIB, MIB
from rlsync.measure.floors import GatherFloor
from rlsync.model.architecture import model_shapes, update_shapes
from rlsync.model.build import torch_dtype
from rlsync.model.lora import adapter_shapes
from rlsync.trainer.data_parallel import split_evenly as split_groups
from rlsync.trainer.offload import plan_pin_chunks, plan_segments, resolve_memory
from rlsync.trainer.parallel import parallel_class
from rlsync.trainer.task import make_prompts
from rlsync.update.base import transport_class, transports_with
from rlsync.update.buckets import TensorMeta, largest_bucket_bytes
from rlsync.update.payload import payload_of

PROBE_MIN, PROBE_CAP = MIB, GIB  # rlsync.measure.floors.copy_bandwidth clamps its buffers to this range
ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq, in the parameter's dtype
LOGIT_COPIES = 4  # logits, their float32 log-softmax, its gradient, the gathered log-probs' graph
LAYER_ACTIVATIONS = 10  # hidden-size-wide tensors kept per layer and token for the backward (norms, q/k/v/o, residuals)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What the runtime grows by in the first steps whatever the model's size: kernels' workspaces, thread
# pools and the allocator's arenas. Calibrated, not derived: a tiny-model run on the CPU build grew
# 76 MiB in step 0 and peaked about 130 MiB above the rest of this estimate.
STEP_WORKSPACE = 128 * MIB
# AdamW's step holds temporaries of one tensor's size at a time on a CPU (the single-tensor path: the
# root of exp_avg_sq and the step), the whole model's at once on CUDA (foreach: one list of roots); a
# tied embedding's gradient is summed from two of its own size (lm_head's and the lookup's).
OPTIMIZER_TEMPORARIES = 2
# Kept free beyond the estimate: what it has missed before (Qwen3-1.7B bf16: 9 % low) and what the
# machine's other processes allocate while the run is starting. Every suggestion is checked with it.
MARGIN_FRACTION = 0.08
GATHER_CALL_MAX = GatherFloor.CALL_SIZES[-1]  # the largest all-gather call of the gather from shards
MARGIN_MIN = 512 * MIB


_SHAPES: dict[tuple[str, str], list] = {}  # (which, the model's keys) -> shapes: a 235B meta build takes seconds


def _cached(which: str, m: ModelConfig, build) -> list:
    key = (which, json.dumps(dataclasses.asdict(m), sort_keys=True, default=str))
    if key not in _SHAPES:
        _SHAPES[key] = list(build(m))
    return list(_SHAPES[key])  # a copy: callers may change their list


def param_shapes(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor the update sends for the model `m` describes, in order, a tied
    lm_head once: the update layout's (model.update_layout; a dense model's parameters, a MoE model's
    experts one tensor per expert and projection in the checkpoint layout). Read off a meta-device
    build of the architecture (rlsync.model.architecture.update_shapes, once per model): nothing is allocated."""
    return _cached("update", m, update_shapes)


def adapter_shapes_of(cfg: Config) -> list[tuple[str, tuple[int, ...]]]:
    """The LoRA adapters' (name, shape) with trainer.lora.rank > 0 (rlsync.model.lora), else none."""
    if not cfg.trainer.lora.rank:
        return []
    return adapter_shapes(_cached("model", cfg.model, model_shapes), cfg.trainer.lora)


def sent_shapes(cfg: Config) -> list[tuple[str, tuple[int, ...]]]:
    """What the engine holds and the update plans: the model's tensors, and the adapters where the payload has the
    engine hold them (Payload.engine_lora: update.payload=lora)."""
    shapes = param_shapes(cfg.model)
    return shapes + adapter_shapes_of(cfg) if payload_of(cfg.update).engine_lora(cfg) is not None else shapes


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def param_count(m: ModelConfig) -> int:
    return sum(numel(s) for _, s in param_shapes(m))


@dataclass(frozen=True)
class Ranks:
    """The data-parallel launch a run is checked for: its ranks, and how many of them share this machine."""

    world: int = 1
    local: int = 1  # ranks on this machine (LOCAL_WORLD_SIZE): they share its RAM, and on a CPU its "device"

    @classmethod
    def launched(cls) -> Ranks:
        """This process's launch, as torchrun, accelerate or the submitit launcher set it."""
        from rlsync.config.launch import launched
        from rlsync.measure.threads import processes_here

        _, world, _ = launched()
        return cls(world, min(world, processes_here())) if world > 1 else cls()


@dataclass
class Estimate:
    """Peak bytes by part: this process (rank 0's), the engine process (ipc, broadcast) and the CUDA device;
    under data parallel, each other rank on this machine (`other_rank`, `other_ranks` of them)."""

    process: dict[str, int] = field(default_factory=dict)
    engine_process: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)  # empty on a CPU run
    other_rank: dict[str, int] = field(default_factory=dict)  # host bytes of each other rank on this machine
    other_ranks: int = 0

    @property
    def process_bytes(self) -> int:
        return sum(self.process.values())

    @property
    def host_bytes(self) -> int:
        """Host memory of the whole run: what the machine's RAM must hold (every rank on it)."""
        return self.process_bytes + sum(self.engine_process.values()) + self.other_ranks * sum(self.other_rank.values())

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
            **({"other_rank": self.other_rank, "other_ranks": self.other_ranks} if self.other_ranks else {}),
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


def planned_largest_bucket(cfg: Config, shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    """The update's largest bucket, planned by the planner the update uses (rlsync.update.buckets)."""
    dtype = torch_dtype(cfg.rollout.dtype)
    metas = [TensorMeta(n, s, dtype) for n, s in shapes]
    return largest_bucket_bytes(payload_of(cfg.update).plan(metas, bucket_bytes(cfg.update)))


def staging_bytes(cfg: Config, shapes) -> tuple[int, int]:
    """(trainer side, engine side) bytes of the update's staging buffers."""
    u = cfg.update
    if not u.enabled or u.strategy in engine_class(cfg.rollout.engine).own_strategies:
        return 0, 0  # the engine's own transfer: nothing staged by rlsync
    slot = (
        max(numel(s) for _, s in shapes) * DTYPE_BYTES[cfg.rollout.dtype]
        if u.strategy == "per_tensor"
        else planned_largest_bucket(cfg, shapes)
    )
    flat_weights, _ = flat_engine_weights_choice(
        u, cfg.rollout, cfg.model
    )  # null (auto) resolved as the update resolves it
    transport = transport_class(u.transport)
    in_process_loader = transport.engine_in_process and engine_class(cfg.rollout.engine).loads_trainer_tensors
    if u.strategy == "bucketed" and not flat_weights and in_process_loader and payload_of(u).whole:
        return 0, 0  # the engine's loader takes the trainer's tensors (vLLM): no staging buffer (update/direct.py)
    trainer, engine = transport.staging_slots(u, flat_weights)  # what the transport declares
    return slot * trainer, slot * engine


def payload_bytes(cfg: Config, shapes) -> int:
    """What the update's payload holds on the trainer's side (one that compares with the last update: the values it sent) and at most
    while it encodes one bucket (rlsync.update.payload: Payload.memory_bytes)."""
    if not cfg.update.enabled:
        return 0
    e = DTYPE_BYTES[cfg.rollout.dtype]
    total = sum(numel(s) for _, s in shapes) * e
    held, transient = payload_of(cfg.update).memory_bytes(total, planned_largest_bucket(cfg, shapes), e)
    return held + transient


# transformers' MoE blocks on a CPU gather each routed token's expert weights for a batched matmul and keep
# them for the backward: per token, layer and routed expert its three projections. Calibrated on tiny_moe
# (16 layers of 64 experts, 4 per token): 0.47 GiB beyond the dense estimate, 0.45 GiB by this term.
def expert_gather_bytes(cfg: Config, tokens: int) -> int:
    if not cfg.model.config:
        return 0
    from rlsync.model.architecture import hf_config

    hf = _cached("hf", cfg.model, lambda m: [hf_config(m)])[0]
    experts, top_k = getattr(hf, "num_experts", None), getattr(hf, "num_experts_per_tok", None)
    width = getattr(hf, "moe_intermediate_size", None)
    if not (experts and top_k and width):
        return 0
    return tokens * hf.num_hidden_layers * top_k * 3 * width * hf.hidden_size * DTYPE_BYTES[cfg.trainer.dtype]


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
    """The copy-floor probe's two buffers (rlsync.measure.floors), at the larger of its two sizes."""
    return 2 * max(min(max(n, PROBE_MIN), PROBE_CAP) for n in (state, update))


def optimizer_bytes(cfg: Config, shapes: list[tuple[str, tuple[int, ...]]], cuda: bool) -> int:
    """AdamW's temporaries in the step and a tied embedding's summed gradient (OPTIMIZER_TEMPORARIES)."""
    itemsize = DTYPE_BYTES[cfg.trainer.dtype]
    largest = max(numel(s) for _, s in shapes) * itemsize
    tied = largest if cfg.model.tie_word_embeddings else 0
    if cuda:  # foreach: a root per parameter, all at once
        return sum(numel(s) for _, s in shapes) * itemsize + tied
    return OPTIMIZER_TEMPORARIES * largest + tied


def estimate(cfg: Config, *, cuda: bool, runtime_bytes: int, ranks: Ranks | None = None) -> Estimate:
    """The run's peak memory by part, from `cfg` alone (no tensor is allocated): rank 0's, and under data
    parallel each other rank's on this machine (`ranks`, default this process's launch)."""
    ranks = ranks or Ranks.launched()
    est = rank_estimate(cfg, cuda=cuda, runtime_bytes=runtime_bytes, ranks=ranks, rank=0)
    if ranks.local > 1:  # the other ranks here: their processes (and engine processes) share this machine's RAM
        other = rank_estimate(cfg, cuda=cuda, runtime_bytes=runtime_bytes, ranks=ranks, rank=1)
        est.other_rank = {**other.process, **{f"engine_process_{k}": v for k, v in other.engine_process.items()}}
        est.other_ranks = ranks.local - 1
    return est


def sharded_shapes(shapes: list[tuple[str, tuple[int, ...]]], world: int) -> list[tuple[str, tuple[int, ...]]]:
    """Each rank's shard of each tensor under fully_shard: dim 0 split in ceil(rows / world) rows (padded)."""
    return [(n, (-(-s[0] // world), *s[1:]) if s else s) for n, s in shapes]


def with_prompts(cfg: Config, prompts: int) -> Config:
    """`cfg` with a rank's share of the prompt groups (what its engine generates, or its trainer trains on)."""
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, prompts_per_step=prompts))


def fsdp_unsharded_bytes(cfg: Config, shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    """What fully_shard holds whole in the forward and backward: the root unit's parameters (embeddings, final
    norm, head) and one decoder layer's at a time, and their unsharded gradients before the reduce-scatter."""
    root = sum(numel(s) for n, s in shapes if ".layers." not in n)
    layer = sum(numel(s) for n, s in shapes if ".layers.0." in n)
    return 2 * (root + layer) * DTYPE_BYTES[cfg.trainer.dtype]


def gather_transient_bytes(cfg: Config, shapes: list[tuple[str, tuple[int, ...]]], world: int) -> int:
    """The update's gather from shards (rlsync.update.gather): the full tensors held at once (update.gather) and
    this rank's packed shards of them, in the trainer's dtype, or the gather floor's probe, the larger."""
    t = DTYPE_BYTES[cfg.trainer.dtype]
    mode = cfg.update.gather
    if mode == "all_at_once":
        held = sum(numel(s) for _, s in shapes) * t
    elif mode == "per_tensor":
        held = max(numel(s) for _, s in shapes) * t
    else:  # per_bucket: the largest bucket (planned in the engine's dtype, as the update plans it), gathered in
        held = planned_largest_bucket(cfg, shapes) * t // DTYPE_BYTES[cfg.rollout.dtype]  # the trainer's
    call = GATHER_CALL_MAX  # one call's output buffer
    probe = min(sum(numel(s) for _, s in shapes) * t, GATHER_CALL_MAX) * (1 + 1 / world)
    return int(max(held * (1 + 1 / world) + call, probe))


def rank_estimate(cfg: Config, *, cuda: bool, runtime_bytes: int, ranks: Ranks, rank: int) -> Estimate:
    """One rank's peak memory by part (a single process is rank 0 of one)."""
    world = ranks.world
    parallel = parallel_class(cfg.trainer.parallel)  # what its class declares: sharded state, DDP's gradient buckets
    sharded = world > 1 and parallel.sharded
    shapes = sent_shapes(cfg)  # update.payload=lora: the adapters too
    held = sharded_shapes(shapes, world) if sharded else shapes  # what this rank's trainer holds of each tensor
    params = sum(numel(s) for _, s in shapes)
    t, e = DTYPE_BYTES[cfg.trainer.dtype], DTYPE_BYTES[cfg.rollout.dtype]
    trainer = sum(numel(s) for _, s in held) * t * (2 + ADAM_MOMENTS)  # weights, grads, AdamW moments
    adapters = adapter_shapes_of(cfg)
    if adapters:  # LoRA: the base weights alone, frozen; the adapters with grads and moments
        base = sum(numel(s) for _, s in param_shapes(cfg.model))
        trainer = (base + sum(numel(s) for _, s in adapters) * (2 + ADAM_MOMENTS)) * t
    reference = params * t if cfg.trainer.kl_coef > 0 else 0  # a whole frozen copy on every rank
    has_engine = rank == 0 or cfg.rollout.placement == "every_rank"
    groups = split_groups(cfg.rollout.prompts_per_step, world)[rank]  # this rank's share of the prompt groups
    engine_groups = cfg.rollout.prompts_per_step if world > 1 and cfg.rollout.placement == "rank0" else groups
    engine_weights = params * e if has_engine else 0
    staging_trainer, staging_engine = staging_bytes(cfg, shapes) if has_engine else (0, 0)
    payload = payload_bytes(cfg, shapes) if has_engine else 0
    prompt = prompt_tokens()
    train_act, _ = activation_bytes(with_prompts(cfg, groups), prompt)
    _, rollout_act = activation_bytes(with_prompts(cfg, engine_groups), prompt) if has_engine else (0, 0)
    train_act += optimizer_bytes(cfg, adapters or held, cuda)  # over what trains
    if sharded:
        train_act += fsdp_unsharded_bytes(cfg, shapes)
    if not cuda:  # on CUDA transformers' grouped expert matmul gathers no weights
        r = cfg.rollout
        micro = min(cfg.trainer.micro_batch_size, groups * r.samples_per_prompt)
        train_act += expert_gather_bytes(cfg, micro * (prompt + r.max_response_len))
    probe = probe_bytes(trainer, engine_weights)  # the copy floors (data parallel: each rank its link's share)
    gather = gather_transient_bytes(cfg, shapes, world) if sharded else 0
    model = _cached("model", cfg.model, model_shapes)  # the offload moves parameters, fused experts whole
    extra = offload_extra(cfg, sharded_shapes(model, world) if sharded else model, cuda)
    ddp = params * t if world > 1 and parallel.grad_buckets else 0  # DDP's gradient buckets, a copy
    own_engine = transport_class(cfg.update.transport).engine_in_process  # its KV cache lives in this process
    remote = bool(cfg.update.engine_address)  # an engine on another machine: not this one's memory
    est = Estimate()
    est.process["runtime"] = runtime_bytes
    est.process["step_workspace"] = STEP_WORKSPACE
    if not cuda:
        # The C heap keeps what a phase freed (measured: Qwen3-0.6B bf16 kept 1.6 GiB of its 2.3 GiB
        # training peak), so the step's transients add up and the probes between steps (every_step) come on
        # top; the gather from shards too (measured over 2 ranks: each rank's peak grows with it).
        step = train_act + (rollout_act if own_engine else 0)  # the rollout's KV cache, kept by the heap too
        between_steps = cfg.run.limit_probe == "every_step"
        est.process.update(
            {
                "trainer_state": trainer,
                "reference": reference,
                "offload_extra": extra,
                "staging": staging_trainer,
                "transient": step + probe + gather if between_steps else max(step, probe) + gather,
            }
        )
        if payload:
            est.process["payload"] = payload
        if ddp:
            est.process["ddp_buckets"] = ddp
        if own_engine:
            est.process["engine_weights"] = engine_weights
        elif not remote and has_engine:
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
        if not own_engine and not remote and has_engine:
            est.engine_process = {"runtime": runtime_bytes}
        if cfg.rollout.release_level == 1 and has_engine and not remote:  # the engine's weights sleep on the host
            host_copy = sum(pinned_bytes(numel(s) * e) for _, s in shapes)  # pinned, one block per storage
            (est.process if own_engine else est.engine_process)["engine_weights_asleep"] = host_copy
        est.device = {
            "trainer_state": trainer,
            "reference": reference,
            "staging": staging_trainer + staging_engine,
            "transient": max(train_act, probe, gather),  # the caching allocator reuses one phase's blocks in the next
        }
        if payload:
            est.device["payload"] = payload
        if ddp:
            est.device["ddp_buckets"] = ddp
        if not remote:
            est.device.update({"engine_weights": engine_weights, "kv_cache": rollout_act})
    return est


def bench_estimate(cfg: Config, *, cuda: bool, runtime_bytes: int) -> Estimate:
    """`python -m rlsync.bench`'s peak: the trainer's weights (no optimizer, no step), the engine, the
    update's staging and the copy-floor probe; the offload target adds the state it moves and its twin."""
    shapes = sent_shapes(cfg)  # update.payload=lora: the adapters too
    params = sum(numel(s) for _, s in shapes)
    t, e = DTYPE_BYTES[cfg.trainer.dtype], DTYPE_BYTES[cfg.rollout.dtype]
    est = Estimate()
    est.process = {"runtime": runtime_bytes, "step_workspace": STEP_WORKSPACE}
    where = est.device if cuda else est.process
    if getattr(cfg, "bench", None) is not None and cfg.bench.target == "stall":
        return stall_bench_estimate(cfg, est, shapes, runtime_bytes)
    if getattr(cfg, "bench", None) is not None and cfg.bench.target == "offload":
        state = params * t * ((2 + ADAM_MOMENTS) if cfg.bench.offload_state == "trainer" else 1)
        where.update({"trainer_state": state, "probe": probe_bytes(state, params * t)})
        est.process["offload_extra"] = state  # its host side (move: the host buffers; twin: the copy)
        return est
    staging_trainer, staging_engine = staging_bytes(cfg, shapes)
    host_source = params * t if cfg.update.source == "host" else 0  # the offloader's host copy it sends from
    where.update(
        {
            "trainer_weights": params * t,
            "engine_weights": params * e,
            "staging": staging_trainer + staging_engine,
            "probe": probe_bytes(params * t, params * e),
        }
    )
    if host_source:
        est.process["host_source"] = host_source
    payload = payload_bytes(cfg, shapes)  # plans the buckets: once
    if payload:
        where["payload"] = payload
    if not transport_class(cfg.update.transport).engine_in_process and not cfg.update.engine_address and not cuda:
        est.engine_process = {"runtime": runtime_bytes, "step_workspace": STEP_WORKSPACE}
    return est


# ----------------------------------------------------------------------------------------------
# The standalone engine's staged copy (serve.update_policy's), and bench.target=stall
# ----------------------------------------------------------------------------------------------


def staged_copy_bytes(cfg: Config, policy: str | None = None) -> int:
    """The copies of the engine's weights (rollout.dtype) a standalone engine under serve.update_policy (or
    `policy`) holds beside them: as many as the policy declares (`UpdatePolicy.staged_copies`: stage's side
    copy, which it receives each update into while it generates; rlsync/serve/policies). 0 without serve.*."""
    policy = policy or getattr(getattr(cfg, "serve", None), "update_policy", None)
    copies = update_policy_class(policy).staged_copies if policy else 0
    return copies * sum(numel(s) for _, s in param_shapes(cfg.model)) * DTYPE_BYTES[cfg.rollout.dtype]


def stall_bench_estimate(cfg: Config, est: Estimate, shapes, runtime_bytes: int) -> Estimate:
    """bench.target=stall: this process holds the two models it alternates between (trainer.dtype), an
    engine that scores the answers and the update's trainer-side staging per policy; each policy's
    standalone engine is a process of its own (its runtime, weights, receive staging and the copies its
    policy stages), counted in `engine_process` by policy."""
    params = sum(numel(s) for _, s in shapes)
    t, e = DTYPE_BYTES[cfg.trainer.dtype], DTYPE_BYTES[cfg.rollout.dtype]
    joining = transports_with(joins_address=True)[0]  # what a standalone engine is joined through (broadcast)
    remote = dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, transport=joining))
    staging_trainer, staging_engine = staging_bytes(remote, shapes)
    policies = list(cfg.bench.policies)
    est.process.update(
        {
            "trainer_weights": 2 * params * t,  # two random models, the updates alternate between them
            "scorer_weights": params * e,
            "staging": staging_trainer * len(policies),
            "probe": probe_bytes(params * t, params * e),
        }
    )
    for policy in policies:
        est.engine_process[f"{policy}_runtime"] = runtime_bytes + STEP_WORKSPACE
        est.engine_process[f"{policy}_engine_weights"] = params * e
        est.engine_process[f"{policy}_staging"] = staging_engine
        staged = staged_copy_bytes(cfg, policy)
        if staged:
            est.engine_process[f"{policy}_staged_copy"] = staged
    return est
