"""`bench.target=stall`: the stalls streaming clients of a standalone engine see while it takes an update.

    python -m rlsync.bench bench.target=stall
    python -m rlsync.bench bench.target=stall model=qwen3_0p6b bench.repeats=5 bench.warmup=1

For each policy in `bench.policies` (serve.update_policy, rlsync/serve/policies) a standalone engine is
started as a process of its own, `python -m rlsync.serve ... serve.update_policy=P` on 127.0.0.1 (port 0),
and this process joins it as its trainer (the broadcast transport, update.engine_address: the weights in
a gloo group, the control over HTTP). The first update fills it. Then each repeat is, for each policy
in turn (their order alternating from repeat to repeat):

1. `bench.clients` client threads stream answers (`POST /v1/stream`, rlsync/client/stream.py) of
   `bench.answer_tokens` tokens each, one after another, for a ramp of half a second (left out), then
   `bench.before_s` measured seconds;
2. the trainer sends an update (its weights alternate between two random models, seeds run.seed and
   run.seed + 1, so every update changes every weight);
3. the clients go on for `bench.after_s` after the engine's swap, then finish their answers.

Every token's arrival is stamped with time.perf_counter() as its line arrives (CLOCK_MONOTONIC on
Linux: the engine's own stamps of its hold, read from `GET /v1/serving`, are on the same clock). A
client waits from sending a request to its first token, then from each token to the next: those are
the gaps, and the longest during an update is its stall. Per policy and update: the longest gap that
ends from the update's start to after_s past the swap (`max_gap`), p50 and p99 of every gap of the
measured window, the time from the engine's hold to the first token after it (`pause_to_token`), tokens
per second during the update (from its start to the swap's end) against the before window's, the
engine's hold and receive times, and the staged copy's bytes. Then the check (untimed), for a policy
that declares `fresh_after_swap`: every answer started after the swap is scored by teacher forcing with
the new weights and with the old ones, in an engine of this process; its log-probs must match the new
weights' (within LOGPROB_TOL) and be farther from the old ones'.

The metric names keep the word this target had before issue 44, `pause/<policy>/...` (recorded runs, the
report and W&B projects are keyed on them); so does summary.json's `pause` (the policies and clients).

`bench.warmup` repeats are left out of the summary; the table gives medians with min to max.

What a standalone engine cannot do is refused before anything starts (rlsync.config.apps.check_stall_target).
A failed request, or an answer the check finds not to be the new weights', ends the bench (RequestsFailed,
exit 1): no figure comes from them. Each engine runs in a process group of its own, ended however the bench
ends (EngineServe.close), and on Linux dies with the bench even when it is SIGKILLed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from rlsync.client.stream import StreamFailed, StreamRequest, serving_state, stream_answer
from rlsync.config.apps import STALL_ENGINE_HOST, standalone_trainer, update_policy_class, update_policy_names
from rlsync.config.compose import to_dict
from rlsync.engines.base import engine_spec, token_logprobs
from rlsync.engines.process import exit_description
from rlsync.errors import RlsyncError
from rlsync.fmt import fmt_bytes, fmt_seconds, fmt_spread, markdown_table
from rlsync.model.architecture import update_tensors
from rlsync.model.build import build_model, build_tokenizer, named_weights, torch_dtype
from rlsync.update.side import open_update_side

RAMP_S = 0.5  # streaming before each measured window, left out (first requests, caches)
PROMPT_TOKENS = 8
LOGPROB_TOL = 0.05  # an answer's largest |streamed - teacher-forced| log-prob under the weights that made it
START_S = 300  # an engine process's start (imports, model build) on two busy cores
REQUEST_S = 120  # a client's longest wait on one line (a hold lasts an update at most)
METRIC = "pause"  # the metrics' prefix, pause/<policy>/<name>: the target's name before issue 44 (recorded runs)


def override_value(value) -> str:
    """A config value as a Hydra command-line override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def engine_overrides(cfg, policy: str) -> list[str]:
    """The standalone engine's command line: this benchmark's model, rollout and device, the policy."""
    tree = to_dict(cfg)
    flat = [f"{group}.{k}={override_value(v)}" for group in ("model", "rollout") for k, v in tree[group].items()]
    return [
        *flat,
        f"run.device={override_value(cfg.run.device)}",
        f"update.strategy={cfg.update.strategy}",
        f"update.engine_address={STALL_ENGINE_HOST}:0",
        f"serve.update_policy={policy}",
        "serve.sessions=0",
        "serve.max_wait_s=120",
        *cfg.bench.engine_overrides,
    ]


