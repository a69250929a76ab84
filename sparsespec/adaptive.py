"""Draft-length policies: how many tokens to draft in each speculative step.

The engine drives a policy once per step::

    k_max = policy.start_step(budget)          # budget = tokens the request may still draft
    entropies = []
    while len(entropies) < k_max:
        draft one token; entropies.append(H(q))  # one marked host sync per draft token
        if not policy.should_continue(entropies):
            break
    verify len(entropies) drafts -> num_accepted (leading run)
    policy.update(entropies, num_accepted)
    policy.observe_costs(mean_draft_forward_s, verify_step_s)

``FixedK`` is the null object (always ``min(k, budget)`` drafts). ``EntropyAdaptive`` is the
SparseSpec-L paper's entropy controller: EMA centroids of the draft-token entropy of
accepted and of rejected tokens, a two-centroid soft classifier giving each draft token an
acceptance probability ``p_i``, and the objective

    E(k) = (1 + sum_{m<=k} prod_{i<=m} p_i) / (k*C_d + C_v)

(expected tokens emitted per step divided by the step's time; ``gamma = C_d / C_v``).

``roc_auc`` scores how well a signal (e.g. ``-entropy``) separates accepted from rejected drafts.

Everything here is host-side Python/NumPy; entropies may be floats, NumPy scalars or 0-d tensors.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from sparsespec.registry import Registry

__all__ = ["CONTROLLERS", "CostAwareController", "DraftLengthPolicy", "EntropyAdaptive", "FixedK", "POLICIES",
           "RowAcceptance", "StepCosts", "VerifyCostModel", "expected_tokens_geometric", "policy_for", "roc_auc"]


def _to_float(x: Any) -> float:
    """Float from a Python number, NumPy scalar or 0-d (host or device) tensor."""
    item = getattr(x, "item", None)
    return float(item() if callable(item) else x)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _sigmoid(z: float) -> float:
    """Overflow-free logistic function."""
    if z >= 0.0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


@runtime_checkable
class DraftLengthPolicy(Protocol):
    """Chooses the draft length online, one drafted token at a time."""

    #: True when ``should_continue`` reads entropies (the draft loop then syncs them per token)
    adaptive: bool

    max_k: int

    def start_step(self, budget: int) -> int:
        """Start a step; return the most drafts allowed in it: ``min(max_k, budget)`` (>= 0)."""
        ...

    def should_continue(self, entropies: Sequence[float]) -> bool:
        """After each drafted token: entropies (nats) of q for the ``m >= 1`` tokens drafted so far
        in this step. ``False`` = stop drafting now and verify these ``m`` tokens."""
        ...

    def update(self, entropies: Sequence[float], num_accepted: int) -> None:
        """After verification: the ``m`` drafted tokens' entropies and the accepted leading run."""
        ...

    def observe_costs(self, draft_step_s: float, verify_step_s: float) -> None:
        """Measured mean time of one draft forward and of the verify step in this step."""
        ...


class FixedK:
    """Null-object policy: draft exactly ``min(k, budget)`` tokens every step."""

    adaptive = False  # the draft loop needs no entropies on the host

    def __init__(self, k: int):
        if not _is_int(k) or k < 0:
            raise ValueError(f"k must be an integer >= 0, got {k!r}")
        self.k = int(k)
        self.max_k = self.k
        self._step_max = self.k
        self.num_decisions = 0
        self.num_steps = 0

    def start_step(self, budget: int) -> int:
        self._step_max = max(0, min(self.k, int(budget)))
        self.num_steps += 1
        return self._step_max

    def should_continue(self, entropies: Sequence[float]) -> bool:
        self.num_decisions += 1
        return len(entropies) < self._step_max

    def update(self, entropies: Sequence[float], num_accepted: int) -> None:
        pass

    def observe_costs(self, draft_step_s: float, verify_step_s: float) -> None:
        pass

    @classmethod
    def from_spec(cls, spec, costs: "StepCosts | None" = None) -> "FixedK":
        """The policy of a method's ``SpecOptions`` with an integer ``k`` (``costs`` unused)."""
        return cls(spec.k_limit)

    @property
    def overhead_s(self) -> float:
        return 0.0  # a length comparison; not worth a clock read

    def __repr__(self) -> str:
        return f"FixedK(k={self.k})"


class StepCosts:
    """Measured costs of one speculative round, shared by the controllers of a batch's rows.

    ``C_d``: seconds of one draft forward; ``C_v(k)``: seconds of verifying ``k + 1`` tokens per
    row (it grows with ``k`` and the batch where the verify is compute-bound); ``C_o``: the rest of
    a round (sampling, acceptance bookkeeping, cache and index maintenance). All are EMAs with
    weight ``ema`` (the first measurement replaces the prior). Non-positive or non-finite
    measurements are ignored.

    ``C_v(k)`` is kept per verify width ``w = k + 1``; a width never measured is interpolated
    linearly between the measured ones (extrapolated with the slope of the two nearest, never
    below zero slope). A measurement without a width (``observe(d, v)``) is a width-free
    fallback used when no width was ever measured. Until a draft cost and a verify cost have
    both been measured, the unitless prior ``C_v = 1, C_d = init_cost_ratio, C_o = 0`` is used.
    """

    def __init__(self, ema: float = 0.1, init_cost_ratio: float = 0.3):
        if not (isinstance(ema, (int, float)) and 0.0 < ema <= 1.0):
            raise ValueError(f"ema must be in (0, 1], got {ema!r}")
        if not (isinstance(init_cost_ratio, (int, float)) and math.isfinite(init_cost_ratio) and init_cost_ratio > 0):
            raise ValueError(f"init_cost_ratio must be a finite number > 0, got {init_cost_ratio!r}")
        self.ema = float(ema)
        self.init_cost_ratio = float(init_cost_ratio)
        self._c_d: float | None = None
        self._c_v: dict[int | None, float] = {}
        self._c_o: float | None = None
        self._last_width: int | None = None

    def _blend(self, old: float | None, x: Any) -> float | None:
        x = _to_float(x)
        if not (math.isfinite(x) and x > 0.0):
            return old
        return x if old is None else old + self.ema * (x - old)

    def observe(self, draft_forward_s: float, verify_s: float, verify_tokens: int | None = None,
                other_s: float | None = None) -> None:
        """One round: mean seconds per draft forward, the verify forward of ``verify_tokens``
        tokens per row (``None``: width unknown), and the rest of the round."""
        self._c_d = self._blend(self._c_d, draft_forward_s)
        key = None if verify_tokens is None else int(verify_tokens)
        v = self._blend(self._c_v.get(key), verify_s)
        if v is not None:
            self._c_v[key] = v
            self._last_width = key
        if other_s is not None:
            o = _to_float(other_s)
            if math.isfinite(o) and o >= 0.0:
                self._c_o = o if self._c_o is None else self._c_o + self.ema * (o - self._c_o)

    @property
    def measured(self) -> bool:
        return self._c_d is not None and bool(self._c_v)

    def draft(self) -> float:
        """``C_d`` (seconds once measured, else ``init_cost_ratio``)."""
        return self._c_d if self.measured else self.init_cost_ratio

    def verify(self, k: int | None = None) -> float:
        """``C_v(k)``: verifying ``k + 1`` tokens (``None``: the width measured last)."""
        if not self.measured:
            return 1.0
        pts = sorted((w, c) for w, c in self._c_v.items() if w is not None)
        if k is None or not pts:
            if self._last_width in self._c_v:
                return self._c_v[self._last_width]
            return self._c_v[None] if None in self._c_v else pts[-1][1]
        w = int(k) + 1
        if len(pts) == 1:
            return pts[0][1]
        for (w0, c0), (w1, c1) in zip(pts, pts[1:]):
            if w0 <= w <= w1:
                return c0 + (c1 - c0) * (w - w0) / (w1 - w0)
        (w0, c0), (w1, c1) = (pts[0], pts[1]) if w < pts[0][0] else (pts[-2], pts[-1])
        slope = max(0.0, (c1 - c0) / (w1 - w0))
        return max(0.0, (c0 if w < w0 else c1) + slope * (w - (w0 if w < w0 else w1)))

    def other(self) -> float:
        """``C_o`` (seconds once measured, else 0)."""
        return self._c_o if (self.measured and self._c_o is not None) else 0.0

    def round_cost(self, k: int) -> float:
        """``k*C_d + C_v(k) + C_o``: the cost of a round drafting ``k`` tokens."""
        return k * self.draft() + self.verify(k) + self.other()

    def state(self) -> dict[str, Any]:
        return {"cost_draft_s": self._c_d, "cost_other_s": self._c_o,
                "cost_verify_s": {str(w): c for w, c in self._c_v.items()}}


