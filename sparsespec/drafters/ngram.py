"""Prompt lookup decoding (n-gram drafter; Saxena 2023, "Prompt Lookup Decoding", as in vLLM's
``ngram`` speculator and transformers' ``prompt_lookup_num_tokens``).

No draft model: the last ``n`` tokens of the sequence (prompt + output), for ``n`` from
``ngram_max`` down to ``ngram_min``, are looked up in the earlier sequence; the tokens that
followed their most recent earlier occurrence are proposed. ``q`` is one-hot (the proposal is
deterministic), so verification accepts a draft with probability ``p(x)`` when sampling and by
exact match when greedy. With ``k="auto"`` the whole matched continuation is proposed, up to
``max_k``: the entropy controller has nothing to read here (every entropy is 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from sparsespec.config import SpecOptions, check_int
from sparsespec.drafters.base import Draft
from sparsespec.kv.cache import KVCache
from sparsespec.registry import DRAFTERS
from sparsespec.sampling import BatchSampling


def ngram_propose(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Continuation of the most recent earlier occurrence of the longest matching suffix n-gram.

    Args:
        tokens: the sequence so far (its last token is the one to continue).
        k: the most tokens to propose.
        n_min, n_max: n-gram sizes tried, longest first.

    Returns:
        Up to ``k`` tokens (empty when no suffix n-gram occurs earlier). A match may overlap the
        suffix itself (e.g. in a repeated pattern); its continuation is read from the sequence as
        far as it exists.
    """
    if k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    L = arr.size
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = arr[L - n :]
        windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)  # starts 0 .. L-1-n
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # most recent earlier occurrence (never the suffix itself)
            return arr[start : start + k].tolist()
    return []


@dataclass(frozen=True)
class NgramOptions(SpecOptions):
    """``ngram``'s options (``SpecOptions`` plus):

    Attributes:
        ngram_min / ngram_max: the n-gram sizes (tokens) looked up, longest first
            (``1 <= ngram_min <= ngram_max``).
    """

    ngram_min: int = 1
    ngram_max: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("ngram_min", self.ngram_min, 1)
        check_int("ngram_max", self.ngram_max, 1)
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")


@DRAFTERS.register("ngram")
class NgramDrafter:
    options = NgramOptions
    want_rows = 0
    want_rows_prefill = 0
    want_hidden = ()
    draft_cost_prior = 0.0  # the cost controller's prior for C_d / C_v(B, 1, N): a host-side lookup, no forward

    def __init__(self, model, spec: NgramOptions, capacity: int, batch_size: int, max_k: int):
        self.spec = spec
        self.vocab_size = model.cfg.vocab_size
        self.batch_size = batch_size

    def prefill_row(self, b: int, cache: KVCache, rows, prompt: Sequence[int] = ()) -> None:
        pass  # stateless: the lookup reads the token history at every step

    def commit(self, cache: KVCache, rows, counts: Sequence[int]) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass  # stateless

    def index_sizes(self) -> list[int]:
        return [0] * self.batch_size

    @property
    def nbytes(self) -> int:
        return 0

    def propose(self, cache: KVCache, pending: torch.Tensor, limits: Sequence[int], policies: Sequence,
                sampling: BatchSampling, history: Sequence[Sequence[int]] = ()) -> Draft:
        B, dev = pending.shape[0], pending.device
        props = [ngram_propose(h, int(limit), self.spec.ngram_min, self.spec.ngram_max)
                 for h, limit in zip(history, limits)]
        K = max((len(p) for p in props), default=0)
        ids = torch.zeros(B, K, dtype=torch.long)
        for b, p in enumerate(props):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(dev)  # [B, K]
        q = None
        if not sampling.all_greedy:  # one-hot q: the proposal is deterministic
            q = torch.nn.functional.one_hot(ids, self.vocab_size).float()  # [B, K, V]
        return Draft(ids, q, torch.zeros(B, K, device=dev), [len(p) for p in props])