class EngineDidNotStart(RlsyncError):
    """A stall bench's engine exited, or did not listen in time: the line carries the engine's own reason."""


class RequestsFailed(RlsyncError):
    """Streaming requests failed, or answers did not come from the weights they should: nothing was measured."""


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def die_with_this_process():
    """The engine's preexec_fn on Linux (None elsewhere): PR_SET_PDEATHSIG, so the kernel SIGKILLs the engine when
    the thread that started it (the bench's main thread) ends, even when this process is SIGKILLed."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the forked child only calls it
    parent = os.getpid()

    def setup() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # this process died before the prctl took: no signal will come
            os._exit(1)

    return setup


@contextmanager
def signals_held():
    """Within the block (the main thread's Popen) SIGINT, SIGTERM and SIGHUP wait, so a stop cannot land between
    the engine's fork and its Popen being known to close(); they are delivered once the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in STOPPING_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(pending):
            os.kill(os.getpid(), sig)  # the run's own handler takes it now (StopOnSignals: Interrupted)


def engine_reason(errors: list[str]) -> str:
    """The engine's own reason from its stderr: its `rlsync:` line (every entry point's error convention), else
    its last line (a crash before that convention: an import, the interpreter: a traceback's exception line);
    "" without output. A traceback cut off before its exception line (the engine could not finish writing it:
    out of file descriptors, killed) is said to be, not given as the code line it ended on."""
    lines = [ln.rstrip() for ln in errors if ln.strip()]
    own = [ln.strip() for ln in lines if ln.lstrip().startswith("rlsync:")]
    if own:
        return own[-1].removeprefix("rlsync:").strip()
    if not lines:
        return ""
    last = lines[-1]
    if any(ln.startswith("Traceback (most recent call last)") for ln in lines) and (
        last[:1].isspace() or last.startswith("Traceback")
    ):  # inside a traceback: its exception line never came
        where = next((ln.strip() for ln in reversed(lines) if ln.lstrip().startswith("File ")), "")
        return "its traceback was cut off before its exception line" + (f" ({where})" if where else "")
    return last.strip()


class EngineServe:
    """`python -m rlsync.serve` for one policy, in a process of its own; its output lines collected.

    However the bench ends (an error, a signal, a failed start) `close()` ends the engine's process group and
    removes its directory; a bench killed outright takes the engine with it (PR_SET_PDEATHSIG, on Linux)."""

    def __init__(self, cfg, policy: str):
        self.policy = policy
        self.proc: subprocess.Popen | None = None
        self.readers: list[threading.Thread] = []
        self.lines: list[str] = []
        self.errors: list[str] = []
        self.dir = tempfile.mkdtemp(prefix=f"rlsync-stall-{policy}-")
        try:
            self.address = self._start(cfg)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg) -> str:
        args = [sys.executable, "-m", "rlsync.serve", *engine_overrides(cfg, self.policy), f"hydra.run.dir={self.dir}"]
        env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
        with signals_held():
            self.proc = subprocess.Popen(
                args,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # its own process group: close() ends it whole; a Ctrl-C reaches the bench
                preexec_fn=die_with_this_process(),
            )
        for stream, sink in ((self.proc.stdout, self.lines), (self.proc.stderr, self.errors)):
            reader = threading.Thread(target=lambda s=stream, d=sink: d.extend(iter(s.readline, "")), daemon=True)
            reader.start()
            self.readers.append(reader)
        deadline = time.monotonic() + START_S
        while not any(" listening on " in ln for ln in self.lines):
            if self.proc.poll() is not None:
                for reader in self.readers:  # its last lines, read to the end of its pipes
                    reader.join(5)
                raise self._failed(exit_description(self.proc.returncode))
            if time.monotonic() > deadline:
                raise self._failed(f"not listening after {START_S} s")
            time.sleep(0.05)
        line = next(ln for ln in self.lines if " listening on " in ln)
        return line.split(" listening on ", 1)[1].split()[0]

    def _failed(self, how: str) -> EngineDidNotStart:
        reason = engine_reason(self.errors) or "no output"
        return EngineDidNotStart(
            f"the engine for serve.update_policy={self.policy} (python -m rlsync.serve) did not start: {reason} ({how})"
        )

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # its group: start_new_session made the engine its leader

    def close(self) -> None:
        """The engine's process group ended (SIGTERM, then SIGKILL), its output read, its directory removed; once."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                self._signal_group(signal.SIGTERM)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self._signal_group(signal.SIGKILL)
                    self.proc.wait(10)
            for reader in self.readers:
                reader.join(5)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Answer:
    prompt: list[int]
    sent: float  # perf_counter before the request went out
    arrivals: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reason: str = ""
    failed: str = ""

    def waits(self) -> list[tuple[float, float]]:
        """(start, end) of every wait of this answer's client: the request to its first token, then token to token."""
        stamps = [self.sent, *self.arrivals]
        return list(itertools.pairwise(stamps))


