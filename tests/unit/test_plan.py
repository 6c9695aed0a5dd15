"""The planner (rlsync.plan): the cost model's fit, plan.json, its flags, calibration end to end, the
comparison with benchmark runs, the shipped reference calibration (a real calibration end to end and the
large presets' plans: tests/process/test_plan.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import ROOT, copy_calibration, run_main

from rlsync.plan import cost, planner, profiles, render
from rlsync.plan.calibrate import calibration_file, observations_under

KNOWN = {  # setup key -> (per_call_s, per_tensor_s, per_byte_s); per_tensor's tensor term: per pooled tensor
    "direct/bucketed": (60e-6, 40e-6, 1 / 6e9),
    "ipc/bucketed": (700e-6, 40e-6, 1 / 5e9),
    "direct/per_tensor": (25e-6, 0.0, 1 / 5.5e9),
    "ipc/per_tensor": (350e-6, 600e-6, 1 / 3.5e9),
}


def synthetic(noise: float = 0.0, seed: int = 0) -> list[cost.Observation]:
    """Runs a machine with the KNOWN coefficients would give: spread in calls, tensors and bytes."""
    rng = random.Random(seed)
    out = []
    for key, (c, t, b) in KNOWN.items():
        setup = cost.Setup.from_key(key)
        for tensors, pooled, elements in [
            (46, 21, 2.5e6),
            (706, 1, 4.6e6),
            (24, 15, 2.2e8),
            (310, 197, 6e8),
            (1200, 300, 1e7),
        ]:
            for buckets in [1, max(1, tensors // 8), tensors] if setup.strategy == "bucketed" else [tensors]:
                w = cost.work(
                    setup,
                    tensors=tensors,
                    buckets=buckets,
                    elements=int(elements),
                    trainer_dtype="bfloat16",
                    engine_dtype="bfloat16",
                    pooled=pooled,
                )
                time_s = w.calls * c + (w.tensors if setup.strategy == "bucketed" else w.pooled) * t + w.bytes * b
                out.append(cost.Observation(setup, w, time_s * (1 + rng.uniform(-noise, noise)), 0.01))
    return out


def test_fit_recovers_known_coefficients():
    fitted = cost.fit(synthetic())
    assert set(fitted) == set(KNOWN)
    for key, expected in KNOWN.items():
        got = fitted[key]
        for name, want in zip(cost.TERMS, expected):
            assert getattr(got, name) == pytest.approx(want, rel=1e-6, abs=1e-12), (key, name)
        assert got.rel_residual_max < 1e-6


def test_fit_with_noise_stays_close_and_says_how_close():
    fitted = cost.fit(synthetic(noise=0.05, seed=1))
    for key, (c, _t, b) in KNOWN.items():
        assert fitted[key].per_call_s == pytest.approx(c, rel=0.2)
        assert fitted[key].per_byte_s == pytest.approx(b, rel=0.1)
        assert 0 < fitted[key].rel_residual_max < 0.12  # the prediction's range comes from this


def test_fit_relative_to_the_copy_floor_recovers_the_multiple_whatever_the_load():
    """A machine whose copy floor moves with the load (1 to 8 GB/s here): the update costs 1.7x the
    floor's time per moved byte plus its calls; the fit in floor units finds 1.7 where bytes/s cannot."""
    setup, rng, obs = cost.Setup("direct", "bucketed"), random.Random(2), []
    for calls, tensors, nbytes in [(1, 46, 2e7), (81, 706, 2e7), (1, 24, 1.5e9), (3, 310, 4.7e9), (225, 310, 4.7e9)]:
        floor = 1 / rng.uniform(1e9, 8e9)  # seconds per byte at this run's floor
        time_s = calls * 1e-4 + tensors * 5e-5 + 1.7 * nbytes * floor
        obs.append(cost.Observation(setup, cost.Work(calls, tensors, int(nbytes)), time_s, 0.0, floor))
    rel = cost.fit(obs, relative_to_floor=True)["direct/bucketed"]
    assert rel.per_byte_s * 1e9 == pytest.approx(1.7, rel=1e-3) and rel.per_call_s == pytest.approx(1e-4, rel=1e-2)
    assert cost.fit(obs)["direct/bucketed"].rel_residual_max > 0.2  # absolute bytes/s: the load shows as misfit


