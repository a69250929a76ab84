"""SparseSpec-L drafter: the target model drafts for itself over a recallable sparse KV index.

Per layer and KV head the draft attends to ``n_sink`` first positions, ``n_recent`` last positions
and the top positions by importance recycled from full attention (see ``sparsespec.kv.index``),
about ``budget_frac`` (10 %) of the context. The index positions are gathered once per draft
step into a compact buffer; the draft tokens of the step append their own KV after it, so the
dense cache is never touched by the draft.
"""
from __future__ import annotations

from typing import Sequence

import torch

from sparsespec.config import SamplingParams, SpecConfig
from sparsespec.drafters.base import Draft, self_draft_loop
from sparsespec.kv.cache import KVCache
from sparsespec.kv.index import ImportanceWindow, build_index
from sparsespec.model import DraftKV, Transformer
from sparsespec.registry import DRAFTERS


@DRAFTERS.register("sparsespec-l")
class SparseSelfDrafter:
    def __init__(self, model: Transformer, spec: SpecConfig, capacity: int, batch_size: int, max_k: int):
        cfg = model.cfg
        self.model, self.spec = model, spec
        self.want_rows = spec.window
        self.window = ImportanceWindow(cfg.num_layers, batch_size, cfg.num_kv_heads, spec.window, capacity, model.device)
        self.n_max = spec.budget(capacity)
        shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, self.n_max + max_k + 1, cfg.head_dim)
        self.dkv = DraftKV(
            torch.zeros(shape, dtype=model.dtype, device=model.device),  # [L, B, H_kv, N_max + K + 1, D]
            torch.zeros(shape, dtype=model.dtype, device=model.device),
            0,
        )
        self.index: list[torch.Tensor | None] = [None] * batch_size  # per row [L, 1, H_kv, N_b] int64

    def _rebuild(self, cache: KVCache, b: int) -> None:
        S = cache.lengths[b]
        scores = self.window.scores(S, b)  # [L, 1, H_kv, S]
        self.index[b] = build_index(scores, S, self.spec.budget(S), self.spec.n_sink, self.spec.n_recent)

    def prefill_row(self, b: int, cache: KVCache, rows: torch.Tensor | None, prompt: Sequence[int] = ()) -> None:
        if rows is not None:
            counts = [0] * cache.batch_size
            counts[b] = rows.shape[3]
            padded = rows.new_zeros(rows.shape[0], cache.batch_size, *rows.shape[2:])
            padded[:, b] = rows[:, 0]
            self.window.push(padded, counts)
        self._rebuild(cache, b)

    def commit(self, cache: KVCache, rows: torch.Tensor | None, counts: Sequence[int]) -> None:
        if rows is not None:
            self.window.push(rows, list(counts))
        for b in range(cache.batch_size):
            self._rebuild(cache, b)

    def select(self, keep: Sequence[int]) -> None:
        keep = list(keep)
        self.window.select(keep)
        idx = torch.tensor(keep, dtype=torch.long, device=self.dkv.k.device)
        self.dkv.k = self.dkv.k.index_select(1, idx)
        self.dkv.v = self.dkv.v.index_select(1, idx)
        self.index = [self.index[b] for b in keep]

    def propose(self, cache: KVCache, pending: torch.Tensor, k_max: int, budgets: Sequence[int], policy,
                sp: SamplingParams, generator, history: Sequence[Sequence[int]] = ()) -> Draft:
        B = pending.shape[0]
        sizes = self.index_sizes()
        n = max(sizes)
        D = cache.k.shape[-1]
        for b, idx in enumerate(self.index):  # gather each row's index into the compact buffer
            gather_idx = idx.unsqueeze(-1).expand(*idx.shape, D)  # [L, 1, H_kv, N_b, D]
            self.dkv.k[:, b : b + 1, :, : sizes[b]] = torch.gather(cache.k[:, b : b + 1], 3, gather_idx)
            self.dkv.v[:, b : b + 1, :, : sizes[b]] = torch.gather(cache.v[:, b : b + 1], 3, gather_idx)
        self.dkv.length = self.dkv.n_index = n
        uniform = min(sizes) == n
        self.dkv.n_valid = None if uniform else torch.tensor(sizes, device=pending.device)
        starts = torch.tensor(cache.lengths, device=pending.device)  # [B] position of each pending token
        return self_draft_loop(self.model, self.dkv, pending, starts, k_max, budgets, policy, sp, generator)

    def index_sizes(self) -> list[int]:
        return [0 if idx is None else int(idx.shape[-1]) for idx in self.index]

    @property
    def nbytes(self) -> int:
        idx = sum(i.numel() * i.element_size() for i in self.index if i is not None)
        return self.window.nbytes + idx + 2 * self.dkv.k.numel() * self.dkv.k.element_size()
