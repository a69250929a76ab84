"""The unit of work every benchmark produces and every worker consumes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One benchmark input, ready to decode.

    Attributes:
        benchmark: registry key of the benchmark, e.g. ``"ruler"``, ``"longbench"``.
        task: task name as the official code spells it, e.g. ``"niah_single_1"``, ``"hotpotqa"``.
        sample_id: stable id, unique within (benchmark, task); used to pair methods and to resume.
        prompt_ids: final prompt token ids (template and chat template applied, truncated).
        references: gold answers (a list even when there is one).
        max_new_tokens: generation budget for this task (the official per-task value).
        num_input_tokens_raw: prompt tokens before truncation.
        num_input_tokens: prompt tokens after truncation (== len(prompt_ids)).
        meta: extra JSON-serialisable fields the scorer needs (e.g. ``all_classes``).
    """

    benchmark: str
    task: str
    sample_id: str
    prompt_ids: tuple[int, ...]
    references: tuple[str, ...]
    max_new_tokens: int
    num_input_tokens_raw: int
    num_input_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"{self.benchmark}/{self.task}/{self.sample_id}: empty prompt_ids")
        if self.max_new_tokens < 1:
            raise ValueError(f"{self.benchmark}/{self.task}/{self.sample_id}: max_new_tokens must be >= 1")
        if self.num_input_tokens != len(self.prompt_ids):
            raise ValueError(
                f"{self.benchmark}/{self.task}/{self.sample_id}: num_input_tokens="
                f"{self.num_input_tokens} but len(prompt_ids)={len(self.prompt_ids)}"
            )
