"""The data-parallel pieces that run in this process: the ranks' metrics merged, whole prompt groups, the
gather's bucket order (update/gather.py) on a fake gather, the checks a launch's environment triggers before any
group is joined, and what trainer.parallel's and update.transport's classes declare (a mode or a transport is
one module and one registry line). The launches themselves: tests/process/test_data_parallel.py.
"""

import pytest
import torch
from conftest import run_main


def test_merge_takes_the_slowest_rank_and_weights_token_means():
    from rlsync.trainer.data_parallel import merge_ranks

    rank0 = {
        "perf/step_time": 1.0,
        "perf/rollout_time": 0.5,
        "perf/update_weights_limit_time": 0.01,
        "train/loss": 0.25,
        "train/grad_norm": 3.0,
        "train/logprob_abs_diff": 0.1,
        "perf/sleep_bytes": 100,
        "perf/device_mem_after_sleep_gb": 1.0,
    }
    rank1 = {
        "perf/step_time": 1.5,
        "train/loss": 0.5,
        "train/grad_norm": 3.0,
        "train/logprob_abs_diff": 0.4,
        "perf/sleep_bytes": 100,
        "perf/device_mem_after_sleep_gb": 2.0,
    }
    merged = merge_ranks([rank0, rank1], [30, 10])
    assert merged["perf/step_time"] == 1.5  # the step waits for its slowest rank
    assert (merged["perf/step_time_rank_min"], merged["perf/step_time_rank_max"]) == (1.0, 1.5)
    assert merged["perf/rollout_time"] == 0.5 and "perf/rollout_time_rank_min" not in merged  # rank 0 alone
    assert "perf/update_weights_limit_time_rank_min" not in merged  # a floor, not a phase
    assert merged["train/loss"] == 0.75  # each rank's part of the batch's token mean
    assert merged["train/logprob_abs_diff"] == pytest.approx((0.1 * 30 + 0.4 * 10) / 40)
    assert merged["train/grad_norm"] == 3.0 and merged["perf/sleep_bytes"] == 100  # shared, per rank
    assert merged["perf/device_mem_after_sleep_gb"] == 2.0
    # one engine per rank: the rollout's averages over every rank's answers (rank 0 generated 6, rank 1 2)
    merged = merge_ranks([{"rollout/reward_mean": 0.5}, {"rollout/reward_mean": 0.1}], [30, 10], [6, 2])
    assert merged["rollout/reward_mean"] == pytest.approx((0.5 * 6 + 0.1 * 2) / 8)
    assert merge_ranks([{"rollout/reward_mean": 0.5}, {}], [30, 10], [8, 0])["rollout/reward_mean"] == 0.5  # rank0


def test_shares_are_whole_groups():
    from rlsync.trainer.data_parallel import DataParallel, split_evenly

    assert split_evenly(3, 2) == [2, 1] and split_evenly(8, 4) == [2, 2, 2, 2] and split_evenly(2, 2) == [1, 1]
    assert [DataParallel(rank, 2).share(3) for rank in (0, 1)] == [slice(0, 2), slice(2, 3)]  # one engine per rank


def sharded(mode: str):
    """ShardedWeights over 3 buckets of the tiny plan, with a fake gather that logs what it gathers."""
    from rlsync.model.architecture import params_layout
    from rlsync.update.buckets import metas_of, plan_buckets
    from rlsync.update.gather import ShardedWeights

    params = {f"w{i}": torch.full((4,), float(i)) for i in range(6)}
    buckets = plan_buckets(metas_of(params, torch.bfloat16), bucket_bytes=16)  # two bf16 tensors per bucket
    log: list[str] = []

    def gather(shards):
        log.extend(next(n for n, p in params.items() if p is t) for t in shards)
        return [t.clone() for t in shards]

    plan = params_layout(params, "checkpoint")
    weights = ShardedWeights(
        params, layout="checkpoint", plan=plan, buckets=buckets, gather=gather, mode=mode, device=torch.device("cpu")
    )
    return weights, log, buckets


