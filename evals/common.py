"""Small helpers shared by the benchmark modules (tokenizer glue, prompt fitting, task lists,
data folders).

Only the standard library is imported here; the tokenizer is any Hugging Face tokenizer passed in.
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

__all__ = [
    "ENV_DATA_DIR",
    "shared_data_dir",
    "resolve_benchmark_dir",
    "has_chat_template",
    "chat_wrap",
    "encode",
    "encode_prompt",
    "finalize_prompt",
    "PromptFitError",
    "fit_prompt",
    "split_tasks",
    "parse_tasks",
]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_wrap(tokenizer: Any, user_text: str) -> str:
    """One user turn through the tokenizer's chat template, generation prompt appended."""
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
    )
    if not isinstance(out, str):  # defensive: some versions return a list for batch input
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(out).__name__}")
    return out


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def encode_prompt(tokenizer: Any, text: str, *, chat_templated: bool) -> list[int]:
    """Final prompt ids. A chat-templated string already carries its special tokens (adding the
    tokenizer's BOS again would duplicate it); a plain prompt gets the tokenizer's specials (BOS),
    as the official ``tokenizer(prompt)`` call does."""
    return encode(tokenizer, text, add_special_tokens=not chat_templated)


def finalize_prompt(tokenizer: Any, text: str, use_chat: bool) -> list[int]:
    """Final prompt ids of ``text``: one user turn of the tokenizer's chat template when
    ``use_chat`` (see :func:`chat_wrap`), else the plain text with the tokenizer's specials."""
    final_text = chat_wrap(tokenizer, text) if use_chat else text
    return encode_prompt(tokenizer, final_text, chat_templated=use_chat)


T = TypeVar("T")


class PromptFitError(ValueError):
    """No truncation length makes the final prompt fit its token limit."""


def fit_prompt(
    render: Callable[[int], tuple[Sequence[int], T]],
    max_length: int,
    limit: int,
    *,
    min_length: int = 2,
    max_tries: int = 8,
) -> tuple[int, list[int], T]:
    """Fit a truncated prompt into ``limit`` tokens; the loop LongBench, LongBench v2 and
    InfiniteBench share.

    ``render(n)`` applies the benchmark's official truncation to ``n`` tokens, wraps the result
    in its final template and returns ``(prompt_ids, extra)``. The official code trusts that
    decoding the kept tokens and encoding them again (at the truncation seam, and inside the chat
    template) keeps the length; it almost does. When ``len(prompt_ids) > limit`` the truncation
    length is lowered by the overflow and the prompt rendered again, at most ``max_tries``
    renders in all. Returns ``(n, prompt_ids, extra)`` of the first render that fits, so a
    prompt that fits at once is exactly the official one.

    Raises :class:`PromptFitError` (a ValueError) when no render fits or when ``n`` would fall
    below ``min_length``.
    """
    if max_length < min_length:
        raise PromptFitError(f"truncation length {max_length} is below {min_length}")
    length = max_length
    for _ in range(max_tries):
        ids, extra = render(length)
        overflow = len(ids) - limit
        if overflow <= 0:
            return length, list(ids), extra
        length -= overflow
        if length < min_length:
            break
    raise PromptFitError(f"no truncation length from {max_length} down fits the prompt in {limit} tokens")


def split_tasks(value: str | Sequence[str] | None) -> list[str]:
    """``"a,b"`` / ``["a", "b"]`` / None -> a list of stripped, non-empty names."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    bad = [t for t in items if not isinstance(t, str)]
    if bad:
        raise ValueError(f"task names must be strings, got {bad[0]!r}")
    return [t.strip() for t in items if t.strip()]


def parse_tasks(value: str | Sequence[str] | None, known: Iterable[str]) -> list[str] | None:
    """``"a,b"`` or ``["a", "b"]`` -> validated list; None/empty -> None. Unknown names raise with
    a suggestion."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    tasks = [t.strip() for t in items if t and t.strip()]
    if not tasks:
        return None
    known = list(known)
    for t in tasks:
        if t not in known:
            close = difflib.get_close_matches(t, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown task {t!r}{hint} (known: {', '.join(known)})")
    return tasks


#: Environment variable naming the shared data root (or one benchmark's folder).
ENV_DATA_DIR = "SPARSESPEC_DATA_DIR"


def shared_data_dir(name: str) -> Path:
    """``<project root>/../shared/data/<name>``: where the offline sample files live."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "data" / name


def resolve_benchmark_dir(data_dir: str | os.PathLike | None, name: str) -> Path:
    """Precedence: explicit ``data_dir`` > ``$SPARSESPEC_DATA_DIR`` > :func:`shared_data_dir`.

    ``$SPARSESPEC_DATA_DIR`` may point at the shared data root (then its ``<name>/`` is used) or
    directly at the benchmark's folder.
    """
    if data_dir:
        return Path(data_dir)
    env = os.environ.get(ENV_DATA_DIR)
    if env:
        root = Path(env)
        return root / name if (root / name).is_dir() else root
    return shared_data_dir(name)
