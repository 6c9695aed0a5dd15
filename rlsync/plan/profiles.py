"""Calibration files: where they live, what they hold, and the built-in GPU profiles.

A calibration file is JSON (`kind: rlsync_calibration`): the coefficients per setup (rlsync.plan.cost),
the machine they were measured on (cpus, device, torch, platform, date, load average), the dtypes of
the runs, whether they were measured at all, and the runs they were fitted from. Its default place is
`$XDG_CACHE_HOME/rlsync/calibration.json` (`~/.cache/rlsync/calibration.json`); `plan.calibration=PATH`
picks another, or the name of a built-in profile.

When the user has none, the planner uses the reference calibration shipped with the package
(`rlsync/plan/reference/cpu.json`, a real calibration of the project's 2-core CPU machine, its machine
recorded): a plan made with it says "REFERENCE" and "(reference calibration)" beside every prediction,
since it is another machine's. `plan.calibration=reference` picks it whatever the user has.

The built-in GPU profiles are seeded from published figures and estimates, not measured by rlsync:
a plan made with one says "unmeasured" beside every prediction, and its range is wide (`GPU_RANGE`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
from pathlib import Path
from typing import Optional

from rlsync.config.files import CALIBRATION_MAX, UnreadableFile, read_json
from rlsync.errors import ConfigError
from rlsync.fmt import GIB, fmt_path, is_number
from rlsync.plan.cost import Coefficients, Setup
from rlsync.plan.payload_fit import section_problem

KIND = "rlsync_calibration"
# 2: the fitted payloads' encode and decode (`payloads`, rlsync/plan/payload_fit.py); a file of version 1 has none
# and still loads (its plans say "no payload fit")
VERSION = 2
REFERENCE = Path(__file__).resolve().parent / "reference" / "cpu.json"
REFERENCE_NAME = "reference"  # plan.calibration=reference
# A published-figure profile's range, as multiples of its prediction: the bytes at 100 % down to 50 % of
# the published copy rate (the updates measured here reach 0.4 to 0.7 of their copy floor), the call
# costs guessed within a factor of about 2 either way (under 1 % of a large model's update).
GPU_RANGE = {"low": 0.8, "high": 2.0}


def default_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rlsync" / "calibration.json"


# A published-figure profile's all-gather: NVLink's per-GPU bandwidth each way (NVIDIA's datasheets give it
# both ways: H100/H200 SXM 900 GB/s, A100 SXM 600 GB/s), ~80 % of it as an all-gather's bus bandwidth (the
# same share the copy profiles assume); no call latency (not counted). Published, not measured by rlsync.
COLLECTIVE_SHARE = 0.8


def nvlink_collective(both_ways_gbps: float, generation: str) -> dict:
    """The `collective` of a GPU profile: bus bandwidth from NVLink's published both-ways figure."""
    return {
        "bus_gbps": both_ways_gbps / 2 * COLLECTIVE_SHARE,
        "latency_s": None,
        "measured": False,
        "source": f"{generation} {both_ways_gbps:g} GB/s per GPU both ways (NVIDIA's datasheet), "
        f"{both_ways_gbps / 2:g} GB/s each way, ~{COLLECTIVE_SHARE:.0%} of it for an all-gather's bus bandwidth; "
        "published, not measured",
    }


def gpu_profile(
    name: str, device: str, copy_tbps: float, source: str, memory_mib: int, collective: Optional[dict] = None
) -> dict:
    """A GPU profile: bandwidth from `copy_tbps` (read + written, TB/s); the per-call and per-tensor
    costs are order-of-magnitude guesses (a kernel launch ~5-10 us; a CUDA IPC message round trip
    between processes ~0.5-1 ms), to be replaced by `plan.calibrate=true` on that GPU. `collective`:
    the all-gather's bus bandwidth over NVLink (nvlink_collective), for the fsdp2 gather."""
    per_byte = 1 / (copy_tbps * 1e12)
    coef = {
        "direct/bucketed": Coefficients(20e-6, 10e-6, per_byte),
        "direct/bucketed/flat": Coefficients(20e-6, 5e-6, per_byte),
        "direct/per_tensor": Coefficients(10e-6, 0.0, per_byte),
        "ipc/bucketed": Coefficients(1e-3, 10e-6, per_byte),
        "ipc/bucketed/flat": Coefficients(1e-3, 5e-6, per_byte),
        "ipc/per_tensor": Coefficients(0.5e-3, 0.0, per_byte),
    }
    return {
        "kind": KIND,
        "version": VERSION,
        "measured": False,
        "name": name,
        "source": source,
        "machine": {"device": device, "cuda": True, "memory_bytes": memory_mib * 2**20},  # nvidia-smi's total
        "range": GPU_RANGE,
        "coefficients": {k: c.as_dict() for k, c in coef.items()},
        **({"collective": collective} if collective else {}),
    }


