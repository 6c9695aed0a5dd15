"""What every rollout engine is: the `Engine` interface, what it returns, and the registry of engines.

An engine holds its own copy of the weights (in the rollout dtype) and samples with them. It never
sees the trainer's tensors: a weight update hands it (name, tensor) pairs (`load_weights`), and
`generate` returns the sampled tokens with their log-probs under the engine's weights, which the
trainer compares against its own (`train/logprob_abs_diff`).

The registry maps `rollout.engine` to an engine class; the config rule for that key offers its
names. Adding an engine is one module holding an `Engine` subclass and one line:

    register_engine("mine", "mypackage.mine:MyEngine")   # resolved on first use: no import now
    register_engine("mine", MyEngine)                    # or the class itself

`register_engine("mine")` also works as a class decorator. Built-in engines are registered by their
"module:Class" path (below), so `import rlsync` never imports an engine's heavy dependencies (vLLM).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch

from rlsync.config.schema import LoraConfig, ModelConfig, RolloutConfig
from rlsync.errors import ConfigError
from rlsync.model.build import torch_dtype
from rlsync.registry import Registry

CHECKSUM_CHUNK = 1 << 22  # elements per step: bounds the checksum's int64 temporaries (32 MiB each)


# ----------------------------------------------------------------------------------------------
# Cancellation: a request whose client went away stops at the engine's next check
# ----------------------------------------------------------------------------------------------


class Cancelled(RuntimeError):
    """The request was cancelled while the engine worked on it (its client left, its session ended, the engine stops)."""


_CANCEL = threading.local()  # the events that cancel the work running on this thread


@contextmanager
def cancelled_by(*events: threading.Event) -> Iterator[None]:
    """Within the block, `check_cancelled()` on this thread raises Cancelled once any of `events` is set."""
    previous = getattr(_CANCEL, "events", ())
    _CANCEL.events = previous + events
    try:
        yield
    finally:
        _CANCEL.events = previous


def check_cancelled() -> None:
    """Raise Cancelled if the work on this thread was cancelled: engines call it between steps of long
    work (the HF engine once per generated token); outside `cancelled_by` it never raises."""
    if any(event.is_set() for event in getattr(_CANCEL, "events", ())):
        raise Cancelled("the request was cancelled")


@dataclass
class Generation:
    sequences: torch.Tensor  # [batch, prompt_len + response_len] left-padded prompt, then answer
    attention_mask: torch.Tensor  # [batch, prompt_len + response_len] 1 on real tokens
    response_mask: torch.Tensor  # [batch, response_len] 1 on sampled tokens (through EOS)
    logprobs: torch.Tensor  # [batch, response_len] engine log-prob of each sampled token, fp32
    prompt_len: int
    truncated: torch.Tensor  # [batch] bool: hit max_response_len without EOS

    def to(self, device: torch.device) -> Generation:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return Generation(**moved)


@dataclass
class EngineSpec:
    """Everything needed to build an engine, wherever it runs (this process or its own)."""

    model: ModelConfig
    rollout: RolloutConfig
    device: str
    allowed_ids: torch.Tensor  # [vocab] bool: ids generation may sample
    eos_id: int
    pad_id: int
    cpu_threads: int | None = None  # torch CPU threads of an engine process (run.cpu_threads as the run chose)
    lora: LoraConfig | None = None  # adapters the engine holds beside its weights (update.payload=lora)
    verify: bool = False  # update.verify: an engine whose weights read back otherwise (vLLM) records what it loaded

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.rollout.dtype)

    def build(self, *, strategy: str = "bucketed") -> Engine:
        """The engine named by rollout.engine; `strategy` (update.strategy) picks vLLM's own transfer path."""
        return build_engine(self, strategy)

    # An engine process builds from an unpickled spec: the engine's class travels with it (by
    # reference, so pickle imports its module there), and an engine registered outside rlsync, by
    # code that process never ran, builds there too.
    def __getstate__(self) -> dict:
        return {**vars(self), "engine_class": engine_class(self.rollout.engine)}

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        cls = state.pop("engine_class")
        vars(self).update(state)
        ENGINES.setdefault(self.rollout.engine, cls)


