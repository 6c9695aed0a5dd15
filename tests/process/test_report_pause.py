"""The stall bench's real CLI (`python -m rlsync.bench bench.target=stall`): its closing table, its summary's
recorded keys, and the report reading its run. In-process twins: tests/unit/test_report_pause.py."""

from __future__ import annotations

import json

from conftest import run_cli, section

from rlsync.report import write_report


def test_the_stall_bench_prints_its_table_and_the_report_reads_its_run(tmp_path):
    """The bench's real CLI: two engine processes under streaming load, then the report on its run."""
    run = tmp_path / "stall"
    proc = run_cli(
        "bench.target=stall",
        "bench.warmup=0",
        "bench.repeats=1",
        "bench.before_s=0.5",
        "bench.after_s=0.5",
        "wandb.mode=disabled",
        f"hydra.run.dir={run}",
        module="rlsync.bench",
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Client-seen stall, tiny: 1 updates per policy after 0 warm-up, 2 streaming clients" in proc.stdout
    assert "| pause | in-place receive |" in proc.stdout and "| stage | pointer swap |" in proc.stdout
    assert "all came from the new weights." in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["target"], summary["status"], summary["measured_steps"]) == ("stall", "finished", 1)
    assert summary["setup"]["transport"] == "broadcast"  # whatever update.transport says
    assert summary["pause"] == {"policies": ["pause", "stage"], "clients": 2}  # its recorded key
    m = summary["metrics"]
    assert m["pause/stage/answers_failed_total"]["max"] == m["pause/pause/answers_failed_total"]["max"] == 0
    assert m["pause/stage/staged_bytes"]["median"] > 0 == m["pause/pause/staged_bytes"]["median"]

    write_report([run], out_dir=tmp_path / "out", log_wandb=False)
    md = (tmp_path / "out" / "report.md").read_text()
    table = section(md, "Client-seen stalls")
    assert [line.split(" | ")[1] for line in table.splitlines() if line.startswith("| stall")] == ["pause", "stage"]
    (verdict,) = [line for line in section(md, "Verdicts").splitlines() if line.startswith("- ")]
    assert "longest client-seen gap: pause" in verdict and "transport broadcast" in verdict
