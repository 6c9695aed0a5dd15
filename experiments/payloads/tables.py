"""The README's payload tables, printed from bench run directories (their summary.json), one row per run.

    python experiments/payloads/tables.py experiments/payloads/results_cpu/runs/goals_delta
    python experiments/payloads/tables.py experiments/payloads/results_cpu/runs/goals_fp8 --ratios

Columns: transport, payload, changed share, bytes sent, update (median, min to max over the timed repeats),
the copy floor of the full update, encode and decode (median time, efficiency: their own floor / time), the
transfer, the cores other processes kept busy during the run. `--ratios` adds, per transport, each payload's
update over the median of the full updates of the same directories (the goals' ratios: within one sweep).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlsync.fmt import fmt_bytes, fmt_seconds, fmt_share

HEAD = (
    "| transport | payload | changed share | bytes sent | update, median (min to max) | copy floor "
    "| encode (efficiency) | decode (efficiency) | transfer | others' busy cores |"
)


def runs(dirs: list[Path]) -> list[dict]:
    """Every finished bench run under `dirs`, in sweep order."""
    found = []
    for d in dirs:
        paths = [d / "summary.json"] if (d / "summary.json").exists() else sorted(d.glob("*/summary.json"), key=job)
        for p in paths:
            s = json.loads(p.read_text())
            if s.get("status") == "finished" or s.get("metrics"):
                found.append(s)
    return found


def job(path: Path) -> tuple:
    name = path.parent.name
    return (0, int(name)) if name.isdigit() else (1, name)


def median(m: dict, key: str):
    v = m.get(f"perf/update_weights_{key}")
    return v.get("median") if isinstance(v, dict) else v


def side(m: dict, name: str) -> str:
    t, eff = median(m, f"{name}_time"), median(m, f"{name}_efficiency")
    if t is None:
        return "-"
    return f"{fmt_seconds(t)} ({eff:.2f})" if eff is not None else f"{fmt_seconds(t)} (-)"


def row(s: dict) -> str:
    m, setup = s["metrics"], s["setup"]
    t = m["perf/update_weights_time"]
    payload = setup.get("payload") or "full"
    changed = median(m, "changed_ratio")
    busy = (s.get("cpu") or {}).get("others_busy_cores_during_run")
    cells = [
        setup["transport"],
        payload,
        fmt_share(changed) if changed is not None else "-",
        fmt_bytes(median(m, "bytes")),
        f"{fmt_seconds(t['median'])} ({fmt_seconds(t['min'])} to {fmt_seconds(t['max'])})",
        fmt_seconds(median(m, "limit_time")),
        side(m, "encode"),
        side(m, "decode"),
        fmt_seconds(median(m, "transfer_time")) if median(m, "transfer_time") is not None else "-",
        f"{busy:.2f}" if busy is not None else "-",
    ]
    return "| " + " | ".join(cells) + " |"


def ratios(found: list[dict]) -> list[str]:
    """Per transport: each payload run's median update over the median of that transport's full updates."""
    full: dict[str, list[float]] = {}
    for s in found:
        if (s["setup"].get("payload") or "full") == "full":
            full.setdefault(s["setup"]["transport"], []).append(s["metrics"]["perf/update_weights_time"]["median"])
    lines = []
    for s in found:
        transport, payload = s["setup"]["transport"], s["setup"].get("payload") or "full"
        if payload == "full" or transport not in full:
            continue
        base = statistics.median(full[transport])
        changed = median(s["metrics"], "changed_ratio")
        share = f" at {fmt_share(changed)} changed" if changed is not None else ""
        t = s["metrics"]["perf/update_weights_time"]["median"]
        lines.append(
            f"- {transport}, {payload}{share}: {t / base:.2f}x the full update ({fmt_seconds(t)} against "
            f"{fmt_seconds(base)}, the median of {len(full[transport])} full job(s))"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="sweep or run directories")
    parser.add_argument("--ratios", action="store_true", help="each payload's update over its transport's full one")
    args = parser.parse_args()
    found = runs(args.dirs)
    print(HEAD)
    print("|" + "---|" * HEAD.count(" | ") + "---|")
    for s in found:
        print(row(s))
    if args.ratios:
        print()
        print("\n".join(ratios(found)))


if __name__ == "__main__":
    main()
