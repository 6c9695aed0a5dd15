"""bench.target=vllm_paths on the tiny model, in a real process: vLLM's three update paths timed in one benchmark,
each row verified against the trainer (issue 46). Skipped, with the reason shown, only where vLLM is not installed
(`pip install -e '.[vllm]'`).

In this process (run_main) the first sample after an update failed here in torch.compile's C++ build of vLLM's
compiled gather_logprobs ("cannot execute 'cc1plus'"), where the same bench as `python -m rlsync.bench` ran.
"""

from __future__ import annotations

import json

from conftest import needs_vllm, read_jsonl, run_cli

from rlsync.bench.vllm_paths import PATHS

BENCH = ("bench.target=vllm_paths", "rollout.engine=vllm", "run.progress=false")
TOKEN_TOL, MEAN_TOL = 0.03, 0.008  # the tiny model's bf16 engine against its fp32 trainer (tests/process/test_vllm.py)


@needs_vllm
def test_one_bench_times_and_checks_each_vllm_path(tmp_path):
    proc = run_cli(
        *BENCH, "bench.warmup=1", "bench.repeats=2", f"hydra.run.dir={tmp_path}", module="rlsync.bench", timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["target"] == "vllm_paths" and summary["measured_steps"] == 2
    assert "vllm_reload_mode" in summary["setup"] and summary["setup"]["vllm_reload_mode"] is None
    paths = summary["vllm_paths"]["paths"]
    assert list(paths) == list(PATHS)
    # each path's floor counts what its receiver declares (Engine.receiver_copies): the four phases' two copies
    assert paths["vllm_weight_transfer"] == {**paths["vllm_weight_transfer"], "strategy": "vllm_shm"}
    assert paths["vllm_weight_transfer"]["receiver_copies"] == ["load", "copy back"]
    assert paths["rlsync_reload"]["receiver_copies"] == paths["vllm_reload"]["receiver_copies"] == []
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]  # one warm-up, two timed: one row per repeat, every path in it
    m = summary["metrics"]
    for path in PATHS:
        key = f"vllm_paths/{path}"
        assert all(r[f"{key}/update_weights_time"] > 0 and r[f"{key}/update_weights_limit_time"] > 0 for r in rows)
        assert m[f"{key}/update_weights_bytes"]["median"] == summary["model"]["update_bytes"]  # the same update
    # the floor of the four phases adds its two receiver copies to the one every update makes
    wt, rr = (
        m["vllm_paths/vllm_weight_transfer/update_weights_limit_time"],
        m["vllm_paths/rlsync_reload/update_weights_limit_time"],
    )
    assert wt["median"] > rr["median"]
    for path in ("rlsync_reload", "vllm_weight_transfer"):  # match the weights just sent, every timed repeat
        assert m[f"vllm_paths/{path}/verified"]["min"] == 1
        assert m[f"vllm_paths/{path}/logprob_max_diff"]["max"] < TOKEN_TOL
        assert m[f"vllm_paths/{path}/logprob_old_mean_diff"]["min"] > 5 * MEAN_TOL  # the old weights lie far off
    # vLLM's reload as its users call it, on a CPU: its finalize leaves the tied lm_head packed from the old
    # embedding (rlsync's path re-packs it), so the check must catch it, and the bench say so
    assert m["vllm_paths/vllm_reload/verified"]["max"] == 0
    assert "NOT VERIFIED: vllm_reload" in summary["warning"]
    for path in PATHS:
        assert f"| {path} |" in proc.stdout
    assert "not a GPU's" in proc.stdout
