"""Fixed-length speed samples: consecutive windows of a real book, no quality score.

Registry entry: :data:`benchmark` (``evals.registry.get_benchmark("speed")``), what
``python -m cluster.speed`` runs its end-to-end measurements on (and any sweep may list).

At context length L (default 1024) with generation budget G (``max_new_tokens``, default 64):

* one task, ``fixed``; ``num_samples`` (default 4) samples with ids ``"L{L}-{i}"``;
* prompt i = tokens ``[skip + i*P, skip + (i+1)*P)`` of the text, tokenised without special
  tokens, with ``P = L - G`` (so prompt + budget is exactly L) and ``skip`` = ``--skip-tokens``
  (default 1000: past the Project Gutenberg header); a text shorter than that is repeated;
* ``meta = {"ignore_eos": True}``: every method generates exactly G tokens, so every method does
  the same work on the same sample and the TPOT ratio is the speedup;
* ``generated``: built at each context length (sample 0 starts at the same token at every L);
* no references and no score (:meth:`Speed.score_sample` returns None: speed only); there is no
  official prediction format (:meth:`Speed.score_predictions` raises ValueError).

The text defaults to Moby-Dick (Project Gutenberg #2701, public domain) in the shared data
(``../shared/data/public_domain_books/2701-0.txt``); ``--text FILE`` takes any plain-text file.
Only the standard library is imported here.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from evals.base import Sample
from evals.common import encode, parse_tasks, shared_data_dir
from evals.spec import BenchmarkBase, Option, check_positive_int

__all__ = ["BENCHMARK", "DEFAULT_TEXT", "ScorelessBenchmark", "Speed", "benchmark", "build_samples", "default_text"]

BENCHMARK = "speed"
TASK = "fixed"
DEFAULT_CONTEXT_LENGTH = 1024
DEFAULT_NUM_SAMPLES = 4
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_SKIP_TOKENS = 1000
#: Characters tokenised per token needed (English BPE is ~4 chars/token): read only what is used.
_CHARS_PER_TOKEN_BUDGET = 8
DEFAULT_TEXT = "2701-0.txt"  # Moby-Dick; or, The Whale (Project Gutenberg #2701)


def default_text() -> Path:
    """The default prompt text: a public-domain novel in the shared data."""
    return shared_data_dir("public_domain_books") / DEFAULT_TEXT


def _text_path(text: str | None) -> Path:
    path = Path(text) if text else default_text()
    if not path.is_file():
        raise FileNotFoundError(f"speed: prompt text {path} not found; pass --text FILE (any long plain-text file)")
    return path


def _skip(value: Any) -> int:
    return check_positive_int(value, "speed: skip_tokens", minimum=0, allow_none=False)  # type: ignore[return-value]


def _token_stream(tokenizer: Any, path: Path, need: int) -> list[int]:
    """At least ``need`` token ids of the text (tokenised without special tokens), the whole
    text repeated when it is shorter."""
    raw = path.read_text(encoding="utf-8-sig")
    budget = need * _CHARS_PER_TOKEN_BUDGET
    ids = encode(tokenizer, raw[:budget], add_special_tokens=False)
    if len(ids) < need and len(raw) > budget:  # denser than the budget assumed: tokenise it all
        ids = encode(tokenizer, raw, add_special_tokens=False)
    if not ids:
        raise ValueError(f"speed: {path} holds no tokens")
    if len(ids) < need:
        ids = ids * (need // len(ids) + 1)
    return ids


def build_samples(
    tokenizer: Any,
    *,
    window: int,
    context_length: int | None = None,
    tasks: str | Sequence[str] | None = None,
    num_samples: int | None = None,
    max_new_tokens: int | None = None,
    options: Mapping[str, Any] | None = None,
) -> list[Sample]:
    """``num_samples`` (default 4) fixed-length samples at ``context_length`` L (default 1024,
    at most ``window``): prompts of exactly ``L - max_new_tokens`` tokens (budget default 64),
    consecutive windows of the text, ``ignore_eos`` set. Raises ValueError (L over the window,
    no room for a prompt, unknown task or option) or FileNotFoundError (no text)."""
    opts = benchmark.resolve_options(options)
    parse_tasks(tasks, benchmark.tasks)
    num = check_positive_int(num_samples, "num_samples", minimum=0)
    num = DEFAULT_NUM_SAMPLES if num is None else num
    gen = check_positive_int(max_new_tokens, "max_new_tokens")
    gen = DEFAULT_MAX_NEW_TOKENS if gen is None else gen
    L = benchmark.total_limit(window, DEFAULT_CONTEXT_LENGTH if context_length is None else context_length)
    P = L - gen
    if P < 1:
        raise ValueError(f"speed: context_length={L} leaves no prompt after {gen} generated tokens")
    skip = _skip(opts["skip_tokens"])
    path = _text_path(opts["text"])
    if num == 0:
        return []
    ids = _token_stream(tokenizer, path, skip + num * P)
    return [
        Sample(
            benchmark=BENCHMARK, task=TASK, sample_id=f"L{L}-{i}",
            prompt_ids=tuple(ids[skip + i * P: skip + (i + 1) * P]), references=(), max_new_tokens=gen,
            num_input_tokens_raw=P, num_input_tokens=P, meta={"ignore_eos": True},
        )
        for i in range(num)
    ]


class ScorelessBenchmark(BenchmarkBase):
    """What a speed-only benchmark shares: tasks from its own list, no reference and no quality
    score (``score_sample`` returns None; ``score_predictions`` raises ValueError). Subclasses
    set ``name``, ``tasks``, ``default_tasks``, ``OPTIONS``, ``check`` and ``build_samples``."""

    __slots__ = ()

    def resolve_tasks(self, tasks: Sequence[str] | None = None,
                      options: Mapping[str, Any] | None = None) -> tuple[str, ...]:
        self.resolve_options(options)
        return tuple(parse_tasks(tasks, self.tasks) or self.default_tasks)

    def score_sample(self, sample: Sample, prediction: str) -> None:  # type: ignore[override]
        """None: these samples have no reference and no quality score."""
        return None

    def score_predictions(self, task: str, records: Sequence[dict], *, model_name: str | None = None) -> dict:
        raise ValueError(f"{self.name}: speed-only samples have no official prediction format to score")


class Speed(ScorelessBenchmark):
    """Fixed-length speed samples as a :class:`evals.registry.Benchmark` (no quality score)."""

    __slots__ = ()

    name = BENCHMARK
    tasks = (TASK,)
    default_tasks = (TASK,)
    generated = True
    default_context_length = DEFAULT_CONTEXT_LENGTH
    OPTIONS = (
        Option("--text", None, metavar="FILE",
               help="plain-text file the prompts are cut from; unset = ../shared/data/public_domain_books/"
                    f"{DEFAULT_TEXT} (Moby-Dick, public domain)"),
        Option("--skip-tokens", DEFAULT_SKIP_TOKENS, type=int,
               help="tokens skipped at the start of the text (the Project Gutenberg header)"),
    )

    def check(self, *, tasks: Sequence[str] | None = None, options: Mapping[str, Any] | None = None) -> None:
        """Unknown option keys or task names, a negative ``skip_tokens`` and a missing text raise."""
        opts = self.resolve_options(options)
        parse_tasks(tasks, self.tasks)
        _skip(opts["skip_tokens"])
        _text_path(opts["text"])

    def build_samples(self, tokenizer: Any, *, window: int, context_length: int | None = None,
                      tasks: Sequence[str] | None = None, num_samples: int | None = None,
                      max_new_tokens: int | None = None, options: Mapping[str, Any] | None = None) -> list[Sample]:
        return build_samples(tokenizer, window=window, context_length=context_length, tasks=tasks,
                             num_samples=num_samples, max_new_tokens=max_new_tokens, options=options)


#: The registry entry (``evals.registry.get_benchmark("speed")``).
benchmark = Speed()
