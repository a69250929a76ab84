"""evals.ruler: niah_single_1/2/3 generation, length fitting, determinism and scoring (CPU)."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from evals import ruler
from evals.base import Sample

BOOKS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "public_domain_books"
TOLERANCE = 0.03  # prompt + max_new_tokens must land in [target * (1 - 3%), target]


@pytest.fixture(scope="session")
def smol_tokenizer():
    from sparsespec import load_tokenizer

    return load_tokenizer("smollm2-135m")


def _ns(**kw):
    base = dict(tasks=None, num_samples=None, context_length=None, seed=None, haystack=None, max_new_tokens=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.fixture(scope="module")
def samples_by_length(smol_tokenizer):
    return {
        ctx: ruler.build_samples(smol_tokenizer, _ns(context_length=ctx, num_samples=2), 8192)
        for ctx in (2048, 4096)
    }


def test_official_configs_and_template_text():
    assert ruler.TASK_CONFIGS["niah_single_1"] == ruler.NiahConfig("noise", "words", "numbers", 1, 1, 1)
    assert ruler.TASK_CONFIGS["niah_single_2"] == ruler.NiahConfig("essay", "words", "numbers", 1, 1, 1)
    assert ruler.TASK_CONFIGS["niah_single_3"] == ruler.NiahConfig("essay", "words", "uuids", 1, 1, 1)
    assert ruler.TOKENS_TO_GENERATE == 128
    assert ruler.NOISE_HAYSTACK == "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    # the official single-needle rewrite of the official template
    single = ruler.single_needle_template(ruler.NIAH_TEMPLATE + ruler.NIAH_ANSWER_PREFIX).format(
        type_needle_v="number", context="CTX", query="KEY"
    )
    assert single == (
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\nCTX\n"
        "What is the special magic number for KEY mentioned in the provided text?"
        " The special magic number for KEY mentioned in the provided text is"
    )


@pytest.mark.parametrize("ctx", [2048, 4096])
def test_prompt_length_close_to_target(samples_by_length, ctx):
    samples = samples_by_length[ctx]
    assert [s.task for s in samples] == [t for t in ruler.DEFAULT_TASKS for _ in range(2)]
    for s in samples:
        total = s.num_input_tokens + s.max_new_tokens
        assert s.max_new_tokens == 128
        assert ctx * (1 - TOLERANCE) <= total <= ctx, (s.task, total)
        assert s.meta["total_tokens"] == total and s.meta["context_length"] == ctx
        assert s.num_input_tokens == len(s.prompt_ids) == s.num_input_tokens_raw


def test_prompt_contains_needle_question_and_answer_prefix(smol_tokenizer, samples_by_length):
    for s in samples_by_length[4096]:
        text = smol_tokenizer.decode(list(s.prompt_ids))
        (value,) = s.references
        key = s.meta["query"]
        kind = "uuids" if s.task == "niah_single_3" else "numbers"
        assert f"One of the special magic {kind} for {key} is: {value}." in text
        assert text.count(value) == 1
        singular = kind[:-1]
        assert f"A special magic {singular} is hidden within the following text." in text
        assert f"\nWhat is the special magic {singular} for {key} mentioned in the provided text?<|im_end|>" in text
        # chat template first, then the official answer prefix as the start of the reply
        assert text.endswith(
            f"<|im_start|>assistant\n The special magic {singular} for {key} mentioned in the provided text is"
        )
        if s.task == "niah_single_1":
            assert ruler.NOISE_HAYSTACK + "\n" + ruler.NOISE_HAYSTACK in text
        else:
            assert ruler.NOISE_HAYSTACK not in text


def test_value_formats(samples_by_length):
    import re

    for s in samples_by_length[2048]:
        (value,) = s.references
        if s.task == "niah_single_3":
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", value)
        else:
            assert re.fullmatch(r"[1-9]\d{6}", value)
        assert re.fullmatch(r"[a-z]+-[a-z]+", s.meta["query"])


def test_score_correct_and_wrong_answers(samples_by_length):
    for s in samples_by_length[2048]:
        (value,) = s.references
        assert ruler.score_sample(s, f" {value}.") == 1.0
        assert ruler.score_sample(s, f"The special magic number is {value.upper()}\n") == 1.0
        assert ruler.score_sample(s, "I could not find it.") == 0.0
        wrong = "1234567" if value != "1234567" else "7654321"
        assert ruler.score_sample(s, wrong) == 0.0


def test_deterministic_for_a_seed(smol_tokenizer):
    a = ruler.generate_sample(smol_tokenizer, "niah_single_2", 2048, 1, seed=7, num_samples=3)
    b = ruler.generate_sample(smol_tokenizer, "niah_single_2", 2048, 1, seed=7, num_samples=3)
    c = ruler.generate_sample(smol_tokenizer, "niah_single_2", 2048, 1, seed=8, num_samples=3)
    assert a == b
    assert a.references != c.references and a.prompt_ids != c.prompt_ids
    # the needle of (task, seed, index) does not depend on the context length
    d = ruler.generate_sample(smol_tokenizer, "niah_single_2", 3000, 1, seed=7, num_samples=3)
    assert d.references == a.references and d.sample_id != a.sample_id


def test_depth_spread_over_samples(smol_tokenizer):
    assert [ruler.depth_for_index(i, 4) for i in range(4)] == [12, 38, 62, 88]
    assert ruler.depth_for_index(0, 1) == 50
    for task in ("niah_single_1", "niah_single_2"):
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


def test_unique_sample_ids_and_max_new_tokens_override(smol_tokenizer):
    samples = ruler.build_samples(
        smol_tokenizer, _ns(tasks="niah_single_1", num_samples=3, context_length=1024, max_new_tokens=32), 8192
    )
    assert len({s.sample_id for s in samples}) == 3
    for s in samples:
        assert s.max_new_tokens == 32
        assert 1024 * (1 - TOLERANCE) <= s.num_input_tokens + 32 <= 1024


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
    assert 2048 * (1 - TOLERANCE) <= s.meta["total_tokens"] <= 2048


def test_strip_gutenberg():
    raw = "\ufeffheader\r\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\nbody text.\r\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nlicense"
    assert ruler.strip_gutenberg(raw).strip() == "body text."
    assert ruler.strip_gutenberg("no markers") == "no markers"


def test_errors(smol_tokenizer):
    with pytest.raises(ValueError, match="did you mean 'niah_single_1'"):
        ruler.build_samples(smol_tokenizer, _ns(tasks="niah_single1"), 8192)
    with pytest.raises(ValueError, match="exceeds the model window"):
        ruler.build_samples(smol_tokenizer, _ns(context_length=16384), 8192)
    with pytest.raises(ValueError, match="too small"):
        ruler.generate_sample(smol_tokenizer, "niah_single_1", 150, 0)
    with pytest.raises(FileNotFoundError):
        ruler.generate_sample(smol_tokenizer, "niah_single_2", 2048, 0, haystack="/nonexistent/book.txt")


def test_save_samples_and_main_wiring(monkeypatch, smol_tokenizer, tmp_path):
    import argparse

    from evals.sample_io import read_samples_jsonl

    captured = {}

    def common_parser(description):
        p = argparse.ArgumentParser(description=description)
        p.add_argument("--tasks")
        p.add_argument("--num-samples", type=int)
        p.add_argument("--max-new-tokens", type=int)
        return p

    def run(benchmark, args, build_samples, score_sample):
        captured["benchmark"] = benchmark
        captured["samples"] = build_samples(smol_tokenizer, args, 8192)
        captured["score"] = score_sample
        return 0

    fake = types.ModuleType("cluster.jobs")
    fake.common_parser, fake.run = common_parser, run
    monkeypatch.setitem(sys.modules, "cluster.jobs", fake)
    out = tmp_path / "ruler.jsonl"
    argv = ["--tasks", "niah_single_1", "--num-samples", "2", "--context-length", "1024", "--seed", "5",
            "--save-samples", str(out)]
    assert ruler.main(argv) == 0
    assert captured["benchmark"] == "ruler" and captured["score"] is ruler.score_sample
    samples = captured["samples"]
    assert len(samples) == 2 and all(isinstance(s, Sample) for s in samples)
    assert all(s.meta["seed"] == 5 and s.meta["context_length"] == 1024 for s in samples)
    assert read_samples_jsonl(out) == samples
