"""The run's CPU threads: the cores free at start (a busy machine is not oversubscribed), recorded with
the machine's load; a wide spread or a busy machine said beside the numbers."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CPU, FAST, run_main

from rlsync.measure import threads
from rlsync.record.summary import noise_warning


@pytest.mark.parametrize(("busy", "expected"), [(0.0, 4), (0.4, 4), (1.2, 3), (2.6, 1), (9.0, 1)])
def test_auto_takes_the_cores_other_processes_leave_free(monkeypatch, busy, expected):
    monkeypatch.setattr(threads, "machine_threads", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(threads.CpuLoad, "sample", classmethod(lambda cls, seconds=0.3: busy))
    count, why, others = threads.choose_threads(None, CPU)
    assert count == expected and others == busy and why.startswith("4 cores, ")


def test_a_set_count_and_a_device_run_are_not_sampled(monkeypatch):
    monkeypatch.setattr(threads.CpuLoad, "sample", classmethod(lambda cls, seconds=0.3: pytest.fail("sampled")))
    assert threads.choose_threads(3, CPU) == (3, "run.cpu_threads", None)
    count, why, _ = threads.choose_threads(None, torch.device("cuda"))
    assert count == torch.get_num_threads() and "device" in why


def test_data_parallel_ranks_split_the_cores(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(threads, "machine_threads", lambda: 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    cpu = threads.RunCpu(None, CPU)
    assert cpu.threads == 4 and cpu.why == "8 cores shared by 2 ranks"


def test_the_load_of_other_processes_is_measured_without_this_ones(monkeypatch):
    # over 2 s of wall time the machine's cores were busy 5 s, 3 of them this process's own: others kept 1 core
    clock = {"wall": 100.0, "busy": 40.0, "own": 7.0}
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(threads, "_busy_seconds", lambda: clock["busy"])
    monkeypatch.setattr(threads, "_own_seconds", lambda: clock["own"])
    load = threads.CpuLoad().start()
    clock.update(wall=102.0, busy=45.0, own=10.0)
    assert load.others() == pytest.approx(1.0)
    clock.update(own=16.0)  # more than the machine's own count (clocks read apart): never below zero
    assert load.others() == 0.0


def test_this_process_cpu_time_is_counted_as_its_own():
    before = threads._own_seconds()
    x = torch.randn(256, 256)
    for _ in range(200):  # this process busy: what CpuLoad takes out of the machine's count
        x = x @ x / 256
    assert threads._own_seconds() > before


@pytest.mark.parametrize(("others", "warned"), [(None, False), (0.2, False), (0.8, True), (1.9, True)])
def test_a_busy_machine_is_said_beside_the_numbers(others, warned):
    line = threads.load_warning(others, 2, "during the run")
    assert (line is not None) == warned
    if warned:
        assert line.startswith(f"the machine was busy during the run: other processes kept {others:.1f} of its 2 cores")


def test_a_wide_spread_says_the_numbers_may_be_noise():
    tight = {"perf/step_time": {"median": 0.45, "min": 0.41, "max": 0.55}}
    wide = {"perf/step_time": {"median": 0.45, "min": 0.29, "max": 14.4}}
    assert noise_warning(tight) is None
    assert noise_warning(wide).startswith("the measured steps spread from 0.29 to 14.40 s around a median of 0.45 s")


def test_a_run_records_its_threads_and_the_load(tmp_path):
    before = torch.get_num_threads()
    result = run_main(*FAST, "run.cpu_threads=1", "wandb.mode=disabled", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    cpu = json.loads((tmp_path / "summary.json").read_text())["cpu"]
    assert cpu["threads"] == 1 and cpu["why"] == "run.cpu_threads" and cpu["cores"] >= 1
    assert cpu["others_busy_cores_during_run"] is None or cpu["others_busy_cores_during_run"] >= 0
    assert torch.get_num_threads() == before  # the run's count for the run only: the process gets its own back


def test_a_data_parallel_rank_tries_copies_on_its_share_of_the_cores(monkeypatch):
    """2 ranks on a 4-core machine: each rank's copy probes try at most 2 threads (on every core, a rank's copy
    oversubscribed them beside the other rank's collective threads: 0.6B's update 1.53 s against 1.04 s)."""
    monkeypatch.setattr(threads, "machine_threads", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with threads.cpu_threads(4, torch.device("cpu")):
        assert threads.thread_candidates() == [1, 2]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with threads.cpu_threads(2, torch.device("cpu")):
        assert threads.thread_candidates() == [1, 2, 4]
