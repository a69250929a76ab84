"""Re-score an existing prediction file in a benchmark's official prediction format.

    python -m evals.score --benchmark {longbench,longbench_v2,infinitebench,ruler} --task T FILE

prints one JSON object, ``{"task": T, "score": S, "n": N, ...}``, with ``S`` on the scale the
official evaluation script prints (LongBench: ``round(100 * mean, 2)``; LongBench v2:
``round(100 * accuracy, 1)``), plus any extra keys the benchmark reports (LongBench-E:
``buckets``; LongBench v2: the difficulty/length breakdown).

``FILE`` holds one JSON object per line (a single JSON array is accepted too). Dispatch is by
convention: ``evals.<benchmark>`` exposes
``score_prediction_records(task: str, records: list[dict]) -> dict`` returning at least
``{"task", "score", "n"}``. Errors (unreadable file, bad JSON, a record the scorer rejects) are one
line on stderr naming ``FILE:LINE`` where known, exit status 2.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from evals.records import RecordError, read_json_records

__all__ = ["BENCHMARKS", "score_file", "main"]

#: Benchmark name -> module that implements ``score_prediction_records``.
BENCHMARKS = {
    "longbench": "evals.longbench",
    "longbench_v2": "evals.longbench_v2",
    "infinitebench": "evals.infinitebench",
    "ruler": "evals.ruler",
}


class ScoreError(Exception):
    """A user-facing error of ``evals.score`` (one line, no traceback)."""


def _scorer(benchmark: str):
    if benchmark not in BENCHMARKS:
        raise ScoreError(f"unknown benchmark {benchmark!r} (known: {', '.join(BENCHMARKS)})")
    try:
        module = importlib.import_module(BENCHMARKS[benchmark])
    except ImportError as e:
        raise ScoreError(f"benchmark {benchmark!r}: cannot import {BENCHMARKS[benchmark]} ({e})") from None
    fn = getattr(module, "score_prediction_records", None)
    if fn is None:
        raise ScoreError(f"benchmark {benchmark!r}: {BENCHMARKS[benchmark]} has no score_prediction_records(task, records)")
    return fn


def score_file(benchmark: str, task: str, path: str) -> dict[str, Any]:
    """Score ``path`` with ``evals.<benchmark>.score_prediction_records``; raises :class:`ScoreError`."""
    fn = _scorer(benchmark)
    try:
        numbered = read_json_records(path)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise ScoreError(str(e)) from None
    if not numbered:
        raise ScoreError(f"{path}: no prediction records")
    lines = [ln for ln, _ in numbered]
    records = [rec for _, rec in numbered]
    for ln, rec in numbered:
        if not isinstance(rec, dict):
            raise ScoreError(f"{path}:{ln}: expected a JSON object, got {type(rec).__name__}")
    try:
        result = fn(task, records)
    except RecordError as e:
        where = f"{path}:{lines[e.index]}" if 0 <= e.index < len(lines) else f"{path}"
        raise ScoreError(f"{where}: {e.detail}") from None
    except KeyError as e:
        raise ScoreError(f"{path}: a record misses field {e.args[0]!r} (benchmark {benchmark}, task {task})") from None
    except (ValueError, TypeError) as e:
        raise ScoreError(f"{path}: {e}") from None
    if not isinstance(result, dict) or not {"task", "score", "n"} <= set(result):
        raise ScoreError(f"{BENCHMARKS[benchmark]}.score_prediction_records returned {result!r}, not a dict with task/score/n")
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m evals.score",
        description="Re-score a prediction file in the official prediction format of a benchmark "
        "(one JSON object per line) and print {\"task\", \"score\", \"n\", ...} as JSON.",
    )
    p.add_argument("--benchmark", required=True, choices=sorted(BENCHMARKS))
    p.add_argument("--task", required=True, help="task name as the official code spells it, e.g. hotpotqa, "
                   "hotpotqa_e (LongBench-E), longbench_v2")
    p.add_argument("file", metavar="FILE", help="prediction file (JSONL)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = score_file(args.benchmark, args.task, args.file)
    except ScoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
