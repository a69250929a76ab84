"""Lossless verification (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"), greedy case.

Tokens of a step are *accepted* (drafts that matched), one *recovered* token (the target's token
at the first mismatch) or one *bonus* token (the target's token after K accepted drafts).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one row's draft.

    Attributes:
        num_accepted: length of the leading run of drafts equal to the target's choice (0..K).
        token_ids: tokens to commit: the accepted drafts then one recovered or bonus token
            (length ``num_accepted + 1``).
        bonus: True when all K drafts were accepted (the last token is a bonus token).
    """

    num_accepted: int
    token_ids: list[int]
    bonus: bool


def greedy_verify(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy verification: accept while ``draft == argmax p``.

    Args:
        draft_ids: ``[K]`` int64 draft tokens (K may be 0).
        target_logits: ``[K + 1, V]`` float32 target logits at the K+1 verified positions.

    Returns:
        The ``Verdict``; output is token-identical to greedy autoregressive decoding.
    """
    k = draft_ids.shape[0]
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, expected K+1={k + 1}")
    target_ids = target_logits.argmax(dim=-1)  # [K + 1]
    match = (draft_ids == target_ids[:k]).int()  # [K]
    num_accepted = int(match.cumprod(0).sum().item()) if k else 0  # SYNC: one per verify step
    tokens = target_ids[: num_accepted + 1].tolist()
    return Verdict(num_accepted=num_accepted, token_ids=tokens, bonus=num_accepted == k)
