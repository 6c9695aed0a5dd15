"""`python -m rlsync.bench bench.target=stall` with real processes: a MoE model's bench runs; a bench whose
requests fail fails and says why; a SIGTERM while the engines start ends with its line, 143 and a summary,
the engine and its directory gone; a bench killed outright takes its engine with it; an engine that cannot
start names its own reason; under `ulimit -n 20` the bench refuses with its engines' reason before it starts
any. In-process twins: tests/unit/test_bench_pause.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, cli_env, run_cli

from rlsync.bench import stall
from rlsync.errors import CONF_DIR

QUICK = ["bench.target=stall", "bench.repeats=1", "bench.warmup=0", "wandb.mode=disabled", "run.progress=false"]


# ----------------------------------------------------------------------------------------------
# Real processes: an engine that cannot start, a MoE model, signals
# ----------------------------------------------------------------------------------------------


def engines_of(marker: str) -> list[int]:
    """Live processes whose command line holds `marker` (the bench's engines: their hydra.run.dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = next(ln for ln in (entry / "status").read_text().splitlines() if ln.startswith("State:"))
            except (OSError, StopIteration):
                continue
            if marker in cmdline and "rlsync.serve" in cmdline and "zombie" not in state:
                found.append(int(entry.name))
    return found


def wait_until(done, timeout_s: float = 600) -> bool:
    """Poll `done()` until it holds (a generous bound: this asserts what happens, not how fast)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")
def test_an_engine_that_cannot_start_names_its_reason_and_leaves_nothing(tmp_path, monkeypatch):
    """U14: its own line, not a line of its traceback; U21b: no engine and no directory left."""
    cfg_overrides = ["run.device=cuda:7"]  # the engine refuses it (no such device) after the bench accepted cpu
    monkeypatch.setattr(stall, "engine_overrides", lambda cfg, policy: cfg_overrides)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(stall.EngineDidNotStart) as caught:
        stall.EngineServe(object(), "pause")
    line = str(caught.value)
    assert line.startswith(
        "the engine for serve.update_policy=pause (python -m rlsync.serve) did not start: config error: run.device=cuda:7"
    ), line
    assert "exit code 2" in line, line
    assert not list(tmp_path.glob("rlsync-stall-*")) and not engines_of(str(tmp_path))


def small_moe(folder: Path) -> Path:
    """The tiny_moe preset's config.json at 2 layers of 8 experts (2 per token): the same architecture and
    per-expert checkpoint layout (69 tensors, not 3,219), so the bench's two engines start and update in seconds."""
    config = json.loads((CONF_DIR / "model" / "hf" / "tiny_moe.json").read_text())
    config.update(num_hidden_layers=2, max_window_layers=2, num_experts=8, num_experts_per_tok=2)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.slow
def test_a_moe_model_is_benched_and_the_ratio_names_its_figures(tmp_path):
    """Q24: the standalone engine takes the update in its checkpoint layout (per-expert names)."""
    moe = f"model.config={small_moe(tmp_path / 'moe')}"
    done = run_cli(
        *QUICK, "model=tiny_moe", moe, f"hydra.run.dir={tmp_path / 'run'}", module="rlsync.bench", timeout=900
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stage / pause, longest gap: " in done.stdout and "(the medians above" in done.stdout, done.stdout
    assert "| stage | local copy |" in done.stdout, done.stdout  # its experts are views: copied, and said so
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["measured_steps"] == 1
    # per layer 9 tensors (q, k, v, o, two norms and the router) and 3 per expert; the embedding, norm and lm_head
    assert summary["model"]["name"] == "tiny_moe" and summary["model"]["tensors"] == 2 * (9 + 8 * 3) + 3, summary
    verified = sum(summary["metrics"][f"pause/{p}/answers_verified_total"]["max"] for p in ("pause", "stage"))
    # every answer checked came from the new weights (a miss fails the bench); on a busy machine none may start
    assert ("Verified: " if verified else "Not verified: no answer started") in done.stdout, done.stdout


@pytest.mark.slow
def test_a_bench_whose_requests_fail_fails_and_says_why(tmp_path):
    """Q19/Q20: thousands of failed requests, a "Verified" line and exit 0. Here every request is refused
    (an answer longer than the engine's serve.max_generate_tokens)."""
    refuse = 'bench.engine_overrides=["serve.max_generate_tokens=2"]'
    done = run_cli(*QUICK, refuse, "bench.policies=[pause]", f"hydra.run.dir={tmp_path}", module="rlsync.bench")
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("rlsync:")]
    assert done.returncode == 1 and "Verified" not in done.stdout, (done.stdout, done.stderr[-2000:])
    assert " streaming requests to the pause engine failed in repeat 1 (" in lines[-1], lines
    assert "max_generate_tokens" in lines[-1], lines
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def start_bench(run_dir: Path, tmp: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rlsync.bench", *QUICK, *args, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=cli_env(TMPDIR=str(tmp)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")
def test_sigterm_while_the_engines_start_ends_with_its_line_and_takes_the_engine_down(tmp_path):
    """G10 and U21b: 143, the line, summary.json; no engine and no rlsync-stall-* directory left."""
    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    bench = start_bench(run_dir, tmp)
    try:
        assert wait_until(lambda: engines_of(str(tmp)) or bench.poll() is not None), "no engine started"
        assert bench.poll() is None, bench.communicate()
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=300)
    finally:
        if bench.poll() is None:
            bench.kill()
    lines = [ln for ln in err.splitlines() if ln.startswith("rlsync:")]
    assert bench.returncode == 143, err[-2000:]
    assert lines[-1].startswith("rlsync: interrupted: stopped by SIGTERM; 0 finished step(s) kept in"), err[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert not engines_of(str(tmp)) and not list(tmp.glob("rlsync-stall-*"))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")
def test_a_bench_killed_outright_takes_its_engine_with_it(tmp_path):
    """U21b: even a SIGKILLed bench leaves no engine serving (PR_SET_PDEATHSIG)."""
    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    bench = start_bench(run_dir, tmp, "bench.policies=[pause]")
    try:
        assert wait_until(lambda: engines_of(str(tmp)) or bench.poll() is not None), "no engine started"
        engines = engines_of(str(tmp))
        bench.kill()
        bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
    # gone, or a zombie its new parent has not reaped yet (engines_of leaves those out): nothing serves
    assert engines and wait_until(lambda: not engines_of(str(tmp)), timeout_s=120), engines_of(str(tmp))


def test_under_an_open_file_limit_its_engines_refuse_the_bench_says_their_reason_before_starting_one(tmp_path):
    """U14: `ulimit -n 20; python -m rlsync.bench bench.target=pause ...` ended `rlsync: failed: RuntimeError: the
    pause engine did not start: check_open_files(cfg.update)`. Now: exit 2, one line, the engines' own reason."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "rlsync.bench", *QUICK, f"hydra.run.dir={run_dir}"]
    done = subprocess.run(
        ["bash", "-c", 'ulimit -n 20 && exec "$@"', "bash", *command],
        cwd=ROOT,
        env=cli_env(TMPDIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith(
        "rlsync: config error: bench.target=stall: its engines (python -m rlsync.serve, update.transport=broadcast) "
        "would not start: each needs more open files than this shell allows (ulimit -n 20, hard limit 20)"
    ), lines[0]
    assert not (run_dir / "metrics.jsonl").exists() and not list(tmp_path.glob("rlsync-stall-*"))
