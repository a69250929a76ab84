"""Registered drafters (importing this package fills ``sparsespec.registry.DRAFTERS``)."""
from sparsespec.drafters import sparse_self  # noqa: F401  (sparsespec-l, magicdec-streaming, magicdec-snapkv)
from sparsespec.drafters import ngram  # noqa: F401,I001
from sparsespec.drafters import draft_model  # noqa: F401,I001  (draft-model)
