"""The data-parallel trainer on the CPU: two real ranks over gloo (tests/process: every test starts processes).

The CLI under `accelerate launch` (two processes; trainer.parallel=fsdp2, rank 0 holding the engine), the
same run in one process for comparison, a ddp launch with one ipc engine per rank whose rank 1 fails (or is
killed), and two ranks started here around the trainer alone (ddp and fsdp2, with the shards' offload between
steps), whose losses and weights over 3 steps must be the single process's on the same batches. The checks a
launch's environment triggers before any group is joined run in this process: tests/unit/test_data_parallel.py.
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
from conftest import FAST, ROOT, Tiny, cli_env, read_jsonl, run_cli

DP_RUN = [*FAST, "trainer.lr=1e-3", "update.verify=true", "wandb.mode=disabled"]
FSDP2_RUN = [*DP_RUN, "trainer.parallel=fsdp2"]  # the fixture's launch; rank 0 holds the one engine
RANK0_ONLY = ("perf/rollout_time", "perf/engine_resume_time", "perf/engine_release_time")
EVERY_RANK = (
    "perf/step_time",
    "perf/batch_scatter_time",
    "perf/wake_up_time",
    "perf/log_probs_time",
    "perf/train_time",
    "perf/update_weights_time",  # fsdp2: every rank gathers, rank 0's engine loads
    "perf/update_weights_gather_time",
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


def torchrun(*args: str, cwd, timeout: float = 300, script: str = "-m rlsync") -> subprocess.CompletedProcess:
    """torchrun of two ranks through the c10d rendezvous a multi-node launch uses (`--nnodes 2` on two
    machines; one node here)."""
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{launcher_port()}",
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
    proc = accelerate_launch(*FSDP2_RUN, f"hydra.run.dir={run_dir}", cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc, run_dir, cwd


def test_two_ranks_train_and_update_the_engine_bit_exact(two_ranks):
    proc, run_dir, cwd = two_ranks
    summary = json.loads((run_dir / "summary.json").read_text())
    # update.verify: every engine tensor equals rank 0's after each update, and every rank holds rank 0's weights
    assert summary["status"] == "finished" and summary["verification"] == "passed"
    setup = summary["setup"]
    assert (setup["ranks"], setup["parallel"], setup["placement"], setup["gather"]) == (
        2,
        "fsdp2",
        "rank0",
        "per_bucket",
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]  # one row per step: rank 0's, merged
    assert max(r["train/logprob_abs_diff"] for r in rows) < 0.02  # the engine samples with the trained weights
    for row in rows:
        for key in EVERY_RANK:  # the slowest rank's time, the spread beside it
            assert row[key] == row[f"{key}_rank_max"] >= row[f"{key}_rank_min"] > 0, key
        for key in RANK0_ONLY:  # rank 0's phases: nothing to gather
            assert f"{key}_rank_max" not in row
        assert row["update/verified_engines"] == 1  # the one engine, checked against a second gather
        assert row["perf/update_weights_gather_bytes"] == 2 * row["perf/update_weights_bytes"]  # fp32 -> bf16
        # the update's floor is the copy's plus the gather's; each part against its own
        assert row["perf/update_weights_limit_time"] == pytest.approx(
            row["perf/update_weights_copy_limit_time"] + row["perf/update_weights_gather_limit_time"]
        )
    # the gather's phase, floor and efficiency in summary.json, the floor measured in the same run
    stats = summary["metrics"]
    for key in ("gather_time", "gather_limit_time", "gather_efficiency", "copy_efficiency", "gather_peak_bytes"):
        assert stats[f"perf/update_weights_{key}"]["median"] > 0, key
    limits = summary["limits"]  # the fastest call size probed, the one the update's gather calls at
    assert limits["gather_gbps"] > 0 and limits["gather_probe"].endswith(
        "calls (the fastest of 1.00 MiB to 4.00 MiB), 2 ranks, gloo"
    )
    assert limits["gather_call_bytes"] in (1 << 20, 4 << 20)
    # the offload's floor: each rank's share of the host link, every rank copying at once
    assert limits["rank_to_host_gbps"] > 0 and limits["rank_link_probe"].startswith("2 ranks copying at once")
    # re-probed before every step: the same order as the first probe (the load moves it between steps)
    first = stats["perf/sleep_bytes"]["median"] / (limits["rank_to_host_gbps"] * 1e9)
    assert 0.2 <= stats["perf/sleep_limit_time"]["median"] / first <= 5
    # per_bucket: the gathered bytes held at once are one bucket's (the tiny model is one 512 MiB bucket)
    assert stats["perf/update_weights_gather_peak_bytes"]["max"] <= stats["perf/update_weights_gather_bytes"]["max"]
    # one run dir, rank 0's; rank 1 wrote nothing, neither in the working directory nor a Hydra dir of its own
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", ".rlsync.lock", "metrics.jsonl", "summary.json"]
    assert list(cwd.iterdir()) == []
    assert proc.stdout.count("Measured steps:") == 1  # one closing block: rank 0's


def test_two_ranks_match_one_process(two_ranks, tmp_path):
    """The fsdp2 launch against one process. Step 0 is the same batch (both sample it from the same initial
    weights), so its loss, gradient and log-probs match; after the first update each engine holds the bf16
    rounding of weights whose float32 sums differ in the last bits, and one flipped bf16 value can flip a
    sampled token, so later batches need not be the same: the 3-step comparison on fixed batches is
    test_two_ranks_train_as_one_process_under_ddp_and_fsdp2."""
    _, run_dir, _ = two_ranks
    # torchrun gives each rank one thread: the same here, so both runs sum in comparable orders
    single = run_cli(*FSDP2_RUN, f"hydra.run.dir={tmp_path}", OMP_NUM_THREADS="1")  # one process: parallel none
    assert single.returncode == 0, single.stderr[-3000:]
    one, two = read_jsonl(tmp_path / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl")
    a, b = one[0], two[0]
    # the same batch: rank 0 samples it as one process does
    assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
    assert a["rollout/response_len_mean"] == b["rollout/response_len_mean"]
    # the same gradient (before clipping) and loss: the ranks' token-weighted sum is the whole batch's mean
    assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4, abs=1e-6)
    assert b["train/logprob_abs_diff"] == pytest.approx(a["train/logprob_abs_diff"], rel=1e-3, abs=1e-6)
    for a, b in zip(one, two, strict=True):
        # each rank's offload moves its own shards: half the one process's state, up to FSDP2's padding
        assert 0.5 <= b["perf/sleep_bytes"] / a["perf/sleep_bytes"] < 0.52


# ----------------------------------------------------------------------------------------------
# The trainer alone: two ranks against one process, 3 steps on fixed batches, ddp and fsdp2
# ----------------------------------------------------------------------------------------------

GROUP_SIZE, PROMPT_LEN, RESPONSE_LEN, STEPS = 2, 5, 6, 3
# ddp: 3 groups over 2 ranks (4 rows and 2: the ranks run 2 and 1 micro-batches); fsdp2: 4 groups (every forward
# is a collective, so the config rule asks for equal shares), uneven answer lengths either way
GROUPS = {"ddp": 3, "fsdp2": 4}
# float32, summed in another order over ranks: the stated tolerance of the loss (and the grad norm), and of the
# weights after 3 AdamW steps of lr 1e-3. AdamW normalises each element's step, so where an element's gradient is
# near zero the summation order moves its step (measured: fsdp2 moves 3 of 1.2M elements by up to 2.8e-6); a wrong
# or stale shard moves whole tensors by the step size, 1e-3 a step.
LOSS_TOLERANCE, WEIGHT_TOLERANCE = {"rel": 1e-5, "abs": 1e-7}, {"rtol": 1e-4, "atol": 5e-5}


def fixed_batch(groups: int, step: int):
    """Step `step`'s batch: random tokens, uneven answer lengths, so the ranks' shares hold different token counts."""
    from rlsync.engines.base import Generation
    from rlsync.trainer.grpo import group_advantages

    gen = torch.Generator().manual_seed(7 + step)
    rows = groups * GROUP_SIZE
    sequences = torch.randint(3, 256, (rows, PROMPT_LEN + RESPONSE_LEN), generator=gen)
    answer_lens = torch.randint(1, RESPONSE_LEN + 1, (rows,), generator=gen)
    response_mask = (torch.arange(RESPONSE_LEN) < answer_lens[:, None]).long()
    attention_mask = torch.cat([torch.ones(rows, PROMPT_LEN, dtype=torch.long), response_mask], dim=1)
    attention_mask[0, :2] = 0  # left padding in one prompt
    batch = Generation(
        sequences=sequences,
        attention_mask=attention_mask,
        response_mask=response_mask,
        logprobs=torch.zeros(rows, RESPONSE_LEN),
        prompt_len=PROMPT_LEN,
        truncated=answer_lens == RESPONSE_LEN,
    )
    rewards = torch.rand(rows, generator=gen)
    return batch, group_advantages(rewards, GROUP_SIZE)


def tiny_trainer(parallel: str, world: int = 1, before_wrap=lambda model: None):
    """The tiny model's trainer under `parallel`, and its offloader (full: params, grads, AdamW state move)."""
    from rlsync.config.schema import ModelConfig, TrainerConfig
    from rlsync.trainer.grpo import Trainer
    from rlsync.trainer.offload import Offloader
    from rlsync.trainer.parallel import parallel_for

    cpu = torch.device("cpu")
    model = Tiny().build(seed=3)
    before_wrap(model)
    # no clipping at this size: a wrongly scaled gradient must show, not be clipped to the same norm
    cfg = TrainerConfig(lr=1e-3, micro_batch_size=2, grad_clip=1e6)
    trainer = Trainer(
        model,
        cfg,
        allowed_ids=torch.ones(ModelConfig().vocab_size, dtype=torch.bool),
        temperature=1.0,
        parallel=parallel_for(parallel, world=world, device=cpu),
    )
    return trainer, Offloader(model, trainer.optimizer, mode="full", device=cpu, memory="move", segment_bytes=1 << 20)


