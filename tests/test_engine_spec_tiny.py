"""``test_engine_spec.py``'s matrices on a tiny random-weight model, where each case takes
milliseconds instead of seconds: greedy losslessness for every method (ragged batch 3 at K in
{1, 8, auto}, batch 1 at auto, prompts crossing the 512-token prefill chunk, a sparse draft
index), int8 drafts, ``max_new_tokens`` exact with the draft clipped, EOS at every offset of an
accepted block (batch 1 and 2), seeded sampling. The oracle is the same as on the real model
(greedy AR, one prompt at a time); fp32 greedy identity does not depend on what the weights mean.

Each greedy case must draft, and every drafter but the n-gram lookup must also have drafts
accepted (the accepted path runs, not only rejections), so no case passes by drafting nothing. The real model runs one case of each matrix per method in
``test_engine_spec.py``.
"""
from __future__ import annotations

import pytest
import torch

from sparsespec import METHODS, Engine
from sparsespec.model import Transformer
from sparsespec.stats import derive
from tests.helpers import eagle3_head, write_tiny_llama

SPEC_METHODS = [m for m in METHODS if m != "ar"]
SPARSE_SELF = {"sparsespec-l", "magicdec-streaming", "magicdec-snapkv"}  # draft over a sparse KV index
V = 48
N_NEW = 24


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # head_dim 16 (64 / 4 heads, GQA 2): the shape class our CPU attention kernel takes, as the
    # real model's 64 does; vocabulary 48: random prompts repeat n-grams, so ngram drafts too
    folder = write_tiny_llama(tmp_path_factory.mktemp("spec") / "m", vocab_size=V, hidden=64, intermediate=128,
                              layers=2, heads=4, kv_heads=2, max_pos=1024, seed=0, scale=0.35, embed_scale=1.0,
                              eos_token_id=V + 7)
    model = Transformer.from_folder(folder)  # its source_folder: draft-model with it drafts with these weights
    eng = Engine(model, _Tok(), "tiny")
    eng.test_folder = str(folder)
    return eng


def _prompt(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def method_options(engine, method: str, **extra):
    """Options every method needs (the draft model drafts with the target's weights, as on the
    real model; the EAGLE-3 head is trained here on the target's greedy continuations)."""
    opts = dict(extra)
    if method == "draft-model":
        opts["draft_model"] = engine.test_folder
    elif method == "eagle3":
        opts["draft_model"] = eagle3_head(engine.model)
    return opts


@pytest.fixture(scope="module")
def long_prompts():
    # ragged, all longer than the 128-token budget floor so the draft index is sparse; two cross
    # the 512-token prefill chunk
    return [_prompt(520, 1), _prompt(600, 2), _prompt(330, 3)]


@pytest.fixture(scope="module")
def ar_rows(engine, long_prompts):
    return [engine.generate([p], method="ar", max_new_tokens=N_NEW, ignore_eos=True)[0] for p in long_prompts]


def test_batched_ar_equals_per_row_ar(engine, long_prompts, ar_rows):
    outs = engine.generate(long_prompts, method="ar", max_new_tokens=N_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == [a.token_ids for a in ar_rows]
    assert len({t for a in ar_rows for t in a.token_ids}) > 8, "varied outputs: the identity check means something"


@pytest.mark.parametrize("method", SPEC_METHODS)
@pytest.mark.parametrize("batch, k", [(3, 1), (3, 8), (3, "auto"), (1, "auto")])
def test_greedy_is_token_identical_to_ar(engine, long_prompts, ar_rows, method, k, batch):
    if k == "auto":  # what earlier cores of this engine measured may stop auto from drafting at all
        engine.__dict__.pop("_controller_state", None)
    prompts = long_prompts[:batch]
    outs = engine.generate(prompts, method=method, method_options=method_options(engine, method, k=k),
                           max_new_tokens=N_NEW, ignore_eos=True)
    for ar, out, prompt in zip(ar_rows, outs, prompts):
        s = out.stats
        assert s["num_drafted"] > 0, "drafted nothing: the check would be inconclusive"
        if method in SPARSE_SELF:
            assert derive(s)["budget_frac"] < 0.5, "the draft index should be sparse here"
        assert out.token_ids == ar.token_ids
        assert s["num_emitted"] == len(out.token_ids) - 1 == N_NEW - 1
        assert s["num_accepted"] <= s["num_drafted"]
        if method == "draft-model":  # the target drafting for itself: every draft passes
            assert s["num_accepted"] == s["num_drafted"]
        if k != "auto":
            hist = {tuple(map(int, key.split(":"))): n for key, n in s["accept_hist"].items()}
            assert max(kk for kk, _ in hist) <= k
        assert s["num_prompt_tokens"] == len(prompt)
    # (an n-gram lookup on random tokens may guess nothing right in 24 tokens; k="auto" drafts as the
    # costs measured during the run say, so on this random model it may draft a few tokens that all
    # fail: the fixed-k cases of the same method cover the acceptance path)
    if method != "ngram" and k != "auto":
        assert sum(o.stats["num_accepted"] for o in outs) > 0, "accepted nothing: only the rejection path ran"


@pytest.mark.parametrize("method", sorted(SPARSE_SELF))
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_with_an_int8_draft_is_token_identical_to_full_precision_ar(engine, long_prompts, ar_rows, method,
                                                                          batch):
    prompts = long_prompts[:batch]
    outs = engine.generate(prompts, method=method, method_options={"k": 4, "draft_weights": "int8"},
                           max_new_tokens=N_NEW, ignore_eos=True)
    for ar, out in zip(ar_rows, outs):
        assert out.stats["num_drafted"] > 0, "drafted nothing: the check would be inconclusive"
        assert out.token_ids == ar.token_ids
        assert out.stats["draft_weight_bytes"] > 0
        assert 0 < out.stats["num_accepted"] <= out.stats["num_drafted"]


@pytest.fixture(scope="module")
def short_prompt():
    """Shorter than the budget floor: the self-drafts see the whole context (accepted blocks)."""
    return _prompt(25, 4)


@pytest.mark.parametrize("method", SPEC_METHODS)
@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 4, 5, 9])  # K = 4: {1, 2, K-1, K, K+1, ...}
def test_max_new_tokens_is_exact_and_draft_is_clipped(engine, short_prompt, method, max_new_tokens):
    ar = engine.generate([short_prompt], method="ar", max_new_tokens=max_new_tokens, ignore_eos=True)[0]
    out = engine.generate([short_prompt], method=method, method_options=method_options(engine, method, k=4),
                          max_new_tokens=max_new_tokens, ignore_eos=True)[0]
    assert len(out.token_ids) == max_new_tokens and out.token_ids == ar.token_ids
    assert out.finish_reason == "length"
    hist = {tuple(map(int, key.split(":"))): n for key, n in out.stats["accept_hist"].items()}
    assert out.stats["num_drafted"] <= max(0, max_new_tokens - 2) * 4 and all(kk <= 4 for kk, _ in hist)
    if max_new_tokens >= 3 and method != "ngram":  # a step with room for a draft drafted: the clip ran
        assert out.stats["num_drafted"] > 0


