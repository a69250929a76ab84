"""The engine on the real model: greedy losslessness for every method (one case each; together
they cover ragged batch 3 at K in {1, 8, auto} and batch 1 at auto), stops inside accepted blocks,
accounting, streaming, sampling, errors.

The full matrices (every method x K x batch, every max_new_tokens and EOS offset, sampling and
int8 drafts for every method) run on a tiny random-weight model in ``test_engine_spec_tiny.py``,
in milliseconds a case; here each behaviour runs once more on the real model's weights, shapes
and tokenizer."""
import pytest

from sparsespec import METHODS, Engine
from sparsespec.stats import derive
from tests.helpers import book_prompt, real_engine

pytestmark = pytest.mark.slow

SPEC_METHODS = [m for m in METHODS if m != "ar"]
SPARSE_SELF = {"sparsespec-l", "magicdec-streaming", "magicdec-snapkv"}  # draft over a sparse KV index
N_NEW = 24


def method_options(method: str, **extra):
    """Options every method needs to run here (the draft model drafts with the target's weights;
    ``eagle3`` takes none: it runs the head shipped for SmolLM2, ``sparsespec/heads/``, 4,096 of
    the 49,152 ids drafted, so the draft-to-target id map runs too)."""
    opts = dict(extra)
    if method == "draft-model":
        from sparsespec import resolve_model

        opts["draft_model"] = str(resolve_model("smollm2-135m"))
    return opts


@pytest.fixture(scope="module")
def engine() -> Engine:
    return real_engine()


@pytest.fixture(scope="module")
def long_prompts(engine):
    tok = engine.tokenizer
    return [  # ragged lengths, all longer than the budget floor so the draft index is sparse
        # (two cross the 512-token prefill chunk; the shortest is still 2.5x the 128-token budget floor)
        book_prompt(tok, 2000, 520, "Summarise what happened to Alice in the text above."),
        book_prompt(tok, 9000, 600, "Repeat the first sentence of the text above."),
        book_prompt(tok, 5000, 330, "Who is speaking in the last paragraph?"),
    ]


@pytest.fixture(scope="module")
def ar_rows(engine, long_prompts):
    """Greedy AR, one prompt at a time: the reference."""
    return [engine.generate([p], method="ar", max_new_tokens=N_NEW, ignore_eos=True)[0] for p in long_prompts]