def test_the_gather_goes_bucket_by_bucket_in_plan_order():
    from rlsync.update import full_weights

    weights, log, buckets = sharded("per_bucket")
    assert list(weights) == [f"w{i}" for i in range(6)] and log == []  # names alone gather nothing
    assert torch.equal(weights["w1"], torch.full((4,), 1.0)) and log == ["w0", "w1"]  # the whole bucket at once
    weights.before(buckets[2])  # a transport's call before packing bucket 2: bucket 1 first, in order
    assert log == ["w0", "w1", "w2", "w3", "w4", "w5"] and set(weights.held) == {"w4", "w5"}
    assert weights.peak_bytes == 2 * 16  # per_bucket holds one bucket's full tensors (fp32)
    with pytest.raises(RuntimeError, match="read after unit 2"):
        weights["w0"]  # another rank's collectives would come in another order: refused, not hung
    assert [n for n, _ in full_weights(weights).items()] == list(weights) and len(log) == 12  # a second pass
    assert [r["bytes"] for r in weights.rows] == [32] * 6 and weights.metrics()[
        "perf/update_weights_gather_bytes"
    ] == 192

    weights, log, _ = sharded("all_at_once")
    weights["w4"]
    assert len(log) == 6 and weights.peak_bytes == 6 * 16  # the whole model held at once
    weights["w0"]  # everything is held: any order
    weights, log, buckets = sharded("per_tensor")
    weights.before(buckets[1])  # per_tensor: nothing before the pack, each tensor as it is read
    assert log == [] and [weights[f"w{i}"][0].item() for i in range(6)] == list(range(6)) and weights.peak_bytes == 16
    weights, log, _ = sharded("per_bucket")
    weights.drain()  # a rank without an engine: the same gathers, none kept
    assert log == [f"w{i}" for i in range(6)] and weights.held == {}


def test_a_single_process_has_no_process_group():
    import torch.distributed as dist

    from rlsync.trainer.data_parallel import DataParallel

    dp = DataParallel.from_env()
    assert not dp.enabled and dp.is_main
    dp.start(torch.device("cpu"), timeout_s=1)
    metrics = {"perf/step_time": 1.0}
    assert dp.gather_metrics(metrics, tokens=3) is metrics and not dist.is_initialized()