class Clients:
    """`count` threads, each streaming answers one after another until stopped."""

    def __init__(self, address: str, count: int, *, tokens: int, allowed: list[int], seed: int):
        self.address, self.tokens, self.allowed = address, tokens, allowed
        self.answers: list[Answer] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._client, args=(random.Random(seed * 1000 + i),), daemon=True)
            for i in range(count)
        ]
        for thread in self.threads:
            thread.start()

    def _client(self, rng: random.Random) -> None:
        while not self.stop.is_set():
            prompt = [rng.choice(self.allowed) for _ in range(PROMPT_TOKENS)]
            request = StreamRequest(
                prompt=prompt, max_new_tokens=self.tokens, temperature=1.0, seed=rng.randrange(1 << 31)
            )
            stamps: list[float] = []
            answer = Answer(prompt, 0.0)
            try:
                for arrived, line in stream_answer(self.address, request, timeout_s=REQUEST_S, stamps=stamps):
                    if line.kind == "token":
                        answer.arrivals.append(arrived)
                        answer.tokens.append(line.token)
                        answer.logprobs.append(line.logprob)
                        answer.versions.append(line.version)
                    else:
                        answer.reason = line.reason or ""
                        answer.failed = line.error or ("" if line.reason in ("eos", "length") else line.reason or "")
            except StreamFailed as err:
                answer.failed = str(err)
            answer.sent = stamps[0] if stamps else time.perf_counter()
            with self.lock:
                self.answers.append(answer)

    def finish(self, timeout_s: float) -> list[Answer]:
        """Stop after the answers in progress; every thread joined within `timeout_s` (or RuntimeError)."""
        self.stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self.threads):
            raise RuntimeError(f"a streaming client did not finish within {timeout_s:g} s")
        return self.answers


def process_cpu_s() -> float:
    """CPU seconds this process has used, every thread (the trainer's side: the pack, gloo, the clients)."""
    times = os.times()
    return times.user + times.system


def quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class StallTarget:
    """`bench.target=stall`: one repeat = one update under streaming load, for each policy."""

    name = "stall"

    def __init__(self, cfg, device: torch.device):
        self.cfg, self.device = cfg, device
        self.engines: dict[str, EngineServe] = {}
        self.sides: dict = {}
        t0 = time.perf_counter()
        dtype = torch_dtype(cfg.trainer.dtype)
        self.models = [
            named_weights(build_model(cfg.model, dtype=dtype, device=device, seed=cfg.run.seed + k)) for k in (0, 1)
        ]
        tokenizer = build_tokenizer(cfg.model)
        self.allowed = [int(i) for i in tokenizer.allowed_ids(cfg.model.vocab_size).nonzero().flatten()]
        self.scorer = engine_spec(cfg.model, cfg.rollout, device=device, tokenizer=tokenizer).build()
        self.scored = -1  # which model the scorer holds
        self.current = 0  # which model the engines hold
        self.repeats = 0
        self.scorer_names = set(self.scorer.weights)
        self.totals: dict[str, int] = {}  # counts over the timed repeats, reported as running totals
        try:
            for policy in cfg.bench.policies:
                self.engines[policy] = EngineServe(cfg, policy)
                remote = standalone_trainer(cfg, self.engines[policy].address)  # as bench.target=stall's rule checked
                side = open_update_side(remote, self.models[0], device=device, tokenizer=tokenizer)
                side.transport.update_weights(side.weights)  # the first update fills the engine
                self.sides[policy] = side
        except BaseException:
            self.close()
            raise
        side = next(iter(self.sides.values()))
        self.setup = {
            "build_time": time.perf_counter() - t0,
            "transport": side.update_cfg.transport,  # whatever update.transport says: the one that joins the engines
            "update_bytes": side.update_bytes,
            **side.info,
            "buckets": len(side.buckets),
            "resolved": side.resolved,
            METRIC: {"policies": list(cfg.bench.policies), "clients": cfg.bench.clients},  # summary.json's "pause"
        }

    def repeat(self) -> dict[str, float]:
        self.repeats += 1
        new = 1 - self.current
        order = list(self.cfg.bench.policies)
        if self.repeats % 2 == 0:
            order.reverse()  # neither policy always runs first (a shared machine drifts)
        row: dict[str, float] = {}
        for policy in order:
            row.update(self.event(policy, new))
        self.current = new
        pair = compared(order)
        if pair is not None:  # the other policy's longest gap over the baseline's, in the same repeat
            other, baseline = (row.get(f"{METRIC}/{p}/max_gap_time") for p in pair)
            if other is not None and baseline:
                row[f"{METRIC}/gap_ratio"] = other / baseline
        return row

    def event(self, policy: str, new: int) -> dict[str, float]:
        cfg, side, engine = self.cfg.bench, self.sides[policy], self.engines[policy]
        weights = update_tensors(self.models[new], self.cfg.model.update_layout, side.layout)  # the update's names
        clients = Clients(
            engine.address, cfg.clients, tokens=cfg.answer_tokens, allowed=self.allowed, seed=self.repeats
        )
        try:
            time.sleep(RAMP_S)
            start = serving_state(engine.address, timeout_s=30)  # the engine's CPU counters, before
            w0, t_cpu0 = time.perf_counter(), process_cpu_s()
            time.sleep(max(0.0, w0 + cfg.before_s - time.perf_counter()))
            at_update = serving_state(engine.address, timeout_s=30)
            cpu0, u0 = process_cpu_s(), time.perf_counter()
            side.transport.update_weights(weights)
            u1, trainer_cpu = time.perf_counter(), process_cpu_s() - cpu0
            after = serving_state(engine.address, timeout_s=30)
            swap = after.last_update
            time.sleep(max(0.0, swap.pause_end + cfg.after_s - time.perf_counter()))
        finally:
            answers = clients.finish(REQUEST_S)
        window = (u0 - cfg.before_s, swap.pause_end + cfg.after_s)
        waits = [w for a in answers for w in a.waits() if window[0] <= w[1] <= window[1]]
        during = [end - start for start, end in waits if end >= u0]
        before = [end - start for start, end in waits if end < u0]
        arrivals = sorted(t for a in answers for t in a.arrivals)
        swap_end = max(u1, swap.pause_end)
        tokens_before = sum(1 for t in arrivals if u0 - cfg.before_s <= t < u0) / cfg.before_s
        tokens_during = sum(1 for t in arrivals if u0 <= t <= swap_end) / max(swap_end - u0, 1e-9)
        resumed = [t for t in arrivals if t >= swap.pause_end]
        failed_requests(answers, policy, self.repeats)
        checked, worst, failures = self.verify(answers, swap, new) if verified(policy) else (0, math.nan, 0)
        if failures:
            raise RequestsFailed(
                f"{failures} of {checked} answers the {policy} engine started after its swap in repeat {self.repeats} "
                f"did not come from the new weights (largest |streamed - teacher-forced| log-prob {worst:.3g}, "
                f"allowed {LOGPROB_TOL}; or a token of another version): the engine served wrong weights"
            )
        p = f"{METRIC}/{policy}"
        receive_s = max(swap.receive_end - swap.receive_start, 1e-9)
        counts = {"answers": len(answers), "answers_failed": failures}  # 0: a failure ends the bench above
        counts["answers_verified"] = checked
        if self.repeats > self.cfg.bench.warmup:  # running totals over the timed repeats: their max is the total
            for name, count in counts.items():
                self.totals[f"{p}/{name}_total"] = self.totals.get(f"{p}/{name}_total", 0) + count
        return {
            **{f"{p}/{name}": count for name, count in counts.items()},
            **{k: v for k, v in self.totals.items() if k.startswith(p + "/")},
            f"{p}/max_gap_time": max(during, default=math.nan),
            f"{p}/max_gap_before_time": max(before, default=math.nan),
            f"{p}/gap_p50_time": quantile(before + during, 0.5),
            f"{p}/gap_p99_time": quantile(before + during, 0.99),
            f"{p}/pause_time": swap.pause_end - swap.pause_start,
            f"{p}/receive_time": swap.receive_end - swap.receive_start,
            f"{p}/pause_to_token_time": (resumed[0] - swap.pause_start) if resumed else math.nan,
            f"{p}/update_time": u1 - u0,
            # how the cores were shared, in CPU seconds per second of wall time: before the update (the
            # engine's decoder thread, the rest of the engine process, this process: the clients), and
            # during the receive (the rest of the engine: the receive, gloo, the decoder's OpenMP workers)
            f"{p}/cores_before_decoder": (at_update.decoder_cpu_s - start.decoder_cpu_s) / (u0 - w0),
            f"{p}/cores_before_engine_other": (
                (at_update.engine_cpu_s - start.engine_cpu_s) - (at_update.decoder_cpu_s - start.decoder_cpu_s)
            )
            / (u0 - w0),
            f"{p}/cores_before_trainer": (cpu0 - t_cpu0) / (u0 - w0),
            f"{p}/cores_decoder": swap.decoder_cpu_s / receive_s,
            f"{p}/cores_engine_other": (swap.engine_cpu_s - swap.decoder_cpu_s) / receive_s,
            f"{p}/cores_trainer": trainer_cpu / max(u1 - u0, 1e-9),
            f"{p}/tokens_per_s_before": tokens_before,
            f"{p}/tokens_per_s_during": tokens_during,
            f"{p}/tokens_ratio": tokens_during / tokens_before if tokens_before else math.nan,
            f"{p}/staged_bytes": swap.staged_bytes,
            f"{p}/verify_max_diff": worst,
            f"{p}/swap_pointer": 1.0 if swap.swap == "pointer swap" else 0.0,
        }

    # -- the check: answers started after the swap come from the new weights -----------------------

    @torch.no_grad()
    def teacher_forced(self, which: int, answer: Answer) -> torch.Tensor:
        if self.scored != which:
            named = update_tensors(self.models[which], self.cfg.model.update_layout)  # the engine's names (MoE)
            self.scorer.load_weights((n, t) for n, t in named.items() if n in self.scorer_names)
            self.scored = which
        ids = torch.tensor([answer.prompt + answer.tokens], device=self.device)
        logits = self.scorer.model(input_ids=ids).logits[0, len(answer.prompt) - 1 : -1]
        tokens = torch.tensor(answer.tokens, device=self.device)
        return token_logprobs(logits, tokens, allowed=self.scorer.allowed, temperature=1.0).cpu()

    def verify(self, answers: list[Answer], swap, new: int) -> tuple[int, float, int]:
        """(answers checked, the largest |streamed - new weights'| log-prob, answers that failed the check)."""
        after = [a for a in answers if a.sent > swap.pause_end and a.tokens and not a.failed]
        worst, failures = 0.0, 0
        scores = {}
        for which in (new, 1 - new):  # one weight load each
            scores[which] = [self.teacher_forced(which, a) for a in after]
        for k, answer in enumerate(after):
            streamed = torch.tensor(answer.logprobs)
            to_new = float((streamed - scores[new][k]).abs().max())
            to_old = float((streamed - scores[1 - new][k]).abs().max())
            worst = max(worst, to_new)
            if to_new > LOGPROB_TOL or to_old <= to_new or set(answer.versions) != {swap.version}:
                failures += 1
        return len(after), worst, failures

    def breakdown(self) -> list[dict]:
        return []

    def close(self) -> None:
        """Every update side (its session with an engine, then its transport), then every engine server, closed,
        each whatever the one before raised (the first is raised)."""
        closing = [side.close for side in self.sides.values()] + [e.close for e in self.engines.values()]
        self.sides, self.engines = {}, {}
        first = None
        for close in closing:
            try:
                close()
            except Exception as err:  # noqa: BLE001 - the next engine must still be ended
                first = first or err
        if first is not None:
            raise first

    # -- the table -----------------------------------------------------------------------------

    @staticmethod
    def table(result: dict) -> str:
        m = result["metrics"]
        policies = measured_policies(m)

        def get(key: str, which: str = "median"):
            return m.get(key, {}).get(which)

        def spread(key: str) -> str:
            return fmt_spread(*(get(key, w) for w in ("median", "min", "max")))

        def rate(key: str) -> str:
            v = get(key)
            return "n/a" if v is None or math.isnan(v) else f"{v:.1f}"

        head = [
            "policy",
            "swap",
            "longest gap (median, min to max)",
            "gap p50",
            "gap p99",
            "hold",
            "hold to first token",
            "tokens/s before",
            "tokens/s during update",
            "during / before",
            "staged copy",
            "answers checked (failed)",
        ]
        rows = []
        for p in policies:
            k = f"{METRIC}/{p}"
            swap = swap_phrase(p, get(f"{k}/swap_pointer"))
            ratio = get(f"{k}/tokens_ratio")
            staged = get(f"{k}/staged_bytes")
            rows.append(
                [
                    p,
                    swap,
                    spread(f"{k}/max_gap_time"),
                    fmt_seconds(get(f"{k}/gap_p50_time")),
                    fmt_seconds(get(f"{k}/gap_p99_time")),
                    fmt_seconds(get(f"{k}/pause_time")),
                    fmt_seconds(get(f"{k}/pause_to_token_time")),
                    rate(f"{k}/tokens_per_s_before"),
                    rate(f"{k}/tokens_per_s_during"),
                    "n/a" if ratio is None or math.isnan(ratio) else f"{ratio:.2f}",
                    fmt_bytes(staged) if staged else "0 (none)",
                    f"{int(sum_of(result, f'{k}/answers_verified'))} ({int(sum_of(result, f'{k}/answers_failed'))})",
                ]
            )
        clients = (result.get("config") or {}).get("bench", {}).get("clients")
        out = [
            f"\nClient-seen stall, {result['model']['name']}: {result['measured_steps']} updates per policy after "
            f"{result['warmup_steps']} warm-up, {clients} streaming clients",
            markdown_table(head, rows),
        ]
        pair = compared(policies)
        if pair is not None and get(f"{METRIC}/gap_ratio") is not None:
            out.append(gap_ratio_line(get, *pair))
        for p in policies:
            k = f"{METRIC}/{p}"
            if get(f"{k}/cores_decoder") is not None:
                out.append(
                    f"Cores under {p} (CPU s per s, median), before the update -> during the receive: the engine's "
                    f"decoder thread {get(f'{k}/cores_before_decoder'):.2f} -> {get(f'{k}/cores_decoder'):.2f}, "
                    f"the engine's other threads (receive, gloo, the decoder's OpenMP workers) "
                    f"{get(f'{k}/cores_before_engine_other'):.2f} -> {get(f'{k}/cores_engine_other'):.2f}, "
                    f"the trainer's process (clients; pack, send) {get(f'{k}/cores_before_trainer'):.2f} -> "
                    f"{get(f'{k}/cores_trainer'):.2f}"
                )
        out.append(verified_line(result, policies))
        return "\n".join(out)


