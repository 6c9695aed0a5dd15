"""The `scheme` config group: each framework's update knobs as a preset (rlsync/conf/scheme/), the
default `rlsync`, and the update's auto knobs (flat_engine_weights, copy_threads) resolved in one place.

Each preset is composed through the real Hydra config (runner and benchmark) and runs one benchmark
repeat on the tiny model, in this process (the ipc schemes' in tests/process/: they start their engine process).
"""

from __future__ import annotations

import pytest
from conftest import ROOT, check_scheme_bench, compose_app

from rlsync.config.derived import flat_engine_weights_choice
from rlsync.config.schema import RolloutConfig, UpdateConfig
from rlsync.update.auto import copy_threads_choice, resolve_update

SCHEMES = sorted(p.stem for p in (ROOT / "rlsync" / "conf" / "scheme").glob("*.yaml"))
FRAMEWORKS = {"miles", "verl", "trl", "nemo_rl", "checkpoint_engine"}
# the schemes whose transport starts an engine process run their benchmark in tests/process/test_schemes.py
IN_PROCESS = [
    s for s in SCHEMES if "  transport: direct" in (ROOT / "rlsync" / "conf" / "scheme" / f"{s}.yaml").read_text()
]


def test_every_framework_has_a_preset_and_each_cites_the_code_it_follows():
    assert set(SCHEMES) == FRAMEWORKS | {"rlsync"}
    for name in SCHEMES:
        text = (ROOT / "rlsync" / "conf" / "scheme" / f"{name}.yaml").read_text()
        assert text.startswith("# @package _global_"), name
        assert f"scheme: {name}" in text, name  # the label the reports group by
        assert ".py" in text, f"{name}: cite the file of the framework's code it follows"


@pytest.mark.parametrize("config_name", ["config", "bench"])
def test_the_default_scheme_is_rlsync_with_the_auto_knobs(config_name):
    cfg = compose_app(config_name)
    u = cfg.update
    assert (u.scheme, u.transport, u.strategy, u.bucket_mb) == ("rlsync", "direct", "bucketed", 512.0)
    assert u.flat_engine_weights is None and u.copy_threads is None  # auto, resolved by rlsync.update.auto


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_scheme_composes_and_command_line_update_keys_still_win(scheme):
    cfg = compose_app("bench", f"scheme={scheme}")
    assert cfg.update.scheme == scheme
    over = compose_app("config", f"scheme={scheme}", "update.bucket_mb=64", "update.inflight_buckets=1")
    assert (over.update.scheme, over.update.bucket_mb, over.update.inflight_buckets) == (scheme, 64.0, 1)


def test_an_experiment_preset_overrides_the_scheme():
    cfg = compose_app("bench", "scheme=verl", "experiment=transports")
    assert cfg.update.scheme == "verl" and cfg.update.bucket_mb == 512.0  # verl's is 2048; the study sets 512


def test_the_framework_schemes_knobs():
    got = {s: compose_app("bench", f"scheme={s}").update for s in FRAMEWORKS}
    assert (got["miles"].transport, got["miles"].source, got["miles"].bucket_mb) == ("ipc", "host", 512.0)
    assert (got["trl"].transport, got["trl"].strategy) == ("direct", "per_tensor")
    assert got["nemo_rl"].inflight_buckets == got["checkpoint_engine"].inflight_buckets == 2
    assert got["verl"].bucket_mb == 2048.0 and got["checkpoint_engine"].source == "host"
    assert all(u.flat_engine_weights is False for u in got.values())  # none of them loads in place


@pytest.mark.parametrize("scheme", IN_PROCESS)  # the others: tests/process/test_schemes.py
def test_each_scheme_runs_a_benchmark_repeat_on_the_tiny_model(scheme, tmp_path):
    check_scheme_bench(scheme, tmp_path)


@pytest.mark.parametrize(
    "engine, transport, strategy, level, want",
    [
        ("hf", "direct", "bucketed", 1, True),
        ("hf", "ipc", "bucketed", 1, True),
        ("hf", "broadcast", "bucketed", 1, True),
        ("hf", "direct", "bucketed", 2, True),  # the direct engine frees its flat buffers itself
        ("hf", "ipc", "bucketed", 2, False),  # shared memory the engine cannot free
        ("hf", "direct", "per_tensor", 1, False),
        ("vllm", "direct", "bucketed", 1, False),
        ("vllm", "ipc", "bucketed", 1, False),
    ],
)
def test_flat_engine_weights_auto_is_on_wherever_the_engine_can_hold_them(engine, transport, strategy, level, want):
    update = UpdateConfig(transport=transport, strategy=strategy)
    on, why = flat_engine_weights_choice(update, RolloutConfig(engine=engine, release_level=level))
    assert on is want and why.startswith("auto: " + ("on" if want else "off"))


