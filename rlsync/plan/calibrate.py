"""Fit the cost model's coefficients from benchmark runs: this machine's short ones, or any set of them.

`calibrate(cfg, out_dir)` (`python -m rlsync.plan plan.calibrate=true`) runs short `rlsync.bench` jobs
in this process (one import of torch and transformers for all; an `ipc` job still starts its engine
process) over models built from the model.* keys, bucket sizes, strategies and transports chosen so
that calls, tensors and bytes vary independently enough to separate the three coefficients:

- `tiny` (46 tensors, 5 MiB), `deep` (64 narrow layers: 706 tensors, under 9 MiB: calls and tensors),
  `slab` (a 65536-token embedding and one layer: 13 tensors, 68 MiB: bytes, cheaply),
  `pool` (8 layers whose tensors all but the norms copy on torch's thread pool: 90 tensors, 57 pooled),
  `wide` (a 151936-token embedding and 2 wide layers: 24 tensors, 0.4 GiB: bytes),
  `qwen3_0p6b` (310 tensors, 1.1 GiB: the largest allowed, near the sizes planned);
- bucketed at 512 MiB (few calls) and at small buckets (a call per tensor or so), and per_tensor
  (over ipc all four: a message per tensor, tensors copied on one thread (deep) or on the thread
  pool (the others), and bytes (wide) each cost their own);
- direct and ipc (flat engine weights too with `plan.calibrate_flat=true`);
- then the fitted payloads' jobs (`payload_grid`: each payload whose class declares `fit_terms`, at two changed
  shares where it counts changes, on slab, deep and pool over the first in-process transport), whose encode
  and decode against their floors the calibration's `payloads` fits (rlsync/plan/payload_fit.py);
- then an all-gather over 2 gloo ranks on loopback (`measure_collective`, the run's own GatherFloor probe in
  two spawned processes): its bus bandwidth and per-call latency, the calibration's `collective`, at which the
  planner predicts the trainer.parallel=fsdp2 update's gather from the shards (plan.ranks).

`plan.calibrate_quick=true` keeps the four small models (tiny, deep, slab, pool): per setup still more
runs than coefficients, varying calls, tensors (pooled tensors for per_tensor) and bytes independently,
so that each coefficient it reports is determined (`underdetermined` checks the design matrix's rank).

Every job writes its run directory (summary.json) under the calibration's output dir, so the fit can
be redone from them (`plan.fit_from=DIR`, which reads any bench runs the same way). Each job's wall
time is kept in the calibration file (`wall_s`): the shipped reference calibration's say how long a
calibration takes (`estimate_seconds`).
"""

from __future__ import annotations

import contextlib
import io
import math
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from rlsync.check.estimate import DTYPE_BYTES
from rlsync.config.apps import BenchAppConfig, calibrated_transports
from rlsync.config.files import SUMMARY_MAX, UnreadableFile, read_json
from rlsync.config.schema import Config
from rlsync.errors import ConfigError, RlsyncError
from rlsync.plan import cost, payload_fit, profiles
from rlsync.plan.collective import measure_collective
from rlsync.plan.profiles import underdetermined
from rlsync.update.base import STRATEGIES, transport_class
from rlsync.update.payload import payload_class, recorded_payload

DEEP = {
    "name": "deep",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 512,
}
WIDE = {
    "name": "wide",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
}
SLAB = {  # bytes for few tensors and little time: the quick calibration's per-byte lever
    "name": "slab",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 65536,
    "tie_word_embeddings": True,
}
POOL = {  # every tensor but the norms over the pool grain (32768 elements): the pooled-tensor lever
    "name": "pool",
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 512,
    "tie_word_embeddings": True,
}
OWN_MODELS = {"deep": DEEP, "wide": WIDE, "slab": SLAB, "pool": POOL}
PRESETS = Path(__file__).resolve().parent.parent / "conf" / "model"


def model_keys(name: str) -> dict:
    """model.* of a preset (rlsync/conf/model/NAME.yaml) or of the calibration's own shapes."""
    if name in OWN_MODELS:
        return dict(OWN_MODELS[name])
    return dict(OmegaConf.to_container(OmegaConf.load(PRESETS / f"{name}.yaml")))