def measured_policies(metrics: dict) -> list[str]:
    """The policies a run measured (its metrics pause/<policy>/max_gap_time), registered ones in registry order
    first (a recorded run's, and the report's, order)."""
    found = [k.split("/")[1] for k in metrics if k.count("/") == 2 and k.startswith(f"{METRIC}/")]
    found = [p for p in dict.fromkeys(found) if f"{METRIC}/{p}/max_gap_time" in metrics]
    registered = update_policy_names()
    return sorted(found, key=lambda p: registered.index(p) if p in registered else len(registered))


def declared(policy: str, fact: str, default):
    """What policy `policy` declares of itself (an UpdatePolicy class attribute); `default` for a name no longer
    registered (a recorded run's)."""
    return getattr(update_policy_class(policy), fact) if policy in update_policy_names() else default


def compared(policies) -> tuple[str, str] | None:
    """(the other, the baseline) when the bench compares two policies and one holds generation for the whole
    receive (`holds_whole_receive`): pause/gap_ratio (its recorded name) is the other's longest gap over the
    baseline's, per repeat."""
    policies = list(policies)
    baselines = [p for p in policies if declared(p, "holds_whole_receive", False)]
    if len(policies) != 2 or len(baselines) != 1:
        return None
    other = next(p for p in policies if p != baselines[0])
    return other, baselines[0]


