"""The checks before a run or a benchmark builds anything: will it fit in memory (estimate.py, fit.py,
and record.py for summary.json's estimate beside the measured peak), and how long will it take
(duration.py, `--dry-run`)."""
