"""Preallocated dense KV cache with per-row lengths and rollback by length."""
from __future__ import annotations

from typing import Sequence

import torch

from sparsespec.config import ModelConfig


class KVCache:
    """Dense KV buffers for all layers, written in place.

    ``k``, ``v``: ``[L, B, H_kv, S_max, D]`` (keys stored after RoPE at their true positions).
    ``lengths``: valid positions per row (host ints; rows are ragged). Rollback is a length change,
    never a copy: positions past a row's length are garbage, masked in attention and overwritten
    by the next forward.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, capacity: int, dtype: torch.dtype, device):
        shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, S_max, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, S_max, D]
        self.lengths: list[int] = [0] * batch_size

    @classmethod
    def _wrap(cls, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> KVCache:
        obj = cls.__new__(cls)
        obj.k, obj.v, obj.lengths = k, v, lengths
        return obj

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def length(self) -> int:
        """The length of a single-row cache."""
        if len(self.lengths) != 1:
            raise ValueError("length is defined for batch size 1; use lengths")
        return self.lengths[0]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def row(self, b: int) -> KVCache:
        """A one-row view sharing storage (writes land in this cache); copy its length back."""
        return KVCache._wrap(self.k[:, b : b + 1], self.v[:, b : b + 1], [self.lengths[b]])

    def head(self, n: int) -> KVCache:
        """A view of the first ``n`` rows (slots), sharing storage; ``lengths`` is a copy, so
        write it back with ``self.lengths[:n] = view.lengths`` after the view's forwards.

        The engine core keeps its running rows in slots ``0 .. B-1`` of a preallocated pool and
        runs each step on ``head(B)``: a prefix along dim 1 keeps every layer's
        ``[B, H_kv, S_max, D]`` block contiguous.
        """
        if not 0 <= n <= self.batch_size:
            raise ValueError(f"head({n}) of a cache with {self.batch_size} rows")
        return KVCache._wrap(self.k[:, :n], self.v[:, :n], list(self.lengths[:n]))

    def move(self, src: int, dst: int) -> None:
        """Copy row ``src``'s valid positions and length into row ``dst`` (compacting the pool
        when a row leaves: the last running row moves into the freed slot)."""
        if src == dst:
            return
        n = self.lengths[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n

    def rollback(self, lengths: Sequence[int] | int) -> None:
        """Forget every position at or after each row's new length (cheap: no data moves)."""
        lengths = [lengths] if isinstance(lengths, int) else list(lengths)
        if len(lengths) != len(self.lengths):
            raise ValueError(f"rollback needs {len(self.lengths)} lengths, got {len(lengths)}")
        for b, (new, old) in enumerate(zip(lengths, self.lengths)):
            if not 0 <= new <= old:
                raise ValueError(f"row {b}: rollback to {new} outside [0, {old}]")
        self.lengths = lengths

    def reserve(self, num_new: int) -> None:
        if max(self.lengths) + num_new > self.capacity:
            raise ValueError(f"KV cache overflow: {max(self.lengths)} + {num_new} > capacity {self.capacity}")

    def select(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (finished rows leave the batch; one copy of the kept rows)."""
        idx = torch.tensor(list(keep), dtype=torch.long, device=self.k.device)
        self.k = self.k.index_select(1, idx)
        self.v = self.v.index_select(1, idx)
        self.lengths = [self.lengths[b] for b in keep]