def verified(policy: str) -> bool:
    """Whether the check applies: the policy declares every answer started after its swap the new weights'."""
    return declared(policy, "fresh_after_swap", True)


def swap_phrase(policy: str, pointer) -> str:
    """How an update reached the engine's weights under `policy` (the bench's and the report's "swap" column);
    `pointer`: pause/<policy>/swap_pointer's median."""
    return update_policy_class(policy).swap_phrase(pointer) if policy in update_policy_names() else "n/a"


def gap_ratio_line(get, other: str, baseline: str) -> str:
    """The other policy's longest gap against the baseline's: the ratio of the two medians the table shows, then
    the median of the per-update ratios (each repeat's other over the same repeat's baseline), which may differ."""
    a, b = get(f"{METRIC}/{other}/max_gap_time"), get(f"{METRIC}/{baseline}/max_gap_time")
    ratio = f"{METRIC}/gap_ratio"
    return (
        f"{other} / {baseline}, longest gap: {a / b:.2f} (the medians above, {fmt_seconds(a)} / "
        f"{fmt_seconds(b)}); per update, {other}'s over {baseline}'s in the same repeat: median "
        f"{get(ratio):.2f} ({get(ratio, 'min'):.2f} to {get(ratio, 'max'):.2f})"
    )


def verified_line(result: dict, policies: list[str]) -> str:
    """What the check found: a failed request or answer ends the bench (RequestsFailed), so a finished one
    either verified answers or had none to verify, which is said, not called verified."""
    checked = int(sum(sum_of(result, f"{METRIC}/{p}/answers_verified") for p in policies))
    unchecked = [p for p in policies if not verified(p)]
    if unchecked:  # a policy that does not declare its answers after the swap fresh: nothing to check of it
        return (
            f"Not verified for {', '.join(unchecked)} (it does not declare every answer after its swap the new "
            f"weights'); {checked} answers of the others verified"
        )
    if not checked:
        return (
            "Not verified: no answer started after a swap within bench.after_s, so none was scored (a longer "
            "bench.after_s or a shorter bench.answer_tokens lets some start)"
        )
    return (
        f"Verified: {checked} answers started after a swap, each scored with the new and the old weights: "
        f"all came from the new weights."
    )


def failed_requests(answers: list[Answer], policy: str, repeat: int) -> None:
    """RequestsFailed if any streaming request failed (refused, broken, ended by an error): its gaps and rates
    would be a failing engine's, not a stall's. The line counts them and gives the most common reason."""
    failed = [a.failed for a in answers if a.failed]
    if failed:
        reason, times = Counter(failed).most_common(1)[0]
        raise RequestsFailed(
            f"{len(failed)} of {len(answers)} streaming requests to the {policy} engine failed in repeat {repeat} "
            f"({times} of them: {reason[:300]}): no stall is measured from failed requests"
        )


def sum_of(result: dict, key: str) -> float:
    """A count summed over the timed repeats: the largest of its running total."""
    stats = result["metrics"].get(key + "_total")
    return stats["max"] if stats else 0.0