def engine_spec(
    model: ModelConfig,
    rollout: RolloutConfig,
    *,
    device,
    tokenizer,
    cpu_threads: int | None = None,
    lora: LoraConfig | None = None,
) -> EngineSpec:
    """The spec of the engine `rollout.engine` names, for `tokenizer`'s vocabulary (the ids generation may
    sample, its eos and pad ids): every entry point builds its engine's spec here. `lora`: the adapters
    the engine holds (the update's payload says: Payload.engine_lora)."""
    return EngineSpec(
        model=model,
        rollout=rollout,
        device=str(device),
        allowed_ids=tokenizer.allowed_ids(model.vocab_size),
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        cpu_threads=cpu_threads,
        lora=lora,
    )


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, allowed: torch.Tensor, temperature: float):
    """Log-prob of `tokens` under softmax(logits / T) restricted to `allowed` ids.

    The trainer uses this same function, so engine and trainer score tokens identically.
    """
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)  # [..., vocab]
    scaled = scaled.masked_fill(~allowed, float("-inf"))
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def checksum(t: torch.Tensor) -> int:
    """Order-sensitive integer checksum of a tensor's bits (equal bits <=> equal checksum, practically).

    Computed in chunks, so a 600 MiB embedding never needs gigabytes of int64 temporaries.
    """
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    bits = t.detach().contiguous().view(-1).view(int_dtype)
    total = 0
    for start in range(0, bits.numel(), CHECKSUM_CHUNK):
        chunk = bits[start : start + CHECKSUM_CHUNK].to(torch.int64)
        weights = (torch.arange(start, start + chunk.numel(), device=bits.device, dtype=torch.int64) % 65521) + 1
        total += int((chunk * weights).sum())
    return total


class Preloaded:
    """A class whose module (and `preload`) a forked engine process imports once, before its first
    engine starts: each engine process then starts without paying those imports."""

    preload: ClassVar[tuple[str, ...]] = ()  # modules beyond the class's own (its model code, its buffers)

    @classmethod
    def preload_modules(cls) -> tuple[str, ...]:
        """This class's module (which registers a class defined outside rlsync there too) and `preload`."""
        return (cls.__module__, *cls.preload)


class EngineHandle(ABC):
    """The engine as the step loop drives it, wherever it runs: an `Engine` in this process, or the handle
    on an engine in its own process (rlsync.engines.process.EngineProcess) or on a standalone one
    (rlsync.client.client.RemoteEngine). Weights reach it through a transport (rlsync.update.base.Transport)."""

    # After close: the engine process's own peak resident set; None for an engine in this process (its
    # memory is this process's) or one that did not say (a standalone engine).
    peak_rss_bytes: int | None = None

    @abstractmethod
    def generate(
        self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, generator: torch.Generator
    ) -> Generation:
        """Sample an answer to each prompt (token ids), seeded from `generator`, which comes back
        advanced as if the sampling ran here (wherever the engine runs)."""

    @abstractmethod
    def release(self) -> None:
        """Give memory back after generation (the trainer's turn); no `generate` until `resume`."""

    @abstractmethod
    def resume(self) -> None:
        """Take the memory back before the update and the rollout; idempotent."""

    @property
    @abstractmethod
    def weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights by the trainer's names (an engine in another process: CPU copies)."""

    def checksums(self) -> dict[str, int]:
        """One checksum per weight (update.verify compares them with the trainer's); an engine in another
        process computes them there."""
        return {name: checksum(t) for name, t in self.weights.items()}

    def close(self) -> None:  # noqa: B027 - optional: most engines in this process hold nothing beyond tensors
        """Free what the engine holds beyond its tensors (processes, files); safe to call twice."""


