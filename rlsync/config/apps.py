"""The entry points' own config trees: the runner's `Config` (rlsync/config/schema.py) plus `bench.*`
(python -m rlsync.bench), `serve.*` (python -m rlsync.serve) and `plan.*` (python -m rlsync.plan), and
the schemas Hydra composes each entry point with (`SCHEMAS`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlsync.config.rules import (
    ANY,
    OPTIONAL_NAME,
    Rule,
    above,
    at_least,
    between,
    choices,
    key,
    node,
    one_of,
    or_null,
)
from rlsync.config.schema import COUNT, SECONDS, Config
from rlsync.errors import ConfigError
from rlsync.fmt import is_number

POLICIES = ("pause", "stage")  # serve.update_policy: how a standalone engine takes an update while it streams


def engine_overrides_ok(v) -> bool:
    return isinstance(v, list) and all(isinstance(o, str) and o.startswith("serve.") and "=" in o for o in v)


def policies_ok(v) -> bool:
    return isinstance(v, list) and bool(v) and len(set(v)) == len(v) and all(p in POLICIES for p in v)


@dataclass
class BenchConfig:
    target: str = key(
        "update",
        choices("rlsync.bench.runner:TARGETS"),
        "what is timed: update (the weight update alone) | offload (trainer sleep + wake-up, trainer.offload) | pause (the gap streaming clients of a standalone engine see during an update)",
    )
    offload_state: str = key(
        "trainer",
        choices("rlsync.bench.offload:STATES"),
        "offload target: trainer (params, grads, AdamW state) | params (weights alone: 1.7B on 24 GiB)",
    )
    warmup: int = key(2, at_least(0), "untimed repeats first (page faults, allocator, thread pools)")
    repeats: int = key(10, COUNT, "timed repeats; the summary gives median, min and max over them")
    changed_ratio: float = key(
        0.0,
        between(0, 1, "a share of the elements"),
        "before each repeat, change this share of every weight's elements (sign flips: their engine-dtype values change), as a training step would; what update.delta=true is timed against",
    )

    clients: int = key(
        2, between(1, 64, "streaming clients"), "bench.target=pause: streaming clients kept busy on the engine"
    )
    policies: list[str] = key(
        ["pause", "stage"],
        Rule(policies_ok, "a non-empty list of pause, stage, each once"),
        "bench.target=pause: the serve.update_policy values compared, one engine each, every repeat one update under each",
    )
    before_s: float = key(
        2.0,
        between(0.2, 600, "seconds"),
        "bench.target=pause: the measured window of steady streaming before each update",
    )
    after_s: float = key(
        1.0, between(0.2, 600, "seconds"), "bench.target=pause: how long streaming is measured after each update's swap"
    )
    engine_overrides: list[str] = key(
        [],
        Rule(engine_overrides_ok, "a list of serve.KEY=VALUE overrides"),
        "bench.target=pause: more overrides for each standalone engine it starts, e.g. [serve.stage_nice=0]",
    )
    answer_tokens: int = key(
        16, between(1, 4096, "tokens"), "bench.target=pause: each client's answer length (a new request after each)"
    )

    def check(self, root: BenchAppConfig) -> None:
        if self.target == "pause" and root.rollout.engine != "hf":
            raise ConfigError(
                "rollout.engine",
                root.rollout.engine,
                "hf (bench.target=pause streams tokens from the standalone engine, which the HF engine serves)",
                "not allowed with bench.target=pause",
            )
        if self.target == "offload" and root.trainer.offload == "none":
            raise ConfigError(
                "trainer.offload", "none", "full, drop_grads (the offload benchmark needs something to move)"
            )


@dataclass
class ServeConfig:
    sessions: int = key(
        0,
        at_least(0, "0 serves until stopped"),
        "trainer sessions to serve, one after another, before exiting (0: until Ctrl-C or SIGTERM)",
    )
    request_timeout_s: float = key(
        10.0, SECONDS, "longest a client may take to send one request (head and body); slower ones are dropped"
    )
    max_request_mb: float = key(
        64.0,
        between(0.01, 1024, "MiB"),
        "largest request body (a plan, a generate request: well under 1 MiB for 1.7B); larger: 413, dropped",
    )
    max_generate_tokens: int = key(
        1 << 22,
        between(1, 1e12, "prompts x new tokens"),
        "largest generate request, its prompts x max_new_tokens (a trainer's step: prompts_per_step x samples_per_prompt x max_response_len); larger: refused",
    )
    max_wait_s: float = key(
        120.0,
        between(0.1, 86400, "seconds"),
        "longest the engine waits on a trainer (its store, its group, one broadcast); a plan's longer timeouts are cut to this",
    )
    session_timeout_s: float = key(
        30.0,
        between(3, 86400, "seconds; trainers send a heartbeat every second"),
        "a session whose trainer sent nothing (no request, no heartbeat) for this long is ended and its work cancelled",
    )
    update_policy: str = key(
        "pause",
        one_of(POLICIES),
        "how an update meets streaming clients: pause (stop generating, receive, go on) | stage (receive into a side copy while generating, swap it in inside a short pause)",
    )
    stage_swap: str = key(
        "auto",
        one_of(("auto", "copy")),
        "update_policy=stage: auto (a pointer swap where the engine's weights allow it, the HF engine's; else a local copy) | copy (always the local copy)",
    )
    stage_nice: int = key(
        10,
        between(0, 19, "a nice increment"),
        "update_policy=stage: how much lower the receive's threads run than generation (Linux nice; 0: alike), so the cores go to the clients first",
    )
    max_streams: int = key(
        8, between(1, 1024, "answers at once"), "streaming answers (POST /v1/stream) served at once; more: 503, refused"
    )


@dataclass
class EngineAppConfig(Config):
    """`python -m rlsync.serve`: the runner's tree (model, rollout, update.engine_address, run.device) plus `serve.*`."""

    serve: ServeConfig = node(ServeConfig, "the engine server (python -m rlsync.serve)")