# (model, transport, strategy, bucket_mb): the grid; small buckets give many calls for few bytes
GRID = [
    (model, transport, strategy, bucket_mb)
    for transport in calibrated_transports()  # plan.calibrate_transports picks among them
    for model, strategy, bucket_mb in (
        ("tiny", "bucketed", 512),
        ("deep", "bucketed", 512),
        ("deep", "bucketed", 0.0625),
        ("slab", "bucketed", 512),
        ("pool", "bucketed", 512),
        ("wide", "bucketed", 512),
        ("qwen3_0p6b", "bucketed", 512),
        ("qwen3_0p6b", "bucketed", 4),
        ("tiny", "per_tensor", 512),
        ("deep", "per_tensor", 512),
        ("slab", "per_tensor", 512),
        ("pool", "per_tensor", 512),
        ("wide", "per_tensor", 512),
        ("qwen3_0p6b", "per_tensor", 512),
    )
]
QUICK_MODELS = (
    "tiny",
    "deep",
    "slab",
    "pool",
)  # plan.calibrate_quick=true: the small ones, every coefficient still determined


# The fitted payloads' jobs (payload_fit), on the small models only, both grids: bytes for few tensors (slab),
# tensors for few bytes (deep), and between (pool), so that the floor and per-tensor terms separate; a payload
# that compares what changed at two changed shares, so that its per-changed-element term does too.
PAYLOAD_MODELS = ("slab", "deep", "pool")
CHANGED_RATIOS = (0.01, 0.1)
PAYLOAD_BUCKET_MB = 512  # the grid's large buckets: each small model in one or two


def payload_grid(transports: Iterable[str]) -> list[tuple[str, str, str, float]]:
    """(model, transport, payload, changed ratio): each fitted payload over one transport, the first whose engine
    is in this process (no engine process to start: the encode and decode are the payload's, whatever carries
    them)."""
    transports = list(transports)
    if not transports:
        return []
    transport = next((t for t in transports if transport_class(t).engine_in_process), transports[0])
    return [
        (model, transport, name, ratio)
        for name in payload_fit.fitted_names()
        for model in PAYLOAD_MODELS
        for ratio in (CHANGED_RATIOS if "changed" in payload_class(name).fit_terms else (0.0,))
    ]


def grid(*, quick: bool, flat: bool, transports: Iterable[str]) -> list[tuple[str, str, str, float, bool]]:
    jobs = [(m, t, s, b, False) for m, t, s, b in GRID if t in transports and (not quick or m in QUICK_MODELS)]
    if flat:
        jobs += [(m, t, "bucketed", b, True) for m, t, s, b, _ in jobs if s == "bucketed"]
    return jobs


def bench_config(
    cfg: Config,
    model: str,
    transport: str,
    strategy: str,
    bucket_mb: float,
    flat: bool,
    repeats: int,
    *,
    payload: Optional[str] = None,
    changed_ratio: float = 0.0,
) -> BenchAppConfig:
    """The benchmark job: the plan's config (dtypes, copy_threads, device) with the grid point's model and update:
    the full update (`payload`: another, at bench.changed_ratio=`changed_ratio`), without LoRA adapters."""
    from rlsync.config.validate import validate

    base = OmegaConf.structured(BenchAppConfig)
    keep = {
        k: OmegaConf.to_container(OmegaConf.structured(getattr(cfg, k)))
        for k in ("update", "rollout", "trainer", "run")
    }
    keep["update"].update(
        transport=transport,
        strategy=strategy,
        bucket_mb=float(bucket_mb),
        flat_engine_weights=flat,
        verify=False,
        engine_address=None,
        payload=payload or payload_fit.full_name(),  # the plan's own update.payload is not what the grid times
    )
    keep["trainer"]["lora"]["rank"] = 0  # the full update and the fitted payloads carry no adapters
    keep["rollout"]["release_level"] = 1  # a bench never sleeps the engine; level 2 would refuse flat ipc weights
    merged = OmegaConf.merge(
        base,
        keep,
        {
            "model": model_keys(model),
            "wandb": {"mode": "disabled"},
            "bench": {"target": "update", "warmup": 1, "repeats": repeats, "changed_ratio": changed_ratio},
        },
    )
    out = OmegaConf.to_object(merged)
    validate(out, types=False)
    return out


