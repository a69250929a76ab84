"""SparseSpec-L drafter: the target model drafts for itself over a recallable sparse KV index.

Per layer and KV head the draft attends to ``n_sink`` first positions, ``n_recent`` last positions
and the top positions by importance recycled from full attention (see ``sparsespec.kv.index``),
about ``budget_frac`` (10 %) of the context. The index positions are gathered once per draft
step into a compact buffer; the draft tokens of the step append their own KV after it, so the
dense cache is never touched by the draft.
"""
from __future__ import annotations

import torch

from sparsespec.config import SpecConfig
from sparsespec.kv.cache import KVCache
from sparsespec.kv.index import ImportanceWindow, build_index
from sparsespec.model import DraftKV, Transformer
from sparsespec.registry import DRAFTERS


@DRAFTERS.register("sparsespec-l")
class SparseSelfDrafter:
    def __init__(self, model: Transformer, spec: SpecConfig, capacity: int, batch_size: int = 1):
        cfg = model.cfg
        self.model, self.spec = model, spec
        self.want_rows = spec.window
        self.window = ImportanceWindow(cfg.num_layers, batch_size, cfg.num_kv_heads, spec.window, capacity, model.device)
        n_max = spec.budget(capacity) + spec.k + 1
        shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, n_max, cfg.head_dim)
        self.dkv = DraftKV(
            torch.zeros(shape, dtype=model.dtype, device=model.device),  # [L, B, H_kv, N + K + 1, D]
            torch.zeros(shape, dtype=model.dtype, device=model.device),
            0,
        )
        self.index: torch.Tensor | None = None  # [L, B, H_kv, N] int64

    def _rebuild(self, cache: KVCache) -> None:
        S = cache.length
        scores = self.window.scores(S)  # [L, B, H_kv, S]
        self.index = build_index(scores, S, self.spec.budget(S), self.spec.n_sink, self.spec.n_recent)

    def prefill(self, cache: KVCache, rows: torch.Tensor | None) -> None:
        if rows is not None:
            self.window.push(rows)
        self._rebuild(cache)

    def commit(self, cache: KVCache, rows: torch.Tensor | None) -> None:
        if rows is not None:
            self.window.push(rows)
        self._rebuild(cache)

    def propose(self, cache: KVCache, pending: torch.Tensor, k: int) -> torch.Tensor:
        idx = self.index  # [L, B, H_kv, N]
        n = idx.shape[-1]
        D = cache.k.shape[-1]
        gather_idx = idx.unsqueeze(-1).expand(*idx.shape, D)  # [L, B, H_kv, N, D]
        self.dkv.k[:, :, :, :n] = torch.gather(cache.k, 3, gather_idx)
        self.dkv.v[:, :, :, :n] = torch.gather(cache.v, 3, gather_idx)
        self.dkv.length = n
        tok = pending  # [B, 1]
        drafts = []
        for j in range(k):
            logits = self.model.forward_draft(tok, cache.length + j, self.dkv)  # [B, V]
            tok = logits.argmax(dim=-1, keepdim=True)  # [B, 1], stays on device
            drafts.append(tok)
        return torch.cat(drafts, dim=1)  # [B, k]

    def index_size(self) -> int:
        return 0 if self.index is None else int(self.index.shape[-1])

    @property
    def nbytes(self) -> int:
        idx = 0 if self.index is None else self.index.numel() * self.index.element_size()
        return self.window.nbytes + idx + 2 * self.dkv.k.numel() * self.dkv.k.element_size()
