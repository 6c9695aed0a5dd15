"""The entry points' own config trees: the runner's `Config` (rlsync/config/schema.py) plus `bench.*`
(python -m rlsync.bench), `serve.*` (python -m rlsync.serve) and `plan.*` (python -m rlsync.plan), and
the schemas Hydra composes each entry point with (`SCHEMAS`)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

from rlsync.config.rules import (
    ANY,
    OPTIONAL_NAME,
    ChoiceList,
    Choices,
    Rule,
    at_least,
    between,
    choices,
    counts,
    key,
    list_of,
    mebibytes,
    node,
    one_of,
    or_null,
    resolve,
)
from rlsync.config.schema import SECONDS, STEPS, STEPS_MAX, Config
from rlsync.errors import ConfigError, show
from rlsync.fmt import first_line

UPDATE_POLICIES = "rlsync.serve.policies.base:update_policy_names"  # serve.update_policy's choices: the registry's
# bench.target's values renamed, (old, new): refused naming the new one; the report reads a recorded old one as new
RENAMED_TARGETS = (("pause", "stall"),)  # issue 44: one word per thing (the target measures the clients' stalls)


def update_policy_names() -> tuple[str, ...]:
    """serve.update_policy's values, in registration order (the registry's, imported now)."""
    return tuple(resolve(UPDATE_POLICIES)())


def update_policy_class(name: str):
    """The class behind serve.update_policy=`name` (rlsync/serve/policies), imported now: what a policy declares
    of itself (its rules, its baseline, its staged copies, how its swap reads) is asked of it, from any layer."""
    return resolve("rlsync.serve.policies.base:update_policy_class")(name)


def engine_overrides_ok(v) -> bool:
    return isinstance(v, list) and all(isinstance(o, str) and o.startswith("serve.") and "=" in o for o in v)


@dataclass(frozen=True)
class EachOnce(ChoiceList):
    """ChoiceList, each name at most once."""

    def ok(self, value) -> bool:
        return super().ok(value) and len(set(value)) == len(value)

    @property
    def allowed(self) -> str:
        return super().allowed.replace("a non-empty list,", "a non-empty list, each once,", 1)


@dataclass(frozen=True)
class Renamed(Choices):
    """The names at `provider`, or one they replaced (`old`: ((old, new), ...)): an old name passes the value
    rule so that its node's check refuses it in one line naming the new one (`refuse_renamed`)."""

    old: tuple[tuple[str, str], ...] = ()

    def ok(self, value) -> bool:
        return value in dict(self.old) or super().ok(value)


def refuse_renamed(node, prefix: str) -> None:
    """A value of `node` that was renamed (a `Renamed` rule's old name), refused naming the new one."""
    for f in fields(node):
        rule, value = f.metadata.get("rule"), getattr(node, f.name)
        if isinstance(rule, Renamed) and isinstance(value, str) and value in dict(rule.old):
            new = dict(rule.old)[value]
            raise ConfigError(f"{prefix}.{f.name}", value, rule.allowed, f"renamed to {prefix}.{f.name}={new}")


# bench.* keys one target reads (rlsync/bench: runner.py, offload.py, stall.py); warmup and repeats serve all. Set
# away from its default under another target, such a key changes nothing: refused, not ignored
TARGET_KEYS = {
    "offload_state": ("offload",),
    "changed_ratio": ("update",),
    **dict.fromkeys(("clients", "policies", "before_s", "after_s", "engine_overrides", "answer_tokens"), ("stall",)),
}


