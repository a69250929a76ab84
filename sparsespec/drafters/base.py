"""The Drafter protocol every speculative method implements.

Engine contract (batch size 1 in this version): the dense ``KVCache`` holds every committed token
but the last one (the *pending* token, whose KV the next forward computes). ``propose`` returns K
draft tokens that would follow the pending token; after verification the engine rolls the dense
cache back to the committed length and calls ``commit`` with the attention rows of the committed
query positions of that verification.
"""
from __future__ import annotations

from typing import Protocol

import torch

from sparsespec.config import SpecConfig
from sparsespec.kv.cache import KVCache


class Drafter(Protocol):
    #: query rows the engine must request from each dense forward (0: none)
    want_rows: int

    def __init__(self, model, spec: SpecConfig, capacity: int) -> None: ...

    def prefill(self, cache: KVCache, rows: torch.Tensor | None) -> None:
        """Initialise from the prefilled cache and the prompt's last query rows ``[L, B, H_kv, W, S]``."""

    def propose(self, cache: KVCache, pending: torch.Tensor, k: int) -> torch.Tensor:
        """Draft ``k`` tokens after ``pending`` (``[B, 1]`` int64); returns ``[B, k]`` int64."""

    def commit(self, cache: KVCache, rows: torch.Tensor | None) -> None:
        """Update after verification; ``rows``: ``[L, B, H_kv, T_committed, S]`` float32."""

    def index_size(self) -> int:
        """Positions of the dense cache the last draft attended to (per layer and KV head)."""

    @property
    def nbytes(self) -> int:
        """Bytes of drafter state (index, compact KV, importance window)."""
