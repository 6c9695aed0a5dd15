"""Many runs -> one comparison: a table, plots and a W&B copy of both.

    python -m rlsync.report outputs/sweeps/2026-11-29_08-00-00            # a sweep (Hydra multirun)
    python -m rlsync.report outputs/runs/A outputs/runs/B --out cmp/      # run directories
    python -m rlsync.report SWEEP --no-wandb                               # local files only
    python -m rlsync.report SWEEP --wandb-report                           # also a W&B Report (online)

Everything is read back from the files each job leaves on disk (summary.json, metrics.jsonl,
.hydra/), so a partly failed sweep still reports: Hydra skips `on_multirun_end` when a job fails.
A job with metrics.jsonl but no summary.json is reported as "incomplete" (its medians computed here);
a job with neither is listed under "Failed runs" with the error line of its log.

Written next to the runs (the sweep directory, or the first PATH, or --out):
report.md (the best setting per model and whether it beats the runner-up beyond the noise, the
table with each run's spread, verdicts, a fit per transport where it means something, plots,
failures), report.csv (the table's raw numbers), calibration.json (the planner's cost model fitted to the update
benchmarks, rlsync/report/sizing.py) and the PNG plots of `report.plots`. Exit status:
0 when at least one run was reported, 1 when none was, 3 when `--wandb-report` could not publish
(the local report is written anyway).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

from rlsync.errors import EARLY, BadInput, Interrupted, RlsyncError, WriteFailed, describe, exit_code

# `python -m rlsync.report` (and `rlsync-report`) imports this package before its __main__ (sys.argv[0] is "-m"
# while Python locates the module): the stop signals are taken from here, before the imports below (torch,
# through the run records' modules), and one that arrives during them is acted on as main() starts. Not raised
# inside them: an exception thrown into numpy's or torch's initialisation leaves a half-imported module
# ("module 'numpy' has no attribute 'ndarray'", a traceback, exit 1) or aborts the process.
if sys.argv[:1] == ["-m"] or Path(sys.argv[0]).name == "rlsync-report":
    EARLY.install()

import itertools

from rlsync.fmt import plural
from rlsync.readers.base import MAX_DEPTH as READER_DEPTH
from rlsync.report import sizing
from rlsync.report.cells import idle_table, rows_markdown, stall_table
from rlsync.report.fits import fit_by_setup, update_fit_lines
from rlsync.report.imported import DEVICES, collect_all, is_rlsync
from rlsync.report.markdown import write_csv, write_markdown
from rlsync.report.output import check_targets
from rlsync.report.output import write_text as write_file
from rlsync.report.plots import PLOTS, write_plots
from rlsync.report.ranking import best_settings
from rlsync.report.rows import table_row
from rlsync.report.runs import RUN_DEPTH, Run, job_label, load_job, unique_paths
from rlsync.report.table import ReportResult, table_rows
from rlsync.shell import pipe_safe_output

__all__ = ["load_job", "main", "print_result", "table_row", "write_report"]


IMPORTED_OUT = "rlsync-report"  # where a report of other frameworks' runs alone is written (no --out)
OUTPUTS = ("report.md", "report.csv", "calibration.json")  # beside the plots (plots.PLOTS)


def choose_out_dir(paths: list[Path], sweeps: list[Path], out_dir: Optional[Path]) -> Path:
    if out_dir is not None:
        return out_dir
    if len(sweeps) == 1 and all(p == sweeps[0] for p in paths):
        return sweeps[0]
    return paths[0]


def choose_group(runs: list[Run], out_dir: Path) -> str:
    """The runs' W&B group, named as the runner names it: wandb.group, else the sweep (or run) directory."""
    groups = {str(run.cfg("wandb.group") or (run.sweep or run.path).name) for run in runs}
    return groups.pop() if len(groups) == 1 else out_dir.resolve().name


def distinct_labels(items: list) -> None:
    """Two runs given by paths that end alike (a/run, b/run) get their parent's name too, then the whole path."""
    for depth in (2, None):
        seen: dict[str, int] = {}
        for item in items:
            seen[item.job] = seen.get(item.job, 0) + 1
        twins = {label for label, n in seen.items() if n > 1}
        if not twins:
            return
        for item in items:
            if item.job in twins:
                item.job = "/".join(item.path.parts[-depth:]) if depth else str(item.path)


def overlap_note(runs: list[Run]) -> Optional[str]:
    """A note when runs of the report ran at the same time (summary.json's started_at / ended_at): a
    launcher that runs jobs side by side, or two commands at once. Their timings contaminate each other."""
    spans = sorted(
        (r.summary["started_at"], r.summary["ended_at"], r.job)
        for r in runs
        if isinstance(r.summary.get("started_at"), (int, float)) and isinstance(r.summary.get("ended_at"), (int, float))
    )
    pairs = [(a[2], b[2]) for a, b in itertools.pairwise(spans) if b[0] < a[1]]
    if not pairs:
        return None
    named = ", ".join(f"{x} and {y}" for x, y in pairs[:3]) + (" and more" if len(pairs) > 3 else "")
    return (
        f"jobs {named} ran at the same time: their timings contaminate each other "
        f"(run them one after another: Hydra's default launcher)"
    )


