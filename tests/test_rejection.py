import math

import pytest
import torch

from sparsespec.rejection import (
    PLACEHOLDER_ID,
    Verdict,
    greedy_verify,
    greedy_verify_batch,
    rejection_sample,
    verdicts,
)
from sparsespec.sampling import logits_to_probs, make_generator, sample

V = 4


def one_hot(ids, v=V):
    return torch.nn.functional.one_hot(torch.tensor(ids), v).float()


def dist(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def rs(draft_ids, q, p, num_draft=None, seed=0):
    """rejection_sample on a single row given as lists / [K, V] tables."""
    draft = torch.tensor([draft_ids], dtype=torch.long).reshape(1, -1)
    nd = None if num_draft is None else torch.tensor([num_draft])
    out, na = rejection_sample(draft, q.reshape(1, -1, V), p.unsqueeze(0), nd, make_generator(seed, "cpu"))
    assert out.dtype == torch.int64 and na.dtype == torch.int64
    assert out.shape == (1, draft.shape[1] + 1) and na.shape == (1,)
    return out[0].tolist(), int(na[0])


# ---------------------------------------------------------------- hand-made tables

def test_accept_all_then_bonus_from_p_k():
    # p == q at every drafted position: every draft is accepted; the bonus comes from p_K.
    q = dist([0.5, 0.5, 0, 0], [0, 0.2, 0.8, 0])
    p = torch.cat([q, dist([0, 0, 0, 1])])
    for seed in range(10):
        assert rs([1, 2], q, p, seed=seed) == ([1, 2, 3], 2)
    # bonus distribution: p_K = [0.5, 0, 0.5, 0] (not p_0 or p_1)
    n = 20_000
    p = torch.cat([q, dist([0.5, 0, 0.5, 0])])
    out, na = rejection_sample(
        torch.tensor([[1, 2]]).expand(n, 2), q.expand(n, 2, V), p.expand(n, 3, V), None, make_generator(0, "cpu")
    )
    assert torch.equal(na, torch.full((n,), 2))
    freq = torch.bincount(out[:, 2], minlength=V).float() / n
    assert freq[1] == 0 and freq[3] == 0 and abs(freq[0] - 0.5) < 0.02


def test_reject_first_recovers_from_residual():
    # Draft 2 has p(2) = 0: always rejected. residual = max(0, p - q) = [0, 0.5, 0, 0] -> token 1
    # every time (sampling from p instead would give token 0 half the time).
    q = dist([0.5, 0, 0.5, 0], [0.25] * 4)
    p = dist([0.5, 0.5, 0, 0], [0.25] * 4, [0.25] * 4)
    for seed in range(20):
        assert rs([2, 0], q, p, seed=seed) == ([1, PLACEHOLDER_ID, PLACEHOLDER_ID], 0)


def test_zero_residual_falls_back_to_p():
    # p == q, but the draft (token 3) has p = q = 0: rejected, and max(0, p - q) is all zero, so
    # the recovered token is sampled from p = [0.5, 0.5, 0, 0].
    q = dist([0.5, 0.5, 0, 0])
    p = dist([0.5, 0.5, 0, 0], [0.25] * 4)
    n = 4000
    out, na = rejection_sample(
        torch.full((n, 1), 3), q.expand(n, 1, V), p.expand(n, 2, V), None, make_generator(0, "cpu")
    )
    assert (na == 0).all() and (out[:, 1] == PLACEHOLDER_ID).all()
    assert 0.45 < (out[:, 0] == 0).double().mean().item() < 0.55
    assert ((out[:, 0] == 0) | (out[:, 0] == 1)).all()


def test_reject_last():
    q = dist([0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1])
    p = dist([0, 1, 0, 0], [0, 0, 1, 0], [0.3, 0.7, 0, 0], [0.25] * 4)
    for seed in range(10):
        out, na = rs([1, 2, 3], q, p, seed=seed)
        assert na == 2 and out[:2] == [1, 2] and out[2] in (0, 1) and out[3] == PLACEHOLDER_ID


def test_k0_emits_bonus_only():
    p = dist([0, 0, 1, 0])
    out, na = rejection_sample(
        torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, 0, V), p.expand(3, 1, V), torch.zeros(3, dtype=torch.long)
    )
    assert out.tolist() == [[2], [2], [2]] and na.tolist() == [0, 0, 0]
    out, na = greedy_verify_batch(torch.zeros(2, 0, dtype=torch.long), torch.randn(2, 1, V), None)
    assert out.shape == (2, 1) and na.tolist() == [0, 0]


