"""Name -> class registries. Keys are the strings used in configs, the database and the dashboard."""
from __future__ import annotations

import difflib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

#: the autoregressive reference method (no drafter): every speedup is against it
AR = "ar"


class MethodUnavailable(ValueError):
    """A method cannot run on this target as provisioned here: the weights or the pair it needs
    are missing (no EAGLE-3 head for the target, a draft model that is not provisioned or does
    not share the target's tokenizer). The message says what is missing and how to get it.

    A sweep records such a method as unavailable for the run (a row that says why) and runs the
    others; any other error fails the shard.
    """


class Registry(Generic[T]):
    """A small name -> object registry; unknown names raise ``ValueError`` with a suggestion."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            hint = difflib.get_close_matches(str(name), list(self._items), n=1)
            raise ValueError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self._items)}"
                + (f" (did you mean {hint[0]!r}?)" if hint else "")
            ) from None

    def keys(self) -> list[str]:
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items


DRAFTERS: Registry = Registry("method")