def test_batched_ar_equals_per_row_ar(engine, long_prompts, ar_rows):
    outs = engine.generate(long_prompts, method="ar", max_new_tokens=N_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == [a.token_ids for a in ar_rows]


# One (batch, k) per method on the real model, so that together they cover k = 1 (a single draft),
# 8 (long blocks) and auto on the ragged batch of 3, and batch 1 with auto (the controller on one
# row); every method x (batch, k) runs on the tiny model (test_engine_spec_tiny.py). k = 4 runs in
# the int8-draft, max_new_tokens, EOS and sampling tests below.
REAL_CASE = {"sparsespec-l": (3, "auto"), "magicdec-streaming": (3, 8), "magicdec-snapkv": (3, 1),
             "ngram": (1, "auto"), "draft-model": (3, 1), "eagle3": (3, 8)}


@pytest.mark.parametrize("method, batch, k", [(m, *REAL_CASE.get(m, (3, "auto"))) for m in SPEC_METHODS])
def test_greedy_is_token_identical_to_ar(engine, long_prompts, ar_rows, method, k, batch):
    prompts = long_prompts[:batch]
    outs = engine.generate(prompts, method=method, method_options=method_options(method, k=k), max_new_tokens=N_NEW,
                           ignore_eos=True)
    for ar, out, prompt in zip(ar_rows, outs, prompts):
        s = out.stats
        assert s["num_drafted"] > 0, "drafted nothing: the check would be inconclusive"
        if method in SPARSE_SELF:
            assert derive(s)["budget_frac"] < 0.5, "the draft index should be sparse here"
        assert out.token_ids == ar.token_ids
        # accounting: every generated token but the first came from a verify step
        assert s["num_emitted"] == len(out.token_ids) - 1 == N_NEW - 1
        assert s["num_accepted"] <= s["num_drafted"]
        if k != "auto":
            hist = {tuple(map(int, key.split(":"))): n for key, n in s["accept_hist"].items()}
            assert max(kk for kk, _ in hist) <= k
        assert s["num_prompt_tokens"] == len(prompt)


@pytest.mark.parametrize("method", ["sparsespec-l"])
def test_greedy_with_an_int8_draft_is_token_identical_to_full_precision_ar(engine, long_prompts, ar_rows, method):
    """A quantised draft changes q only: the outputs stay the full-precision AR's (the int8 copy of
    the real model's weights, on the ragged batch of 3; every self-speculative method at batch 1
    and 3 on the tiny model)."""
    prompts = long_prompts
    outs = engine.generate(prompts, method=method, method_options={"k": 4, "draft_weights": "int8"},
                           max_new_tokens=N_NEW, ignore_eos=True)
    for ar, out in zip(ar_rows, outs):
        assert out.stats["num_drafted"] > 0, "drafted nothing: the check would be inconclusive"
        assert out.token_ids == ar.token_ids
        assert out.stats["draft_weight_bytes"] > 0
        assert 0 < out.stats["num_accepted"] <= out.stats["num_drafted"]


def test_ar_stats_follow_the_contract(ar_rows):
    s = ar_rows[0].stats
    assert s["num_steps"] == s["num_emitted"] == N_NEW - 1
    assert s["num_drafted"] == s["num_accepted"] == 0 and s["draft_s"] == 0.0
    assert s["prefill_s"] > 0 and s["decode_s"] > 0 and s["verify_s"] <= s["decode_s"] + 1e-6
    assert s["total_s"] == pytest.approx(s["ttft_s"] + s["decode_s"])
    assert derive(s)["budget_frac"] is None and s["kv_bytes"] > 0
    assert s["itl_p50_s"] > 0 and s["itl_p99_s"] >= s["itl_p50_s"]


def test_auto_k_reports_controller_and_entropy_auc(engine, long_prompts):
    # the entropy controller decides per drafted token: its draft lengths vary
    out = engine.generate(long_prompts[:1], method="sparsespec-l", method_options={"k": "auto", "controller": "entropy"},
                          max_new_tokens=40, ignore_eos=True)[0]
    s = out.stats
    assert s["k"] == "auto" and s["controller_s"] > 0 and s["num_entropy_labels"] > 0
    ks = {int(key.split(":")[0]) for key in s["accept_hist"]}
    assert len(ks) >= 2, f"the controller never changed the draft length: {s['accept_hist']}"
    # the cost controller (the default) reports its time too; with nothing measured before, its
    # first step drafts (a core that inherits a measured draft cost may never draft where no
    # acceptance could pay)
    engine.__dict__.pop("_controller_state", None)
    cost = engine.generate(long_prompts[:1], method="sparsespec-l", method_options={"k": "auto"}, max_new_tokens=40,
                           ignore_eos=True)[0]
    assert cost.stats["controller_s"] > 0 and cost.stats["num_drafting_steps"] >= 1
    assert cost.token_ids == out.token_ids  # both lossless


def test_full_budget_draft_is_accepted_entirely(engine):
    """Context shorter than the budget: the draft sees everything, so greedy acceptance is 1.0."""
    prompt = engine.tokenizer("The capital of France is Paris. The capital of Italy is").input_ids
    out = engine.generate([prompt], method="sparsespec-l", method_options={"k": 4}, max_new_tokens=21, ignore_eos=True)[0]
    s = out.stats
    assert s["num_drafted"] > 0 and s["num_accepted"] == s["num_drafted"]
    assert derive(s)["budget_frac"] == 1.0
    assert out.token_ids == engine.generate([prompt], method="ar", max_new_tokens=21, ignore_eos=True)[0].token_ids


COUNTING = "One, two, three, four, five, six, seven, eight, nine, ten, eleven,"


# every method at K + 1, and sparsespec-l at each of {1, 2, K-1, K, K+1, ...} (K = 4); every method
# at every value on the tiny model
MAX_NEW_CASES = [(m, 5) for m in SPEC_METHODS] + [("sparsespec-l", n) for n in (1, 2, 3, 4, 9)]


@pytest.mark.parametrize("method, max_new_tokens", MAX_NEW_CASES)
def test_max_new_tokens_is_exact_and_draft_is_clipped(engine, method, max_new_tokens):
    prompt = engine.tokenizer(COUNTING).input_ids
    ar = engine.generate([prompt], method="ar", max_new_tokens=max_new_tokens, ignore_eos=True)[0]
    out = engine.generate([prompt], method=method, method_options=method_options(method, k=4),
                          max_new_tokens=max_new_tokens, ignore_eos=True)[0]
    assert len(out.token_ids) == max_new_tokens and out.token_ids == ar.token_ids
    assert out.finish_reason == "length"
    # each step drafts at most (remaining budget - 1): no draft is ever wasted past the budget
    hist = {tuple(map(int, key.split(":"))): n for key, n in out.stats["accept_hist"].items()}
    assert out.stats["num_drafted"] <= max(0, max_new_tokens - 2) * 4 and all(kk <= 4 for kk, _ in hist)


# sparsespec-l on the real model (batch 2: row 0 is checked as at batch 1, and the other row must
# not be disturbed); every method at batch 1 and 2 on the tiny model
@pytest.mark.parametrize("method, batch", [("sparsespec-l", 2)])
def test_eos_at_every_offset_of_an_accepted_block(engine, method, batch):
    prompt = engine.tokenizer(COUNTING).input_ids
    ref = engine.generate([prompt], method="ar", max_new_tokens=12, ignore_eos=True)[0].token_ids
    other = engine.tokenizer("The quick brown fox").input_ids
    for offset in range(1, 9):  # declare the token the model emits at `offset` as EOS
        eos = ref[offset]
        first = ref.index(eos)
        prompts = [prompt, other][:batch]
        outs = engine.generate(prompts, method=method, method_options=method_options(method, k=8), max_new_tokens=12,
                               eos_token_ids=[eos])
        out = outs[0]
        assert out.token_ids == ref[: first + 1], offset
        assert out.finish_reason == "stop"
        s = out.stats
        assert s["num_emitted"] == len(out.token_ids) - 1  # nothing after the stop is counted
        assert s["num_accepted"] <= s["num_emitted"]
        if batch == 2:  # the other row is not disturbed by the first one leaving the batch
            solo = engine.generate([other], method="ar", max_new_tokens=12, eos_token_ids=[eos])[0]
            assert outs[1].token_ids == solo.token_ids


def test_stop_string_completed_mid_block(engine):
    prompt = engine.tokenizer(COUNTING).input_ids
    ref = engine.generate([prompt], method="ar", max_new_tokens=16, ignore_eos=True)[0]
    full = ref.text
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # a string the model completes mid-output
    out = engine.generate([prompt], method="sparsespec-l", method_options={"k": 8}, max_new_tokens=16, stop=[stop])[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]
    assert ref.token_ids[: len(out.token_ids)] == out.token_ids
    assert engine.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True).find(stop) < 0
    assert out.stats["num_emitted"] == len(out.token_ids) - 1