def test_fit_keeps_coefficients_non_negative():
    setup = cost.Setup("direct", "bucketed")
    obs = [
        cost.Observation(setup, cost.Work(calls, tensors, nbytes), t)
        for calls, tensors, nbytes, t in [
            (1, 10, 1e8, 0.05),
            (10, 10, 1e8, 0.04),
            (100, 100, 1e6, 0.01),
            (1, 100, 1e7, 0.02),
        ]
    ]
    coef = cost.fit(obs)["direct/bucketed"]
    assert min(coef.per_call_s, coef.per_tensor_s, coef.per_byte_s) >= 0


def test_moved_bytes_count_the_copies_and_the_conversion():
    n = 1000
    assert cost.moved_bytes(cost.Setup("direct", "per_tensor"), n, "float32", "bfloat16") == n * 6
    assert cost.moved_bytes(cost.Setup("direct", "bucketed"), n, "float32", "bfloat16") == n * (6 + 4)
    assert cost.moved_bytes(cost.Setup("direct", "bucketed", True), n, "bfloat16", "bfloat16") == n * 4
    assert cost.moved_bytes(cost.Setup("ipc", "per_tensor"), n, "bfloat16", "bfloat16") == n * 8


def calibration_of(coefficients=KNOWN, measured=True) -> dict:
    return copy_calibration(coefficients, measured=measured, dtypes=("bfloat16", "bfloat16"))


def test_plan_schema_prediction_and_flags(compose):
    from rlsync.config.apps import PlanAppConfig
    from rlsync.config.compose import to_config

    cfg = compose(
        "model=qwen3_1p7b", "trainer.dtype=bfloat16", "update.flat_engine_weights=false"
    )  # the two-copy setup KNOWN holds
    cfg = to_config(__import__("omegaconf").OmegaConf.structured(PlanAppConfig(**vars(cfg))), PlanAppConfig)
    plan = planner.make_plan(cfg, calibration=calibration_of(), calibration_where="test", bucket_sizes=[64, 512, 1024])
    planner.check_plan(json.loads(json.dumps(plan)))  # the schema, through JSON
    assert plan["model"]["tensors"] == 310 and plan["model"]["update_bytes"] == 3_441_149_952
    assert plan["model"]["largest_tensor"]["name"] == "model.embed_tokens.weight"
    by_mb = {r["bucket_mb"]: r for r in plan["buckets"]}
    assert by_mb[512]["buckets"] == 7 and by_mb[512]["tensors_over_bucket"] == 1  # the 594 MiB embedding
    assert by_mb[512]["staging_bytes"] == by_mb[512]["largest_bucket_bytes"] == 151936 * 2048 * 2
    assert by_mb[1024]["tensors_over_bucket"] == 0
    pred = plan["prediction"]
    c, t, b = KNOWN["direct/bucketed"]
    assert pred["calls"] == 7 and pred["time_s"] == pytest.approx(7 * c + 310 * t + 1_720_574_976 * 8 * b)
    assert pred["low_s"] == pytest.approx(pred["time_s"] * 0.9) and pred["high_s"] == pytest.approx(
        pred["time_s"] * 1.1
    )
    kinds = {f["kind"]: f for f in plan["flags"]}
    assert {"tensor_over_bucket", "staging", "per_tensor_overhead", "overhead_share"} <= set(kinds)
    assert "model.embed_tokens.weight (594 MiB)" in kinds["tensor_over_bucket"]["message"]
    per_tensor = 310 * KNOWN["direct/per_tensor"][0] + 1_720_574_976 * 4 * KNOWN["direct/per_tensor"][2]
    assert kinds["per_tensor_overhead"]["share"] == pytest.approx((per_tensor - pred["time_s"]) / per_tensor)
    setups = {(r["transport"], r["strategy"], r["bucket_mb"]) for r in plan["predictions"]}
    assert ("ipc", "per_tensor", None) in setups and ("ipc", "bucketed", 1024) in setups
    # per_tensor over ipc: a message per tensor, plus the pooled ones (copied on torch's thread pool:
    # over 32768 elements): by hand, 28 layers x (q, k, v, o, gate, up, down) + the tied embedding = 197
    ipc = next(r for r in plan["predictions"] if (r["transport"], r["strategy"]) == ("ipc", "per_tensor"))
    c, t, b = KNOWN["ipc/per_tensor"]
    assert ipc["pooled_tensors"] == 197 and ipc["tensor_term"] == {"count": 197, "counts": "pooled tensors"}
    assert ipc["time_s"] == pytest.approx(310 * c + 197 * t + 1_720_574_976 * 8 * b)
    text = render.render(plan)
    assert "Flag tensor_over_bucket" in text and "Predicted update time" in text and "unmeasured" not in text


