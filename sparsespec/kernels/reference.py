"""PyTorch references of the attention kernels (the CPU path, and the oracle of the parity tests).

``grouped_attention`` is the exact math of ``Transformer._grouped_attention`` (the model calls it);
``verify_attention_ref`` and ``sparse_attention_ref`` wrap it with the masks of
``Transformer.forward_dense`` (ragged causal rows) and of the compact sparse draft
(``Transformer.forward_draft``) respectively. ``chunk_attention_cpu`` is the PyTorch path of a
prefill chunk's attention on CPU (fused flash attention, split in two).
"""
from __future__ import annotations

import torch


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      want_rows: int, scale: float, *, mask_from: int = 0,
                      rows_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with query heads grouped by KV head (GQA without materialising repeated KV heads).

    Args:
        q: ``[B, H, T, D]``; heads ``h = kv * G + g`` share KV head ``kv`` (G = H / H_kv).
        k, v: ``[B, H_kv, S, D]``.
        mask: ``[B, T, S - mask_from]`` bool (True = visible) over the key columns
            ``mask_from .. S - 1``; the keys before ``mask_from`` are visible to every query (the
            causal tail of a decode/verify step is a few columns, so no dense ``[B, T, S]`` mask
            is built). None: every key visible.
        want_rows: W; 0 = no importance rows.
        scale: softmax scale (``1 / sqrt(D)``).
        mask_from: first key column ``mask`` covers (0: it covers all S).
        rows_out: optional ``[B, H_kv, W, S]`` float32 buffer the rows are summed into (e.g. one
            layer's slice of a preallocated ``[L, B, H_kv, W, S]`` buffer: no stack afterwards).

    Returns:
        out ``[B, H, T, D]`` (q's dtype) and, if ``want_rows``, rows ``[B, H_kv, W, S]`` float32:
        the attention probabilities of the last W queries summed over the G query heads of each
        KV head (zero where masked).
    """
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * T, D)  # heads h = kv*G + g are contiguous
    scores = torch.matmul(qg, k.transpose(-1, -2))  # [B, H_kv, G*T, S]
    scores = scores.float() if scores.dtype != torch.float32 else scores
    scores.mul_(scale)
    if mask is not None:  # in place, over the masked columns only
        tail = scores.view(B, Hkv, G, T, S)[..., mask_from:]  # [B, H_kv, G, T, S - mask_from]
        tail.masked_fill_(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [B, H_kv, G*T, S]
    out = torch.matmul(probs.to(v.dtype), v).view(B, H, T, D)
    rows = None
    if want_rows:
        sel = probs.view(B, Hkv, G, T, S)[:, :, :, T - want_rows :]  # [B, H_kv, G, W, S]
        if rows_out is None:
            rows = sel.sum(dim=2)  # [B, H_kv, W, S]
        else:  # summed in place, one add per query head of the group (a reduction with out= zero-fills first)
            rows = rows_out.copy_(sel[:, :, 0])
            for g in range(1, G):
                rows.add_(sel[:, :, g])
    return out, rows


def tail_mask(starts: torch.Tensor, T: int, S: int, mask_from: int) -> torch.Tensor:
    """``[B, T, S - mask_from]`` bool: ``verify_mask``'s columns ``mask_from .. S - 1`` (every
    key before ``mask_from <= min(starts)`` is visible to every query)."""
    positions = starts.long()[:, None] + torch.arange(T, device=starts.device)  # [B, T]
    return torch.arange(mask_from, S, device=starts.device)[None, None, :] <= positions[:, :, None]


def verify_mask(starts: torch.Tensor, T: int, S: int) -> torch.Tensor:
    """``[B, T, S]`` bool: row b's query t sits at position ``starts[b] + t`` and sees keys ``<=`` it."""
    positions = starts.long()[:, None] + torch.arange(T, device=starts.device)  # [B, T]
    return torch.arange(S, device=starts.device)[None, None, :] <= positions[:, :, None]


def verify_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, starts: torch.Tensor,
                         want_rows: int, scale: float, max_start: int | None = None):
    """Dense decode/verify attention over a ragged batch (the math of ``Transformer.forward_dense``).

    Args:
        q: ``[B, H, T, D]`` queries of the T new tokens of each row.
        k_cache, v_cache: ``[B, H_kv, S_max, D]`` one layer's dense cache, the new tokens already
            written at positions ``starts[b] .. starts[b] + T - 1``.
        starts: ``[B]`` int, each row's length before this forward.
        want_rows: W <= T, importance rows for the last W queries (0 = none).
        scale: softmax scale.
        max_start: ``max(starts)`` if known on the host (avoids a device sync).

    Returns:
        out ``[B, H, T, D]`` and rows ``[B, H_kv, W, S]`` float32 (S = max(starts) + T) or None.
    """
    T = q.shape[2]
    S = (int(starts.max()) if max_start is None else max_start) + T
    mask = verify_mask(starts, T, S)
    return grouped_attention(q, k_cache[:, :, :S], v_cache[:, :, :S], mask, want_rows, scale)


