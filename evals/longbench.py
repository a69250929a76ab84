"""LongBench v1 / LongBench-E on one model through the cluster CLI: python evals/longbench.py --help.

Also ``ray job submit --working-dir . -- python evals/longbench.py ...``. The benchmark itself is
:mod:`evals.benchmarks.longbench` (registry name ``longbench``); this script and its siblings are the only
files under ``evals/`` that import ``cluster``.
"""
from __future__ import annotations


def main(argv=None) -> int:
    from cluster.sweep.cli import benchmark_main

    return benchmark_main("longbench", argv)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    # Run as a script: the project root first on sys.path, this folder off it (evals/*.py must not
    # shadow top-level modules).
    _root, _here = Path(__file__).resolve().parents[1], Path(__file__).resolve().parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() not in (_root, _here)]
    raise SystemExit(main())
