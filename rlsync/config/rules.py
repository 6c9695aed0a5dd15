"""The vocabulary of config value rules, declared beside each key in rlsync/config/schema.py.

    bucket_mb: float = key(512.0, mebibytes("the bucket's size"), "bucket size in MiB")
    transport: str = key("direct", choices("rlsync.update.base:transport_names"), "...")

`key(default, rule, doc)` is a dataclass field whose metadata holds the rule and the line `--help`
shows; rlsync/config/validate.py walks the schema and applies each leaf's rule (`ok(value)`; `allowed` is what the error offers instead).
Choices that an implementation owns (engines, transports, dtypes, ...) are named by import path and
looked up when checked (`choices("module:attr")`), so the schema imports nothing above it and a name
registered at run time (a test's toy engine) is accepted. This module imports nothing of rlsync
but the formatters.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Union

from rlsync.fmt import MIB, is_number

INT64_MAX = 2**63 - 1  # torch sizes and offsets are int64


@dataclass(frozen=True)
class Rule:
    ok: Callable[[Any], bool]
    allowed: str  # what the error message offers instead


@dataclass(frozen=True)
class Choices:
    """One of the names at `provider` ("module:attr": a collection of names, or a function returning
    one), imported when a value is checked, never when the schema is."""

    provider: str

    def names(self) -> tuple[str, ...]:
        found = resolve(self.provider)
        return tuple(found() if callable(found) else found)

    def ok(self, value: Any) -> bool:
        return value in self.names()

    @property
    def allowed(self) -> str:
        return ", ".join(self.names())


@dataclass(frozen=True)
class ChoiceList(Choices):
    """A non-empty list of the names at `provider`, each one of them (looked up when checked); `why` says
    what the names are."""

    why: str = ""

    def ok(self, value: Any) -> bool:
        return isinstance(value, (list, tuple)) and bool(value) and all(v in self.names() for v in value)

    @property
    def allowed(self) -> str:
        return f"a non-empty list, each one of {', '.join(self.names())}{note(self.why)}"


AnyRule = Union[Rule, Choices]


def resolve(path: str) -> Any:
    """The object at "module:attr" (attr may be dotted), importing its module."""
    module, _, attr = path.partition(":")
    found = importlib.import_module(module)
    for part in attr.split("."):
        found = getattr(found, part)
    return found


def key(default: Any, rule: AnyRule, doc: str) -> Any:
    """A schema field with its default, its value rule and the one line `--help` shows for it (a list
    default is copied per instance)."""
    if not isinstance(rule, (Rule, Choices)):
        raise TypeError(f"key(default, rule, doc): the rule must be a Rule or Choices, got {rule!r}")
    if not doc or "\n" in doc:
        raise TypeError(f"key(default, rule, doc): the doc must be one non-empty line, got {doc!r}")
    metadata = {"rule": rule, "doc": doc}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def node(schema: type, doc: str) -> Any:
    """A schema field holding a node of keys (a dataclass), with the one line `--help` heads it with."""
    return field(default_factory=schema, metadata={"doc": doc})


def note(why: str) -> str:
    return f" ({why})" if why else ""


def at_least(low: float, why: str = "") -> Rule:
    return Rule(lambda v: is_number(v) and v >= low, f"a number >= {low:g}{note(why)}")


def above(low: float, why: str = "") -> Rule:
    return Rule(lambda v: is_number(v) and v > low, f"a number > {low:g}{note(why)}")


def between(low: float, high: float, why: str = "") -> Rule:
    return Rule(lambda v: is_number(v) and low <= v <= high, f"{low:g} to {high:g}{note(why)}")


def one_of(names: Iterable[str]) -> Rule:
    """One of fixed `names` (choices an implementation owns: `choices("module:attr")`)."""
    names = tuple(names)
    return Rule(lambda v: v in names, ", ".join(names))


def choices(provider: str) -> Choices:
    """One of the names an implementation offers, at `provider` ("module:attr"), looked up when checked."""
    return Choices(provider)


def or_null(rule: Rule) -> Rule:
    return Rule(lambda v: v is None or rule.ok(v), f"null or {rule.allowed}")


def parsed_by(parser: str, allowed: str) -> Rule:
    """A string the function at `parser` ("module:function", looked up when checked) takes without ValueError."""

    def ok(v: Any) -> bool:
        try:
            resolve(parser)(v)
        except ValueError:
            return False
        return True

    return Rule(ok, allowed)


def mebibytes(why: str) -> Rule:
    """A size in MiB that is a whole number of bytes from 1 to INT64_MAX once multiplied out (int(v * MIB))."""
    return Rule(
        lambda v: is_number(v) and 1 <= int(v * MIB) <= INT64_MAX,
        f"a number of MiB from {1 / MIB:.3g} (1 byte) to {INT64_MAX / MIB:.3g} (2^63 - 1 bytes){note(why)}",
    )


def counts(low: int, high: int, why: str) -> Rule:
    """A whole count from `low` to `high`, written out in full (`between` would say 1e+06)."""
    return Rule(lambda v: is_number(v) and low <= v <= high, f"{low} to {high}{note(why)}")


def list_of(rule: AnyRule) -> Rule:
    """A non-empty list whose every item holds to `rule`."""
    return Rule(
        lambda v: isinstance(v, (list, tuple)) and bool(v) and all(rule.ok(x) for x in v),
        f"a non-empty list, each {rule.allowed}",
    )


def size_rule(high: int, what: str) -> Rule:
    return between(1, high, f"{what}; larger is no published model (a typo?)")


ANY = Rule(lambda v: True, "any value of the key's type")
NAME = Rule(lambda v: isinstance(v, str) and bool(v.strip()), "a non-empty string")
OPTIONAL_NAME = or_null(NAME)
