"""Preallocated dense KV cache with rollback by length."""
from __future__ import annotations

import torch

from sparsespec.config import ModelConfig


class KVCache:
    """Dense KV buffers for all layers, written in place.

    ``k``, ``v``: ``[L, B, H_kv, S_max, D]`` (keys stored after RoPE at their true positions).
    ``length``: number of valid positions (batch size 1 in this version: one shared length).
    Rollback is a length change, never a copy: positions past ``length`` are garbage and are
    overwritten by the next forward.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, capacity: int, dtype: torch.dtype, device: torch.device):
        shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, S_max, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, S_max, D]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def rollback(self, length: int) -> None:
        """Forget every position at or after ``length`` (cheap: no data moves)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback to {length} outside [0, {self.length}]")
        self.length = length

    def reserve(self, num_new: int) -> None:
        if self.length + num_new > self.capacity:
            raise ValueError(f"KV cache overflow: {self.length} + {num_new} > capacity {self.capacity}")
