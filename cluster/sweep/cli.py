"""The benchmark scripts' CLI: ``python evals/<benchmark>.py [flags]`` is a one-benchmark sweep.

``benchmark_main("ruler", argv)`` parses the shared flags (those of ``python -m cluster.sweep``
plus ``--k`` and ``--method-options``) and the benchmark's own (``Benchmark.add_arguments``),
builds the equivalent sweep spec (``--print-spec`` shows it as YAML) and runs it through the
same planner, workers, store and report as ``python -m cluster.sweep``.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from cluster.sweep.schema import SpecError, parse_spec
from cluster.results.store import DEFAULT_DB_URL
from cluster.sweep.run import add_override_flags, execute, overrides_from, setup_logging

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_METHODS = ("sparsespec-l",)


def _json_object(text: str) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict) or not all(isinstance(v, dict) for v in obj.values()):
        raise argparse.ArgumentTypeError('expected a JSON object {"method": {"option": value}}')
    return obj


def _k(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"k must be >= 0, got {v}")
    return v


def build_parser(name: str) -> argparse.ArgumentParser:
    from evals.registry import get_benchmark

    bench = get_benchmark(name)
    p = argparse.ArgumentParser(prog=f"python evals/{name}.py",
                                description=f"{name} as a one-benchmark sweep (see python -m cluster.sweep)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_override_flags(p)
    p.add_argument("--k", type=_k, default=None,
                   help="draft length passed as {'k': K} to every method but ar (default: the method's own)")
    p.add_argument("--method-options", type=_json_object, default={},
                   help='per-method options as JSON, e.g. \'{"draft-model": {"draft_model": "qwen2.5-0.5b"}}\'')
    p.add_argument("--print-spec", action="store_true", help="print the equivalent sweep spec (YAML) and exit")
    p.add_argument("--dry-run", action="store_true", help="print the shard keys, one per line, and run nothing")
    group = p.add_argument_group(f"{name} options")
    bench.add_arguments(group)  # type: ignore[arg-type]
    return p


def spec_from_args(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The sweep spec (a plain mapping, before validation) that the flags describe."""
    from cluster.sweep.schema import apply_overrides
    from evals.registry import get_benchmark

    bench = get_benchmark(name)
    methods = list(args.methods or DEFAULT_METHODS)
    stray = sorted(set(args.method_options) - set(methods))
    if stray:
        raise SpecError(f"--method-options names method(s) {stray} that are not in --methods {methods}")
    method_map = {m: ({} if m == "ar" else {**({"k": args.k} if args.k is not None else {}),
                                            **args.method_options.get(m, {})}) for m in methods}
    options = {k: getattr(args, k) for k in bench.option_defaults() if hasattr(args, k)}
    data: dict[str, Any] = {
        "name": name, "models": args.models or [DEFAULT_MODEL], "methods": method_map,
        "benchmarks": [{"name": name, "options": options}], "db": DEFAULT_DB_URL,
    }
    over = overrides_from(args)
    over["methods"] = None  # resolved above, with --k and --method-options
    return apply_overrides(data, over)


def benchmark_main(name: str, argv: Sequence[str] | None = None) -> int:
    """Entry point of ``evals/<name>.py``; returns the exit status (see ``cluster.sweep.run``)."""
    try:
        parser = build_parser(name)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        data = spec_from_args(name, args)
        spec = parse_spec(data, f"evals/{name}.py flags")
        if args.print_spec:
            import yaml

            print(yaml.safe_dump(spec.resolved(), sort_keys=False), end="")
            return 0
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return execute(spec, args)
