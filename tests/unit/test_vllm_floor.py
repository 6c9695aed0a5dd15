"""The floor of vLLM's own transfer counts what vLLM's receiving side must copy (issue 46, item 4).

Each path declares its copies (Engine.receiver_copies; vLLM's per sender class, rlsync/engines/vllm_ipc.py),
and the floor adds them at the bandwidth of a copy in the engine's dtype (rlsync.measure.floors). The
bandwidths are faked here: what is checked is what the floor counts, not how fast this machine copies.
No vLLM import.
"""

from __future__ import annotations

import pytest
import torch

from rlsync.engines.base import engine_class
from rlsync.engines.vllm_ipc import SENDERS, IpcSender, ShmSender
from rlsync.measure import floors
from rlsync.model.build import build_tokenizer
from rlsync.update import side as side_module

CAST_BPS, SAME_BPS = 3e9, 8e9  # fp32 -> bf16 and bf16 -> bf16, bytes read + written per second (fake)


@pytest.fixture
def fake_bandwidth(monkeypatch):
    """copy_bandwidth by dtypes: a converting copy at CAST_BPS, a same-dtype one at SAME_BPS."""

    def bandwidth(nbytes, *, src, dst, repeats=3, dtypes=floors.BYTES):
        return floors.Bandwidth(SAME_BPS if dtypes[0] == dtypes[1] else CAST_BPS, f"fake {dtypes}")

    monkeypatch.setattr(floors, "copy_bandwidth", bandwidth)


@pytest.mark.parametrize(
    "overrides, copies",
    [
        (("update.strategy=vllm_ipc",), ("clone", "load", "copy back")),  # layerwise: every release's default
        (("update.strategy=vllm_ipc", "rollout.vllm_reload_mode=direct"), ("clone", "load")),  # 0.34: in place
        (("update.strategy=vllm_ipc", "rollout.vllm_reload_mode=layerwise"), ("clone", "load", "copy back")),
        (("update.strategy=vllm_shm",), ("load", "copy back")),
        (("update.strategy=vllm_shm", "rollout.vllm_reload_mode=direct"), ("load",)),
        (("update.strategy=bucketed",), ()),  # rlsync's reload path declares none
    ],
)
def test_each_vllm_path_declares_what_its_receiver_copies(compose, overrides, copies):
    cfg = compose("rollout.engine=vllm", *overrides)
    assert engine_class("vllm").receiver_copies(cfg) == copies
    assert engine_class("hf").receiver_copies(compose()) == ()


def test_the_declarations_are_the_sender_classes():
    assert {"vllm_ipc": IpcSender, "vllm_shm": ShmSender} == SENDERS
    assert IpcSender.receiver_copies == ("clone", "load")  # packed_ipc_consumer clones, on purpose
    assert ShmSender.receiver_copies == ("load",)


def test_the_floor_adds_each_receiver_copy_at_the_engines_copy_bandwidth(fake_bandwidth):
    read, written = 4 << 20, 2 << 20  # fp32 trainer, bf16 engine
    kw = {
        "update_bytes": written,
        "state_bytes": 2 * read,
        "read_bytes": read,
        "dtypes": (torch.float32, torch.bfloat16),
    }
    plain = floors.Floors(torch.device("cpu"), **kw)
    assert plain.update_floor_time == pytest.approx((read + written) / CAST_BPS)
    assert "receiver_copies" not in plain.as_dict() and plain.engine_copy is None
    for copies in (("load",), ("clone", "load"), ("clone", "load", "copy back")):
        floor = floors.Floors(torch.device("cpu"), **kw, receiver_copies=copies)
        assert floor.engine_copy == SAME_BPS
        assert floor.update_floor_time == pytest.approx(
            (read + written) / CAST_BPS + len(copies) * 2 * written / SAME_BPS
        )
        assert floor.as_dict()["receiver_copies"] == list(copies)
        assert floor.as_dict()["engine_copy_gbps"] == pytest.approx(SAME_BPS / 1e9)


def test_the_benchmarks_probe_re_times_the_engines_copies_beside_the_update(monkeypatch):
    """CopyProbe (python -m rlsync.bench, beside each repeat): the update's copy and the engine's own copies."""
    seconds = {torch.float32: 0.004, torch.bfloat16: 0.001}  # by the source's dtype: converting, same-dtype

    def best_copy(dst, src, rounds, budget_s=0.5, *, warm_up=True, candidates=None, clock=None):
        way = floors.Way("copy_", 1)
        return floors.BestCopy(seconds[src.dtype], way, src.dtype, dst.dtype, src.device, dst.device)

    monkeypatch.setattr(floors, "best_copy", best_copy)
    read, written = 4 << 20, 2 << 20
    kw = {"update_bytes": written, "read_bytes": read, "source": "device", "dtypes": (torch.float32, torch.bfloat16)}
    plain = floors.CopyProbe(torch.device("cpu"), **kw)
    with_copies = floors.CopyProbe(torch.device("cpu"), **kw, receiver_copies=2)
    cast_bps = plain.moved / seconds[torch.float32]
    same_bps = 2 * with_copies.engine_pair[0].nbytes / seconds[torch.bfloat16]
    assert plain.floor_time() == pytest.approx((read + written) / cast_bps)
    assert with_copies.floor_time() == pytest.approx((read + written) / cast_bps + 2 * 2 * written / same_bps)


@pytest.mark.parametrize(
    "overrides, copies",
    [
        (("rollout.engine=vllm", "update.strategy=vllm_shm"), ["load", "copy back"]),
        (("rollout.engine=vllm", "update.strategy=bucketed"), None),
        ((), None),
    ],
)
def test_the_update_side_builds_its_floor_from_the_engines_declaration(
    compose, tiny, monkeypatch, fake_bandwidth, overrides, copies
):
    """open_update_side, as the runner and the benchmark open it (the transport and the auto knobs faked)."""
    cfg = compose(*overrides)
    monkeypatch.setattr(side_module, "open_update", lambda update_cfg, *, spec, buckets: ("engine", "transport"))
    monkeypatch.setattr(side_module, "resolve_for_run", lambda update, rollout, **kw: (update, {}))
    side = side_module.open_update_side(
        cfg, tiny.weights(), device=torch.device("cpu"), tokenizer=build_tokenizer(cfg.model)
    )
    assert side.floors.as_dict().get("receiver_copies") == copies
    base = (side.read_bytes + side.update_bytes) / CAST_BPS
    assert side.floors.update_floor_time == pytest.approx(base + len(copies or ()) * 2 * side.update_bytes / SAME_BPS)