def test_the_default_plan_predicts_the_one_copy_update_it_resolves(compose):
    """update.flat_engine_weights=null: the headline prediction, its table column and the flags are
    the flat (one-copy) setup's, as the update resolves it; not the two-copy path's coefficients."""
    from rlsync.config.apps import PlanAppConfig
    from rlsync.config.compose import to_config

    cfg = compose("model=qwen3_1p7b", "trainer.dtype=bfloat16", "rollout.dtype=bfloat16")
    assert cfg.update.flat_engine_weights is None
    cfg = to_config(__import__("omegaconf").OmegaConf.structured(PlanAppConfig(**vars(cfg))), PlanAppConfig)
    plan = planner.make_plan(cfg, calibration=profiles.resolve("h100")[1], calibration_where="h100", bucket_sizes=[512])
    assert plan["setup"]["flat_engine_weights"] is True
    flat = next(
        r
        for r in plan["predictions"]
        if r["strategy"] == "bucketed" and r["bucket_mb"] == 512 and r["transport"] == "direct"
    )
    assert flat["flat"] is True and plan["prediction"]["time_s"] == pytest.approx(flat["time_s"])
    assert plan["prediction"]["moved_bytes"] == plan["model"]["params"] * 4  # one bf16 -> bf16 copy: read 2 + write 2
    assert "flat buffer" in next(f["message"] for f in plan["flags"] if f["kind"] == "tensor_over_bucket")
    assert "Update: direct flat, bucketed" in render.render(plan)


def test_gpu_profile_is_marked_unmeasured(tmp_path):
    proc = run_main("model=qwen3_4b", "plan.calibration=h200", f"hydra.run.dir={tmp_path}", module="rlsync.plan")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UNMEASURED" in proc.stdout and "Predicted update time (unmeasured)" in proc.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["calibration"]["measured"] is False and plan["prediction"]["measured"] is False


def test_fit_from_a_directory_of_runs(tmp_path):
    proc = run_main(
        f"plan.fit_from={tmp_path}",
        f"plan.calibration={tmp_path / 'c.json'}",
        f"hydra.run.dir={tmp_path}/r",
        module="rlsync.plan",
    )
    assert proc.returncode != 0 and "no finished rlsync.bench update runs" in proc.stderr


