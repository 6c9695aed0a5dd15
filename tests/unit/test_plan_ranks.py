"""The planner with data-parallel ranks (plan.ranks): the fsdp2 gather beside the copy, what it holds at once,
the memory per rank and the DOES NOT FIT flag from it, the rules of plan.ranks, the collective bandwidth's
sources (the calibration's 2-rank gloo probe, a profile's published NVLink figure, plan.collective_gbps).
All in-process; the probe itself (two processes) is tests/process/test_plan_ranks.py."""

from __future__ import annotations

import json

import pytest
from conftest import copy_calibration, run_main

from rlsync.plan import planner, profiles, render

BUS_GBPS, LATENCY_S, CALL_BYTES = 2.0, 100e-6, 16 * 2**20  # a collective as a calibration would hold it


def calibration(collective: bool = True) -> dict:
    data = copy_calibration()
    if collective:
        data["collective"] = {
            "bus_gbps": BUS_GBPS,
            "latency_s": LATENCY_S,
            "call_bytes": CALL_BYTES,
            "measured": True,
            "probe": "test",
        }
    return data


def plan_cfg(compose, *overrides: str):
    from omegaconf import OmegaConf

    from rlsync.config.apps import PlanAppConfig
    from rlsync.config.compose import to_config

    return to_config(OmegaConf.structured(PlanAppConfig(**vars(compose(*overrides)))), PlanAppConfig)


def plan_of(compose, *overrides: str, ranks: int, cal: dict | None = None, **kw) -> dict:
    cfg = plan_cfg(compose, *overrides)
    cal = calibration() if cal is None else cal
    return planner.make_plan(cfg, calibration=cal, calibration_where="test", bucket_sizes=[64, 512], ranks=ranks, **kw)


