"""The paired speed benchmark against the roofline (``measure``: ``python -m cluster.speed``) and
the peer engines timed beside ours (``peers``: transformers, and vLLM's CPU build in its own
environment). The top of ``cluster``: it may import ``cluster.sweep`` and ``cluster.results``.

The repository's other speed tools are scripts in ``benchmarks/``; this one is a package module
because ``benchmarks/paired_e2e.py`` and the tests import it and its rows go to the store.
"""