class EntropyAdaptive:
    """Entropy-driven draft length (SparseSpec-L controller).

    State
        ``mu_accept`` / ``mu_reject``: EMA centroids of the entropy (nats) of accepted draft tokens
        and of rejected ones. Per token, in order: every token of the accepted leading run updates
        ``mu_accept``; the first rejected token (if any) updates ``mu_reject``; tokens after the
        first rejection were never judged by the target, their label is unknown and they update
        nothing. Non-finite entropies are skipped. ``accept_rate`` is a running mean of the same labels
        (an EMA once ``1 / ema`` labels were seen): the fallback probability in degenerate cases
        and the predicted acceptance when deciding, before drafting, whether to draft at all
        (``k = 0`` when no length beats plain decoding; only after ``min_labels`` labels, and
        every ``probe_every``-th such step drafts anyway).
        ``C_d`` / ``C_v``: EMAs of the measured draft-forward and verify-step seconds. Until both
        have been measured the ratio ``gamma = init_cost_ratio`` is used (``C_v = 1, C_d = gamma``,
        unitless); the first measurement of each replaces its initial value, later ones are blended
        with weight ``ema``. Non-positive or non-finite measurements (e.g. a step with no draft
        forward) are ignored.

    Soft classification (two-centroid softmax over squared distances, scaled by the spread)
        With ``d_a = h - mu_accept``, ``d_r = h - mu_reject``, ``s = mu_reject - mu_accept`` and
        ``beta = sharpness``::

            p(h) = exp(-beta d_a^2 / s^2) / (exp(-beta d_a^2 / s^2) + exp(-beta d_r^2 / s^2))
                 = sigmoid(2 beta (m - h) / s),     m = (mu_accept + mu_reject) / 2

        i.e. a logistic in ``h`` centred at the midpoint of the centroids, with slope set by their
        spread; ``p(mu_accept) = sigmoid(beta)`` and ``p(mu_reject) = sigmoid(-beta)`` (0.953 and
        0.047 for the default ``beta = 3``). If the centroids learn the "inverted" order
        (``s < 0``) the formula follows the data. Degenerate cases: if ``|s| < min_spread`` (equal
        centroids, no information) or ``h`` is NaN, ``p = accept_rate``.

    Decision rule (online, after each drafted token)
        The step's candidates are ``{min(c, k_step) for c in candidates}`` with
        ``k_step = start_step(budget)`` (a candidate longer than the budget is truncated to it,
        as ``FixedK`` does). After ``m`` drafted tokens with ``p_1..p_m`` from their entropies,
        the unknown future probabilities are predicted as ``p_i = p_m`` for ``i > m`` (the next
        tokens are assumed as easy as the latest one). Continue iff some step candidate
        ``k > m`` has ``E(k) > E(m)``; stop otherwise, and always at ``m >= k_step``. Stopping
        is allowed at any ``m`` (not only at candidates): the tokens already drafted are sunk cost.
    """

    adaptive = True  # the draft loop hands it each token's entropy

    def __init__(
        self,
        candidates: Sequence[int] = (1, 2, 3, 4, 6, 8, 12, 16),
        ema: float = 0.1,
        init_accept_entropy: float = 0.5,
        init_reject_entropy: float = 2.5,
        init_cost_ratio: float = 0.3,
        sharpness: float = 3.0,
        min_spread: float = 1e-3,
        costs: StepCosts | None = None,
        skip_unprofitable: bool = True,
        probe_every: int = 8,
    ):
        try:
            cands = list(candidates)
        except TypeError:
            raise ValueError(f"candidates must be a sequence of positive integers, got {candidates!r}") from None
        if not cands:
            raise ValueError("candidates must not be empty")
        for c in cands:
            if not _is_int(c) or c < 1:
                raise ValueError(f"candidates must be positive integers, got {c!r} in {candidates!r}")
        if not (isinstance(ema, (int, float)) and 0.0 < ema <= 1.0):
            raise ValueError(f"ema must be in (0, 1], got {ema!r}")
        for name, v in (("init_accept_entropy", init_accept_entropy), ("init_reject_entropy", init_reject_entropy)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0.0):
                raise ValueError(f"{name} must be a finite entropy >= 0 (nats), got {v!r}")
        for name, v in (("init_cost_ratio", init_cost_ratio), ("sharpness", sharpness), ("min_spread", min_spread)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0.0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")

        self.candidates: tuple[int, ...] = tuple(sorted({int(c) for c in cands}))
        self.max_k = self.candidates[-1]
        self.ema = float(ema)
        self.sharpness = float(sharpness)
        self.min_spread = float(min_spread)
        self.init_cost_ratio = float(init_cost_ratio)
        self.mu_accept = float(init_accept_entropy)
        self.mu_reject = float(init_reject_entropy)
        self.accept_rate = 0.5
        # measured round costs, shared with the other rows of the batch when given
        self.costs = costs if costs is not None else StepCosts(ema, init_cost_ratio)
        self.skip_unprofitable = bool(skip_unprofitable)
        if not _is_int(probe_every) or probe_every < 1:
            raise ValueError(f"probe_every must be an integer >= 1, got {probe_every!r}")
        self.probe_every = int(probe_every)
        self._skipped = 0  # consecutive steps the row chose k = 0
        self.num_skipped = 0
        self.num_labels = 0  # draft tokens with a known outcome seen so far
        self.min_labels = 16  # skipping needs this much evidence of the row's acceptance
        self._step_max = self.max_k
        self._step_cands: tuple[int, ...] = self.candidates
        # per-step cache of converted entropies / probabilities, reused by object identity so a
        # device tensor already read once is not read (synced) again on the next call
        self._cache_raw: list[Any] = []
        self._cache_p: list[float] = []
        # counters
        self.num_steps = 0
        self.num_decisions = 0
        self._overhead_s = 0.0

    # ------------------------------------------------------------------ costs
    @property
    def cost_draft(self) -> float:
        """``C_d``: seconds once both costs are measured, else ``init_cost_ratio`` (unitless)."""
        return self.costs.draft()

    @property
    def cost_verify(self) -> float:
        """``C_v`` at the width measured last: seconds once both costs are measured, else ``1.0``."""
        return self.costs.verify()

    @property
    def gamma(self) -> float:
        """Relative draft cost ``C_d / C_v``."""
        return self.cost_draft / self.cost_verify

    @property
    def overhead_s(self) -> float:
        """Seconds spent inside start_step / should_continue / update / observe_costs."""
        return self._overhead_s

    # ------------------------------------------------------------ classifier
    def accept_prob(self, h: Any) -> float:
        """Acceptance probability of a draft token whose q has entropy ``h`` (see class doc)."""
        h = _to_float(h)
        s = self.mu_reject - self.mu_accept
        if math.isnan(h) or abs(s) < self.min_spread:
            return self.accept_rate
        mid = 0.5 * (self.mu_accept + self.mu_reject)
        return _sigmoid(2.0 * self.sharpness * (mid - h) / s)

    def accept_probs(self, entropies: Sequence[Any]) -> list[float]:
        return [self.accept_prob(h) for h in entropies]

    # -------------------------------------------------------------- objective
    @staticmethod
    def expected_tokens(ps: Sequence[float]) -> float:
        """Expected tokens emitted by a step drafting ``len(ps)`` tokens:
        ``1 + sum_{m<=k} prod_{i<=m} p_i`` (the 1 is the recovered/bonus token)."""
        total, run = 1.0, 1.0
        for p in ps:
            run *= float(p)
            total += run
        return total

    def objective(self, ps: Sequence[float], k: int) -> float:
        """``E(k) = (1 + sum_{m<=k} prod_{i<=m} p_i) / (k*C_d + C_v(k) + C_o)``, using ``ps[:k]``."""
        if not _is_int(k) or k < 0:
            raise ValueError(f"k must be an integer >= 0, got {k!r}")
        if k > len(ps):
            raise ValueError(f"k={k} needs at least k probabilities, got {len(ps)}")
        return self.expected_tokens(ps[:k]) / self.costs.round_cost(k)

    def best_k(self, ps: Sequence[float]) -> int:
        """Argmax of ``E(k)`` over the candidates ``k <= len(ps)`` (ties -> the shorter k)."""
        ks = [c for c in self.candidates if c <= len(ps)]
        if not ks:
            raise ValueError(f"best_k needs at least {self.candidates[0]} probabilities, got {len(ps)}")
        return max(ks, key=lambda k: (self.objective(ps, k), -k))

    def extrapolate(self, ps: Sequence[float], horizon: int) -> list[float]:
        """``ps`` extended to ``horizon`` entries by repeating its last value (the rule's
        assumption that unknown future tokens are as likely to pass as the latest one)."""
        ps = [float(p) for p in ps]
        if not ps:
            raise ValueError("extrapolate needs at least one probability")
        return ps + [ps[-1]] * max(0, horizon - len(ps))

    def plan(self, entropies: Sequence[Any], k_max: int | None = None) -> int:
        """Best candidate length (truncated to ``k_max``) predicted from the entropies drafted so far."""
        k_max = self.max_k if k_max is None else int(k_max)
        cands = sorted({min(c, k_max) for c in self.candidates if min(c, k_max) >= 1})
        if not cands:
            return 0
        ps = self.extrapolate(self.accept_probs(entropies), cands[-1])
        return max(cands, key=lambda k: (self.objective(ps, k), -k))

    def _continue_from(self, ps: Sequence[float]) -> bool:
        """The online rule: with ``p_i = p_m`` predicted for ``i > m``, is some step candidate
        ``k > m`` better than stopping at ``m``?"""
        m = len(ps)
        longer = {k for k in self._step_cands if k > m}
        if m >= self._step_max or not longer:
            return False
        cost = self.costs.round_cost
        num, run = 1.0, 1.0  # numerator of E and prod_{i<=j} p_i, built incrementally
        for p in ps:
            run *= p
            num += run
        e_stop = num / cost(m)
        p_next = ps[-1]
        for k in range(m + 1, max(longer) + 1):
            run *= p_next
            num += run
            if k in longer and num / cost(k) > e_stop * (1.0 + 1e-12):
                return True
        return False

    # ------------------------------------------------------------ the protocol
    def start_step(self, budget: int) -> int:
        t0 = time.perf_counter()
        self._step_max = max(0, min(self.max_k, int(budget)))
        if self._step_max and self._unprofitable():
            self._step_max = 0  # k = 0: speculation does not pay for this row now
        self._step_cands = tuple(sorted({min(c, self._step_max) for c in self.candidates})) if self._step_max else ()
        self._cache_raw, self._cache_p = [], []
        self.num_steps += 1
        self._overhead_s += time.perf_counter() - t0
        return self._step_max

    def should_continue(self, entropies: Sequence[Any]) -> bool:
        t0 = time.perf_counter()
        n_same = 0
        for raw, cached in zip(entropies, self._cache_raw):
            if raw is not cached:
                break
            n_same += 1
        ps = self._cache_p[:n_same] + [self.accept_prob(h) for h in list(entropies)[n_same:]]
        self._cache_raw, self._cache_p = list(entropies), ps
        decision = self._continue_from(ps) if ps else self._step_max > 0
        self.num_decisions += 1
        self._overhead_s += time.perf_counter() - t0
        return decision

    def update(self, entropies: Sequence[Any], num_accepted: int) -> None:
        t0 = time.perf_counter()
        m = len(entropies)
        if not _is_int(num_accepted) or not 0 <= num_accepted <= m:
            raise ValueError(f"num_accepted must be an integer in [0, {m}], got {num_accepted!r}")
        a = self.ema
        for h in list(entropies)[:num_accepted]:
            h = _to_float(h)
            if math.isfinite(h):
                self.mu_accept += a * (h - self.mu_accept)
            self._label(1.0)
        if num_accepted < m:  # the first rejection; later tokens have no label
            h = _to_float(entropies[num_accepted])
            if math.isfinite(h):
                self.mu_reject += a * (h - self.mu_reject)
            self._label(0.0)
        self._cache_raw, self._cache_p = [], []
        self._overhead_s += time.perf_counter() - t0

    def _unprofitable(self) -> bool:
        """Before drafting: is no draft length expected to beat plain decoding (``k = 0``)?

        The first token's acceptance is predicted by ``accept_rate`` (its entropy is not known
        yet) and later ones likewise. Only decided on measured costs; every ``probe_every``-th
        skipped step drafts anyway, so the row keeps measuring its acceptance.
        """
        if not (self.skip_unprofitable and self.costs.measured and self.num_labels >= self.min_labels):
            return False
        p = min(max(self.accept_rate, 0.0), 1.0)
        e0 = 1.0 / self.costs.round_cost(0)
        best, num, run = 0.0, 1.0, 1.0
        for k in range(1, self._step_max + 1):
            run *= p
            num += run
            if k in self.candidates or k == self._step_max:
                best = max(best, num / self.costs.round_cost(k))
        if best > e0:
            self._skipped = 0
            return False
        self._skipped += 1
        if self._skipped >= self.probe_every:  # probe: draft once to refresh accept_rate
            self._skipped = 0
            return False
        self.num_skipped += 1
        return True

    def _label(self, y: float) -> None:
        """One draft token's outcome into ``accept_rate``: a running mean over the first
        ``1 / ema`` labels (so the prior 0.5 is forgotten at once), an EMA after."""
        self.num_labels += 1
        w = max(self.ema, 1.0 / self.num_labels)
        self.accept_rate += w * (y - self.accept_rate)

    def observe_costs(self, draft_step_s: float, verify_step_s: float, verify_tokens: int | None = None,
                      other_s: float | None = None) -> None:
        """Measured mean draft-forward seconds, verify seconds (of ``verify_tokens`` tokens per
        row when known) and other seconds of the round (see ``StepCosts.observe``)."""
        t0 = time.perf_counter()
        self.costs.observe(draft_step_s, verify_step_s, verify_tokens, other_s)
        self._overhead_s += time.perf_counter() - t0

    @classmethod
    def from_spec(cls, spec, costs: StepCosts | None = None) -> EntropyAdaptive:
        """The controller of a method's ``SpecOptions`` with ``k="auto"``: candidates up to ``max_k``."""
        base = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
        cands = tuple(sorted({c for c in base if c <= spec.max_k} | {spec.max_k}))
        return cls(candidates=cands, costs=costs)

    # --------------------------------------------------------------- report
    def state(self) -> dict[str, float | int | None]:
        """Controller state and counters, for the run's result row."""
        return {
            "mu_accept": self.mu_accept,
            "mu_reject": self.mu_reject,
            "accept_rate_ema": self.accept_rate,
            "gamma": self.gamma,
            **self.costs.state(),
            "num_skipped": self.num_skipped,
            "num_steps": self.num_steps,
            "num_decisions": self.num_decisions,
            "overhead_s": self._overhead_s,
        }

    def __repr__(self) -> str:
        return (f"EntropyAdaptive(candidates={self.candidates}, ema={self.ema}, mu_accept={self.mu_accept:.3f}, "
                f"mu_reject={self.mu_reject:.3f}, gamma={self.gamma:.3f})")


POLICIES: Registry = Registry("draft-length policy")
POLICIES.register("fixed")(FixedK)
POLICIES.register("entropy")(EntropyAdaptive)


def policy_for(spec, costs: StepCosts | None = None):
    """A fresh per-row policy for ``spec``: ``"entropy"`` for ``k="auto"``, else ``"fixed"``
    (``spec`` None: the null drafter's ``FixedK(0)``)."""
    if spec is None:
        return FixedK(0)
    return POLICIES.get("entropy" if spec.k == "auto" else "fixed").from_spec(spec, costs)


def roc_auc(scores: Sequence[float], labels: Sequence[Any]) -> float | None:
    """ROC AUC of ``scores`` for binary ``labels`` (1/True = positive), via Mann-Whitney U with
    average ranks for ties: ``AUC = (R_pos - n_pos (n_pos + 1) / 2) / (n_pos n_neg)``.
    ``None`` when either class is missing."""
    s = np.asarray([_to_float(x) for x in scores], dtype=np.float64)
    y = np.asarray([_to_float(x) for x in labels], dtype=np.float64)
    if s.shape != y.shape:
        raise ValueError(f"scores and labels differ in length: {s.shape[0]} vs {y.shape[0]}")
    if not np.all((y == 0.0) | (y == 1.0)):
        raise ValueError("labels must be binary (0/1 or bool)")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores must be finite")
    pos = y == 1.0
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    first_rank = np.cumsum(counts) - counts + 1  # 1-based rank of each tie group's first member
    ranks = (first_rank + (counts - 1) / 2.0)[inverse]  # average rank within the tie group
    u = ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


# --------------------------------------------------------------------------- cost-aware batch controller
def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares ``X c ~ y`` with ``c >= 0`` (a small active-set loop: columns whose
    coefficient comes out negative are dropped and the rest refitted; at most ``n`` rounds).
    Columns are rescaled to unit max for conditioning."""
    n = X.shape[1]
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale
    active = np.ones(n, dtype=bool)
    coef = np.zeros(n)
    for _ in range(n):
        if not active.any():
            break
        sol, *_ = np.linalg.lstsq(Xs[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        idx = np.flatnonzero(active)
        active[idx[sol < 0]] = False
    return coef / scale


class VerifyCostModel:
    """Seconds of one dense forward of ``w`` tokens per row for ``B`` rows over ``S`` cached
    positions (an AR step is ``w = 1``, a verify of k drafts ``w = k + 1``), fitted to
    measurements with the roofline's terms as features::

        C_v(B, w, S) = c0 + c1 * B w + c2 * B w S + c3 * B S

    (fixed cost: dispatch and the weights read once; per token: the linear FLOPs; per token and
    key: the attention FLOPs; per row and key: the KV read), non-negative least squares of the
    relative error over the calibration points (kept) and the last ``history`` observations. Until ``min_points``
    distinct points exist, ``predict`` returns None. The fit is redone when a calibration point
    arrives, while there is none, when the median relative error of the last ``refit_every``
    new observations against the fit exceeds ``refit_tol`` (the costs moved: a host that slows down by a
    third moves every point; one slow round, a spike, does not), and after ``history`` new
    observations in any case. (A round observes one. Refitting each time cost 0.6 ms of a 26 ms
    step at batch 1 x 1K; every 8 rounds, 0.4 ms a fit on a cache a forward has just flushed:
    0.4 % of every 12 ms declined step at batch 1 x 4K, while those rounds' points, all at
    width 1 and one position apart, moved no prediction.)
    """

    def __init__(self, history: int = 64, min_points: int = 3, refit_every: int = 8, refit_tol: float = 0.05):
        """Raises ValueError: ``history``, ``min_points`` or ``refit_every`` not an integer >= 1, or
        ``refit_tol`` not a finite number >= 0."""

        for name, v in (("history", history), ("min_points", min_points), ("refit_every", refit_every)):
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not (isinstance(refit_tol, (int, float)) and math.isfinite(refit_tol) and refit_tol >= 0.0):
            raise ValueError(f"refit_tol must be a finite number >= 0, got {refit_tol!r}")

        self.calibration: list[tuple[float, float, float, float]] = []  # (B, w, S, seconds)
        self.recent = deque(maxlen=history)
        self.min_points = min_points
        self.refit_every = int(refit_every)
        self.refit_tol = float(refit_tol)
        self._errors: list[float] = []  # relative errors of the observations since the last fit
        # (the last refit_every decide; the list is emptied at every fit, at most history long)
        self.coef: np.ndarray | None = None
        self._coef_floats: tuple[float, float, float, float] | None = None
        self._dirty = False
        self._new = 0  # observations since the last fit

    @staticmethod
    def features(B: float, w: float, S: float) -> list[float]:
        return [1.0, B * w, B * w * S, B * S]

    def observe(self, B: int, w: int, S: float, seconds: float, calibration: bool = False) -> None:
        """One measured forward; non-finite or non-positive seconds are ignored."""
        seconds = _to_float(seconds)
        if not (math.isfinite(seconds) and seconds > 0.0):
            return
        (self.calibration if calibration else self.recent).append((float(B), float(w), float(S), seconds))
        self._new += 1
        c = self._coef_floats
        if c is not None:
            self._errors.append((c[0] + c[1] * B * w + c[2] * B * w * S + c[3] * B * S) / seconds - 1.0)
        if (calibration or self.coef is None or self._new >= self.recent.maxlen
                or (self._new >= self.refit_every and abs(statistics.median(self._errors[-self.refit_every:])) > self.refit_tol)):
            self._dirty = True

    def _fit(self) -> None:
        pts = self.calibration + list(self.recent)
        if len({p[:3] for p in pts}) < self.min_points:
            self.coef = None
        else:
            X = np.array([self.features(*p[:3]) for p in pts])
            y = np.array([p[3] for p in pts])
            self.coef = _nnls(X / y[:, None], np.ones_like(y))  # relative errors: the short steps count as much as the long
        self._coef_floats = None if self.coef is None else tuple(float(c) for c in self.coef)
        self._dirty = False
        self._errors = []
        self._new = 0

    def coefficients(self) -> tuple[float, float, float, float] | None:
        """``(c0, c1, c2, c3)`` as plain floats (refitted first if due), or None."""
        if self._dirty:
            self._fit()
        return self._coef_floats

    def predict(self, B: float, w: float, S: float) -> float | None:
        if self._dirty:
            self._fit()
        if self.coef is None:
            return None
        return float(np.dot(self.coef, self.features(B, w, S)))

    def predict_many(self, B: float, w: Any, S: Any) -> np.ndarray | None:
        """``predict`` over arrays of widths and contexts (broadcast together)."""
        if self._dirty:
            self._fit()
        if self.coef is None:
            return None
        w, S = np.asarray(w, dtype=float), np.asarray(S, dtype=float)
        return sum(c * f for c, f in zip(self.coef, self.features(B, w, S))) + np.zeros(np.broadcast(w, S).shape)

    def state(self) -> dict[str, Any]:
        if self._dirty or self._new:
            self._fit()
        return {"verify_cost_coef": None if self.coef is None else [float(c) for c in self.coef],
                "verify_cost_points": len(self.calibration) + len(self.recent)}


class RowAcceptance:
    """A row's policy under ``CostAwareController``: no decision of its own (``adaptive`` False:
    the draft loop never syncs for it), only the row's acceptance rate ``alpha`` learned from
    verification: every token of the accepted leading run is a 1, the first rejection a 0, later
    tokens have no label; a running mean over the first ``1 / ema`` labels, an EMA after.

    ``reach`` is the longest draft the row's own evidence supports (the controller caps the row
    there): twice the last round's accepted run plus one after a rejection, doubling after a round
    accepted whole. A row starts at ``reach`` (default ``max_k``: no cap) and ramps 2, 4, 8, ...
    while it keeps being accepted, so a few rows of unknown acceptance never pay for 16 drafts
    on a one-label estimate, and a rejection brings the reach back at once."""

    adaptive = False

    def __init__(self, max_k: int, ema: float = 0.05, reach: int | None = None):
        self.max_k = int(max_k)
        self.ema = float(ema)
        self.reach = self.max_k if reach is None else max(1, min(int(reach), self.max_k))
        self.alpha: float | None = None
        self.num_labels = 0
        self._step_max = self.max_k
        self.num_steps = 0
        self._overhead_s = 0.0

    def start_step(self, budget: int) -> int:
        self._step_max = max(0, min(self.max_k, int(budget)))
        self.num_steps += 1
        return self._step_max

    def should_continue(self, entropies: Sequence[float]) -> bool:
        return len(entropies) < self._step_max

    def update(self, entropies: Sequence[Any], num_accepted: int) -> None:
        t0 = time.perf_counter()
        m = len(entropies)
        if not _is_int(num_accepted) or not 0 <= num_accepted <= m:
            raise ValueError(f"num_accepted must be an integer in [0, {m}], got {num_accepted!r}")
        labels = [1.0] * num_accepted + ([0.0] if num_accepted < m else [])
        if m:
            ramp = 2 * m if num_accepted == m else 2 * (num_accepted + 1)
            self.reach = min(self.max_k, max(self.reach, ramp) if num_accepted == m else ramp)
        for y in labels:
            self.num_labels += 1
            w = max(self.ema, 1.0 / self.num_labels)
            self.alpha = y if self.alpha is None else self.alpha + w * (y - self.alpha)
        self._overhead_s += time.perf_counter() - t0

    def observe_costs(self, *args, **kwargs) -> None:
        pass

    @property
    def overhead_s(self) -> float:
        return self._overhead_s

    def __repr__(self) -> str:
        return f"RowAcceptance(alpha={self.alpha}, labels={self.num_labels})"


def expected_tokens_geometric(alpha: float, k: int) -> float:
    """Tokens a round drafting ``k`` emits when each draft passes with probability ``alpha``
    given the earlier ones passed: ``sum_{i=0..k} alpha^i`` (accepted run + the bonus/recovered token)."""
    a = min(max(float(alpha), 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class CostAwareController:
    """Chooses, once per step and before drafting, every row's draft length for the whole batch
    (``k = 0`` included: plain decoding where speculation does not pay), from measured costs.

    The rows of a batch draft together (every draft forward runs all of them) and are verified
    together (the verify pads every row to the longest draft), so a step drafting ``k`` costs

        T(k) = k * C_d(B, N) + C_v(B, k + 1, S) + C_o

    and emits ``sum_b E(alpha_b, min(k, limit_b))`` tokens (``expected_tokens_geometric``). The
    controller takes ``k* = argmax_k sum_b E_b(k) / T(k)`` over ``1..max_k`` (ties: the shorter),
    declines (``k* = 0``) unless that rate beats not drafting by more than ``margin`` (``_argmax``;
    "pays" below means by that margin), and gives row b ``min(k*, limit_b)``. ``C_v`` is
    ``VerifyCostModel`` (calibrated at load by
    the engine with a few timed forwards, refitted on every measured round), ``C_d`` is
    ``draft_ratio * C_v(B, 1, N)`` (a draft forward as a fraction of a dense forward over the N
    keys it reads; the drafter's prior until measured, then an EMA of measured ratios), ``C_o``
    an EMA of the measured rest of the round. A row's alpha is its measured one shrunk towards
    the batch's (``alphas``); a row with fewer than ``explore_labels`` acceptance labels makes the
    step draft at least ``explore_k`` (``exploring``; ``probe_k`` until a draft forward has been
    timed): one round's one or two labels per row do
    not decide a request's whole decode (a declined round measures no acceptance, so a low first
    estimate would stick), unless the step is ``hopeless``: not even the rows'
    ``optimistic_alphas`` (the upper 90 % bound of what each row's labels and the prior allow) would pay at the
    measured costs, so the rows' own labels already say the exploring rounds lose (batch 1 at 1K-4K on a CPU, where a
    k = 2 round costs about 2.7 AR steps); no row drafts past its ``RowAcceptance.reach`` (the geometric
    model is not trusted beyond twice the run the row was last seen to accept). Every ``probe_every``-th consecutive
    ``k = 0`` step drafts ``probe_k`` tokens, so acceptance keeps being measured, unless the step
    is ``futile``: with the draft cost measured, not even alpha = 1 would pay (then it neither
    probes nor explores: no acceptance could change the decision).
    The only host work is this arithmetic, once per step (no sync inside the draft loop).
    """

    def __init__(self, max_k: int, draft_ratio: float = 1.0, ema: float = 0.2, prior_alpha: float = 0.6,
                 prior_weight: float = 1.0, probe_every: int = 8, probe_k: int = 1, explore_k: int = 2,
                 explore_labels: int = 6, margin: float = 0.05):
        if not _is_int(max_k) or max_k < 1:
            raise ValueError(f"max_k must be an integer >= 1, got {max_k!r}")
        for name, v in (("draft_ratio", draft_ratio), ("ema", ema), ("prior_alpha", prior_alpha),
                        ("prior_weight", prior_weight)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not 0.0 < ema <= 1.0 or not prior_alpha <= 1.0:
            raise ValueError("ema must be in (0, 1] and prior_alpha in [0, 1]")
        if not _is_int(probe_every) or probe_every < 1 or not _is_int(probe_k) or probe_k < 1:
            raise ValueError("probe_every and probe_k must be integers >= 1")
        self.max_k = int(max_k)
        self.verify_cost = VerifyCostModel()
        self.draft_ratio = float(draft_ratio)
        self.draft_measured = False
        self.other_s: float | None = None
        self.ema = float(ema)
        self.prior_alpha = float(prior_alpha)
        self.prior_weight = float(prior_weight)
        self.learned_prior: float | None = None  # mean alpha measured by earlier cores (``load``)
        self._alpha_sum, self._alpha_n = 0.0, 0.0  # finished rows' votes: sum of shrunk alphas, count
        self._probe_interval = int(probe_every)
        self.probe_every, self.probe_k = int(probe_every), int(probe_k)
        if not _is_int(explore_k) or explore_k < 1:
            raise ValueError(f"explore_k must be an integer >= 1, got {explore_k!r}")
        self.explore_k = int(explore_k)
        if not _is_int(explore_labels) or explore_labels < 1:
            raise ValueError(f"explore_labels must be an integer >= 1, got {explore_labels!r}")
        self.explore_labels = int(explore_labels)
        if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 0.0):
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        self.margin = float(margin)
        self._zero_run = 0
        # output lengths (tokens) of the requests finished lately: how long a request of a given
        # age may still run (``residual``); carried to later cores like the alpha (``export``)
        self.finished_lengths: deque[int] = deque(maxlen=64)
        self.num_steps = 0
        self.num_skipped = 0  # steps that chose k = 0
        self.k_hist: dict[int, int] = {}
        self._overhead_s = 0.0

    def policy(self) -> RowAcceptance:
        """A new row's policy object (its ``reach`` starts at ``explore_k``)."""
        return RowAcceptance(self.max_k, reach=self.explore_k)

    # ------------------------------------------------------------------ costs
    def step_cost(self, k: int, B: int, S: float, N: float) -> float | None:
        """``T(k)`` in seconds (None until the verify cost model has enough points)."""
        v = self.verify_cost.predict(B, k + 1, S)
        if v is None:
            return None
        d = 0.0
        if k:
            d1 = self.verify_cost.predict(B, 1, N + k / 2)
            d = k * self.draft_ratio * (d1 or 0.0)
        return d + v + (self.other_s or 0.0)

    def observe_round(self, B: int, S: float, N: float, k: int, draft_s: float, verify_s: float,
                      other_s: float | None) -> None:
        """One measured round: ``k`` draft forwards over ``draft_s`` seconds, the verify of
        ``k + 1`` tokens per row in ``verify_s``, the rest in ``other_s``."""
        t0 = time.perf_counter()
        self.verify_cost.observe(B, k + 1, S, verify_s)
        if k and draft_s > 0:
            d1 = self.verify_cost.predict(B, 1, N + k / 2)
            if d1:
                r = (draft_s / k) / d1
                self.draft_ratio = r if not self.draft_measured else self.draft_ratio + self.ema * (r - self.draft_ratio)
                self.draft_measured = True
        if other_s is not None and math.isfinite(other_s) and other_s >= 0:
            self.other_s = other_s if self.other_s is None else self.other_s + self.ema * (other_s - self.other_s)
        self._overhead_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ the decision
    def alphas(self, policies: Sequence[RowAcceptance]) -> list[float]:
        """Each row's alpha, shrunk towards a prior by ``prior_weight`` pseudo-labels:
        ``(n alpha_b + m prior) / (n + m)`` with ``n`` the row's labels (at most ``1 / ema``, the
        EMA's memory) and ``prior`` the mean alpha of the batch's other rows that have labels,
        else the alpha earlier cores measured (``learned_prior``), else ``prior_alpha``."""
        base = self.prior_alpha if self.learned_prior is None else self.learned_prior
        measured = [(i, p.alpha) for i, p in enumerate(policies) if p.alpha is not None and p.num_labels > 0]
        m = self.prior_weight
        out = []
        for i, p in enumerate(policies):
            others = [a for j, a in measured if j != i]  # a row is not its own prior
            prior = sum(others) / len(others) if others else base
            n = 0.0 if p.alpha is None else min(float(p.num_labels), 1.0 / p.ema)
            out.append((n * (p.alpha or 0.0) + m * prior) / (n + m) if n + m > 0 else prior)
        return out

    def exploring(self, policies: Sequence[RowAcceptance]) -> bool:
        """True while some row has fewer than ``explore_labels`` acceptance labels and the prior
        is not a measured one (``learned_prior``): the step then drafts at least ``explore_k``
        tokens (a request's first few decode steps), so alpha is measured before the prior, or
        one round's one or two labels, decide for it. Measured on ``make demo``'s batch 4 x 6K
        cell (SmolLM2, 2 CPU cores): after one exploring round of two labels per row the rows'
        alphas read 0.42-0.83 against the 0.92 the run accepted at fixed k, the later rounds
        declined but for one-token probes (a declined round measures no acceptance) and ``k="auto"`` ran 0.96x ``ar`` where k = 2 ran
        1.06x."""
        return self.learned_prior is None and any(p.num_labels < self.explore_labels for p in policies)

    def export(self) -> dict[str, Any]:
        """What a later core of the same engine and method may start from (``load``): the
        measured draft ratio and round overhead, the recent verify timings and the alpha of the
        requests seen (None if none had a label): one vote per finished row, its own alpha shrunk
        towards ``prior_alpha`` by ``prior_weight`` pseudo-labels as ``alphas`` shrinks a row
        (``row_finished``), and the votes' mean shrunk towards ``prior_alpha`` by ``prior_weight``
        pseudo-requests. The next request is a new draw: acceptance varies between prompts far more
        than a row's labels pin its own (SmolLM2 at batch 1 x 4K, RULER niah_single_2: 1.0, 0.5
        and 1.0 on three prompts; ``make demo``'s niah_single_1-3: 1.0, 0.67, 0.0), so many labels
        of one row do not make its alpha the next request's. Pooled by labels, after a niah row
        that accepted its 20 remembered drafts the learned alpha read 0.98, and the next prompt
        drafted 2 at its first step, where a round drafting 2 pays only above alpha ~0.9 (2.7 AR
        steps), accepted 1 and ran 0.91x ``ar`` (per request it would have read 0.82: declined).
        Unshrunk, one SmolLM2 row at 1K that accepted its 7 drafts handed on 1.0, and the next
        core drafted up to k = 8 where drafting loses (0.92x ar)."""
        m = self.prior_weight
        seen = ((self._alpha_sum + m * self.prior_alpha) / (self._alpha_n + m) if self._alpha_n
                else self.learned_prior)
        return {"draft_ratio": self.draft_ratio if self.draft_measured else None, "other_s": self.other_s,
                "recent": list(self.verify_cost.recent), "alpha": seen, "lengths": list(self.finished_lengths)}

    def load(self, state: Mapping[str, Any]) -> None:
        """Start from ``export()`` of an earlier core (measurements, not constants)."""
        if state.get("draft_ratio") is not None:
            self.draft_ratio, self.draft_measured = float(state["draft_ratio"]), True
        if state.get("other_s") is not None:
            self.other_s = float(state["other_s"])
        for pt in state.get("recent") or ():
            self.verify_cost.observe(*pt)
        if state.get("alpha") is not None:
            self.learned_prior = float(state["alpha"])
        self.finished_lengths.extend(int(n) for n in state.get("lengths") or ())

    def row_finished(self, policy: RowAcceptance, num_tokens: int | None = None) -> None:
        """Fold a finished row into what ``export`` hands on: its output length (``num_tokens``,
        if given; ``residual``) and its vote for the alpha: its alpha over its labels (at most
        ``1 / ema``, its EMA's memory) shrunk towards ``prior_alpha`` by ``prior_weight``
        pseudo-labels. A row without labels (it never drafted) has no vote."""
        if num_tokens is not None:
            self.finished_lengths.append(int(num_tokens))
        if policy.alpha is not None and policy.num_labels:
            n, m = min(float(policy.num_labels), 1.0 / policy.ema), self.prior_weight
            self._alpha_sum += (n * policy.alpha + m * self.prior_alpha) / (n + m)
            self._alpha_n += 1.0

    def step_costs(self, k_cap: int, B: int, S: float, N: float) -> list[float] | None:
        """``step_cost(k)`` for k = 0 .. ``k_cap`` at once, seconds (None until the verify cost
        model has enough points). Plain floats: this runs before every step, after a forward has
        flushed the caches, where each numpy call costs microseconds (the controller's share of a
        declined batch-1 step was 0.2-0.3 ms of 12.5 with numpy here)."""
        coef = self.verify_cost.coefficients()
        if coef is None:
            return None
        c0, c1, c2, c3 = coef
        other = self.other_s or 0.0
        r = self.draft_ratio
        out = []
        for k in range(max(0, k_cap) + 1):
            verify = c0 + B * (k + 1) * (c1 + c2 * S) + c3 * B * S  # C_v(B, k + 1, S)
            d1 = c0 + B * c1 + (c2 + c3) * B * (N + k / 2)  # C_v(B, 1, N + k / 2)
            out.append(k * r * d1 + verify + other)
        return out

    @staticmethod
    def _tokens(alphas: Sequence[float], limits: Sequence[int], k_cap: int) -> list[float]:
        """``sum_b E(alpha_b, min(k, limit_b))`` for k = 0 .. ``k_cap`` (expected_tokens_geometric,
        as running sums: E(a, k) = E(a, k - 1) + a^k)."""
        k_cap = max(0, k_cap)
        tokens = [0.0] * (k_cap + 1)
        for a, lim in zip(alphas, limits):
            a = min(max(float(a), 0.0), 1.0)
            e, term = 0.0, 1.0
            for k in range(k_cap + 1):
                if k <= lim:
                    e += term
                    term *= a
                tokens[k] += e
        return tokens

    def _argmax(self, rates: Sequence[float]) -> tuple[int, float]:
        """The drafting k (>= 1) whose rate beats every shorter one's by more than rounding (ties:
        the shorter), if it beats not drafting (``rates[0]``) by more than ``margin``; else 0.

        The margin is the cost model's own tolerance (``VerifyCostModel``'s ``refit_tol``, 5 %):
        within it the model cannot tell the two apart, and the alphas that decide are estimates
        taken after the rounds that were accepted (a row drafts after a run of accepted probes,
        and regresses towards its mean). Measured at batch 1 x 4K on SmolLM2 (AMD EPYC, 2
        threads): a round drafting 1 cost 1.9 AR steps (predicted 1.89-1.96), so it pays only
        above alpha 0.9; fixed k = 1 at alpha 0.96 ran 1.03x ``ar`` and ``k="auto"``, drafting at
        estimates around the break-even, 0.976-0.977x."""
        best_k, best_rate = 0, float(rates[0])
        for k in range(1, len(rates)):
            if rates[k] > best_rate * (1.0 + 1e-9):
                best_k, best_rate = k, float(rates[k])
        if best_k and not best_rate > float(rates[0]) * (1.0 + self.margin):
            return 0, float(rates[0])
        return best_k, best_rate

    def _rate_list(self, alphas: Sequence[float], limits: Sequence[int], B: int, S: float, N: float,
                   costs: Sequence[float] | None = None) -> list[float] | None:
        k_cap = max(0, min(self.max_k, max(limits, default=0)))
        cost = self.step_costs(k_cap, B, S, N) if costs is None else costs[: k_cap + 1]
        if cost is None:
            return None
        return [t / c for t, c in zip(self._tokens(alphas, limits, k_cap), cost)]

    def rates(self, alphas: Sequence[float], limits: Sequence[int], B: int, S: float, N: float,
              costs: Sequence[float] | None = None) -> np.ndarray | None:
        """Predicted tokens per second of the step at k = 0 .. ``min(max_k, max(limits))``:
        ``sum_b E(alpha_b, min(k, limit_b)) / step_cost(k)`` for every k at once (None until the
        verify cost model has enough points). ``costs``: ``step_costs`` already computed for at
        least these k (one step asks at several alphas)."""
        out = self._rate_list(alphas, limits, B, S, N, costs)
        return None if out is None else np.asarray(out)

    def best_k(self, alphas: Sequence[float], limits: Sequence[int], B: int, S: float, N: float,
               costs: Sequence[float] | None = None) -> tuple[int, float | None]:
        """``(k*, predicted tokens/s)``: the argmax of ``rates`` (ties: the shorter k); the most any
        row may draft (``max(limits)``) capped at ``min(max_k, 2)`` when costs are unknown (the
        first rounds measure them)."""
        k_cap = min(self.max_k, max(limits, default=0))
        if k_cap <= 0:
            return 0, None
        rates = self._rate_list(alphas, limits, B, S, N, costs)
        if rates is None:
            return min(k_cap, 2), None  # nothing measured yet: a short draft measures every cost
        return self._argmax(rates)

    def futile(self, limits: Sequence[int], B: int, S: float, N: float, costs: Sequence[float] | None = None) -> bool:
        """True when drafting cannot pay at this step's costs even if every draft were accepted
        (``best_k`` at alpha = 1 is 0), with the draft cost measured (``draft_measured``: a prior
        alone never rules drafting out, or a pessimistic prior would never be corrected)."""
        if not self.draft_measured or max(limits, default=0) <= 0:
            return False
        return self.best_k([1.0] * len(limits), limits, B, S, N, costs)[0] == 0

    #: one-sided 90 % normal quantile of ``optimistic_alphas``' Wilson bound
    OPTIMISM_Z = 1.2816

    @staticmethod
    def _wilson_upper(a: float, n: float) -> float:
        """The one-sided 90 % Wilson score upper bound of a rate ``a`` over ``n`` > 0 labels."""
        z2 = CostAwareController.OPTIMISM_Z ** 2
        a = min(max(float(a), 0.0), 1.0)
        half = CostAwareController.OPTIMISM_Z * math.sqrt(a * (1.0 - a) / n + z2 / (4.0 * n * n))
        return min(1.0, (a + z2 / (2.0 * n) + half) / (1.0 + z2 / n))

    def optimistic_alphas(self, policies: Sequence[RowAcceptance]) -> list[float]:
        """Each row's acceptance at the upper end of what its labels and the prior allow: the
        one-sided 90 % Wilson score bound over its ``n`` labels (at most ``1 / ema``, the EMA's
        memory) and ``prior_weight`` pseudo-labels at the prior (the learned one, else
        ``prior_alpha``), as ``alphas`` shrinks a row. With the defaults (0.6, one pseudo-label):
        no label 0.929; one accepted draft 0.965 (its own label alone: 1.0), one of two 0.819,
        two of two 0.977, 12 of 20 0.725. Exploring stops when not even these alphas would pay."""
        base = self.prior_alpha if self.learned_prior is None else self.learned_prior
        m = self.prior_weight
        out = []
        for p in policies:
            n = 0.0 if p.alpha is None else min(float(p.num_labels), 1.0 / p.ema)
            if n + m <= 0.0:
                out.append(1.0)
                continue
            out.append(self._wilson_upper((n * float(p.alpha or 0.0) + m * base) / (n + m), n + m))
        return out

    def hopeless(self, policies: Sequence[RowAcceptance], limits: Sequence[int], B: int, S: float, N: float,
                 costs: Sequence[float] | None = None) -> bool:
        """True when, with the draft cost measured, drafting would not pay even at every row's
        ``optimistic_alphas``: more exploring rounds would cost rounds that the rows' labels (and
        the prior) already say lose. At batch 1 on a CPU a round drafting 2 costs 2.5-2.9 AR steps
        and pays only above alpha ~0.9: a cold start that explored 2 drafts a round from the
        prior ran 0.84x and 0.93x ``ar`` on ``make demo``'s first LongBench prompt of a context
        bucket. (A draft cost that is only a prior decides nothing: the first exploring round
        measures it, ``plan``.)"""
        if not self.draft_measured or max(limits, default=0) <= 0:
            return False
        return self.best_k(self.optimistic_alphas(policies), limits, B, S, N, costs)[0] == 0

    def residual(self, generated: int) -> float:
        """How many more tokens a request that has emitted ``generated`` may be expected to emit:
        the median of ``n - generated`` over the finished requests (``finished_lengths``) that
        ran longer than it, or infinity where none did (no evidence that it is about to end)."""
        left = sorted(n - generated for n in self.finished_lengths if n > generated)
        if not left:
            return math.inf
        mid = len(left) // 2
        return float(left[mid]) if len(left) % 2 else (left[mid - 1] + left[mid]) / 2.0

    def plan(self, policies: Sequence[RowAcceptance], limits: Sequence[int], lengths: Sequence[int],
             index_sizes: Sequence[int], remaining: Sequence[int] | None = None,
             generated: Sequence[int] | None = None) -> list[int]:
        """Each row's draft length for this step (``<= limits[b]``). ``remaining``: the most tokens
        each row may still emit after this step (None: unknown); ``generated``: the tokens each
        has emitted (None: unknown). A probe is skipped when no row may be expected to run as
        many more tokens as the declined rounds it waited: what it could find would be used for
        fewer rounds than it took to look. A row's expectation is its ``remaining`` budget,
        capped by its ``residual`` life among the requests finished before it: the last of a
        64-token request's three probes at batch 1 (each ~2 AR steps), and the probe after 8
        declined rounds of RULER niah answers at 4K, which end after 9 or 10 tokens (``make
        demo``: the probe on the last step of a 9-token answer, its draft forward wasted, ran
        0.86-0.87x ``ar``), looked too late to matter."""
        t0 = time.perf_counter()
        budgets = [int(lim) for lim in limits]
        limits = [min(lim, p.reach) for p, lim in zip(policies, budgets)]  # what each row's evidence supports
        B = len(limits)
        S = sum(lengths) / max(1, B)
        N = sum(index_sizes) / max(1, B) if index_sizes else S
        costs = self.step_costs(min(self.max_k, max(budgets, default=0)), B, S, N)  # once per step
        k, _ = self.best_k(self.alphas(policies), limits, B, S, N, costs)
        # where not even alpha = 1 would pay at the measured costs, acceptance decides nothing:
        # no exploring, no probing (each costs a round for evidence that cannot change k = 0)
        futile = k == 0 and self.futile(budgets, B, S, N, costs)  # reach aside: the draft it may grow to
        explore = min(self.explore_k, max(limits, default=0))
        if (k < explore and not futile and self.exploring(policies)
                and not self.hopeless(policies, budgets, B, S, N, costs)):
            # until a draft forward is timed, explore at a probe's size: it measures the draft
            # cost (then ``hopeless`` can judge) at a probe's price
            k = explore if self.draft_measured else min(explore, self.probe_k)
        if futile:
            self.num_skipped += 1
        elif k == 0 and max(limits, default=0) > 0:
            self._zero_run += 1
            if self._zero_run >= self._probe_interval and self._worth_probing(remaining, generated):
                self._zero_run, k = 0, min(self.probe_k, max(limits))
                self._probe_interval = min(8 * self.probe_every, 2 * self._probe_interval)  # back off
            else:
                self.num_skipped += 1
        elif k > 0:
            self._zero_run, self._probe_interval = 0, self.probe_every
        self.num_steps += 1
        self.k_hist[k] = self.k_hist.get(k, 0) + 1
        self._overhead_s += time.perf_counter() - t0
        return [min(k, lim) for lim in limits]

    def _worth_probing(self, remaining: Sequence[int] | None, generated: Sequence[int] | None) -> bool:
        """Some row may be expected to run at least the declined rounds the probe waited
        (``plan``): its budget, capped by its ``residual`` life when ``generated`` is known."""
        if remaining is None and generated is None:
            return True  # nothing known: probe
        for b in range(len(remaining) if remaining is not None else len(generated)):
            left = math.inf if remaining is None else remaining[b]
            if generated is not None:
                left = min(left, self.residual(generated[b]))
            if left >= self._probe_interval:
                return True
        return False

    @property
    def overhead_s(self) -> float:
        return self._overhead_s

    def state(self) -> dict[str, Any]:
        return {"controller": "cost", "draft_ratio": self.draft_ratio, "cost_other_s": self.other_s,
                "num_steps": self.num_steps, "num_skipped": self.num_skipped,
                "k_hist": {str(k): n for k, n in sorted(self.k_hist.items())}, "overhead_s": self._overhead_s,
                **self.verify_cost.state()}


#: ``SpecOptions.controller`` values: how ``k="auto"`` chooses the draft length
CONTROLLERS = ("cost", "entropy")