def test_streaming_yields_exactly_the_output(engine, long_prompts):
    events = list(engine.stream([long_prompts[2], COUNTING], method="sparsespec-l", method_options={"k": 4},
                                max_new_tokens=10, stop=[" eleven"]))
    finals = {e.row: e.output for e in events if e.finished}
    for row in (0, 1):
        toks = [t for e in events if e.row == row for t in e.token_ids]
        text = "".join(e.text for e in events if e.row == row)
        assert toks == finals[row].token_ids and text == finals[row].text
        assert [e.finished for e in events if e.row == row][-1]  # nothing after the final event


@pytest.fixture(scope="module")
def short_prompts(engine):
    """Two prompts of ~300 tokens: past the budget floor (128), a third of the long ones' prefill."""
    tok = engine.tokenizer
    return [book_prompt(tok, 2000, 300, "Summarise the text above."),
            book_prompt(tok, 5000, 250, "Who is speaking in the last paragraph?")]


@pytest.mark.parametrize("method", ["sparsespec-l"])  # every method on the tiny model
def test_sampling_is_seeded_and_drafts(engine, short_prompts, method):
    kw = dict(method=method, method_options=method_options(method, k=4), max_new_tokens=16, temperature=0.8,
              top_p=0.9, top_k=50, ignore_eos=True)
    a = engine.generate(short_prompts, seed=7, **kw)
    b = engine.generate(short_prompts, seed=7, **kw)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(o.stats["num_drafted"] > 0 and len(o.token_ids) == 16 for o in a)
    c = engine.generate(short_prompts, seed=8, **kw)
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_string_prompts_and_text(engine):
    out = engine.generate(["Hello, my name is"], method="sparsespec-l", max_new_tokens=5, ignore_eos=True)[0]
    assert isinstance(out.text, str) and out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="magic"), "unknown method 'magic'"),
        (dict(method="sparsespec-L"), "did you mean 'sparsespec-l'"),
        (dict(method_options={"k": 0}), "k must be"),
        (dict(method_options={"k": "fast"}), "k must be"),
        (dict(method_options={"kk": 3}), "unknown method_options"),
        (dict(method_options={"budget_frac": 1.5}), "budget_frac"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(seed=-3), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(eos_token_ids=[-1]), "eos_token_ids"),
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


