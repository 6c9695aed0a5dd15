"""The package's layering: the import-linter contracts in pyproject.toml hold, and no module imports
one that (directly or not) imports it back."""

from __future__ import annotations

import shutil
import subprocess

import grimp
import pytest
from conftest import ROOT, cli_env


def test_import_contracts_hold():
    lint = shutil.which("lint-imports")
    if lint is None:
        pytest.fail("lint-imports is missing: pip install -e '.[test]' installs import-linter")
    proc = subprocess.run([lint], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_no_import_circles():
    graph = grimp.build_graph("rlsync")
    circles = sorted(
        {
            tuple(sorted((a, b)))
            for a in graph.modules
            for b in graph.find_modules_directly_imported_by(a)
            if a != b and graph.chain_exists(importer=b, imported=a)
        }
    )
    assert circles == [], f"modules that import each other (directly or through others): {circles}"
