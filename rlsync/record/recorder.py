"""One run's record, kept the same way by the runner (`python -m rlsync`) and the benchmark
(`python -m rlsync.bench`): its directory (held by the run lock), metrics.jsonl, the console lines,
the W&B run and summary.json.

    with Recorder(run_dir, cfg.wandb, name=..., group=..., job_type="run", config=to_dict(cfg)) as rec:
        rec.start(console_steps=...)                      # W&B, metrics.jsonl, the console
        with rec.steps(release=..., summarize=..., closing=...) as record:
            for step in ...:
                record({"step": step, **measured})        # one finished step: file, W&B, console
        rec.result                                        # the summary, written however the loop ended

The owner keeps what is its own: what a step is, what its summary says, what it closes.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Optional

import torch

from rlsync.config.schema import WandbConfig
from rlsync.errors import StopOnSignals, WriteFailed
from rlsync.fmt import error_line
from rlsync.measure.threads import machine_threads
from rlsync.record.run_lock import RunLock
from rlsync.record.sinks import Console, MetricsFile, WandbRun, wandb_run, write_json


class Recorder:
    """The record of one run in `run_dir`; `enabled=False` (data-parallel ranks > 0) keeps the rows
    in memory and writes nothing: rank 0 records every step.

    As a context manager it holds the run directory (rlsync.record.run_lock: a second live run stops there,
    touching nothing) and, once `start()` opened it, finishes the W&B run however the job ends.
    """

    def __init__(
        self,
        run_dir: Path,
        wandb: Optional[WandbConfig] = None,
        *,
        name: str = "",
        group: str = "",
        job_type: str = "run",
        config: Optional[dict] = None,
        overrides: list[str] = (),
        enabled: bool = True,
        hydra_record: Optional[dict[str, str]] = None,
    ):
        self.run_dir, self.enabled = Path(run_dir), enabled
        self.wandb = wandb or WandbConfig(mode="disabled")
        self.wandb_args = {"name": name, "group": group, "job_type": job_type, "config": config or {}}
        self.overrides = list(overrides)  # the command line's, for summary.json
        self.hydra_record = hydra_record or {}  # .hydra/'s files, written once the directory is held
        self.rows: list[dict] = []  # the finished steps, as recorded
        self.status, self.error, self.failure = "running", None, None
        self.started_at: Optional[float] = None  # unix time of start()
        self.result: Optional[dict] = None  # the summary, once written
        self.summary_failure: Optional[WriteFailed] = None
        self.wb = WandbRun(None)
        self.metrics_file: Optional[MetricsFile] = None
        self.console: Optional[Console] = None
        self._stack = ExitStack()

    def __enter__(self) -> Recorder:
        if self.enabled:
            self._stack.enter_context(RunLock(self.run_dir, self.hydra_record))  # then .hydra/ is written
        return self

    def __exit__(self, *exc) -> Optional[bool]:
        self.close_files()
        return self._stack.__exit__(*exc)  # W&B finished (failed on an error), then the directory let go

    def start(self, *, console_steps: Optional[int] = None, progress: bool = True, warmup_steps: int = 0) -> None:
        """Open the W&B run, a fresh metrics.jsonl (a previous run's record kept as .prev) and, given
        `console_steps`, the console: a progress bar (`progress`) and a line per step, warm-up marked."""
        self.started_at = time.time()  # summary.json: a report tells jobs that ran at the same time
        if not self.enabled:
            return
        self.wb = self._stack.enter_context(wandb_run(self.wandb, run_dir=self.run_dir, **self.wandb_args))
        self.metrics_file = MetricsFile(self.run_dir)
        if console_steps is not None:
            self.console = Console(console_steps, enabled=progress, warmup_steps=warmup_steps)

    @contextmanager
    def steps(
        self,
        *,
        release: Callable[[], None],
        summarize: Callable[[], dict],
        closing: Callable[[dict], None],
        cause: Optional[Callable[[BaseException], Optional[BaseException]]] = None,
    ) -> Iterator[Callable[[dict], None]]:
        """Around the owner's loop, which records each finished step with the function this yields.

        SIGINT / SIGTERM / SIGHUP raise Interrupted in the loop: the step in progress is dropped, the
        finished ones kept (a step is recorded whole or not at all). However the loop ends: the files
        are closed, `release()` frees the owner's resources (an error there is raised after the
        summary, which must not be lost to it), `summarize()` builds the summary from this record,
        which goes to summary.json and W&B, and `closing(summary)` prints the closing lines.
        `cause(err)`, where given, names what really stopped the run (another data-parallel rank).
        """
        with StopOnSignals() as self.stop:
            try:
                self.stop.check()  # a signal from before the run, swallowed on the way: stopped here, summarized
                yield self.record
                self.status = "finished"
            except BaseException as err:
                self.stop.deferring = True  # first: no signal is raised from here to the summary (no call before)
                with self.stop.ending():  # the launcher's SIGTERM may follow another rank's exit at once
                    stopped_by = cause(err) if cause is not None else None
                if stopped_by is not None:  # another rank failed, died, or was stopped by a signal
                    self.status = "interrupted" if isinstance(stopped_by, KeyboardInterrupt) else "failed"
                    self.error, self.failure = str(stopped_by), stopped_by
                    raise stopped_by from err
                self.status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
                self.error, self.failure = error_line(err), err
                raise
            finally:
                self.stop.deferring = True
                # the summary is written whatever signal arrives meanwhile (a launcher's SIGTERM follows a rank's
                # end at once): absorbed when the run is stopping anyway, raised after it when it had finished
                with self.stop.deferred(absorb=self.status != "finished"):
                    self.close_files()
                    close_error = None
                    try:
                        release()
                    except Exception as err:  # noqa: BLE001 - a dead engine's close must not cost the finished steps
                        close_error = err
                    self.result = summarize()
                    self.write_summary(self.result)
                    if self.enabled:
                        closing(self.result)
            if close_error is not None:
                raise close_error
            if self.summary_failure is not None:  # every step finished; only the summary is missing
                raise WriteFailed(
                    self.summary_failure.path,
                    self.summary_failure.err,
                    f"; all {len(self.rows)} finished step(s) are kept in {self.run_dir / 'metrics.jsonl'}",
                ) from self.summary_failure

    def record(self, row: dict) -> None:
        """One finished step: kept, then written to metrics.jsonl, W&B and the console."""
        with self.stop.deferred():
            self.rows.append(row)
            if self.metrics_file is not None:
                self.metrics_file.write(row)
            self.wb.log(row)
            if self.console is not None:
                self.console.step(row)

    def measured(self, warmup_steps: int) -> int:
        """The finished steps past the warm-up."""
        return sum(1 for r in self.rows if r["step"] >= warmup_steps)

    def progress(self, *, steps: int, warmup_steps: int) -> dict:
        """summary.json's account of how far the run got."""
        return {
            "status": self.status,
            "error": self.error,
            "steps_requested": steps,
            "steps_finished": len(self.rows),
            "warmup_steps": warmup_steps,
            "measured_steps": self.measured(warmup_steps),
            "started_at": self.started_at,  # unix time of start() and of this summary
            "ended_at": time.time(),
        }

    def write_summary(self, result: dict) -> None:
        """summary.json (whole or not at all; a failure is raised once the loop's resources are closed), then W&B's summary."""
        if self.enabled:
            try:
                write_json(self.run_dir / "summary.json", result)
            except WriteFailed as err:
                self.summary_failure = err
        self.wb.summarize(result)

    def close_files(self) -> None:
        """The console's progress bar and metrics.jsonl (every row fsynced already); once."""
        if self.console is not None:
            self.console.close()
        if self.metrics_file is not None:
            self.metrics_file.close()
        self.console = self.metrics_file = None


def machine_info(device: torch.device) -> dict:
    """summary.json's `machine`: where the numbers were measured."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": machine_threads(),  # the machine's, not the run's torch threads (1 on a busy machine)
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