def observation(summary: dict, source: str = "") -> Optional[cost.Observation]:
    """A finished `rlsync.bench` update run (summary.json) as the fit sees it; None for anything else."""
    if summary.get("kind") != "bench" or summary.get("target") != "update" or summary.get("status") != "finished":
        return None
    s, m = summary["setup"], summary["model"]
    t = summary.get("metrics", {}).get("perf/update_weights_time") or {}
    if s.get("strategy") not in STRATEGIES or not t.get("median"):
        return None
    if recorded_payload(s, payload_fit.dotted(summary.get("config") or {})) != payload_fit.full_name():
        return None  # another payload's update is its encode and decode (payload_fit), not the transport's copies
    setup = cost.Setup(
        s["transport"], s["strategy"], bool(s.get("flat_engine_weights")) and s["strategy"] == "bucketed"
    )
    w = cost.work(
        setup,
        tensors=m["tensors"],
        buckets=s["buckets"],
        elements=m["params"],
        trainer_dtype=s["trainer_dtype"],
        engine_dtype=s["engine_dtype"],
        pooled=m.get("pooled_tensors") or 0,  # runs from before the count: 0 (the column carries nothing)
        cached=s.get("cache_resident_elements") or 0,
    )  # runs from before it: every byte counted
    spread = (t["max"] - t["min"]) / 2 / t["median"] if t.get("max") is not None else 0.0
    return cost.Observation(
        setup,
        w,
        t["median"],
        spread,
        floor_s_per_byte(summary),
        source=source,
        model=m["name"],
        extra={
            "bucket_mb": s.get("bucket_mb"),
            "trainer_dtype": s["trainer_dtype"],
            "engine_dtype": s["engine_dtype"],
            "device": s.get("device"),
        },
    )


def floor_s_per_byte(summary: dict) -> Optional[float]:
    """The run's copy floor, seconds per byte read + written: its limit time (the median of the floors
    re-timed beside each repeat) over the bytes one converting copy of the update reads and writes."""
    s, m = summary["setup"], summary["model"]
    limit = (summary.get("metrics", {}).get("perf/update_weights_limit_time") or {}).get("median")
    nbytes = m["params"] * (DTYPE_BYTES[s["trainer_dtype"]] + DTYPE_BYTES[s["engine_dtype"]])
    return limit / nbytes if limit and nbytes else None


AGAIN = "_again"  # a calibration job run again (RETRY_RESIDUAL): its directory is the first's name plus this


def observations_under(root: Path, warn=None) -> list[cost.Observation]:
    """Every finished update benchmark of the full update under `root` (`bench_runs_under`)."""
    return bench_runs_under(root, warn)[0]


def bench_runs_under(root: Path, warn=None) -> tuple[list[cost.Observation], list[payload_fit.PayloadRun]]:
    """Every finished update benchmark under `root`: the full update's as the cost model's observations (of a
    calibration job and its rerun, the faster), another payload's as its encode and decode rows (payload_fit).
    A summary.json that cannot be read or has the wrong shape is skipped with one line (`warn`, else stderr)."""
    warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
    found: dict[str, cost.Observation] = {}
    coded: list[payload_fit.PayloadRun] = []
    for path in sorted(Path(root).rglob("summary.json")):
        o, rows = None, []
        try:
            data = read_json(path, max_bytes=SUMMARY_MAX)  # a regular file only: a FIFO would block
            if isinstance(data, dict):
                o, rows = observation(data, str(path.parent)), payload_fit.payload_runs(data, str(path.parent))
            else:
                warn(f"rlsync: warning: skipped {path}: it holds a JSON {type(data).__name__}, not an object")
        except UnreadableFile as err:
            warn(f"rlsync: warning: skipped {path}: {err}")
        except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError) as err:
            warn(f"rlsync: warning: skipped {path}: not a summary the fit can read ({type(err).__name__}: {err})")
            o, rows = None, []
        coded += rows
        key = str(path.parent).removesuffix(AGAIN)
        if o is not None and (key not in found or o.time_s < found[key].time_s):
            found[key] = o
    return list(found.values()), coded


def at_floor_dict(c: cost.Coefficients) -> dict:
    """An at-floor fit's coefficients: its per-byte term is a multiple of the floor's time, not a bandwidth."""
    d = c.as_dict()
    d.pop("bandwidth_gbps", None)
    d["floor_multiple"] = c.per_byte_s * 1e9
    return d


