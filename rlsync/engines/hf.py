"""The HF engine (`rollout.engine=hf`): its own weights (in the rollout dtype) and sampling with a KV cache.

The engine never sees the trainer's tensors: the weight update writes into `engine.weights` by
name (see rlsync/update). Generation returns the sampled tokens and their log-probs under the
engine's weights, which the trainer compares against its own (`train/logprob_abs_diff`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from torch import nn

from rlsync.config.schema import LoraConfig, ModelConfig
from rlsync.engines.base import Engine, EngineSpec, Generation, check_cancelled, left_pad, position_ids
from rlsync.measure.devices import copy_into
from rlsync.model.architecture import build_empty, update_tensors
from rlsync.model.lora import inject, update_names


def sample_tokens(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` [batch, vocab], drawn with `generator`: [batch] on probs' device.

    The draw happens on the generator's device: a generator on the engine's device (rlsync.measure.devices.sampler)
    samples in place, with no [batch, vocab] copy per token; a CPU generator serving a CUDA engine (a
    trainer on the host driving an engine on a GPU) draws on the host, as PyTorch requires a generator
    of the tensor's device type. On a CPU both are the same draw.
    """
    return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1).to(probs.device)


def owns(storage: torch.UntypedStorage) -> bool:
    """Whether the engine can free `storage`: not shared memory (CPU) nor memory opened from a CUDA IPC
    handle, which belong to the trainer's side."""
    return storage.resizable() and not (storage.device.type == "cpu" and storage.is_shared())


