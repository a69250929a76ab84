"""Logits -> probabilities (temperature, top-k, top-p) and sampling.

Losslessness of speculative sampling (Leviathan et al. 2023; Chen et al. 2023) is a statement
about the distributions actually used: the engine must turn the target's logits into ``p`` and the
drafter's logits into ``q`` with the *same* function and the *same* parameters
(``logits_to_probs(logits, temperature, top_k, top_p)``), and the draft token must be sampled from
exactly that ``q``. The verified output is then distributed exactly as sampling from ``p`` token by
token, i.e. as plain autoregressive decoding with these parameters. Deterministic drafters (greedy,
n-gram lookup) pass a one-hot ``q``.

All functions are batched over any leading dimensions, run on the tensors' device and never
synchronise with the host. Probabilities are float32 whatever the logits'
dtype.
"""
from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Sequence

import torch

# Slack on the nucleus boundary. A token is kept when the probability mass ranked strictly above
# it is < top_p - _TOP_P_SLACK. Without it, a float32 cumulative sum that should equal top_p
# exactly (probs [0.5, 0.3, ...] with top_p = 0.8) lands on either side of it by rounding, and the
# nucleus size flips. The slack only ever drops tail tokens whose total mass is < 1e-6.
_TOP_P_SLACK = 1e-6
_MAX_SEED = 2**64 - 1


def validate_sampling(temperature: float, top_k: int, top_p: float, seed: int | None) -> None:
    """Check decoding parameters; raise ``ValueError`` naming the first invalid one.

    Args:
        temperature: finite, >= 0 (0 = greedy).
        top_k: integer >= 0 (0 = disabled).
        top_p: in (0, 1] (1 = disabled).
        seed: ``None`` or an integer in [0, 2**64 - 1].
    """
    if isinstance(temperature, bool) or not isinstance(temperature, Real):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not math.isfinite(float(temperature)) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, Integral) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = disabled), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, Real) or not (0.0 < float(top_p) <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {top_p!r}")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, Integral) or not 0 <= seed <= _MAX_SEED
    ):
        raise ValueError(f"seed must be None or an integer in [0, 2**64 - 1], got {seed!r}")


def logits_to_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Turn logits into the sampling distribution; apply it identically to ``p`` and ``q``.

    Args:
        logits: ``[..., V]`` any float dtype.
        temperature: 0 -> one-hot at ``torch.argmax(logits, -1)`` (first index among ties; top-k
            and top-p are then irrelevant: the argmax is always inside both). Otherwise
            ``softmax(logits / temperature)`` in float32.
        top_k: keep the ``top_k`` most probable tokens (0 or >= V: disabled). Exactly ``top_k``
            tokens are kept; among tokens tied at the boundary the lower token ids win (stable
            descending sort).
        top_p: nucleus (HF / vLLM semantics), applied after top-k on the renormalised top-k
            distribution: sort descending and keep the smallest prefix whose cumulative
            probability reaches ``top_p`` (at least one token). The boundary has a 1e-6 slack
            against float32 rounding (a prefix whose mass is within 1e-6 below ``top_p`` counts
            as reaching it). 1 = disabled.

    Returns:
        ``[..., V]`` float32 probabilities, zero outside the kept set, renormalised to sum to 1.
    """
    validate_sampling(temperature, top_k, top_p, None)
    vocab = logits.shape[-1]
    if temperature == 0:
        ids = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
        out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return out.scatter_(-1, ids, 1.0)  # [..., V]
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [..., V] float32
    use_k = 0 < top_k < vocab
    use_p = top_p < 1.0
    if not (use_k or use_p):
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [..., V] each
    keep_sorted = torch.ones_like(sorted_probs, dtype=torch.bool)  # [..., V]
    if use_k:
        keep_sorted[..., top_k:] = False
        sorted_probs = sorted_probs * keep_sorted
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    if use_p:
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # [..., V] exclusive cumsum
        in_nucleus = mass_above < (top_p - _TOP_P_SLACK)
        in_nucleus[..., 0] = True  # always keep the most probable token
        keep_sorted = keep_sorted & in_nucleus
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)  # [..., V] vocab order
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True)


def race_argmax(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample an index proportionally to non-negative ``weights`` (need not be normalised).

    Exponential race (vLLM style): ``argmax_i w_i / E_i`` with ``E_i ~ Exp(1)`` i.i.d. picks
    ``i`` with probability ``w_i / sum(w)``. Computed in log space, ``log w_i - log E_i``, so a
    zero weight is ``-inf`` and can never win against a positive one (a one-hot row always returns
    its hot index). One fixed-size random draw, no host synchronisation.

    Args:
        weights: ``[..., V]`` float, >= 0 (negatives count as 0). An all-zero row returns 0
            (the distribution is undefined there).
        generator: a ``torch.Generator`` on ``weights.device``, ``None`` for the global one, or
            a list of them, one per row of a ``[B, V]`` ``weights`` (each row draws from its own).

    Returns:
        ``[...]`` int64 indices.
    """
    w = weights.float().clamp(min=0.0)  # [..., V]
    e = _exponentials(w, generator)  # [..., V]
    e.clamp_(min=torch.finfo(torch.float32).tiny)  # exponential_ must not give log(0)
    return (w.log() - e.log()).argmax(dim=-1)  # [...]


