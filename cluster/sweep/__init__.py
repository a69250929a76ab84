"""Sweeps on Ray (``python -m cluster.sweep SPEC.yaml``): ``schema`` (YAML -> validated spec),
``plan`` (spec -> cells -> shards), ``run`` (``run_sweep``, the CLI, and the one place a sweep
writes to the store), ``coordinator`` (drives the Ray actors, retries, scores; hands shard events
back), ``worker`` (one engine per actor), ``cli`` (the benchmark scripts' CLI), ``provenance``
and ``testing`` (fault-injecting engines, importable by Ray workers).

Imports ``cluster.results`` (never ``cluster.serve`` or ``cluster.speed``).
"""
