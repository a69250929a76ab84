"""Lossless verification of drafted tokens.

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding" and Chen et al.
2023, "Accelerating Large Language Model Decoding with Speculative Sampling".

Tokens of a step are *accepted* (drafts that passed verification), one *recovered* token (the
token emitted at the first rejection in place of the rejected draft) or one *bonus* token (the
token emitted from the target's distribution after all drafts were accepted). Every step emits
``num_accepted + 1`` tokens.

- ``greedy_verify``: one row, greedy (accept while ``draft == argmax p``), returns a ``Verdict``.
- ``greedy_verify_batch``: the same rule batched over rows with per-row draft lengths, on device.
- ``rejection_sample``: the sampling rule (accept with ``min(1, p/q)``, recover from
  ``norm(max(0, p - q))``, bonus from ``p``), batched, on device. With one-hot ``p`` and ``q``
  (temperature 0) it reduces exactly to greedy verification.
- ``verdicts``: batched outputs -> per-row ``Verdict`` (one host sync).

The batched functions are vectorised over rows and draft positions (no Python loop over B or K)
and do not synchronise with the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsespec.sampling import race_argmax, uniforms


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


PLACEHOLDER_ID = -1  # output_ids after the recovered / bonus token


def _num_draft(num_draft: torch.Tensor | None, batch: int, k: int, device: torch.device) -> torch.Tensor:
    """``[B]`` int64 valid draft counts, clamped to [0, K] (clamping avoids a host-side check)."""
    if num_draft is None:
        return torch.full((batch,), k, dtype=torch.long, device=device)
    if tuple(num_draft.shape) != (batch,):
        raise ValueError(f"num_draft has shape {tuple(num_draft.shape)}, expected [B]=({batch},)")
    return num_draft.to(device=device, dtype=torch.long).clamp(0, k)  # [B]


def _assemble(draft_ids: torch.Tensor, num_accepted: torch.Tensor, last_ids: torch.Tensor) -> torch.Tensor:
    """``[B, K+1]`` = accepted drafts, then ``last_ids``, then ``PLACEHOLDER_ID``."""
    batch, k = draft_ids.shape
    pos = torch.arange(k + 1, device=draft_ids.device)  # [K+1]
    pad = torch.full((batch, 1), PLACEHOLDER_ID, dtype=torch.long, device=draft_ids.device)
    drafts = torch.cat([draft_ids.long(), pad], dim=1)  # [B, K+1]
    na = num_accepted.unsqueeze(1)  # [B, 1]
    out = torch.where(pos < na, drafts, PLACEHOLDER_ID)  # [B, K+1]
    return torch.where(pos == na, last_ids.unsqueeze(1), out)  # [B, K+1]


def rejection_sample(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_draft: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative (rejection) sampling, batched: the output is distributed exactly as sampling
    from the target ``p`` token by token (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

    Per row, for draft positions ``i < num_draft`` in order: draft ``x_i`` is *accepted* with
    probability ``min(1, p_i(x_i) / q_i(x_i))`` (implemented as ``p_i(x_i) > u_i * q_i(x_i)``,
    ``u_i ~ U[0, 1)``, so ``p_i(x_i) = 0`` always rejects and ``q_i(x_i) = 0 < p_i(x_i)``, a draft
    outside its claimed support, accepts). At the first rejection ``i`` a *recovered* token is
    sampled from ``norm(max(0, p_i - q_i))``; if that residual is all zero (only possible when
    ``p_i == q_i`` up to rounding) it is sampled from ``p_i``. If all ``num_draft`` drafts are
    accepted, a *bonus* token is sampled from ``p_{num_draft}``. Positions at or past
    ``num_draft`` are padding: their ids and probabilities are never read into the result (they
    may hold anything, even NaN or -1).

    With one-hot ``p`` and ``q`` (temperature 0, see ``sampling.logits_to_probs``) this is
    exactly greedy exact-match verification (``greedy_verify_batch``).

    Args:
        draft_ids: ``[B, K]`` int64 draft tokens (K may be 0).
        draft_probs: ``[B, K, V]`` float32 ``q``: exactly the distribution each draft token was
            sampled from (one-hot for greedy or deterministic drafters such as n-gram lookup),
            after the same temperature / top-k / top-p as the target.
        target_probs: ``[B, K+1, V]`` float32 ``p`` at the K+1 verified positions (position i
            scores draft i; position K only ever serves as the bonus distribution).
        num_draft: ``[B]`` int64 valid drafts per row (values are clamped to [0, K]); ``None``
            means K for every row.
        generator: ``torch.Generator`` on the probabilities' device, ``None``, or a list of one
            per row (each row draws only from its own). The amount of randomness drawn is fixed
            by the shapes (``[B, K]`` uniforms, ``[B, V]``
            exponentials), so a seeded generator gives reproducible results.

    Returns:
        ``output_ids``: ``[B, K+1]`` int64 = the accepted drafts, then the recovered or bonus
        token, then ``-1`` (``PLACEHOLDER_ID``); ``num_accepted``: ``[B]`` int64, the length of
        the leading accepted run (``0..num_draft``). The last token is a bonus token exactly
        when ``num_accepted == num_draft``.
    """
    if draft_ids.dim() != 2:
        raise ValueError(f"draft_ids must be [B, K], got shape {tuple(draft_ids.shape)}")
    batch, k = draft_ids.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (batch, k + 1):
        raise ValueError(
            f"target_probs has shape {tuple(target_probs.shape)}, expected [B, K+1, V]=({batch}, {k + 1}, V)"
        )
    vocab = target_probs.shape[-1]
    if tuple(draft_probs.shape) != (batch, k, vocab):
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)}, expected [B, K, V]=({batch}, {k}, {vocab})"
        )
    device = target_probs.device
    draft_ids = draft_ids.to(device)
    n = _num_draft(num_draft, batch, k, device)  # [B]

    valid = torch.arange(k, device=device) < n.unsqueeze(1)  # [B, K]
    safe_ids = draft_ids.long().clamp(0, vocab - 1).unsqueeze(-1)  # [B, K, 1] (padding may be -1)
    p_x = target_probs[:, :k].gather(-1, safe_ids).squeeze(-1)  # [B, K]
    q_x = draft_probs.gather(-1, safe_ids).squeeze(-1)  # [B, K]
    # float64 uniforms: P(u == 0) is 2**-53, not float32's 2**-24.
    u = uniforms((batch, k), generator, device)  # [B, K]
    accept = valid & (p_x.double() > u * q_x.double())  # [B, K]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B] leading run

    rows = torch.arange(batch, device=device)
    p_last = target_probs[rows, num_accepted].float()  # [B, V] p at the emitting position
    if k > 0:
        q_last = draft_probs[rows, num_accepted.clamp(max=k - 1)].float()  # [B, V]
        residual = (p_last - q_last).clamp(min=0.0)  # [B, V] unnormalised: race_argmax is fine
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_last)
        rejected = (num_accepted < n).unsqueeze(1)  # [B, 1] recovered (else bonus)
        weights = torch.where(rejected, residual, p_last)  # [B, V]
    else:
        weights = p_last
    last_ids = race_argmax(weights, generator)  # [B]
    return _assemble(draft_ids, num_accepted, last_ids), num_accepted


