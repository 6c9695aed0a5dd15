"""Fit the payloads' encode and decode from this study's runs into the shipped reference calibration.

    python experiments/payloads/fit_reference.py              # results_cpu/runs -> rlsync/plan/reference/cpu.json

The reference calibration (rlsync/plan/reference/cpu.json: the cost model a fresh install plans with) was measured
before payloads were fitted; this adds its `payloads` section (rlsync/plan/payload_fit.py), fitted from the delta
and FP8 runs of this study on the same machine, so that `python -m rlsync.plan` predicts each payload's update
out of the box. Its transport coefficients are left as they are. `python -m rlsync.plan plan.calibrate=true`
makes a calibration of both on the machine it runs on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlsync.plan import payload_fit, profiles
from rlsync.plan.calibrate import bench_runs_under

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "experiments/payloads/results_cpu/runs"
REFERENCE = ROOT / "rlsync/plan/reference/cpu.json"


def main() -> None:
    _, runs = bench_runs_under(RUNS)
    section = payload_fit.fit(runs)
    section["source"] = str(RUNS.relative_to(ROOT))
    data = json.loads(REFERENCE.read_text())
    data["payloads"] = section
    data["version"] = profiles.VERSION
    REFERENCE.write_text(json.dumps(data, indent=2) + "\n")
    print(
        f"{REFERENCE.relative_to(ROOT)}: payloads fitted from {len(runs)} encode and decode rows under {section['source']}"
    )
    print("\n".join(payload_fit.fit_lines(data)))


if __name__ == "__main__":
    main()
