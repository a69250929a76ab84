"""Shared test utilities (real model loaded once per test process)."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
BOOK = SHARED_DATA / "public_domain_books" / "11-0.txt"  # Alice in Wonderland (public domain)


@functools.lru_cache(maxsize=None)
def real_engine():
    from sparsespec import Engine

    torch.set_num_threads(max(1, torch.get_num_threads()))
    return Engine.from_pretrained("smollm2-135m", dtype="float32")


def chat_prompt(tokenizer, user: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def book_prompt(tokenizer, offset: int, num_tokens: int, question: str) -> list[int]:
    text = BOOK.read_text(encoding="utf-8-sig")
    ids = tokenizer(text, add_special_tokens=False).input_ids[offset : offset + num_tokens]
    return chat_prompt(tokenizer, tokenizer.decode(ids) + "\n\n" + question)
