"""The `ipc` and `broadcast` transports, each with its engine in a process of its own (slow).

Bit-exact engine weights after updates for every transport x strategy x source, with buckets smaller than the
largest tensor; generation through the engine process equal to in-process generation; the staging accounting;
checksums computed in the engine process; a dead engine raising a clear error within seconds; the default
process group left alone; the whole step through the CLI's entry point (in this process); and a real
`python -m rlsync` whose ipc engine is killed mid-run. `direct` is tests/unit/test_transports.py's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import (
    BF16,
    CPU,
    FAST,
    ROOT,
    SMALL_BUCKET_MB,
    Trainer,
    assert_engine_holds,
    cli_env,
    read_jsonl,
    run_main,
)

from rlsync.config.schema import UpdateConfig
from rlsync.engines.process import EngineDied
from rlsync.update import WeightMismatch, checksum, close_update, timed_update

# Process engines cost a start each (the first about 7 s of imports, then about 1 s from the
# forkserver), so each configuration is opened once per module and serves both sources.
PROCESS_CASES = [
    pytest.param("ipc", "bucketed", 2, False, id="ipc-bucketed-inflight2"),
    pytest.param("ipc", "per_tensor", 1, False, id="ipc-per_tensor"),
    pytest.param("ipc", "bucketed", 1, True, id="ipc-bucketed-flat"),
    pytest.param("broadcast", "bucketed", 1, False, id="broadcast-bucketed"),
    pytest.param("broadcast", "per_tensor", 2, False, id="broadcast-per_tensor-inflight2"),
    pytest.param("broadcast", "bucketed", 2, True, id="broadcast-bucketed-flat-inflight2"),
]


@pytest.mark.parametrize("name,strategy,inflight,flat", PROCESS_CASES)
def test_process_engine_is_bit_exact_for_both_sources(name, strategy, inflight, flat):
    trainer = Trainer()
    update = UpdateConfig(
        transport=name,
        strategy=strategy,
        inflight_buckets=inflight,
        flat_engine_weights=flat,
        bucket_mb=SMALL_BUCKET_MB,
        verify=True,
        engine_timeout_s=120,
    )
    engine, transport, buckets = trainer.open(update)
    largest_tensor = max(t.numel() * 2 for t in trainer.weights.values())
    assert max(b.nbytes for b in buckets) == largest_tensor > SMALL_BUCKET_MB * 2**20  # one tensor alone, oversized
    try:
        for source in ("device", "host", "device"):
            sent = trainer.source(source)
            metrics = timed_update(transport, sent, buckets=buckets, cfg=update, device=CPU, floor_time=1e-3)
            assert_engine_holds(engine, sent)
            for key in ("pack", "transfer", "load"):
                assert metrics[f"perf/update_weights_{key}_time"] >= 0
            rows = transport.last_update_buckets
            assert len(rows) == (len(buckets) if strategy == "bucketed" else len(trainer.weights))
            assert sum(r["bytes"] for r in rows) == metrics["perf/update_weights_bytes"]

        # The staging memory the bucket size costs, counted once per buffer on either side.
        slot = max(b.nbytes for b in buckets)  # == the largest tensor here, so per_tensor's slot too
        expected = {
            ("ipc", False): inflight * slot,
            ("ipc", True): 0,
            ("broadcast", False): 2 * inflight * slot,
            ("broadcast", True): inflight * slot,
        }
        assert metrics["perf/update_weights_peak_bytes"] == expected[name, flat and strategy == "bucketed"]
    finally:
        close_update(engine, transport)
    assert not engine.is_alive()
    assert not dist.is_initialized()


def test_ipc_generates_what_the_in_process_engine_generates():
    """Same weights, same sampler state: same tokens and log-probs, and the sampler advances the same."""
    trainer = Trainer()
    weights = trainer.source("device")
    opened = {}  # transport name -> (engine, transport)
    try:
        for name in ("direct", "ipc"):
            update = UpdateConfig(transport=name)
            engine, transport, buckets = trainer.tiny.open(update, weights, spec=trainer.spec)
            opened[name] = engine, transport
            timed_update(transport, weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
        prompts = [[256, *b"12+7="], [256, *b"3*4=?"], [256, 65]]
        outs, states = {}, {}
        for name, (engine, _) in opened.items():
            engine.resume()
            sampler = torch.Generator().manual_seed(11)
            outs[name] = engine.generate(prompts, max_new_tokens=6, temperature=1.0, generator=sampler)
            engine.release()
            states[name] = sampler.get_state()
        for field in ("sequences", "attention_mask", "response_mask", "logprobs", "truncated"):
            assert torch.equal(getattr(outs["direct"], field), getattr(outs["ipc"], field)), field
        assert torch.equal(states["direct"], states["ipc"])
    finally:
        for engine, transport in opened.values():
            close_update(engine, transport)


def test_verify_in_the_engine_process_names_the_tensor():
    trainer = Trainer()
    update = UpdateConfig(transport="ipc", verify=True)
    engine, transport, buckets = trainer.open(update)
    try:
        timed_update(transport, trainer.weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
        sums = engine.checksums()  # computed in the engine process
        assert sums == {n: checksum(t.to(BF16)) for n, t in trainer.weights.items()}
        with torch.no_grad():
            trainer.weights["model.norm.weight"].add_(1.0)  # the trainer moves on, the engine does not hear of it
        from rlsync.update import verify

        with pytest.raises(WeightMismatch, match="model.norm.weight"):
            verify(trainer.weights, engine.checksums(), BF16)
    finally:
        close_update(engine, transport)


def kill_after(pid: int, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, args=(pid, signal.SIGKILL))
    timer.start()
    return timer


@pytest.mark.parametrize("name", ["ipc", "broadcast"])
def test_a_dead_engine_is_a_clear_error_within_seconds(name):
    """Killed while the trainer waits on it (a long generation): EngineDied naming the exit code, fast;
    then close() still leaves no process and no process group behind."""
    trainer = Trainer()
    update = UpdateConfig(transport=name, bucket_mb=SMALL_BUCKET_MB)
    engine, transport, buckets = trainer.open(update)
    try:
        timed_update(transport, trainer.weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
        kill_after(engine.pid, 0.5)
        start = time.monotonic()
        with pytest.raises(EngineDied, match=r"exit code -9 \(killed by SIGKILL\)"):
            engine.generate([[256, 65]] * 8, max_new_tokens=100_000, temperature=1.0, generator=torch.Generator())
        assert time.monotonic() - start < 5.0
        with pytest.raises(EngineDied, match="exit code -9"):  # and every later call says the same at once
            timed_update(transport, trainer.weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
    finally:
        close_update(engine, transport)
    assert not engine.is_alive()
    assert not dist.is_initialized()


def test_a_broadcast_engine_killed_mid_update_does_not_hang_the_trainer():
    """The hardest wait: the trainer inside a collective whose peer is gone."""
    trainer = Trainer()
    update = UpdateConfig(transport="broadcast", bucket_mb=SMALL_BUCKET_MB, engine_timeout_s=120)
    engine, transport, buckets = trainer.open(update)
    os.kill(engine.pid, signal.SIGSTOP)  # frozen: the trainer's broadcasts cannot complete
    kill_after(engine.pid, 0.5)
    start = time.monotonic()
    try:
        with pytest.raises(
            EngineDied, match=r"exit code -9 \(killed by SIGKILL\) while the trainer waited for a weight"
        ):
            timed_update(transport, trainer.weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
        assert time.monotonic() - start < 5.0
    finally:
        close_update(engine, transport)
    assert not dist.is_initialized()


def test_broadcast_leaves_the_default_process_group_alone():
    """A data-parallel trainer owns torch.distributed's default group; the engine's group is its own."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = Trainer()
        update = UpdateConfig(transport="broadcast", bucket_mb=SMALL_BUCKET_MB)
        engine, transport, buckets = trainer.open(update)
        try:
            timed_update(transport, trainer.weights, buckets=buckets, cfg=update, device=CPU, floor_time=1.0)
            assert_engine_holds(engine, trainer.weights)
        finally:
            close_update(engine, transport)
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# The whole step through the CLI
# ----------------------------------------------------------------------------------------------