def bench_run(
    model: str,
    transport: str,
    strategy: str,
    bucket_mb: float,
    seconds: float,
    *,
    largest_bucket: int,
    peak: int,
    tensors: int = 310,
    params: int = 1_720_574_976,
):
    from rlsync.report.runs import Run

    stats = {
        "perf/update_weights_time": {"median": seconds, "min": seconds * 0.95, "max": seconds * 1.05},
        "perf/update_weights_peak_bytes": {"median": peak, "min": peak, "max": peak},
    }
    summary = {
        "kind": "bench",
        "target": "update",
        "status": "finished",
        "model": {"name": model, "params": params, "tensors": tensors},
        "metrics": stats,
        "machine": {"device": "cpu", "cpus": 2},
        "setup": {
            "transport": transport,
            "strategy": strategy,
            "bucket_mb": bucket_mb,
            "flat_engine_weights": False,
            "buckets": 7 if strategy == "bucketed" else tensors,
            "largest_bucket_bytes": largest_bucket,
            "trainer_dtype": "bfloat16",
            "engine_dtype": "bfloat16",
        },
    }
    return Run(
        Path(f"/runs/{transport}_{strategy}"), f"{transport}_{strategy}", [], "finished", None, summary, {}, stats, 5
    )


def test_report_sizes_the_known_pain_and_fits_the_cost_model():
    from rlsync.report import sizing

    emb = 151936 * 2048 * 2
    runs = [
        bench_run("qwen3_1p7b", "ipc", "bucketed", 512, 1.0, largest_bucket=emb, peak=emb),
        bench_run("qwen3_1p7b", "ipc", "per_tensor", 512, 4.0, largest_bucket=emb, peak=emb),
        bench_run("qwen3_1p7b", "direct", "bucketed", 1024, 0.8, largest_bucket=2**30 - 1, peak=2**30),
    ]
    lines = "\n".join(sizing.pain_lines(runs))
    assert "tensor larger than the bucket: qwen3_1p7b at 512 MiB: its largest bucket is 594 MiB" in lines
    assert "at 1024 MiB" not in lines.split("staging")[0]  # 1024 MiB holds the embedding
    assert "staging memory: qwen3_1p7b direct bucketed 1024 MiB: 1.00 GiB" in lines
    assert "per-tensor overhead share: qwen3_1p7b ipc at 512 MiB: 75.0 %" in lines
    data = sizing.cost_fit(runs)
    assert set(data["coefficients"]) == {"ipc/bucketed", "ipc/per_tensor", "direct/bucketed"}
    assert data["machine"]["fitted_from_runs"] is True
    assert "ipc/per_tensor" in "\n".join(sizing.cost_fit_lines(data))


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["plan.calibrate=true", "plan.fit_from=/tmp"], "plan.fit_from=/tmp: not allowed with plan.calibrate=true"),
        (["plan.bucket_sizes=[0]"], "plan.bucket_sizes=[0.0]: not allowed"),
        # L09: a size that rounds to 0 bytes is held to update.bucket_mb's rule, not refused at run time
        (
            ["plan.bucket_sizes=[64,1e-9]"],
            "plan.bucket_sizes=[64.0,1e-09]: not allowed (allowed: a non-empty list, each",
        ),
        # L11: a bandwidth no copy or link has (a floor of 0.00 GB/s and a 300-digit time)
        (["plan.copy_gbps=1e-300"], "plan.copy_gbps=1e-300: out of range (allowed: null or 0.01 to 100000"),
        (["plan.collective_gbps=1e300"], "plan.collective_gbps=1e+300: out of range (allowed: null or 0.01 to 100000"),
        # L19: the calibration grid benchmarks direct and ipc only, as the rule says
        (["plan.calibrate_transports=[direct,broadcast]"], "plan.calibrate_transports=[direct,broadcast]: not allowed"),
        (["plan.calibrate=true", "plan.calibration=h200"], "plan.calibration=h200: names a built-in calibration"),
        (["plan.calibrate_repeats=100000000000000000000000"], "out of range (allowed: 1 to 1000000"),
    ],
)
def test_plan_config_rules(tmp_path, overrides, says):
    proc = run_main(*overrides, f"hydra.run.dir={tmp_path}", module="rlsync.plan")
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "plan.json").exists()


def test_the_calibration_grid_benchmarks_each_transport_the_rule_allows():
    from rlsync.config.apps import calibrated_transports
    from rlsync.plan.calibrate import GRID

    assert {transport for _, transport, _, _ in GRID} == set(calibrated_transports())