@pytest.mark.parametrize("method", SPEC_METHODS)
@pytest.mark.parametrize("batch", [1, 2])
def test_eos_at_every_offset_of_an_accepted_block(engine, short_prompt, method, batch):
    ref = engine.generate([short_prompt], method="ar", max_new_tokens=12, ignore_eos=True)[0].token_ids
    other = _prompt(4, 5)
    accepted = 0
    for offset in range(1, 9):  # declare the token the model emits at `offset` as EOS
        eos = ref[offset]
        first = ref.index(eos)
        prompts = [short_prompt, other][:batch]
        outs = engine.generate(prompts, method=method, method_options=method_options(engine, method, k=8),
                               max_new_tokens=12, eos_token_ids=[eos])
        out = outs[0]
        assert out.token_ids == ref[: first + 1], offset
        assert out.finish_reason == "stop"
        s = out.stats
        assert s["num_emitted"] == len(out.token_ids) - 1  # nothing after the stop is counted
        assert s["num_accepted"] <= s["num_emitted"]
        accepted += s["num_accepted"]
        if batch == 2:  # the other row is not disturbed by the first one leaving the batch
            solo = engine.generate([other], method="ar", max_new_tokens=12, eos_token_ids=[eos])[0]
            assert outs[1].token_ids == solo.token_ids
    if method in SPARSE_SELF or method == "draft-model":  # the draft is the target here: blocks are accepted
        assert accepted > 0


@pytest.fixture(scope="module")
def sampling_prompts():
    return [_prompt(300, 6), _prompt(250, 7)]


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_sampling_is_seeded_and_drafts(engine, sampling_prompts, method):
    kw = dict(method=method, method_options=method_options(engine, method, k=4), max_new_tokens=16,
              temperature=0.8, top_p=0.9, top_k=20, ignore_eos=True)
    a = engine.generate(sampling_prompts, seed=7, **kw)
    b = engine.generate(sampling_prompts, seed=7, **kw)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(o.stats["num_drafted"] > 0 and len(o.token_ids) == 16 for o in a)
    c = engine.generate(sampling_prompts, seed=8, **kw)
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
