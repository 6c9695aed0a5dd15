"""rlsync as a user installs it: a wheel (and an editable install) in a fresh virtual environment,
its console scripts run from a directory outside the checkout.

The environments see the running interpreter's packages (its site directories, a virtual
environment's as well as a base interpreter's), so torch and the other dependencies come from this
one and only rlsync is installed (--no-deps), built with this environment's own pip and setuptools:
about a minute and a half on two cores, most of it the tiny run and the benchmark. `-m "not packaging"`
(or `-m "not slow"`) leaves it out.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST, ROOT

pytestmark = pytest.mark.packaging


def sh(*cmd, cwd: Path, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """A command as a user runs it: no PYTHONPATH into the checkout, W&B off."""
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    return subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env={**base, "WANDB_MODE": "disabled", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (proc.args, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def source_copy(dest: Path) -> Path:
    """What a build reads, copied, so the build leaves nothing in the checkout (build/, egg-info)."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(ROOT / "rlsync", dest / "rlsync", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def running_site_dirs() -> list[str]:
    """Where this interpreter's packages are: a virtual environment's site-packages when the tests run in one."""
    dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    return [d for d in dirs if Path(d).is_dir()]


def venv(path: Path, *install: str) -> Path:
    """A virtual environment over this one's packages, with `pip install --no-deps *install` in it; its bin/.

    Not `--system-site-packages`: made from inside a virtual environment, that reaches the *base*
    interpreter's packages (no torch, perhaps a setuptools without bdist_wheel), not the running ones.
    A .pth file adds the running interpreter's site directories after the new environment's own, so
    what is installed here comes first and pip and setuptools are this environment's."""
    ok(sh(sys.executable, "-m", "venv", "--without-pip", path, cwd=path.parent))
    python = path / "bin" / "python"
    purelib = ok(sh(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=path.parent))
    own = Path(purelib.stdout.strip())
    (own / "zz_running_environment.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in running_site_dirs())
    )
    ok(sh(python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *install, cwd=path.parent))
    return path / "bin"


def installed_from(bin_dir: Path, cwd: Path) -> Path:
    out = ok(sh(bin_dir / "python", "-c", "import rlsync; print(rlsync.__file__)", cwd=cwd)).stdout
    return Path(out.strip()).parent


def assert_help_and_completion(bin_dir: Path, cwd: Path) -> None:
    shown = ok(sh(bin_dir / "rlsync", "--help", cwd=cwd)).stdout
    assert "update.bucket_mb=512.0" in shown and "bucket size in MiB" in shown
    assert "bench.repeats=10" in ok(sh(bin_dir / "rlsync-bench", "--help", cwd=cwd)).stdout
    assert "serve.sessions=0" in ok(sh(bin_dir / "rlsync-serve", "--help", cwd=cwd)).stdout
    script = ok(sh(bin_dir / "rlsync", "--shell-completion", "install=bash", cwd=cwd)).stdout
    assert script.rstrip().endswith("hydra_bash_completion rlsync")  # keyed to the console script's name
    offered = ok(sh(bin_dir / "rlsync", "--shell-completion", "query=bash", cwd=cwd, COMP_LINE="rlsync update.tr"))
    assert "update.transport=" in offered.stdout.split()


def test_wheel_install_runs_every_console_script_outside_the_checkout(tmp_path):
    src = source_copy(tmp_path / "src")
    ok(
        sh(
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            src,
            "-w",
            tmp_path / "wheels",
            cwd=tmp_path,
        )
    )
    wheel = next((tmp_path / "wheels").glob("rlsync-*.whl"))
    bin_dir = venv(tmp_path / "venv", str(wheel))
    work = tmp_path / "work"
    work.mkdir()
    package = installed_from(bin_dir, work)
    assert package.is_relative_to(tmp_path / "venv"), package
    assert (package / "conf" / "config.yaml").is_file()

    ok(sh(bin_dir / "rlsync", *FAST, "wandb.mode=disabled", cwd=work))
    run_dir = next((work / "outputs" / "runs").iterdir())
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    assert not (run_dir / "rlsync.log").exists()  # Hydra's job log only when something is logged
    ok(sh(bin_dir / "rlsync-bench", "bench.warmup=1", "bench.repeats=2", "wandb.mode=disabled", cwd=work))
    assert (next((work / "outputs" / "bench").iterdir()) / "summary.json").is_file()
    ok(sh(bin_dir / "rlsync-report", run_dir, "--no-wandb", cwd=work))
    assert (run_dir / "report.md").is_file()
    assert_help_and_completion(bin_dir, work)

    # an install without its configs says so, and is not taken for a bad command line (exit 2)
    for config in (package / "conf").glob("*.yaml"):
        config.rename(config.with_suffix(".moved"))
    proc = sh(bin_dir / "rlsync", cwd=work)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.startswith("rlsync: installation error:") and str(package / "conf") in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_editable_install_finds_its_configs_and_completes(tmp_path):
    src = source_copy(tmp_path / "src")
    bin_dir = venv(tmp_path / "venv", "-e", str(src))
    work = tmp_path / "work"
    work.mkdir()
    assert installed_from(bin_dir, work) == src / "rlsync"
    assert_help_and_completion(bin_dir, work)
