"""The Drafter protocol every method implements (``ar`` is the null drafter), and the shared
autoregressive draft loop.

Engine contract. The engine core preallocates its pools for ``max_num_seqs`` *slots*; the
running rows always occupy slots ``0 .. B-1`` (a row that leaves is replaced by the last one,
``move``), and every call below gets the dense ``KVCache`` view of those B rows. The dense cache
holds every committed token of a row but the last one (the *pending* token, whose KV the next
forward computes). ``propose`` returns up to ``limits[b]`` draft tokens per row that would follow
the pending token; after verification the engine rolls the dense cache back to each row's
committed length and calls ``commit`` with the attention rows of the verified query positions,
of which the first ``counts[b]`` are committed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from sparsespec.config import MethodOptions, SamplingParams
from sparsespec.kv.cache import KVCache
from sparsespec.registry import DRAFTERS
from sparsespec.sampling import BatchSampling


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
    """What the engine core reads and calls; every registered method implements all of it.

    Constructor: ``Drafter(model, spec, capacity, max_num_seqs, max_k)``: the target
    ``Transformer``, the method's validated options (an instance of its ``options`` class),
    positions per slot of the dense pool, the number of slots, and the longest draft of any step
    (buffers are sized from these once).

    A new method is one file: its options dataclass (a frozen ``sparsespec.config.SpecOptions``
    subclass: ``k``, ``max_k``, ``controller`` plus its own fields, validated in
    ``__post_init__``), its drafter class with ``options = <that class>`` registered with
    ``@DRAFTERS.register("<name>")``, and one import line in ``sparsespec/drafters/__init__.py``.
    """

    #: the method's options dataclass (``sparsespec.config.MethodOptions`` subclass): what
    #: ``method_options`` may hold, validated, and (``resolved()``) what a run id hashes
    options: type[MethodOptions]

    #: importance rows (last queries of each verify forward) the engine must request; 0 = none
    want_rows: int
    #: importance rows of the prompt's last queries handed to ``prefill_row``; 0 = none
    want_rows_prefill: int
    #: target layers whose output hidden states (``Transformer.forward_dense_features``) the
    #: drafter reads: when non-empty, ``prefill_row`` and ``commit`` also get ``hidden=``, the
    #: features ``[B, T, n E]`` of the prompt / the verified positions (EAGLE-3); () = none
    want_hidden: tuple[int, ...]

    def prefill_row(self, b: int, cache: KVCache, rows: torch.Tensor | None, prompt: Sequence[int]) -> None:
        """Initialise slot ``b`` (a new request) from its prefilled cache, its prompt's last
        query rows ``[L, 1, H_kv, W, P]`` (None when ``want_rows_prefill`` is 0) and its prompt."""

    def propose(self, cache: KVCache, pending: torch.Tensor, limits: Sequence[int], policies: Sequence,
                sampling: BatchSampling, history: Sequence[Sequence[int]]) -> Draft:
        """Draft up to ``limits[b]`` tokens after ``pending`` (``[B, 1]`` int64) for each row.

        ``policies[b]``: row b's draft-length policy (an adaptive one may stop the row earlier);
        ``sampling``: the rows' sampling parameters and generators (q is their processed
        distribution); ``history[b]``: row b's prompt and committed output (last = pending).
        """

    def commit(self, cache: KVCache, rows: torch.Tensor | None, counts: Sequence[int]) -> None:
        """After verification; ``rows`` ``[L, B, H_kv, T, S]``, of which the first ``counts[b]``
        are committed query positions of row b (None: none asked, or the verify wrote them where
        ``importance_target`` said).

        A drafter with ``want_rows`` may also offer ``importance_target(batch, num_rows, width)
        -> sparsespec.kv.index.RowsTarget``: the engine then has the verify forward write its rows
        there (e.g. an importance window's spare ring slots) and passes ``rows=None`` here."""

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s state into slot ``dst`` (pool compaction when a row leaves)."""

    def index_sizes(self) -> list[int]:
        """Per slot: positions of the dense cache the next draft attends to (per layer and KV head)."""

    @property
    def nbytes(self) -> int:
        """Bytes of drafter state over all slots (index, compact KV, importance window)."""


@DRAFTERS.register("ar")
class NullDrafter:
    """``ar``: drafts nothing, so every step verifies only the pending token (plain decoding)."""

    options = MethodOptions  # none
    want_rows = 0
    want_rows_prefill = 0
    want_hidden = ()

    def __init__(self, model, spec: MethodOptions | None, capacity: int, max_num_seqs: int, max_k: int):
        self.max_num_seqs = max_num_seqs

    def prefill_row(self, b, cache, rows, prompt) -> None:
        pass

    def propose(self, cache, pending, limits, policies, sampling, history) -> Draft:
        return empty_draft(pending)

    def commit(self, cache, rows, counts) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass

    def index_sizes(self) -> list[int]:
        return [0] * self.max_num_seqs

    @property
    def nbytes(self) -> int:
        return 0


def empty_draft(pending: torch.Tensor) -> Draft:
    """A step that drafts nothing for any row."""
    B = pending.shape[0]
    return Draft(pending[:, :0], None, torch.zeros(B, 0, device=pending.device), [0] * B)


def draft_loop(step, pending: torch.Tensor, limits: Sequence[int], policies: Sequence,
               sampling: BatchSampling) -> Draft:
    """Autoregressive drafting shared by every model-based drafter.

    ``step(tok, j)`` runs the drafter's model on ``tok`` ``[B, 1]`` (the ``j``-th input of the
    step: the pending token, then each draft) and returns logits ``[B, V]``. Row ``b`` drafts at
    most ``limits[b]`` tokens; an adaptive ``policies[b]`` may stop it earlier after reading the
    entropies (the one host sync of the loop). q is the row's ``logits_to_probs`` of the
    drafter's logits with its own temperature/top-k/top-p, exactly what is sampled from.
    """
    B = pending.shape[0]
    limit = [max(0, int(x)) for x in limits]
    drafting = [lim > 0 for lim in limit]
    num_draft = [0] * B
    adaptive = [bool(getattr(p, "adaptive", False)) for p in policies]
    toks, qs, ents = [], [], []
    tok = pending  # [B, 1]
    for j in range(max(limit, default=0)):
        logits = step(tok, j)  # [B, V]
        logp = torch.log_softmax(logits.float(), dim=-1)
        ents.append(-(logp.exp() * logp).sum(-1))  # [B] entropy of the raw draft distribution
        if sampling.all_greedy:
            tok = logits.argmax(dim=-1, keepdim=True)  # [B, 1]
        else:
            q = sampling.probs(logits)  # [B, V]
            qs.append(q)
            tok = sampling.sample(logits, q).view(B, 1)
        toks.append(tok)
        for b in range(B):
            if drafting[b]:
                num_draft[b] = j + 1
                drafting[b] = num_draft[b] < limit[b]
        if any(d and a for d, a in zip(drafting, adaptive)):
            ent_host = torch.stack(ents, dim=1).tolist()  # SYNC: the entropy controller decides per token
            for b in range(B):
                if drafting[b] and adaptive[b] and not policies[b].should_continue(ent_host[b][: j + 1]):
                    drafting[b] = False
        if not any(drafting):
            break
    if not toks:
        return empty_draft(pending)
    return Draft(torch.cat(toks, dim=1), torch.stack(qs, dim=1) if qs else None, torch.stack(ents, dim=1), num_draft)


def self_draft_loop(model, dkv, pending: torch.Tensor, start_positions: torch.Tensor, limits: Sequence[int],
                    policies: Sequence, sampling: BatchSampling, weights=None) -> Draft:
    """``draft_loop`` with the target model over a compact KV (``model.forward_draft``);
    ``start_positions`` ``[B]``: absolute position of each row's pending token; ``weights``: the
    draft's linear weights (``Transformer.draft_weights``; None = the model's own)."""
    return draft_loop(lambda tok, j: model.forward_draft(tok, start_positions + j, dkv, weights), pending, limits,
                      policies, sampling)