def test_padding_past_num_draft_is_ignored():
    # num_draft = 1 of K = 3: padding ids are -1 and padding probabilities are NaN; the bonus
    # comes from p_1, not p_3.
    nan = math.nan
    q = dist([0, 1, 0, 0], [nan] * 4, [nan] * 4)
    p = dist([0, 1, 0, 0], [0, 0, 0, 1], [nan] * 4, [1, 0, 0, 0])
    assert rs([1, -1, -1], q, p, num_draft=1) == ([1, 3, PLACEHOLDER_ID, PLACEHOLDER_ID], 1)
    # padding drafts that would be accepted are not counted either
    q = dist([0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 0])
    p = dist([0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 0], [0, 0, 1, 0])
    assert rs([1, 2, 2], q, p, num_draft=1) == ([1, 2, PLACEHOLDER_ID, PLACEHOLDER_ID], 1)
    assert rs([1, 2, 2], q, p, num_draft=0) == ([1, PLACEHOLDER_ID, PLACEHOLDER_ID, PLACEHOLDER_ID], 0)
    out, na = greedy_verify_batch(torch.tensor([[1, 2, 2]]), p.unsqueeze(0), torch.tensor([1]))
    assert out.tolist() == [[1, 2, PLACEHOLDER_ID, PLACEHOLDER_ID]] and na.tolist() == [1]


def test_batch_rows_with_different_outcomes():
    # row 0 accepts all (bonus 3), row 1 rejects first (recovers 0), row 2 rejects the second
    # (recovers 3), row 3 has num_draft 1 and accepts it (bonus from p_1 = 2), row 4 num_draft 0.
    oh = one_hot
    draft = torch.tensor([[1, 2], [1, 2], [1, 2], [1, 0], [3, 3]])
    q = torch.stack([torch.stack([oh(1), oh(2)])] * 5)  # [5, 2, V]
    p = torch.stack([
        torch.stack([oh(1), oh(2), oh(3)]),
        torch.stack([oh(0), oh(2), oh(3)]),
        torch.stack([oh(1), oh(3), oh(3)]),
        torch.stack([oh(1), oh(2), oh(0)]),
        torch.stack([oh(1), oh(2), oh(0)]),
    ])
    num_draft = torch.tensor([2, 2, 2, 1, 0])
    expected_out = [[1, 2, 3], [0, -1, -1], [1, 3, -1], [1, 2, -1], [1, -1, -1]]
    expected_na = [2, 0, 1, 1, 0]
    out, na = rejection_sample(draft, q, p, num_draft, make_generator(0, "cpu"))
    assert out.tolist() == expected_out and na.tolist() == expected_na
    out, na = greedy_verify_batch(draft, p, num_draft)
    assert out.tolist() == expected_out and na.tolist() == expected_na
    vs = verdicts(out, na, num_draft)
    assert vs[0] == Verdict(2, [1, 2, 3], True)
    assert vs[1] == Verdict(0, [0], False)
    assert vs[3] == Verdict(1, [1, 2], True)
    assert vs[4] == Verdict(0, [1], True)


def test_shape_errors():
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, V), torch.zeros(1, 2, V))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, V + 1), torch.zeros(1, 3, V))
    with pytest.raises(ValueError, match="num_draft"):
        rejection_sample(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, V), torch.zeros(1, 3, V), torch.ones(2))
    with pytest.raises(ValueError, match="target_logits"):
        greedy_verify_batch(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, V))


def test_greedy_one_hot_equals_greedy_verify_batch_and_greedy_verify():
    g = torch.Generator().manual_seed(0)
    b, k, v = 256, 5, 7
    logits = torch.randn(b, k + 1, v, generator=g)
    target_ids = logits.argmax(-1)  # [B, K+1]
    # drafts: the target's argmax with some random corruptions, so every outcome occurs
    wrong = torch.randint(0, v, (b, k), generator=g)
    corrupt = torch.rand(b, k, generator=g) < 0.25
    draft = torch.where(corrupt, wrong, target_ids[:, :k])
    num_draft = torch.randint(0, k + 1, (b,), generator=g)
    q = torch.nn.functional.one_hot(draft, v).float()  # greedy drafter: one-hot at its token
    p = logits_to_probs(logits, 0.0)

    out_rs, na_rs = rejection_sample(draft, q, p, num_draft, make_generator(5, "cpu"))
    out_g, na_g = greedy_verify_batch(draft, logits, num_draft)
    assert torch.equal(out_rs, out_g) and torch.equal(na_rs, na_g)
    assert len(set(na_g.tolist())) == k + 1  # all outcomes 0..K occurred
    for row in range(b):
        n = int(num_draft[row])
        ver = greedy_verify(draft[row, :n], logits[row, : n + 1])
        na = int(na_g[row])
        assert ver.num_accepted == na
        assert ver.token_ids == out_g[row, : na + 1].tolist()
        assert (out_g[row, na + 1 :] == PLACEHOLDER_ID).all()
    assert verdicts(out_g, na_g, num_draft) == [
        greedy_verify(draft[r, : int(num_draft[r])], logits[r, : int(num_draft[r]) + 1]) for r in range(b)
    ]


