"""vLLM's own reload path beside rlsync's vLLM update and TRL's per-tensor scheme, in one process.

    PYTHONPATH=$PWD python experiments/schemes/vllm_side_by_side.py --model qwen3_0p6b --repeats 5

One vLLM engine (rollout.engine=vllm, the CPU backend here), one fp32 trainer model; each repeat runs
every way once, in turn, so a drift of the machine's load falls on all of them alike:

- `reload_per_bucket`: the baseline. One `reload_weights(weights_iterator=...)` call per bucket of
  update.bucket_mb, handed the trainer's fp32 tensors, on every thread of the machine. Raw vLLM: a
  fused layer split across two buckets is rebuilt from half its parts (wrong weights there); it is
  the engine's cost floor, not a correct update.
- `reload_per_bucket_bf16`: the same with tensors cast to bf16 beforehand (the cast untimed): what
  vLLM's reload costs on its own.
- `rlsync` (update.copy_threads=null, timed on the update's tensors as the runner resolves it), and
  `rlsync_threads_1`, `rlsync_threads_0` (torch's default): rlsync's direct update, what the runner
  times (`rlsync.update.update_weights`), fused parts held until their layer is complete.
- `trl`: update.strategy=per_tensor (scheme=trl): one reload per tensor, fused parts held (correct).

Writes side_by_side.json (every time, medians, spread, the load average before and after) into
--out and prints a table. Keep the machine quiet: each way moves the whole model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_module

from rlsync.config.apps import BenchAppConfig
from rlsync.config.compose import register_configs, to_config
from rlsync.engines.base import EngineSpec
from rlsync.engines.vllm import _reload_in_worker
from rlsync.measure.floors import Floors
from rlsync.measure.threads import cpu_threads, machine_threads
from rlsync.model.build import build_model, build_tokenizer, named_weights, torch_dtype
from rlsync.update import close_update, open_update, plan_for, timed_update
from rlsync.update.auto import resolve_for_run
from rlsync.update.direct import DirectTransport


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_0p6b", help="a model preset (rlsync/conf/model/)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument(
        "--ways",
        default="reload_per_bucket,reload_per_bucket_bf16,rlsync,rlsync_threads_1,rlsync_threads_0,trl",
        help="comma-separated subset of the ways",
    )
    ap.add_argument("--out", default="outputs/vllm_side_by_side")
    args = ap.parse_args()

    register_configs()
    with initialize_config_module(config_module="rlsync.conf", version_base="1.3"):
        dcfg = compose(
            "bench", overrides=[f"model={args.model}", "rollout.engine=vllm", f"update.bucket_mb={args.bucket_mb}"]
        )
    cfg = to_config(dcfg, BenchAppConfig)
    device = torch.device("cpu")
    print(f"load before: {loadavg()}; {machine_threads()} threads; building {args.model} ...", flush=True)
    model = build_model(cfg.model, dtype=torch_dtype(cfg.trainer.dtype), device=device, seed=0)
    weights = named_weights(model)
    engine_dtype = torch_dtype(cfg.rollout.dtype)
    buckets = plan_for(weights, cfg.update, engine_dtype)
    read_bytes = sum(t.nbytes for t in weights.values())
    update_bytes = sum(b.nbytes for b in buckets)
    floors = Floors(
        device,
        update_bytes=update_bytes,
        state_bytes=read_bytes,
        read_bytes=read_bytes,
        dtypes=(torch_dtype(cfg.trainer.dtype), engine_dtype),
    )
    update_cfg, resolved = resolve_for_run(cfg.update, cfg.rollout, weights=weights, buckets=buckets, device=device)
    tok = build_tokenizer(cfg.model)
    spec = EngineSpec(
        model=cfg.model,
        rollout=cfg.rollout,
        device="cpu",
        allowed_ids=tok.allowed_ids(cfg.model.vocab_size),
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
    )
    engine, bucketed = open_update(update_cfg, spec=spec, buckets=buckets)  # a VLLMEngine, DirectTransport to it
    per_tensor_cfg = dataclasses.replace(update_cfg, strategy="per_tensor", flat_engine_weights=False)
    per_tensor = DirectTransport(spec, buckets, per_tensor_cfg)
    per_tensor.connect(engine)
    cast = {n: t.to(engine_dtype) for n, t in weights.items()}

    def reload_per_bucket(source) -> float:
        start = time.perf_counter()
        with cpu_threads(machine_threads(), device):
            for bucket in buckets:
                engine.llm.collective_rpc(_reload_in_worker, args=([(n, source[n]) for n in bucket.names],))
        return time.perf_counter() - start

    def rlsync(threads) -> float:
        ucfg = update_cfg if threads is None else dataclasses.replace(update_cfg, copy_threads=threads)
        return timed_update(bucketed, weights, buckets=buckets, cfg=ucfg, device=device, floor_time=1.0)[
            "perf/update_weights_time"
        ]

    def trl() -> float:
        ucfg = dataclasses.replace(update_cfg, strategy="per_tensor")
        return timed_update(per_tensor, weights, buckets=buckets, cfg=ucfg, device=device, floor_time=1.0)[
            "perf/update_weights_time"
        ]

    ways = {
        "reload_per_bucket": lambda: reload_per_bucket(weights),
        "reload_per_bucket_bf16": lambda: reload_per_bucket(cast),
        "rlsync": lambda: rlsync(None),
        "rlsync_threads_1": lambda: rlsync(1),
        "rlsync_threads_0": lambda: rlsync(0),
        "trl": trl,
    }
    chosen = [w for w in args.ways.split(",") if w]
    unknown = set(chosen) - set(ways)
    if unknown:
        ap.error(f"unknown ways {sorted(unknown)}; known: {', '.join(ways)}")
    times: dict[str, list[float]] = {w: [] for w in chosen}
    floors = []
    load_start = loadavg()
    probe = floors.update_probe()
    for r in range(args.warmup + args.repeats):
        floors.append(probe.floor_time())
        for w in chosen:
            t = ways[w]()
            if r >= args.warmup:
                times[w].append(t)
        print(
            f"repeat {r}{' (warm-up)' if r < args.warmup else ''}: "
            + ", ".join(f"{w} {times[w][-1]:.3f} s" for w in chosen if r >= args.warmup)
            + f"  load {loadavg()}",
            flush=True,
        )
    load_end = loadavg()
    floor = statistics.median(floors[args.warmup :])
    rows = {
        w: {
            "median_s": statistics.median(v),
            "min_s": min(v),
            "max_s": max(v),
            "times_s": v,
            "time_over_floor": statistics.median(v) / floor,
        }
        for w, v in times.items()
    }
    result = {
        "model": args.model,
        "bucket_mb": args.bucket_mb,
        "buckets": len(buckets),
        "tensors": len(weights),
        "update_bytes": update_bytes,
        "threads": machine_threads(),
        "resolved": resolved,
        "copy_floor_s": floor,
        "copy_probe": floors.update_probe_how,
        "load_before": load_start,
        "load_after": load_end,
        "repeats": args.repeats,
        "ways": rows,
        "torch": torch.__version__,
        "vllm": __import__("vllm").__version__,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "side_by_side.json").write_text(json.dumps(result, indent=1))
    base = rows.get("reload_per_bucket", {}).get("median_s")
    print(
        f"\n{args.model}, {len(buckets)} buckets of {args.bucket_mb:g} MiB, {len(weights)} tensors; "
        f"copy floor {floor * 1e3:.0f} ms ({floors.update_probe_how}); load {load_start} -> {load_end}"
    )
    print("| way | median | min to max | / reload_per_bucket | / copy floor |\n|---|---|---|---|---|")
    for w, row in rows.items():
        rel = f"{row['median_s'] / base:.2f}x" if base else "n/a"
        print(
            f"| {w} | {row['median_s']:.3f} s | {row['min_s']:.3f} to {row['max_s']:.3f} s | {rel} | {row['time_over_floor']:.2f}x |"
        )
    per_tensor.close()
    close_update(engine, bucketed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
