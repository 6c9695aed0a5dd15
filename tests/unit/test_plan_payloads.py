"""The planner's payloads (issue 45, item 4): each fitted payload's encode and decode fitted from bench runs
(rlsync/plan/payload_fit.py), kept in the calibration file, and the plan's payload table predicting each
payload's update time over each calibrated transport, with the break-even changed share against the full update."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import copy_calibration

from rlsync.config.apps import PlanAppConfig, PlanConfig
from rlsync.config.schema import UpdateConfig
from rlsync.config.validate import validate
from rlsync.errors import ConfigError
from rlsync.measure.timing import HostTimer
from rlsync.plan import calibrate, kinds, payload_fit, planner, profiles, render
from rlsync.update.payload import payload_class, payload_names
from rlsync.update.payload.kernels import Compiled

# per payload and side: (floor multiple, per_tensor_s, per_changed_s); the delta counts changes, FP8 does not
KNOWN = {
    "delta": {"encode": (2.5, 20e-6, 10e-9), "decode": (1.5, 5e-6, 30e-9)},
    "fp8": {"encode": (3.0, 50e-6, 0.0), "decode": (2.0, 40e-6, 0.0)},
}
GBPS = 20.0  # the synthetic runs' copy floor (bytes read + written per second, GB/s)


def stat(value: float) -> dict:
    return {"median": value, "min": value * 0.98, "max": value * 1.02}


def bench_summary(
    payload: str | None,
    *,
    params: int,
    tensors: int,
    ratio: float = 0.0,
    sides: dict | None = None,
    config: dict | None = None,
) -> dict:
    """A finished update benchmark's summary.json: its payload (setup.payload, or None: only `config` says), the
    run's copy floor at GBPS, and each side's time and floor seconds (`sides`: side -> (time_s, floor_s))."""
    limit = params * (4 + 2) / (GBPS * 1e9)  # one float32 -> bf16 copy of the update at the floor
    metrics = {"perf/update_weights_time": stat(0.5), "perf/update_weights_limit_time": stat(limit)}
    if ratio:
        metrics["perf/update_weights_changed_ratio"] = stat(ratio)
    for side, (took, floor) in (sides or {}).items():
        metrics[f"perf/update_weights_{side}_time"] = stat(took)
        metrics[f"perf/update_weights_{side}_limit_time"] = stat(floor)
    setup = {
        "transport": "direct",
        "strategy": "bucketed",
        "bucket_mb": 512.0,
        "flat_engine_weights": False,
        "buckets": 3,
        "trainer_dtype": "float32",
        "engine_dtype": "bfloat16",
    }
    if payload:
        setup["payload"] = payload
    return {
        "kind": "bench",
        "target": "update",
        "status": "finished",
        "model": {"name": f"m{params}", "params": params, "tensors": tensors},
        "metrics": metrics,
        "setup": setup,
        "config": config or {},
    }


def synthetic_summaries(seed: int = 0) -> list[dict]:
    """Runs a machine with the KNOWN coefficients gives: models spread in bytes and tensors, changed shares."""
    rng = random.Random(seed)
    out = []
    for name, sides in KNOWN.items():
        ratios = (0.01, 0.05, 0.2) if "changed" in payload_class(name).fit_terms else (0.0,)
        for params, tensors in ((2_500_000, 46), (4_600_000, 706), (220_000_000, 24), (600_000_000, 310)):
            for ratio in ratios:
                timed = {}
                for side, (m, per_tensor, per_changed) in sides.items():
                    floor = params * rng.uniform(4, 8) / (GBPS * 1e9)  # the declared bytes, whatever they are
                    timed[side] = (m * floor + per_tensor * tensors + per_changed * round(ratio * params), floor)
                out.append(bench_summary(name, params=params, tensors=tensors, ratio=ratio, sides=timed))
    return out


def test_the_fit_recovers_known_coefficients_from_synthetic_summaries():
    runs = [r for s in synthetic_summaries() for r in payload_fit.payload_runs(s, "synthetic")]
    section = payload_fit.fit(runs)
    assert set(section["fits"]) == set(KNOWN)
    for name, sides in KNOWN.items():
        terms = payload_class(name).fit_terms
        for side, (m, per_tensor, per_changed) in sides.items():
            c = section["fits"][name][side]
            assert c["terms"] == list(terms) and c["underdetermined"] is None
            assert c["floor_multiple"] == pytest.approx(m, rel=1e-6)
            assert c["efficiency"] == pytest.approx(1 / m, rel=1e-6)
            assert c["per_tensor_s"] == pytest.approx(per_tensor, rel=1e-5)
            assert c["per_changed_s"] == pytest.approx(per_changed, rel=1e-5, abs=1e-15)
            assert c["rel_residual_max"] < 1e-6
    assert section["floor_gbps"] == pytest.approx(GBPS)  # the runs' own copy floor, read back from their limit
    assert payload_fit.usable({"payloads": section}).keys() == KNOWN.keys()


def test_a_run_recorded_with_the_old_keys_is_read_as_its_payload():
    """A run from before update.payload (no setup.payload; its config's update.delta=true) is the delta's."""
    old = bench_summary(
        None,
        params=1000,
        tensors=4,
        ratio=0.1,
        sides={"encode": (1e-3, 1e-4), "decode": (1e-4, 1e-5)},
        config={"update": {"delta": True}},
    )
    assert {r.payload for r in payload_fit.payload_runs(old)} == {payload_class("delta").name}


def test_a_run_dir_without_payload_metrics_contributes_nothing(tmp_path):
    """The full update's run is the cost model's, never a payload's; a payload run without its sides' floors (from
    before they were recorded) gives no row; a payload run with them gives its rows and is no transport's run."""
    full = bench_summary(payload_fit.full_name(), params=1000, tensors=4)
    bare = bench_summary("delta", params=1000, tensors=4, ratio=0.1)  # no encode / decode metrics
    timed = bench_summary("delta", params=1000, tensors=4, ratio=0.1, sides={"encode": (1e-3, 1e-4)})
    for name, summary in (("full", full), ("bare", bare), ("timed", timed)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    observations, rows = calibrate.bench_runs_under(tmp_path)
    assert [o.source for o in observations] == [str(tmp_path / "full")]
    assert [(r.source, r.side) for r in rows] == [(str(tmp_path / "timed"), "encode")]
    assert payload_fit.payload_runs(full) == [] and payload_fit.payload_runs(bare) == []
    assert payload_fit.fit(payload_fit.payload_runs(bare))["fits"] == {}


def test_a_side_its_runs_do_not_determine_is_left_out():
    two = [r for s in synthetic_summaries()[:2] for r in payload_fit.payload_runs(s)]  # 2 runs, 3 delta terms
    section = payload_fit.fit(two)
    assert "2 runs for 3 coefficients" in section["fits"]["delta"]["encode"]["underdetermined"]
    assert payload_fit.usable({"payloads": section}) == {}
    assert "UNDERDETERMINED" in "\n".join(payload_fit.fit_lines({"payloads": section}))


def calibration(per_byte_s: float = 1e-9, payloads: dict | None = None, version: int = profiles.VERSION) -> dict:
    """direct's bucketed setups at 50 us a call, 10 us a tensor and `per_byte_s`."""
    setups = ("direct/bucketed", "direct/bucketed/flat")
    data = copy_calibration(dict.fromkeys(setups, (5e-05, 1e-05, per_byte_s)), version=version)
    data["floor_gbps"] = GBPS
    if payloads is not None:
        data["payloads"] = payloads
    return data


def fitted(encode=(1.0, 0.0, 1e-7), decode=(1.0, 0.0, 1e-7)) -> dict:
    """A payloads section of a delta fitted to (floor multiple, per_tensor_s, per_changed_s) per side."""
    sides = {}
    for side, (m, t, c) in (("encode", encode), ("decode", decode)):
        sides[side] = {"terms": ["floor", "tensors", "changed"], "floor_multiple": m, "per_tensor_s": t}
        sides[side].update(per_changed_s=c, points=5, underdetermined=None)
    return {"model": payload_fit.MODEL, "fits": {"delta": sides}, "floor_gbps": GBPS, "observations": []}


def plan_config(**plan) -> PlanAppConfig:
    cfg = PlanAppConfig(update=UpdateConfig(flat_engine_weights=False), plan=PlanConfig(**plan))
    validate(cfg)
    return cfg


def make(cfg, data) -> dict:
    return planner.make_plan(cfg, calibration=data, calibration_where="test", bucket_sizes=[512.0])


def test_an_old_calibration_without_payloads_still_loads_and_says_no_payload_fit(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(calibration(version=1)))
    _, data = profiles.resolve(str(path))
    assert data is not None and "payloads" not in data
    plan = make(plan_config(), data)
    k = plan["kinds"]
    assert k["payload_fit"] is False and set(k["unfitted"]) == set(payload_fit.fitted_names())
    assert all(k["rows"][n]["predicted"]["direct"] is None for n in payload_fit.fitted_names())
    full = k["rows"][payload_fit.full_name()]["predicted"]["direct"]
    assert full["time_s"] == pytest.approx(plan["prediction"]["time_s"])  # the whole payload: the cost model's
    text = render.render(plan)
    said = [line for line in text.splitlines() if line.startswith("No payload fit")]
    assert len(said) == 1 and kinds.FIT_COMMAND in said[0]
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps(calibration(version=profiles.VERSION + 1)))
    with pytest.raises(ConfigError, match="its version is"):
        profiles.resolve(str(newer))
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(calibration(payloads={"fits": {"delta": {"encode": {"terms": ["floor"]}}}})))
    with pytest.raises(ConfigError, match="floor_multiple is None, not a number"):
        profiles.resolve(str(broken))