def test_unknown_dtype():
    with pytest.raises(ValueError, match="dtype"):
        Engine.from_pretrained("smollm2-135m", dtype="int3")


def test_context_limit_exact_fit_truncation_and_error(engine):
    import dataclasses

    model = engine.model
    saved = model.cfg
    model.cfg = dataclasses.replace(saved, max_position_embeddings=300)  # a small window, same weights
    try:
        prompt = engine.tokenizer(COUNTING * 40).input_ids[:290]
        ar = engine.generate([prompt], method="ar", max_new_tokens=10, ignore_eos=True)[0]
        out = engine.generate([prompt], method="sparsespec-l", method_options={"k": 8}, max_new_tokens=10,
                              ignore_eos=True)[0]  # prompt + generation fills the window exactly
        assert out.token_ids == ar.token_ids and len(out.token_ids) == 10 and out.stats["num_drafted"] > 0
        longer = engine.tokenizer(COUNTING * 40).input_ids[:295]
        with pytest.raises(ValueError, match="context window"):
            engine.generate([longer], method="ar", max_new_tokens=10)
        cut = engine.generate([longer], method="ar", max_new_tokens=10, ignore_eos=True, truncate_prompt=True)[0]
        assert cut.stats["num_prompt_tokens"] == 290
        assert cut.token_ids == engine.generate([longer[5:]], method="ar", max_new_tokens=10, ignore_eos=True)[0].token_ids
    finally:
        model.cfg = saved


def test_zero_accept_steps_and_throughput_accounting(engine):
    prompt = book_prompt(engine.tokenizer, 9000, 1000, "Repeat the first sentence of the text above.")
    out = engine.generate([prompt], method="sparsespec-l", method_options={"k": 8}, max_new_tokens=24,
                          ignore_eos=True)[0]
    s = out.stats
    hist = {tuple(map(int, key.split(":"))): n for key, n in s["accept_hist"].items()}
    assert any(a == 0 for _, a in hist), "this prompt has steps that accept nothing (alpha ~0.2)"
    assert s["num_emitted"] == len(out.token_ids) - 1  # every token but the first came from a step
    assert s["num_accepted"] + s["num_steps"] == s["num_emitted"]  # accepted + one recovered/bonus each
    d = derive(s)
    assert d["tokens_per_s"] == pytest.approx(len(out.token_ids) / s["total_s"])
