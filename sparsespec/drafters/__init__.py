"""Registered drafters (importing this package fills ``sparsespec.registry.DRAFTERS``)."""
from sparsespec.drafters import base  # noqa: F401  (ar, the null drafter: registered first)
from sparsespec.drafters import sparse_self  # noqa: F401  (sparsespec-l, magicdec-streaming, magicdec-snapkv)
from sparsespec.drafters import ngram  # noqa: F401,I001
from sparsespec.drafters import draft_model  # noqa: F401,I001  (draft-model)
from sparsespec.drafters import eagle3  # noqa: F401,I001  (eagle3)
