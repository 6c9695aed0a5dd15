"""Calibration files: where they live, what they hold, and the built-in GPU profiles.

A calibration file is JSON (`kind: rlsync_calibration`): the coefficients per setup (rlsync.plan.cost),
the machine they were measured on (cpus, device, torch, platform, date, load average), the dtypes of
the runs, whether they were measured at all, and the runs they were fitted from. Its default place is
`$XDG_CACHE_HOME/rlsync/calibration.json` (`~/.cache/rlsync/calibration.json`); `plan.calibration=PATH`
picks another, or the name of a built-in profile.

The built-in GPU profiles are seeded from published figures and estimates, not measured by rlsync:
a plan made with one says "unmeasured" beside every prediction.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path
from typing import Optional

from rlsync.plan.cost import Coefficients

KIND = "rlsync_calibration"
VERSION = 1


def default_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rlsync" / "calibration.json"


def gpu_profile(name: str, device: str, copy_tbps: float, source: str) -> dict:
    """A GPU profile: bandwidth from `copy_tbps` (read + written, TB/s); the per-call and per-tensor
    costs are order-of-magnitude guesses (a kernel launch ~5-10 us; a CUDA IPC message round trip
    between processes ~0.5-1 ms), to be replaced by `plan.calibrate=true` on that GPU."""
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
        "machine": {"device": device, "cuda": True},
        "coefficients": {k: c.as_dict() for k, c in coef.items()},
    }


PROFILES = {  # plan.calibration=NAME
    "h200": lambda: gpu_profile(
        "h200",
        "NVIDIA H200",
        4.3,
        "device-to-device copy ~4.3 TB/s read + written (design notes, one H200); call costs guessed",
    ),
    "h100": lambda: gpu_profile(
        "h100",
        "NVIDIA H100 80GB HBM3",
        2.6,
        "HBM3 3.35 TB/s published peak, ~80 % of it for a copy; call costs guessed",
    ),
    "a100": lambda: gpu_profile(
        "a100",
        "NVIDIA A100-SXM4-80GB",
        1.6,
        "HBM2e 2.0 TB/s published peak, ~80 % of it for a copy; call costs guessed",
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
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
    else:  # the CPU copies' cache: the plan counts the bytes a staged copy reads back from it (cost.moved_bytes)
        from rlsync.measure.limits import llc_bytes

        info["llc_bytes"] = llc_bytes()
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def resolve(value: Optional[str]) -> tuple[str, Optional[dict]]:
    """(where, the calibration or None when there is none yet) for `plan.calibration`."""
    if value in PROFILES:
        return f"built-in profile {value}", PROFILES[value]()
    path = Path(value).expanduser() if value else default_path()
    if not path.exists():
        return str(path), None
    data = json.loads(path.read_text())
    if data.get("kind") != KIND:
        raise ValueError(f"{path}: not an rlsync calibration file (kind={data.get('kind')!r})")
    return str(path), data


def save(data: dict, value: Optional[str]) -> Path:
    if value in PROFILES:
        raise ValueError(f"plan.calibration={value} names a built-in profile: give a file path to write to")
    path = Path(value).expanduser() if value else default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


def coefficients(data: Optional[dict], which: str = "coefficients") -> dict[str, Coefficients]:
    """`coefficients` (absolute bytes/s) or `coefficients_at_floor` (bytes in units of the copy floor)."""
    return {k: Coefficients.from_dict(v) for k, v in (data or {}).get(which, {}).items()}


def describe(where: str, data: Optional[dict]) -> str:
    if data is None:
        return (
            f"no calibration at {where}: run python -m rlsync.plan plan.calibrate=true (a few minutes) to predict times"
        )
    m = data.get("machine", {})
    if not data.get("measured", True):
        return f"{where}: UNMEASURED ({data.get('source', 'published figures')}), {m.get('device', '?')}"
    load = m.get("load_average")
    return (
        f"{where}: measured {m.get('date', '?')} on {m.get('device', '?')} ({m.get('cpus', '?')} cpus, torch "
        f"{m.get('torch', '?')}{', load ' + format(load[0], '.2f') if load else ''}), dtypes "
        f"{data.get('dtypes', {}).get('trainer', '?')} -> {data.get('dtypes', {}).get('engine', '?')}, "
        f"{len(data.get('observations', []))} runs"
    )