def test_seeded_generator_reproduces_rejection_sample():
    g = torch.Generator().manual_seed(0)
    b, k, v = 64, 4, 10
    q = torch.softmax(torch.randn(b, k, v, generator=g), -1)
    p = torch.softmax(torch.randn(b, k + 1, v, generator=g), -1)
    draft = sample(q, g)
    a = rejection_sample(draft, q, p, None, make_generator(7, "cpu"))
    c = rejection_sample(draft, q, p, None, make_generator(7, "cpu"))
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])


# ---------------------------------------------------------------- Monte-Carlo losslessness

N = 200_000


def _chi2_crit(df: int, z: float = 4.5) -> float:
    """Upper chi-square quantile (Wilson-Hilferty), z = 4.5 sigma: p ~ 3e-6."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _assert_distributed_as(ids: torch.Tensor, probs: torch.Tensor):
    """Empirical distribution of ``ids`` [n] vs ``probs`` [V]: TV < 0.01 and a chi-square test."""
    n = ids.numel()
    counts = torch.bincount(ids, minlength=probs.numel()).double()
    expected = probs.double() * n
    assert (counts[expected == 0] == 0).all()
    assert expected[expected > 0].min() >= 20  # chi-square is valid
    tv = 0.5 * (counts / n - probs.double()).abs().sum().item()
    mask = expected > 0
    chi2 = (((counts - expected) ** 2)[mask] / expected[mask]).sum().item()
    df = int(mask.sum()) - 1
    assert tv < 0.01, f"TV {tv:.4f}"
    assert chi2 < _chi2_crit(df), f"chi2 {chi2:.1f} >= {_chi2_crit(df):.1f} (df {df})"


def _tables(v: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    p = 0.7 * torch.softmax(torch.randn(v, generator=g) * 1.5, -1) + 0.3 / v
    q_logits = torch.randn(v, generator=g) * 1.5
    q = logits_to_probs(q_logits, 1.0, top_k=v - 2)  # q misses two tokens that p has
    return p.float(), q, g


@pytest.mark.parametrize("v,seed", [(6, 0), (8, 1)])
def test_k1_first_token_is_distributed_as_p_and_acceptance_matches(v, seed):
    p, q, g = _tables(v, seed)
    p_bonus = torch.softmax(torch.randn(v, generator=g), -1)
    draft = sample(q.expand(N, 1, v), g)  # [N, 1] drafts from q
    target = torch.stack([p, p_bonus]).expand(N, 2, v)
    out, na = rejection_sample(draft, q.expand(N, 1, v), target, torch.ones(N, dtype=torch.long), g)
    _assert_distributed_as(out[:, 0], p)
    alpha = torch.minimum(p, q).sum().item()
    assert abs(na.double().mean().item() - alpha) < 0.005
    # after an accepted draft, the bonus token comes from p_1
    assert (out[na == 0, 1] == PLACEHOLDER_ID).all()
    _assert_distributed_as(out[na == 1, 1], p_bonus)


def _stream(outs: list[torch.Tensor], m: int) -> torch.Tensor:
    """First m emitted tokens of consecutive steps, per trial: [N, m]."""
    cat = torch.cat(outs, dim=1)  # [N, steps*(K+1)]
    order = torch.sort((cat == PLACEHOLDER_ID).int(), dim=1, stable=True).indices
    return cat.gather(1, order)[:, :m]


def test_k3_emitted_tokens_follow_the_target_sequential_distribution():
    # p does not depend on context, so decoding from the target emits i.i.d. tokens from p: each
    # emitted token ~ p and consecutive pairs ~ p x p, including across step boundaries.
    v, k, steps = 5, 3, 2
    p, q, g = _tables(v, 2)
    outs = []
    for _ in range(steps):
        draft = sample(q.expand(N, k, v), g)  # [N, K] i.i.d. from q
        out, na = rejection_sample(draft, q.expand(N, k, v), p.expand(N, k + 1, v), None, g)
        outs.append(out)
    stream = _stream(outs, 2)  # every trial emits >= 1 token per step
    assert (stream >= 0).all()
    _assert_distributed_as(stream[:, 0], p)
    _assert_distributed_as(stream[:, 1], p)
    _assert_distributed_as(stream[:, 0] * v + stream[:, 1], torch.outer(p, p).flatten())
    # within one step: the second emitted token, when it exists (first draft accepted), is ~ p
    first = outs[0]
    has_second = first[:, 1] != PLACEHOLDER_ID
    _assert_distributed_as(first[has_second, 1], p)
    # and the mean tokens per step matches sum_{j<=K} alpha^j (i.i.d. acceptance alpha)
    alpha = torch.minimum(p, q).sum().item()
    tau = sum(alpha**j for j in range(k + 1))
    emitted = (first != PLACEHOLDER_ID).sum(1).double().mean().item()
    assert abs(emitted - tau) < 0.01
