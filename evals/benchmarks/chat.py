"""Short-context chat prompts: the regime EAGLE-style drafters are built for, as a speed benchmark.

Registry entry: :data:`benchmark` (``evals.registry.get_benchmark("chat")``). Two tasks, each
prompt formatted with the model's chat template (plain text when it has none):

* ``chat``: an open instruction (explain, write, list, compare; the ``INSTRUCTIONS`` below);
* ``summarize``: "Summarise this passage" over a ~``passage_tokens`` (default 200) token passage of
  a public-domain novel (default Middlemarch, Project Gutenberg #145, which
  ``sparsespec.train_eagle3`` holds out of its training data), consecutive passages from token
  ``skip_tokens`` on.

Samples ``"{task}-{i}"``; natural EOS (greedy outputs are the same for every lossless method, so
the methods do the same work); budget ``max_new_tokens`` (default 128). No references and no
quality score (``ScorelessBenchmark``: alpha, tau and speed only). Only the
standard library is imported here.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from evals.base import Sample
from evals.common import encode, finalize_prompt, has_chat_template, parse_tasks, shared_data_dir
from evals.benchmarks.speed import ScorelessBenchmark
from evals.spec import Option, check_positive_int

__all__ = ["BENCHMARK", "INSTRUCTIONS", "Chat", "benchmark", "build_samples"]

BENCHMARK = "chat"
TASKS = ("chat", "summarize")
DEFAULT_NUM_SAMPLES = 4
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_PASSAGE_TOKENS = 200
DEFAULT_SKIP_TOKENS = 3000
DEFAULT_TEXT = "145-0.txt"  # Middlemarch (Project Gutenberg #145, public domain)

INSTRUCTIONS = (
    "Explain how a rainbow forms, in simple terms.",
    "Write a short poem about the sea at night.",
    "What are three tips for learning a new language?",
    "Describe the water cycle step by step.",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between weather and climate?",
    "Write a polite email asking a colleague to review a document.",
    "List five animals that live in the desert and say how each survives.",
    "Explain what a computer program is to a ten-year-old.",
    "Why do leaves change colour in autumn?",
    "Write a short story about a lost key.",
    "What are the benefits of regular exercise?",
    "How does a bicycle stay upright when it moves?",
    "Suggest a plan for a relaxing weekend at home.",
    "Compare trains and planes for a 500 kilometre trip.",
    "Explain why the sky is blue.",
)
SUMMARY_TEMPLATE = "Summarise the following passage in a few sentences.\n\n{passage}"


def _text_path(text: str | None) -> Path:
    path = Path(text) if text else shared_data_dir("public_domain_books") / DEFAULT_TEXT
    if not path.is_file():
        raise FileNotFoundError(f"chat: passage text {path} not found; pass --text FILE (any long plain-text file)")
    return path


def build_samples(tokenizer: Any, *, window: int, context_length: int | None = None,
                  tasks: str | Sequence[str] | None = None, num_samples: int | None = None,
                  max_new_tokens: int | None = None, options: Mapping[str, Any] | None = None) -> list[Sample]:
    """``num_samples`` (default 4) prompts per task; a prompt that with its budget exceeds
    ``min(context_length, window)`` raises ValueError (these are short-context samples)."""
    opts = benchmark.resolve_options(options)
    names = parse_tasks(tasks, TASKS) or list(TASKS)
    num = check_positive_int(num_samples, "num_samples", minimum=0)
    num = DEFAULT_NUM_SAMPLES if num is None else num
    gen = check_positive_int(max_new_tokens, "max_new_tokens")
    gen = DEFAULT_MAX_NEW_TOKENS if gen is None else gen
    limit = benchmark.total_limit(window, context_length)
    plen = check_positive_int(opts["passage_tokens"], "chat: passage_tokens", allow_none=False)
    skip = check_positive_int(opts["skip_tokens"], "chat: skip_tokens", minimum=0, allow_none=False)
    use_chat = has_chat_template(tokenizer)
    out = []
    for task in names:
        if task == "chat":
            users = [INSTRUCTIONS[i % len(INSTRUCTIONS)] for i in range(num)]
        else:
            raw = _text_path(opts["text"]).read_text(encoding="utf-8-sig")
            ids = encode(tokenizer, raw[: (skip + (num + 1) * plen) * 8], add_special_tokens=False)
            if len(ids) < skip + num * plen:
                raise ValueError(f"chat: the passage text has {len(ids)} tokens, need {skip + num * plen}")
            users = [SUMMARY_TEMPLATE.format(passage=tokenizer.decode(ids[skip + i * plen: skip + (i + 1) * plen]).strip())
                     for i in range(num)]
        for i, user in enumerate(users):
            prompt = finalize_prompt(tokenizer, user, use_chat)
            if len(prompt) + gen > limit:
                raise ValueError(f"chat/{task}-{i}: {len(prompt)} prompt tokens + {gen} exceed the limit of {limit}")
            out.append(Sample(benchmark=BENCHMARK, task=task, sample_id=f"{task}-{i}", prompt_ids=tuple(prompt),
                              references=(), max_new_tokens=gen, num_input_tokens_raw=len(prompt),
                              num_input_tokens=len(prompt)))
    return out


class Chat(ScorelessBenchmark):
    """Short chat and summarisation prompts as a :class:`evals.registry.Benchmark` (no score)."""

    __slots__ = ()

    name = BENCHMARK
    tasks = TASKS
    default_tasks = TASKS
    generated = True  # built, not truncated: the same prompts at every context length
    default_context_length = 1024
    OPTIONS = (
        Option("--text", None, metavar="FILE",
               help=f"plain-text file the passages are cut from; unset = ../shared/data/public_domain_books/"
                    f"{DEFAULT_TEXT} (Middlemarch, public domain)"),
        Option("--passage-tokens", DEFAULT_PASSAGE_TOKENS, type=int, help="tokens per summarised passage"),
        Option("--skip-tokens", DEFAULT_SKIP_TOKENS, type=int, help="tokens skipped before the first passage"),
    )

    def check(self, *, tasks: Sequence[str] | None = None, options: Mapping[str, Any] | None = None) -> None:
        """Unknown option keys or task names and a missing passage text raise."""
        opts = self.resolve_options(options)
        names = parse_tasks(tasks, self.tasks) or list(self.tasks)
        if "summarize" in names:
            _text_path(opts["text"])

    def build_samples(self, tokenizer: Any, *, window: int, context_length: int | None = None,
                      tasks: Sequence[str] | None = None, num_samples: int | None = None,
                      max_new_tokens: int | None = None, options: Mapping[str, Any] | None = None) -> list[Sample]:
        return build_samples(tokenizer, window=window, context_length=context_length, tasks=tasks,
                             num_samples=num_samples, max_new_tokens=max_new_tokens, options=options)


#: The registry entry (``evals.registry.get_benchmark("chat")``).
benchmark = Chat()