@dataclass
class BenchConfig:
    target: str = key(
        "update",
        Renamed("rlsync.bench.runner:TARGETS", old=RENAMED_TARGETS),
        "what is timed: update (the weight update alone) | offload (trainer sleep + wake-up, trainer.offload) | stall (the gaps streaming clients of a standalone engine see during an update) | vllm_paths (vLLM's three update paths on one model, each verified; rollout.engine=vllm)",
    )
    offload_state: str = key(
        "trainer",
        choices("rlsync.bench.offload:STATES"),
        "offload target: trainer (params, grads, AdamW state) | params (weights alone: 1.7B on 24 GiB)",
    )
    warmup: int = key(
        2,
        counts(0, STEPS_MAX, "more repeats than any RL run takes steps is a typo"),
        "untimed repeats first (page faults, allocator, thread pools)",
    )
    repeats: int = key(10, STEPS, "timed repeats; the summary gives median, min and max over them")
    changed_ratio: float = key(
        0.0,
        between(0, 1, "a share of the elements"),
        "bench.target=update: before each repeat, change this share of every weight's elements (sign flips: their engine-dtype values change), as a training step would; what an update.payload that sends only the changed elements is timed against",
    )

    clients: int = key(
        2, between(1, 64, "streaming clients"), "bench.target=stall: streaming clients kept busy on the engine"
    )
    policies: list[str] = key(
        ["pause", "stage"],
        EachOnce(UPDATE_POLICIES, "serve.update_policy's values"),
        "bench.target=stall: the serve.update_policy values compared, one engine each, every repeat one update under each",
    )
    before_s: float = key(
        2.0,
        between(0.2, 600, "seconds"),
        "bench.target=stall: the measured window of steady streaming before each update",
    )
    after_s: float = key(
        1.0, between(0.2, 600, "seconds"), "bench.target=stall: how long streaming is measured after each update's swap"
    )
    engine_overrides: list[str] = key(
        [],
        Rule(engine_overrides_ok, "a list of serve.KEY=VALUE overrides"),
        "bench.target=stall: more overrides for each standalone engine it starts, e.g. [serve.stage_nice=0]",
    )
    answer_tokens: int = key(
        16, between(1, 4096, "tokens"), "bench.target=stall: each client's answer length (a new request after each)"
    )

    def check_target_keys(self) -> None:
        """A key another target reads, set while this one runs (bench.changed_ratio=0.5 with bench.target=offload)."""
        defaults = BenchConfig()
        for name, targets in TARGET_KEYS.items():
            value, default = getattr(self, name), getattr(defaults, name)
            if self.target not in targets and value != default:
                raise ConfigError(
                    f"bench.{name}",
                    value,
                    f"{show(default)} (its default) with bench.target={self.target}; it applies to "
                    f"bench.target={', '.join(targets)}",
                    f"does nothing with bench.target={self.target}",
                )

    def check(self, root: BenchAppConfig) -> None:
        refuse_renamed(self, "bench")
        self.check_target_keys()
        if self.target == "stall" and root.rollout.engine != "hf":
            raise ConfigError(
                "rollout.engine",
                root.rollout.engine,
                "hf (bench.target=stall streams tokens from the standalone engine, which the HF engine serves)",
                "not allowed with bench.target=stall",
            )
        if self.target == "stall":
            check_stall_target(self, root)
        if self.target == "offload" and root.trainer.offload == "none":
            raise ConfigError(
                "trainer.offload", "none", "full, drop_grads (the offload benchmark needs something to move)"
            )
        # a target's own rules, declared on its class (bench.target=vllm_paths: vLLM importable, its keys)
        check = getattr(resolve("rlsync.bench.runner:TARGETS")[self.target], "check_config", None)
        if check is not None:
            check(root)


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
        choices(UPDATE_POLICIES),
        "how an update meets streaming clients: a registered update policy (rlsync/serve/policies; docs/serve.md lists each, as it declares itself)",
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

    def check(self, root) -> None:
        update_policy_class(self.update_policy).check_config(self, root)  # the policy's own rules across keys


# ----------------------------------------------------------------------------------------------
# bench.target=stall: its engines are standalone ones (python -m rlsync.serve), joined at update.engine_address
# ----------------------------------------------------------------------------------------------

STALL_ENGINE_HOST = "127.0.0.1"  # where the stall bench starts its engines (port 0: each picks a free one)
# serve.* keys the stall bench sets on each engine itself: what to set instead
STALL_SETS = {
    "serve.update_policy": "bench.policies (one engine per policy, each labelled by it)",
    "serve.sessions": "nothing (the bench stops its engines itself)",
}