def calibration_file(
    observations: list[cost.Observation],
    *,
    device: str,
    seconds: Optional[float] = None,
    payload_runs: Optional[list[payload_fit.PayloadRun]] = None,
) -> dict:
    """The calibration: coefficients per setup, the machine, and the runs behind them; with `payload_runs`, the
    fitted payloads' encode and decode (`payloads`, rlsync/plan/payload_fit.py)."""
    if not observations:
        raise ValueError(
            "no finished rlsync.bench update runs to fit (kind bench, target update, strategy bucketed or per_tensor)"
        )
    coef = cost.fit(observations)
    coef_floor = cost.fit(observations, relative_to_floor=True)
    floors = [o.floor_s_per_byte for o in observations if o.floor_s_per_byte]
    dtypes = {(o.extra.get("trainer_dtype"), o.extra.get("engine_dtype")) for o in observations}
    rows = []
    for o in observations:
        fitted = coef[o.setup.key].predict(o.work, o.setup)
        rows.append(
            {
                "setup": o.setup.key,
                "model": o.model,
                "bucket_mb": o.extra.get("bucket_mb"),
                "calls": o.work.calls,
                "tensors": o.work.tensors,
                "pooled": o.work.pooled,
                "bytes": o.work.bytes,
                "time_s": o.time_s,
                "spread": o.spread,
                "fitted_s": fitted,
                "floor_gbps": 1e-9 / o.floor_s_per_byte if o.floor_s_per_byte else None,
                "rel_error": (o.time_s - fitted) / fitted if fitted else None,
                "flat": o.setup.flat,
                "wall_s": o.extra.get("wall_s"),  # the job's own duration, build included (estimate_seconds)
                "source": o.source,
            }
        )
    trainer, engine = next(iter(dtypes)) if len(dtypes) == 1 else ("mixed", "mixed")
    payloads = {"payloads": payload_fit.fit(payload_runs)} if payload_runs is not None else {}
    return {
        "kind": profiles.KIND,
        "version": profiles.VERSION,
        "measured": True,
        "machine": profiles.machine_now(device),
        "dtypes": {"trainer": trainer, "engine": engine},
        "seconds": seconds,
        "model": "time = calls x per_call_s + tensors x per_tensor_s + moved bytes x per_byte_s (rlsync/plan/cost.py)",
        "coefficients": {k: c.as_dict() for k, c in coef.items()},
        # the same model with bytes in units of each run's copy floor: per_byte_s x 1e9 = multiple of the floor
        "coefficients_at_floor": {k: at_floor_dict(c) for k, c in coef_floor.items()},
        "floor_gbps": 1e-9 / statistics.median(floors) if floors else None,  # the runs' median copy floor
        "observations": rows,
        **payloads,
    }


def checked_fit(data: dict, plan) -> dict:
    """A fit about to become plan.calibration, once the planner could read it: not when its runs determine no
    setup's coefficients (plan.fit_from over a few runs of one setup), which would predict from guesses.
    Refused before anything is written; setups left undetermined beside determined ones are left out when read."""
    problem = profiles.calibration_problem(data)
    if not problem:
        return data
    if plan.fit_from:
        raise ConfigError(
            "plan.fit_from",
            plan.fit_from,
            "a directory of rlsync.bench update runs that vary calls, tensors and bytes for each setup (python -m "
            "rlsync.plan plan.calibrate=true runs such a grid)",
            f"{problem}: nothing written",
        )
    raise RlsyncError(f"calibration failed: {problem}: nothing written (see its jobs' lines above)")


RETRY_RESIDUAL = 0.3  # a job this far off the fit of the others is run again once: the faster of the two counts


