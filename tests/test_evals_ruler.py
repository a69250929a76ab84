"""evals.ruler: the 13 RULER tasks -- official templates/configs, length fitting at 2K/4K/8K with the
real SmolLM2 tokenizer, answers present, scoring, determinism, errors, and re-scoring of official
prediction files (CPU)."""
from __future__ import annotations

import collections
import json
import re
import sys
import types
from pathlib import Path

import pytest

from evals.benchmarks import ruler
from evals.base import Sample

ROOT = Path(__file__).resolve().parents[1]
BOOKS = ROOT.parent / "shared" / "data" / "public_domain_books"
HOTPOT = ROOT / "tests" / "data" / "ruler_hotpotqa_tiny.json"
LENGTHS = (2048, 4096, 8192)

# Largest allowed gap (tokens) between prompt + tokens_to_generate and the target: about one
# haystack unit for SmolLM2 (the official binary search's granularity). Every sample is also checked
# to be maximal: one more unit would overflow the target.
TOLERANCE = {
    "niah_single_1": 32,  # one noise sentence (25 tokens)
    "niah_single_2": 16, "niah_single_3": 16, "niah_multikey_1": 16,  # one essay word
    "niah_multivalue": 16, "niah_multiquery": 16,
    "niah_multikey_2": 32,  # one distractor needle, word key + number (~25 tokens)
    "niah_multikey_3": 96,  # one distractor needle, uuid key + uuid value (~85 tokens)
    "vt": 32,  # one noise sentence
    "cwe": 32,  # one more word = freq_ucw more list entries
    "fwe": 32,  # one more unit of the zipf counts (the official steps by target // 32 words)
    "qa_1": 200,  # one SQuAD document of the fixture (<= 172 tokens)
    "qa_2": 64,  # one HotpotQA paragraph of the fixture
}