class Engine(Preloaded, EngineHandle):
    """A rollout engine, as the step loop and every transport drive it.

    The loop's order: `resume` (memory back), the weight update (`load_weights`, one call per
    bucket or tensor), `generate`, `release` (memory to the trainer). `weights` and `checksums`
    serve verification (update.verify) and the flat-weights layout; `close` frees what the engine
    holds beyond its tensors (processes, files).
    """

    device: torch.device  # where the engine's weights live and generation runs
    dtype: torch.dtype  # the weights' dtype (rollout.dtype): what an update casts to
    # Whether the engine's weights can be views into bucket-shaped flat buffers, by trainer name
    # (update.flat_engine_weights=null turns the one-copy layout on where this is true).
    holds_flat_weights: bool = False
    # Whether it builds the trainer's PEFT adapters beside its weights from `EngineSpec.lora` and generates
    # through them (a payload that sends the adapters alone needs it: Payload.engine_lora).
    takes_adapters: bool = False
    # Whether `load_weights` is itself a copy (and cast) from whatever tensors it is handed, and costs
    # per call rather than per byte: then the `direct` transport hands it each bucket's trainer tensors,
    # not a packed staging buffer (one copy instead of two). vLLM's reload path is such a loader.
    loads_trainer_tensors: bool = False
    # Whether, in its own process on a CPU, the engine's OpenMP threads may sleep as soon as an op ends
    # (OMP_WAIT_POLICY=PASSIVE) instead of spinning: a spinning engine steals the trainer's cores
    # between update messages (rlsync.engines.process.passive_openmp). False for an engine that
    # binds its own threads (vLLM's CPU backend).
    passive_cpu_threads: bool = True
    # update.strategy values this engine's own trainer-to-engine transfer offers (`native_update`),
    # beside the transports' bucketed and per_tensor; such a strategy stages nothing of rlsync's.
    own_strategies: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def release_takes_weights(cls, release_level: int, device_type: str) -> bool:
        """Whether `release` at rollout.release_level on a `device_type` device takes the weights off it
        (1: to host memory, 2: freed), so the step loop resumes the engine before every update, which
        writes into them (timed as the engine's resume, not inside the update). By default levels 1 and
        2 do; level 0 keeps everything. `resume` is idempotent: answering true costs one call."""
        return release_level >= 1

    # What an engine accepts is asked of its class, before any model is built (rlsync.config.validate).
    @classmethod
    def check_config(cls, cfg) -> None:
        """This engine's rules across the config's keys: a ConfigError naming the key. By default only
        another engine's own strategy is refused."""
        strategy = cfg.update.strategy
        if strategy in own_strategy_names() and strategy not in cls.own_strategies:
            owner, owner_cls = strategy_owner(strategy)
            raise ConfigError(
                "update.strategy",
                strategy,
                f"bucketed, per_tensor ({strategy} is "
                f"{owner_cls.title or owner}'s own transfer: set rollout.engine={owner})",
                f"not allowed with rollout.engine={cfg.rollout.engine}",
            )

    @classmethod
    def check_machine(cls, cfg) -> None:
        """What this machine must have for the engine (installed, its API, the device); nothing by default."""

    @classmethod
    def receiver_copies(cls, cfg) -> tuple[str, ...]:
        """The copies of each update byte, in the engine's dtype, that this engine's receiving side makes on
        `cfg`'s update path beyond the one every update's floor counts (the trainer's bytes into what the
        engine reads), by name; the floor counts them too (rlsync.measure.floors). None by default."""
        return ()

    @classmethod
    def flat_weights_refusal(cls, name: str) -> str | None:
        """Why update.flat_engine_weights=null (auto) is off with this engine (registered as `name`);
        None where it can be on."""
        if cls.holds_flat_weights:
            return None
        return f"the {name} engine does not hold its weights as views by trainer name"

    title: ClassVar[str] = ""  # how messages name the engine ("vLLM"); its registry name where unset

    @classmethod
    @abstractmethod
    def from_spec(cls, spec: EngineSpec, *, strategy: str) -> Engine:
        """Build the engine `spec` describes; `strategy` is update.strategy (an engine may have its own path)."""

    @abstractmethod
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Where updates land: (name, tensor) pairs in the trainer's naming, in any grouping."""

    def load_trainer_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`load_weights` of tensors the caller keeps alive and unchanged until the update ends (the
        trainer's own, not a reused staging buffer): an engine that holds some back until a fused layer
        is complete may keep references instead of copies."""
        self.load_weights(named)

    def native_update(self, weights: dict[str, torch.Tensor], *, bucket_bytes: int) -> tuple[dict[str, float], int]:
        """An engine's own trainer-to-engine transfer (update.strategy=vllm_ipc); most engines have none.

        Returns the seconds per phase it can tell apart ("pack", "load") and the staging bytes it held."""
        raise NotImplementedError(f"{type(self).__name__} has no transfer of its own; use update.strategy=bucketed")


# ----------------------------------------------------------------------------------------------
# The registry: rollout.engine -> engine class
# ----------------------------------------------------------------------------------------------

ENGINES: Registry[Engine] = Registry(
    "rollout.engine",
    {
        "hf": "rlsync.engines.hf:HFEngine",  # transformers, embedded
        "vllm": "rlsync.engines.vllm:VLLMEngine",  # vLLM in this process (the extra: pip install -e '.[vllm]')
    },
)
register_engine = ENGINES.register  # register_engine("mine", "mypackage.mine:MyEngine"), or as a decorator
engine_names = ENGINES.names  # the values rollout.engine accepts, in registration order
engine_class = ENGINES.resolve  # the class registered under a name, imported the first time


def own_strategy_names() -> tuple[str, ...]:
    """Every registered engine's own update strategies, in registration order."""
    return tuple(dict.fromkeys(s for name in engine_names() for s in engine_class(name).own_strategies))


def strategy_owner(strategy: str) -> tuple[str, type[Engine]]:
    """(name, class) of the engine whose own transfer `strategy` is."""
    return next((n, engine_class(n)) for n in engine_names() if strategy in engine_class(n).own_strategies)


def build_engine(spec: EngineSpec, strategy: str = "bucketed") -> Engine:
    """The engine named by `spec.rollout.engine`, built from `spec`."""
    return engine_class(spec.rollout.engine).from_spec(spec, strategy=strategy)


def answer_ids(gen: Generation) -> list[list[int]]:
    """Each row's sampled answer tokens (through EOS, without the padding after it), on the host.

    Both the tokens and their mask cross to the host together: indexing a host tensor with a device
    mask is an error on CUDA (and two small copies beat a sync per row).
    """
    tokens = gen.sequences[:, gen.prompt_len :].cpu()  # [batch, response_len]
    mask = gen.response_mask.cpu().bool()  # [batch, response_len]
    return [row[keep].tolist() for row, keep in zip(tokens, mask)]
