"""Benchmarks as data: loaders, official prompts, truncation and official metrics.

This package never imports ``sparsespec``, ``ray``, ``sqlalchemy`` or ``streamlit``: it turns
benchmark records into token-id prompts (given a Hugging Face tokenizer) and scores strings.
The runnable scripts (``python evals/ruler.py``) hand their samples to ``cluster`` lazily,
inside ``main()``.
"""
from evals.base import Sample

__all__ = ["Sample"]
