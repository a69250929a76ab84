"""The ``chat`` benchmark: short chat and summarisation prompts for speed runs (no quality score)."""
from __future__ import annotations

import pickle

import pytest

from evals.benchmarks import chat
from evals.registry import Benchmark, get_benchmark
from helpers import SHARED_DATA


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from sparsespec.provision import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))


def test_registered_with_the_protocol():
    b = get_benchmark("chat")
    assert isinstance(b, Benchmark) and b is chat.benchmark and b.tasks == ("chat", "summarize")
    assert pickle.loads(pickle.dumps(b)) is b
    assert b.option_defaults() == {"text": None, "passage_tokens": 200, "skip_tokens": 3000}


def test_samples_are_chat_templated_short_prompts(tok):
    samples = get_benchmark("chat").build_samples(tok, window=8192, num_samples=3, max_new_tokens=64)
    assert [s.sample_id for s in samples] == ["chat-0", "chat-1", "chat-2", "summarize-0", "summarize-1", "summarize-2"]
    text = tok.decode(samples[0].prompt_ids)
    assert chat.INSTRUCTIONS[0] in text and "<|im_start|>assistant" in text  # SmolLM2's chat template
    book = (SHARED_DATA / "public_domain_books" / chat.DEFAULT_TEXT).read_text(encoding="utf-8-sig")
    summ = [tok.decode(s.prompt_ids) for s in samples[3:]]
    assert all("Summarise the following passage" in t for t in summ) and len(set(summ)) == 3
    words = summ[1].split("\n\n", 1)[1].split()[5:15]  # a stretch of the passage is in the novel
    assert " ".join(words) in " ".join(book.split())
    assert all(s.max_new_tokens == 64 and not s.references and len(s.prompt_ids) < 400 for s in samples)
    assert get_benchmark("chat").score_sample(samples[0], "anything") is None


def test_bad_input_is_refused(tok, tmp_path):
    b = get_benchmark("chat")
    with pytest.raises(ValueError, match="exceed the limit of 256"):
        b.build_samples(tok, window=8192, context_length=256, tasks=["summarize"], num_samples=1, max_new_tokens=64)
    with pytest.raises(ValueError, match="unknown"):
        b.check(tasks=["nope"], options={})
    with pytest.raises(FileNotFoundError, match="not found"):
        b.check(tasks=["summarize"], options={"text": str(tmp_path / "missing.txt")})
    b.check(tasks=["chat"], options={"text": str(tmp_path / "missing.txt")})  # chat reads no text