@pytest.mark.parametrize("value", ["h999", "{tmp}/nonexistent/cal.json", "{tmp}/loopA"])
def test_a_calibration_that_is_neither_a_file_nor_built_in_is_refused(tmp_path, value):
    """C076, C076b, L05: refused in one line naming the built-in ones, not a plan whose predictions are all n/a."""
    (tmp_path / "loopA").symlink_to(tmp_path / "loopB")
    (tmp_path / "loopB").symlink_to(tmp_path / "loopA")
    value = value.format(tmp=tmp_path)
    proc = run_main(f"plan.calibration={value}", f"hydra.run.dir={tmp_path / 'plan'}", module="rlsync.plan")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    what = "a symbolic link to nothing (a loop, or a missing target)" if value.endswith("loopA") else "no such file"
    assert line.startswith(f"rlsync: config error: plan.calibration={value}: {what}, and not a built-in calibration")
    assert "(allowed: h200, h100, a100, reference (built in), a calibration file" in line
    assert not (tmp_path / "plan" / "plan.json").exists()


def write_bench_runs(root: Path, runs: list[tuple]) -> Path:
    """summary.json of finished rlsync.bench update runs, (transport, buckets, tensors, params, seconds) each."""
    for i, (transport, buckets, tensors, params, seconds) in enumerate(runs):
        (root / f"run{i}").mkdir(parents=True)
        summary = {
            "kind": "bench",
            "target": "update",
            "status": "finished",
            "model": {"name": f"m{i}", "params": params, "tensors": tensors},
            "machine": {"device": "cpu", "cpus": 2},
            "metrics": {"perf/update_weights_time": {"median": seconds, "min": seconds * 0.95, "max": seconds * 1.05}},
            "setup": {
                "transport": transport,
                "strategy": "bucketed",
                "bucket_mb": 512,
                "flat_engine_weights": False,
                "buckets": buckets,
                "trainer_dtype": "float32",
                "engine_dtype": "bfloat16",
            },
        }
        (root / f"run{i}" / "summary.json").write_text(json.dumps(summary))
    return root


# direct/bucketed runs that vary calls, tensors and bytes independently: its three coefficients are determined
DETERMINED = [
    ("direct", 1, 46, 2_500_000, 0.004),
    ("direct", 46, 46, 2_500_000, 0.006),
    ("direct", 3, 706, 4_600_000, 0.02),
    ("direct", 1, 24, 220_000_000, 0.2),
    ("direct", 12, 310, 600_000_000, 0.6),
]


def test_a_fit_its_runs_do_not_determine_is_refused_and_not_written(tmp_path):
    """L17: plan.fit_from over three runs of one setup was written (UNDERDETERMINED, residual 15248 %) and
    became the calibration, exit 0: refused in one line, nothing written."""
    runs = write_bench_runs(tmp_path / "runs", DETERMINED[:3])
    cal = tmp_path / "new" / "cal.json"
    proc = run_main(
        f"plan.fit_from={runs}", f"plan.calibration={cal}", f"hydra.run.dir={tmp_path / 'p'}", module="rlsync.plan"
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"rlsync: config error: plan.fit_from={runs}: its runs determine no setup's coefficients ")
    assert "direct/bucketed: 3 runs for 3 coefficients" in line and "nothing written" in line
    assert not cal.exists() and not (tmp_path / "p" / "calibration.json").exists()