def calibrate(cfg, out_dir: Path, *, log=print) -> dict:
    """Run the grid's benchmark jobs under `out_dir/calibration/` and fit them: the calibration file's content.

    On a shared machine a job that ran while something else took the cores or the memory bandwidth
    comes out slow: a job whose fitted residual is over RETRY_RESIDUAL is run again once and the
    faster median kept (load only ever slows a copy)."""
    from rlsync.measure.devices import resolve_device

    p = cfg.plan
    jobs = grid(quick=p.calibrate_quick, flat=p.calibrate_flat, transports=p.calibrate_transports)
    coded_jobs = len(payload_grid(p.calibrate_transports))
    log(
        f"calibration: {len(jobs)} benchmark jobs, {duration_line(jobs)}; then {coded_jobs} payload jobs "
        "(the fitted payloads' encode and decode on the small models: not in that time)"
    )
    started = time.perf_counter()
    runs = Path(out_dir) / "calibration"
    observations: dict[int, cost.Observation] = {}
    for i, job in enumerate(jobs):
        o = run_job(cfg, runs, i, job, log=log, label=f"{i + 1}/{len(jobs)}")
        if o:
            observations[i] = o
    coef = cost.fit(observations.values()) if observations else {}
    for i, o in list(observations.items()):
        fitted = coef[o.setup.key].predict(o.work, o.setup)
        if fitted > 0 and abs(o.time_s - fitted) / fitted > RETRY_RESIDUAL:
            again = run_job(
                cfg,
                runs,
                i,
                jobs[i],
                log=log,
                label=f"again ({(o.time_s - fitted) / fitted:+.0%} off the fit)",
                suffix=AGAIN,
            )
            if again and again.time_s < o.time_s:
                observations[i] = again
    before = time.perf_counter()
    coded = run_payload_jobs(cfg, runs, len(jobs), log=log)
    coded_s = time.perf_counter() - before
    device = str(resolve_device(cfg.run.device))
    collective = collective_or_none(device, log=log)
    data = calibration_file(
        list(observations.values()), device=device, seconds=time.perf_counter() - started, payload_runs=coded
    )
    data["payloads"]["seconds"] = coded_s  # apart from the grid's time: estimate_seconds scales by the grid's alone
    if collective:
        data["collective"] = collective
    return data


def run_payload_jobs(cfg, runs: Path, first: int, *, log=print) -> list[payload_fit.PayloadRun]:
    """The fitted payloads' benchmark jobs (`payload_grid`, numbered after the grid's), their encode and decode
    rows; one line each, and one for what they added to the calibration's time."""
    from rlsync.bench.runner import run_bench

    jobs = payload_grid(cfg.plan.calibrate_transports)
    started, out = time.perf_counter(), []
    for i, (model, transport, payload, ratio) in enumerate(jobs, start=first):
        name = f"{i:02d}_{model}_{transport}_{payload}_{ratio:g}"
        bcfg = bench_config(
            cfg,
            model,
            transport,
            "bucketed",
            PAYLOAD_BUCKET_MB,
            False,
            cfg.plan.calibrate_repeats,
            payload=payload,
            changed_ratio=ratio,
        )
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # each job's closing table: its summary.json has it
                summary = run_bench(bcfg, runs / name, name=name, group="calibration")
        except Exception as err:  # noqa: BLE001 - one failed job leaves the others to fit
            summary = {"error": f"{type(err).__name__}: {err}"}
        rows = payload_fit.payload_runs(summary or {}, str(runs / name))
        took = ", ".join(f"{r.side} {r.time_s * 1e3:.2f} ms ({r.floor_s / r.time_s:.2f} of its floor)" for r in rows)
        log(
            f"calibration payload {i - first + 1}/{len(jobs)} {name}: "
            + (f"{took}, {time.perf_counter() - t0:.1f} s" if rows else f"failed ({(summary or {}).get('error')})")
        )
        out += rows
    if jobs:
        log(f"calibration: {len(jobs)} payload jobs took {fmt_minutes(time.perf_counter() - started)}")
    return out


def collective_or_none(device: str, *, log=print) -> Optional[dict]:
    """The all-gather probe for a CPU calibration (measure_collective), None with one line where it cannot run:
    a CUDA calibration (2 ranks need 2 GPUs, and a GPU's gather is NCCL's, not gloo's) or a probe that fails."""
    if device.startswith("cuda"):
        log("calibration: collective not measured (a CUDA calibration: the gloo probe would not be the GPU's gather)")
        return None
    try:
        found = measure_collective()
    except RuntimeError as err:
        log(f"calibration: collective not measured: {err}")
        return None
    log(
        f"calibration: all-gather over {found['ranks']} gloo ranks: bus bandwidth {found['bus_gbps']:.3f} GB/s, "
        f"{found['latency_s'] * 1e3:.2f} ms per call, {found['seconds']:.1f} s"
    )
    return found


