"""The planner's collective probe itself: an all-gather over 2 gloo ranks (two processes), as plan.calibrate=true
measures it. The rest of the planner with data-parallel ranks runs in-process: tests/unit/test_plan_ranks.py."""

from __future__ import annotations

import pytest
from conftest import copy_calibration

from rlsync.plan import profiles
from rlsync.plan.collective import measure_collective


def test_the_calibration_measures_an_all_gather_over_2_gloo_ranks():
    found = measure_collective(nbytes=16 * 2**20, timeout_s=120)
    assert found["ranks"] == 2 and found["backend"] == "gloo" and found["measured"] is True
    assert found["bus_gbps"] > 0 and found["gathered_gbps"] == pytest.approx(2 * found["bus_gbps"])
    assert 0 < found["latency_s"] < 1 and "all_gather" in found["probe"] and "2 ranks, gloo" in found["probe"]
    assert found["call_bytes"] is None or 0 < found["call_bytes"] <= 16 * 2**20  # the fastest call size probed
    assert profiles.calibration_problem({**copy_calibration(), "collective": found}) is None