PROFILES = {  # plan.calibration=NAME
    "h200": lambda: gpu_profile(
        "h200",
        "NVIDIA H200",
        4.3,
        "device-to-device copy ~4.3 TB/s read + written (design notes, one H200); call costs guessed",
        143771,
        nvlink_collective(900, "NVLink 4"),
    ),
    "h100": lambda: gpu_profile(
        "h100",
        "NVIDIA H100 80GB HBM3",
        2.6,
        "HBM3 3.35 TB/s published peak, ~80 % of it for a copy; call costs guessed",
        81559,
        nvlink_collective(900, "NVLink 4"),
    ),
    "a100": lambda: gpu_profile(
        "a100",
        "NVIDIA A100-SXM4-80GB",
        1.6,
        "HBM2e 2.0 TB/s published peak, ~80 % of it for a copy; call costs guessed",
        81920,
        nvlink_collective(600, "NVLink 3"),
    ),
}


def machine_now(device: str = "cpu") -> dict:
    import platform

    import torch

    info = {
        "platform": platform.platform(),
        "node": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "cuda": device.startswith("cuda"),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    info.update(host_description())
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
        info["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    else:  # the CPU copies' cache: the plan counts the bytes a staged copy reads back from it (cost.moved_bytes)
        from rlsync.measure.floors import llc_bytes

        info["llc_bytes"] = llc_bytes()
    with contextlib.suppress(OSError):
        info["load_average"] = list(os.getloadavg())
    return info


def host_description() -> dict:
    """The CPU and memory the calibration ran on (/proc: model name, MemTotal), so that a reader of the
    file knows whose machine it describes; {} where /proc says nothing."""
    out = {}
    try:
        with open("/proc/cpuinfo") as f:
            out["cpu_model"] = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = host_memory_bytes()
    if memory:
        out["host_memory_bytes"] = memory
        out.setdefault("memory_bytes", memory)  # a CPU calibration's device is the host
    return out


def host_memory_bytes() -> Optional[int]:
    """This machine's RAM (MemTotal), None where /proc/meminfo is not."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return None


def reference() -> Optional[dict]:
    """The reference calibration shipped with rlsync (marked `reference: true`), None if it is missing."""
    if not REFERENCE.is_file():
        return None
    data = read_json(REFERENCE, max_bytes=CALIBRATION_MAX)
    return {**data, "reference": True} if not calibration_problem(data) else None


def names() -> list[str]:
    """What plan.calibration takes besides a file: the built-in profiles and the reference."""
    return [*PROFILES, REFERENCE_NAME]


def check_choice(plan) -> None:
    """plan.calibration, before anything is read or fitted (PlanConfig.check): a built-in name, or a file that
    exists; with plan.calibrate=true or plan.fit_from, the file the fit writes (that it does not exist yet is
    fine), never a built-in name."""
    value, writes = plan.calibration, plan.calibrate or bool(plan.fit_from)
    if value is None:
        return
    if value in names():
        if writes:
            raise ConfigError(
                "plan.calibration",
                value,
                "a file path the fitted coefficients are written to, or null (~/.cache/rlsync/calibration.json)",
                "names a built-in calibration, which a fit cannot write",
            )
        return
    if not writes and not Path(value).expanduser().exists():
        raise missing(value)


def missing(value: str) -> ConfigError:
    """plan.calibration names neither a built-in calibration nor a file: refused, never a plan of n/a."""
    path = Path(value).expanduser()
    what = "a symbolic link to nothing (a loop, or a missing target)" if path.is_symlink() else "no such file"
    return ConfigError(
        "plan.calibration",
        value,
        f"{', '.join(names())} (built in), a calibration file written by python -m rlsync.plan (plan.calibrate=true "
        "or plan.fit_from=DIR), or null (~/.cache/rlsync/calibration.json, else the reference)",
        f"{what}, and not a built-in calibration",
    )


def resolve(value: Optional[str]) -> tuple[str, Optional[dict]]:
    """(where, the calibration or None when there is none) for `plan.calibration`. With none given and
    none at the default place, the shipped reference calibration (another machine's, marked as such); a
    value that names neither a built-in calibration nor a file is refused (`missing`)."""
    if value in PROFILES:
        return f"built-in profile {value}", PROFILES[value]()
    if value == REFERENCE_NAME:
        return f"reference {REFERENCE.name} (shipped with rlsync)", reference()
    path = Path(value).expanduser() if value else default_path()
    if not path.exists():
        if value:
            raise missing(value)
        ref = reference()
        if ref is not None:
            return f"reference {REFERENCE.name} (shipped with rlsync; none of this machine at {fmt_path(path)})", ref
        return fmt_path(path), None
    try:  # a regular file only (a FIFO would block), of bounded size and nesting, of the calibration's shape
        data = read_json(path, max_bytes=CALIBRATION_MAX)
        problem = calibration_problem(data)
    except UnreadableFile as err:
        problem = f"cannot read it: {err}"
    if problem:
        raise ConfigError(
            "plan.calibration",
            value if value else str(path),
            f"a calibration file written by python -m rlsync.plan (JSON, kind {KIND}), or {', '.join(PROFILES)}",
            problem,
        )
    return fmt_path(path), data


def calibration_problem(data) -> Optional[str]:
    """What makes `data` no calibration the planner can read (its shape, its coefficients' numbers), or None."""
    if not isinstance(data, dict):
        return f"it holds a JSON {type(data).__name__}, not an object"
    if data.get("kind") != KIND:
        return f"not an rlsync calibration file (kind={data.get('kind')!r})"
    version = data.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= VERSION:
        return f"its version is {version!r}: this rlsync reads versions 1 to {VERSION} (a newer rlsync wrote it?)"
    if "payloads" in data:
        problem = section_problem(data["payloads"])
        if problem:
            return problem
    for name, kind in (("machine", dict), ("dtypes", dict), ("observations", list)):
        if name in data and not isinstance(data[name], kind):
            return f"its {name} is a {type(data[name]).__name__}, not a {kind.__name__}"
    for which in ("coefficients", "coefficients_at_floor"):
        table = data.get(which, {})
        if not isinstance(table, dict) or not all(isinstance(c, dict) for c in table.values()):
            return f"its {which} is not an object of objects (setup -> coefficients)"
        for setup, c in table.items():
            missing = [k for k in ("per_call_s", "per_tensor_s", "per_byte_s") if k not in c]
            if missing:
                return f"{which}[{setup!r}] has no {missing[0]}"
            bad = [k for k in Coefficients.__dataclass_fields__ if k in c and not is_number(c[k])]
            if bad:
                return f"{which}[{setup!r}].{bad[0]} is {c[bad[0]]!r}, not a number"
    spread = data.get("range")  # a profile's range, multiples of the prediction
    if spread is not None and not (
        isinstance(spread, dict)
        and all(is_number(spread.get(k)) for k in ("low", "high"))
        and spread["low"] <= 1 <= spread["high"]
    ):
        return f"its range is {spread!r}, not {{low: <= 1, high: >= 1}}"
    for i, row in enumerate(data.get("observations") or []):  # the fit's runs: the design matrix
        if not isinstance(row, dict) or not all(is_number(row.get(k)) for k in ("calls", "tensors", "bytes")):
            return f"its observations[{i}] is not a run with calls, tensors and bytes"
    left_out = underdetermined_setups(data)
    if left_out and len(left_out) == len(data.get("coefficients") or {}):
        return (
            "its runs determine no setup's coefficients ("
            + "; ".join(f"{k}: {why}" for k, why in sorted(left_out.items()))
            + ")"
        )
    if data.get("floor_gbps") is not None and not is_number(data["floor_gbps"]):
        return f"its floor_gbps is {data['floor_gbps']!r}, not a number"
    collective = data.get("collective")  # the all-gather probe (plan.calibrate=true) or a profile's NVLink figure
    if collective is not None and not (
        isinstance(collective, dict)
        and is_number(collective.get("bus_gbps"))
        and collective["bus_gbps"] > 0
        and (collective.get("latency_s") is None or is_number(collective["latency_s"]))
    ):
        return f"its collective is {collective!r}, not {{bus_gbps: > 0, latency_s: a number or null}}"
    return None


def design_rows(key: str, observations: list[dict]) -> list[list[float]]:
    """The fit's design matrix for `key` from a calibration file's observation rows (cost.Work.row)."""
    per_tensor = Setup.from_key(key).strategy == "per_tensor"
    return [
        [r["calls"], (r.get("pooled") or 0) if per_tensor else r["tensors"], r["bytes"]]
        for r in observations
        if r.get("setup") == key
    ]


def underdetermined(key: str, observations: list[dict], points: int) -> Optional[str]:
    """Why `key`'s coefficients are not all determined by its runs, or None: a term no run has (a column
    of zeros) is left out; the rest needs more runs than terms (else the residual says nothing) and runs
    that vary the terms independently (a design matrix of full rank, columns scaled to unit norm)."""
    import numpy as np

    rows = design_rows(key, observations)
    if not rows:  # a file without its rows (a report's fit, an old file): the count is all there is
        return f"{points} runs for {coefficient_count(key)} coefficients" if points <= coefficient_count(key) else None
    a = np.asarray(rows, dtype=float)
    a = a[:, np.abs(a).sum(axis=0) > 0]
    a = a / np.linalg.norm(a, axis=0)
    terms = a.shape[1]
    if len(rows) <= terms:
        return f"{len(rows)} runs for {terms} coefficients, so the residual says nothing"
    if np.linalg.matrix_rank(a, tol=1e-6) < terms:
        return "its runs do not vary calls, tensors and bytes independently"
    return None


def coefficient_count(key: str) -> int:
    """Free coefficients of a setup: calls, tensors (per_tensor: the pooled tensors) and bytes."""
    return 3


def underdetermined_setups(data: Optional[dict]) -> dict[str, str]:
    """{setup: why} for the setups of a measured calibration whose runs do not determine their coefficients
    (`underdetermined`): the planner leaves them out and says so. A published-figure profile is no fit, and a
    file that records neither its runs nor their count gives nothing to judge by."""
    if not data or not data.get("measured", True):
        return {}
    rows = data.get("observations") or []
    out = {}
    for key, c in (data.get("coefficients") or {}).items():
        if rows or "points" in c:
            why = underdetermined(key, rows, c.get("points", 0))
            if why:
                out[key] = why
    return out


def left_out_line(data: Optional[dict]) -> Optional[str]:
    """The plan's closing warning when its calibration's runs leave setups undetermined, else None."""
    left_out = underdetermined_setups(data)
    if not left_out:
        return None
    return (
        f"rlsync: warning: UNDERDETERMINED: the calibration's runs do not determine {len(left_out)} of its "
        f"{len(data['coefficients'])} setups ({'; '.join(f'{k}: {why}' for k, why in sorted(left_out.items()))}): "
        "left out, their predictions n/a; python -m rlsync.plan plan.calibrate=true fits every setup"
    )


def save(data: dict, value: Optional[str]) -> Path:
    if value in PROFILES or value == REFERENCE_NAME:
        raise ValueError(f"plan.calibration={value} names a built-in profile: give a file path to write to")
    path = Path(value).expanduser() if value else default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


def coefficients(data: Optional[dict], which: str = "coefficients") -> dict[str, Coefficients]:
    """`coefficients` (absolute bytes/s) or `coefficients_at_floor` (bytes in units of the copy floor), less the
    setups its runs do not determine (`underdetermined_setups`: a prediction from them would be a guess)."""
    left_out = underdetermined_setups(data)
    return {k: Coefficients.from_dict(v) for k, v in (data or {}).get(which, {}).items() if k not in left_out}


def describe_machine(m: dict) -> str:
    """ "cpu (2 cpus, Intel(R) Xeon(R) ..., 23.5 GiB, torch 2.13.0+cpu, load 1.56)"."""
    parts = [f"{m.get('cpus', '?')} cpus"]
    parts += [m["cpu_model"]] if m.get("cpu_model") else []
    parts += [f"{m['host_memory_bytes'] / GIB:.1f} GiB"] if m.get("host_memory_bytes") else []
    parts += [f"torch {m.get('torch', '?')}"]
    load = m.get("load_average")
    parts += [f"load {load[0]:.2f}"] if load else []
    return f"{m.get('device', '?')} ({', '.join(parts)})"


def describe(where: str, data: Optional[dict], hint: str = "python -m rlsync.plan plan.calibrate=true") -> str:
    """The calibration in one line (two for the reference: how to measure this machine, `hint`)."""
    if data is None:
        return f"no calibration at {where}: {hint} to predict times"
    m = data.get("machine", {})
    if not data.get("measured", True):
        return f"{where}: UNMEASURED ({data.get('source', 'published figures')}), {m.get('device', '?')}"
    reference = (
        "REFERENCE (another machine's: read its times as an order of magnitude), " if data.get("reference") else ""
    )
    line = (
        f"{where}: {reference}measured {m.get('date', '?')} on {describe_machine(m)}, dtypes "
        f"{data.get('dtypes', {}).get('trainer', '?')} -> {data.get('dtypes', {}).get('engine', '?')}, "
        f"{len(data.get('observations', []))} runs"
    )
    left_out = underdetermined_setups(data)
    if left_out:
        line += f"; UNDERDETERMINED, left out: {', '.join(sorted(left_out))}"
    if reference:
        line += f"\n  {hint}"
    return line
