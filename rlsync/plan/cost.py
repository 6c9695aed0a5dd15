"""The update's cost model: `calls x per_call + tensors x per_tensor + bytes / bandwidth`.

One set of coefficients per setup (`Setup`: transport, strategy, flat engine weights or not), since
a call is a different thing in each (a staged bucket, a message to another process, a per-tensor
`copy_`). The three terms:

- calls: the update's units of work: buckets for `bucketed`, tensors for `per_tensor` (one call
  each).
- tensors: per named tensor, whatever the grouping (the views, the per-tensor `copy_` launches inside
  a bucket's pack and load). For `per_tensor` calls and tensors are the same count, so there this
  column counts the *pooled* tensors instead (`Work.pooled`): those whose copy runs on torch's CPU
  thread pool (more than 32,768 elements, rlsync.measure.threads.POOL_GRAIN), each copy waking the
  pool's sleeping threads, in both processes over ipc: such a message costs a few times one copied
  on one thread (experiments/sizing/README.md, "Measurements behind the cost model").
- bytes: read + written by the update's copies, the dtype conversion counted (trainer.dtype ->
  rollout.dtype reads one itemsize and writes the other); the copies are one (per-tensor direct, flat
  engine weights) or two (pack into staging, then load: bucketed, per-tensor through a process);
  the second copy's read of a unit (tensor or bucket) that fits in half the CPU's last-level cache
  is not counted: it reads the cache the first copy just wrote (`moved_bytes`).
  Bandwidth is fitted as absolute bytes per second, not relative to the copy floor: a floor measured
  at plan time would mean allocating, and on a GPU profile it is a published figure anyway.

`fit` is a least squares with non-negative coefficients on relative error (each row divided by its
measured time), so that a 5 ms run and a 2 s run weigh alike: calibration spans three orders of
magnitude and the plan extrapolates upwards. Pure functions: no torch, nothing allocated.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Optional

from rlsync.check.estimate import DTYPE_BYTES  # bytes per element of each trainer / engine dtype
from rlsync.trainer.parallel import parallel_class
from rlsync.update.base import Transport, transport_class, transport_names

TERMS = ("per_call_s", "per_tensor_s", "per_byte_s")


@dataclass(frozen=True)
class Setup:
    """What a set of coefficients is for."""

    transport: str
    strategy: str
    flat: bool = False

    @property
    def key(self) -> str:
        return f"{self.transport}/{self.strategy}" + ("/flat" if self.flat else "")

    @classmethod
    def from_key(cls, key: str) -> Setup:
        transport, strategy, *rest = key.split("/")
        return cls(transport, strategy, rest == ["flat"])


def copies(setup: Setup) -> int:
    """How many times the update copies each element (rlsync/update: direct.py, ipc.py, broadcast.py)."""
    # what the transport declares; a setup read from a calibration of a transport not registered here: the default
    declares = transport_class(setup.transport) if setup.transport in transport_names() else Transport
    return declares.copies(setup.strategy, setup.flat)


def moved_bytes(setup: Setup, elements: int, trainer_dtype: str, engine_dtype: str, cached: int = 0) -> int:
    """Bytes read + written by the update's copies that reach memory: the first converts trainer ->
    engine dtype, the others copy the engine dtype. `cached`: elements of the units (tensors for
    per_tensor, buckets otherwise) whose staging fits in half the CPU's last-level cache
    (rlsync.measure.floors.cache_resident_elements): the second copy reads those from the cache the first
    just wrote them to, so that read is not counted (experiments/sizing/README.md, "Measurements
    behind the cost model")."""
    t, e = DTYPE_BYTES[trainer_dtype], DTYPE_BYTES[engine_dtype]
    n = copies(setup)
    return elements * ((t + e) + (n - 1) * 2 * e) - (cached * e if n > 1 else 0)


@dataclass(frozen=True)
class Work:
    """What one update does, in the model's three terms."""

    calls: int
    tensors: int
    bytes: int
    pooled: int = 0  # tensors whose CPU copy runs on torch's thread pool (rlsync.measure.threads.pooled)

    def row(self, setup: Setup) -> list[float]:
        """The design-matrix row; per_tensor's tensor column counts the pooled tensors (its calls count them all)."""
        return [self.calls, self.pooled if setup.strategy == "per_tensor" else self.tensors, self.bytes]


def tensor_term(setup: Setup) -> str:
    """What the tensor column counts for `setup` (Work.row)."""
    return "pooled tensors" if setup.strategy == "per_tensor" else "tensors"


def work(
    setup: Setup,
    *,
    tensors: int,
    buckets: int,
    elements: int,
    trainer_dtype: str,
    engine_dtype: str,
    pooled: int = 0,
    cached: int = 0,
) -> Work:
    calls = tensors if setup.strategy == "per_tensor" else buckets
    return Work(calls, tensors, moved_bytes(setup, elements, trainer_dtype, engine_dtype, cached), pooled)


@dataclass
class Coefficients:
    """One setup's fitted coefficients and how well they fit."""

    per_call_s: float
    per_tensor_s: float
    per_byte_s: float
    points: int = 0  # runs fitted
    rel_residual_max: float = 0.0  # largest |measured - fitted| / fitted over those runs
    rel_residual_rms: float = 0.0
    repeat_spread: float = 0.0  # median of the runs' (max - min) / 2 / median over their repeats

    @property
    def bandwidth_gbps(self) -> Optional[float]:
        return 1e-9 / self.per_byte_s if self.per_byte_s > 0 else None

    @property
    def rel_error(self) -> float:
        """The prediction's half-range, relative: the worst fitted residual or the repeats' own spread."""
        return max(self.rel_residual_max, self.repeat_spread)

    def terms(self, w: Work, setup: Setup) -> dict[str, float]:
        calls, tensors, nbytes = w.row(setup)
        return {
            "calls_s": calls * self.per_call_s,
            "tensors_s": tensors * self.per_tensor_s,
            "bytes_s": nbytes * self.per_byte_s,
        }

    def predict(self, w: Work, setup: Setup) -> float:
        return sum(self.terms(w, setup).values())

    def as_dict(self) -> dict:
        d = asdict(self)
        d["bandwidth_gbps"] = self.bandwidth_gbps
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Coefficients:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class Observation:
    """One benchmark run, as the fit sees it."""

    setup: Setup
    work: Work
    time_s: float  # median over the timed repeats
    spread: float = 0.0  # (max - min) / 2 / median
    floor_s_per_byte: Optional[float] = (
        None  # the run's own copy floor: seconds per byte read + written (rlsync.measure.floors)
    )
    source: str = ""  # where it came from (a run dir)
    model: str = ""
    extra: dict = field(default_factory=dict)


def nnls(a: list[list[float]], b: list[float]) -> list[float]:
    """Non-negative least squares (scipy's Lawson-Hanson), columns scaled to unit norm first so that
    bytes (1e9) and calls (1e1) are conditioned alike."""
    import numpy as np
    from scipy.optimize import nnls as scipy_nnls

    a_, b_ = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    scale = np.linalg.norm(a_, axis=0)
    scale[scale == 0] = 1.0
    x, _ = scipy_nnls(a_ / scale, b_)
    return list(x / scale)


def at_floor(o: Observation) -> Observation:
    """`o` with its bytes counted in units of its run's copy floor (seconds at the floor x 1e9), so that
    the fitted per-byte coefficient is a multiple of the floor: time at the floor per byte x 1e-9."""
    w = Work(o.work.calls, o.work.tensors, int(o.work.bytes * o.floor_s_per_byte * 1e9), o.work.pooled)
    return Observation(o.setup, w, o.time_s, o.spread, o.floor_s_per_byte, o.source, o.model, o.extra)


def fit(observations: Iterable[Observation], *, relative_to_floor: bool = False) -> dict[str, Coefficients]:
    """Coefficients per setup from benchmark runs: NNLS of time on (calls, tensors, bytes), each row
    weighted by 1 / its time (relative error). `relative_to_floor`: bytes in units of each run's own
    copy floor (runs without one left out), so per_byte_s * 1e9 is the update's cost per byte as a
    multiple of the floor's: on a shared machine the floor moves with the load, and the update with it."""
    by_setup: dict[Setup, list[Observation]] = {}
    for o in observations:
        if relative_to_floor:
            if not o.floor_s_per_byte:
                continue
            o = at_floor(o)
        if o.time_s > 0:
            by_setup.setdefault(o.setup, []).append(o)
    out = {}
    for setup, obs in sorted(by_setup.items(), key=lambda kv: kv[0].key):
        a = [[x / o.time_s for x in o.work.row(setup)] for o in obs]
        x = nnls(a, [1.0] * len(obs))
        coef = Coefficients(*x, points=len(obs))
        rel = [(o.time_s - coef.predict(o.work, setup)) / max(coef.predict(o.work, setup), 1e-12) for o in obs]
        coef.rel_residual_max = max(abs(r) for r in rel)
        coef.rel_residual_rms = math.sqrt(sum(r * r for r in rel) / len(rel))
        coef.repeat_spread = statistics.median(o.spread for o in obs)
        out[setup.key] = coef
    return out


def predict(coef: Coefficients, w: Work, setup: Setup) -> dict:
    """The predicted time with its range and the share of each term."""
    t = coef.predict(w, setup)
    e = coef.rel_error
    terms = coef.terms(w, setup)
    return {
        "time_s": t,
        "low_s": t * max(0.0, 1 - e),
        "high_s": t * (1 + e),
        "terms": terms,
        "shares": {k: (v / t if t > 0 else None) for k, v in terms.items()},
    }


def gather_seconds(trainer_bytes: int, ranks: int, collective_gbps: float) -> float:
    """The gather of the update from FSDP2 shards (trainer.parallel=fsdp2, rlsync/update/gather.py), at its floor:
    each rank receives the (N-1)/N of the trainer-dtype bytes it does not hold, over a collective whose bus
    bandwidth is `collective_gbps` (GB/s per rank; a run's all-gather floor, limits.gather_gbps, counts the
    gathered bytes, i.e. bus bandwidth x N/(N-1)). One rank gathers nothing."""
    if ranks <= 1:
        return 0.0
    return trainer_bytes * (ranks - 1) / ranks / (collective_gbps * 1e9)


def per_rank_state_bytes(state_bytes: int, ranks: int, parallel: str) -> int:
    """The trainer state one rank holds (and offloads): all of it under ddp, 1/N of it where trainer.parallel's
    class declares `sharded` (fsdp2; up to padding)."""
    return -(-state_bytes // ranks) if ranks > 1 and parallel_class(parallel).sharded else state_bytes