@dataclass
class BenchAppConfig(Config):
    """`python -m rlsync.bench`: the runner's tree plus the benchmark's own keys."""

    bench: BenchConfig = node(BenchConfig, "the benchmark (python -m rlsync.bench): what is timed, how often")


def bucket_sizes_ok(v) -> bool:
    return isinstance(v, list) and bool(v) and all(is_number(x) and 0 < x <= MEBIBYTES_MAX for x in v)


def transports_ok(v) -> bool:
    return isinstance(v, list) and bool(v) and all(t in ("direct", "ipc", "broadcast") for t in v)


MEBIBYTES_MAX = 2**20  # a bucket of up to 1 TiB: the plan of any model's largest tensor
RANKS_MAX = 1_000_000  # plan.ranks: well past the largest published training clusters (about 10^5 GPUs)


@dataclass
class PlanConfig:
    calibration: Optional[str] = key(
        None,
        OPTIONAL_NAME,
        "coefficients: a calibration file, a built-in GPU profile (h200, h100, a100: published figures, unmeasured) or reference; null: ~/.cache/rlsync/calibration.json, else the reference one shipped with rlsync",
    )
    calibrate: bool = key(
        False,
        ANY,
        "first fit the coefficients on this machine from 44 short rlsync.bench runs and time an all-gather over 2 gloo ranks (about 11 min on 2 cores), write them to plan.calibration",
    )
    fit_from: Optional[str] = key(
        None,
        OPTIONAL_NAME,
        "first fit the coefficients from the bench runs (summary.json) under this directory, write them to plan.calibration",
    )
    bucket_sizes: list[float] = key(
        [16.0, 64.0, 256.0, 512.0, 1024.0, 2048.0],
        Rule(bucket_sizes_ok, f"a non-empty list of MiB, each above 0 and at most {MEBIBYTES_MAX}"),
        "bucket sizes (MiB) the plan tabulates, beside update.bucket_mb",
    )
    copy_gbps: Optional[float] = key(
        None,
        or_null(above(0, "GB/s")),
        "the copy floor (GB/s read + written, a bench's limits.update_copy_gbps) the at-floor prediction is at; null: the calibration runs' median",
    )
    ranks: int = key(
        1,
        between(1, RANKS_MAX, "trainer ranks; more than any cluster has (a typo?)"),
        "trainer ranks the plan is for (data parallel): with trainer.parallel=fsdp2 over N > 1 the update first gathers (N-1)/N of its bytes, and each rank holds 1/N of the state",
    )
    collective_gbps: Optional[float] = key(
        None,
        or_null(above(0, "GB/s")),
        "the all-gather's bus bandwidth (GB/s each rank receives) the fsdp2 gather is predicted at; null: the calibration's (plan.calibrate=true measures 2 gloo ranks here)",
    )
    changed_ratio: float = key(
        0.05,
        between(0, 1, "a share of the elements"),
        "the share of engine-dtype elements one step changes, for the delta's predicted bytes (verl #7060: 4-8 % for Qwen3-0.6B)",
    )
    calibrate_repeats: int = key(3, COUNT, "calibration: timed repeats per benchmark job (after one warm-up)")
    calibrate_quick: bool = key(
        False,
        ANY,
        "calibration: the four small models only (about 3 min on 2 cores), every coefficient still determined",
    )
    calibrate_flat: bool = key(
        True,
        ANY,
        "calibration: also the flat-engine-weights setups (update.flat_engine_weights=true, the auto default with the HF engine)",
    )
    calibrate_transports: list[str] = key(
        ["direct", "ipc"],
        Rule(transports_ok, "a non-empty list of direct, ipc"),
        "calibration: the transports benchmarked",
    )

    def check(self, root: PlanAppConfig) -> None:
        if self.calibrate and self.fit_from:
            raise ConfigError(
                "plan.fit_from",
                self.fit_from,
                "null with plan.calibrate=true (one source of coefficients)",
                "not allowed with plan.calibrate=true",
            )
        if self.ranks > 1 and root.trainer.parallel == "none":
            raise ConfigError(
                "trainer.parallel",
                "none",
                f"ddp, fsdp2 (with plan.ranks={self.ranks}: none is one process only)",
                f"not allowed with plan.ranks={self.ranks}",
            )


@dataclass
class PlanAppConfig(Config):
    """`python -m rlsync.plan`: the runner's tree (model, update, rollout and trainer dtypes) plus `plan.*`."""

    plan: PlanConfig = node(PlanConfig, "the planner (python -m rlsync.plan): calibration, bucket sizes, ranks")


SCHEMAS = {
    "rlsync_schema": Config,
    "rlsync_bench_schema": BenchAppConfig,
    "rlsync_engine_schema": EngineAppConfig,
    "rlsync_plan_schema": PlanAppConfig,
}
