"""Where a run's numbers go: the console, metrics.jsonl / summary.json on disk, and W&B.

The disk files come first and never depend on W&B: metrics.jsonl gets one line per finished step,
flushed and fsynced before the next step starts, so a killed run keeps every step it finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from rlsync.config.schema import WandbConfig
from rlsync.errors import WriteFailed
from rlsync.fmt import first_line
from rlsync.measure import metrics


class MetricsFile:
    """metrics.jsonl: one JSON line per finished step, fsynced before the next step starts.

    Each run starts its record afresh: in a reused run directory (`hydra.run.dir=X` again, after the
    first run ended: rlsync.record.run_lock refuses a second run while the first is alive) appending would
    mix two runs' steps under one run's summary.json. The previous runs' files are never deleted or
    overwritten: they are renamed to NAME.prev, then NAME.prev2, NAME.prev3, ... (the first suffix
    none of the record's files has yet, so one run's files share it): reusing a directory is usually
    an accident, and those rows may be the only record of a long run. The report reads
    metrics.jsonl alone, so the kept files never enter it.
    """

    RECORD = ("metrics.jsonl", "summary.json", "error.log")  # what one run leaves in its directory

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self.rows = 0
        present = [run_dir / name for name in self.RECORD if (run_dir / name).exists()]
        if present:  # the previous run's summary or error must not stand beside these rows either
            suffix = previous_suffix(run_dir, self.RECORD)
            for previous in present:
                os.rename(previous, previous.with_name(previous.name + suffix))
        self.size = 0  # bytes of whole rows in the file: a failed write is cut back to it
        try:
            # unbuffered: nothing is left to flush at close; open for the run, closed by close()
            self._f = open(self.path, "wb", buffering=0)  # noqa: SIM115
        except OSError as err:
            raise WriteFailed(self.path, err) from err

    def write(self, row: dict) -> None:
        line = (json.dumps(row) + "\n").encode("utf-8")
        try:
            view = memoryview(line)
            while view:
                view = view[self._write(self._f.fileno(), view) :]
            os.fsync(self._f.fileno())
        except OSError as err:
            try:  # a full disk took part of the line: cut it, so the file ends with a whole row
                os.ftruncate(self._f.fileno(), self.size)
                os.lseek(self._f.fileno(), self.size, os.SEEK_SET)
            except OSError:
                pass
            raise WriteFailed(self.path, err, f"; the {self.rows} step(s) finished before are kept in it") from err
        self.size += len(line)
        self.rows += 1

    @staticmethod
    def _write(fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # every row was written and fsynced by write(), or write() raised already
            self._f.close()


def previous_suffix(run_dir: Path, names: tuple[str, ...]) -> str:
    """.prev, .prev2, .prev3, ...: the first that none of `names` carries in `run_dir` yet."""
    n = 1
    while True:
        suffix = ".prev" if n == 1 else f".prev{n}"
        if not any((run_dir / f"{name}{suffix}").exists() for name in names):
            return suffix
        n += 1


def write_json(path: Path, obj: dict) -> None:
    """Write `obj` whole or not at all (a temporary file, then a rename); a failed write leaves no
    temporary file and raises WriteFailed naming `path`."""
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")
        tmp.replace(path)  # never a half-written summary
    except OSError as err:
        with contextlib.suppress(OSError):  # nothing was created (its directory is gone or not a directory)
            tmp.unlink(missing_ok=True)
        raise WriteFailed(path, err) from err


class Console:
    """A progress bar over the steps and one table row per finished step."""

    def __init__(self, steps: int, *, enabled: bool, warmup_steps: int):
        self.bar = tqdm(total=steps, desc="steps", unit="step", file=sys.stderr, disable=not enabled, leave=False)
        self.warmup_steps = warmup_steps
        self.header_done = False
        self.columns: list[tuple[str, str]] = []  # (metric, header): from the first row, which shows what is timed

    def step(self, row: dict) -> None:
        if not self.header_done:
            self.columns = [(m.name, m.console) for m in metrics.console_columns(row)]
            tqdm.write("step " + " ".join(f"{h:>9}" for _, h in self.columns))
            self.header_done = True
        cells = [f"{row[k]:9.4f}" if isinstance(row.get(k), (int, float)) else f"{'-':>9}" for k, _ in self.columns]
        tag = " (warm-up)" if row["step"] < self.warmup_steps else ""
        tqdm.write(f"{row['step']:>4} " + " ".join(cells) + tag)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


WANDB_MODES = ("offline", "online", "disabled")


class WandbRun:
    """Thin wrapper so the step loop logs the same way whether W&B is on or off.

    A W&B call that fails mid-run (its service died) costs W&B alone: one line, then local files only.
    """

    def __init__(self, run=None):
        self.run = run

    def log(self, row: dict) -> None:
        if self.run is not None:
            self._call(self.run.log, row)

    def summarize(self, summary: dict) -> None:
        if self.run is not None:
            self._call(self._summarize, summary)

    def _summarize(self, summary: dict) -> None:
        declared = metrics.declared()
        for key, s in summary.get("metrics", {}).items():  # each by the stat the report shows (a peak by its max)
            self.run.summary[key] = s[declared[key].stat if key in declared else "median"]
            self.run.summary[f"{key}.min"], self.run.summary[f"{key}.max"] = s["min"], s["max"]
        for phase, share in summary.get("share", {}).items():
            self.run.summary[f"share/{phase}"] = share
        for key in ("verdict", "status", "measured_steps", "verification", "warning"):
            if key in summary:
                self.run.summary[key] = summary[key]

    def _call(self, fn, arg) -> None:
        try:
            fn(arg)
        except Exception as err:  # noqa: BLE001 - W&B must never cost the run or its files
            print(
                f"rlsync: W&B failed mid-run ({first_line(err, type(err).__name__)}); logging to local files only",
                file=sys.stderr,
            )
            self.run = None

    def finish(self, exit_code: int) -> None:
        """Close the run; a non-zero exit code marks it failed in W&B."""
        if self.run is not None:
            self._call(lambda code: self.run.finish(exit_code=code), exit_code)


def define_step_metric(run) -> None:
    run.define_metric("step")
    run.define_metric("*", step_metric="step")


def start_wandb(cfg: WandbConfig, *, run_dir: Path, **kwargs):
    """wandb.init in the configured mode; online falls back to offline, offline to no W&B: one line each."""
    try:
        import wandb
    except ImportError:
        print(
            f"rlsync: wandb is not installed; wandb.mode={cfg.mode} ignored, logging to local files only",
            file=sys.stderr,
        )
        return None
    # quiet: no run history/summary footer at finish, so the closing table and verdict stay the last lines
    settings = wandb.Settings(init_timeout=cfg.init_timeout, quiet=True)
    for mode in [cfg.mode] + (["offline"] if cfg.mode == "online" else []):
        try:
            return wandb.init(mode=mode, settings=settings, dir=str(run_dir), **kwargs)
        except Exception as err:  # noqa: BLE001 - no login, no network, no service: the run goes on
            then = f"logging offline under {run_dir}/wandb" if mode == "online" else "logging to local files only"
            print(f"rlsync: W&B {mode} failed ({first_line(err, type(err).__name__)}); {then}", file=sys.stderr)
    return None


@contextmanager
def wandb_run(cfg: WandbConfig, *, run_dir: Path, name: str, group: str, config: dict, job_type: str):
    """Open one W&B run for this job (or none when disabled), finished however the job ends.

    A job that raises finishes its run with a non-zero exit code (failed in W&B; 130/143 when
    interrupted). We finish explicitly rather than `with run:`, whose exit prints the traceback.
    """
    if cfg.mode == "disabled":
        yield WandbRun(None)
        return
    if isinstance(config.get("wandb"), dict):  # the group the run joined, not the config's null ("default: ...")
        config = {**config, "wandb": {**config["wandb"], "group": group}}
    run = start_wandb(
        cfg,
        run_dir=run_dir,
        project=cfg.project,
        entity=cfg.entity,
        group=group,
        name=name,
        job_type=job_type,
        tags=list(cfg.tags),
        config=config,
        reinit="finish_previous",
    )
    wb = WandbRun(run)
    if run is not None:
        wb._call(define_step_metric, run)
    try:
        yield wb
    except BaseException as err:
        wb.finish(getattr(err, "exit_code", 1) or 1)
        raise
    wb.finish(0)
