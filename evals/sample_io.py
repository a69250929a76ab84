"""Write/read :class:`evals.base.Sample` lists as JSONL, one sample per line.

Used by ``--save-samples`` so the exact inputs of a run (generated RULER haystacks, truncated
LongBench prompts) can be inspected or replayed.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

from evals.base import Sample

__all__ = ["sample_to_dict", "sample_from_dict", "write_samples_jsonl", "read_samples_jsonl"]


def sample_to_dict(sample: Sample) -> dict:
    d = dataclasses.asdict(sample)
    d["prompt_ids"] = list(sample.prompt_ids)
    d["references"] = list(sample.references)
    return d


def sample_from_dict(d: dict) -> Sample:
    fields = {f.name for f in dataclasses.fields(Sample)}
    missing = sorted(fields - set(d) - {"meta"})
    if missing:
        raise ValueError(f"sample record misses fields {missing}")
    kwargs = {k: d[k] for k in fields if k in d}
    kwargs["prompt_ids"] = tuple(int(t) for t in d["prompt_ids"])
    kwargs["references"] = tuple(str(r) for r in d["references"])
    return Sample(**kwargs)


def write_samples_jsonl(samples: Iterable[Sample], path: str | Path) -> Path:
    """Write samples to ``path`` (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(sample_to_dict(s), ensure_ascii=False) + "\n")
    return path


def read_samples_jsonl(path: str | Path) -> list[Sample]:
    """Read samples written by :func:`write_samples_jsonl`; errors name file and line."""
    path = Path(path)
    out: list[Sample] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append(sample_from_dict(json.loads(line)))
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}:{lineno}: bad sample record: {e}") from e
    return out