def test_the_gather_scales_as_n_minus_1_over_n_and_adds_to_the_copy(compose):
    plans = {n: plan_of(compose, "model=qwen3_0p6b", "trainer.parallel=fsdp2", ranks=n) for n in (2, 4, 8)}
    nbytes = plans[2]["model"]["params"] * 4  # float32, every parameter once (a dense model, per_bucket)
    # each bucket's shards packed and gathered in calls of CALL_BYTES: its float32 bytes are twice its bfloat16 ones
    buckets = planner.Planner(plan_cfg(compose, "model=qwen3_0p6b"), calibration()).plan(512)
    calls = sum(-(-2 * b.nbytes // CALL_BYTES) for b in buckets)
    assert calls > len(buckets) == 3
    for n, plan in plans.items():
        g = plan["gather"]
        assert g["applies"] and g["bytes"] == nbytes and g["received_bytes"] == nbytes * (n - 1) // n
        assert g["floor_s"] == pytest.approx(nbytes * (n - 1) / n / (BUS_GBPS * 1e9))
        assert g["collectives"] == calls and g["latency_term_s"] == pytest.approx(calls * LATENCY_S)
        assert g["time_s"] == pytest.approx(g["floor_s"] + g["latency_term_s"])
        copy = plan["prediction"]["time_s"]
        assert g["whole_update"]["time_s"] == pytest.approx(copy + g["time_s"])
        for row in plan["buckets"]:  # beside the copy, per bucket size
            assert row["bucketed_with_gather_s"] == pytest.approx(row["bucketed_time_s"] + row["gather_time_s"])
    assert plans[4]["gather"]["floor_s"] / plans[2]["gather"]["floor_s"] == pytest.approx((3 / 4) / (1 / 2))
    assert plans[8]["gather"]["floor_s"] / plans[2]["gather"]["floor_s"] == pytest.approx((7 / 8) / (1 / 2))
    text = render.render(plans[2])
    assert "Gather from shards (trainer.parallel=fsdp2, 2 ranks, update.gather=per_bucket): " in text
    assert "over a bus bandwidth of 2 GB/s" in text and "Predicted whole update (gather + copy): " in text
    assert "| gather | gathered held | bucketed + gather |" in text


def test_ddp_and_a_single_rank_gather_nothing(compose):
    ddp = plan_of(compose, "model=qwen3_0p6b", "trainer.parallel=ddp", ranks=4)
    assert ddp["gather"]["applies"] is False and ddp["gather"]["time_s"] == 0.0
    assert "trainer.parallel=ddp: every rank holds the whole model" in ddp["gather"]["why"]
    text = render.render(ddp)
    assert "Gather from shards: none (trainer.parallel=ddp" in text and "| gather |" not in text
    one = plan_of(compose, "model=qwen3_0p6b", "trainer.parallel=fsdp2", ranks=1)
    assert one["gather"]["applies"] is False
    assert "Gather from shards" not in render.render(one) and "Memory per rank" not in render.render(one)


def test_per_bucket_holds_one_bucket_all_at_once_the_whole_model_in_the_trainer_dtype(compose):
    plan = plan_of(compose, "model=qwen3_0p6b", "trainer.parallel=fsdp2", ranks=2)
    held, by_mb = plan["gather"]["held_bytes"], {r["bucket_mb"]: r for r in plan["buckets"]}
    largest = by_mb[512]["largest_bucket_bytes"]  # in the engine's bfloat16: the float32 gather holds twice it
    assert held["per_bucket"] == 2 * largest and held["all_at_once"] == plan["model"]["params"] * 4
    assert held["per_tensor"] == plan["model"]["largest_tensor"]["bytes"] * 2
    assert by_mb[64]["gather_held_bytes"] < by_mb[512]["gather_held_bytes"]  # smaller buckets hold less
    at_once = plan_of(compose, "model=qwen3_0p6b", "trainer.parallel=fsdp2", "update.gather=all_at_once", ranks=2)
    assert at_once["buckets"][0]["gather_held_bytes"] == plan["model"]["params"] * 4
    assert at_once["gather"]["held_bytes_draining"] == held["per_bucket"]  # a rank without an engine drains


def test_per_rank_memory_halves_the_state_under_fsdp2_over_2_ranks(compose):
    fsdp2 = plan_of(compose, "model=qwen3_0p6b", "trainer.parallel=fsdp2", ranks=2)
    ddp = plan_of(compose, "model=qwen3_0p6b", "trainer.parallel=ddp", ranks=2)
    sharded = fsdp2["memory"]["per_rank"]
    state = ddp["memory"]["per_rank"]["rank0"]["host"]["trainer_state"]  # ddp: the whole state on each rank
    assert state == fsdp2["model"]["params"] * 4 * 4  # weights, grads, two AdamW moments in float32
    assert sharded["rank0"]["host"]["trainer_state"] == state // 2 == sharded["other_rank"]["host"]["trainer_state"]
    assert ddp["memory"]["per_rank"]["other_rank"]["host"]["trainer_state"] == state
    # rollout.placement=rank0: the engine on rank 0 only; every_rank: on each
    assert sharded["rank0"]["host"]["engine_weights"] == fsdp2["model"]["update_bytes"]
    assert not sharded["other_rank"]["host"].get("engine_weights")
    every = plan_of(compose, "model=qwen3_0p6b", "trainer.parallel=fsdp2", "rollout.placement=every_rank", ranks=2)
    r = every["memory"]["per_rank"]
    assert r["other_rank"]["host"]["engine_weights"] == r["rank0"]["host"]["engine_weights"]
    assert r["all_ranks_host_bytes"] == 2 * r["rank0"]["host_bytes"]
    assert "Memory per rank (2 ranks, trainer.parallel=fsdp2: 1/2 of the state each" in render.render(fsdp2)


def test_does_not_fit_is_judged_per_rank(compose):
    _where, a100 = profiles.resolve("a100")
    ddp = plan_of(compose, "model=qwen3_8b", "trainer.parallel=ddp", ranks=8, cal=a100)
    (flag,) = [f for f in ddp["flags"] if f["kind"] == "does_not_fit"]
    assert flag["bytes"] == ddp["memory"]["per_rank"]["rank0"]["device_bytes"] > 80 * 2**30
    assert "rank 0 needs" in flag["message"] and "trainer.parallel=fsdp2 shards the state" in flag["message"]
    fsdp2 = plan_of(compose, "model=qwen3_8b", "trainer.parallel=fsdp2", ranks=8, cal=a100)
    assert fsdp2["memory"]["per_rank"]["rank0"]["device_bytes"] < 80 * 2**30  # an eighth of the state each
    assert "does_not_fit" not in {f["kind"] for f in fsdp2["flags"]}
    # the profile's all-gather is NVLink's published figure, said so
    assert fsdp2["gather"]["measured"] is False and fsdp2["gather"]["source"].startswith("published: NVLink 3")
    assert fsdp2["gather"]["latency_s"] is None and "no call latency known" in render.render(fsdp2)


def test_without_a_collective_bandwidth_the_gather_is_unpredicted_and_plan_collective_gbps_gives_one(compose):
    plan = plan_of(compose, "model=tiny", "trainer.parallel=fsdp2", ranks=2, cal=calibration(collective=False))
    assert plan["gather"]["time_s"] is None and plan["gather"]["whole_update"] is None
    assert "unpredicted: no calibrated collective bandwidth" in render.render(plan)
    given = plan_of(compose, "model=tiny", "trainer.parallel=fsdp2", ranks=2, collective_gbps=4.0)
    assert given["gather"]["source"] == "plan.collective_gbps" and given["gather"]["bus_gbps"] == 4.0
    assert given["gather"]["floor_s"] == pytest.approx(given["gather"]["bytes"] / 2 / 4e9)
    planner.check_plan(json.loads(json.dumps(given)))
    older = {k: v for k, v in given.items() if k != "gather"}  # a plan.json from before the gather: still read
    planner.check_plan(older)


def test_a_calibration_s_collective_is_checked():
    bad = {**calibration(), "collective": {"bus_gbps": "fast"}}
    assert "its collective is" in profiles.calibration_problem(bad)
    assert profiles.calibration_problem(calibration()) is None
    assert profiles.calibration_problem(profiles.PROFILES["h200"]()) is None


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["plan.ranks=0"], "plan.ranks=0: out of range (allowed: 1 to 1e+06 (trainer ranks"),
        (["plan.ranks=2", "trainer.parallel=none"], "trainer.parallel=none: not allowed with plan.ranks=2"),
        (["plan.collective_gbps=0"], "plan.collective_gbps=0.0: out of range (allowed: null or 0.01 to 100000 (GB/s"),
    ],
)
def test_plan_ranks_rules_refuse_in_one_line(tmp_path, overrides, says):
    proc = run_main(*overrides, f"hydra.run.dir={tmp_path}", module="rlsync.plan")
    assert proc.returncode == 2 and says in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "plan.json").exists()


def test_the_command_plans_two_ranks_with_the_reference_calibration_s_collective(tmp_path):
    proc = run_main(
        "model=tiny",
        "trainer.parallel=fsdp2",
        "plan.ranks=2",
        "plan.calibration=reference",
        f"hydra.run.dir={tmp_path}",
        module="rlsync.plan",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    ref = profiles.reference()["collective"]
    assert plan["gather"]["bus_gbps"] == ref["bus_gbps"] and plan["gather"]["measured"] is True
    assert "the reference calibration's (another machine's), measured " in plan["gather"]["source"]
    assert "Gather from shards (trainer.parallel=fsdp2, 2 ranks" in proc.stdout
    assert "Memory per rank (2 ranks" in proc.stdout
