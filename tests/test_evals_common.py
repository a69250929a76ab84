"""evals.common: the one prompt-fitting loop (fit_prompt) the natural-data benchmarks share, and
the small task/tokenizer helpers."""
from __future__ import annotations

import pytest

from evals.common import PromptFitError, finalize_prompt, fit_prompt, split_tasks


def _renderer(lengths_by_n):
    """render(n) -> (ids of len lengths_by_n(n), n); records every n asked for."""
    calls: list[int] = []

    def render(n):
        calls.append(n)
        return [0] * lengths_by_n(n), f"extra{n}"

    return render, calls


def test_fits_at_once_is_one_render_and_the_official_length():
    render, calls = _renderer(lambda n: n + 5)
    assert fit_prompt(render, 100, 105) == (100, [0] * 105, "extra100")
    assert calls == [100]


def test_overflow_lowers_the_length_by_the_overflow():
    # re-tokenisation adds 3 tokens at the seam whatever n is: one retry, lowered by exactly 3
    render, calls = _renderer(lambda n: n + 3)
    n, ids, extra = fit_prompt(render, 100, 100)
    assert (n, len(ids), extra) == (97, 100, "extra97") and calls == [100, 97]
    # a seam that costs more at some lengths: several retries, each by the overflow seen
    render, calls = _renderer(lambda n: n + (4 if n > 95 else 1))
    n, ids, _ = fit_prompt(render, 100, 95)  # 104 -> n = 91 -> 92 tokens
    assert calls == [100, 91] and (n, len(ids)) == (91, 92)


def test_gives_up_after_max_tries_or_below_min_length():
    render, calls = _renderer(lambda n: 1000)  # never fits
    with pytest.raises(PromptFitError, match="fits the prompt in 10 tokens"):
        fit_prompt(render, 100, 10)
    assert calls == [100]  # 100 - 990 < 2: no second try
    render, calls = _renderer(lambda n: 11)  # one token over whatever the length
    with pytest.raises(PromptFitError):
        fit_prompt(render, 50, 10, max_tries=3)
    assert calls == [50, 49, 48]
    with pytest.raises(PromptFitError, match="below 2"):
        fit_prompt(render, 1, 10)
    assert issubclass(PromptFitError, ValueError)


def test_max_tries_bounds_the_renders():
    render, calls = _renderer(lambda n: 1001)  # one token over whatever the length
    with pytest.raises(PromptFitError):
        fit_prompt(render, 1000, 1000)
    assert calls == list(range(1000, 992, -1))  # 8 renders by default
    render, calls = _renderer(lambda n: n + 10)
    n, ids, _ = fit_prompt(render, 1000, 1000, max_tries=2)
    assert (n, calls) == (990, [1000, 990])


def test_split_tasks():
    assert split_tasks(None) == [] and split_tasks("") == [] and split_tasks(" , ") == []
    assert split_tasks("a, b,,c") == ["a", "b", "c"]
    assert split_tasks(["a ", "b"]) == ["a", "b"]
    with pytest.raises(ValueError, match="must be strings"):
        split_tasks(["a", 3])


class _Tok:
    chat_template = "x"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return f"<u>{messages[0]['content']}</u><a>"


def test_finalize_prompt_plain_and_chat():
    tok = _Tok()
    assert finalize_prompt(tok, "hi", False) == [1, ord("h"), ord("i")]
    assert finalize_prompt(tok, "hi", True) == [ord(c) for c in "<u>hi</u><a>"]  # no second BOS
