"""A W&B run on W&B's servers, named by its path `entity/project/run_id` (or its https://wandb.ai/.../runs/ID
address), read through wandb's public API: `wandb.Api().run(path)`, its config, its recorded GPU
(`metadata["gpu"]`) and every logged row (`scan_history()`, `_step` and `_timestamp` in each).

It needs the network and an API key (WANDB_API_KEY or `wandb login`): with WANDB_MODE=offline or disabled
it is refused before anything is asked, and any failure of the API (no key, no network, no such run) is one
line naming the path. The API object comes from `api_factory` (a parameter of `read`, by default wandb's
own), so the reader is tested with a stand-in: the online path itself is not exercised by the test suite.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Optional

from rlsync.readers.base import CLOCK, MAX_ROWS, STEP, History, Reader, ReadRefused, bounded, number

PART = r"[A-Za-z0-9][A-Za-z0-9_.-]*"  # an entity's, a project's or a run id's characters
RUN_PATH = re.compile(rf"^({PART})/({PART})/({PART})$")
RUN_URL = re.compile(rf"^https?:/+[^/]+/({PART})/({PART})/runs/({PART})/?$")  # a Path collapses the URL's //
API_TIMEOUT_S = 30  # each request to W&B's servers
OFFLINE_MODES = ("offline", "disabled", "dryrun")


def run_path(text: str) -> Optional[str]:
    """The run's path, entity/project/run_id, for a W&B run path or run URL; None for anything else."""
    found = RUN_PATH.match(text) or RUN_URL.match(text)
    if not found or ".." in found.groups():
        return None
    return "/".join(found.groups())


def default_api() -> Any:
    """wandb's public API, with a bounded timeout per request."""
    import wandb

    return wandb.Api(timeout=API_TIMEOUT_S)


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200]}" if text else type(err).__name__


def plain_config(config: Any) -> dict[str, Any]:
    """The run's config as plain values (an older API wraps each as {"value": ...}; W&B's own keys left out)."""
    if not isinstance(config, dict):
        return {}
    out = {}
    for key, value in config.items():
        if str(key).startswith("_wandb"):
            continue
        out[key] = value["value"] if isinstance(value, dict) and set(value) == {"value"} else value
    return out


def recorded_gpu(metadata: Any) -> Optional[str]:
    """The GPU W&B recorded for the run (its system metadata), or None."""
    if not isinstance(metadata, dict):
        return None
    gpu = metadata.get("gpu")
    if isinstance(gpu, str) and gpu:
        return gpu
    nvidia = metadata.get("gpu_nvidia")
    if isinstance(nvidia, list) and nvidia and isinstance(nvidia[0], dict) and isinstance(nvidia[0].get("name"), str):
        return nvidia[0]["name"]
    return None


class WandbApiReader(Reader):
    title = "W&B run (API)"
    api_factory: ClassVar[Callable[[], Any]] = staticmethod(default_api)  # the tests put a stand-in here

    @classmethod
    def sources(cls, found: list[Path]) -> list[Path]:
        return []  # never a local file: a run path that is no local path (addresses)

    @classmethod
    def addresses(cls, text: str) -> bool:
        return run_path(text) is not None

    @classmethod
    def read(cls, source: Path, api_factory: Optional[Callable[[], Any]] = None) -> History:
        path = run_path(str(source))
        if path is None:
            raise ReadRefused(f"{source}: not a W&B run path (entity/project/run_id)")
        needs = (
            f"{source}: no such file or directory; as a W&B run path it is read through W&B's API, which needs the "
            f"network and an API key (WANDB_API_KEY, or wandb login)"
        )
        mode = os.environ.get("WANDB_MODE", "").strip().lower()
        if mode in OFFLINE_MODES:
            raise ReadRefused(f"{needs}: WANDB_MODE={mode} (give the run's offline directory, wandb/offline-run-*)")
        try:
            run = (api_factory or cls.api_factory)().run(path)
            rows = []
            for item in run.scan_history():
                if len(rows) >= MAX_ROWS:  # refused before the rest is fetched
                    raise ReadRefused(f"{source}: over {MAX_ROWS:,} logged steps: export the timing keys alone")
                row = {k: v for k, v in ((str(k), number(v)) for k, v in dict(item).items()) if v is not None}
                if STEP in row:
                    rows.append(row)
            config, device, name = plain_config(run.config), recorded_gpu(run.metadata), str(run.id or path)
        except ReadRefused:
            raise
        except Exception as err:  # noqa: BLE001 - no key, no network, no such run: whatever wandb raises, one line
            raise ReadRefused(f"{needs}: {first_line(err)}") from None
        for row in rows:
            if CLOCK not in row and "_runtime" in row:
                row[CLOCK] = row["_runtime"]
        return History(source, "wandb_api", name, bounded(rows, source), config, device=device)