def greedy_verify_batch(
    draft_ids: torch.Tensor, target_logits: torch.Tensor, num_draft: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification, batched: accept while ``draft == argmax p`` (``torch.argmax``, first
    index among ties, as ``greedy_verify``); the recovered token (first mismatch) or the bonus
    token (after ``num_draft`` matches) is the target's argmax at that position. Token-identical
    to greedy autoregressive decoding.

    Args:
        draft_ids: ``[B, K]`` int64 draft tokens (K may be 0).
        target_logits: ``[B, K+1, V]`` target logits (any float dtype) at the K+1 verified
            positions.
        num_draft: ``[B]`` int64 valid drafts per row (clamped to [0, K]; positions past it are
            padding and ignored); ``None`` means K for every row.

    Returns:
        ``(output_ids [B, K+1] int64, num_accepted [B] int64)`` exactly as ``rejection_sample``.
    """
    if draft_ids.dim() != 2:
        raise ValueError(f"draft_ids must be [B, K], got shape {tuple(draft_ids.shape)}")
    batch, k = draft_ids.shape
    if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (batch, k + 1):
        raise ValueError(
            f"target_logits has shape {tuple(target_logits.shape)}, expected [B, K+1, V]=({batch}, {k + 1}, V)"
        )
    device = target_logits.device
    draft_ids = draft_ids.to(device).long()
    n = _num_draft(num_draft, batch, k, device)  # [B]
    target_ids = target_logits.argmax(dim=-1)  # [B, K+1]
    valid = torch.arange(k, device=device) < n.unsqueeze(1)  # [B, K]
    match = valid & (draft_ids == target_ids[:, :k])  # [B, K]
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)  # [B]
    last_ids = target_ids.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [B]
    return _assemble(draft_ids, num_accepted, last_ids), num_accepted


def verdicts(
    output_ids: torch.Tensor, num_accepted: torch.Tensor, num_draft: torch.Tensor | None = None
) -> list[Verdict]:
    """Per-row ``Verdict``s from batched outputs (one host sync: call once per step).

    ``bonus`` is True when the row accepted all its ``num_draft`` drafts (``None``: K).
    """
    batch, k1 = output_ids.shape
    n = _num_draft(num_draft, batch, k1 - 1, num_accepted.device)
    na_list = num_accepted.tolist()  # SYNC
    n_list = n.tolist()
    ids = output_ids.tolist()
    return [
        Verdict(num_accepted=na, token_ids=row[: na + 1], bonus=na == nd)
        for na, nd, row in zip(na_list, n_list, ids)
    ]
