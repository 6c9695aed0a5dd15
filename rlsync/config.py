"""The typed config tree.

Hydra composes YAML from conf/ on top of the `Config` schema registered here, so a wrong type or an
unknown key is rejected while composing. `to_config` turns the composed DictConfig into plain
dataclasses once, at the entry point; the rest of the code only reads attributes of that tree
(no `cfg.update` surprises: on a DictConfig that is the `update` method, not the node).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from rlsync.fmt import MIB


@dataclass
class ModelConfig:
    name: str = "tiny"  # label used in tables and run names
    hidden_size: int = 256
    intermediate_size: int = 512  # MLP width
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # grouped-query attention
    head_dim: int = 64
    vocab_size: int = 512  # >= 259 for the byte tokenizer; Qwen3 uses 151936
    tie_word_embeddings: bool = True  # lm_head shares the embedding (sent once in the update)
    max_position_embeddings: int = 40960
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    pretrained: Optional[str] = None  # local dir or hub id: load real weights + tokenizer instead


@dataclass
class UpdateConfig:
    enabled: bool = True  # false: skip the update (baseline step; stale engine for the log-prob check)
    bucket_mb: float = 512.0  # bucket size in MiB (512 = --update-weight-buffer-size 536870912)
    strategy: str = "bucketed"  # bucketed: flat buffer per bucket | per_tensor: one copy per tensor
    transport: str = "direct"  # direct: engine in the trainer's process | ipc: own process, shared buffers | broadcast: own process, torch.distributed
    source: str = "device"  # device: from live trainer weights | host: from the offloaded copy
    inflight_buckets: int = 1  # staging buffers in flight (2 overlaps pack and load)
    verify: bool = False  # checksum every engine tensor against the trainer after each update
    flat_engine_weights: bool = False  # engine weights are views into bucket-laid-out flat buffers: packing writes them (one copy)
    backend: str = "auto"  # broadcast's torch.distributed backend: auto = gloo (NCCL refuses two ranks on one GPU)
    engine_timeout_s: float = 3600.0  # longest wait for one engine reply (start, generate, load); a dead engine fails at once
    engine_address: Optional[str] = None  # broadcast: HOST:PORT of an engine started on its own (python -m rlsync.engine listens there); null: start it here
    engine_connect_timeout_s: float = 120.0  # with engine_address: how long to retry while that engine is not listening yet
    copy_threads: int = 1  # torch CPU threads for the update's copies, per process (0: torch's default); 1 reaches memcpy speed


@dataclass
class RolloutConfig:
    engine: str = "hf"  # hf: transformers model with a KV cache | vllm: vLLM in this process (the vllm extra)
    max_response_len: int = 32  # answers are cut here (tokens)
    prompts_per_step: int = 4
    samples_per_prompt: int = 4  # the GRPO group size (>= 2)
    temperature: float = 1.0
    dtype: str = "bfloat16"  # engine weights dtype
    release_weights: bool = False  # engine frees its weights after generation (KV cache always); re-allocated before the update, which refills them


@dataclass
class TrainerConfig:
    lr: float = 1e-5  # AdamW learning rate
    dtype: str = "float32"  # parameter (master weight) dtype
    micro_batch_size: int = 8  # sequences per forward/backward
    clip_eps: float = 0.2  # PPO clip range of the ratio
    kl_coef: float = 0.0  # > 0 keeps a frozen reference model and times its log-probs
    offload: str = "full"  # full: params, grads, optimizer state to host after the step | drop_grads: not the grads (zeroed on wake-up) | none
    offload_memory: str = "auto"  # twin: persistent (pinned) host copy, on a CPU the state twice | move: segment by segment, the state once | auto: move on a CPU, twin on CUDA
    offload_segment_mb: float = 128.0  # move: largest segment in MiB (a bigger tensor is its own); one spare buffer per segment size
    offload_pin_chunk_mb: float = 1024.0  # twin: the host copy is allocated (pinned on CUDA) in chunks of at most this many MiB (a bigger tensor is its own); a power of two wastes nothing to torch's rounding
    offload_free_device: Optional[bool] = None  # free what stays on the device while asleep (twin: its copy; move: dropped grads); null: on CUDA only (re-faulting CPU pages costs more than the copy)
    grad_clip: float = 1.0  # max grad norm


@dataclass
class RunConfig:
    steps: int = 6
    warmup_steps: int = 2  # left out of every summary
    seed: int = 0
    device: str = "auto"  # auto: cuda when available, else cpu
    verdict_threshold: float = 0.03  # update share of the step above which it is worth tuning
    progress: bool = True  # progress bar over the steps
    rank_timeout_s: float = 3600.0  # data-parallel launches: longest a rank waits for the others (rank 0's rollout included)
    limit_probe: str = "every_step"  # every_step: re-measure the copy floors before each step, outside its timing (they drift with the load) | start: once, before step 0
    memory_check: bool = True  # refuse a run whose estimated peak memory exceeds the machine's (rlsync.memory)


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline (sync later) | online | disabled
    project: str = "rlsync"
    entity: Optional[str] = None
    group: Optional[str] = None  # default: the sweep (or run) directory name
    tags: list[str] = field(default_factory=list)
    init_timeout: float = 60.0  # seconds W&B may take to start; then the run logs offline (online) or locally only


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


BENCH_TARGETS = ("update", "offload")  # bench.target: what python -m rlsync.bench times


@dataclass
class BenchConfig:
    target: str = "update"  # what is timed: update (the weight update alone) | offload (trainer sleep + wake-up, trainer.offload)
    offload_state: str = "trainer"  # offload target: trainer (params, grads, AdamW state) | params (weights alone: 1.7B on 24 GiB)
    warmup: int = 2  # untimed repeats first (page faults, allocator, thread pools)
    repeats: int = 10  # timed repeats; the summary gives median, min and max over them


@dataclass
class ServeConfig:
    sessions: int = 0  # trainer sessions to serve, one after another, before exiting (0: until Ctrl-C or SIGTERM)
    request_timeout_s: float = 10.0  # longest a client may take to send one request (head and body); slower ones are dropped
    max_request_mb: float = 64.0  # largest request body (a plan, a generate request: well under 1 MiB for 1.7B); larger: 413, dropped


@dataclass
class EngineAppConfig(Config):
    """`python -m rlsync.engine`: the runner's tree (model, rollout, update.engine_address, run.device) plus `serve.*`."""

    serve: ServeConfig = field(default_factory=ServeConfig)


@dataclass
class BenchAppConfig(Config):
    """`python -m rlsync.bench`: the runner's tree plus the benchmark's own keys."""

    bench: BenchConfig = field(default_factory=BenchConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="rlsync_schema", node=Config)
    ConfigStore.instance().store(name="rlsync_bench_schema", node=BenchAppConfig)
    ConfigStore.instance().store(name="rlsync_engine_schema", node=EngineAppConfig)


def to_config(dcfg: DictConfig, schema: type = Config):
    """Resolve the composed config and turn it into the typed dataclass tree (`schema`'s)."""
    plain = OmegaConf.masked_copy(dcfg, [k for k in dcfg.keys() if k != "hydra"]) if "hydra" in dcfg else dcfg
    typed = OmegaConf.merge(OmegaConf.structured(schema), plain)
    return OmegaConf.to_object(typed)


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def bucket_bytes(cfg: UpdateConfig) -> int:
    return int(cfg.bucket_mb * MIB)
