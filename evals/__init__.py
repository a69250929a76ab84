"""Benchmarks as data: loaders, official prompts, truncation or generation, and official metrics.

* :mod:`evals.registry` -- the one registry (``get_benchmark("ruler")``, ``BENCHMARKS``) of
  :class:`evals.registry.Benchmark` entries: tasks, CLI options, ``check``, ``build_samples``
  (for a tokenizer, a model window and a context length), ``score_sample``, ``score_predictions``.
* :mod:`evals.benchmarks` -- the implementations (``ruler``, ``longbench``, ``longbench_v2``,
  ``infinitebench``); :mod:`evals.common` -- tokenizer glue and the shared prompt fitting;
  :mod:`evals.metrics`, :mod:`evals.records`, :mod:`evals.sample_io`, :mod:`evals.hub`.
* ``python -m evals.score`` -- re-score an official prediction file through the registry.
* ``evals/<benchmark>.py`` -- the runnable scripts (``python evals/ruler.py``, also through
  ``ray job submit``): a few lines over the registry and ``cluster.sweep.cli``, and the only modules
  here that import ``cluster``.

Everything else in this package never imports ``cluster``, ``sparsespec``, ``ray``,
``sqlalchemy`` or ``streamlit``: it turns benchmark records into token-id prompts (given a Hugging
Face tokenizer) and scores strings.
"""
from evals.base import Sample

__all__ = ["Sample"]
