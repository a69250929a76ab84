"""SparseSpec-L in the engine: greedy losslessness on the real model, stops, accounting, errors."""
import pytest
import torch

from sparsespec import METHODS, Engine
from tests.helpers import book_prompt, real_engine

pytestmark = pytest.mark.slow

SPEC_METHODS = [m for m in METHODS if m != "ar"]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return real_engine()


@pytest.fixture(scope="module")
def long_prompts(engine):
    tok = engine.tokenizer
    return [
        book_prompt(tok, 2000, 1100, "Summarise what happened to Alice in the text above."),
        book_prompt(tok, 9000, 1300, "Repeat the first sentence of the text above."),
    ]


@pytest.fixture(scope="module")
def ar_outputs(engine, long_prompts):
    return engine.generate(long_prompts, method="ar", max_new_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("method", SPEC_METHODS)
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_is_token_identical_to_ar(engine, long_prompts, ar_outputs, method, k):
    outs = engine.generate(long_prompts, method=method, method_options={"k": k}, max_new_tokens=32, ignore_eos=True)
    for ar, out, prompt in zip(ar_outputs, outs, long_prompts):
        s = out.stats
        assert s["num_drafted"] > 0, "drafted nothing: the check would be inconclusive"
        # the index really was sparse (about 10 % of the context), so this is not full attention
        assert 0.05 < s["budget_frac"] < 0.2
        assert out.token_ids == ar.token_ids
        assert len(out.token_ids) == 32
        # accounting: every generated token but the first came from a verify step
        assert s["num_emitted"] == len(out.token_ids) - 1
        assert s["num_accepted"] <= s["num_drafted"]
        assert sum(int(key.split(":")[1]) * n for key, n in s["accept_hist"].items()) == s["num_accepted"]
        assert sum(s["accept_hist"].values()) <= s["num_steps"]
        assert s["num_prompt_tokens"] == len(prompt)


def test_ar_stats_follow_the_contract(ar_outputs):
    s = ar_outputs[0].stats
    assert s["num_steps"] == s["num_emitted"] == 31
    assert s["num_drafted"] == s["num_accepted"] == 0 and s["draft_s"] == 0.0
    assert s["prefill_s"] > 0 and s["decode_s"] > 0 and s["verify_s"] <= s["decode_s"]
    assert s["total_s"] == pytest.approx(s["prefill_s"] + s["decode_s"])
    assert s["budget_frac"] is None and s["kv_bytes"] > 0


def test_full_budget_draft_is_accepted_entirely(engine):
    """Context shorter than the budget: the draft sees everything, so greedy acceptance is 1.0."""
    prompt = engine.tokenizer("The capital of France is Paris. The capital of Italy is").input_ids
    out = engine.generate([prompt], method="sparsespec-l", method_options={"k": 4}, max_new_tokens=21, ignore_eos=True)[0]
    s = out.stats
    assert s["num_drafted"] > 0 and s["num_accepted"] == s["num_drafted"]
    assert s["budget_frac"] == 1.0
    assert out.token_ids == engine.generate([prompt], method="ar", max_new_tokens=21, ignore_eos=True)[0].token_ids


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 4, 5, 9])
def test_max_new_tokens_is_exact_and_draft_is_clipped(engine, max_new_tokens):
    prompt = engine.tokenizer("One, two, three, four, five, six, seven, eight,").input_ids
    ar = engine.generate([prompt], method="ar", max_new_tokens=max_new_tokens, ignore_eos=True)[0]
    out = engine.generate([prompt], method="sparsespec-l", method_options={"k": 4}, max_new_tokens=max_new_tokens,
                          ignore_eos=True)[0]
    assert len(out.token_ids) == max_new_tokens and out.token_ids == ar.token_ids
    assert out.finish_reason == "length"
    # never drafted past the budget: each step drafts at most (remaining - 1)
    assert out.stats["num_drafted"] <= max(0, max_new_tokens - 2) * 4


def test_eos_inside_an_accepted_block_stops_there(engine):
    prompt = engine.tokenizer("One, two, three, four, five, six, seven, eight,").input_ids
    ref = engine.generate([prompt], method="ar", max_new_tokens=12, ignore_eos=True)[0].token_ids
    for offset in range(1, 8):  # declare the token the model emits at `offset` as EOS
        eos = ref[offset]
        first = ref.index(eos)
        out = engine.generate([prompt], method="sparsespec-l", method_options={"k": 8}, max_new_tokens=12,
                              eos_token_ids=[eos])[0]
        assert out.token_ids == ref[: first + 1], offset
        assert out.finish_reason == "stop"
        s = out.stats
        assert s["num_emitted"] == len(out.token_ids) - 1  # nothing after the stop is counted
        assert s["num_accepted"] <= s["num_emitted"]


def test_string_prompts_and_text(engine):
    out = engine.generate(["Hello, my name is"], method="sparsespec-l", max_new_tokens=5, ignore_eos=True)[0]
    assert isinstance(out.text, str) and out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="magic"), "unknown method 'magic'"),
        (dict(method="sparsespec-L"), "did you mean 'sparsespec-l'"),
        (dict(method_options={"k": 0}), "k must be"),
        (dict(method_options={"kk": 3}), "unknown method_options"),
        (dict(method_options={"budget_frac": 1.5}), "budget_frac"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=0.7), "temperature"),
        (dict(max_new_tokens=8190), "context window"),
    ],
)
def test_invalid_arguments_raise_value_error(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([[1, 2, 3, 4]], **kwargs)


@pytest.mark.parametrize("prompt, match", [([], "empty"), ([10**9], "outside"), (["a", "b"], "token ids")])
def test_bad_prompts_raise_value_error(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([prompt], method="ar")


def test_unknown_dtype(engine):
    with pytest.raises(ValueError, match="dtype"):
        Engine.from_pretrained("smollm2-135m", dtype="int3")