def standalone_trainer(root, address: str):
    """`root` as the trainer of a standalone engine at `address`: update.engine_address, through the transport
    that joins one (its class declares `joins_address`: broadcast)."""
    transport = resolve("rlsync.update.base:transports_with")(joins_address=True)[0]
    return replace(root, update=replace(root.update, transport=transport, engine_address=address))


def serve_overrides(overrides: list[str]) -> dict:
    """bench.engine_overrides as {serve key: value, as Hydra parses it}; a ConfigError names the first that is
    no serve.* key, a value its rule refuses, or a key the bench sets itself (STALL_SETS)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    rules = {f"serve.{f.name}": f.metadata["rule"] for f in fields(ServeConfig)}
    parsed = {}
    for text in overrides:
        try:
            override = OverridesParser.create().parse_override(text)
            value = override.value()
        except Exception as err:  # noqa: BLE001 - Hydra's grammar errors: the override named, one line
            raise ConfigError(
                "bench.engine_overrides", overrides, "serve.KEY=VALUE in Hydra's grammar", f"{text}: {first_line(err)}"
            ) from None
        name = override.key_or_group
        if name in STALL_SETS:
            raise ConfigError(
                "bench.engine_overrides",
                overrides,
                f"no {name}: set {STALL_SETS[name]}",
                f"{text}: the bench sets {name} itself",
            )
        if name not in rules or override.is_sweep_override():
            raise ConfigError(
                "bench.engine_overrides", overrides, ", ".join(sorted(rules)), f"{text}: unknown serve key"
            )
        if not rules[name].ok(value):
            raise ConfigError(name, value, rules[name].allowed, "not allowed in bench.engine_overrides")
        parsed[name] = value
    return parsed


def check_stall_target(bench: BenchConfig, root) -> None:
    """What each engine of a stall bench is asked to do must be what a standalone engine does, at once: the
    update's payload and transport under update.engine_address (their rules, asked as a run would), the
    open files its engines need, the engine's own keys and each policy's rules, the clients within its streams."""
    trainer = standalone_trainer(root, f"{STALL_ENGINE_HOST}:0")
    try:
        resolve("rlsync.update.payload.base:payload_of")(trainer.update).check_config(trainer)
        resolve("rlsync.update.base:transport_class")(trainer.update.transport).check_config(trainer)
    except ConfigError as err:  # the rule names update.engine_address, which the user did not set: the bench did
        others = ", ".join(t for t in resolve("rlsync.bench.runner:TARGETS") if t != bench.target)
        raise ConfigError(
            "bench.target",
            bench.target,
            f"{others} (the stall bench joins standalone engines through update.engine_address and "
            f"update.transport={trainer.update.transport}, and there {err.key} takes only {err.allowed})",
            err.problem,
        ) from None
    try:  # the engines inherit this process's open-file limit (raised to its hard limit where low)
        resolve("rlsync.config.validate:check_open_files")(trainer.update)
    except ConfigError as err:  # the engine's own reason (python -m rlsync.serve in this shell refuses alike)
        least = resolve("rlsync.config.validate:OPEN_FILES_MIN")
        raise ConfigError(
            "bench.target",
            bench.target,
            f"a shell with an open-file limit of at least {least} (ulimit -n 4096), which the engines inherit",
            f"its engines (python -m rlsync.serve, update.transport={trainer.update.transport}) would not start: "
            f"each {err.problem}, to receive its buffers as file descriptors",
        ) from None
    if root.trainer.lora.rank:  # a merging payload passes the rule above, but the bench builds no adapters
        raise ConfigError(
            "trainer.lora.rank",
            root.trainer.lora.rank,
            "0 with bench.target=stall (its two models are built without adapters: it times full updates)",
            "not allowed with bench.target=stall",
        )
    serve = ServeConfig(
        **{k.removeprefix("serve."): v for k, v in serve_overrides(list(bench.engine_overrides)).items()}
    )
    for policy in bench.policies:  # each engine's policy, asked as that engine would ask it
        update_policy_class(policy).check_config(replace(serve, update_policy=policy), root)
    streams = serve.max_streams
    if bench.clients > streams:
        raise ConfigError(
            "bench.clients",
            bench.clients,
            f"at most the engines' serve.max_streams={streams} (each client keeps one answer streaming, and an "
            f"engine refuses more with 503): fewer clients, or 'bench.engine_overrides=[\"serve.max_streams="
            f"{bench.clients}\"]'",
            "out of range",
        )


@dataclass
class EngineAppConfig(Config):
    """`python -m rlsync.serve`: the runner's tree (model, rollout, update.engine_address, run.device) plus `serve.*`."""

    serve: ServeConfig = node(ServeConfig, "the engine server (python -m rlsync.serve)")