def cache_kwarg(model: nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache`; accept both."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFEngine(Engine):
    """A transformers model in the rollout dtype, generating with a DynamicCache."""

    preload = ("transformers.models.qwen3.modeling_qwen3",)
    holds_flat_weights = True  # its parameters are plain tensors by trainer name: flat views can replace them
    takes_adapters = True  # EngineSpec.lora: the same PEFT adapters as the trainer's

    def __init__(
        self,
        model_cfg: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        allowed_ids: torch.Tensor,
        eos_id: int,
        pad_id: int,
        release_level: int = 1,
        lora: LoraConfig | None = None,
    ):
        # storage only: the first weight update fills it (rlsync.model.architecture: any causal LM, Qwen3 from the keys)
        model = build_empty(model_cfg, dtype=dtype, device=device)
        if lora is not None:  # update.payload=lora: the trainer's PEFT adapters, one adapter name for every update
            model = inject(model, lora)
        self.model = model.eval().requires_grad_(False)
        self.device, self.dtype = device, dtype
        self.allowed = allowed_ids.to(device)
        self.eos_id, self.pad_id = eos_id, pad_id
        self._cache_kw = cache_kwarg(model)
        self.release_level = release_level  # rollout.release_level: what release() gives back, as vLLM's sleep levels
        self.host_is_device = device.type == "cpu"  # level 1 offloads the weights to host memory: here they are
        self.layout = model_cfg.update_layout  # the names the update arrives in (the trainer's, the same plan)
        # weight storages freed by release(): (storage, its size, its host copy at level 1 or None)
        self.released: list[tuple[torch.UntypedStorage, int, torch.UntypedStorage | None]] = []
        self.host_copies: list[torch.UntypedStorage] = []  # level 1: the weights' host copies, made once, reused

    @classmethod
    def from_spec(cls, spec: EngineSpec, *, strategy: str) -> HFEngine:
        return cls(
            spec.model,
            dtype=spec.dtype,
            device=torch.device(spec.device),
            allowed_ids=spec.allowed_ids,
            eos_id=spec.eos_id,
            pad_id=spec.pad_id,
            release_level=spec.rollout.release_level,
            lora=spec.lora,
        )

    @classmethod
    def release_takes_weights(cls, release_level: int, device_type: str) -> bool:
        """Level 2 frees the weights; level 1 moves them to host memory, except on a CPU (host == device)."""
        return release_level == 2 or (release_level == 1 and device_type != "cpu")

    def release(self) -> None:
        """Give the memory back after generation as vLLM's sleep level `rollout.release_level` does,
        wherever the engine runs (this process or its own). Nothing here is timed: the loop times the
        release and the resume (perf/engine_release_time, perf/engine_resume_time).

        0: nothing; the allocator keeps its cache (the next rollout finds its blocks).
        1: the KV cache, which lives only inside `generate`, so it is already free: emptying the
           allocator's cache hands it to the driver; and the weights offloaded to host memory: each
           storage copied to its host copy (pinned on CUDA, made once and reused), then its device
           storage freed; `resume` copies them back. On a CPU device the host is the device: the
           weights stay where they are and only the KV cache goes (levels 0 and 1 then differ little).
        2: the KV cache and the weights' storage (each parameter keeps its shape and identity, holding
           no memory); `resume` re-allocates it and the next weight update refills it, so in between
           the engine must not generate.

        Weights in memory shared with the trainer (ipc's flat weights) are the trainer side's: level 2
        refuses them, level 1 leaves them in place.
        """
        offload = self.release_level == 1 and not self.host_is_device
        if (self.release_level == 2 or offload) and not self.released:
            storages = list(self.weight_storages().values())
            owned = [s for s in storages if owns(s)]
            if self.release_level == 2 and len(owned) < len(storages):
                raise RuntimeError(
                    "rollout.release_level=2: the engine's weights live in memory shared with the trainer "
                    "and cannot be freed by the engine; set rollout.release_level=1 or 0"
                )
            hosts = self.host_copy(owned) if offload else [None] * len(owned)
            for storage, host in zip(owned, hosts):
                if host is not None:
                    host.copy_(storage, non_blocking=host.is_pinned())
            if offload and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # every copy landed before its device storage goes
            for storage, host in zip(owned, hosts):
                self.released.append((storage, storage.nbytes(), host))
                storage.resize_(0)
        if self.release_level >= 1 and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def weight_storages(self) -> dict[int, torch.UntypedStorage]:
        """Each storage the weights live in, once (views of one flat buffer share it), by address."""
        storages: dict[int, torch.UntypedStorage] = {}
        for param in self.model.parameters():
            storage = param.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage)
        return storages

    def host_copy(self, storages: list[torch.UntypedStorage]) -> list[torch.UntypedStorage]:
        """Level 1: a host storage per weight storage (pinned on CUDA), allocated at the first release."""
        if [h.nbytes() for h in self.host_copies] != [s.nbytes() for s in storages]:
            pin = self.device.type == "cuda"
            self.host_copies = [
                torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin).untyped_storage() for s in storages
            ]
        return self.host_copies

    def resume(self) -> None:
        """Take the memory back: re-allocate released weights, copied back from the host at level 1
        (contents undefined at level 2 until the next update).

        Idempotent: the loop calls it before the weight update and again before the rollout.
        """
        for storage, nbytes, host in self.released:
            storage.resize_(nbytes)
            if host is not None:
                storage.copy_(host, non_blocking=host.is_pinned())  # the device's stream orders what reads it
        self.released = []

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights by the update's names (tied ones once): its parameters, or in the
        checkpoint layout of a MoE model per-expert views of its fused expert parameters."""
        return update_tensors(update_names(dict(self.model.named_parameters())), self.layout)

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Where updates land: copy each (name, tensor) into the parameter of that name."""
        if getattr(self, "_params", None) is None:  # walking the module tree costs ~1 ms: once, not per call
            self._params = self.weights  # parameters keep their identity (release, flat views swap storage only)
        params = self._params
        for name, tensor in named:
            copy_into(params[name], tensor)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, generator: torch.Generator
    ) -> Generation:
        from transformers import DynamicCache  # loaded with the model already (models.py: transformers stays lazy)

        ids, mask = left_pad(prompts, self.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        batch = ids.shape[0]
        cache = DynamicCache(config=self.model.config)
        tokens, logps = [], []
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        alive = []  # [batch] per step: 1 if the token at this step was sampled (not padding)
        step_ids, step_pos, full_mask = ids, position_ids(mask), mask
        for _ in range(max_new_tokens):
            check_cancelled()  # a standalone engine's client that left stops its generation here (serve/app.py)
            out = self.model(
                input_ids=step_ids,
                attention_mask=full_mask,
                position_ids=step_pos,
                use_cache=True,
                **{self._cache_kw: cache},
            )
            logits = out.logits[:, -1, :].float()  # [batch, vocab]
            scaled = logits / (temperature if temperature > 0 else 1.0)
            scaled = scaled.masked_fill(~self.allowed, float("-inf"))
            logp_all = torch.log_softmax(scaled, dim=-1)
            sampled = sample_tokens(logp_all.exp(), generator) if temperature > 0 else logp_all.argmax(-1)
            sampled = torch.where(finished, torch.full_like(sampled, self.pad_id), sampled)
            alive.append(~finished)
            tokens.append(sampled)
            logps.append(logp_all.gather(-1, sampled.unsqueeze(-1)).squeeze(-1).masked_fill(finished, 0.0))
            finished = finished | (sampled == self.eos_id)
            if bool(finished.all()):
                break
            step_pos = step_pos[:, -1:] + 1
            step_ids = sampled.unsqueeze(-1)
            full_mask = torch.cat([full_mask, torch.ones_like(full_mask[:, :1])], dim=-1)

        response = torch.stack(tokens, dim=1)  # [batch, response_len]
        response_mask = torch.stack(alive, dim=1).long()  # [batch, response_len]
        return Generation(
            sequences=torch.cat([ids, response], dim=1),
            attention_mask=torch.cat([mask, response_mask], dim=1),
            response_mask=response_mask,
            logprobs=torch.stack(logps, dim=1),
            prompt_len=ids.shape[1],
            truncated=~finished,
        )
