"""The planner on real presets and a real calibration: qwen3_8b and qwen3_235b_a22b planned without
allocating, and a quick calibration end to end, compared and refitted (tests/unit/test_plan.py: the rest)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, cli_env, run_main

from rlsync.plan import compare, planner, profiles
from rlsync.plan.calibrate import calibration_file, observations_under

# The bound: the planner never allocates the weights (8B: ~470 MiB, 235B: ~540 MiB, mostly torch).
RSS_LIMIT = 2**30


HANG_S = 1800  # a child's time limit catches a hang only: a plan on a loaded 2-core machine took over 120 s


def plan_with_rss(tmp_path: Path, *overrides: str) -> tuple[dict, int, str]:
    """Run `python -m rlsync.plan` in a child that reports its own peak resident set (bytes).

    VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across exec, so a child of a large
    pytest process would report the parent's peak (1.15 GiB in a full suite run)."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['rlsync.plan', *{list(overrides)!r}, 'hydra.run.dir={tmp_path}']\n"
        "try:\n    runpy.run_module('rlsync.plan', run_name='__main__')\nexcept SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
        "print('PEAK_RSS', int(hwm.split()[1]) * 1024)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=HANG_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rss = int(proc.stdout.rsplit("PEAK_RSS", 1)[1].split()[0])
    return json.loads((tmp_path / "plan.json").read_text()), rss, proc.stdout


def test_plan_of_qwen3_8b_allocates_nothing(tmp_path):
    plan, rss, out = plan_with_rss(tmp_path, "model=qwen3_8b", "plan.calibration=h100")
    assert plan["model"]["params"] == 8_190_735_360  # Qwen3-8B's published count (untied lm_head)
    assert rss < RSS_LIMIT, f"peak RSS {rss / 2**20:.0f} MiB: the plan must not allocate the weights"
    assert "Plan: qwen3_8b" in out


def test_plan_of_qwen3_235b_a22b(tmp_path):
    """The published 235B-A22B plans from its config alone (per-expert names, nothing allocated). How long it
    takes is no assertion: a loaded machine is slow, not wrong (plan_with_rss's timeout catches a hang)."""
    plan, rss, _out = plan_with_rss(tmp_path, "model=qwen3_235b_a22b")
    assert rss < RSS_LIMIT, f"peak RSS {rss / 2**20:.0f} MiB"
    assert plan["model"]["params"] == pytest.approx(235_093_634_560, rel=0.01)
    assert plan["model"]["update_bytes"] == pytest.approx(235_093_634_560 * 2, rel=0.01)


def test_calibrate_quick_end_to_end_then_compare_and_refit(tmp_path):
    cal = tmp_path / "cal.json"
    run_dir = tmp_path / "run"
    proc = run_main(
        "plan.calibrate=true",
        "plan.calibrate_quick=true",
        "plan.calibrate_transports=[direct]",
        "plan.calibrate_repeats=2",
        "plan.calibrate_flat=false",
        "update.flat_engine_weights=false",
        "trainer.dtype=bfloat16",
        f"plan.calibration={cal}",
        f"hydra.run.dir={run_dir}",
        module="rlsync.plan",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(cal.read_text())
    assert data["kind"] == profiles.KIND and data["measured"] is True
    assert {"cpus", "device", "torch", "date"} <= set(data["machine"])
    assert set(data["coefficients"]) == {"direct/bucketed", "direct/per_tensor"}
    assert data["dtypes"] == {"trainer": "bfloat16", "engine": "bfloat16"}
    plan = json.loads((run_dir / "plan.json").read_text())
    planner.check_plan(plan)
    assert plan["prediction"]["time_s"] > 0 and plan["calibration"]["measured"] is True
    assert data["floor_gbps"] > 0 and set(data["coefficients_at_floor"]) == set(data["coefficients"])
    assert plan["prediction"]["at_floor"]["floor_gbps"] == pytest.approx(data["floor_gbps"])
    assert "Calibration written to" in proc.stdout and "Predicted update time:" in proc.stdout
    assert "calibration: 9 benchmark jobs, about " in proc.stdout  # its duration, from the reference's jobs
    assert "UNDERDETERMINED" not in proc.stdout  # the quick grid determines every coefficient it reports
    # the all-gather over 2 gloo ranks, for the fsdp2 gather (plan.ranks)
    assert data["collective"]["bus_gbps"] > 0 and data["collective"]["ranks"] == 2
    assert "calibration: all-gather over 2 gloo ranks: bus bandwidth " in proc.stdout

    # the comparison table: the calibration's own tiny runs against the plan
    out = tmp_path / "compare.md"
    text, rows = compare.write([str(run_dir)], out)
    tiny = [r for r in rows if r["model"] == "tiny" and r["strategy"] == "bucketed"]
    assert tiny and tiny[0]["predicted_s"] == pytest.approx(plan["prediction"]["time_s"])
    assert tiny[0]["at_floor_s"] > 0 and tiny[0]["floor_gbps"] > 0  # at the bench's own floor
    assert tiny[0]["error"] == pytest.approx((tiny[0]["predicted_s"] - tiny[0]["measured_s"]) / tiny[0]["measured_s"])
    assert out.read_text().startswith("Predicted (rlsync.plan)") and "| tiny | direct | bucketed 512 MiB |" in text
    deep = [r for r in rows if r["model"] == "deep"]
    assert deep and all(r["predicted_s"] is None for r in deep)  # no plan of that model: shown, not scored

    # the same fit from the runs on disk (plan.fit_from, a sweep report)
    refit = calibration_file(observations_under(run_dir / "calibration"), device="cpu")
    for key, c in data["coefficients"].items():
        assert refit["coefficients"][key]["per_byte_s"] == pytest.approx(c["per_byte_s"])


def test_a_fresh_install_plans_qwen3_30b_a3b_with_the_reference(tmp_path):
    """No calibration of this machine (an empty cache): the reference answers, marked as such, with a range;
    the 30B model does not fit in this machine's RAM, and the plan says so. (In-process, but a large preset's plan:
    its 30B model's peaks take seconds to count.)"""
    run_dir = tmp_path / "run"
    proc = run_main(
        "model=qwen3_30b_a3b", f"hydra.run.dir={run_dir}", module="rlsync.plan", XDG_CACHE_HOME=str(tmp_path / "cache")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "Calibration: reference cpu.json (shipped with rlsync; none of this machine at" in out and "REFERENCE" in out
    assert "plan.calibrate=true measures this machine (about " in out and "a few minutes" not in out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("Predicted update time")]
    assert line.startswith("Predicted update time (reference calibration): ") and "n/a" not in line
    plan = json.loads((run_dir / "plan.json").read_text())
    pred = plan["prediction"]
    assert plan["calibration"]["reference"] is True and 0 < pred["low_s"] < pred["time_s"] < pred["high_s"]
    assert "Flag does_not_fit: DOES NOT FIT in this machine's RAM" in out
    assert any(f["kind"] == "does_not_fit" for f in plan["flags"])
