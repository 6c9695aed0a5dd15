"""A registry of named classes, resolved lazily: what `rollout.engine` (rlsync/engines/base.py) and
`update.transport` (rlsync/update/base.py) each keep.

An entry is the class itself, or "module:Class", imported the first time the name is used, so
registering a class whose module pulls in a heavy dependency (vLLM) imports nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar, Union

T = TypeVar("T")


class Registry(dict, Generic[T]):
    """name -> class or "module:Class", in registration order; `key` is the config key it serves."""

    def __init__(self, key: str, entries: dict[str, Union[type[T], str]]):
        super().__init__(entries)
        self.key = key

    def register(self, name: str, ref: Union[type[T], str, None] = None) -> Callable[[type[T]], type[T]] | None:
        """Make `key=name` use `ref` (a class or "module:Class"); without `ref`, a class decorator."""
        if ref is not None:
            self[name] = ref
            return None

        def decorate(cls: type[T]) -> type[T]:
            self[name] = cls
            return cls

        return decorate

    def names(self) -> tuple[str, ...]:
        """The values `key` accepts, in registration order."""
        return tuple(self)

    def resolve(self, name: str) -> type[T]:
        """The class registered as `name`, importing its module the first time."""
        if name not in self:
            raise ValueError(f"{self.key}={name!r}: expected one of {', '.join(self)}")
        ref = self[name]
        if isinstance(ref, str):
            module, _, qualname = ref.partition(":")
            ref = self[name] = getattr(importlib.import_module(module), qualname)
        return ref
