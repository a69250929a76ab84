"""Registered drafters (importing this package fills ``sparsespec.registry.DRAFTERS``)."""
from sparsespec.drafters import sparse_self  # noqa: F401
