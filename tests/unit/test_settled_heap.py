"""Python's full garbage collection stays out of timed phases: what setup left is frozen (gc.freeze) while the
steps and the bench's repeats run, and given back to the collector after them (a sweep's next job in the same
process gets this one's cycles back). Before: a full collection of tiny_moe's half a million objects, 0.2 s, landed
in the FP8 update of 2 steps in 3 (0.35 s against 0.13 s) and in whatever phase its turn came."""

from __future__ import annotations

import gc
import weakref

from conftest import QUIET, SMALL_MODEL, run_in_process, run_main

from rlsync.bench import runner
from rlsync.measure.timing import settled_heap
from rlsync.run import loop


class Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def test_the_heap_is_frozen_within_and_its_cycles_collected_after():
    kept = Cycle()
    gone = weakref.ref(kept)
    with settled_heap():
        assert gc.get_freeze_count() > 0
        del kept
        gc.collect()  # a full collection inside does not look at what was frozen
        assert gone() is not None
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None


def frozen_during(monkeypatch, cls, method: str) -> list[int]:
    """gc.get_freeze_count() at each call of cls.method, while it is patched to record it."""
    seen, real = [], getattr(cls, method)

    def recording(self, *args, **kwargs):
        seen.append(gc.get_freeze_count())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, recording)
    return seen


def test_a_runs_steps_run_on_a_settled_heap_and_give_it_back(tmp_path, monkeypatch):
    seen = frozen_during(monkeypatch, loop.Experiment, "step")
    rows, summary = run_in_process(tmp_path / "run")
    assert summary["status"] == "finished" and len(rows) == 3
    assert len(seen) == 3 and all(count > 0 for count in seen), seen
    assert gc.get_freeze_count() == 0


def test_a_benchs_repeats_run_on_a_settled_heap_and_give_it_back(tmp_path, monkeypatch):
    seen = frozen_during(monkeypatch, runner.UpdateTarget, "repeat")
    done = run_main(
        *QUIET, *SMALL_MODEL, "bench.repeats=2", "bench.warmup=1", f"hydra.run.dir={tmp_path}", module="rlsync.bench"
    )
    assert done.returncode == 0, done.stderr
    assert len(seen) == 3 and all(count > 0 for count in seen), seen
    assert gc.get_freeze_count() == 0