def sparse_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
                         n_valid: torch.Tensor | None, k_tail: torch.Tensor | None, v_tail: torch.Tensor | None,
                         scale: float) -> torch.Tensor:
    """Sparse draft attention: gather the indexed positions, append the draft tail, attend.

    Args:
        q: ``[B, H, T, D]``; query t is the tail's slot ``E - T + t``.
        k_cache, v_cache: ``[B, H_kv, S_max, D]`` one layer's dense cache.
        index: ``[B, H_kv, N]`` int positions into the cache (row b uses its first ``n_valid[b]``).
        n_valid: ``[B]`` int or None (all N valid).
        k_tail, v_tail: ``[B, H_kv, E, D]`` the draft phase's own tokens (the T queries' KV last),
            or None (E = 0). Causal among them: query t sees tail slots ``<= E - T + t``.
        scale: softmax scale.

    Returns:
        out ``[B, H, T, D]`` in q's dtype.
    """
    B, Hkv, N = index.shape
    T, D = q.shape[2], q.shape[3]
    gi = index.long()[..., None].expand(B, Hkv, N, D)
    keys, vals = torch.gather(k_cache, 2, gi), torch.gather(v_cache, 2, gi)  # [B, H_kv, N, D]
    E = 0 if k_tail is None else k_tail.shape[2]
    if E:
        keys, vals = torch.cat([keys, k_tail], dim=2), torch.cat([vals, v_tail], dim=2)  # [B, H_kv, N + E, D]
    j = torch.arange(N + E, device=q.device)
    idx_ok = (j < N)[None, :].expand(B, N + E)
    if n_valid is not None:
        idx_ok = idx_ok & (j[None, :] < n_valid.to(q.device)[:, None])
    tail_ok = (j[None, :] >= N) & (j[None, :] - N <= E - T + torch.arange(T, device=q.device)[:, None])  # [T, N+E]
    mask = idx_ok[:, None, :] | tail_ok[None]  # [B, T, N + E]
    out, _ = grouped_attention(q, keys, vals, mask, 0, scale)
    return out


# PyTorch's fused CPU flash attention with its log-sum-exp (what SDPA runs on CPU, minus the mask)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def chunk_attention_cpu(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, start: int,
                        scale: float) -> torch.Tensor:
    """A prefill chunk's causal attention on CPU: ``q`` ``[B, H, T, D]`` at positions
    ``start .. start + T - 1`` of every row, ``keys``/``vals`` ``[B, H_kv, start + T, D]`` (any
    strides). Returns ``[B, H, T, D]``, equal to causal SDPA over the keys up to rounding.

    Two fused flash-attention calls instead of one masked one: the prefix ``[0, start)``, seen
    whole by every query, with each KV group's query heads as extra query rows (``[B, H_kv, G*T,
    D]``: no repeated KV, no mask, 4x longer flash tiles), and the chunk's own ``T`` keys with
    ``is_causal`` (top-left aligned, which is exact there); the two are merged by their
    log-sum-exps. On the 2-core Xeon this ran 1.3-1.4x the masked SDPA at 512-token chunks of an
    8K prompt (benchmarks/RESULTS.md, tenth session). Needs ``_FLASH_CPU``.
    """
    B, H, T, D = q.shape
    H_kv = keys.shape[1]
    G = H // H_kv
    k_own = keys[:, :, start : start + T].repeat_interleave(G, dim=1)  # [B, H, T, D]
    v_own = vals[:, :, start : start + T].repeat_interleave(G, dim=1)
    out_own, lse_own = _FLASH_CPU(q, k_own, v_own, is_causal=True, scale=scale)[:2]  # [B, H, T, D], [B, H, T]
    if start == 0:
        return out_own
    q_grouped = q.reshape(B, H_kv, G * T, D)  # query head h = kv head h // G, as GQA groups them
    out_pre, lse_pre = _FLASH_CPU(q_grouped, keys[:, :, :start], vals[:, :, :start], scale=scale)[:2]
    out_pre = out_pre.reshape(B, H, T, D)
    lse_pre = lse_pre.reshape(B, H, T)
    lse = torch.logaddexp(lse_pre, lse_own)  # [B, H, T]
    out = (out_pre * (lse_pre - lse).exp()[..., None]).add_(out_own * (lse_own - lse).exp()[..., None])
    return out.to(q.dtype)
