"""Build the model from its config (random weights, no download) or load a checkpoint.

Which architecture, and its meta-device build, are rlsync.model.architecture's; this module fills it.

Random init the naive way runs every module's initializer on the CPU (about 13 s for Qwen3-0.6B).
We build on the meta device, allocate storage once with `to_empty`, and fill the matrices by tiling
one pool of normal noise (a prime length, so rows do not line up with its period) from a random
offset per tensor: memcpy speed. Norm weights are ones. rlsync times copies, not model quality, so
the noise's period is harmless; tensors shorter than the pool (every tiny-model tensor) get
independent noise.
"""

from __future__ import annotations

import torch
from torch import nn

from rlsync.config.schema import ModelConfig
from rlsync.errors import ConfigError, show
from rlsync.model.architecture import ARCHITECTURE_KEYS, build_empty, hf_config  # noqa: F401 - hf_config: the engines' import
from rlsync.model.lora import update_names

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INIT_STD = 0.02
NOISE_POOL = 1_000_003  # elements; prime


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


# transformers takes seconds to import: it is imported where a model or tokenizer is built, so that
# --help, validation and the report start fast.


MODEL_TYPE = "qwen3"  # what build_model and the engine build from the keys


def checkpoint_value(ckpt: dict, key: str):
    """`key` as a checkpoint's config.json gives it (None when it does not): transformers 5 nests
    rope_theta in rope_parameters, and head_dim defaults to hidden_size / heads."""
    if key == "rope_theta" and "rope_theta" not in ckpt:
        rope = ckpt.get("rope_parameters")
        return rope.get("rope_theta") if isinstance(rope, dict) else None
    if (
        key == "head_dim"
        and ckpt.get("head_dim") is None
        and ckpt.get("hidden_size")
        and ckpt.get("num_attention_heads")
    ):
        return ckpt["hidden_size"] // ckpt["num_attention_heads"]
    return ckpt.get(key)


def architecture_differences(cfg: ModelConfig, ckpt: dict) -> list[tuple[str, object, object]]:
    """(key, the checkpoint's value, model.<key>) for every architecture key that differs; the model
    type first when it is not Qwen3's. Keys the checkpoint does not give are not compared."""
    out = []
    if ckpt.get("model_type") not in (None, MODEL_TYPE):
        out.append(("model_type", ckpt["model_type"], MODEL_TYPE))
    for key in ARCHITECTURE_KEYS:
        theirs, ours = checkpoint_value(ckpt, key), getattr(cfg, key)
        if theirs is None:
            continue
        same = (
            abs(float(theirs) - float(ours)) <= 1e-9 * max(abs(float(ours)), 1.0)
            if isinstance(ours, float) and isinstance(theirs, (int, float))
            else theirs == ours
        )
        if not same:
            out.append((key, theirs, ours))
    return out


def check_architecture(cfg: ModelConfig, ckpt: dict) -> None:
    """Raise ConfigError (one line, exit 2) naming each model.* key the checkpoint's config differs in."""
    diffs = architecture_differences(cfg, ckpt)
    if not diffs:
        return
    if diffs[0][0] == "model_type":
        raise ConfigError(
            "model.pretrained",
            cfg.pretrained,
            f"a {MODEL_TYPE} checkpoint (rlsync builds Qwen3 models)",
            f"its config.json has model_type={diffs[0][1]}",
        )
    differing = ", ".join(
        f"{k}={show(theirs)} in the checkpoint but model.{k}={show(ours)}" for k, theirs, ours in diffs
    )
    fix = " ".join(f"model.{k}={show(theirs)}" for k, theirs, _ in diffs)
    raise ConfigError(
        "model.pretrained",
        cfg.pretrained,
        f"model.* keys that match the checkpoint: add {fix}, or choose the model=... preset of that architecture",
        f"its architecture differs ({differing})",
    )


def build_model(cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device, seed: int) -> nn.Module:
    """The causal LM `cfg` describes (model.config's architecture, else Qwen3 from the keys) in `dtype`
    on `device`: from `cfg.pretrained` if set, else random (rlsync.model.architecture.build_empty, then filled)."""
    if cfg.pretrained:
        from transformers import AutoConfig, AutoModelForCausalLM

        # a hub id's config.json arrives here first (validation checked a local one): refuse before any weight loads
        check_architecture(cfg, AutoConfig.from_pretrained(cfg.pretrained).to_dict())
        model = AutoModelForCausalLM.from_pretrained(cfg.pretrained, dtype=dtype)
        return model.to(device)

    model = build_empty(cfg, dtype=dtype, device=device)
    fill_random_(model, seed=seed)
    model.tie_weights()
    return model


@torch.no_grad()
def fill_random_(model: nn.Module, *, seed: int) -> None:
    """Normal(0, INIT_STD) noise for matrices and embeddings, ones for 1-D norm weights."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pool = torch.empty(NOISE_POOL).normal_(0.0, INIT_STD, generator=gen)
    pools = {}  # one doubled pool per (device, dtype), so any offset has a contiguous full period
    for p in model.parameters():
        if p.dim() == 1:
            p.fill_(1.0)
            continue
        key = (p.device, p.dtype)
        if key not in pools:
            pools[key] = torch.cat([pool, pool]).to(device=p.device, dtype=p.dtype)
        offset = int(torch.randint(NOISE_POOL, (1,), generator=gen))
        _tile_(p.view(-1), pools[key][offset : offset + NOISE_POOL])


def _tile_(flat: torch.Tensor, period: torch.Tensor) -> None:
    n_periods, rest = divmod(flat.numel(), period.numel())
    if n_periods:
        flat[: n_periods * period.numel()].view(n_periods, -1).copy_(period.expand(n_periods, -1))
    if rest:
        flat[n_periods * period.numel() :].copy_(period[:rest])


def named_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by the update's names, tied ones once (named_parameters already skips shared tensors);
    a PEFT adapter's as PEFT saves them (rlsync.model.lora.update_names)."""
    return update_names(dict(model.named_parameters()))


def model_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * itemsize


class ByteTokenizer:
    """Bytes 0-255 are tokens 0-255; three specials follow. Random models sample only decodable ids."""

    bos_id, eos_id, pad_id = 256, 257, 258
    size = 259

    def encode(self, text: str) -> list[int]:
        return [self.bos_id, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def allowed_ids(self, vocab_size: int) -> torch.Tensor:
        """Bool mask over the model's vocab: which ids generation may sample."""
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[:256] = True
        mask[self.eos_id] = True
        return mask


class HFTokenizer:
    """A checkpoint's own tokenizer (for `model.pretrained`)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        if not len(self.tok) or self.tok.eos_token_id is None:  # a checkpoint without its tokenizer files
            raise ConfigError(
                "model.pretrained",
                path,
                "a checkpoint with its tokenizer (tokenizer.json or vocab files, and an eos token)",
                f"its tokenizer has {len(self.tok)} tokens and eos_token_id={self.tok.eos_token_id}",
            )
        self.eos_id = self.tok.eos_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def allowed_ids(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[: len(self.tok)] = True
        return mask


def build_tokenizer(cfg: ModelConfig):
    if cfg.pretrained:
        return HFTokenizer(cfg.pretrained)
    return ByteTokenizer()
