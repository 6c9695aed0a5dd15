"""What a framework's logged keys mean: one declared class per framework (its keys, what each spans,
its step axis, its warm-up, its traps), the registry `--framework` names, and detection.

Adding a framework is one module holding a `FrameworkMap` subclass and one line:

    register_framework("mine", "mypackage.mine:MyMap")   # resolved on first use

Keys are tuples: the first one a run logged is read (a framework renames a key between releases).
Each time is in seconds. `phases` are the step's other parts under rlsync's phase names
(rlsync/measure/metrics.py: "rollout", "log_probs", "train", ...), so the report's step breakdown and
the largest phase read them as they read rlsync's own runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Optional

from rlsync.readers.base import CLOCK, History, ReadRefused
from rlsync.registry import Registry

Phases = dict[str, tuple[str, ...]]  # rlsync phase name -> the framework's keys for it


class FrameworkMap:
    """One framework's metric names and what they span."""

    title: ClassVar[str] = ""  # how the report names it ("verl")
    update: ClassVar[tuple[str, ...]] = ()  # the weight update's time
    step: ClassVar[tuple[str, ...]] = ()  # the whole step's time; () = from the clock (the time between steps)
    offload: ClassVar[tuple[str, ...]] = ()  # the trainer's offload (rlsync's perf/sleep_time)
    onload: ClassVar[tuple[str, ...]] = ()  # the trainer's onload (rlsync's perf/wake_up_time)
    phases: ClassVar[Phases] = {}  # the step's other parts, by rlsync phase name
    axis: ClassVar[tuple[str, ...]] = ()  # the step axis' key; () = the writer's own step (W&B's _step, TB's step)
    carry_to_next: ClassVar[bool] = False  # rows without the axis belong to the next row with it (else dropped)
    warmup: ClassVar[int] = 2  # logged steps left out first (the guide's two)
    spans: ClassVar[str] = ""  # what its update time spans: the note under the verdict
    traps: ClassVar[tuple[str, ...]] = ()  # what else reading it needs to know (docs/report.md)
    config_keys: ClassVar[tuple[str, ...]] = ()  # top-level config keys only this framework's runs carry
    model_keys: ClassVar[tuple[str, ...]] = ()  # dotted config keys holding the Hugging Face model id
    checked: ClassVar[str] = ""  # where the key names were read

    @classmethod
    def first(cls, keys: Iterable[str], candidates: tuple[str, ...]) -> Optional[str]:
        present = set(keys)
        return next((k for k in candidates if k in present), None)

    @classmethod
    def recognises(cls, keys: set[str]) -> bool:
        """Whether a run with `keys` logged this framework's update and a step (its key, or a clock)."""
        return cls.first(keys, cls.update) is not None and (cls.first(keys, cls.step) is not None or CLOCK in keys)

    @classmethod
    def matched(cls, keys: set[str]) -> int:
        """How many of its keys a run logged: the better fit among frameworks that each recognise it."""
        declared = {*cls.update, *cls.step, *cls.offload, *cls.onload, *cls.axis}
        declared.update(k for ks in cls.phases.values() for k in ks)
        return len(declared & keys)

    @classmethod
    def model_id(cls, config: dict[str, Any]) -> Optional[str]:
        """The Hugging Face model id the run's config names, if any."""
        for dotted in cls.model_keys:
            node: Any = config
            for part in dotted.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, str) and node:
                return node
        return None


FRAMEWORKS: Registry[FrameworkMap] = Registry(
    "--framework",
    {
        "miles": "rlsync.readers.frameworks.miles:Miles",
        "verl": "rlsync.readers.frameworks.verl:Verl",
        "trl": "rlsync.readers.frameworks.trl:TRL",
        "trl_async": "rlsync.readers.frameworks.trl:TRLAsync",
        "nemo_rl": "rlsync.readers.frameworks.nemo_rl:NemoRL",
        "skyrl": "rlsync.readers.frameworks.skyrl:SkyRL",
        "openrlhf": "rlsync.readers.frameworks.openrlhf:OpenRLHF",
        "areal": "rlsync.readers.frameworks.areal:AReaL",
        "prime_rl": "rlsync.readers.frameworks.prime_rl:PrimeRL",
        "open_instruct": "rlsync.readers.frameworks.open_instruct:OpenInstruct",
    },
)
register_framework = FRAMEWORKS.register
framework_names = FRAMEWORKS.names
framework_class = FRAMEWORKS.resolve


def shown_keys(keys: set[str], limit: int = 12) -> str:
    named = sorted(k for k in keys if not k.startswith("_"))
    more = f" and {len(named) - limit} more" if len(named) > limit else ""
    return (", ".join(named[:limit]) or "none") + more


def detect(history: History, forced: Optional[str] = None) -> tuple[str, type[FrameworkMap]]:
    """The framework whose map reads `history`: `forced` (--framework), else the one its format implies,
    else the one its config names, else the recognising map that matches most keys. ReadRefused (one line
    naming the keys found and the frameworks known) when none recognises an update and a step."""
    keys = history.keys()
    if forced is not None:
        if forced not in FRAMEWORKS:
            raise ReadRefused(f"--framework {forced}: not a framework rlsync knows ({', '.join(framework_names())})")
        cls = framework_class(forced)
        if not cls.recognises(keys):
            raise ReadRefused(
                f"{history.path}: --framework {forced} reads its update from {' or '.join(cls.update)} and its step "
                f"from {' or '.join(cls.step) or 'the clock'}; this run logged {shown_keys(keys)}"
            )
        return forced, cls
    fitting = [(n, framework_class(n)) for n in framework_names() if framework_class(n).recognises(keys)]
    if not fitting:
        raise ReadRefused(
            f"{history.path}: no framework's update and step keys among the keys it logged ({shown_keys(keys)}); "
            f"rlsync knows {', '.join(framework_names())} (docs/report.md; --framework NAME)"
        )
    for name, cls in fitting:  # the format says (verl's file logger, Miles' dashboard)
        if name in history.hints:
            return name, cls
    named = [(n, c) for n, c in fitting if any(k in history.config for k in c.config_keys)]
    return max(named or fitting, key=lambda nc: nc[1].matched(keys))
