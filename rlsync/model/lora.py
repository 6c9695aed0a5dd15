"""LoRA adapters through PEFT (trainer.lora.rank > 0): injection, the update's names, the merge.

PEFT wraps each targeted linear layer: its weight becomes `X.base_layer.weight` and the adapter adds
`X.lora_A.default.weight` [rank, in] and `X.lora_B.default.weight` [out, rank], the layer computing
`base(x) + scaling * B(A(x))` with scaling = alpha / rank. The update names them as PEFT saves an
adapter (`X.weight`, `X.lora_A.weight`, `X.lora_B.weight`): one name per tensor on both sides
(`update_names`), whichever adapter name PEFT used in memory.

`MergedWeights` is what the merged LoRA payload sends: each targeted weight as W + scaling * B @ A, merged
in fp32 when it is read (never in place, so there is nothing to unmerge and no drift from merging and
unmerging in a low precision); `merge_errors` reports how far a bf16 merge would land from it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from rlsync.config.schema import LoraConfig, ModelConfig
from rlsync.errors import ConfigError

LINEAR_EXAMPLES = ("Qwen3: q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")  # PEFT's X.lora_A.<adapter name>.weight
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


def update_name(name: str) -> str:
    """A parameter's name as the update sends it: PEFT's wrapping and adapter name dropped."""
    return ADAPTER.sub(r".\1.weight", name.replace(".base_layer.", "."))


def update_names(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`named` by the update's names (the identity for a model without adapters)."""
    return {update_name(n): t for n, t in named.items()}


def is_adapter(name: str) -> bool:
    return name.endswith((A_SUFFIX, B_SUFFIX))


def module_targeted(param_name: str, shape: tuple[int, ...], targets: list[str]) -> bool:
    """Whether PEFT wraps the layer owning `param_name`: a 2-D `.weight` whose module's name is one of
    `targets` (PEFT matches a target against the module name's last parts)."""
    if len(shape) != 2 or not param_name.endswith(".weight"):
        return False
    module = param_name[: -len(".weight")]
    return any(module == t or module.endswith("." + t) for t in targets)


def wrapped_layers(model: nn.Module, targets: list[str]) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the layers `inject` gives an adapter: linear layers named by a target that own their
    weight. Other kinds (an embedding: PEFT keeps its adapters as lora_embedding_A/B, which the update neither
    names nor sends) and a tied lm_head (the embedding's weight) get none."""
    owned = {name for name, _ in model.named_parameters()}  # a tied weight once, under its first owner
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and name + ".weight" in owned
        and module_targeted(name + ".weight", (1, 1), targets)
    ]


def check_layers(lora: LoraConfig, m: ModelConfig) -> None:
    """trainer.lora against the model's layers, on a meta build (LoraConfig.check): every target that names
    layers names some `inject` wraps, at least one layer is wrapped, and the rank fits the narrowest of them."""
    from rlsync.model.architecture import hf_config, meta_model

    model, targets = meta_model(hf_config(m)), list(lora.target_modules)
    layers = wrapped_layers(model, targets)
    wrapped = {name for name, _ in layers}
    for target in targets:
        named = [(n, mod) for n, mod in model.named_modules() if module_targeted(n + ".weight", (1, 1), [target])]
        if named and not any(n in wrapped for n, _ in named):
            name, module = named[0]
            kind = type(module).__name__ + (", tied to the embedding" if isinstance(module, nn.Linear) else "")
            raise ConfigError(
                "trainer.lora.target_modules",
                targets,
                f"names of linear layers of the model ({', '.join(LINEAR_EXAMPLES)}): rlsync's adapters wrap "
                "nn.Linear layers only",
                f"{target} names {name} ({kind}), which takes no adapter",
            )
    if not layers:
        raise ConfigError(
            "trainer.lora.target_modules",
            targets,
            f"names of linear layers of the model ({', '.join(LINEAR_EXAMPLES)})",
            "matches no layer",
        )
    name, narrowest = min(layers, key=lambda item: min(item[1].in_features, item[1].out_features))
    most = min(narrowest.in_features, narrowest.out_features)
    if lora.rank > most:
        raise ConfigError(
            "trainer.lora.rank",
            lora.rank,
            f"0, or 1 to {most}: B @ A has rank at most min(in, out) of its layer, and the narrowest targeted "
            f"one, {name}, is {narrowest.in_features} -> {narrowest.out_features} (a larger rank adds "
            "parameters, not rank)",
            "out of range",
        )