def encoders_bytes(cls, weights, buckets, changed_ratio: float) -> dict:
    """What the payload's own encoder sends and declares over `buckets` on a later update (the delta: a first
    update, then one with nothing changed, the plan's share of 0)."""
    assert changed_ratio == 0.0
    encoder = cls.encoder(buckets, torch.device("cpu"))
    buffer = torch.zeros(max(b.numel for b in buckets), dtype=torch.bfloat16)
    for _ in range(2):  # the first update, then a later one (the plan's row)
        sent = enc = dec = 0
        for i, bucket in enumerate(buckets):
            encoded = encoder.encode(i, bucket, weights, buffer, HostTimer(), {})
            sent, enc, dec = sent + encoded.nbytes, enc + encoded.floor.encode, dec + encoded.floor.decode
    return {"bytes": sent, "encode_floor_bytes": enc, "decode_floor_bytes": dec}


def test_the_plans_row_for_each_payload_is_what_its_own_encoder_sends_and_declares(tiny, monkeypatch):
    """plan.json's kinds: each payload's bytes and floor bytes from the config alone are what its encoder sends
    and its class declares (Payload.floor) when the tiny model's weights are encoded for real."""
    from rlsync.update import plan_for

    monkeypatch.setattr(Compiled, "enabled", False)  # FP8's eager chunks: the same bytes, no compile
    cfg = plan_config(changed_ratio=0.0)
    rows = make(cfg, None)["kinds"]["rows"]
    weights = tiny.weights()
    for name in payload_names():
        cls = payload_class(name)
        if name not in rows or cls.adapters:  # no row of its own; the adapters need a LoRA trainer (test_lora.py)
            continue
        buckets = plan_for(weights, UpdateConfig(payload=name), torch.bfloat16)
        got = encoders_bytes(cls, weights, buckets, cfg.plan.changed_ratio)
        assert {k: rows[name][k] for k in got} == got, name
        assert rows[name]["fit_terms"] == list(cls.fit_terms)


