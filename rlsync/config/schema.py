"""The typed config tree: every key, its default, its value rule and a one-line comment.

Hydra composes rlsync/conf/ over these trees (`SCHEMAS`, registered by rlsync/config/compose.py), so a wrong
type or an unknown key is rejected while composing. Each key's value rule and the line `--help` shows sit
beside it (`key(default, rule, doc)`, rlsync/config/rules.py), a rule that ties keys together is the `check(root)`
method of the node it is about, and an engine's own rules are its class's (`Engine.check_config`);
rlsync/config/validate.py applies them all, once, before any model is built. Choices an implementation owns
are named by import path (`choices("rlsync.engines.base:engine_names")`) and looked up when checked: this
module imports nothing of rlsync but the rules and the error type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from rlsync.config.rules import (
    ANY,
    NAME,
    OPTIONAL_NAME,
    Rule,
    above,
    at_least,
    between,
    choices,
    counts,
    key,
    mebibytes,
    node,
    one_of,
    or_null,
    parsed_by,
    resolve,
    size_rule,
)
from rlsync.errors import ConfigError
from rlsync.fmt import is_number

SEED_MAX = 2**64 - 1  # torch.manual_seed takes an unsigned 64-bit seed
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"  # wandb.Settings.validate_project (wandb 0.2x/0.3x); also at most 128 chars
WANDB_PROJECT_MAX, WANDB_TAG_MAX = 128, 64  # characters; a tag must be 1 to 64 (wandb.Settings.validate_run_tags)
DTYPE = choices("rlsync.model.build:DTYPES")
SECONDS = above(0, "seconds")
COUNT = at_least(1)
VERDICT_THRESHOLD = 0.03  # run.verdict_threshold: the update share of the step above which tuning it pays
ENGINE_PLACEMENTS = ("rank0", "every_rank")  # rollout.placement: where data parallel's engines live
RELEASE_LEVEL_MAX = 2  # rollout.release_level: 0 keeps, 1 offloads the weights to host, 2 frees them
KL_COEF_MAX = 1000.0  # trainer.kl_coef: typical weights are 1e-3 to 1; 1e308 turns the loss into inf
COPY_THREADS_MAX = 1024  # update.copy_threads: torch.set_num_threads(100000) crashes the process
# run.steps, bench.repeats and their warm-ups: more than any published RL run (DeepSeek-R1-Zero: about 10^4 steps)
# while rlsync times a few, so a larger count is a typo (10^23 ran until killed); each step is a row kept in memory
STEPS_MAX = 1_000_000
STEPS = counts(1, STEPS_MAX, "more steps than any RL run takes is a typo")
# Plausible model sizes: 8x the largest published (126 layers, 53k wide, 256k vocabulary), so a typo is
# refused at once instead of a memory check that builds 100000 layers on the meta device to count them.
LAYERS_MAX, WIDTH_MAX, VOCAB_MAX, HEADS_MAX = 1024, 1 << 19, 1 << 21, 1024


@dataclass
class ModelConfig:
    name: str = key("tiny", NAME, "label used in tables and run names")
    hidden_size: int = key(256, size_rule(WIDTH_MAX, "a width"), "width of the residual stream")
    intermediate_size: int = key(512, size_rule(WIDTH_MAX, "a width"), "MLP width")
    num_hidden_layers: int = key(4, size_rule(LAYERS_MAX, "layers"), "transformer blocks")
    num_attention_heads: int = key(4, size_rule(HEADS_MAX, "heads"), "query heads")
    num_key_value_heads: int = key(2, size_rule(HEADS_MAX, "heads"), "grouped-query attention")
    head_dim: int = key(
        64,
        Rule(
            lambda v: is_number(v) and v >= 2 and v % 2 == 0,
            "an even integer >= 2 (rotary embeddings turn pairs of dims)",
        ),
        "width of one attention head",
    )
    vocab_size: int = key(512, size_rule(VOCAB_MAX, "tokens"), ">= 259 for the byte tokenizer; Qwen3 uses 151936")
    tie_word_embeddings: bool = key(True, ANY, "lm_head shares the embedding (sent once in the update)")
    max_position_embeddings: int = key(40960, COUNT, "longest sequence (prompt + response) the model takes")
    rope_theta: float = key(
        1_000_000.0,
        at_least(1, "the rotary base: published models use 1e4 to 1e8; tiny ones make the frequencies overflow"),
        "rotary position embedding base",
    )
    rms_norm_eps: float = key(1e-6, above(0), "RMSNorm epsilon")
    pretrained: Optional[str] = key(
        None,
        OPTIONAL_NAME,
        "local dir or hub id: load real weights + tokenizer instead (and it must exist: rlsync.config.validate)",
    )
    config: Optional[str] = key(
        None,
        OPTIONAL_NAME,
        "a transformers config.json (or a folder holding one): any causal-LM architecture, random weights; its values replace the keys above at validation (name too while it is tiny)",
    )
    update_layout: str = key(
        "checkpoint",
        choices("rlsync.model.architecture:LAYOUTS"),
        "checkpoint: one tensor per expert and projection, as published checkpoints name them (what trainers send) | fused: transformers' in-memory 3-D expert tensors; same for dense models",
    )

    def check(self, root: Config) -> None:
        if self.config:
            if self.pretrained:
                raise ConfigError(
                    "model.config",
                    self.config,
                    "null with model.pretrained (the checkpoint's own config.json describes its model)",
                    "not allowed with model.pretrained",
                )
            resolve("rlsync.model.architecture:check_supported")(self)  # model_type, then a meta build of it
            resolve("rlsync.model.architecture:fill_keys")(self)  # the model.* keys the rest of rlsync reads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "model.num_key_value_heads",
                self.num_key_value_heads,
                f"a divisor of model.num_attention_heads={self.num_attention_heads}",
                "not allowed",
            )
        byte_ids = resolve("rlsync.model.build:ByteTokenizer.size")
        if not self.pretrained and self.vocab_size < byte_ids:
            raise ConfigError(
                "model.vocab_size",
                self.vocab_size,
                f">= {byte_ids} (the byte tokenizer's ids) unless model.pretrained is set",
                "out of range",
            )


def replaced_by_payload(key: str, value) -> tuple[str, str]:
    """(problem, allowed) refusing a key update.payload replaced: the value of update.payload to write (the payload
    package maps each old value: rlsync.update.payload.base.replaced_key)."""
    return resolve("rlsync.update.payload.base:replaced_key")(key, value)


@dataclass
class UpdateConfig:
    # Keys update.payload replaced, old leaf -> how to say what replaced it (rlsync.errors.renamed_key). Not a field.
    renamed_keys = dict.fromkeys(("delta", "wire_dtype", "lora"), replaced_by_payload)

    enabled: bool = key(True, ANY, "false: skip the update (baseline step; stale engine for the log-prob check)")
    bucket_mb: float = key(
        512.0, mebibytes("the bucket's size"), "bucket size in MiB (512 = --update-weight-buffer-size 536870912)"
    )
    strategy: str = key(
        "bucketed",
        choices("rlsync.update.base:strategy_names"),
        "bucketed: flat buffer per bucket | per_tensor: one copy per tensor",
    )
    transport: str = key(
        "direct",
        choices("rlsync.update.base:transport_names"),
        "direct: engine in the trainer's process | ipc: own process, shared buffers | broadcast: own process, torch.distributed",
    )
    source: str = key(
        "device",
        choices("rlsync.update.base:SOURCES"),
        "device: from live trainer weights | host: from the offloaded copy",
    )
    inflight_buckets: int = key(
        1,
        between(1, 2, "2 overlaps packing one bucket with loading the other"),
        "staging buffers in flight (2 overlaps pack and load)",
    )
    verify: bool = key(False, ANY, "checksum every engine tensor against the trainer after each update")
    # The one key that chooses what each bucket carries; its choices are the payload registry's (docs/payloads.md)
    payload: str = key(
        "full",
        choices("rlsync.update.payload.base:payload_names"),
        "full: every element | delta: only the elements whose engine-dtype value changed since the last update (the first is full) | fp8: 2-D weights in FP8 with a scale per 128x128 block (embeddings, lm_head, norms kept) | with trainer.lora.rank > 0: lora: the engine holds base and adapters and receives the adapters only (the first update sends all) | lora_merged: W + alpha/rank*BA merged in fp32, the whole model sent",
    )
    flat_engine_weights: Optional[bool] = key(
        None,
        ANY,
        "engine weights are views into bucket-laid-out flat buffers, packing writes them (one copy); null (auto): on wherever the engine can hold them (flat_engine_weights_choice)",
    )
    backend: str = key(
        "auto",
        choices("rlsync.update.base:BACKENDS"),
        "broadcast's torch.distributed backend: auto = gloo (NCCL refuses two ranks on one GPU)",
    )
    engine_timeout_s: float = key(
        3600.0, SECONDS, "longest wait for one engine reply (start, generate, load); a dead engine fails at once"
    )
    engine_address: Optional[str] = key(
        None,
        or_null(
            parsed_by(
                "rlsync.client.client:parse_address",
                "HOST:PORT (port 1 to 65535; 0 lets python -m rlsync.serve pick a free one)",
            )
        ),
        "broadcast: HOST:PORT of an engine started on its own (python -m rlsync.serve listens there); null: start it here",
    )
    engine_connect_timeout_s: float = key(
        120.0, SECONDS, "with engine_address: how long to retry while that engine is not listening yet"
    )
    copy_threads: Optional[int] = key(
        None,
        or_null(between(0, COPY_THREADS_MAX, "0 keeps torch's default; torch crashes creating a pool of 100000")),
        "torch CPU threads for the update, per process (0: torch's default); null (auto): the count that copies a sample of the update's own tensors fastest, timed at start (rlsync.update.auto)",
    )
    gather: str = key(
        "per_bucket",
        choices("rlsync.update.gather:GATHER_MODES"),
        "trainer.parallel=fsdp2: per_bucket: each bucket's full tensors gathered from the shards just before it is sent (holds one bucket) | per_tensor: each tensor as it is read (verl, TRL) | all_at_once: the whole model first (a full state dict; holds the model)",
    )
    scheme: str = key(
        "rlsync",
        NAME,
        "label of the framework scheme these knobs follow (set by scheme=NAME, rlsync/conf/scheme/); reports group by it",
    )

    def check(self, root: Config) -> None:
        if self.source == "host" and root.trainer.offload == "none":
            raise ConfigError(
                "update.source",
                "host",
                "device (source=host sends from the offloaded copy, which trainer.offload=none never makes)",
                "not allowed with trainer.offload=none",
            )
        if self.engine_address and not resolve("rlsync.update.base:transport_class")(self.transport).joins_address:
            joining = resolve("rlsync.update.base:transports_with")(joins_address=True)
            raise ConfigError(
                "update.transport",
                self.transport,
                f"{', '.join(joining)} (an engine started on its own, at update.engine_address, is joined through "
                "a transport whose class declares joins_address)",
                "not allowed with update.engine_address",
            )
        if (
            self.flat_engine_weights
            and root.model.update_layout == "checkpoint"
            and resolve("rlsync.model.architecture:has_fused_experts")(root.model)
        ):
            raise ConfigError(
                "update.flat_engine_weights",
                True,
                "false with model.update_layout=checkpoint, or "
                "model.update_layout=fused (the engine's fused expert tensors cannot be bound to "
                "per-expert slots of the flat buffers)",
                "not allowed for a model with fused experts",
            )


@dataclass
class RolloutConfig:
    # Keys renamed, old -> new: refused in one line naming the new one (rlsync.errors.renamed_key). Not a field.
    # sleep_level -> release_level: it is what the engine's `release` frees (vLLM's sleep levels), not the trainer's
    # offload, which the docs and metrics call offload and onload.
    renamed_keys: ClassVar[dict[str, str]] = {"sleep_level": "release_level"}

    engine: str = key(
        "hf",
        choices("rlsync.engines.base:engine_names"),
        "hf: transformers model with a KV cache, embedded | any other engine registered in rlsync.engines (a bad value lists them)",
    )
    max_response_len: int = key(32, at_least(1, "tokens"), "answers are cut here (tokens)")
    prompts_per_step: int = key(4, COUNT, "prompts per step (each sampled samples_per_prompt times)")
    samples_per_prompt: int = key(
        4, at_least(2, "GRPO normalises rewards within a group: one sample has no spread"), "the GRPO group size (>= 2)"
    )
    temperature: float = key(1.0, at_least(0, "0 is greedy"), "sampling temperature (0: greedy)")
    dtype: str = key("bfloat16", DTYPE, "engine weights dtype")
    release_level: int = key(
        1,
        between(0, RELEASE_LEVEL_MAX, "vLLM's sleep levels"),
        "what the engine's release frees after generation, as vLLM's sleep levels: 0 keeps everything | 1 frees the KV cache, weights to host memory (back before the update) | 2 frees both (the update refills the weights)",
    )
    placement: str = key(
        "rank0",
        one_of(ENGINE_PLACEMENTS),
        "data parallel: rank0: one engine, on rank 0, generates the whole batch | every_rank: one per rank (colocated, verl's layout), each its rank's prompt groups",
    )
    vllm_reload_mode: Optional[str] = key(
        None,
        or_null(one_of(("layerwise", "direct"))),
        "rollout.engine=vllm on vLLM 0.34+: VLLM_RELOAD_MODE (layerwise | direct: in place, CUDA graphs stay valid); null: vLLM's default",
    )

    def check(self, root: Config) -> None:
        limit = root.model.max_position_embeddings
        if self.max_response_len >= limit:
            raise ConfigError(
                "rollout.max_response_len",
                self.max_response_len,
                f"< model.max_position_embeddings={limit}",
                "out of range",
            )
        if self.release_level == 2 and not root.update.enabled:
            raise ConfigError(
                "rollout.release_level",
                2,
                "0, 1 (level 2 frees the weights, refilled only by the weight update, which update.enabled=false skips)",
                "not allowed with update.enabled=false",
            )


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # attention and MLP
RANK_MAX = 4096
# trainer.lora.alpha: the adapters' output is scaled by alpha / rank. Recipes set alpha to 1 to 2x the rank (a scale
# of 0.5 to 2); 2^14 (a scale of 16384 at rank 1) is past any, while 1e308 makes the scale inf in fp32 and bf16 and
# the first forward nan (0 x inf: B starts at zero)
ALPHA_MAX = 16384.0


def names_ok(v) -> bool:
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(n, str) and n for n in v)


@dataclass
class LoraConfig:
    rank: int = key(
        0,
        between(0, RANK_MAX, "0 is full fine-tuning"),
        "LoRA rank through PEFT: 0 trains every weight (full fine-tuning) | r > 0 trains rank-r adapters only",
    )
    alpha: float = key(
        32.0,
        Rule(
            lambda v: is_number(v) and 0 < v <= ALPHA_MAX,
            f"a number > 0 and at most {ALPHA_MAX:g} (alpha / rank scales the adapters' output: "
            "recipes use 1 to 2x the rank; far larger overflows it)",
        ),
        "LoRA alpha: the adapters' output is scaled by alpha / rank",
    )
    target_modules: list[str] = key(
        LORA_TARGETS,
        Rule(names_ok, "a non-empty list of module names (PEFT matches each against a layer name's end)"),
        "the linear layers that get an adapter (all attention and MLP projections)",
    )

    def check(self, root: Config) -> None:
        if not self.rank:
            return
        # the layers the targets name, on a meta build: linear ones the adapters wrap, a rank they can hold
        resolve("rlsync.model.lora:check_layers")(self, root.model)
        world = resolve("rlsync.config.launch:launched")()[1]
        if world > 1 and resolve("rlsync.trainer.parallel:parallel_class")(root.trainer.parallel).sharded:
            whole = resolve("rlsync.trainer.parallel:parallels_with")(spans_ranks=True, sharded=False)
            raise ConfigError(
                "trainer.parallel",
                root.trainer.parallel,
                f"{', '.join(whole)} with trainer.lora.rank > 0 (the sharded update gathers whole tensors: adapters "
                "are not planned for it)",
                "not allowed with LoRA",
            )


@dataclass
class TrainerConfig:
    lr: float = key(1e-5, at_least(0), "AdamW learning rate")
    dtype: str = key("float32", DTYPE, "parameter (master weight) dtype")
    micro_batch_size: int = key(8, COUNT, "sequences per forward/backward")
    clip_eps: float = key(0.2, above(0), "PPO clip range of the ratio")
    kl_coef: float = key(
        0.0,
        between(0, KL_COEF_MAX, "the KL term's weight; a larger one swamps the loss and overflows its gradient"),
        "> 0 keeps a frozen reference model and times its log-probs",
    )
    offload: str = key(
        "full",
        choices("rlsync.trainer.offload:OFFLOAD_MODES"),
        "full: params, grads, optimizer state to host after the step | drop_grads: not the grads (zeroed on wake-up) | none",
    )
    offload_memory: str = key(
        "auto",
        choices("rlsync.trainer.offload:OFFLOAD_MEMORY"),
        "twin: persistent (pinned) host copy, on a CPU the state twice | move: segment by segment, the state once | auto: move on a CPU, twin on CUDA",
    )
    offload_segment_mb: float = key(
        128.0,
        mebibytes("the largest segment"),
        "move: largest segment in MiB (a bigger tensor is its own); one spare buffer per segment size",
    )
    offload_pin_chunk_mb: float = key(
        1024.0,
        mebibytes("the largest pinned chunk"),
        "twin: the host copy is allocated (pinned on CUDA) in chunks of at most this many MiB (a bigger tensor is its own); a power of two wastes nothing to torch's rounding",
    )
    offload_free_device: Optional[bool] = key(
        None,
        ANY,
        "free what stays on the device while asleep (twin: its copy; move: dropped grads); null: on CUDA only (re-faulting CPU pages costs more than the copy)",
    )
    grad_clip: float = key(1.0, above(0), "max grad norm")
    parallel: str = key(
        "ddp",
        choices("rlsync.trainer.parallel:parallel_names"),
        "data-parallel launches: ddp: the whole model per rank, gradients all-reduced (accelerate's DDP) | fsdp2: weights, grads, AdamW state sharded (torch fully_shard), the update gathers them | none: one process only",
    )
    lora: LoraConfig = node(LoraConfig, "LoRA adapters through PEFT: rank 0 (the default) trains every weight")

    def check(self, root: Config) -> None:
        world = resolve("rlsync.config.launch:launched")()[1]
        if world <= 1:
            return
        parallel = resolve("rlsync.trainer.parallel:parallel_class")(self.parallel)  # its declared facts
        if not parallel.spans_ranks:
            spanning = resolve("rlsync.trainer.parallel:parallels_with")(spans_ranks=True)
            raise ConfigError(
                "trainer.parallel",
                self.parallel,
                f"{', '.join(spanning)} (with {world} data-parallel ranks)",
                "not allowed",
            )
        if parallel.sharded and root.rollout.prompts_per_step % world:
            raise ConfigError(
                "rollout.prompts_per_step",
                root.rollout.prompts_per_step,
                f"a multiple of the {world} ranks with trainer.parallel={self.parallel} (each forward is a collective: "
                "every rank must run as many micro-batches)",
                "out of range",
            )
        if parallel.sharded and root.update.source == "host":
            raise ConfigError(
                "update.source",
                "host",
                f"device with trainer.parallel={self.parallel} (the host copy holds this rank's shards; the update "
                "gathers whole tensors from the live ones)",
                f"not allowed with trainer.parallel={self.parallel}",
            )


@dataclass
class RunConfig:
    steps: int = key(6, STEPS, "steps to run, warm-up included")
    warmup_steps: int = key(2, at_least(0), "left out of every summary")
    seed: int = key(
        0,
        Rule(
            lambda v: is_number(v) and 0 <= v <= SEED_MAX,
            f"0 to 2^64 - 1 = {SEED_MAX} (torch seeds are unsigned 64-bit)",
        ),
        "seeds the model init and the sampling",
    )
    device: str = key(
        "auto",
        Rule(lambda v: v in ("auto", "cpu") or v == "cuda" or v.startswith("cuda:"), "auto, cpu, cuda, cuda:N"),
        "auto: cuda when available, else cpu (and present: rlsync.config.validate)",
    )
    verdict_threshold: float = key(
        VERDICT_THRESHOLD,
        Rule(lambda v: is_number(v) and 0 < v < 1, "a share of the step between 0 and 1"),
        "update share of the step above which it is worth tuning",
    )
    progress: bool = key(True, ANY, "progress bar over the steps")
    rank_timeout_s: float = key(
        3600.0, SECONDS, "data-parallel launches: longest a rank waits for the others (rank 0's rollout included)"
    )
    limit_probe: str = key(
        "every_step",
        choices("rlsync.measure.floors:PROBES"),
        "every_step: re-measure the copy floors before each step, outside its timing (they drift with the load) | start: once, before step 0",
    )
    memory_check: bool = key(True, ANY, "refuse a run whose estimated peak memory exceeds the machine's (rlsync.check)")
    dry_run: bool = key(
        False, ANY, "print what would run (each job's memory fit, an estimated duration) and start nothing"
    )
    cpu_threads: Optional[int] = key(
        None,
        or_null(between(1, COPY_THREADS_MAX, "more threads than that crash OpenMP")),
        "torch CPU threads for the run's phases on a CPU; null (auto): the cores free at start, so a busy machine is not oversubscribed (rlsync.measure.threads)",
    )

    def check(self, root: Config) -> None:
        if self.warmup_steps >= self.steps:
            raise ConfigError(
                "run.warmup_steps",
                self.warmup_steps,
                f"0 to run.steps - 1 = {self.steps - 1}, so that a step is measured",
                "leaves no step to measure",
            )


def wandb_project_ok(v) -> bool:
    return (
        isinstance(v, str)
        and bool(v.strip())
        and len(v) <= WANDB_PROJECT_MAX
        and not any(c in v for c in WANDB_PROJECT_FORBIDDEN)
    )


def wandb_tags_ok(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, str) and 1 <= len(t) <= WANDB_TAG_MAX for t in v)


@dataclass
class WandbConfig:
    mode: str = key("offline", choices("rlsync.record.sinks:WANDB_MODES"), "offline (sync later) | online | disabled")
    project: str = key(
        "rlsync",
        Rule(
            wandb_project_ok,
            f"a non-empty name of at most {WANDB_PROJECT_MAX} characters, "
            f"without any of {' '.join(WANDB_PROJECT_FORBIDDEN)} (W&B refuses them)",
        ),
        "W&B project",
    )
    entity: Optional[str] = key(None, OPTIONAL_NAME, "W&B team or user; null: your default entity")
    group: Optional[str] = key(None, OPTIONAL_NAME, "default: the sweep (or run) directory name")
    tags: list[str] = key(
        [],
        Rule(wandb_tags_ok, f"a list of tags of 1 to {WANDB_TAG_MAX} characters each (W&B's limit)"),
        "W&B run tags, e.g. '[a,b]'",
    )
    init_timeout: float = key(
        60.0, SECONDS, "seconds W&B may take to start; then the run logs offline (online) or locally only"
    )


@dataclass
class Config:
    model: ModelConfig = node(ModelConfig, "the model, built alike by trainer and engine (presets: model=NAME)")
    update: UpdateConfig = node(UpdateConfig, "the weight update, trainer -> engine")
    rollout: RolloutConfig = node(RolloutConfig, "the rollout engine and its sampling (presets: rollout=NAME)")
    trainer: TrainerConfig = node(TrainerConfig, "optimizer, GRPO loss, offload to host between steps")
    run: RunConfig = node(RunConfig, "steps, device, what is measured and shown")
    wandb: WandbConfig = node(WandbConfig, "Weights & Biases logging")