@pytest.mark.parametrize("explicit", [True, False])
def test_an_explicit_flat_engine_weights_is_kept(explicit):
    on, why = flat_engine_weights_choice(UpdateConfig(flat_engine_weights=explicit), RolloutConfig())
    assert on is explicit and why == "set explicitly"


def test_copy_threads_auto_takes_the_probes_fastest_and_explicit_values_stay():
    assert copy_threads_choice(UpdateConfig(), probe_threads=2, probe_how="timed")[0] == 2
    assert copy_threads_choice(UpdateConfig(), probe_threads=0)[0] == 0  # not a CPU copy: torch's default
    assert copy_threads_choice(UpdateConfig(copy_threads=0), probe_threads=2) == (
        0,
        "set explicitly (0: torch's default)",
    )
    assert copy_threads_choice(UpdateConfig(copy_threads=3), probe_threads=1)[0] == 3
    resolved, why = resolve_update(UpdateConfig(), RolloutConfig(), probe_threads=2)
    assert (resolved.flat_engine_weights, resolved.copy_threads) == (True, 2)
    assert set(why) == {"flat_engine_weights", "flat_engine_weights_why", "copy_threads", "copy_threads_why"}


def test_copy_threads_rejects_a_negative_count(compose):
    from rlsync.config.validate import validate
    from rlsync.errors import ConfigError

    cfg = compose("update.copy_threads=-1")
    with pytest.raises(ConfigError, match="update.copy_threads"):
        validate(cfg)


def test_fastest_threads_times_the_updates_own_tensors_on_each_candidate():
    import torch

    from rlsync.update import plan_for
    from rlsync.update.auto import fastest_threads, thread_candidates

    weights = {f"w{i}": torch.randn(64, 64) for i in range(8)}
    buckets = plan_for(weights, UpdateConfig(bucket_mb=0.01), torch.bfloat16)
    threads, how = fastest_threads(weights, buckets, torch.device("cpu"), rounds=1)
    assert threads in thread_candidates() and "8 of the update" in how and "best of 1" in how
    assert fastest_threads(weights, buckets, torch.device("cuda")) == (0, "not a CPU copy")  # nothing runs on a device


def test_a_fewer_threads_win_is_timed_again_so_a_passing_disturbance_loses():
    from rlsync.update import auto

    def rounds(*timings):  # one {threads: seconds} per round, in order
        it = iter(timings)
        return lambda: next(it)

    pauses = []
    # the sizing sweep's 4B job: 2 threads disturbed at first (41 ms against 36), then 16 ms
    first = [{1: 0.036, 2: 0.041}] * 3
    later = [{1: 0.031, 2: 0.016}] * 3
    threads, how = auto.fastest_of(rounds(*first, *later), rounds=3, sleep=pauses.append)
    assert threads == 2 and "best of 6 over 2 timings" in how and "2 threads 16.0 ms" in how
    assert pauses == [auto.CONFIRM_PAUSE_S]
    # a lasting disturbance (a core held by another process) keeps winning: believed after CONFIRM retimings
    pauses.clear()
    busy = [{1: 0.030, 2: 0.070}] * (3 * (auto.CONFIRM + 1))
    threads, how = auto.fastest_of(rounds(*busy), rounds=3, sleep=pauses.append)
    assert threads == 1 and len(pauses) == auto.CONFIRM and f"over {auto.CONFIRM + 1} timings" in how
    # the most threads winning, or a sample too small for the choice to matter, is believed at once
    assert auto.fastest_of(rounds({1: 0.030, 2: 0.016}), rounds=1, sleep=pauses.append)[0] == 2
    assert auto.fastest_of(rounds({1: 0.001, 2: 0.004}), rounds=1, sleep=pauses.append) == (
        1,
        "fastest on 1 thread (best of 1: 1 thread 1.0 ms, 2 threads 4.0 ms; spread 0.0 ms, counted as at least 1 ms)",
    )
    assert len(pauses) == auto.CONFIRM  # no pause added by the last two
