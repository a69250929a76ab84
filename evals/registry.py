"""One registry of benchmarks, keyed by the names used everywhere (``Sample.benchmark``, the
store, ``python -m evals.score --benchmark``, the sweep specs).

    from evals.registry import get_benchmark
    bench = get_benchmark("ruler")
    bench.check(tasks=None, options={})                       # fast preflight, no tokenizer
    samples = bench.build_samples(tokenizer, window=8192, context_length=4096)
    score = bench.score_sample(samples[0], "prediction")       # official per-sample score in [0, 1]

Every entry satisfies :class:`Benchmark`. The entries are module-level instances of small
stateless classes (one per module of :mod:`evals.benchmarks`, named ``benchmark`` there); they
pickle as a reference to that module-level name, so a benchmark, its bound ``score_sample`` and the samples it builds travel to Ray
workers. Importing this module imports the benchmark modules (standard library only; no torch,
transformers, datasets, ray or sqlalchemy).
"""
from __future__ import annotations

import argparse
import difflib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from evals.base import Sample

__all__ = ["Benchmark", "BENCHMARKS", "get_benchmark"]


@runtime_checkable
class Benchmark(Protocol):
    """What every benchmark provides.

    Attributes:
        name: registry key == ``Sample.benchmark``.
        tasks: every task it knows (LongBench: the 21 tasks + the 13 LongBench-E ``*_e``).
        default_tasks: the tasks run when none are named. Data-dependent for LongBench and
            InfiniteBench (every task with a file in the default data folder); the entries also
            offer ``resolve_tasks(tasks, options)`` for the tasks a given call would run.
        generated: True: synthetic, generated at each context length (RULER); False: natural
            data, truncated to each context length.
        default_context_length: the context length used when none is given (RULER 4096);
            None for natural data (no cap beyond the model window).
    """

    name: str
    tasks: tuple[str, ...]
    default_tasks: tuple[str, ...]
    generated: bool
    default_context_length: int | None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the benchmark-specific options only (``dest`` = the keys of ``options``, same
        defaults as :meth:`option_defaults`); never the shared flags of the cluster CLI
        (--model --methods --tasks --num-samples --max-new-tokens --context-length ...)."""
        ...

    def option_defaults(self) -> dict[str, Any]:
        """``{dest: default}`` of the options of :meth:`add_arguments` (JSON-able)."""
        ...

    def check(self, *, tasks: Sequence[str] | None, options: Mapping[str, Any]) -> None:
        """Fast preflight, no tokenizer: unknown task names (did-you-mean), unknown option keys,
        a missing data folder or file raise ValueError / FileNotFoundError with one clear line."""
        ...

    def build_samples(
        self,
        tokenizer: Any,
        *,
        window: int,
        context_length: int | None = None,
        tasks: Sequence[str] | None = None,
        num_samples: int | None = None,
        max_new_tokens: int | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> list[Sample]:
        """Samples for ``tokenizer``. ``window``: the model's context window; ``context_length``
        L: prompt + generation budget <= L (RULER generates at L, default 4096; natural data is
        truncated officially to ``min(L, window)``); L > window raises ValueError. Deterministic;
        ``sample_id`` is stable and unique per (benchmark, task). ``options``: keys of
        :meth:`option_defaults` (missing ones take the defaults; an unknown key raises)."""
        ...

    def score_sample(self, sample: Sample, prediction: str) -> float:
        """The official per-sample score of ``prediction``, in [0, 1]."""
        ...

    def score_predictions(self, task: str, records: Sequence[dict], *, model_name: str | None = None) -> dict:
        """Re-score the records of an official prediction file: ``{"task", "score", "n", ...}``
        on the official scale. ``model_name`` only matters for InfiniteBench (its official
        ``--model_name``; ``"gpt4"`` applies the math_calc rule)."""
        ...


def _load() -> dict[str, Benchmark]:
    from evals.benchmarks import chat, infinitebench, longbench, longbench_v2, ruler, speed

    entries = [longbench.benchmark, longbench_v2.benchmark, infinitebench.benchmark, ruler.benchmark, speed.benchmark,
               chat.benchmark]
    return {b.name: b for b in entries}


#: name -> benchmark: ``longbench``, ``longbench_v2``, ``infinitebench``, ``ruler`` (quality), ``speed``
#: (fixed-length speed samples) and ``chat`` (short chat and summarisation prompts): no quality
#: score for the last two (their ``score_sample`` returns None).
BENCHMARKS: dict[str, Benchmark] = _load()


def get_benchmark(name: str) -> Benchmark:
    """The registry entry ``name``; an unknown name raises ValueError naming the known ones."""
    try:
        return BENCHMARKS[name]
    except (KeyError, TypeError):
        pass
    close = difflib.get_close_matches(str(name), list(BENCHMARKS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown benchmark {name!r}{hint} (known: {', '.join(BENCHMARKS)})")