def train_steps(trainer, offloader, batches, dp=None) -> dict:
    """STEPS steps, the trainer offloaded and onloaded between them; losses, grad norms, tokens, final weights."""
    out = {"loss": [], "grad_norm": [], "tokens": [], "rows": [], "sleep_bytes": []}
    for batch, advantages in batches:
        batch_tokens = None
        if dp is not None:
            batch, advantages, batch_tokens = dp.scatter_groups(
                batch, advantages, group_size=GROUP_SIZE, device=torch.device("cpu")
            )
        offloader.onload()
        old_logp = trainer.log_probs(batch)
        metrics = trainer.train_step(batch, old_logp=old_logp, advantages=advantages, batch_tokens=batch_tokens)
        out["sleep_bytes"].append(offloader.offload())
        out["loss"].append(metrics["train/loss"])
        out["grad_norm"].append(metrics["train/grad_norm"])
        out["tokens"].append(float(batch.response_mask.sum()))
        out["rows"].append(batch.sequences.shape[0])
    offloader.onload()
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in trainer.model.named_parameters()}
    out["weights"] = {n: t.detach().clone() for n, t in full.items()}
    return out


def rank_process(rank: int, port: int, out_dir: str) -> None:
    """One rank, as torchrun starts it: the environment (the store is the launcher's, as torchrun's agent
    hosts it), then rlsync.trainer.data_parallel's and rlsync.trainer.parallel's own calls."""
    torch.set_num_threads(1)
    os.environ.update(
        OMP_NUM_THREADS="1",  # as torchrun sets it (accelerate's Accelerator would set 2 threads otherwise)
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from rlsync.trainer.data_parallel import DataParallel
    from rlsync.update import WeightMismatch
    from rlsync.update.gather import gather_shards

    def rank0_wins(model) -> None:  # rank 0's weights must win: start rank 1 elsewhere, then broadcast
        if rank == 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        dp.broadcast_weights(model)

    dp = DataParallel.from_env()
    results = {}
    with dp:
        dp.start(torch.device("cpu"), timeout_s=120)
        for parallel, groups in GROUPS.items():
            trainer, offloader = tiny_trainer(parallel, world=2, before_wrap=rank0_wins)
            batches = [fixed_batch(groups, k) if dp.is_main else (None, None) for k in range(STEPS)]
            results[parallel] = train_steps(trainer, offloader, batches, dp)
            if parallel == "ddp":
                dp.check_same_weights(dict(trainer.model.named_parameters()))  # the replicas stay identical
            else:  # the update's gather against full_tensor(), in calls that cut tensors, and in one call
                shards = list(trainer.model.parameters())
                results["gather_matches"] = all(
                    torch.equal(a, p.full_tensor())
                    for call_bytes in (1000, 1 << 30)
                    for a, p in zip(gather_shards(shards, call_bytes=call_bytes), shards)
                )
        mesh = init_device_mesh("cpu", (2,))  # uneven rows: a short last shard, an empty one, a 1-D tensor
        odd = [torch.arange(15.0).reshape(5, 3), torch.arange(7.0), torch.arange(4.0).reshape(1, 4)]
        dts = [distribute_tensor(t, mesh, [Shard(0)]) for t in odd]
        results["odd"] = [[t.clone() for t in gather_shards(dts, call_bytes=cb)] for cb in (8, 40, 1 << 20)]
        dp.agree(None)  # update.verify: every rank's engine matched
        try:  # rank 1's engine did not: every rank learns it, and which
            dp.agree(WeightMismatch("engine tensor 'w' differs") if rank == 1 else None)
        except WeightMismatch as err:
            results["verdict"] = str(err)
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def test_two_ranks_train_as_one_process_under_ddp_and_fsdp2(tmp_path):
    from datetime import timedelta

    from rlsync.trainer.data_parallel import merge_ranks
    from rlsync.update.broadcast import listen_store

    # The launcher's store, listening before the ranks start and until they end: a port found free and
    # released for rank 0 to bind could be taken meanwhile (the other test worker's sockets), failing the launch.
    store = listen_store("127.0.0.1", timedelta(seconds=120))
    mp.start_processes(rank_process, args=(store.port, str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    del store
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["verdict"] for r in ranks] == ["rank 1's engine: engine tensor 'w' differs"] * 2
    assert all(r["gather_matches"] for r in ranks)  # the update's gather is full_tensor()'s, bit for bit
    odd = [torch.arange(15.0).reshape(5, 3), torch.arange(7.0), torch.arange(4.0).reshape(1, 4)]
    for r in ranks:
        for gathered in r["odd"]:  # calls of 1 element per rank, of 5 (cutting tensors), and one call
            assert all(torch.equal(g, t) for g, t in zip(gathered, odd))
    torch.set_num_threads(1)
    for parallel, groups in GROUPS.items():
        trainer, offloader = tiny_trainer("none")
        single = train_steps(trainer, offloader, [fixed_batch(groups, k) for k in range(STEPS)])
        two = [r[parallel] for r in ranks]
        split = (4, 2) if groups == 3 else (4, 4)
        assert all(tuple(r["rows"][k] for r in two) == split for k in range(STEPS)), parallel  # whole groups
        for k in range(STEPS):  # the same loss, step by step: the ranks' token-weighted sum is the batch's mean
            merged = merge_ranks(
                [{"train/loss": r["loss"][k], "train/grad_norm": r["grad_norm"][k]} for r in two],
                [r["tokens"][k] for r in two],
            )
            assert merged["train/loss"] == pytest.approx(single["loss"][k], **LOSS_TOLERANCE), (parallel, k)
            assert merged["train/grad_norm"] == pytest.approx(single["grad_norm"][k], rel=1e-5), (parallel, k)
        for name, weight in single["weights"].items():  # after 3 steps and 3 offloads, the same weights
            torch.testing.assert_close(two[0]["weights"][name], weight, **WEIGHT_TOLERANCE, msg=f"{parallel} {name}")
            assert torch.equal(two[0]["weights"][name], two[1]["weights"][name])  # one model on both ranks
        # each rank offloads its own state: the whole of it under ddp, its shards (half, up to padding) under fsdp2
        ratio = two[0]["sleep_bytes"][0] / single["sleep_bytes"][0]
        assert ratio == 1.0 if parallel == "ddp" else 0.5 <= ratio < 0.52, (parallel, ratio)


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


def test_a_failing_rank_is_named_as_the_runs_error(tmp_path):
    """Rank 0 sees only a collective's "connection closed by peer" (or torchrun's SIGTERM): its error
    line and summary must name rank 1's failure instead, and keep the finished step.

    The same launch runs ddp with one engine per rank, each in its own process (ipc), every rank's engine
    verified after the update of the step that finished, started by torchrun through the c10d rendezvous
    of a multi-node launch."""
    script, run_dir = tmp_path / "failing_rank.py", tmp_path / "run"
    script.write_text(FAILING_RANK)
    every_rank = ["trainer.parallel=ddp", "rollout.placement=every_rank", "update.transport=ipc"]
    proc = torchrun(*DP_RUN, *every_rank, "run.steps=4", f"hydra.run.dir={run_dir}", cwd=ROOT, script=str(script))
    assert proc.returncode != 0
    (row,) = read_jsonl(run_dir / "metrics.jsonl")  # the finished step: both ranks' engines updated and verified
    assert row["update/verified_engines"] == 2 and row["train/logprob_abs_diff"] < 0.02
    assert row["perf/rollout_time"] == row["perf/rollout_time_rank_max"]  # each rank's engine generated its groups
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


RANK_1_SIGNALS_ITSELF = """
import os, runpy, signal

from rlsync.trainer.grpo import Trainer

if os.environ.get("RANK") == "1":
    original, calls = Trainer.train_step, []

    def signalled_train_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIG{sig})
        return original(self, *args, **kwargs)

    Trainer.train_step = signalled_train_step
runpy.run_module("rlsync", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    "sig,status,line",
    [
        (
            "KILL",
            "failed",
            "data-parallel rank 1 died (its process ended without a word: killed by SIGKILL, the out-of-memory killer, "
            "or a crash)",
        ),
        ("INT", "interrupted", "interrupted: stopped by SIGINT (sent to data-parallel rank 1)"),
    ],
)
def test_a_rank_killed_or_stopped_is_named_not_taken_for_the_launchers_sigterm(tmp_path, sig, status, line):
    """D02/D08: rank 1 SIGKILLed (or Ctrl-C'd alone) in its second step; rank 0, stopped by torchrun's SIGTERM or
    a closed collective, names rank 1 and writes its summary with the finished step."""
    script, run_dir = tmp_path / "signalled_rank.py", tmp_path / "run"
    script.write_text(RANK_1_SIGNALS_ITSELF.replace("{sig}", sig))
    proc = torchrun(
        *DP_RUN, "trainer.parallel=ddp", "run.steps=4", f"hydra.run.dir={run_dir}", cwd=ROOT, script=str(script)
    )
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("rlsync:")]
    kept = f"; 1 finished step(s) kept in {run_dir} (summary.json status {status})"
    assert f"rlsync: {line}{kept}" in lines, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == status and summary["steps_finished"] == 1
