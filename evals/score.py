"""Re-score an existing prediction file in a benchmark's official prediction format.

    python -m evals.score --benchmark {longbench,longbench_v2,infinitebench,ruler} --task T [--model-name M] FILE

prints one JSON object, ``{"task": T, "score": S, "n": N, ...}``, with ``S`` on the scale the
official evaluation script prints (LongBench: ``round(100 * mean, 2)``; LongBench v2:
``round(100 * accuracy, 1)``; RULER: ``round(100 * mean, 2)``; InfiniteBench: the plain mean in
[0, 1]), plus any extra keys the benchmark reports (LongBench-E: ``buckets``; LongBench v2: the
difficulty/length breakdown).

``FILE`` holds one JSON object per line (a single JSON array is accepted too). Dispatch is through
the benchmark registry: ``evals.registry.get_benchmark(B).score_predictions(task, records,
model_name=M)`` returning at least ``{"task", "score", "n"}``.

``--model-name`` is InfiniteBench's official ``compute_scores.py --model_name``: ``gpt4`` applies
its math_calc rule (the first predicted number is dropped, as GPT-4 repeats the expression's first
number); no other name changes a score, and the other benchmarks ignore it. Unlike the official
script (default ``gpt4``) the default is no model name, i.e. no rule.

Errors (unreadable file, bad JSON, a record the scorer rejects) are one line on stderr naming
``FILE:LINE`` where known, exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from evals import registry
from evals.records import RecordError, read_json_records

__all__ = ["ScoreError", "score_file", "main"]


class ScoreError(Exception):
    """A user-facing error of ``evals.score`` (one line, no traceback)."""


def _scorer(benchmark: str):
    try:
        bench = registry.get_benchmark(benchmark)
    except ValueError as e:
        raise ScoreError(str(e)) from None
    fn = getattr(bench, "score_predictions", None)
    if fn is None:
        raise ScoreError(f"benchmark {benchmark!r} has no score_predictions(task, records, *, model_name)")
    return fn


def score_file(benchmark: str, task: str, path: str, *, model_name: str | None = None) -> dict[str, Any]:
    """Score ``path`` with ``get_benchmark(benchmark).score_predictions``; raises :class:`ScoreError`."""
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
        result = fn(task, records, model_name=model_name)
    except RecordError as e:
        where = f"{path}:{lines[e.index]}" if 0 <= e.index < len(lines) else f"{path}"
        raise ScoreError(f"{where}: {e.detail}") from None
    except KeyError as e:
        raise ScoreError(f"{path}: a record misses field {e.args[0]!r} (benchmark {benchmark}, task {task})") from None
    except (ValueError, TypeError) as e:
        raise ScoreError(f"{path}: {e}") from None
    if not isinstance(result, dict) or not {"task", "score", "n"} <= set(result):
        raise ScoreError(f"{benchmark}: score_predictions returned {result!r}, not a dict with task/score/n")
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m evals.score",
        description="Re-score a prediction file in the official prediction format of a benchmark "
        "(one JSON object per line) and print {\"task\", \"score\", \"n\", ...} as JSON.",
    )
    p.add_argument("--benchmark", required=True, choices=sorted(registry.BENCHMARKS))
    p.add_argument("--task", required=True, help="task name as the official code spells it, e.g. hotpotqa, "
                   "hotpotqa_e (LongBench-E), longbench_v2")
    p.add_argument("--model-name", default=None,
                   help="InfiniteBench: the official compute_scores.py --model_name; gpt4 applies its math_calc "
                   "rule (drop the first predicted number). Default: none (no rule; the official default is gpt4). "
                   "Ignored by the other benchmarks")
    p.add_argument("file", metavar="FILE", help="prediction file (JSONL)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = score_file(args.benchmark, args.task, args.file, model_name=args.model_name)
    except ScoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