@dataclass
class BenchAppConfig(Config):
    """`python -m rlsync.bench`: the runner's tree plus the benchmark's own keys."""

    bench: BenchConfig = node(BenchConfig, "the benchmark (python -m rlsync.bench): what is timed, how often")


RANKS_MAX = 1_000_000  # plan.ranks: well past the largest published training clusters (about 10^5 GPUs)


def calibrated_transports() -> tuple[str, ...]:
    """The transports plan.calibrate=true benchmarks (rlsync/plan/calibrate.py's grid): those whose class declares
    `calibrated`. broadcast is not among them: its copies cross torch.distributed, whose cost another model would
    have to describe (the planner predicts none for it)."""
    return resolve("rlsync.update.base:transports_with")(calibrated=True)


# plan.copy_gbps, plan.collective_gbps: a copy's or a link's bandwidth. CPUs copy at about 1 to 100 GB/s, an H200's
# HBM3e 4.8 TB/s, NVLink 5 1.8 TB/s per GPU; 0.01 GB/s (10 MB/s) to 100000 GB/s (20x HBM3e) holds them all with
# room, and outside it is a typo (1e-300 printed a floor of 0.00 GB/s and a 300-digit time)
GBPS = or_null(between(0.01, 100_000, "GB/s: from a slow link to 20x the fastest memory"))


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
        list_of(mebibytes("as update.bucket_mb")),
        "bucket sizes (MiB) the plan tabulates, beside update.bucket_mb",
    )
    copy_gbps: Optional[float] = key(
        None,
        GBPS,
        "the copy floor (GB/s read + written, a bench's limits.update_copy_gbps) the at-floor prediction is at; null: the calibration runs' median",
    )
    ranks: int = key(
        1,
        between(1, RANKS_MAX, "trainer ranks; more than any cluster has (a typo?)"),
        "trainer ranks the plan is for (data parallel): with trainer.parallel=fsdp2 over N > 1 the update first gathers (N-1)/N of its bytes, and each rank holds 1/N of the state",
    )
    collective_gbps: Optional[float] = key(
        None,
        GBPS,
        "the all-gather's bus bandwidth (GB/s each rank receives) the fsdp2 gather is predicted at; null: the calibration's (plan.calibrate=true measures 2 gloo ranks here)",
    )
    changed_ratio: float = key(
        0.05,
        between(0, 1, "a share of the elements"),
        "the share of engine-dtype elements one step changes, for the predicted bytes of an update.payload that sends only the changed elements (verl #7060: 4-8 % for Qwen3-0.6B)",
    )
    step_s: Optional[float] = key(
        None,
        or_null(SECONDS),
        "your RL step's time (seconds, e.g. perf/step_time): the plan then gives the update's share of it and whether to tune it",
    )
    calibrate_repeats: int = key(3, STEPS, "calibration: timed repeats per benchmark job (after one warm-up)")
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
        ChoiceList("rlsync.config.apps:calibrated_transports", "the transports the calibration benchmarks"),
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
        if self.calibration is not None:  # a name, or a file to read; with a fit the file it writes (may not exist)
            resolve("rlsync.plan.profiles:check_choice")(self)
        if self.ranks > 1 and not resolve("rlsync.trainer.parallel:parallel_class")(root.trainer.parallel).spans_ranks:
            spanning = resolve("rlsync.trainer.parallel:parallels_with")(spans_ranks=True)
            raise ConfigError(
                "trainer.parallel",
                root.trainer.parallel,
                f"{', '.join(spanning)} (with plan.ranks={self.ranks}: {root.trainer.parallel} is one process only)",
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