def test_a_fit_writes_a_new_calibration_file_and_ends_on_the_setups_it_leaves_out(tmp_path):
    """A plan.calibration that does not exist yet is what plan.fit_from writes; a setup its runs do not determine
    (one ipc run) is left out of the predictions, and the command's last line says so."""
    runs = write_bench_runs(tmp_path / "runs", [*DETERMINED, ("ipc", 1, 46, 2_500_000, 0.01)])
    cal = tmp_path / "new" / "cal.json"
    args = [f"plan.calibration={cal}", "update.flat_engine_weights=false", f"hydra.run.dir={tmp_path / 'p'}"]
    proc = run_main(f"plan.fit_from={runs}", *args, module="rlsync.plan")
    assert proc.returncode == 0, proc.stderr
    assert cal.is_file()
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rlsync: warning: UNDERDETERMINED: the calibration's runs do not determine 1 of its 2")
    assert "ipc/bucketed: 1 runs for 3 coefficients" in last
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert "UNDERDETERMINED, left out: ipc/bucketed" in plan["calibration"]["describe"]
    assert plan["prediction"]["time_s"] > 0  # direct/bucketed, the configured setup, is determined
    # the file read again: ipc's coefficients are not used, and the plan says why
    proc = run_main(*args, "update.transport=ipc", module="rlsync.plan")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == last
    assert not json.loads((tmp_path / "p" / "plan.json").read_text())["prediction"]


def test_a_staged_copy_read_back_from_the_cache_is_not_counted_as_moved(tmp_path):
    from rlsync.measure.floors import cache_resident_elements, llc_bytes

    n, cached = 1_000_000, 400_000
    ipc = cost.Setup("ipc", "per_tensor")  # into the slot (read 2 + write 2), then the load (read 2 + write 2)
    assert cost.moved_bytes(ipc, n, "bfloat16", "bfloat16") == n * 8
    assert cost.moved_bytes(ipc, n, "bfloat16", "bfloat16", cached) == n * 8 - cached * 2  # the load's read of the slot
    flat = cost.Setup("direct", "bucketed", flat=True)  # one copy: nothing is read back
    assert cost.moved_bytes(flat, n, "float32", "bfloat16", cached) == n * 6
    # units whose staging fits in half the last-level cache, none without a figure
    assert cache_resident_elements("bucketed", [1], [10, 8 << 20, (8 << 20) + 1], 2, 32 << 20) == 10 + (8 << 20)
    assert cache_resident_elements("per_tensor", [10, 8 << 20, (8 << 20) + 1], [1], 2, 32 << 20) == 10 + (8 << 20)
    assert cache_resident_elements("bucketed", [10], [10], 2, None) == 0
    # sysfs: the highest level's size
    for index, (level, size) in enumerate([(1, "48K"), (1, "32K"), (2, "2048K"), (3, "36608K")]):
        d = tmp_path / f"index{index}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    assert llc_bytes(str(tmp_path)) == 36608 * 1024
    assert llc_bytes(str(tmp_path / "absent")) is None


def test_the_plan_counts_the_cache_of_the_calibration_machine(compose):
    """Qwen3-1.7B over ipc per_tensor, bf16, with a 32 MiB LLC: tensors of at most 8 Mi elements (16 MiB)
    stay in the cache between the copy into the slot and the engine's load. By hand, per layer
    q_proj and o_proj (2048 x 2048), k_proj and v_proj (1024 x 2048), the two norms (2048) and
    q_norm, k_norm (128): 12,587,264 elements; 28 layers and the final norm: 352,445,440. Not the
    MLP (6144 x 2048) nor the embedding."""
    from rlsync.config.apps import PlanAppConfig
    from rlsync.config.compose import to_config

    cfg = compose("model=qwen3_1p7b", "trainer.dtype=bfloat16", "update.strategy=per_tensor", "update.transport=ipc")
    cfg = to_config(__import__("omegaconf").OmegaConf.structured(PlanAppConfig(**vars(cfg))), PlanAppConfig)
    cal = calibration_of()
    without = planner.make_plan(cfg, calibration=cal, calibration_where="test", bucket_sizes=[512])["prediction"]
    cal["machine"]["llc_bytes"] = 32 << 20
    with_llc = planner.make_plan(cfg, calibration=cal, calibration_where="test", bucket_sizes=[512])["prediction"]
    assert without["moved_bytes"] == 1_720_574_976 * 8
    assert with_llc["moved_bytes"] == 1_720_574_976 * 8 - 352_445_440 * 2
    cal["machine"]["cuda"] = True  # a GPU calibration: its copies are not the CPU's
    on_gpu = planner.make_plan(cfg, calibration=cal, calibration_where="test", bucket_sizes=[512])["prediction"]
    assert on_gpu["moved_bytes"] == without["moved_bytes"]


