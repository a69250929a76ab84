"""Small helpers shared by the benchmark scripts (tokenizer glue, argument handling).

Only the standard library is imported here; the tokenizer is any Hugging Face tokenizer passed in.
"""
from __future__ import annotations

import argparse
import difflib
import os
from pathlib import Path
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "ENV_DATA_DIR",
    "shared_data_dir",
    "resolve_benchmark_dir",
    "has_chat_template",
    "chat_wrap",
    "encode",
    "encode_prompt",
    "parse_tasks",
    "add_argument_once",
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


def add_argument_once(parser: argparse.ArgumentParser, *flags: str, **kwargs: Any) -> None:
    """Add an option unless the (shared) parser already defines it."""
    if any(f in parser._option_string_actions for f in flags):  # noqa: SLF001
        return
    parser.add_argument(*flags, **kwargs)


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