def adapter_shapes(shapes: list[tuple[str, tuple[int, ...]]], lora: LoraConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the adapter tensors PEFT adds to a model of `shapes`, in PEFT's order."""
    out = []
    for name, shape in shapes:
        if module_targeted(name, shape, list(lora.target_modules)):
            prefix = name[: -len(".weight")]
            out += [(prefix + A_SUFFIX, (lora.rank, shape[1])), (prefix + B_SUFFIX, (shape[0], lora.rank))]
    return out


def scaling(lora: LoraConfig) -> float:
    return lora.alpha / lora.rank


def inject(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """`model` with LoRA adapters on `lora.target_modules` (in place): only the adapters train.

    PEFT initializes A (Kaiming-uniform) and B (zeros), so the adapted model starts equal to the base."""
    from peft import LoraConfig as PeftLoraConfig  # lazy: only LoRA runs pay PEFT's import
    from peft import inject_adapter_in_model

    # By full name, the linear layers alone: given bare names, PEFT also wraps a MoE model's fused 3-D expert
    # tensors (nested wrappers whose adapters the update cannot name apart); those take no adapter here.
    targets = [name for name, _ in wrapped_layers(model, list(lora.target_modules))]
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=targets,
        lora_dropout=0.0,  # the engine samples without dropout: the trainer's log-probs must be the same function
        bias="none",
    )
    model = inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(update_name(name)))
    return model


def adapted(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """`model` with the adapters trainer.lora asks for (none at rank 0: full fine-tuning)."""
    return inject(model, lora) if lora.rank > 0 else model


def merged_weight(weights: Mapping[str, torch.Tensor], name: str, scale: float) -> torch.Tensor:
    """W + scale * B @ A for the targeted weight `name`, in fp32."""
    prefix = name[: -len(".weight")]
    a, b = weights[prefix + A_SUFFIX], weights[prefix + B_SUFFIX]
    return torch.addmm(weights[name].float(), b.float(), a.float(), alpha=scale)


class MergedWeights(Mapping):
    """The trainer's weights as a model without adapters: targeted weights merged in fp32 as read."""

    def __init__(self, weights: Mapping[str, torch.Tensor], scale: float):
        self.source, self.scale = weights, scale
        self.merged = {n[: -len(A_SUFFIX)] + ".weight" for n in weights if n.endswith(A_SUFFIX)}
        self.names = [n for n in weights if not is_adapter(n)]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.merged:
            return merged_weight(self.source, name, self.scale)
        if is_adapter(name):
            raise KeyError(name)
        return self.source[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


@torch.no_grad()
def merge_errors(weights: Mapping[str, torch.Tensor], scale: float, dtype: torch.dtype) -> dict[str, float]:
    """How far the engine's merged weights (in `dtype`) land from the exact W + s*BA, over all targeted
    layers, relative to the adapters' own contribution ||s*BA||: merged in fp32 and cast once (what
    the merged LoRA payload sends, the nearest `dtype` weights, so the floor: `update/lora_merge_error`), and
    merged in `dtype` itself, W and s*BA cast first (a low-precision merge: `_in_dtype`), with the share
    of elements where the two differ. Empty while the adapters add nothing (B starts at zero)."""
    sent_sq = low_sq = delta_sq = 0.0
    differ = total = 0
    for name in MergedWeights(weights, scale).merged:
        base = weights[name].float()
        exact = merged_weight(weights, name, scale)
        delta = exact - base
        sent, low = exact.to(dtype), base.to(dtype) + delta.to(dtype)
        delta_sq += float(delta.square().sum())
        sent_sq += float((sent.float() - exact).square().sum())
        low_sq += float((low.float() - exact).square().sum())
        differ += int((sent != low).sum())
        total += exact.numel()
    if delta_sq == 0.0:
        return {}
    return {
        "update/lora_merge_error": (sent_sq / delta_sq) ** 0.5,
        "update/lora_merge_error_in_dtype": (low_sq / delta_sq) ** 0.5,
        "update/lora_merge_differ_ratio": differ / total,
    }
