"""The data-parallel trainer on the CPU: two real ranks over gloo.

The CLI under `accelerate launch` (two processes, rank 0 holding the engine), the same run in one
process for comparison, and two ranks started here around the trainer alone, whose gradients and
weights after one step must be the single process's on the same batch (all marked slow: real
processes). The checks a launch's environment triggers before any group is joined run in this process.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import FAST, ROOT, cli_env, read_jsonl, run_cli, run_main

DP_RUN = [*FAST, "trainer.lr=1e-3", "update.verify=true", "wandb.mode=disabled"]
RANK0_ONLY = ("perf/rollout_time", "perf/update_weights_time", "perf/engine_resume_time", "perf/engine_release_time")
EVERY_RANK = (
    "perf/step_time",
    "perf/batch_scatter_time",
    "perf/wake_up_time",
    "perf/log_probs_time",
    "perf/train_time",
    "perf/grad_allreduce_time",
    "perf/sleep_time",
)


def launcher_port() -> int:
    """A free port for the launcher's store that no other socket can be given before the launcher binds it.

    `--main_process_port 0` has accelerate pick a free port and release it before torchrun's agent binds it:
    meanwhile the kernel may hand that port to any socket bound to port 0 or connecting out (the other test
    worker's engines, stores and HTTP clients), and the launch fails with "address already in use". Ports
    below the kernel's ephemeral range are never handed out that way; each worker process takes its own."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    start = max(1024, low - 8192)
    taken = {29500, 29610}  # torchrun's and rlsync.serve's default ports, which a test may bind by name
    for i in range(low - start):
        port = start + (os.getpid() * 7 + i) % (low - start)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {start}-{low - 1}")


def accelerate_launch(*args: str, cwd, timeout: float = 300, script: str = "-m rlsync") -> subprocess.CompletedProcess:
    """`accelerate launch` of two ranks. On a CPU, --multi_gpu is its torchrun path (--cpu wants mpirun)."""
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(launcher_port()),
    ]
    return subprocess.run(
        [*launch, *script.split(), *args], cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One two-rank run: (process, rank 0's run dir, the launch's working directory)."""
    base = tmp_path_factory.mktemp("dp")
    run_dir, cwd = base / "run", base / "cwd"
    cwd.mkdir()
    proc = accelerate_launch(*DP_RUN, f"hydra.run.dir={run_dir}", cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc, run_dir, cwd


@pytest.mark.slow
def test_two_ranks_train_and_update_the_engine_bit_exact(two_ranks):
    proc, run_dir, cwd = two_ranks
    summary = json.loads((run_dir / "summary.json").read_text())
    # update.verify: every engine tensor equals rank 0's after each update, and every rank holds rank 0's weights
    assert summary["status"] == "finished" and summary["verification"] == "passed"
    assert summary["setup"]["ranks"] == 2
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]  # one row per step: rank 0's, merged
    assert max(r["train/logprob_abs_diff"] for r in rows) < 0.02  # the engine samples with the trained weights
    for row in rows:
        for key in EVERY_RANK:  # the slowest rank's time, the spread beside it
            assert row[key] == row[f"{key}_rank_max"] >= row[f"{key}_rank_min"] > 0, key
        for key in RANK0_ONLY:  # rank 0's phases: nothing to gather
            assert f"{key}_rank_max" not in row
    # one run dir, rank 0's; rank 1 wrote nothing, neither in the working directory nor a Hydra dir of its own
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", ".rlsync.lock", "metrics.jsonl", "summary.json"]
    assert list(cwd.iterdir()) == []
    assert proc.stdout.count("| model | weight update |") == 1  # one closing table: rank 0's


@pytest.mark.slow
def test_two_ranks_match_one_process_step_by_step(two_ranks, tmp_path):
    _, run_dir, _ = two_ranks
    # torchrun gives each rank one thread: the same here, so both runs sum in comparable orders
    single = run_cli(*DP_RUN, f"hydra.run.dir={tmp_path}", OMP_NUM_THREADS="1")
    assert single.returncode == 0, single.stderr[-3000:]
    one, two = read_jsonl(tmp_path / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl")
    for a, b in zip(one, two, strict=True):
        # the same batch every step: rank 0 samples it as one process does, from the weights both trained
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        assert a["rollout/response_len_mean"] == b["rollout/response_len_mean"]
        # the same gradient (before clipping) and loss: the ranks' token-weighted sum is the whole batch's mean
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4, abs=1e-6)
        assert b["train/logprob_abs_diff"] == pytest.approx(a["train/logprob_abs_diff"], rel=1e-3, abs=1e-6)


# ----------------------------------------------------------------------------------------------
# The trainer alone: two ranks against one process, on one fixed batch
# ----------------------------------------------------------------------------------------------

GROUPS, GROUP_SIZE, PROMPT_LEN, RESPONSE_LEN = 3, 2, 5, 6  # 3 groups over 2 ranks: 4 rows and 2 rows


def fixed_batch():
    """A batch with uneven answer lengths, so the ranks' shares hold different token counts."""
    from rlsync.engines.base import Generation
    from rlsync.trainer.grpo import group_advantages

    gen = torch.Generator().manual_seed(7)
    rows = GROUPS * GROUP_SIZE
    sequences = torch.randint(3, 256, (rows, PROMPT_LEN + RESPONSE_LEN), generator=gen)
    answer_lens = torch.tensor([6, 2, 5, 1, 3, 6])  # rank 0: 14 tokens, rank 1: 9
    response_mask = (torch.arange(RESPONSE_LEN) < answer_lens[:, None]).long()
    attention_mask = torch.cat([torch.ones(rows, PROMPT_LEN, dtype=torch.long), response_mask], dim=1)
    attention_mask[0, :2] = 0  # left padding in one prompt
    batch = Generation(
        sequences=sequences,
        attention_mask=attention_mask,
        response_mask=response_mask,
        logprobs=torch.zeros(rows, RESPONSE_LEN),
        prompt_len=PROMPT_LEN,
        truncated=answer_lens == 6,
    )
    rewards = torch.rand(rows, generator=gen)
    return batch, group_advantages(rewards, GROUP_SIZE)


def tiny_trainer(grad_sync=None):
    from rlsync.config.schema import ModelConfig, TrainerConfig
    from rlsync.model.build import build_model
    from rlsync.trainer.grpo import Trainer

    model = build_model(ModelConfig(), dtype=torch.float32, device=torch.device("cpu"), seed=3)
    # no clipping at this size: a wrongly scaled gradient must show, not be clipped to the same norm
    cfg = TrainerConfig(lr=1e-3, micro_batch_size=2, grad_clip=1e6)
    return Trainer(
        model,
        cfg,
        allowed_ids=torch.ones(ModelConfig().vocab_size, dtype=torch.bool),
        temperature=1.0,
        grad_sync=grad_sync,
    )


def one_step(trainer, batch, advantages, batch_tokens=None) -> dict:
    old_logp = trainer.log_probs(batch)
    metrics = trainer.train_step(batch, old_logp=old_logp, advantages=advantages, batch_tokens=batch_tokens)
    params = dict(trainer.model.named_parameters())
    return {
        "metrics": metrics,
        "tokens": float(batch.response_mask.sum()),
        "weights": {n: p.detach().clone() for n, p in params.items()},
        "grads": {n: p.grad.detach().clone() for n, p in params.items()},
    }


def rank_process(rank: int, port: int, out_dir: str) -> None:
    """One rank, as torchrun starts it: the environment (the store is the launcher's, as torchrun's agent
    hosts it), then rlsync.trainer.data_parallel's own calls."""
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    from rlsync.trainer.data_parallel import DataParallel

    dp = DataParallel.from_env()
    with dp:
        dp.start(torch.device("cpu"), timeout_s=120)
        trainer = tiny_trainer(grad_sync=dp.all_reduce_grads)
        if rank == 1:  # rank 0's weights must win: start rank 1 elsewhere
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.add_(1.0)
        dp.broadcast_weights(trainer.model)
        batch, advantages = fixed_batch() if dp.is_main else (None, None)
        share, share_advantages, batch_tokens = dp.scatter_groups(
            batch, advantages, group_size=GROUP_SIZE, device=torch.device("cpu")
        )
        result = one_step(trainer, share, share_advantages, batch_tokens)
        result["rows"] = share.sequences.shape[0]
        dp.check_same_weights(dict(trainer.model.named_parameters()))
    torch.save(result, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
def test_two_ranks_take_the_single_process_step(tmp_path):
    from datetime import timedelta

    from rlsync.sync.broadcast import listen_store
    from rlsync.trainer.data_parallel import merge_ranks

    # The launcher's store, listening before the ranks start and until they end: a port found free and
    # released for rank 0 to bind could be taken meanwhile (the other test worker's sockets), failing the launch.
    store = listen_store("127.0.0.1", timedelta(seconds=120))
    mp.start_processes(rank_process, args=(store.port, str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    del store
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.set_num_threads(1)
    batch, advantages = fixed_batch()
    single = one_step(tiny_trainer(), batch, advantages)

    assert [r["rows"] for r in ranks] == [4, 2] and [r["tokens"] for r in ranks] == [14.0, 9.0]  # whole groups
    for name, grad in single["grads"].items():
        for r in ranks:  # the all-reduced gradient is the whole batch's, on every rank
            torch.testing.assert_close(r["grads"][name], grad, rtol=1e-4, atol=1e-7)
    for name, weight in single["weights"].items():
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name])  # the ranks stay identical
        torch.testing.assert_close(ranks[0]["weights"][name], weight, rtol=1e-5, atol=1e-7)
    merged = merge_ranks([r["metrics"] for r in ranks], [r["tokens"] for r in ranks])
    assert merged["train/loss"] == pytest.approx(single["metrics"]["train/loss"], rel=1e-5, abs=1e-7)
    assert merged["train/grad_norm"] == pytest.approx(single["metrics"]["train/grad_norm"], rel=1e-5)


# ----------------------------------------------------------------------------------------------
# The pieces
# ----------------------------------------------------------------------------------------------


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
    assert "perf/update_weights_limit_time_rank_min" not in merged  # a limit, not a phase
    assert merged["train/loss"] == 0.75  # each rank's part of the batch's token mean
    assert merged["train/logprob_abs_diff"] == pytest.approx((0.1 * 30 + 0.4 * 10) / 40)
    assert merged["train/grad_norm"] == 3.0 and merged["perf/sleep_bytes"] == 100  # shared, per rank
    assert merged["perf/device_mem_after_sleep_gb"] == 2.0


def test_shares_are_whole_groups_and_buckets_keep_one_dtype():
    from rlsync.trainer.data_parallel import grad_buckets, split_evenly

    assert split_evenly(3, 2) == [2, 1] and split_evenly(8, 4) == [2, 2, 2, 2] and split_evenly(2, 2) == [1, 1]
    grads = [torch.zeros(4), torch.zeros(4), torch.zeros(100), torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)]
    buckets = grad_buckets(grads, bucket_bytes=64)  # 4 floats = 16 bytes
    assert [[g.numel() for g in b] for b in buckets] == [[4, 4], [100], [2], [2]]


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
        ("1", "update.transport=ipc", "update.transport"),
    ],
)
def test_what_two_ranks_cannot_run_is_a_config_error(tmp_path, rank, override, key):
    cwd, run_dir = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    # the launcher's environment alone: the check comes before any process group is joined
    proc = run_main(
        override, "wandb.mode=disabled", f"hydra.run.dir={run_dir}", cwd=cwd, WORLD_SIZE="2", RANK=rank, LOCAL_RANK=rank
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    who = "" if rank == "0" else f"rank {rank}: "  # every rank prints its line; ranks > 0 say which they are
    assert proc.stderr.strip().splitlines()[-1].startswith(f"rlsync: {who}config error: {key}=")
    assert list(cwd.iterdir()) == []  # no rank writes where it was started
    assert (run_dir / "error.log").exists() == (rank == "0")  # rank 0 logs in its run dir; rank 1 writes nothing


def test_a_sweep_under_a_data_parallel_launch_is_refused():
    proc = run_main("-m", "run.seed=1,2", "wandb.mode=disabled", WORLD_SIZE="2", RANK="0")
    assert proc.returncode == 2 and "a sweep (-m) cannot run under a data-parallel launch" in proc.stderr


# `python -m rlsync` whose rank 1 raises in its second train step, as a bug or an OOM on one rank would.
FAILING_RANK = """
import os, runpy

from rlsync.trainer.grpo import Trainer

if os.environ.get("RANK") == "1":
    original, calls = Trainer.train_step, []

    def failing_train_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("rank 1 broke on purpose")
        return original(self, *args, **kwargs)

    Trainer.train_step = failing_train_step
runpy.run_module("rlsync", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_a_failing_rank_is_named_as_the_runs_error(tmp_path):
    """Rank 0 sees only a collective's "connection closed by peer" (or torchrun's SIGTERM): its error
    line and summary must name rank 1's failure instead, and keep the finished step."""
    script, run_dir = tmp_path / "failing_rank.py", tmp_path / "run"
    script.write_text(FAILING_RANK)
    proc = accelerate_launch(*DP_RUN, "run.steps=4", f"hydra.run.dir={run_dir}", cwd=ROOT, script=str(script))
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("rlsync:")]
    assert "rlsync: rank 1: failed: RuntimeError: rank 1 broke on purpose" in lines, proc.stderr[-3000:]
    assert (
        "rlsync: data-parallel rank 1 failed: RuntimeError: rank 1 broke on purpose; 1 finished step(s) kept in "
        f"{run_dir} (summary.json status failed)"
    ) in lines, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps_finished"] == 1
    assert summary["error"] == "data-parallel rank 1 failed: RuntimeError: rank 1 broke on purpose"
    assert "rank 1 broke on purpose" in (run_dir / "error.log").read_text()
