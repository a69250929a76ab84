"""Draft-length policies (sparsespec.adaptive): FixedK, EntropyAdaptive, roc_auc."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from sparsespec.adaptive import DraftLengthPolicy, EntropyAdaptive, FixedK, roc_auc

CANDS = (1, 2, 3, 4, 6, 8, 12, 16)


def draft_step(policy, entropy_of, num_accepted_of, budget=1000):
    """Drive one engine step the way the engine does; returns (k drafted, entropies)."""
    k_max = policy.start_step(budget)
    ents: list[float] = []
    while len(ents) < k_max:
        ents.append(entropy_of(len(ents)))
        if not policy.should_continue(ents):
            break
    policy.update(ents, num_accepted_of(ents))
    return len(ents), ents


def brute_E(ps, k, gamma):
    """E(k) written out directly: (1 + sum_{m<=k} prod_{i<=m} p_i) / (k*gamma + 1)."""
    return (1 + sum(math.prod(ps[:m]) for m in range(1, k + 1))) / (k * gamma + 1)


class AsProb(EntropyAdaptive):
    """Treats the 'entropy' fed to it as the acceptance probability itself, to test the rule alone."""

    def accept_prob(self, h):
        return float(h)


# ------------------------------------------------------------------------------------ FixedK
def test_fixed_k_stops_exactly_at_k_and_honours_budget():
    pol = FixedK(4)
    assert isinstance(pol, DraftLengthPolicy) and pol.max_k == 4
    # entropy is ignored: even very uncertain drafts continue until k
    assert draft_step(pol, lambda i: 9.0, lambda e: 0)[0] == 4
    assert draft_step(pol, lambda i: 0.0, lambda e: len(e))[0] == 4
    assert [pol.should_continue([0.1] * m) for m in range(1, 6)] == [True, True, True, False, False]
    assert pol.start_step(2) == 2
    assert [pol.should_continue([0.1] * m) for m in (1, 2)] == [True, False]
    assert draft_step(pol, lambda i: 0.0, lambda e: len(e), budget=3)[0] == 3
    assert pol.start_step(0) == 0 and pol.start_step(-5) == 0
    assert pol.start_step(100) == 4  # the budget cap does not stick to later steps
    pol.update([0.1, 0.2], 1)
    pol.observe_costs(1.0, 1.0)  # null object: no effect, no error
    assert pol.overhead_s == 0.0


@pytest.mark.parametrize("k", [-1, 2.5, True, "4"])
def test_fixed_k_validation(k):
    with pytest.raises(ValueError, match="k"):
        FixedK(k)


# --------------------------------------------------------------------------- classifier
def test_accept_prob_formula_and_degenerate_cases():
    pol = EntropyAdaptive(init_accept_entropy=0.5, init_reject_entropy=2.5, sharpness=3.0)
    sig = lambda z: 1 / (1 + math.exp(-z))
    for h in (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 7.0):
        d_a, d_r, s2 = (h - 0.5) ** 2, (h - 2.5) ** 2, 2.0**2
        soft = math.exp(-3 * d_a / s2) / (math.exp(-3 * d_a / s2) + math.exp(-3 * d_r / s2))
        assert pol.accept_prob(h) == pytest.approx(soft, rel=1e-12)
        assert pol.accept_prob(h) == pytest.approx(sig(2 * 3.0 * (1.5 - h) / 2.0), rel=1e-12)
    assert pol.accept_prob(0.5) == pytest.approx(sig(3.0)) and pol.accept_prob(1.5) == pytest.approx(0.5)
    ps = [pol.accept_prob(h) for h in np.linspace(0, 5, 21)]
    assert all(a > b for a, b in zip(ps, ps[1:]))  # monotone: higher entropy, lower p
    assert pol.accept_prob(1e6) == 0.0 and pol.accept_prob(float("inf")) == 0.0  # no overflow
    # equal centroids carry no information: fall back to the running acceptance rate
    flat = EntropyAdaptive(init_accept_entropy=1.0, init_reject_entropy=1.0)
    assert flat.accept_prob(0.0) == flat.accept_prob(5.0) == flat.accept_rate == 0.5
    flat.update([1.0, 1.0, 1.0], 3)
    assert flat.accept_prob(3.0) == pytest.approx(flat.accept_rate) and flat.accept_rate > 0.5
    assert pol.accept_prob(float("nan")) == pol.accept_rate
    # 0-d tensors are accepted everywhere
    assert pol.accept_prob(torch.tensor(0.7)) == pytest.approx(pol.accept_prob(0.7), rel=1e-6)


# ------------------------------------------------------------------ objective / best_k
def test_objective_matches_formula_by_hand():
    pol = EntropyAdaptive(init_cost_ratio=0.3)
    assert pol.gamma == pytest.approx(0.3)
    assert pol.expected_tokens([0.5, 0.5]) == pytest.approx(1.75)
    assert pol.objective([0.5, 0.5], 2) == pytest.approx(1.75 / 1.6)
    assert pol.objective([0.5, 0.5], 0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        pol.objective([0.5], 2)


@pytest.mark.parametrize("gamma", [0.01, 0.05, 0.1, 0.3, 0.6, 1.0])
def test_best_k_is_the_brute_force_argmax(gamma):
    rng = np.random.default_rng(int(gamma * 1000))
    pol = EntropyAdaptive(candidates=CANDS, init_cost_ratio=gamma)
    lists = [[0.95, 0.9, 0.85, 0.6, 0.5, 0.9, 0.9, 0.9, 0.3, 0.99, 0.99, 0.99, 0.99, 0.9, 0.9, 0.9]]
    lists += [list(1 - rng.random(16) ** 3) for _ in range(200)]  # mostly high p
    lists += [[p] * 16 for p in (0.2, 0.5, 0.8, 0.9, 0.97, 1.0)]
    for ps in lists:
        want = max(CANDS, key=lambda k: (brute_E(ps, k, gamma), -k))
        assert pol.best_k(ps) == want
        assert pol.objective(ps, want) == pytest.approx(brute_E(ps, want, gamma) / 1.0)
    # only candidates that fit into len(ps)
    assert pol.best_k([1.0] * 5) in (1, 2, 3, 4)


def test_online_rule_matches_brute_force():
    """continue iff some step candidate k > m beats stopping at m, with p_i = p_m for i > m."""
    rng = np.random.default_rng(0)
    checked = {True: 0, False: 0}
    for trial in range(300):
        gamma = float(rng.choice([0.02, 0.1, 0.3, 0.7]))
        budget = int(rng.choice([3, 5, 7, 16, 100]))
        pol = AsProb(candidates=CANDS, init_cost_ratio=gamma)
        k_step = pol.start_step(budget)
        assert k_step == min(16, budget)
        step_cands = {min(c, k_step) for c in CANDS}
        ps = list(1 - rng.random(k_step) ** 2)
        for m in range(1, k_step + 1):
            ext = ps[:m] + [ps[m - 1]] * (16 - m)
            want = any(brute_E(ext, k, gamma) > brute_E(ext, m, gamma) for k in step_cands if m < k <= k_step)
            assert pol.should_continue(ps[:m]) == want, (trial, gamma, budget, m, ps[:m])
            checked[want] += 1
    assert checked[True] > 100 and checked[False] > 100  # both branches exercised


def test_budget_truncates_candidates():
    pol = AsProb(candidates=(4, 8), init_cost_ratio=0.01)
    assert pol.start_step(6) == 6
    # p = 1: the longest allowed draft is best; candidate 8 is truncated to the budget 6
    assert [pol.should_continue([1.0] * m) for m in range(1, 7)] == [True] * 5 + [False]
    assert pol.start_step(0) == 0


# ------------------------------------------------------------------------- adaptation
def test_adaptive_shortens_when_entropy_rises_and_lengthens_when_it_falls():
    pol = EntropyAdaptive(candidates=CANDS, ema=0.1, init_cost_ratio=0.1)
    ks = []
    phases = [  # (entropy of every drafted token, those tokens are accepted?)
        (0.15, True),  # easy text: confident drafts, all pass
        (2.2, False),  # hard text: uncertain drafts, the first one fails
        (0.15, True),  # easy again
    ]
    for h, ok in phases:
        for _ in range(60):
            k, _ = draft_step(pol, lambda i: h, (lambda e: len(e)) if ok else (lambda e: 0))
            ks.append(k)
    a, b, c = (np.mean(ks[i * 60 + 40:(i + 1) * 60]) for i in range(3))
    assert a >= 12 and b <= 2 and c >= 12, (a, b, c)
    assert b < a and c > b
    assert pol.mu_accept < 0.5 and 2.0 < pol.mu_reject < 2.5  # centroids followed the data
    assert pol.num_decisions == sum(ks) and pol.num_steps == 180
    assert pol.overhead_s > 0.0


def test_same_entropy_different_history_gives_different_length():
    """The centroids are learned: h = 1.3 means 'likely accepted' or 'likely rejected' by history."""
    lenient = EntropyAdaptive(init_cost_ratio=0.1)  # 1.3-entropy drafts pass, 3.0 ones fail
    strict = EntropyAdaptive(init_cost_ratio=0.1)  # 1.3-entropy drafts fail, 0.2 ones pass
    for _ in range(80):
        draft_step(lenient, lambda i: 1.3 if i < 6 else 3.0, lambda e: min(6, len(e)))
        draft_step(strict, lambda i: 0.2 if i < 3 else 1.3, lambda e: min(3, len(e)))
    assert lenient.accept_prob(1.3) > 0.8 and strict.accept_prob(1.3) < 0.2
    k_len, _ = draft_step(lenient, lambda i: 1.3, lambda e: len(e))
    k_str, _ = draft_step(strict, lambda i: 1.3, lambda e: 0)
    assert k_len >= 8 and k_str == 1


def test_stops_when_a_high_entropy_token_appears_mid_step():
    pol = EntropyAdaptive(init_cost_ratio=0.1)
    pol.start_step(16)
    assert all(pol.should_continue([0.1] * m) for m in range(1, 6))
    assert not pol.should_continue([0.1] * 5 + [3.0])


def test_centroid_updates_use_only_leading_run_and_first_rejection():
    pol = EntropyAdaptive(ema=0.5, init_accept_entropy=0.5, init_reject_entropy=2.5)
    pol.update([0.1, 0.7, 3.5, 0.0, 9.0], 2)  # accepted 0.1, 0.7; rejected 3.5; 0.0, 9.0 unknown
    assert pol.mu_accept == pytest.approx(0.5)  # 0.5 -> 0.3 -> 0.5
    assert pol.mu_reject == pytest.approx(3.0)  # 2.5 -> 3.0 (9.0 would give more, 0.0 less)
    pol.update([0.9, 0.9], 2)  # all accepted: no rejection known
    assert pol.mu_accept == pytest.approx(0.8) and pol.mu_reject == pytest.approx(3.0)
    pol.update([1.0, 0.0, 0.0], 0)  # first token rejected, the rest unknown
    assert pol.mu_accept == pytest.approx(0.8) and pol.mu_reject == pytest.approx(2.0)
    pol.update([], 0)  # nothing drafted: nothing learned
    assert (pol.mu_accept, pol.mu_reject) == pytest.approx((0.8, 2.0))
    pol.update([float("nan"), 0.8], 1)  # non-finite entropy is skipped, not propagated
    assert math.isfinite(pol.mu_accept) and pol.mu_reject == pytest.approx(1.4)
    for bad in (-1, 3, 1.0):
        with pytest.raises(ValueError, match="num_accepted"):
            pol.update([0.1, 0.2], bad)


def test_tensor_entropies_equal_float_entropies():
    a, b = EntropyAdaptive(), EntropyAdaptive()
    hs = [0.3, 0.9, 1.7, 0.2]
    a.start_step(16), b.start_step(16)
    for m in range(1, 5):
        assert a.should_continue(hs[:m]) == b.should_continue([torch.tensor(h) for h in hs[:m]])
    a.update(hs, 2), b.update([torch.tensor(h) for h in hs], 2)
    assert (a.mu_accept, a.mu_reject) == pytest.approx((b.mu_accept, b.mu_reject), rel=1e-6)
    a.observe_costs(0.002, 0.01), b.observe_costs(torch.tensor(0.002), torch.tensor(0.01))
    assert a.gamma == pytest.approx(b.gamma, rel=1e-6)


# ----------------------------------------------------------------------- costs / gamma
def test_cost_emas():
    pol = EntropyAdaptive(ema=0.5, init_cost_ratio=0.3)
    pol.observe_costs(0.004, 0.0)  # verify time unknown: keep the prior ratio
    assert pol.gamma == pytest.approx(0.3)
    pol.observe_costs(0.0, 0.010)  # a step with no draft forward: draft cost unchanged
    assert pol.gamma == pytest.approx(0.4) and pol.cost_verify == pytest.approx(0.010)
    pol.observe_costs(0.006, 0.030)
    assert pol.cost_draft == pytest.approx(0.005) and pol.cost_verify == pytest.approx(0.020)
    pol.observe_costs(float("nan"), float("inf"))
    assert pol.gamma == pytest.approx(0.25)


def test_efficiency_inversion_large_gamma_prefers_short_drafts():
    ps = [0.8] * 16
    ks = [EntropyAdaptive(init_cost_ratio=g).best_k(ps) for g in (0.01, 0.05, 0.1, 0.3, 0.6, 0.9)]
    assert ks[0] >= 8 and ks[-1] == 1
    assert all(x >= y for x, y in zip(ks, ks[1:]))  # longer drafts only pay while gamma is small
    # the same through measured costs and the online rule
    h = 0.9  # p ~ 0.87 under the initial centroids
    cheap, dear = EntropyAdaptive(), EntropyAdaptive(skip_unprofitable=False)
    cheap.observe_costs(0.0002, 0.010)  # gamma = 0.02
    dear.observe_costs(0.009, 0.010)  # gamma = 0.9: a draft costs almost a verify
    k_cheap, _ = draft_step(cheap, lambda i: h, lambda e: len(e))
    k_dear, _ = draft_step(dear, lambda i: h, lambda e: len(e))
    assert k_cheap >= 6 and k_dear == 1
    # allowed to skip, the dear row does not speculate at all (accept_rate 0.5: E(1) < E(0))
    skip = EntropyAdaptive()
    skip.observe_costs(0.009, 0.010)
    assert skip.start_step(16) == 16, "no skipping before the row's acceptance is known"
    for _ in range(8):
        skip.update([1.0, 1.0], 1)  # half the drafts pass
    assert skip.accept_rate == pytest.approx(0.5, abs=0.05) and skip.num_labels == 16
    assert skip.start_step(16) == 0 and skip.num_skipped == 1
    for _ in range(skip.probe_every - 2):
        assert skip.start_step(16) == 0
    assert skip.start_step(16) == 16, "every probe_every-th step drafts again"


# -------------------------------------------------------------------------------- roc_auc
def test_roc_auc_hand_made():
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert roc_auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert roc_auc([0.5] * 6, [0, 1, 0, 1, 1, 0]) == 0.5
    assert roc_auc([1, 2, 2, 3], [False, True, False, True]) == pytest.approx(0.875)
    assert roc_auc([0.1, 0.2], [1, 1]) is None and roc_auc([0.1, 0.2], [0, 0]) is None and roc_auc([], []) is None
    assert roc_auc(torch.tensor([-0.5, -2.0]), torch.tensor([True, False])) == 1.0
    with pytest.raises(ValueError):
        roc_auc([0.1, 0.2], [0, 1, 1])
    with pytest.raises(ValueError):
        roc_auc([0.1, 0.2], [0, 2])


def test_roc_auc_matches_pairwise_count_with_ties():
    rng = np.random.default_rng(1)
    for _ in range(50):
        n = int(rng.integers(2, 40))
        s = rng.integers(0, 5, n).astype(float)  # many ties
        y = rng.integers(0, 2, n)
        pos, neg = s[y == 1], s[y == 0]
        if not len(pos) or not len(neg):
            assert roc_auc(s, y) is None
            continue
        pairs = [(1.0 if a > b else 0.5 if a == b else 0.0) for a, b in itertools.product(pos, neg)]
        assert roc_auc(s, y) == pytest.approx(np.mean(pairs))


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"candidates": ()}, "candidates"),
        ({"candidates": (0, 2)}, "candidates"),
        ({"candidates": (-1,)}, "candidates"),
        ({"candidates": (1.5, 2)}, "candidates"),
        ({"candidates": 4}, "candidates"),
        ({"ema": 0.0}, "ema"),
        ({"ema": 1.5}, "ema"),
        ({"ema": -0.1}, "ema"),
        ({"init_accept_entropy": -0.1}, "init_accept_entropy"),
        ({"init_reject_entropy": float("nan")}, "init_reject_entropy"),
        ({"init_cost_ratio": 0.0}, "init_cost_ratio"),
        ({"init_cost_ratio": float("inf")}, "init_cost_ratio"),
        ({"sharpness": 0.0}, "sharpness"),
        ({"min_spread": -1.0}, "min_spread"),
    ],
)
def test_entropy_adaptive_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        EntropyAdaptive(**kwargs)


def test_defaults_and_protocol():
    pol = EntropyAdaptive()
    assert isinstance(pol, DraftLengthPolicy)
    assert pol.candidates == CANDS and pol.max_k == 16 and pol.ema == 0.1
    assert EntropyAdaptive(candidates=[8, 2, 2, 4]).candidates == (2, 4, 8)
    assert pol.start_step(5) == 5 and pol.start_step(40) == 16
    assert set(pol.state()) >= {"mu_accept", "mu_reject", "gamma", "num_decisions", "overhead_s"}


def test_policies_declare_whether_the_draft_loop_must_read_entropies():
    # the engine's draft loop calls should_continue (and syncs entropies) only for adaptive policies
    assert EntropyAdaptive.adaptive is True and FixedK(4).adaptive is False
