"""Reading benchmark record files (JSONL or one JSON array) with file:line in every error.

Official benchmark files come in two layouts: JSON Lines (LongBench v1 data, every official
prediction file) and a single JSON array (LongBench v2 ``data.json``). :func:`read_json_records`
reads both and reports, for every record, the 1-based line on which it starts, so that a loader
can name ``file:line`` when a record is malformed or misses a field. Nothing is skipped except
blank lines of a JSONL file.

:class:`RecordError` is the error a scorer raises about the i-th record it was given
(``evals.score`` turns the index back into ``file:line``).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["RecordError", "read_json_records", "iter_json_records", "require_fields"]


class RecordError(ValueError):
    """A problem with one record of a list; ``index`` is its 0-based position in that list."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"record {index}: {message}")
        self.index = index
        self.detail = message


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _iter_array(text: str, path: Path, start: int) -> Iterator[tuple[int, Any]]:
    """Elements of the JSON array starting at ``text[start] == "["``, each with its line."""
    decoder = json.JSONDecoder()
    n = len(text)
    pos = start + 1

    def skip_ws(p: int) -> int:
        while p < n and text[p] in " \t\r\n":
            p += 1
        return p

    pos = skip_ws(pos)
    if pos < n and text[pos] == "]":
        end = skip_ws(pos + 1)
        if end != n:
            raise ValueError(f"{path}:{_line_of(text, end)}: malformed JSON: extra data after the array")
        return
    while True:
        if pos >= n:
            raise ValueError(f"{path}:{_line_of(text, pos)}: malformed JSON: unterminated array")
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: malformed JSON: {e.msg} (column {e.colno})") from None
        yield _line_of(text, pos), obj
        pos = skip_ws(end)
        if pos < n and text[pos] == ",":
            pos = skip_ws(pos + 1)
            continue
        if pos < n and text[pos] == "]":
            end = skip_ws(pos + 1)
            if end != n:
                raise ValueError(f"{path}:{_line_of(text, end)}: malformed JSON: extra data after the array")
            return
        raise ValueError(f"{path}:{_line_of(text, pos)}: malformed JSON: expected ',' or ']' in the array")


def iter_json_records(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """Yield ``(line, value)`` for every record of ``path``.

    A file whose first non-blank character is ``[`` is read as one JSON array (``line`` = the line
    on which the element starts); anything else as JSON Lines (one value per non-blank line).
    Malformed JSON raises ``ValueError("<path>:<line>: malformed JSON: ...")``; a missing file
    raises ``FileNotFoundError`` naming it.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    stripped = text.lstrip()
    if stripped.startswith("["):
        yield from _iter_array(text, path, len(text) - len(stripped))
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: malformed JSON: {e.msg} (column {e.colno})") from None


def read_json_records(path: str | os.PathLike) -> list[tuple[int, Any]]:
    """:func:`iter_json_records` as a list."""
    return list(iter_json_records(path))


def require_fields(record: Any, fields: Sequence[str], where: str) -> dict:
    """``record`` as a dict that has every key in ``fields``; else ``ValueError`` naming ``where``."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in fields if k not in record]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    return record