def break_even(per_byte_s: float) -> dict:
    plan = make(plan_config(changed_ratio=0.01), calibration(per_byte_s, payloads=fitted()))
    return plan["kinds"]["break_even"]["delta"]["direct"], plan


def test_the_break_even_share_rises_as_the_transport_slows():
    """The delta's encode and decode do not cross the transport's link; the full update's bytes do: a slower
    transport makes the full update slower and the delta pay up to a larger changed share."""
    fast, plan = break_even(1 / 2e9)
    slow, _ = break_even(1 / 1e9)
    assert fast["pays"] == slow["pays"] == "below"
    assert 0 < fast["share"] < slow["share"] < 1
    assert slow["full_s"] > fast["full_s"] and slow["at_zero_s"] == pytest.approx(fast["at_zero_s"])
    # at the share it names, the delta's prediction is the full update's
    cls, data = payload_class("delta"), calibration(1 / 2e9, payloads=fitted())
    cfg = plan_config(changed_ratio=fast["share"])
    real = planner.Planner(cfg, data)
    ctx = kinds.context(real.cfg, real.plan(cfg.update.bucket_mb), [], GBPS)
    at = kinds.Predictor(real.cfg, real, GBPS, data).predict(cls, cls.planned(ctx), "direct")["time_s"]
    assert at == pytest.approx(fast["full_s"], rel=1e-4)  # changed elements are whole: a step of one element
    line = next(ln for ln in render.render(plan).splitlines() if ln.startswith("Break-even share"))
    assert "over direct" in line and "changed (faster below it)" in line
    row = plan["kinds"]["rows"]["delta"]["predicted"]["direct"]
    assert row["time_s"] == pytest.approx(row["encode_s"] + row["decode_s"] + row["transport_s"])


def test_the_calibration_grid_runs_each_fitted_payload_on_the_small_models():
    """plan.calibrate=true's payload jobs: each payload whose class declares fit_terms, at two changed shares
    where it counts changes, each job a config validation accepts."""
    cfg = plan_config()
    jobs = calibrate.payload_grid(cfg.plan.calibrate_transports)
    assert {p for _, _, p, _ in jobs} == set(payload_fit.fitted_names())
    assert {m for m, *_ in jobs} == set(calibrate.PAYLOAD_MODELS) <= set(calibrate.QUICK_MODELS)
    for model, transport, payload, ratio in jobs:
        bcfg = calibrate.bench_config(
            cfg, model, transport, "bucketed", 512, False, 1, payload=payload, changed_ratio=ratio
        )
        assert (bcfg.update.payload, bcfg.bench.changed_ratio) == (payload, ratio)
    ratios = {r for _, _, p, r in jobs if "changed" in payload_class(p).fit_terms}
    assert len(ratios) >= 2


def test_a_break_even_below_a_hundredth_of_a_percent_reads_as_only_when_nothing_changed():
    """Where the first changed element's per-tensor costs already make the delta slower, the bisection lands on a
    share like 2e-9: the line says the delta pays only when nothing changed, not "0.0000002 %"."""
    _, plan = break_even(1 / 2e9)
    plan["kinds"]["break_even"]["delta"]["direct"].update(share=2e-9, at_zero_s=0.19, full_s=0.2)
    line = next(ln for ln in render.render(plan).splitlines() if ln.startswith("Break-even share"))
    assert "over direct faster only when nothing changed (0.19 s at 0 % against 0.20 s)" in line, line
    assert "0.0000002" not in line
