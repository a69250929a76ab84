"""LongBench v2 on one model through the cluster CLI: python evals/longbench_v2.py --help.

Also ``ray job submit --working-dir . -- python evals/longbench_v2.py ...``. The benchmark itself is
:mod:`evals.benchmarks.longbench_v2` (registry name ``longbench_v2``); this script and its siblings are the only
files under ``evals/`` that import ``cluster``.
"""
from __future__ import annotations


def main(argv=None) -> int:
    from cluster.sweep.cli import benchmark_main

    return benchmark_main("longbench_v2", argv)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    # Run as a script: the project root first on sys.path, this folder off it (evals/*.py must not
    # shadow top-level modules).
    _root, _here = Path(__file__).resolve().parents[1], Path(__file__).resolve().parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() not in (_root, _here)]
    raise SystemExit(main())