def write_report(
    paths: Iterable[str | Path],
    out_dir: Optional[str | Path] = None,
    log_wandb: bool = True,
    *,
    side_by_side: Optional[str] = None,
    framework: Optional[str] = None,
    warmup: Optional[int] = None,
    model: Optional[str] = None,
    device: Optional[str] = None,
) -> ReportResult:
    """Read every run under `paths`, write report.md, report.csv and the plots, log to W&B.

    Never raises for a bad run or a W&B problem: those end up in `result.failures`, `result.notes`
    and `result.wandb_line`. Nothing is written when no job directory is found at all.
    """
    paths, repeated = unique_paths(Path(p) for p in paths)  # a path given twice (or by two names) is read once
    # other frameworks' runs too (rlsync/readers/: `framework` forces their map, `warmup` their warm-up);
    # the report is never written among them: beside rlsync's own runs, else in ./rlsync-report
    # `model` (a preset or a config.json) and `device` (h200, h100, a100): their update's floor, where the runs name none
    runs, failures, sweeps, notes = collect_all(paths, framework=framework, warmup=warmup, model=model, device=device)
    notes = repeated + notes
    own = [p for p in paths if is_rlsync(p)] or [Path(IMPORTED_OUT)]
    out = choose_out_dir(own, sweeps, Path(out_dir) if out_dir is not None else None)
    result = ReportResult(out_dir=out, group=choose_group(runs, out), runs=runs, failures=failures, notes=notes)
    if not runs and not failures:
        return result

    several = len(sweeps) > 1
    for item in [*runs, *failures]:
        item.job = job_label(item.path, item.sweep, several)
    distinct_labels([*runs, *failures])
    if side_by_side:  # the sweep's launcher runs jobs at once (rlsync.report.sweep_callback)
        result.notes.append(f"hydra/launcher={side_by_side} ran this sweep's jobs side by side")
    if note := overlap_note(runs):
        result.notes.append(note)
    result.rows = table_rows(result)
    result.table_markdown = rows_markdown(result.rows)
    result.fits = fit_by_setup(result.rows)

    target = out
    try:  # a full disk, a read-only or missing directory: one line naming the path (WriteFailed)
        out.mkdir(parents=True, exist_ok=True)
        # a link, a FIFO or a folder at any output's name: refused before anything is written (output.py)
        check_targets(out / name for name in (*OUTPUTS, *PLOTS))
        plots, plot_notes = write_plots(result.rows, result.fits, out)
        result.notes += plot_notes
        result.calibration = sizing.cost_fit(result.runs)
        if result.calibration is not None:  # the planner's coefficients, fitted to these runs
            target = out / "calibration.json"
            write_file(target, json.dumps(result.calibration, indent=2) + "\n")
        target = out / "report.md"
        write_markdown(target, result, plots, paths)
        target = out / "report.csv"
        write_csv(target, result.rows)
    except OSError as err:
        raise WriteFailed(Path(err.filename) if err.filename else target, err) from err
    result.files = [out / "report.md", out / "report.csv", *plots] + (
        [out / "calibration.json"] if result.calibration else []
    )

    if log_wandb and runs:
        from rlsync.report import wandb_report  # wandb only when a run logs to it

        result.wandb_line = wandb_report.log_report_run(result)
    return result


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlsync.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="sweep directories and/or run directories")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the sweep, or the first PATH)")
    parser.add_argument("--no-wandb", action="store_true", help="do not log the comparison to W&B")
    parser.add_argument("--wandb-report", action="store_true", help="also publish a W&B Report (needs W&B online)")
    parser.add_argument(
        "--framework",
        default=None,
        help="read other frameworks' runs with this map (docs/report.md; default: detected)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, metavar="N", help="other frameworks' runs: logged steps left out first (2)"
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="PRESET|CONFIG_JSON",
        help="other frameworks' runs: their model, for the update's bytes and floor (default: the Hugging Face id "
        "their config names, where it matches a preset)",
    )
    parser.add_argument(
        "--device",
        default=None,
        metavar="|".join(DEVICES),
        help="other frameworks' runs: the GPU their update's floor is on (default: the GPU the run recorded)",
    )
    return parser.parse_args(argv)


