"""stop_token_ids and min_new_tokens (vLLM's stop_token_ids / min_tokens): the stop ids end a row,
cannot be generated before min_new_tokens, and every method stays token-identical to AR."""
from __future__ import annotations

import pytest
import torch

from sparsespec import METHODS
from sparsespec.config import SamplingParams
from sparsespec.shapes import random_engine
from tests.helpers import eagle3_head


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    return random_engine("tiny", seed=3)


def _prompt(n=300, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def test_stop_token_id_ends_the_row_and_min_new_tokens_masks_it(engine):
    prompt = _prompt()
    free = engine.generate([prompt], method="ar", max_new_tokens=12, eos_token_ids=[])[0].token_ids
    first, second = free[0], free[1]
    # the first greedy token as a stop id: the row ends right there
    out = engine.generate([prompt], method="ar", max_new_tokens=12, eos_token_ids=[], stop_token_ids=[first])[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    # ... unless it may not be generated yet: then the runner-up of the same logits comes first
    masked = engine.generate([prompt], method="ar", max_new_tokens=12, eos_token_ids=[], stop_token_ids=[first],
                             min_new_tokens=1)[0]
    assert masked.token_ids[0] != first
    model = engine.model
    from sparsespec.kv.cache import KVCache

    cache = KVCache(model.cfg, 1, len(prompt) + 1, model.dtype, model.device)
    logits, _ = model.prefill(torch.tensor([prompt]), cache)
    runner_up = logits[0].topk(2).indices[1].item()
    assert masked.token_ids[0] == runner_up
    # a stop id that shows up later still ends the row once min_new_tokens is reached
    out = engine.generate([prompt], method="ar", max_new_tokens=12, eos_token_ids=[], stop_token_ids=[second],
                          min_new_tokens=1)[0]
    assert out.token_ids == [first, second] and out.finish_reason == "stop"


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("ar", "draft-model")])
def test_every_method_matches_ar_under_min_new_tokens(engine, method):
    prompts = [_prompt(300, 1), _prompt(250, 2)]
    free = engine.generate(prompts, method="ar", max_new_tokens=16, eos_token_ids=[])
    # stop ids that greedy decoding would produce early: masked for the first 6 tokens
    stops = sorted({free[0].token_ids[2], free[1].token_ids[3]})
    kw = dict(max_new_tokens=16, eos_token_ids=[], stop_token_ids=stops, min_new_tokens=6)
    ar = engine.generate(prompts, method="ar", **kw)
    opts = {"k": 4, **({"draft_model": eagle3_head(engine.model, draft_vocab=256)} if method == "eagle3" else {})}
    got = engine.generate(prompts, method=method, method_options=opts, **kw)
    assert [o.token_ids for o in got] == [o.token_ids for o in ar]
    assert all(t not in stops for o in ar for t in o.token_ids[:6])
    assert sum(o.stats["num_drafted"] for o in got) > 0  # drafted: the check is conclusive


@pytest.mark.parametrize("bad", [-1, 8, 1.5, True])
def test_min_new_tokens_is_validated(bad):
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=8, min_new_tokens=bad)
