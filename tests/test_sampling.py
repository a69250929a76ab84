import math

import pytest
import torch

from sparsespec.sampling import logits_to_probs, make_generator, race_argmax, sample, validate_sampling


def _support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def _check_support_rules(logits: torch.Tensor, probs: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """The support rules every logits_to_probs output must satisfy, for p and q alike."""
    full = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
    for row_full, row in zip(full, probs):
        assert torch.allclose(row.sum(), torch.tensor(1.0), atol=1e-5)
        kept = sorted(_support(row))
        dropped = sorted(set(range(row.numel())) - set(kept))
        # kept tokens are the most probable ones
        if dropped:
            assert row_full[kept].min() >= row_full[dropped].max()
        if top_k:
            assert len(kept) <= top_k
        # kept probabilities are the renormalised full ones
        assert torch.allclose(row[kept], row_full[kept] / row_full[kept].sum(), atol=1e-6)
        # nucleus: after top-k, the kept prefix reaches top_p and is minimal
        base = row_full.clone()
        if top_k:
            base[torch.argsort(base, descending=True, stable=True)[top_k:]] = 0
            base /= base.sum()
        mass = base[kept].sum().item()
        assert mass >= top_p - 1e-5
        assert mass - base[kept].min().item() < top_p


def test_temperature_zero_is_one_hot_at_torch_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 50, generator=g)
    logits[0, 0, 7] = logits[0, 0, 9] = logits[0, 0].max() + 1  # tie: torch.argmax picks 7
    for x in (logits, logits.bfloat16(), logits.half()):
        probs = logits_to_probs(x, 0.0, top_k=5, top_p=0.5)
        assert probs.dtype == torch.float32 and probs.shape == x.shape
        assert torch.equal(probs.argmax(-1), x.argmax(-1))
        assert torch.equal(probs.sum(-1), torch.ones(4, 3))
        assert torch.equal((probs == 1).sum(-1), torch.ones(4, 3, dtype=torch.long))
    assert logits_to_probs(logits, 0.0)[0, 0, 7] == 1.0
    # one-hot rows always sample their hot index
    probs = logits_to_probs(logits, 0)
    for seed in range(20):
        assert torch.equal(sample(probs, make_generator(seed, "cpu")), logits.argmax(-1))


def test_temperature_scales_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.allclose(logits_to_probs(logits, 1.0), torch.softmax(logits, -1))
    assert torch.allclose(logits_to_probs(logits, 0.5), torch.softmax(logits * 2, -1))
    assert torch.allclose(logits_to_probs(logits.bfloat16(), 2.0), torch.softmax(logits.bfloat16().float() / 2, -1))


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([[0.0, 2.0, 2.0, 2.0, 1.0]])
    probs = logits_to_probs(logits, 1.0, top_k=2)
    assert _support(probs[0]) == {1, 2}  # tie at the boundary: lower ids kept, exactly k
    assert torch.allclose(probs[0, [1, 2]], torch.tensor([0.5, 0.5]))
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 40, generator=g)
    for k in (1, 3, 39):
        probs = logits_to_probs(logits, 0.7, top_k=k)
        assert torch.equal((probs > 0).sum(-1), torch.full((64,), k))
        _check_support_rules(logits, probs, 0.7, k, 1.0)
    # k = 0 and k >= V are disabled
    assert torch.allclose(logits_to_probs(logits, 1.0, top_k=0), torch.softmax(logits, -1))
    assert torch.allclose(logits_to_probs(logits, 1.0, top_k=40), torch.softmax(logits, -1))


def test_top_p_keeps_smallest_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert _support(logits_to_probs(logits, 1.0, top_p=0.8)) == {0, 1}
    assert _support(logits_to_probs(logits, 1.0, top_p=0.81)) == {0, 1, 2}
    assert _support(logits_to_probs(logits, 1.0, top_p=0.5)) == {0}
    assert _support(logits_to_probs(logits, 1.0, top_p=0.3)) == {0}  # always at least one
    assert _support(logits_to_probs(logits, 1.0, top_p=0.96)) == {0, 1, 2, 3}
    assert torch.allclose(logits_to_probs(logits, 1.0, top_p=0.8), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(logits_to_probs(logits, 1.0, top_p=1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_top_p_applies_to_the_renormalised_top_k_distribution():
    # HF / vLLM order: top-k, renormalise, then top-p. Top-k 2 gives [0.571, 0.429]: 0.5 -> 1 token
    # (top-p on the raw distribution would keep 2).
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert _support(logits_to_probs(logits, 1.0, top_k=2, top_p=0.5)) == {0}
    assert _support(logits_to_probs(logits, 1.0, top_k=0, top_p=0.5)) == {0, 1}


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (5, 1.0), (5, 0.7), (1, 0.5), (30, 0.95)])
def test_same_support_rules_for_target_and_draft(top_k, top_p):
    # p and q come from different logits through the same function: both obey the same rules.
    g = torch.Generator().manual_seed(2)
    target_logits = torch.randn(16, 30, generator=g) * 2
    draft_logits = target_logits + torch.randn(16, 30, generator=g)
    for logits in (target_logits, draft_logits):
        probs = logits_to_probs(logits, 0.8, top_k=top_k, top_p=top_p)
        _check_support_rules(logits, probs, 0.8, top_k, top_p)


def test_seeded_generator_reproduces_samples():
    probs = torch.softmax(torch.randn(8, 100, generator=torch.Generator().manual_seed(3)), -1)
    a = sample(probs, make_generator(123, "cpu"))
    b = sample(probs, make_generator(123, "cpu"))
    c = sample(probs, make_generator(124, "cpu"))
    assert a.dtype == torch.int64 and a.shape == (8,)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert make_generator(None, "cpu") is None
    with pytest.raises(ValueError, match="seed"):
        make_generator(-1, "cpu")


def test_sample_matches_distribution_and_ignores_zero_tokens():
    probs = torch.tensor([0.1, 0.0, 0.4, 0.2, 0.3])
    n = 200_000
    ids = sample(probs.expand(n, 5), make_generator(0, "cpu"))
    freq = torch.bincount(ids, minlength=5).float() / n
    assert freq[1] == 0
    assert 0.5 * (freq - probs).abs().sum() < 0.01
    # unnormalised weights work the same way
    ids = race_argmax((probs * 7).expand(n, 5), make_generator(1, "cpu"))
    assert 0.5 * (torch.bincount(ids, minlength=5).float() / n - probs).abs().sum() < 0.01


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"seed": -3}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_validate_sampling_names_the_parameter(kwargs, name):
    args = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": None} | kwargs
    with pytest.raises(ValueError, match=name):
        validate_sampling(**args)


def test_validate_sampling_accepts_valid_values():
    validate_sampling(0.0, 0, 1.0, None)
    validate_sampling(0.7, 50, 0.9, 0)
    validate_sampling(2, 1, 1e-3, 2**64 - 1)
    with pytest.raises(ValueError, match="top_p"):
        logits_to_probs(torch.zeros(3), 1.0, top_p=0)
