"""The schemes whose transport starts an engine process (ipc): each runs one benchmark repeat on the tiny model
(tests/unit/test_schemes.py: the others, and the presets' composition)."""

from __future__ import annotations

import pytest
from conftest import ROOT, check_scheme_bench

SCHEMES = sorted(p.stem for p in (ROOT / "rlsync" / "conf" / "scheme").glob("*.yaml"))
PROCESS = [
    s for s in SCHEMES if "  transport: direct" not in (ROOT / "rlsync" / "conf" / "scheme" / f"{s}.yaml").read_text()
]


@pytest.mark.parametrize("scheme", PROCESS)
def test_each_scheme_runs_a_benchmark_repeat_on_the_tiny_model(scheme, tmp_path):
    check_scheme_bench(scheme, tmp_path)