def print_result(result: ReportResult) -> None:
    print(f"rlsync report: {result.group} ({plural(len(result.runs), 'run')}, {len(result.failures)} failed)")
    if result.rows:
        print(result.table_markdown)
        if idle := idle_table(result.rows):  # runs of the step loop: the engine's idle time beside the update
            print(f"\nEngine idle per step (its largest parts beside the update):\n{idle}\n")
        if stalls := stall_table(result.rows):  # stall benches: what streaming clients saw beside the copy
            print(f"\nClient-seen stall per policy (beside the engine's receive):\n{stalls}\n")
        for best in best_settings(result.rows):  # the same sentences as report.md's "Best setting"
            print(f"best: {best.describe()}")
        print("\n".join(update_fit_lines(result.fits)))
        if any(row.get("framework") for row in result.rows):  # other frameworks' runs: each one's answer
            for row in result.rows:
                print(f"verdict: {row['job']} ({row.get('framework') or 'rlsync'}): {row['verdict']}")
    for note in result.notes:
        print(f"note: {note}")
    for failure in result.failures:
        print(f"failed: {failure.job} ({' '.join(failure.overrides) or 'defaults'}): {failure.error}")
    if result.wandb_line:
        print(result.wandb_line)
    for path in result.files:
        print(f"wrote {path}")


def main(argv: Optional[list[str]] = None) -> int:
    """The command line: every ending is one line on stderr and an exit code, never a traceback
    (RLSYNC_DEBUG=1 prints it as well). Ctrl-C, SIGTERM or SIGHUP stop it with its line and 128 + the signal,
    at once (rlsync.errors.EARLY raises where the report is; one during the entry's imports as they end); a
    reader of its output that goes away (`| head`) stops nothing (rlsync.shell's pipe_safe_output, as elsewhere)."""
    previous = EARLY.install()  # the stop signals, unless the entry took them at its first line (this package's)
    raising, EARLY.raising = EARLY.raising, True
    try:
        with pipe_safe_output():
            return run_command(argv)
    finally:
        EARLY.raising = raising
        for sig, handler in previous.items():  # in this process's caller (a test): its own handlers back
            signal.signal(sig, handler)


def run_command(argv: Optional[list[str]]) -> int:
    try:
        EARLY.check()  # a stop during the imports, recorded there
        code = report_main(parse_args(argv))
        EARLY.check()  # one that library code swallowed on the way: the report still ends as it was asked
        return code
    except KeyboardInterrupt as err:
        EARLY.raising = False  # a second signal while the line is printed is not raised inside it
        stop = Interrupted(err.signum) if isinstance(err, Interrupted) else err
        print(f"rlsync.report: {describe(stop)}", file=sys.stderr, flush=True)
        EARLY.reported(err)
        return exit_code(stop)
    except WriteFailed as err:
        print(f"rlsync.report: {err}", file=sys.stderr)
        return 1
    except BadInput as err:  # another framework's run that cannot be read or answered: nothing was written
        print(f"rlsync.report: {err}", file=sys.stderr)
        return 2
    except RlsyncError as err:  # an output's name that holds a link or a FIFO (output.RefusedTarget): nothing written
        print(f"rlsync.report: {err}", file=sys.stderr)
        return exit_code(err)
    except Exception as err:  # noqa: BLE001 - a bug in the report: one line, the traceback on request
        from rlsync.errors import debug_enabled

        if debug_enabled():
            import traceback

            traceback.print_exc()
        print(
            f"rlsync.report: failed: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            f" (RLSYNC_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1


def report_main(args: argparse.Namespace) -> int:
    if args.warmup is not None and args.warmup < 0:
        raise BadInput(f"--warmup {args.warmup}: out of range (allowed: 0 or more logged steps)")
    result = write_report(
        args.paths,
        out_dir=args.out,
        log_wandb=not args.no_wandb,
        framework=args.framework,
        warmup=args.warmup,
        model=args.model,
        device=args.device,
    )
    if not result.runs and not result.failures:
        print(
            f"rlsync.report: no run directories found within {plural(RUN_DEPTH, 'level')} under "
            f"{' '.join(map(str, args.paths))} (nor another framework's run within {READER_DEPTH} levels; "
            f"docs/report.md, Finding the runs)",
            file=sys.stderr,
        )
        return 1
    print_result(result)
    if failed_plots := [n for n in result.notes if " failed: " in n]:  # a plot that could not be drawn or written
        print(f"rlsync.report: {len(failed_plots)} plot(s) failed: {failed_plots[0]}", file=sys.stderr)
        return 1
    if not result.ok:
        print(
            f"rlsync.report: no run measured a step ({len(result.failures)} failed); see {result.out_dir / 'report.md'}",
            file=sys.stderr,
        )
        return 1
    if args.wandb_report:
        from rlsync.report import wandb_report  # wandb only when a run logs to it

        try:
            url = wandb_report.publish_report(result)
        except wandb_report.ReportUnavailable as exc:
            print(f"rlsync.report: {exc}; the local report was written to {result.out_dir}", file=sys.stderr)
            return 3
        print(f"W&B report: {url}")
    return 0
