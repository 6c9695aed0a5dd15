"""The HF engine (`rollout.engine=hf`): its own weights (in the rollout dtype) and sampling with a KV cache.

The engine never sees the trainer's tensors: the weight update writes into `engine.weights` by
name (see rlsync/sync). Generation returns the sampled tokens and their log-probs under the
engine's weights, which the trainer compares against its own (`train/logprob_abs_diff`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from torch import nn

from rlsync.config.schema import ModelConfig
from rlsync.engines.base import Engine, EngineSpec, Generation, check_cancelled, left_pad, position_ids
from rlsync.measure.devices import copy_into
from rlsync.model.architecture import build_empty, update_tensors


def sample_tokens(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` [batch, vocab], drawn with `generator`: [batch] on probs' device.

    The draw happens on the generator's device: a generator on the engine's device (rlsync.measure.devices.sampler)
    samples in place, with no [batch, vocab] copy per token; a CPU generator serving a CUDA engine (a
    trainer on the host driving an engine on a GPU) draws on the host, as PyTorch requires a generator
    of the tensor's device type. On a CPU both are the same draw.
    """
    return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1).to(probs.device)


def cache_kwarg(model: nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache`; accept both."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFEngine(Engine):
    """A transformers model in the rollout dtype, generating with a DynamicCache."""

    preload = ("transformers.models.qwen3.modeling_qwen3",)
    holds_flat_weights = True  # its parameters are plain tensors by trainer name: flat views can replace them

    def __init__(
        self,
        model_cfg: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        allowed_ids: torch.Tensor,
        eos_id: int,
        pad_id: int,
        release_weights: bool = False,
    ):
        # storage only: the first weight update fills it (rlsync.model.architecture: any causal LM, Qwen3 from the keys)
        model = build_empty(model_cfg, dtype=dtype, device=device)
        self.model = model.eval().requires_grad_(False)
        self.device, self.dtype = device, dtype
        self.allowed = allowed_ids.to(device)
        self.eos_id, self.pad_id = eos_id, pad_id
        self._cache_kw = cache_kwarg(model)
        self.release_weights = release_weights
        self.layout = model_cfg.update_layout  # the names the update arrives in (the trainer's, the same plan)
        self.released: list[tuple[torch.UntypedStorage, int]] = []  # weight storages freed by release(), their sizes

    @classmethod
    def from_spec(cls, spec: EngineSpec, *, strategy: str) -> HFEngine:
        return cls(
            spec.model,
            dtype=spec.dtype,
            device=torch.device(spec.device),
            allowed_ids=spec.allowed_ids,
            eos_id=spec.eos_id,
            pad_id=spec.pad_id,
            release_weights=spec.rollout.release_weights,
        )

    def release(self) -> None:
        """Give the memory back after generation, wherever the engine runs (this process or its own).

        The KV cache lives only inside `generate`, so it is already free: emptying the allocator's
        cache hands it to the driver. With `release_weights` the weights' storage is freed too (each
        parameter keeps its shape and identity, holding no memory); `resume` re-allocates it and the
        next weight update refills it, so in between the engine must not generate.
        """
        if self.release_weights and not self.released:
            storages = {}
            for param in self.model.parameters():
                storage = param.untyped_storage()
                storages.setdefault(storage.data_ptr(), storage)  # views of one flat buffer: freed once
            for storage in storages.values():
                # shared memory (CPU) or memory opened from a CUDA IPC handle belongs to the trainer's side
                if not storage.resizable() or (storage.device.type == "cpu" and storage.is_shared()):
                    raise RuntimeError(
                        "rollout.release_weights=true: the engine's weights live in memory shared with "
                        "the trainer and cannot be freed by the engine; set rollout.release_weights=false"
                    )
            for storage in storages.values():
                self.released.append((storage, storage.nbytes()))
                storage.resize_(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self) -> None:
        """Take the memory back: re-allocate released weights (contents undefined until the next update).

        Idempotent: the loop calls it before the weight update and again before the rollout.
        """
        for storage, nbytes in self.released:
            storage.resize_(nbytes)
        self.released = []

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights by the update's names (tied ones once): its parameters, or in the
        checkpoint layout of a MoE model per-expert views of its fused expert parameters."""
        return update_tensors(dict(self.model.named_parameters()), self.layout)

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
            if temperature > 0:
                sampled = sample_tokens(logp_all.exp(), generator)
            else:
                sampled = logp_all.argmax(-1)
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