# ----------------------------------------------------------------------------------------------
# Out of the box: the shipped reference calibration, a quick calibration that determines its
# coefficients, published-figure profiles with a range, the "does not fit" flag, real durations
# ----------------------------------------------------------------------------------------------


def planned_rows(jobs: list[tuple]) -> list[dict]:
    """Each calibration job's work from its model's shapes alone (no run): the rows the fit would see."""
    import torch

    from rlsync.check.estimate import param_shapes
    from rlsync.config.schema import ModelConfig
    from rlsync.measure.threads import pooled
    from rlsync.plan.calibrate import model_keys
    from rlsync.update.buckets import TensorMeta, plan_buckets

    rows = []
    for model, transport, strategy, bucket_mb, flat in jobs:
        metas = [TensorMeta(n, tuple(s), torch.bfloat16) for n, s in param_shapes(ModelConfig(**model_keys(model)))]
        setup = cost.Setup(transport, strategy, flat)
        w = cost.work(
            setup,
            tensors=len(metas),
            buckets=len(plan_buckets(metas, int(bucket_mb * 2**20))),
            elements=sum(m.numel for m in metas),
            trainer_dtype="float32",
            engine_dtype="bfloat16",
            pooled=sum(pooled(m.numel) for m in metas),
        )
        rows.append({"setup": setup.key, "calls": w.calls, "tensors": w.tensors, "pooled": w.pooled, "bytes": w.bytes})
    return rows


def test_the_quick_calibration_determines_every_coefficient():
    """plan.calibrate_quick=true: per setup more runs than coefficients, and calls, tensors (pooled ones
    for per_tensor) and bytes varied independently (full rank); the two models it had before did not."""
    from rlsync.plan.calibrate import grid, underdetermined

    jobs = grid(quick=True, flat=True, transports=("direct", "ipc"))
    rows = planned_rows(jobs)
    setups = {r["setup"] for r in rows}
    assert setups == {f"{t}/{s}" for t in ("direct", "ipc") for s in ("bucketed", "bucketed/flat", "per_tensor")}
    assert {key: underdetermined(key, rows, 0) for key in setups} == dict.fromkeys(setups)
    before = [row for row, job in zip(rows, jobs) if job[0] in ("tiny", "deep")]
    assert all(underdetermined(key, before, 0) for key in setups)
    assert "UNDERDETERMINED" in "\n".join(calibration_lines_of(before))


def calibration_lines_of(rows: list[dict]) -> list[str]:
    from rlsync.plan.calibrate import coefficient_lines

    coef = {r["setup"]: cost.Coefficients(1e-5, 1e-6, 1e-10, points=3).as_dict() for r in rows}
    return coefficient_lines({"coefficients": coef, "observations": rows})


def test_the_shipped_reference_calibration_is_a_real_one_of_a_described_machine():
    import tomllib

    from rlsync.plan.calibrate import GRID, underdetermined

    data = profiles.reference()
    assert data["reference"] is True and data["measured"] is True and profiles.calibration_problem(data) is None
    assert {"cpus", "cpu_model", "host_memory_bytes", "torch", "date", "device", "load_average"} <= set(data["machine"])
    assert data["seconds"] > 60 and all(r["wall_s"] > 0 for r in data["observations"])
    assert {r["model"] for r in data["observations"]} == {m for m, *_ in GRID}  # the full grid, not the quick one
    assert "direct/bucketed/flat" in data["coefficients"]  # the default plan's setup (flat weights, auto)
    assert {key: underdetermined(key, data["observations"], 0) for key in data["coefficients"]} == dict.fromkeys(
        data["coefficients"]
    )
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert profiles.REFERENCE.relative_to(ROOT / "rlsync" / "plan").as_posix() == "reference/cpu.json"
    assert "reference/*.json" in package_data["rlsync.plan"]  # in the wheel


