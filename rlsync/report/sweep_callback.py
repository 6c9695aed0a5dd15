"""Hydra callback: at the end of a sweep, write the sweep report (rlsync.report).

Hydra skips `on_multirun_end` when any job fails; `python -m rlsync.report SWEEP_DIR` makes the same
report by hand from the files every job left on disk, failed sweep or not.
"""

from __future__ import annotations

import sys

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepReport(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from rlsync.report import print_result, write_report

        try:
            print_result(write_report([config.hydra.sweep.dir]))
        except Exception as err:  # noqa: BLE001 - a report problem must not fail a finished sweep
            print(
                f"rlsync: the sweep report failed ({err}); retry with `python -m rlsync.report "
                f"{config.hydra.sweep.dir}`",
                file=sys.stderr,
            )
