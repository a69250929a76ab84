"""Command-line plumbing shared by the benchmark scripts (``evals/ruler.py``, ``evals/longbench.py``).

A benchmark script does::

    def main(argv=None) -> int:
        from cluster import jobs
        p = jobs.common_parser("RULER on one model")
        p.add_argument(...)                 # benchmark-specific flags
        return jobs.run("ruler", p.parse_args(argv), build_samples, score_sample)

``run`` validates the flags, resolves the tokenizer and context window of the model, builds the
samples, runs (or resumes) the benchmark through ``cluster.coordinator.run_benchmark`` and prints
the report of that run. ``sparsespec`` is imported lazily, inside ``run``.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cluster.store import DEFAULT_DB_URL, StoreError, safe_url

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
#: Flags that say where/how to run, not what: excluded from the run's identity (its hash).
INFRA_FLAGS = ("db", "ray_address", "num_workers", "threads", "log_level")


def _comma_list(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list, e.g. a,b")
    return items


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def _json_object(text: str) -> dict:
    import json

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict) or not all(isinstance(v, dict) for v in obj.values()):
        raise argparse.ArgumentTypeError('expected a JSON object {"method": {"option": value}}')
    return obj


def common_parser(description: str) -> argparse.ArgumentParser:
    """Parser with the flags every benchmark script shares (add benchmark-specific ones after)."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model preset name or local HF folder")
    p.add_argument("--methods", type=_comma_list, default=["sparsespec-l"],
                   help='comma list of decoding methods; "ar" is always added (the reference)')
    p.add_argument("--tasks", type=_comma_list, default=None,
                   help="comma list of tasks (default: the benchmark's default set)")
    p.add_argument("--num-samples", type=_positive_int, default=None, help="samples per task")
    p.add_argument("--max-new-tokens", type=_positive_int, default=None,
                   help="override the per-task generation budget")
    p.add_argument("--db", default=DEFAULT_DB_URL,
                   help="result store URL (sqlite:///relative/path.db is relative to the current directory)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--k", type=_positive_int, default=None,
                   help="draft length, passed as method_options {'k': K} to every non-ar method")
    p.add_argument("--method-options", type=_json_object, default={},
                   help='per-method options as JSON, e.g. \'{"draft-model": {"draft_model": "qwen2.5-0.5b"}}\'')
    p.add_argument("--temperature", type=_non_negative_float, default=0.0,
                   help="0 = greedy (token-identical losslessness check)")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--num-workers", type=_positive_int, default=None,
                   help="engine actors (default: one per GPU, else 1)")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch threads per actor")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


def run(benchmark: str, args: argparse.Namespace, build_samples: Callable[..., Sequence[Any]],
        score_sample: Callable[[Any, str], float], *, engine_factory: Callable[[str, str], Any] | None = None,
        ) -> int:
    """Run one benchmark from parsed flags; print the report of the run. Returns an exit code.

    ``engine_factory`` (tests, dry runs) replaces ``sparsespec.Engine.from_pretrained`` in workers.
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(level=getattr(args, "log_level", "INFO"),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import sparsespec

    from cluster.coordinator import (
        AR,
        ShardFailedError,
        WorkerStartError,
        normalize_methods,
        run_benchmark,
    )
    from cluster.report import format_table, report_rows

    methods = normalize_methods(args.methods or [])
    known = list(getattr(sparsespec, "METHODS", ()))
    unknown = [m for m in methods if m not in known]
    if unknown:
        _err(f"unknown method(s) {unknown}; available: {sorted(known)}")
        return 2

    tokenizer = sparsespec.load_tokenizer(args.model)
    max_context = int(sparsespec.model_max_context(args.model))
    samples = list(build_samples(tokenizer, args, max_context))
    if args.max_new_tokens is not None:
        samples = [dataclasses.replace(s, max_new_tokens=args.max_new_tokens) for s in samples]
    if not samples:
        _err(f"{benchmark}: no samples were built (tasks={args.tasks}, num_samples={args.num_samples})")
        return 1

    # Resolve every method's options to the engine's full config (defaults included), so the run id
    # changes when a default changes and a resumed run never mixes two configurations.
    extra = getattr(args, "method_options", None) or {}
    stray = sorted(set(extra) - set(methods))
    if stray:
        _err(f"--method-options names method(s) {stray} that are not in --methods {methods}")
        return 2
    try:
        method_options = {m: sparsespec.resolve_method_options(m, {**({"k": args.k} if args.k else {}), **extra.get(m, {})})
                          for m in methods if m != AR}
    except ValueError as e:
        _err(str(e))
        return 2
    config = {k: v for k, v in sorted(vars(args).items()) if k not in INFRA_FLAGS}
    config["methods"] = methods
    log.info("%s: %d sample(s) over %d task(s), methods %s, model %s, db %s", benchmark, len(samples),
             len({s.task for s in samples}), methods, args.model, safe_url(args.db))
    try:
        run_id = run_benchmark(
            benchmark=benchmark, samples=samples, scorer=score_sample, model=args.model, methods=methods,
            db_url=args.db, config=config, dtype=args.dtype, method_options=method_options,
            temperature=args.temperature, ray_address=args.ray_address, num_workers=args.num_workers,
            threads=args.threads, engine_factory=engine_factory,
        )
    except (ShardFailedError, WorkerStartError, StoreError, ValueError) as e:
        _err(str(e))
        return 1
    rows = report_rows(args.db, [run_id])
    print(f"run {run_id}  ({safe_url(args.db)}; score x100, speedup = median paired TPOT ratio vs ar)")
    print(format_table(rows))
    return 0
