"""The benchmark implementations, pure data: ``ruler``, ``longbench``, ``longbench_v2``,
``infinitebench`` (and ``speed``, fixed-length speed samples without a quality score).

Each module holds one benchmark's official prompts, loaders, truncation or generation, and
metrics, plus its registry entry ``benchmark`` (see :mod:`evals.registry`). None of them imports
``cluster``, ``sparsespec``, ``ray``, ``sqlalchemy`` or ``streamlit``; the runnable scripts are
``evals/<benchmark>.py``.
"""
