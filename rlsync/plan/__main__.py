"""`python -m rlsync.plan` (`rlsync-plan`): the update's plan and predicted time; with
`plan.calibrate=true` (or `plan.fit_from=DIR`) the coefficients are fitted first and written to
`plan.calibration`."""

from __future__ import annotations

if __name__ == "__main__":  # python -m rlsync.plan: the stop signals from the first line; one that arrives
    from rlsync.errors import EARLY  # during the imports below is acted on as cli starts (one line, 128 + it)

    EARLY.install()

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from rlsync.config.apps import PlanAppConfig
from rlsync.config.compose import CONFIG_PATH, register_configs
from rlsync.config.launch import hydra_job, hydra_record
from rlsync.config.validate import checked_config
from rlsync.errors import ConfigError
from rlsync.fmt import fmt_path
from rlsync.record.run_lock import RunLock
from rlsync.record.sinks import write_json
from rlsync.shell import cli, job_errors

register_configs()


def run_plan(cfg: PlanAppConfig, run_dir) -> dict:
    from rlsync.plan import calibrate, payload_fit, planner, profiles, render

    p = cfg.plan
    if p.calibrate or p.fit_from:
        if p.calibrate:
            data = calibrate.calibrate(cfg, run_dir, log=lambda line: print(line, flush=True))
        else:
            from pathlib import Path

            root = Path(p.fit_from).expanduser()
            if not root.is_dir():
                raise ConfigError(
                    "plan.fit_from",
                    p.fit_from,
                    "a directory holding rlsync.bench runs (their summary.json)",
                    "no such directory",
                )
            observations, coded = calibrate.bench_runs_under(root)  # the full update's runs; other payloads' sides
            if not observations:
                raise ConfigError(
                    "plan.fit_from",
                    p.fit_from,
                    "a directory holding rlsync.bench update runs (kind bench, target update, strategy bucketed or per_tensor)",
                    "holds no finished rlsync.bench update runs to fit",
                )
            data = calibrate.calibration_file(observations, device="from runs", payload_runs=coded)
            data["machine"] = {**data["machine"], **fitted_machine(data)}
        data = calibrate.checked_fit(data, p)  # a fit that determines no setup: refused, nothing written
        where = profiles.save(data, p.calibration)
        write_json(run_dir / "calibration.json", data)  # whole or not at all; a refused write names the file
        took = f", {calibrate.fmt_minutes(data['seconds'])}" if data.get("seconds") else ""
        print(f"Calibration written to {fmt_path(where)} ({len(data['observations'])} runs{took}):")
        print("\n".join(calibrate.coefficient_lines(data)))
        print("\n".join(payload_fit.fit_lines(data)))  # each fitted payload's encode and decode
        print()
    where, data = profiles.resolve(p.calibration)
    plan = planner.make_plan(
        cfg,
        calibration=data,
        calibration_where=where,
        bucket_sizes=list(p.bucket_sizes),
        copy_gbps=p.copy_gbps,
        ranks=p.ranks,
        collective_gbps=p.collective_gbps,
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "plan.json", plan)
    print(render.render(plan))
    print(f"\nplan.json: {fmt_path(run_dir / 'plan.json')}", flush=True)
    left_out = profiles.left_out_line(data)  # the last line: setups the calibration's runs do not determine
    if left_out:
        print(left_out, file=sys.stderr, flush=True)
    return plan


def fitted_machine(data: dict) -> dict:
    """plan.fit_from: the runs' machine as their summaries say (the first run's), not this one's."""
    import json as _json
    from pathlib import Path

    first = next((o["source"] for o in data["observations"] if o.get("source")), None)
    if not first:
        return {}
    summary = Path(first) / "summary.json"
    m = _json.loads(summary.read_text()).get("machine", {})
    import datetime as _dt

    date = _dt.datetime.fromtimestamp(summary.stat().st_mtime, _dt.timezone.utc).isoformat(timespec="seconds")
    return {
        "date": date,
        "load_average": None,
        "device": m.get("device"),
        "cpus": m.get("cpus"),
        "torch": m.get("torch"),
        "platform": m.get("platform"),
        "cuda": str(m.get("device", "")).startswith("cuda"),
        "gpu": m.get("gpu"),
        "fitted_from_runs": True,
    }


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="plan")
def hydra_main(dcfg: DictConfig) -> None:
    with job_errors(None):  # an empty hydra.run.dir: one line, nothing written
        run_dir, _sweep_dir, _name = hydra_job(HydraConfig.get())
    record = hydra_record(dcfg)  # .hydra/: written once the plan holds its directory
    with job_errors(run_dir, hydra_record=record):
        cfg = checked_config(dcfg, PlanAppConfig)
        with RunLock(run_dir, record):  # a live run's directory: refused, nothing of it rewritten
            run_plan(cfg, run_dir)


def main() -> None:
    cli(hydra_main)


if __name__ == "__main__":
    sys.exit(main())
