"""The planner's answer for a GPU user is a verdict too: with plan.step_s the predicted update's share of the
step and whether to tune it (the run's own phrasing and threshold), and what the predicted time spans beside
what each framework's update metric spans (read from the framework maps, never copied)."""

from __future__ import annotations

import json

import pytest
from conftest import run_main

from rlsync.config.schema import VERDICT_THRESHOLD
from rlsync.plan.planner import PREDICTION_SPANS
from rlsync.readers.frameworks.base import framework_class, framework_names
from rlsync.record.summary import share_verdict

MILES = ("model=qwen3_1p7b", "scheme=miles", "plan.calibration=h200")


def plan(tmp_path, *overrides: str):
    proc = run_main(*overrides, f"hydra.run.dir={tmp_path}", module="rlsync.plan")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads((tmp_path / "plan.json").read_text())


@pytest.mark.parametrize("step_s, side", [(30.0, "not the step to tune"), (0.1, "worth tuning")])
def test_the_plan_judges_the_predicted_update_against_the_step(tmp_path, step_s, side):
    out, p = plan(tmp_path, *MILES, f"plan.step_s={step_s}")
    v, pred = p["verdict"], p["prediction"]
    share = pred["time_s"] / step_s
    assert v["share"] == pytest.approx(share) and v["threshold"] == VERDICT_THRESHOLD
    assert (v["low_share"], v["high_share"]) == pytest.approx((pred["low_s"] / step_s, pred["high_s"] / step_s))
    assert v["verdict"] == share_verdict(share, VERDICT_THRESHOLD) and side in v["verdict"]
    assert f"Verdict at plan.step_s={step_s:g} s (unmeasured): {v['verdict']}" in out
    # scheme=miles: Miles' own span note beside the prediction's, read from its map; no other framework's
    miles = framework_class("miles")
    assert [f["name"] for f in v["frameworks"]] == ["miles"] and v["frameworks"][0]["spans"] == miles.spans
    assert f"The predicted time is {PREDICTION_SPANS}" in out and f"  {miles.title}: {miles.spans}" in out
    assert framework_class("verl").spans not in out


def test_a_range_across_the_threshold_says_so(tmp_path):
    # 14.1 ms predicted (11.3 to 28.2 ms): at 0.6 s the median is under 3 %, the range's top over it
    out, p = plan(tmp_path, *MILES, "plan.step_s=0.6")
    v = p["verdict"]
    assert v["share"] < VERDICT_THRESHOLD <= v["high_share"]
    assert "its range crosses 3.00 %: measure it" in out


def test_without_a_step_the_verdict_says_how_to_get_one_and_every_framework_is_listed(tmp_path):
    out, p = plan(tmp_path, "model=qwen3_0p6b", "plan.calibration=h100")  # scheme=rlsync: no framework of its own
    assert p["verdict"]["step_s"] is None and p["verdict"]["verdict"] is None
    assert "Verdict: n/a (plan.step_s=SECONDS" in out
    assert [f["name"] for f in p["verdict"]["frameworks"]] == list(framework_names())
    for name in framework_names():
        cls = framework_class(name)
        assert f"  {cls.title}: {cls.spans}" in out


RULE = "allowed: null or a number > 0 (seconds)"  # the key's rule, not an unknown key's error


@pytest.mark.parametrize(
    "value, says", [("0", RULE), ("-1", RULE), ("inf", RULE), ("nan", RULE), ("fast", "wrong type (allowed: a number)")]
)
def test_plan_step_s_is_a_positive_finite_number_of_seconds(tmp_path, value, says):
    proc = run_main(f"plan.step_s={value}", f"hydra.run.dir={tmp_path}", module="rlsync.plan")
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith("rlsync: ") and "plan.step_s" in line
    assert says in line
    assert not (tmp_path / "plan.json").exists()


def test_help_shows_plan_step_s(tmp_path):
    proc = run_main("--help", module="rlsync.plan")
    assert proc.returncode == 0
    assert any(
        "plan.step_s" in line and "share of it and whether to tune it" in line for line in proc.stdout.splitlines()
    )
