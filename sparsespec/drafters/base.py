"""The Drafter protocol every speculative method implements, and the shared self-draft loop.

Engine contract: the dense ``KVCache`` holds every committed token of a row but the last one (the
*pending* token, whose KV the next forward computes). ``propose`` returns up to K draft tokens per
row that would follow the pending token; after verification the engine rolls the dense cache back
to each row's committed length and calls ``commit`` with the attention rows of the committed
query positions. Rows that finish leave the batch through ``select``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from sparsespec.config import SamplingParams, SpecConfig
from sparsespec.kv.cache import KVCache
from sparsespec.sampling import logits_to_probs, sample


@dataclass
class Draft:
    """Drafted tokens of one step.

    Attributes:
        token_ids: ``[B, K]`` int64 (K = the longest row's draft; shorter rows are padded).
        q_probs: ``[B, K, V]`` float32, the distribution each draft token was sampled from
            (after temperature/top-k/top-p); None for greedy (one-hot q: exact-match verification).
        entropies: ``[B, K]`` float32, entropy (nats) of the drafter's own distribution at
            temperature 1 for each draft token (what the entropy controller reads).
        num_draft: valid drafts per row (``<= K``).
    """

    token_ids: torch.Tensor
    q_probs: torch.Tensor | None
    entropies: torch.Tensor
    num_draft: list[int]


class Drafter(Protocol):
    #: query rows the engine must request from each dense forward (0: none)
    want_rows: int

    def prefill_row(self, b: int, cache: KVCache, rows: torch.Tensor | None, prompt: Sequence[int]) -> None:
        """Initialise row ``b`` from its prefilled cache, its prompt's last query rows
        ``[L, 1, H_kv, W, P]`` and its prompt token ids."""

    def propose(self, cache: KVCache, pending: torch.Tensor, k_max: int, budgets: Sequence[int], policy,
                sp: SamplingParams, generator: torch.Generator | None,
                history: Sequence[Sequence[int]]) -> Draft:
        """Draft up to ``min(k_max, budgets[b])`` tokens after ``pending`` (``[B, 1]`` int64).

        ``history[b]``: row b's prompt and committed output (its last token is the pending one).
        """

    def commit(self, cache: KVCache, rows: torch.Tensor | None, counts: Sequence[int]) -> None:
        """Update after verification; ``rows`` ``[L, B, H_kv, T, S]``, of which the first ``counts[b]`` are committed."""

    def select(self, keep: Sequence[int]) -> None:
        """Keep only batch rows ``keep``."""

    def index_sizes(self) -> list[int]:
        """Per row: positions of the dense cache the next draft attends to (per layer and KV head)."""

    @property
    def nbytes(self) -> int:
        """Bytes of drafter state (index, compact KV, importance window)."""


def draft_loop(step, pending: torch.Tensor, k_max: int, budgets: Sequence[int], policy, sp: SamplingParams,
               generator) -> Draft:
    """Autoregressive drafting shared by every model-based drafter.

    ``step(tok, j)`` runs the drafter's model on ``tok`` ``[B, 1]`` (the ``j``-th input of the
    step: the pending token, then each draft) and returns logits ``[B, V]``. Row ``b`` drafts at
    most ``min(k_max, budgets[b])`` tokens; an adaptive ``policy`` may stop a row earlier after
    reading the entropies (the one host sync of the loop). q is ``logits_to_probs`` of the
    drafter's logits with the request's temperature/top-k/top-p, exactly what is sampled from.
    """
    B = pending.shape[0]
    limit = [min(k_max, int(x)) for x in budgets]
    drafting = [lim > 0 for lim in limit]
    num_draft = [0] * B
    adaptive = getattr(policy, "adaptive", False)
    toks, qs, ents = [], [], []
    tok = pending  # [B, 1]
    for j in range(max(limit, default=0)):
        logits = step(tok, j)  # [B, V]
        logp = torch.log_softmax(logits, dim=-1)
        ents.append(-(logp.exp() * logp).sum(-1))  # [B]
        if sp.temperature == 0:
            tok = logits.argmax(dim=-1, keepdim=True)  # [B, 1]
        else:
            q = logits_to_probs(logits, sp.temperature, sp.top_k, sp.top_p)  # [B, V]
            qs.append(q)
            tok = sample(q, generator).view(B, 1)
        toks.append(tok)
        for b in range(B):
            if drafting[b]:
                num_draft[b] = j + 1
                drafting[b] = num_draft[b] < limit[b]
        if adaptive and any(drafting):
            ent_host = torch.stack(ents, dim=1).tolist()  # SYNC: the entropy controller decides per token
            for b in range(B):
                if drafting[b] and not policy.should_continue(ent_host[b][: j + 1]):
                    drafting[b] = False
        if not any(drafting):
            break
    if not toks:
        return Draft(pending[:, :0], None, torch.zeros(B, 0, device=pending.device), num_draft)
    return Draft(torch.cat(toks, dim=1), torch.stack(qs, dim=1) if qs else None, torch.stack(ents, dim=1), num_draft)


def self_draft_loop(model, dkv, pending: torch.Tensor, start_positions: torch.Tensor, k_max: int,
                    budgets: Sequence[int], policy, sp: SamplingParams, generator) -> Draft:
    """``draft_loop`` with the target model over a compact KV (``model.forward_draft``);
    ``start_positions`` ``[B]``: absolute position of each row's pending token."""
    return draft_loop(lambda tok, j: model.forward_draft(tok, start_positions + j, dkv), pending, k_max, budgets,
                      policy, sp, generator)