@pytest.mark.parametrize(
    "rank, override, key",
    [
        ("0", "rollout.prompts_per_step=1", "rollout.prompts_per_step"),
        ("1", "update.transport=broadcast", "update.transport"),
        ("0", "trainer.parallel=none", "trainer.parallel"),
        ("1", "trainer.parallel=fsdp2 rollout.prompts_per_step=3", "rollout.prompts_per_step"),
        ("0", "trainer.parallel=fsdp2 update.source=host", "update.source"),
    ],
)
def test_what_two_ranks_cannot_run_is_a_config_error(tmp_path, rank, override, key):
    cwd, run_dir = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    # the launcher's environment alone: the check comes before any process group is joined
    proc = run_main(
        *override.split(),
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
        cwd=cwd,
        WORLD_SIZE="2",
        RANK=rank,
        LOCAL_RANK=rank,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    who = "" if rank == "0" else f"rank {rank}: "  # every rank prints its line; ranks > 0 say which they are
    assert proc.stderr.strip().splitlines()[-1].startswith(f"rlsync: {who}config error: {key}=")
    assert list(cwd.iterdir()) == []  # no rank writes where it was started
    assert (run_dir / "error.log").exists() == (rank == "0")  # rank 0 logs in its run dir; rank 1 writes nothing


def test_a_sweep_under_a_data_parallel_launch_is_refused():
    proc = run_main("-m", "run.seed=1,2", "wandb.mode=disabled", WORLD_SIZE="2", RANK="0")
    assert proc.returncode == 2 and "a sweep (-m) cannot run under a data-parallel launch" in proc.stderr


def test_the_framework_schemes_train_as_their_frameworks_do():
    from conftest import compose_app

    got = {s: compose_app("config", f"scheme={s}") for s in ("verl", "trl", "nemo_rl", "miles")}
    assert {s: (c.trainer.parallel, c.rollout.placement, c.update.gather) for s, c in got.items()} == {
        "verl": ("fsdp2", "every_rank", "per_tensor"),  # fsdp_workers.py: full_tensor() per parameter
        "trl": ("fsdp2", "every_rank", "per_tensor"),
        "nemo_rl": ("fsdp2", "every_rank", "per_tensor"),
        "miles": ("ddp", "every_rank", "per_bucket"),  # Megatron's replicas; the gather does not apply
    }


def test_the_cost_model_has_a_gather_term_and_per_rank_state():
    from rlsync.plan.cost import gather_seconds, per_rank_state_bytes

    assert gather_seconds(8_000_000_000, 1, 100.0) == 0.0  # one rank holds the whole model
    assert gather_seconds(8_000_000_000, 2, 100.0) == pytest.approx(0.04)  # half the bytes arrive, at 100 GB/s
    assert gather_seconds(8_000_000_000, 8, 100.0) == pytest.approx(0.07)  # 7/8 of them
    assert per_rank_state_bytes(10, 4, "fsdp2") == 3 and per_rank_state_bytes(10, 4, "ddp") == 10


# ----------------------------------------------------------------------------------------------
# What a mode or a transport declares on its class, read where a name was tested before (issue 44)
# ----------------------------------------------------------------------------------------------


def two_ranks_launched(monkeypatch) -> None:
    """This process as rank 0 of a two-rank launch, for the checks that read the launch's environment."""
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def toy_modes(monkeypatch):
    """Two trainer.parallel modes registered from this file alone: `toy_shards`, which declares what fsdp2
    declares (a sharded state over the ranks), and `toy_single`, a one-process mode under another name."""
    from rlsync.trainer.parallel import PARALLELS, Parallel

    class ToyShards(Parallel):
        spans_ranks = sharded = True

    class ToySingle(Parallel):
        pass

    monkeypatch.setitem(PARALLELS, "toy_shards", ToyShards)
    monkeypatch.setitem(PARALLELS, "toy_single", ToySingle)


def test_a_mode_that_declares_a_sharded_state_is_treated_as_fsdp2_is(compose, monkeypatch, toy_modes):
    from rlsync.check.estimate import Ranks, rank_estimate
    from rlsync.config.validate import validate
    from rlsync.errors import ConfigError
    from rlsync.plan.cost import per_rank_state_bytes
    from rlsync.trainer.parallel import parallels_with

    assert per_rank_state_bytes(10, 4, "toy_shards") == 3 and per_rank_state_bytes(10, 4, "toy_single") == 10
    assert parallels_with(spans_ranks=True, sharded=True) == ("fsdp2", "toy_shards")
    # each rank's memory, part by part, as under fsdp2
    parts = {
        mode: rank_estimate(
            compose(f"trainer.parallel={mode}"), cuda=False, runtime_bytes=0, ranks=Ranks(2, 2), rank=1
        ).process
        for mode in ("fsdp2", "toy_shards", "ddp")
    }
    assert parts["toy_shards"] == parts["fsdp2"] != parts["ddp"]
    two_ranks_launched(monkeypatch)
    with pytest.raises(ConfigError, match=r"^update.source=host: not allowed with trainer.parallel=toy_shards"):
        validate(compose("trainer.parallel=toy_shards", "update.source=host"))
    with pytest.raises(
        ConfigError, match=r"^trainer.parallel=toy_single: not allowed \(allowed: ddp, fsdp2, toy_shards"
    ):
        validate(compose("trainer.parallel=toy_single"))


@pytest.fixture
def toy_transports(monkeypatch):
    """Transports registered from this file alone, each declaring one fact a built-in one declares."""
    from rlsync.update.base import TRANSPORTS, Transport

    def toy(**facts):
        return type("Toy", (Transport,), {"send_weights": lambda self, w: None, "close": lambda self: None, **facts})

    monkeypatch.setitem(TRANSPORTS, "toy_joins", toy(joins_address=True, engine_in_process=False))
    monkeypatch.setitem(TRANSPORTS, "toy_ranks", toy(data_parallel=True))
    monkeypatch.setitem(TRANSPORTS, "toy_planned", toy(calibrated=True))


def test_a_transport_is_accepted_by_what_its_class_declares(compose, monkeypatch, toy_transports):
    from rlsync.config.apps import calibrated_transports
    from rlsync.config.validate import check_data_parallel
    from rlsync.errors import ConfigError

    joined = compose("update.transport=toy_joins", "update.engine_address=127.0.0.1:29610")
    joined.update.check(joined)  # joins a standalone engine, as broadcast does
    refused = compose("update.transport=direct", "update.engine_address=127.0.0.1:29610")
    with pytest.raises(ConfigError, match=r"\(allowed: broadcast, toy_joins \("):
        refused.update.check(refused)
    assert calibrated_transports() == ("direct", "ipc", "toy_planned")
    two_ranks_launched(monkeypatch)
    check_data_parallel(compose("update.transport=toy_ranks"))
    with pytest.raises(ConfigError, match=r"^update.transport=toy_joins: not supported with 2 data-parallel ranks"):
        check_data_parallel(compose("update.transport=toy_joins"))