Generators = "torch.Generator | None | Sequence[torch.Generator | None]"


def _per_row(generator) -> bool:
    return isinstance(generator, (list, tuple))


def _exponentials(w: torch.Tensor, generator) -> torch.Tensor:
    """Exp(1) draws shaped like ``w``; per row of dim 0 from its own generator when given a list."""
    if not _per_row(generator):
        return torch.empty_like(w).exponential_(generator=generator)
    if len(generator) != w.shape[0]:
        raise ValueError(f"need one generator per row: {w.shape[0]} rows, {len(generator)} generators")
    if all(g is None for g in generator):
        return torch.empty_like(w).exponential_()
    return torch.stack([torch.empty_like(w[b]).exponential_(generator=g) for b, g in enumerate(generator)])


def uniforms(shape: tuple[int, ...], generator, device, dtype=torch.float64) -> torch.Tensor:
    """U[0, 1) draws ``[B, ...]``; per row from its own generator when ``generator`` is a list."""
    if not _per_row(generator):
        return torch.rand(shape, dtype=dtype, device=device, generator=generator)
    if len(generator) != shape[0]:
        raise ValueError(f"need one generator per row: {shape[0]} rows, {len(generator)} generators")
    if all(g is None for g in generator):
        return torch.rand(shape, dtype=dtype, device=device)
    return torch.stack([torch.rand(shape[1:], dtype=dtype, device=device, generator=g) for g in generator])


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample one token per row of ``probs``.

    Args:
        probs: ``[..., V]`` probabilities (float32 from ``logits_to_probs``).
        generator: ``torch.Generator`` on ``probs.device`` (see ``make_generator``) or ``None``.

    Returns:
        ``[...]`` int64 token ids. One-hot rows always return their hot index, so temperature-0
        probabilities sample the argmax. No host synchronisation.
    """
    return race_argmax(probs, generator)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``; ``None`` when ``seed`` is None
    (use the global generator)."""
    if seed is None:
        return None
    validate_sampling(0.0, 0, 1.0, seed)
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen


class BatchSampling:
    """The sampling parameters of the rows of one batch (each request keeps its own).

    ``params[b]`` is any object with ``temperature``, ``top_k``, ``top_p`` (a ``SamplingParams``);
    ``generators[b]`` row b's generator (``None`` = the global one). Rows with equal
    (temperature, top_k, top_p) are processed together, so a uniform batch costs one call.
    """

    def __init__(self, params: Sequence, generators: Sequence[torch.Generator | None]):
        if len(params) != len(generators):
            raise ValueError(f"{len(params)} rows of parameters but {len(generators)} generators")
        self.params = list(params)
        self.generators = list(generators)
        self.keys = [(float(p.temperature), int(p.top_k), float(p.top_p)) for p in self.params]
        self.all_greedy = all(k[0] == 0 for k in self.keys)
        self.greedy = [k[0] == 0 for k in self.keys]

    def __len__(self) -> int:
        return len(self.params)

    def select(self, rows: Sequence[int]) -> "BatchSampling":
        return BatchSampling([self.params[b] for b in rows], [self.generators[b] for b in rows])

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits_to_probs`` per row: logits ``[B, ..., V]`` -> float32 probabilities ``[B, ..., V]``."""
        groups: dict[tuple, list[int]] = {}
        for b, key in enumerate(self.keys):
            groups.setdefault(key, []).append(b)
        if len(groups) == 1:
            (t, k, p), = groups
            return logits_to_probs(logits, t, k, p)
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        for (t, k, p), rows in groups.items():
            idx = torch.tensor(rows, device=logits.device)
            out[idx] = logits_to_probs(logits[idx], t, k, p)
        return out

    def sample(self, logits: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row from logits ``[B, V]``: the argmax for greedy rows, else a draw from
        ``probs`` (``self.probs(logits)`` when not given) with the row's own generator. ``[B]`` int64."""
        if self.all_greedy:
            return logits.argmax(dim=-1)
        probs = self.probs(logits) if probs is None else probs
        drawn = race_argmax(probs, self.generators)  # [B]
        if any(self.greedy):
            greedy = torch.tensor(self.greedy, device=logits.device)
            drawn = torch.where(greedy, logits.argmax(dim=-1), drawn)
        return drawn
