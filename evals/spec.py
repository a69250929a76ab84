"""What every benchmark implementation shares: its CLI options declared once, and the checks of
the :class:`evals.registry.Benchmark` protocol's arguments (option keys, window, context length).

A benchmark class lists its options as :class:`Option` entries; ``add_arguments`` (argparse),
``option_defaults`` and the validation of an ``options`` mapping all derive from that one list,
so the flag names, ``dest`` keys and defaults cannot drift apart. Only the standard library is
imported here.
"""
from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Option", "BenchmarkBase", "check_positive_int"]


@dataclass(frozen=True)
class Option:
    """One benchmark-specific command-line option.

    ``flag`` is the long option (``"--data-dir"``); its ``dest`` (the key of ``options``) is the
    flag without the dashes, ``-`` -> ``_`` (``"data_dir"``). ``store_true`` makes a boolean switch
    (default ``False``).
    """

    flag: str
    default: Any = None
    help: str = ""
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    store_true: bool = False
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        kwargs: dict[str, Any] = {"dest": self.dest, "default": self.default, "help": self.help}
        if self.store_true:
            parser.add_argument(self.flag, action="store_true", **kwargs)
            return
        if self.type is not None:
            kwargs["type"] = self.type
        if self.choices is not None:
            kwargs["choices"] = list(self.choices)
        if self.metavar is not None:
            kwargs["metavar"] = self.metavar
        parser.add_argument(self.flag, **kwargs)


def check_positive_int(value: Any, what: str, *, minimum: int = 1, allow_none: bool = True) -> int | None:
    """``value`` as an int >= ``minimum`` (None passes when ``allow_none``); else ValueError naming ``what``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


class BenchmarkBase:
    """Shared plumbing of the benchmark classes (see :class:`evals.registry.Benchmark`).

    Subclasses set the class attributes and :data:`OPTIONS` and implement ``check``,
    ``build_samples``, ``score_sample`` and ``score_predictions``. Instances carry no state: each
    benchmark module holds one, and it pickles as a reference to the registry entry (so
    ``pickle.loads(pickle.dumps(b)) is b`` and bound methods such as ``b.score_sample`` travel to
    Ray workers by name).
    """

    __slots__ = ()

    name: str = ""
    tasks: tuple[str, ...] = ()
    default_tasks: tuple[str, ...] = ()
    generated: bool = False
    default_context_length: int | None = None
    #: The benchmark-specific options (never the shared flags of the cluster CLI).
    OPTIONS: tuple[Option, ...] = ()

    def __reduce__(self) -> str:
        # pickled by reference: the module-level ``benchmark`` of the class's module (every
        # benchmark module defines its entry so), which unpickling imports; no registry import
        return "benchmark"

    def __repr__(self) -> str:
        return f"<benchmark {self.name!r} ({type(self).__module__}.{type(self).__qualname__})>"

    # --- options ------------------------------------------------------------------------------

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this benchmark's own options to ``parser`` (``dest`` = the keys of ``options``)."""
        for option in self.OPTIONS:
            option.add_to(parser)

    def option_defaults(self) -> dict[str, Any]:
        """``{dest: default}`` of the options :meth:`add_arguments` adds."""
        return {option.dest: option.default for option in self.OPTIONS}

    def resolve_options(self, options: Mapping[str, Any] | None) -> dict[str, Any]:
        """``options`` over :meth:`option_defaults` (a missing key takes its default; ``None``
        values count as given). An unknown key raises ``ValueError`` with a suggestion."""
        resolved = self.option_defaults()
        if options is None:
            return resolved
        if not isinstance(options, Mapping):
            raise ValueError(f"{self.name}: options must be a mapping, got {type(options).__name__}")
        for key in options:
            if key not in resolved:
                close = difflib.get_close_matches(str(key), list(resolved), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                known = ", ".join(resolved) or "none"
                raise ValueError(f"{self.name}: unknown option {key!r}{hint} (known: {known})")
        resolved.update(options)
        return resolved

    # --- window and context length ------------------------------------------------------------

    def total_limit(self, window: int, context_length: int | None) -> int:
        """Tokens that prompt + generation budget may take: ``min(context_length, window)``
        (``context_length`` None: the window). ``context_length > window`` raises ValueError."""
        check_positive_int(window, "window", allow_none=False)
        if context_length is None:
            return window
        check_positive_int(context_length, "context_length", allow_none=False)
        if context_length > window:
            raise ValueError(
                f"{self.name}: context_length={context_length} exceeds the model window ({window} tokens)"
            )
        return context_length