def run_job(cfg, runs: Path, i: int, job: tuple, *, log, label: str, suffix: str = "") -> Optional[cost.Observation]:
    from rlsync.bench.runner import run_bench

    model, transport, strategy, bucket_mb, flat = job
    name = f"{i:02d}_{model}_{transport}_{strategy}{'_flat' if flat else ''}_{bucket_mb:g}{suffix}"
    bcfg = bench_config(cfg, model, transport, strategy, bucket_mb, flat, cfg.plan.calibrate_repeats)
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # each job's closing table: its summary.json has it
            summary = run_bench(bcfg, runs / name, name=name, group="calibration")
    except Exception as err:  # noqa: BLE001 - one failed job (out of memory, say) leaves the others to fit
        summary = {"error": f"{type(err).__name__}: {err}"}
    o = observation(summary or {}, str(runs / name))
    if o:
        o.extra["wall_s"] = time.perf_counter() - t0
    log(
        f"calibration {label} {name}: "
        + (
            f"{o.time_s * 1e3:.2f} ms ({o.work.calls} calls, {o.work.tensors} tensors, {o.work.bytes / 2**20:.1f} MiB "
            f"moved), {time.perf_counter() - t0:.1f} s"
            if o
            else f"failed ({(summary or {}).get('error')})"
        )
    )
    return o


def coefficient_lines(data: dict) -> list[str]:
    """The calibration's coefficients and fit quality, one line per setup."""
    out = []
    for key, c in sorted(data["coefficients"].items()):
        bw = c.get("bandwidth_gbps")
        why = underdetermined(key, data.get("observations") or [], c.get("points", 0))
        out.append(
            f"  {key:22s} per call {c['per_call_s'] * 1e6:9.2f} us, per tensor {c['per_tensor_s'] * 1e6:8.2f} us, "
            f"{f'{bw:.2f} GB/s' if bw else 'bytes unresolved':>12s}; {c.get('points', 0)} runs, residual max "
            f"{c.get('rel_residual_max', 0) * 100:.1f} % rms {c.get('rel_residual_rms', 0) * 100:.1f} %, "
            f"repeat spread {c.get('repeat_spread', 0) * 100:.1f} %"
            + (f" (UNDERDETERMINED: {why}; calibrate with plan.calibrate=true)" if why else "")
        )
    return out


def estimate_seconds(jobs: list[tuple], reference: Optional[dict]) -> Optional[float]:
    """How long `jobs` take, from the wall times of the same jobs in `reference` (a calibration file, the
    shipped one): each job's own (model, setup, bucket size), else the median job's; scaled by the
    reference's whole duration over its jobs' (its reruns of the jobs off the fit, the final fit), so
    that the reference's own grid comes out at the time it really took. None without one."""
    rows = [r for r in (reference or {}).get("observations", []) if r.get("wall_s")]
    if not rows:
        return None
    walls = {(r["model"], r["setup"], r.get("bucket_mb")): r["wall_s"] for r in rows}
    typical = statistics.median(r["wall_s"] for r in rows)
    total = 0.0
    for model, transport, strategy, bucket_mb, flat in jobs:
        key = cost.Setup(transport, strategy, flat).key
        total += walls.get((model, key, float(bucket_mb)), typical)
    whole = reference.get("seconds")
    if whole:  # the grid's jobs, their reruns and the collective: less the payload jobs, timed apart
        whole -= ((reference.get("payloads") or {}).get("seconds")) or 0.0
    return total * (whole / sum(walls.values()) if whole and len(walls) == len(rows) else 1.0)


def duration_line(jobs: list[tuple]) -> str:
    """ "about 8.1 min (as the same jobs took for the reference calibration on a 2-core machine, ...)"."""
    reference = profiles.reference()
    seconds = estimate_seconds(jobs, reference)
    if seconds is None:
        return "duration unknown (no reference calibration to time it by)"
    m = reference.get("machine", {})
    load = m.get("load_average")
    return (
        f"about {fmt_minutes(seconds)} (as the same jobs took for the reference calibration on a "
        f"{m.get('cpus', '?')}-core {m.get('device', '?')} machine{', load ' + format(load[0], '.1f') if load else ''})"
    )


def calibrate_hint() -> str:
    """How to measure this machine, with the real durations (the reference calibration's jobs, timed)."""
    ref = profiles.reference()
    full = estimate_seconds(grid(quick=False, flat=True, transports=calibrated_transports()), ref)
    quick = estimate_seconds(grid(quick=True, flat=True, transports=calibrated_transports()), ref)
    if full is None or quick is None:
        return "python -m rlsync.plan plan.calibrate=true measures this machine"
    cpus = (ref.get("machine") or {}).get("cpus", "?")
    return (
        f"python -m rlsync.plan plan.calibrate=true measures this machine (about {fmt_minutes(full)} on the "
        f"reference's {cpus} cores; plan.calibrate_quick=true about {fmt_minutes(quick)})"
    )


def fmt_minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def median_or_none(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else None
