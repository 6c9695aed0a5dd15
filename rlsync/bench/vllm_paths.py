"""`bench.target=vllm_paths`: vLLM's three ways of taking new weights, side by side on one model and one bucket plan.

    python -m rlsync.bench bench.target=vllm_paths rollout.engine=vllm
    python -m rlsync.bench bench.target=vllm_paths rollout.engine=vllm model=qwen3_0p6b bench.repeats=3 bench.warmup=1

Every repeat updates each path to the same new weights (two trainer models, seeds run.seed and run.seed + 1,
alternate, so every update changes every weight), the paths in a rotating order (a shared machine's drift falls
on each alike):

- `rlsync_reload`: rlsync's reload path as `rollout.engine=vllm` runs it today (`update.strategy=bucketed`, the
  direct transport): `VLLMEngine.load_weights` per bucket, the trainer's tensors handed to vLLM's worker
  `reload_weights`, the parts of a fused layer held until the layer is whole, a tied lm_head re-packed;
- `vllm_reload`: vLLM's reload per bucket as its users call it, `LLM.collective_rpc("reload_weights",
  kwargs={"weights_iterator": ...})`, the same buckets, nothing held back, nothing re-packed, on an engine of its
  own (what it leaves behind is not the next path's to repair);
- `vllm_weight_transfer`: vLLM's four phases (init once, then start, update per chunk, finish) through the
  weight-transfer engine registered with vLLM's factory: `update.strategy=vllm_shm` on a CPU (shared memory,
  rlsync/engines/vllm_shm.py), `vllm_ipc` on CUDA; an engine of its own (vLLM's transfer config is fixed at start).

Each is timed as every update is (`rlsync.update.timed_update`: synchronized, `bench.warmup` repeats left out,
median and spread over `bench.repeats`), against its own floor re-timed right before it: the copy every
update makes plus the copies its receiver declares (`Engine.receiver_copies`: the four phases' load and copy
back; none for the reload path). After each update (untimed) the engine samples answers and the trainer scores
them with the weights just sent and with the others, as tests/process/test_vllm.py compares them: the path is
verified when the engine's log-probs sit SEPARATION times closer to the new weights' than to the old ones'
(on average over the answer tokens; a NaN fails). A path that fails is timed all the same and its row says so (summary.json
`warning`): a comparison that hid it would rank a wrong update.

Rows: `vllm_paths/<path>/<metric>` per repeat (the `perf/update_weights_*` family without `perf/`, and
`logprob_max_diff`, `logprob_mean_diff`, `logprob_old_mean_diff`, `verified`); summary.json `vllm_paths` names
each path's calls and receiver copies and the machine's load average before and after.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import torch

from rlsync.engines.base import engine_class, engine_spec
from rlsync.engines.vllm import NATIVE_DEVICES, api_refusal, quiet_reload_logs, unavailable_reason, vllm_api_missing
from rlsync.engines.vllm_api import installed_version
from rlsync.errors import ConfigError, show
from rlsync.fmt import fmt_bytes, fmt_ratio, fmt_seconds, fmt_sig, fmt_spread, markdown_table, plural
from rlsync.measure.devices import explicit_device
from rlsync.measure.floors import CopyProbe
from rlsync.measure.timing import unit_timer
from rlsync.model.architecture import update_tensors
from rlsync.model.build import build_model, build_tokenizer, named_weights, torch_dtype
from rlsync.trainer.grpo import sequence_logprobs
from rlsync.update import close_update, open_update, timed_update
from rlsync.update.base import Transport, UpdateResult
from rlsync.update.side import open_update_side

PATHS = ("rlsync_reload", "vllm_reload", "vllm_weight_transfer")  # the table's order
CALLS = {
    "rlsync_reload": "VLLMEngine.load_weights per bucket (worker reload_weights; fused layers held whole, tied lm_head re-packed)",
    "vllm_reload": 'LLM.collective_rpc("reload_weights", weights_iterator=...) per bucket, as vLLM users call it',
    "vllm_weight_transfer": "vLLM's four phases (start, update_weights per chunk, finish) through update.strategy={native}",
}
# The check compares as tests/process/test_vllm.py does (the engine's sampled answers scored by the trainer), with a
# bound that holds across models: a bf16 engine against the fp32 trainer moved a token's log-prob by 0.003 on average
# on the tiny model and 0.011 on Qwen3-0.6B (28 layers), where the other weights sat 0.45 and 1.1 away. Verified: the
# answers are SEPARATION times closer to the weights just sent than to the others (a NaN fails).
SEPARATION = 20.0
VERIFY_TEMPERATURE = 0.7  # not 1: both sides must divide by the same temperature
VERIFY_PROMPTS = ("Repeat after me: abcde\nAnswer: ", "hello", "x" * 40)
VERIFY_SAMPLES = 2  # answers per prompt
VERIFY_TOKENS = 12  # answer length, at most rollout.max_response_len


def native_strategy(device_type: str) -> str:
    """vLLM's own four-phase transfer on this device: vllm_shm on a CPU, vllm_ipc on CUDA."""
    return next(s for s, d in NATIVE_DEVICES.items() if d == ("cuda" if device_type == "cuda" else "cpu"))