def test_whole_step_runs_with_broadcast(tmp_path):
    run_dir = tmp_path / "run"
    fast = [o for o in FAST if not o.startswith(("run.steps=", "run.warmup_steps="))] + [
        "run.steps=1",
        "run.warmup_steps=0",
    ]
    proc = run_main(
        *fast,
        "update.transport=broadcast",
        "update.verify=true",
        f"update.bucket_mb={SMALL_BUCKET_MB}",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["setup"]["transport"] == "broadcast"
    # the engine's own peak resident set, as its close answered (not the trainer's, nor the forkserver's)
    assert 50 * 2**20 < summary["memory"]["measured"]["engine_peak_rss_bytes"] < 2**30, summary["memory"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 1
    for row in rows:  # the engine scored its samples with the weights the trainer just sent (bf16 vs fp32)
        assert 0 <= row["train/logprob_abs_diff"] < 0.01
        assert row["perf/update_weights_peak_bytes"] > 0 and row["perf/update_weights_transfer_time"] > 0


def engine_pid(parent: int, timeout: float = 60.0) -> int:
    """The engine process among `parent`'s descendants (forked by the forkserver, itself a child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in descendants(parent):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "forkserver" in cmd and descendants(pid) == [] and is_forked_child(pid):
                return pid
        time.sleep(0.2)
    raise AssertionError("no engine process appeared")


def descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            out += [child, *descendants(child)]
    return out


def is_forked_child(pid: int) -> bool:
    """A process the forkserver forked (its parent is the forkserver, not the trainer)."""
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        parent_cmd = Path(f"/proc/{ppid}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return False
    return b"forkserver" in parent_cmd


@pytest.mark.slow
def test_whole_step_runs_with_ipc_and_a_killed_engine_ends_it_clearly(tmp_path):
    """Steps run through the ipc engine; killing it mid-run fails the run within seconds with the engine's
    exit code, and metrics.jsonl and summary.json keep the steps that finished."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlsync",
            *[o for o in FAST if not o.startswith("run.steps=")],
            "run.steps=50",
            "update.transport=ipc",
            f"update.bucket_mb={SMALL_BUCKET_MB}",
            "update.inflight_buckets=2",
            "wandb.mode=disabled",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and (not metrics.exists() or len(read_jsonl(metrics)) < 1):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        pid = engine_pid(proc.pid)  # looked up once steps run: the engine is certainly up by then
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        assert time.monotonic() - killed < 15  # the error itself comes within POLL_S; the rest is the summary
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    assert "exit code -9 (killed by SIGKILL)" in stderr
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) >= 1
    for row in rows:
        assert 0 <= row["train/logprob_abs_diff"] < 0.01
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps_finished"] == len(rows)
    assert "EngineDied" in summary["error"]