# ------------------------------------------------------------------------------------------------
# The official strings, copied from NVIDIA/RULER scripts/data/synthetic/constants.py (TASKS),
# niah.py, variable_tracking.py and qa.py.
# ------------------------------------------------------------------------------------------------
OFFICIAL = {
    "niah": {
        "tokens_to_generate": 128,
        "template": """Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?""",
        "answer_prefix": """ The special magic {type_needle_v} for {query} mentioned in the provided text are""",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": """Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.""",
        # "assigned" since upstream commit 4a216f4 ("fix typo", 2025-05-13); it read "assgined" before
        "answer_prefix": """ Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: """,
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": """Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?""",
        "answer_prefix": """ Answer: The top 10 words that appear most often in the list are:""",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": """Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?""",
        "answer_prefix": """ Answer: According to the coded text above, the three most frequently appeared words are:""",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": """Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}""",
        "answer_prefix": """ Answer:""",
    },
}
OFFICIAL_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
OFFICIAL_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
OFFICIAL_DOCUMENT_PROMPT = "Document {i}:\n{document}"

# scripts/synthetic.yaml (the 13 tasks)
OFFICIAL_YAML = {
    "niah_single_1": ("niah", dict(type_haystack="noise", type_needle_k="words", type_needle_v="numbers", num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_single_2": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_single_3": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="uuids", num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_1": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_k=4, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_2": ("niah", dict(type_haystack="needle", type_needle_k="words", type_needle_v="numbers", num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_3": ("niah", dict(type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids", num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multivalue": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_k=1, num_needle_v=4, num_needle_q=1)),
    "niah_multiquery": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_k=1, num_needle_v=1, num_needle_q=4)),
    "vt": ("variable_tracking", dict(num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}


@pytest.fixture(scope="session")
def smol_tokenizer():
    from sparsespec import load_tokenizer

    return load_tokenizer("smollm2-135m")


def _ns(**kw):
    base = dict(tasks=None, num_samples=None, context_length=None, seed=None, haystack=None, max_new_tokens=None,
                qa_data=None, qa2_data=None)
    base.update(kw)
    return base


_SHARED = ("tasks", "num_samples", "max_new_tokens", "context_length")


def _build(tokenizer, ns, window):
    """``ruler.benchmark.build_samples`` from a flat dict of shared arguments + options."""
    kw = dict(vars(ns) if isinstance(ns, types.SimpleNamespace) else ns)
    shared = {k: kw.pop(k) for k in _SHARED if k in kw}
    return ruler.benchmark.build_samples(tokenizer, window=window, options=kw, **shared)


@pytest.fixture(scope="module")
def all_samples(smol_tokenizer):
    """One sample of every task at 2K, 4K and 8K (~4 s)."""
    return {
        ctx: {s.task: s for s in _build(
            smol_tokenizer, _ns(tasks="all", num_samples=1, context_length=ctx, qa2_data=str(HOTPOT)), 8192)}
        for ctx in LENGTHS
    }


def _text(tok, sample: Sample) -> str:
    return tok.decode(list(sample.prompt_ids))


# ------------------------------------------------------------------------------------------------
# Official strings and configs
# ------------------------------------------------------------------------------------------------


def test_vt_answer_prefix_is_the_current_upstream_string():
    """NVIDIA/RULER scripts/data/synthetic/constants.py at c3f5e3b (the typo "assgined" was fixed
    upstream in 4a216f4): the exact string, and the rendered prefix of a vt sample."""
    upstream = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                "variables are assigned the value {query}, they are: ")
    assert ruler.VT_ANSWER_PREFIX == upstream
    assert ruler.TASKS["variable_tracking"]["answer_prefix"] == upstream
    assert "assgined" not in ruler.VT_ANSWER_PREFIX
    assert ruler._vt_format("ctx", "12345", 5)[1] == (
        " Answer: According to the chain(s) of variable assignment in the text above, 5 variables are "
        "assigned the value 12345, they are: ")


def test_templates_are_the_official_strings():
    assert set(ruler.TASKS) == set(OFFICIAL)
    for base, official in OFFICIAL.items():
        for key, value in official.items():
            assert ruler.TASKS[base][key] == value, (base, key)
    assert ruler.NIAH_TEMPLATE == OFFICIAL["niah"]["template"]
    assert ruler.NIAH_ANSWER_PREFIX == OFFICIAL["niah"]["answer_prefix"]
    assert ruler.VT_TEMPLATE == OFFICIAL["variable_tracking"]["template"]
    assert ruler.VT_ANSWER_PREFIX == OFFICIAL["variable_tracking"]["answer_prefix"]
    assert ruler.CWE_TEMPLATE == OFFICIAL["common_words_extraction"]["template"]
    assert ruler.CWE_ANSWER_PREFIX == OFFICIAL["common_words_extraction"]["answer_prefix"]
    assert ruler.FWE_TEMPLATE == OFFICIAL["freq_words_extraction"]["template"]
    assert ruler.FWE_ANSWER_PREFIX == OFFICIAL["freq_words_extraction"]["answer_prefix"]
    assert ruler.QA_TEMPLATE == OFFICIAL["qa"]["template"]
    assert ruler.QA_ANSWER_PREFIX == OFFICIAL["qa"]["answer_prefix"]
    assert ruler.NEEDLE == OFFICIAL_NEEDLE
    assert ruler.NOISE_HAYSTACK == OFFICIAL_NOISE
    assert ruler.DOCUMENT_PROMPT == OFFICIAL_DOCUMENT_PROMPT
    metrics = {b: ruler.TASKS[b]["metric"] for b in ruler.TASKS}
    assert metrics == {"niah": "string_match_all", "variable_tracking": "string_match_all",
                       "common_words_extraction": "string_match_all", "freq_words_extraction": "string_match_all",
                       "qa": "string_match_part"}


def test_task_configs_are_the_official_yaml():
    assert tuple(OFFICIAL_YAML) == ruler.ALL_TASKS
    for task, (base, args) in OFFICIAL_YAML.items():
        cfg = ruler.TASK_CONFIGS[task]
        assert ruler.base_task(task) == base == cfg.base_task
        for key, value in args.items():
            assert getattr(cfg, key) == value, (task, key)
        assert ruler.tokens_to_generate(task) == OFFICIAL[base]["tokens_to_generate"]
    assert ruler.TASK_CONFIGS["vt"].type_haystack == "noise"  # variable_tracking.py default
    assert ruler.DEFAULT_TASKS == ("niah_single_1", "niah_single_2", "niah_single_3")


def test_depths_match_numpy_linspace():
    import numpy as np

    assert list(ruler.DEPTHS) == [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]


def test_single_needle_rewrite_of_the_official_template():
    single = ruler.single_needle_template(ruler.NIAH_TEMPLATE + ruler.NIAH_ANSWER_PREFIX).format(
        type_needle_v="number", context="CTX", query="KEY"
    )
    assert single == (
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\nCTX\n"
        "What is the special magic number for KEY mentioned in the provided text?"
        " The special magic number for KEY mentioned in the provided text is"
    )


def test_zeta_matches_closed_forms():
    import math

    assert ruler._zeta(2.0) == pytest.approx(math.pi**2 / 6, rel=1e-15)
    assert ruler._zeta(4.0) == pytest.approx(math.pi**4 / 90, rel=1e-15)
    assert ruler._zeta(1.5) == pytest.approx(2.612375348685488, rel=1e-14)


# ------------------------------------------------------------------------------------------------
# Length, answers and scoring for every task at 2K/4K/8K
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ctx", LENGTHS)
def test_every_task_fits_the_target_tightly(all_samples, ctx):
    samples = all_samples[ctx]
    assert tuple(samples) == ruler.ALL_TASKS
    for task, s in samples.items():
        total = s.num_input_tokens + s.max_new_tokens
        assert s.max_new_tokens == ruler.tokens_to_generate(task)
        assert s.num_input_tokens == len(s.prompt_ids) == s.num_input_tokens_raw
        assert s.meta["total_tokens"] == total and s.meta["context_length"] == ctx
        assert total <= ctx, (task, total)
        assert ctx - total <= TOLERANCE[task], (task, ctx - total)
        # maximal: one more haystack unit would not fit
        assert s.meta["total_tokens_next_unit"] > ctx, task


@pytest.mark.parametrize("ctx", LENGTHS)
def test_every_task_contains_its_answers(smol_tokenizer, all_samples, ctx):
    for task, s in all_samples[ctx].items():
        text = _text(smol_tokenizer, s)
        assert s.references, task
        if task.startswith("qa"):
            assert any(r in text for r in s.references), task
        else:
            missing = [r for r in s.references if r not in text]
            assert not missing, (task, missing)
        # chat template first, then the official answer prefix as the start of the reply
        assert "<|im_start|>assistant\n " in text[-400:], task
        assert text.count("<|im_start|>assistant\n") == (2 if task == "cwe" else 1), task


@pytest.mark.parametrize("ctx", LENGTHS)
def test_every_task_scores_correct_and_wrong_answers(all_samples, ctx):
    for task, s in all_samples[ctx].items():
        refs = list(s.references)
        if task.startswith("qa"):
            assert ruler.score_sample(s, f" {refs[0].upper()}\n") == 1.0, task
            assert ruler.score_sample(s, "I do not know.") == 0.0, task
        else:
            assert ruler.score_sample(s, " " + ", ".join(refs) + ".\x00") == 1.0, task
            assert ruler.score_sample(s, "\n" + " ".join(r.upper() for r in refs)) == 1.0, task
            assert ruler.score_sample(s, "qqqqqqq") == 0.0, task
            if len(refs) > 1:
                assert ruler.score_sample(s, refs[0]) == pytest.approx(1 / len(refs)), task


def test_niah_prompts(smol_tokenizer, all_samples):
    samples = all_samples[4096]
    for task in [t for t in ruler.ALL_TASKS if t.startswith("niah")]:
        s, cfg = samples[task], ruler.TASK_CONFIGS[task]
        text = _text(smol_tokenizer, s)
        v, q = cfg.type_needle_v, s.meta["query"]
        for needle in s.meta["needles"]:
            assert text.count(needle) == 1, task
        assert len(s.meta["needles"]) == max(cfg.num_needle_k, cfg.num_needle_q) * cfg.num_needle_v
        if cfg.num_needle_q * cfg.num_needle_v == 1:
            single = v[:-1]
            assert f"A special magic {single} is hidden within the following text." in text
            assert f"\nWhat is the special magic {single} for {q} mentioned in the provided text?<|im_end|>" in text
            assert text.endswith(f"<|im_start|>assistant\n The special magic {single} for {q} mentioned in the provided text is")
            assert len(s.references) == 1
        else:
            assert f"Some special magic {v} are hidden within the following text." in text
            assert text.endswith(f"<|im_start|>assistant\n The special magic {v} for {q} mentioned in the provided text are")
        if cfg.type_haystack == "noise":
            assert ruler.NOISE_HAYSTACK + "\n" + ruler.NOISE_HAYSTACK in text
        else:
            assert ruler.NOISE_HAYSTACK not in text
        if cfg.type_haystack == "needle":  # distractor needles, one per line, none with the query key
            lines = [ln for ln in text.split("\n") if ln.startswith("One of the special magic")]
            assert len(lines) == s.meta["num_haystack"] + 1
            assert sum(f" for {q} is: " in ln for ln in lines) == 1
    mq = samples["niah_multiquery"]
    assert len(mq.meta["queries"]) == 4 and len(set(mq.meta["queries"])) == 4
    assert mq.meta["query"] == ", ".join(mq.meta["queries"][:3]) + ", and " + mq.meta["queries"][3]
    mv = samples["niah_multivalue"]
    assert all(f" for {mv.meta['query']} is: {v}." in n for n, v in zip(sorted(mv.meta["needles"]), sorted(mv.references)))


def test_value_and_key_formats(all_samples):
    nouns, adjs, verbs = ruler._wonderwords()
    assert (len(nouns), len(adjs), len(verbs)) == (6786, 912, 1042)  # wonderwords 2.2.0's lists
    assert len(ruler._cwe_words()) == 8169  # sorted(set(nouns + adjs + verbs))
    nouns, adjs = set(nouns), set(adjs)
    uuid4 = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    for s in all_samples[2048].values():
        cfg = ruler.TASK_CONFIGS[s.task]
        if not isinstance(cfg, ruler.NiahConfig):
            continue
        for value in s.references:
            assert re.fullmatch(uuid4 if cfg.type_needle_v == "uuids" else r"[1-9]\d{6}", value), s.task
        for key in s.meta["queries"]:
            if cfg.type_needle_k == "uuids":
                assert re.fullmatch(uuid4, key)
            else:  # adjective-noun from wonderwords' lists (some entries contain '-' themselves)
                assert any(key[: i] in adjs and key[i + 1:] in nouns for i, c in enumerate(key) if c == "-"), key


def test_vt_chain_and_one_shot_example(smol_tokenizer, all_samples):
    for ctx in LENGTHS:
        s = all_samples[ctx]["vt"]
        text = _text(smol_tokenizer, s)
        names, value = list(s.references), s.meta["query"]
        assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
        assert f"VAR {names[0]} = {value}\n" in text
        for a, b in zip(names, names[1:]):
            assert f"VAR {b} = VAR {a} \n" in text  # the official trailing space survives
        # the one-shot example sits in the user turn before the task, with its answer
        user = text.split("<|im_start|>user\n", 1)[1]
        assert user.count("Memorize and track the chain(s)") == 2
        example, task = user.split("\n\nMemorize and track the chain(s)", 1)
        assert re.search(r"they are:  [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3}$", example)
        assert "12345" not in example and value not in example
        assert "5 variables are assigned the value" in example
        assert text.endswith(f"<|im_start|>assistant\n Answer: According to the chain(s) of variable assignment "
                             f"in the text above, 5 variables are assigned the value {value}, they are: ")
        assert len(smol_tokenizer(example)["input_ids"]) <= 520


def test_cwe_counts_and_few_shot(smol_tokenizer, all_samples):
    for ctx in LENGTHS:
        s = all_samples[ctx]["cwe"]
        text = _text(smol_tokenizer, s)
        common_repeats, uncommon_repeats = (6, 1) if ctx < 4096 else (30, 3)
        last_user = text.rsplit("<|im_start|>user\n", 1)[1]
        listing = last_user.split("\n")[1]
        entries = re.findall(r"(\d+)\. (.+?)(?= \d+\. |$)", listing)
        assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
        counts = collections.Counter(w for _, w in entries)
        assert {w: counts[w] for w in s.references} == {w: common_repeats for w in s.references}
        assert set(counts.values()) == {common_repeats, uncommon_repeats}
        assert len(counts) == s.meta["num_haystack"]
        # one few-shot example: the full chat-templated prompt, answer prefix and its numbered answer
        first = text.split("\n<|im_start|>system", 1)[0]
        assert re.search(r"<\|im_start\|>assistant\n Answer: The top 10 words that appear most often in the list are:"
                         r" 1\. \S+( \d+\. \S+){9}$", first)
        # 20 words x3/x1 below 4096 target tokens (40 entries), else 40 words x10/x3 (190 entries)
        example = first.split("<|im_start|>user\n", 1)[1].split("\n")[1]
        assert len(re.findall(r"\d+\. ", example)) == (40 if ctx < 4096 else 190)


def test_fwe_answers_are_the_most_frequent_coded_words(smol_tokenizer, all_samples):
    for ctx in LENGTHS:
        s = all_samples[ctx]["fwe"]
        text = _text(smol_tokenizer, s)
        body = text.split("Find the three most frequently appeared coded words. ", 1)[1].split("\nQuestion:", 1)[0]
        counts = collections.Counter(body.split(" "))
        ranked = [w for w, _ in counts.most_common()]
        assert ranked[0] == "..."
        assert ranked[1:4] == list(s.references)
        assert counts[ranked[3]] > counts[ranked[4]]
        assert all(re.fullmatch(r"[a-z]{6}", w) for w in ranked[1:])
        assert s.meta["vocab_size"] == (ctx - 50) // 50


def test_qa_prompts(smol_tokenizer, all_samples):
    squad = json.loads(ruler.DEFAULT_SQUAD_PATH.read_text())
    paragraphs = [p["context"] for a in squad["data"] for p in a["paragraphs"]]
    for ctx in LENGTHS:
        s = all_samples[ctx]["qa_1"]
        text = _text(smol_tokenizer, s)
        docs = re.findall(r"Document (\d+):\n(.*?)(?=\n\nDocument \d+:\n|\n\nAnswer the question)", text, re.S)
        assert [int(i) for i, _ in docs] == list(range(1, s.meta["num_haystack"] + 1))
        assert {d for _, d in docs} == set(paragraphs)  # the fixture's 2 paragraphs, repeated as upstream
        assert s.meta["query"] == "To whom did the Virgin Mary allegedly appear in 1858 in Lourdes France?"
        assert text.endswith(f"Question: {s.meta['query']}<|im_end|>\n<|im_start|>assistant\n Answer:")
        hp = all_samples[ctx]["qa_2"]
        hp_text = _text(smol_tokenizer, hp)
        assert hp.references == ("the Selwick River",)
        assert "Document 1:\n" in hp_text and "Harrowgate workshop\nThe Harrowgate workshop is" in hp_text


def test_qa_questions_in_file_order_and_small_dataset_limits(smol_tokenizer, tmp_path):
    samples = _build(smol_tokenizer, _ns(tasks="qa_2", num_samples=3, context_length=1024,
                                                      qa2_data=str(HOTPOT)), 8192)
    assert [s.references for s in samples] == [("the Selwick River",), ("the viola",), ("1934",)]
    with pytest.raises(ValueError, match="has only 3 answerable questions"):
        ruler.generate_sample(smol_tokenizer, "qa_2", 1024, 3, qa2_data=HOTPOT)
    # SQuAD fixture: 6 questions, 1 unanswerable -> 5
    assert len(ruler.load_qa_dataset(ruler.DEFAULT_SQUAD_PATH, "squad").qas) == 5
    with pytest.raises(ValueError, match="has only 5 answerable questions"):
        ruler.generate_sample(smol_tokenizer, "qa_1", 1024, 5)


# ------------------------------------------------------------------------------------------------
# Determinism, sample ids, overrides, haystacks
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_2", "vt", "cwe", "fwe", "qa_1"])
def test_deterministic_for_a_seed(smol_tokenizer, task):
    a = ruler.generate_sample(smol_tokenizer, task, 2048, 1, seed=7, num_samples=3)
    b = ruler.generate_sample(smol_tokenizer, task, 2048, 1, seed=7, num_samples=3)
    c = ruler.generate_sample(smol_tokenizer, task, 2048, 1, seed=8, num_samples=3)
    assert a == b
    assert a.prompt_ids != c.prompt_ids
    if task != "qa_1":  # qa: question i for sample i, whatever the seed
        assert a.references != c.references


def test_needles_do_not_depend_on_the_context_length(smol_tokenizer):
    a = ruler.generate_sample(smol_tokenizer, "niah_single_2", 2048, 1, seed=7, num_samples=3)
    d = ruler.generate_sample(smol_tokenizer, "niah_single_2", 3000, 1, seed=7, num_samples=3)
    assert d.references == a.references and d.sample_id != a.sample_id


def test_depth_spread_over_samples(smol_tokenizer):
    assert [ruler.depth_for_index(i, 4) for i in range(4)] == [12, 38, 62, 88]
    assert ruler.depth_for_index(0, 1) == 50
    for task in ("niah_single_1", "niah_single_2", "niah_multikey_2"):
        positions = []
        for i in range(3):
            s = ruler.generate_sample(smol_tokenizer, task, 2048, i, seed=1, num_samples=3)
            text = smol_tokenizer.decode(list(s.prompt_ids))
            start = text.index("afterwards.\n") + len("afterwards.\n")
            end = text.rindex("\nWhat is the special magic")
            positions.append((text.index(s.meta["needle"]) - start) / (end - start))
        assert positions == sorted(positions)
        for pos, depth in zip(positions, (17, 50, 83)):
            assert abs(pos - depth / 100) < 0.1, (task, positions)


def test_build_samples_defaults_ids_and_max_new_tokens_override(smol_tokenizer):
    samples = _build(smol_tokenizer, _ns(num_samples=1, context_length=1024), 8192)
    assert [s.task for s in samples] == list(ruler.DEFAULT_TASKS)
    samples = _build(
        smol_tokenizer, _ns(tasks="niah_single_1,fwe", num_samples=3, context_length=1024, max_new_tokens=32), 8192
    )
    assert len({(s.task, s.sample_id) for s in samples}) == 6
    for s in samples:
        assert s.max_new_tokens == 32
        assert 1024 - TOLERANCE[s.task] <= s.num_input_tokens + 32 <= 1024


def test_no_chat_template_gives_the_base_prompt(smol_tokenizer):
    s = ruler.generate_sample(smol_tokenizer, "qa_1", 1024, 0, use_chat_template=False)
    text = smol_tokenizer.decode(list(s.prompt_ids))
    assert text.startswith("Answer the question based on the given documents.") and "<|im_start|>" not in text
    assert text.endswith("Question: To whom did the Virgin Mary allegedly appear in 1858 in Lourdes France? Answer:")
    assert s.meta["total_tokens"] <= 1024


def test_gutenberg_haystack(smol_tokenizer):
    book = BOOKS / "35-0.txt"
    if not book.is_file():
        pytest.skip(f"no {book}")
    words = ruler.load_haystack_words(book)
    assert "GUTENBERG" not in " ".join(words[:50]).upper()
    s = ruler.generate_sample(smol_tokenizer, "niah_single_3", 2048, 0, seed=3, haystack=book)
    text = smol_tokenizer.decode(list(s.prompt_ids))
    assert "START OF THIS PROJECT GUTENBERG" not in text
    assert "Time Traveller" in text
    assert s.meta["needle"] in text
    assert 2048 - TOLERANCE["niah_single_3"] <= s.meta["total_tokens"] <= 2048


def test_strip_gutenberg():
    raw = "\ufeffheader\r\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\nbody text.\r\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nlicense"
    assert ruler.strip_gutenberg(raw).strip() == "body text."
    assert ruler.strip_gutenberg("no markers") == "no markers"


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def test_errors(smol_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="did you mean 'niah_single_1'"):
        _build(smol_tokenizer, _ns(tasks="niah_single1"), 8192)
    with pytest.raises(ValueError, match="exceeds the model window"):
        _build(smol_tokenizer, _ns(context_length=16384), 8192)
    with pytest.raises(ValueError, match="too small"):
        ruler.generate_sample(smol_tokenizer, "niah_single_1", 150, 0)
    with pytest.raises(ValueError, match="qa_2: context_length=300 is too small"):
        ruler.generate_sample(smol_tokenizer, "qa_2", 300, 0, qa2_data=HOTPOT)
    with pytest.raises(FileNotFoundError, match="--haystack"):
        ruler.generate_sample(smol_tokenizer, "niah_single_2", 2048, 0, haystack="/nonexistent/book.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*\.txt files"):
        ruler.generate_sample(smol_tokenizer, "niah_single_2", 2048, 0, haystack=empty)
    with pytest.raises(ValueError, match="single-needle"):
        ruler.generate_sample(smol_tokenizer, "niah_multivalue", 2048, 0, depth_percent=50)


def test_cwe_word_pool_limit_is_a_clear_error(smol_tokenizer, monkeypatch):
    monkeypatch.setattr(ruler, "_cwe_words", lambda: tuple(f"w{i:03d}" for i in range(60)))
    with pytest.raises(ValueError, match="cwe needs more than the 60 distinct wonderwords words"):
        ruler.generate_sample(smol_tokenizer, "cwe", 8192, 0)


def test_vt_with_essay_haystack(smol_tokenizer, monkeypatch):
    monkeypatch.setitem(ruler.TASK_CONFIGS, "vt", ruler.VtConfig(num_chains=2, num_hops=3, type_haystack="essay"))
    s = ruler.generate_sample(smol_tokenizer, "vt", 2048, 0)
    text = smol_tokenizer.decode(list(s.prompt_ids))
    names, value = s.references, s.meta["query"]
    assert len(names) == 4 and len(s.meta["chains"]) == 2
    assert f"VAR {names[0]} = {value}." in text and f"VAR {names[1]} = VAR {names[0]}." in text
    assert ruler.NOISE_HAYSTACK not in text
    assert 2048 - 16 <= s.meta["total_tokens"] <= 2048 < s.meta["total_tokens_next_unit"]


def test_qa_file_errors(smol_tokenizer, tmp_path):
    # qa_2 has no default file: a clear error, before anything is generated
    with pytest.raises(FileNotFoundError, match="--qa2-data"):
        _build(smol_tokenizer, _ns(tasks="niah_single_1,qa_2", num_samples=1), 8192)
    with pytest.raises(FileNotFoundError, match="--qa2-data"):
        _build(smol_tokenizer, _ns(tasks="all", num_samples=1), 8192)
    with pytest.raises(FileNotFoundError, match="no such file"):
        ruler.generate_sample(smol_tokenizer, "qa_2", 2048, 0, qa2_data=tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match="--qa-data"):
        ruler.generate_sample(smol_tokenizer, "qa_1", 2048, 0, qa_data=tmp_path / "missing.json")

    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"data": [\n  {"paragraphs": }\n]}')
    with pytest.raises(ValueError, match=r"bad\.json: not valid JSON \(line 2"):
        ruler.generate_sample(smol_tokenizer, "qa_1", 2048, 0, qa_data=bad_json)

    cases = {
        "squad": [
            ({"version": "v2.0"}, r"the top level has no 'data' field"),
            ({"data": [{"title": "x"}]}, r"data\[0\] has no 'paragraphs' field"),
            ({"data": [{"paragraphs": [{"context": "c", "qas": [{"id": "1", "answers": [], "is_impossible": False}]}]}]},
             r"data\[0\]\.paragraphs\[0\]\.qas\[0\] has no 'question' field"),
            ({"data": [{"paragraphs": [{"context": "c", "qas": [{"question": "q", "answers": [], "is_impossible": False}]}]}]},
             r"answerable but has no answers"),
            ({"data": [{"paragraphs": [{"context": "c", "qas": [{"question": "q", "answers": [], "is_impossible": True}]}]}]},
             r"no answerable questions"),
        ],
        "hotpotqa": [
            ({"data": []}, r"a HotpotQA file is a JSON list"),
            ([{"question": "q", "context": [["t", ["s"]]]}], r"\[0\] has no 'answer' field"),
            ([{"question": "q", "answer": "a", "context": [["t", "not a list"]]}], r"\[0\]\.context\[0\] must be \[title, \[sentence"),
            ([{"question": "q", "answer": "a", "context": []}], r"\[0\]\.context is empty"),
        ],
    }
    for dataset, items in cases.items():
        for i, (content, message) in enumerate(items):
            path = tmp_path / f"{dataset}{i}.json"
            path.write_text(json.dumps(content))
            task, key = ("qa_1", "qa_data") if dataset == "squad" else ("qa_2", "qa2_data")
            with pytest.raises(ValueError, match=message) as info:
                ruler.generate_sample(smol_tokenizer, task, 2048, 0, **{key: path})
            assert str(path.name) in str(info.value)


def test_squad_1_1_files_without_is_impossible_are_read(tmp_path):
    path = tmp_path / "squad11.json"
    path.write_text(json.dumps({"data": [{"paragraphs": [
        {"context": "Paris is in France.", "qas": [{"question": "Where is Paris?", "answers": [{"text": "France"}]}]},
        {"context": "Rome is in Italy.", "qas": [{"question": "Where is Rome?", "answers": [{"text": "Italy"}, {"text": "Italy"}]}]},
    ]}]}))
    ds = ruler.load_qa_dataset(path, "squad")
    assert ds.docs == ("Paris is in France.", "Rome is in Italy.")  # sorted unique paragraphs
    assert [(q.query, q.outputs, q.context, q.more_context) for q in ds.qas] == [
        ("Where is Paris?", ("France",), (0,), (1,)),
        ("Where is Rome?", ("Italy", "Italy"), (1,), (0,)),
    ]


# ------------------------------------------------------------------------------------------------
# Re-scoring official prediction files (scripts/pred/call_api.py lines, scripts/eval/evaluate.py)
# ------------------------------------------------------------------------------------------------


def _record(index, pred, outputs, **extra):
    rec = {"index": index, "pred": pred, "input": "...", "outputs": outputs, "others": {}, "truncation": -1,
           "length": 4096}
    rec.update(extra)
    return rec


def test_score_prediction_records_official_scale():
    recs = [
        _record(0, " 1234567.", ["1234567"]),
        _record(1, "12\x0034567 and 7654321", ["1234567", "7654321"]),  # control char -> newline: 1 of 2
        _record(2, "nothing", ["1111111"]),
    ]
    assert ruler.score_prediction_records("niah_multivalue", recs) == {"task": "niah_multivalue", "score": 50.0, "n": 3}
    # qa: string_match_part (any reference)
    qa = [_record(0, " the VIOLA", ["viola", "cello"]), _record(1, "a cello", ["violin"]), _record(2, "x", ["x"])]
    assert ruler.score_prediction_records("qa_2", qa) == {"task": "qa_2", "score": 66.67, "n": 3}
    # the same lines under string_match_all: (0.5 + 0 + 1) / 3
    assert ruler.score_prediction_records("vt", qa)["score"] == 50.0
    # 'output' fallback and missing 'others' are accepted
    assert ruler.score_prediction_records("cwe", [{"index": 0, "pred": "a b", "output": "b"}])["score"] == 100.0
    # evaluate.py: no lines, or a null first reference, score 0.0
    assert ruler.score_prediction_records("fwe", []) == {"task": "fwe", "score": 0.0, "n": 0}
    assert ruler.score_prediction_records("fwe", [_record(0, "x", [None])])["score"] == 0.0
    # empty predictions stay in the denominator
    assert ruler.score_prediction_records("qa_1", [_record(0, "", ["a"]), _record(1, "a", ["a"])])["score"] == 50.0
    # round(sum / n * 100, 2) as the official metric_fn
    assert ruler.score_prediction_records("niah_single_1", [_record(i, "7", ["7" if i == 0 else "8"]) for i in range(3)])[
        "score"] == 33.33


def test_score_prediction_records_errors():
    with pytest.raises(ValueError, match="did you mean 'niah_single_1'"):
        ruler.score_prediction_records("niah_single1", [])
    with pytest.raises(ruler.RecordError, match=r"record 1: no 'pred' field \(vt, index 7\)") as info:
        ruler.score_prediction_records("vt", [_record(0, "a", ["a"]), {"index": 7, "outputs": ["a"]}])
    assert info.value.index == 1 and isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="'pred' must be a string"):
        ruler.score_prediction_records("vt", [_record(0, None, ["a"])])
    with pytest.raises(ValueError, match="non-empty list of strings"):
        ruler.score_prediction_records("vt", [_record(0, "a", [])])
    with pytest.raises(ValueError, match="non-empty list of strings"):
        ruler.score_prediction_records("vt", [_record(0, "a", "abc")])
    with pytest.raises(ValueError, match="expected a JSON object"):
        ruler.score_prediction_records("vt", ["a"])


def test_score_sample_uses_the_task_metric(all_samples):
    s = all_samples[2048]["qa_1"]
    qa = Sample(**{**s.__dict__, "references": ("violin", "viola")})
    assert ruler.score_sample(qa, "the viola") == 1.0  # string_match_part
    vt = all_samples[2048]["vt"]
    assert ruler.score_sample(vt, vt.references[0]) == pytest.approx(0.2)  # string_match_all


# ------------------------------------------------------------------------------------------------
# Saved samples and the script entry point
# ------------------------------------------------------------------------------------------------


def test_save_samples_and_cli_options(smol_tokenizer, tmp_path):
    import argparse

    from evals.sample_io import read_samples_jsonl

    parser = argparse.ArgumentParser()
    ruler.benchmark.add_arguments(parser)
    assert vars(parser.parse_args([])) == ruler.benchmark.option_defaults() == {
        "seed": 42, "haystack": None, "qa_data": None, "qa2_data": None, "save_samples": None}
    out = tmp_path / "ruler.jsonl"
    opts = vars(parser.parse_args(["--seed", "5", "--qa2-data", str(HOTPOT), "--save-samples", str(out)]))
    tasks = ["niah_single_1", "vt", "qa_2"]
    ruler.benchmark.check(tasks=tasks, options=opts)
    samples = ruler.benchmark.build_samples(smol_tokenizer, window=8192, context_length=1024, tasks=tasks,
                                            num_samples=2, options=opts)
    assert [s.task for s in samples] == ["niah_single_1"] * 2 + ["vt"] * 2 + ["qa_2"] * 2
    assert all(isinstance(s, Sample) for s in samples)
    assert all(s.meta["seed"] == 5 and s.meta["context_length"] == 1024 for s in samples)
    # baseline and method read back exactly the same inputs
    assert read_samples_jsonl(out) == samples


def test_check_fails_fast(tmp_path):
    with pytest.raises(FileNotFoundError, match="qa_2 needs a HotpotQA-format JSON file"):
        ruler.benchmark.check(tasks=["qa_2"], options={})
    with pytest.raises(FileNotFoundError, match="--qa-data .*none.json|none.json not found"):
        ruler.benchmark.check(tasks=["qa_1"], options={"qa_data": str(tmp_path / "none.json")})
    with pytest.raises(FileNotFoundError, match="--haystack"):
        ruler.benchmark.check(tasks=["niah_single_2"], options={"haystack": str(tmp_path / "none")})
    with pytest.raises(ValueError, match="seed must be an integer"):
        ruler.benchmark.check(tasks=None, options={"seed": "5"})
    with pytest.raises(ValueError, match="unknown task 'fw'; did you mean 'fwe'"):
        ruler.benchmark.check(tasks=["fw"], options={})
    ruler.benchmark.check(tasks=["niah_single_1", "vt"], options={})  # noise haystacks: nothing to read
