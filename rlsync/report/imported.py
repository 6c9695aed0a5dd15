"""Other frameworks' runs beside rlsync's own: the paths that are not rlsync runs or sweeps are asked of
the readers (rlsync/readers/), and each run they answer becomes a `Run` as rlsync's own are read, its
figures under rlsync's metric names, so every row, table, plot, report.csv and the W&B report run
carry it unchanged.

Where the run names its model (a Hugging Face id in its config that matches a preset of rlsync/conf/model/,
or --model PRESET / path/to/config.json) and its GPU (--device h200|h100|a100, or the GPU the run
recorded), the update's bytes and their floor on that GPU come from the planner (rlsync/plan/planner.py
update_floor): the run's update as a multiple of that floor joins its verdict, and the floor and the update
over it fill the table's and report.csv's floor columns (update_limit_time_*, update_efficiency_median)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlsync.config.schema import ModelConfig
from rlsync.errors import BadInput
from rlsync.fmt import fmt_bytes, fmt_ratio, fmt_seconds
from rlsync.plan import planner, profiles
from rlsync.readers import Answer, imported_runs, reader_class
from rlsync.readers.answer import UPDATE
from rlsync.record.summary import FLOOR_METRIC
from rlsync.report.runs import FailedRun, Run, collect, is_job_dir, is_sweep_dir

EFFICIENCY_METRIC = "perf/update_weights_efficiency"  # the floor over the update's time, per step (as rlsync's runs)
DEVICES = tuple(profiles.PROFILES)  # --device: the planner's built-in GPU profiles


@dataclass
class Sizing:
    """What --model and --device name for every imported run (None: each run's own, where it names one)."""

    model: Optional[ModelConfig] = None
    model_named: str = ""  # how --model named it ("--model qwen3_1p7b")
    device: Optional[str] = None


def sizing_of(model: Optional[str], device: Optional[str]) -> Sizing:
    """--model (a preset name, or a transformers config.json or its folder) and --device, checked before any run
    is read; BadInput (exit 2) for either that names nothing rlsync knows."""
    if device is not None and device not in DEVICES:
        raise BadInput(f"--device {device}: not a GPU the planner knows (allowed: {', '.join(DEVICES)})")
    if model is None:
        return Sizing(device=device)
    if model in planner.preset_names():
        return Sizing(planner.preset_model(model), f"--model {model}", device)
    if not (model.endswith(".json") or "/" in model or Path(model).exists()):
        raise BadInput(
            f"--model {model}: not a model preset ({', '.join(planner.preset_names())}) nor a path to a config.json"
        )
    return Sizing(planner.config_json_model(model), f"--model {model}", device)


def preset_for(model_id: str) -> Optional[str]:
    """The preset a Hugging Face id (or a checkpoint's folder) names: its last part, lower case, '.' as 'p' and
    '-' as '_' (Qwen/Qwen3-1.7B -> qwen3_1p7b), or the longest preset it starts with before a suffix of its own
    (Qwen3-8B-Base -> qwen3_8b: the same tensors); None when it names none."""
    stem = model_id.rstrip("/").rsplit("/", 1)[-1].lower().replace(".", "p").replace("-", "_")
    matches = [p for p in planner.preset_names() if stem == p or stem.startswith(p + "_")]
    return max(matches, key=len) if matches else None


BOTH_MISSING = "name the model with --model and the device with --device"  # neither known: the note's plain form


def device_of(recorded: Optional[str]) -> Optional[str]:
    """The GPU profile a recorded GPU name is ("NVIDIA H100 80GB HBM3" -> h100), or None."""
    name = (recorded or "").lower()
    return next((d for d in DEVICES if d in name), None)


def update_floor(found: Answer, sizing: Sizing) -> tuple[Optional[dict], Optional[str]]:
    """(the planner's bytes and floor for this run, None) or (None, why there is none: the note's reason)."""
    model, named = sizing.model, sizing.model_named
    if model is None and found.model:
        preset = preset_for(found.model)
        if preset:
            model, named = planner.preset_model(preset), f"{found.model} as preset {preset}"
    device = sizing.device or device_of(found.history.device)
    where = "--device" if sizing.device else f"the run recorded {found.history.device}"
    if model is None and device is None and not found.model and not found.history.device:
        return None, BOTH_MISSING
    missing = []
    if model is None:
        missing.append(
            f"its model {found.model} is no preset ({', '.join(planner.preset_names())}): name it with --model"
            if found.model
            else "name the model with --model"
        )
    if device is None:
        missing.append(
            f"its GPU {found.history.device} is none of {', '.join(DEVICES)}: name one with --device"
            if found.history.device
            else "name the device with --device"
        )
    if missing:
        return None, "; ".join(missing)
    floor = planner.update_floor(model, device)
    return {**floor, "named": named, "device_from": where}, None


def floor_phrase(floor: dict, update_s: float) -> str:
    """ "Floor: 1.60 ms on h200 (...); the update's median 0.20 s is 125x it." """
    return (
        f"Floor: {fmt_seconds(floor['floor_s'])} on {floor['gpu']} ({floor['device_from']}): "
        f"{fmt_bytes(floor['update_bytes'])} of {floor['named']} in {floor['dtype']}, read and written once at "
        f"the {floor['device']} profile's {floor['copy_gbps']:.0f} GB/s; the update's median "
        f"{fmt_seconds(update_s)} is {fmt_ratio(update_s / floor['floor_s'])} it."
    )


def as_run(found: Answer, sizing: Optional[Sizing] = None) -> tuple[Run, Optional[str]]:
    """An answered run as the report's Run: its verdict, share, source and framework in its summary; with a
    model and a GPU, its update's bytes and floor. The second value: why it has no floor (None: it has one)."""
    history = found.history
    floor, why = update_floor(found, sizing or Sizing())
    stats = dict(found.stats)
    summary = {
        "verdict": found.verdict,
        "share": {"update_weights": found.share},
        "model": {"name": found.model},
        "source": reader_class(history.source).title or history.source,
        "framework": found.map.title or found.framework,
        "measured_steps": found.measured,
        "warmup_steps": found.warmup,
        # rlsync's broken-measurement rule judges its own update against a copy floor timed beside it on a
        # quiet machine; another framework's update spans more than a copy, so it is never judged so
        "verdict_trusted": True,
    }
    if floor is not None:
        measured = [s for s in found.steps[found.warmup :] if s.get(UPDATE)]
        ratios = [floor["floor_s"] / s[UPDATE] for s in measured]
        stats[FLOOR_METRIC] = dict.fromkeys(("median", "min", "max"), floor["floor_s"])
        if ratios:  # each step's own ratio, as rlsync's runs record it
            stats[EFFICIENCY_METRIC] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
        # the bytes stay out of the row's update_bytes: a framework's update time is no copy of them alone, so it is
        # no point of the report's fit of time against bytes (the verdict and summary["floor"] carry them)
        summary["model"] = {"name": found.model or floor["model"], "params": floor["params"]}
        summary["setup"] = {"device": floor["device"]}
        summary["floor"] = floor
        summary["verdict"] = f"{found.verdict} {floor_phrase(floor, found.stats[UPDATE]['median'])}"
    rows = [{**s, "step": int(s["step"]) if float(s["step"]).is_integer() else s["step"]} for s in found.steps]
    run = Run(
        history.path,
        history.name,
        [],
        "finished",
        None,
        summary,
        {},
        stats,
        found.measured,
        warmup_steps=found.warmup,
        step_rows=rows,
    )
    return run, why


def is_rlsync(path: Path) -> bool:
    return is_sweep_dir(path) or (path.is_dir() and is_job_dir(path))


def collect_all(
    paths: list[Path],
    *,
    framework: Optional[str] = None,
    warmup: Optional[int] = None,
    model: Optional[str] = None,
    device: Optional[str] = None,
) -> tuple[list[Run], list[FailedRun], list[Path], list[str]]:
    """runs.collect over rlsync's runs and sweeps, then every other path's runs from the readers;
    ReadRefused (exit 2) for one that cannot be read or answered, and BadInput for a --model or --device that
    names nothing, before anything is written. Imported runs without a floor are named in one note."""
    sizing = sizing_of(model, device)
    own = [p for p in paths if is_rlsync(p)]
    deeper: list[Path] = []  # rlsync's runs the readers met below a path that is not itself rlsync's
    found_by_path = {
        path: imported_runs(path, framework=framework, warmup=warmup, rlsync_runs=deeper)
        for path in paths
        if path not in own
    }
    runs, failures, sweeps, notes = collect(own + [d for d in deeper if d not in own])
    unfloored: dict[str, list[str]] = {}
    for path, found in found_by_path.items():
        for answered in found:
            run, why = as_run(answered, sizing)
            runs.append(run)
            if why:
                unfloored.setdefault(why, []).append(run.job)
        if not found and not any(path in d.parents for d in deeper):
            notes.append(f"{path}: not a run or sweep directory, nor another framework's run, skipped")
    for why, jobs in unfloored.items():  # once per reason, naming the runs
        notes.append(f"{', '.join(jobs)}: floor: n/a ({why})")
    return runs, failures, sweeps, notes
