"""Sampling through the whole engine preserves the target distribution, for every method.

A tiny random-weight model with a 12-token vocabulary makes the exact target marginals cheap to
enumerate; 600 independent rows of one batch (one generator) give the empirical ones. The draft
index is made sparse (budget 40 of a 200-token prompt), so q differs from p and the rejection
path (recovered tokens) is exercised, not only acceptance.
"""

import pytest
import torch

from sparsespec import METHODS, Engine
from sparsespec.kv.cache import KVCache
from sparsespec.model import Transformer
from tests.helpers import eagle3_head, own_options, write_tiny_llama

pytestmark = pytest.mark.slow

V, ROWS, T = 12, 600, 1.0


class _Tok:
    """Just enough tokenizer for the engine (decode only)."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _tiny(folder, seed):
    return write_tiny_llama(folder, vocab_size=V, hidden=32, intermediate=64, max_pos=512, seed=seed, scale=0.6,
                            embed_scale=1.5, eos_token_id=V + 100)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = Transformer.from_folder(_tiny(root / "target", 0))
    target.source_folder = None  # no tokenizer files here: the draft-model check falls back to vocab_size
    draft_folder = _tiny(root / "draft", 1)
    prompt = torch.randint(0, V, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    return Engine(target, _Tok(), "tiny"), str(draft_folder), prompt


def _exact_marginals(model: Transformer, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """p(x1), p(x2) of ancestral sampling at temperature T, by enumeration."""
    def next_probs(ids):
        cache = KVCache(model.cfg, 1, len(ids) + 1, model.dtype, "cpu")
        logits, _ = model.forward_dense(torch.tensor([ids]), cache, logits_for="last")
        return torch.softmax(logits[0, -1] / T, -1).double()

    p1 = next_probs(prompt)
    p2 = sum(p1[x] * next_probs(prompt + [x]) for x in range(V))
    return p1, p2


@pytest.mark.parametrize("method", [m for m in METHODS if m != "ar"])
def test_sampled_tokens_follow_the_target_distribution(tiny, method):
    engine, draft_folder, prompt = tiny
    opts = own_options(method, {"k": 3, "min_budget": 40, "max_budget": 40, "n_sink": 4, "n_recent": 8, "window": 8})
    if method == "draft-model":
        opts["draft_model"] = draft_folder
    elif method == "eagle3":  # a draft vocabulary smaller than the target's: q is 0 outside it
        opts["draft_model"] = eagle3_head(engine.model, draft_vocab=V - 8)
    outs = engine.generate([prompt] * ROWS, method=method, method_options=opts, max_new_tokens=4, temperature=T,
                           seed=11, ignore_eos=True)
    drafted = sum(o.stats["num_drafted"] for o in outs)
    accepted = sum(o.stats["num_accepted"] for o in outs)
    assert drafted > 0, "drafted nothing: inconclusive"
    p1, p2 = _exact_marginals(engine.model, prompt)
    for pos, p in ((0, p1), (1, p2)):
        counts = torch.bincount(torch.tensor([o.token_ids[pos] for o in outs]), minlength=V).double()
        tv = 0.5 * (counts / ROWS - p).abs().sum().item()
        assert tv < 0.1, f"{method}: position {pos} total variation {tv:.3f}"
    if method != "ngram":  # n-gram proposals are one-hot, the others are real distributions
        assert accepted < drafted, "some drafts must be rejected for the recovery path to be tested"