class VllmReloadCalls(Transport):
    """vLLM's reload per bucket, as a vLLM user calls it: one worker `reload_weights` per bucket, nothing else."""

    def __init__(self, buckets):
        self.buckets = buckets

    def start_engine(self, spec):
        return spec.build(strategy="bucketed")

    def send_weights(self, weights: dict[str, torch.Tensor]) -> UpdateResult:
        timer = unit_timer(self.engine.device)
        rows: list[dict] = []
        for bucket in self.buckets:
            rows.append({"bytes": bucket.nbytes})
            named = [(name, weights[name]) for name in bucket.names]
            with timer("load", rows[-1]):
                self.engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named)})
        timer.resolve()
        return UpdateResult(dict(timer.seconds), rows)

    def close(self) -> None:
        self.engine = None  # nothing of its own: the engine is closed first (close_update)


class VllmPathsTarget:
    """`bench.target=vllm_paths`: one repeat = one update through each path, each checked against the trainer."""

    name = "vllm_paths"

    @classmethod
    def check_config(cls, root) -> None:
        """vLLM importable, rollout.engine=vllm, the reload path's own keys (the target sets each path's strategy),
        and vLLM's four-phase API for this device: each refused in one line before anything is built."""
        reason = unavailable_reason()
        if reason:
            raise ConfigError("bench.target", "vllm_paths", "another bench.target: vLLM's paths need vLLM", reason)
        if root.rollout.engine != "vllm":
            raise ConfigError(
                "rollout.engine",
                root.rollout.engine,
                "vllm with bench.target=vllm_paths (it compares vLLM's update paths)",
                "not allowed with bench.target=vllm_paths",
            )
        update = root.update
        wanted = {"transport": "direct", "strategy": "bucketed", "source": "device"}
        for name, value in wanted.items():
            if getattr(update, name) != value:
                raise ConfigError(
                    f"update.{name}",
                    getattr(update, name),
                    f"{value} with bench.target=vllm_paths (the reload path as rollout.engine=vllm runs it; the "
                    "target runs vLLM's reload and its four phases itself)",
                    "not allowed with bench.target=vllm_paths",
                )
        for name, value, allowed in (
            ("update.payload", update.payload, "full"),
            ("trainer.lora.rank", root.trainer.lora.rank, 0),
        ):
            if value != allowed:
                raise ConfigError(
                    name,
                    value,
                    f"{allowed} with bench.target=vllm_paths (every path sends the whole weights as trained)",
                    "not allowed with bench.target=vllm_paths",
                )
        native = native_strategy("cuda" if root.run.device != "cpu" and torch.cuda.is_available() else "cpu")
        reason = api_refusal(installed_version() or "unknown", vllm_api_missing(native))
        if reason:
            raise ConfigError(
                "bench.target",
                "vllm_paths",
                f"another bench.target: {native}, vLLM's four phases here, needs that API",
                reason,
            )

    def __init__(self, cfg, device: torch.device):
        self.cfg, self.device = cfg, device
        self.side = self.native_engine = self.native_transport = self.raw_engine = self.raw_transport = None
        self.load_start = os.getloadavg()
        t0 = time.perf_counter()
        dtype = torch_dtype(cfg.trainer.dtype)
        self.models = [build_model(cfg.model, dtype=dtype, device=device, seed=cfg.run.seed + k) for k in (0, 1)]
        params = [named_weights(m) for m in self.models]
        tokenizer = build_tokenizer(cfg.model)
        self.allowed = tokenizer.allowed_ids(cfg.model.vocab_size).to(device)
        self.prompts = [tokenizer.encode(p) for p in VERIFY_PROMPTS] * VERIFY_SAMPLES
        self.native = native_strategy(device.type)
        try:
            # rlsync's reload path as UpdateTarget opens it: the floors first, the auto knobs, then the engine
            side = self.side = open_update_side(
                cfg,
                params[0],
                device=device,
                tokenizer=tokenizer,
                state_bytes=sum(t.numel() * t.element_size() for t in params[0].values()),
            )
            self.weights = [side.weights, update_tensors(params[1], cfg.model.update_layout, side.layout)]
            native_update = dataclasses.replace(side.update_cfg, strategy=self.native)
            spec = engine_spec(cfg.model, cfg.rollout, device=explicit_device(device), tokenizer=tokenizer)
            self.native_engine, self.native_transport = open_update(native_update, spec=spec, buckets=side.buckets)
            # an engine of its own: what vLLM's reload leaves behind (a layer rebuilt from half its parts) is not
            # rlsync's path's to repair (on a shared engine rlsync's next update read back NaN on Qwen3-0.6B)
            raw = self.raw_transport = VllmReloadCalls(side.buckets)
            self.raw_engine = raw.start_engine(dataclasses.replace(spec, verify=False))
            raw.connect(self.raw_engine)
        except BaseException:
            self.close()
            raise
        quiet_reload_logs()  # vLLM's per-weight notices of a partial load: per call, by design (untimed)
        verify = side.update_cfg.verify
        self.paths = {
            "rlsync_reload": (side.transport, side.engine, side.update_cfg),
            "vllm_reload": (
                raw,
                self.raw_engine,
                dataclasses.replace(side.update_cfg, verify=False),
            ),  # records nothing
            "vllm_weight_transfer": (
                self.native_transport,
                self.native_engine,
                dataclasses.replace(native_update, verify=verify and self.native != "vllm_ipc"),
            ),
        }
        copies = {
            path: engine_class(cfg.rollout.engine).receiver_copies(
                dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, strategy=strategy))
            )
            for path, strategy in zip(PATHS, ("bucketed", "bucketed", self.native))
        }
        floors = side.floors
        self.probes = {  # one per count of receiver copies: the reload paths share theirs
            n: CopyProbe(
                device,
                update_bytes=side.update_bytes,
                read_bytes=side.read_bytes,
                source=cfg.update.source,
                dtypes=floors.dtypes,
                receiver_copies=n,
            )
            for n in {len(c) for c in copies.values()}
        }
        self.copies = copies
        self.current, self.repeats = 1, 0  # model 0 goes in first
        self.setup = {
            "build_time": time.perf_counter() - t0,
            "transport": "direct",
            "update_bytes": side.update_bytes,
            "read_bytes": side.read_bytes,
            **side.info,
            "layout": cfg.model.update_layout,
            "buckets": len(side.buckets),
            "largest_bucket_bytes": max(b.nbytes for b in side.buckets),
            "limits": floors.as_dict(),
            "resolved": side.resolved,
            "vllm_paths": {
                "paths": {
                    path: {
                        "calls": CALLS[path].format(native=self.native),
                        "strategy": strategy,
                        "receiver_copies": list(copies[path]),
                    }
                    for path, strategy in zip(PATHS, ("bucketed", "bucketed", self.native))
                },
                "vllm": installed_version(),
                "reload_mode": cfg.rollout.vllm_reload_mode,
                "verify": {"temperature": VERIFY_TEMPERATURE, "separation": SEPARATION, "answers": len(self.prompts)},
                "load_average_start": list(self.load_start),
                "load_average_end": None,  # after the last repeat
            },
        }

    def repeat(self) -> dict[str, float]:
        self.repeats += 1
        new = 1 - self.current
        shift = self.repeats % len(PATHS)
        row: dict[str, float] = {}
        for path in PATHS[shift:] + PATHS[:shift]:  # each path first in turn: a drifting machine falls on all
            transport, engine, update_cfg = self.paths[path]
            floor_time = self.probes[len(self.copies[path])].floor_time()
            metrics = timed_update(
                transport,
                self.weights[new],
                buckets=self.side.buckets,
                cfg=update_cfg,
                device=self.device,
                floor_time=floor_time,
            )
            metrics.update(self.check(engine, new))
            row.update({f"vllm_paths/{path}/{k.removeprefix('perf/')}": v for k, v in metrics.items()})
        self.current = new
        self.setup["vllm_paths"]["load_average_end"] = list(os.getloadavg())
        return row

    @torch.no_grad()
    def check(self, engine, new: int) -> dict[str, float]:
        """The engine's answers scored by the trainer with the weights just sent and with the others (untimed)."""
        tokens = min(VERIFY_TOKENS, self.cfg.rollout.max_response_len)
        generator = torch.Generator().manual_seed(self.cfg.run.seed + self.repeats)
        gen = engine.generate(self.prompts, max_new_tokens=tokens, temperature=VERIFY_TEMPERATURE, generator=generator)
        mask = gen.response_mask.bool()
        gaps = []
        for which in (new, 1 - new):
            trainer = sequence_logprobs(
                self.models[which], gen, allowed=self.allowed, temperature=VERIFY_TEMPERATURE, micro_batch_size=8
            )
            gaps.append((gen.logprobs - trainer).abs()[mask].float().cpu())
        fresh, stale = gaps
        worst, mean, old = float(fresh.max()), float(fresh.mean()), float(stale.mean())
        return {
            "logprob_max_diff": worst,
            "logprob_mean_diff": mean,
            "logprob_old_mean_diff": old,
            "verified": float(verified(mean, old)),
        }

    def breakdown(self) -> list[dict]:
        return []

    def close(self) -> None:
        """Each path's engine and channel: the four phases', vLLM's reload's, rlsync's path's (each whatever the
        one before raised)."""
        native, self.native_engine, self.native_transport = (self.native_engine, self.native_transport), None, None
        raw, self.raw_engine, self.raw_transport = (self.raw_engine, self.raw_transport), None, None
        side, self.side = self.side, None
        try:
            close_update(*native)
        finally:
            try:
                close_update(*raw)
            finally:
                if side is not None:
                    side.close()

    @staticmethod
    def warning(stats: dict) -> str | None:
        """summary.json's and the table's line on the paths that failed their check in some timed repeat."""
        failed = [p for p in PATHS if stats.get(f"vllm_paths/{p}/verified", {}).get("min") == 0]
        if not failed:
            return None
        return (
            f"NOT VERIFIED: {', '.join(failed)}: after at least one timed update the engine's log-probs did not "
            "match the weights just sent (timed all the same: its time is not a correct update's)"
        )

    @staticmethod
    def verdict(metrics: dict) -> str | None:
        """The report's verdict line: each path's median update against its own floor, and whether every timed
        repeat verified it ("rlsync_reload 20.9 ms (1.4x its floor); vllm_reload 19.7 ms (1.3x its floor, NOT
        VERIFIED); ..."). None where no path was timed."""
        parts = []
        for path in PATHS:
            seconds = path_stat(metrics, path, "update_weights_time").get("median")
            if seconds is None:
                continue
            eff = path_stat(metrics, path, "update_weights_efficiency").get("median")
            against = f"{fmt_ratio(1 / eff)} its floor" if eff else "no floor measured"
            ok = "" if path_stat(metrics, path, "verified").get("min") == 1 else ", NOT VERIFIED"
            parts.append(f"{path} {fmt_seconds(seconds)} ({against}{ok})")
        return "; ".join(parts) or None

    # -- the table -----------------------------------------------------------------------------

    @staticmethod
    def table(result: dict) -> str:
        m, s = result["metrics"], result["setup"]
        info = result.get("vllm_paths") or {}
        paths = info.get("paths") or {}

        def get(path: str, key: str, which: str = "median"):
            return path_stat(m, path, key).get(which)

        def spread(path: str, key: str) -> str:
            return fmt_spread(*(get(path, key, w) for w in ("median", "min", "max")))

        head = [
            "path",
            "strategy",
            "time (median, min to max)",
            "floor (median, min to max)",
            "receiver copies in floor",
            "time / floor",
            "GB/s",
            "load (vLLM)",
            "verified (max / mean |log-prob diff|, old weights' mean)",
        ]
        rows = []
        for path in PATHS:
            if get(path, "update_weights_time") is None:
                continue
            eff = get(path, "update_weights_efficiency")
            load = get(path, "update_weights_load_time")
            rows.append(
                [
                    path,
                    (paths.get(path) or {}).get("strategy", "n/a"),
                    spread(path, "update_weights_time"),
                    spread(path, "update_weights_limit_time"),
                    ", ".join((paths.get(path) or {}).get("receiver_copies") or []) or "none",
                    fmt_ratio(1 / eff) if eff else "n/a",
                    fmt_sig(get(path, "update_weights_gbps"), decimals=1),
                    fmt_seconds(load) if load is not None else "-",
                    verified_cell(m, path),
                ]
            )
        start, end = info.get("load_average_start"), info.get("load_average_end")
        load_line = "load average (1, 5, 15 min) " + " -> ".join(
            " ".join(f"{x:.2f}" for x in v) for v in (start, end) if v
        )
        cpu = result.get("cpu") or {}
        busy = [
            f"{cpu[k]:.1f} of {cpu.get('cores')} cores busy with other processes {when}"
            for k, when in (("others_busy_cores_at_start", "at start"), ("others_busy_cores_during_run", "during it"))
            if isinstance(cpu.get(k), (int, float))
        ]
        out = [
            f"\nvLLM's update paths, {result['model']['name']}: {result['measured_steps']} timed repeats each after "
            f"{result['warmup_steps']} warm-up; {plural(s.get('buckets'), 'bucket')} of {s.get('bucket_mb'):g} MiB, "
            f"{fmt_bytes(result['model'].get('update_bytes'))} per update; vllm {info.get('vllm')}, "
            f"rollout.vllm_reload_mode={show(info.get('reload_mode'))}",
            markdown_table(head, rows),
            f"Machine: {load_line}" + (f"; {', '.join(busy)}" if busy else "") + ".",
        ]
        if line := VllmPathsTarget.warning(m):
            out.append(line)
        if str(s.get("device", "cpu")).startswith("cpu"):
            out.append(
                "A ranking on a CPU, vLLM's CPU backend beside other processes, is not a GPU's: the copies, the "
                "GEMM re-pack and the per-call overheads weigh differently there."
            )
        return "\n".join(out)


def path_stat(metrics: dict, path: str, key: str) -> dict:
    """One path's statistics of `key` in summary.json's metrics (median, min, max, ...), {} where not recorded."""
    return metrics.get(f"vllm_paths/{path}/{key}") or {}


def verified(mean: float, old: float) -> bool:
    """The weights just sent, not others: the answers' mean log-prob gap to them SEPARATION times under the gap to
    the old ones (NaN, from a head or a layer loaded from nothing, fails every comparison)."""
    return math.isfinite(mean) and math.isfinite(old) and mean * SEPARATION <= old


def verified_cell(metrics: dict, path: str) -> str:
    """ "yes (0.012 / 0.003, 0.41)", or "NO (nan / nan, nan)": the worst repeat's figures (largest gaps to the
    new weights, smallest to the old), "NO" when any timed repeat failed the check."""

    def st(key: str) -> dict:
        return path_stat(metrics, path, key)

    ok = st("verified")
    figures = f"{st('logprob_max_diff').get('max', math.nan):.3g} / {st('logprob_mean_diff').get('max', math.nan):.3g}"
    figures += f", {st('logprob_old_mean_diff').get('min', math.nan):.3g}"
    if ok.get("min") == 1:
        return f"yes ({figures})"
    return f"NO ({figures})"