def plan_cfg(compose, *overrides: str):
    from omegaconf import OmegaConf

    from rlsync.config.apps import PlanAppConfig
    from rlsync.config.compose import to_config

    cfg = compose(*overrides)
    return to_config(OmegaConf.structured(PlanAppConfig(**vars(cfg))), PlanAppConfig)


def test_a_gpu_profile_predicts_a_range_and_flags_a_run_that_does_not_fit(compose):
    where, h200 = profiles.resolve("h200")
    small = planner.make_plan(plan_cfg(compose, "model=qwen3_0p6b"), calibration=h200, calibration_where=where,
                              bucket_sizes=[512])  # fmt: skip
    pred = small["prediction"]
    assert pred["low_s"] == pytest.approx(0.8 * pred["time_s"]) and pred["high_s"] == pytest.approx(2 * pred["time_s"])
    assert "does_not_fit" not in {f["kind"] for f in small["flags"]}
    assert small["memory"]["capacity_bytes"] == 143771 * 2**20
    where, a100 = profiles.resolve("a100")
    big = planner.make_plan(plan_cfg(compose, "model=qwen3_8b"), calibration=a100, calibration_where=where,
                            bucket_sizes=[512])  # fmt: skip
    (flag,) = [f for f in big["flags"] if f["kind"] == "does_not_fit"]
    assert flag["bytes"] == big["memory"]["run_peak_device_bytes"] > 80 * 2**30
    assert flag["message"].startswith("DOES NOT FIT in NVIDIA A100-SXM4-80GB (80.0 GiB): a whole run needs ")
    assert "per device" in flag["message"] and "Flag does_not_fit: DOES NOT FIT" in render.render(big)


def test_the_calibration_says_how_long_it_takes():
    """From the reference calibration's own job times, not "a few minutes"."""
    from rlsync.plan.calibrate import calibrate_hint, estimate_seconds, fmt_minutes, grid

    ref = profiles.reference()
    full = estimate_seconds(grid(quick=False, flat=True, transports=("direct", "ipc")), ref)
    assert full == pytest.approx(ref["seconds"])  # its own grid: the time it took, reruns included
    quick = estimate_seconds(grid(quick=True, flat=True, transports=("direct", "ipc")), ref)
    assert 0 < quick < full / 2
    assert f"about {fmt_minutes(full)} on the reference's 2 cores" in calibrate_hint()
    assert f"plan.calibrate_quick=true about {fmt_minutes(quick)}" in calibrate_hint()
    assert "a few minutes" not in profiles.describe("x", None, calibrate_hint())


def test_a_calibration_file_that_determines_no_setup_is_refused_when_read_or_fitted(tmp_path):
    """The same rule where the file is read (plan.calibration, a report's fit of three runs) and where
    plan.calibrate=true's jobs leave nothing determined (exit 1: the jobs failed, not the input)."""
    from types import SimpleNamespace

    from rlsync.errors import RlsyncError
    from rlsync.plan.calibrate import checked_fit

    data = calibration_file(observations_under(write_bench_runs(tmp_path / "runs", DETERMINED[:3])), device="cpu")
    (tmp_path / "cal.json").write_text(json.dumps(data))
    proc = run_main(
        f"plan.calibration={tmp_path / 'cal.json'}", f"hydra.run.dir={tmp_path / 'p'}", module="rlsync.plan"
    )
    assert proc.returncode == 2, proc.stderr
    assert f"plan.calibration={tmp_path / 'cal.json'}: its runs determine no setup's coefficients" in proc.stderr
    with pytest.raises(RlsyncError, match=r"^calibration failed: its runs determine no setup's .*: nothing written"):
        checked_fit(data, SimpleNamespace(calibrate=True, fit_from=None))
