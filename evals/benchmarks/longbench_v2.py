"""LongBench v2: 503 multiple-choice questions; official prompt, truncation, answer extraction, accuracy.

Ground truth: THUDM/LongBench (v2 code at the repository root): ``prompts/0shot.txt`` (template),
``pred.py`` (``query_llm`` truncation, ``extract_answer``, ``judge``, ``max_new_tokens=128`` for the
non-CoT 0-shot run) and ``result.py`` (overall / easy / hard / short / medium / long accuracy).

One task, ``longbench_v2`` (the whole set; difficulty, length class and domain of every question
are in ``Sample.meta`` and :func:`accuracy_breakdown` reports the official breakdown).

Prompt construction per record (as ``pred.py``, 0-shot without CoT):

1. ``prompts/0shot.txt`` with ``$DOC$``, ``$Q$``, ``$C_A$`` .. ``$C_D$`` replaced, in that order,
   by the stripped context, question and choices (chained ``str.replace``, so a placeholder that
   occurs inside the document is replaced too, as in the official code);
2. ``input_ids = tokenizer.encode(prompt)`` (special tokens included); if longer than ``max_len``:
   ``input_ids[:max_len//2] + input_ids[-max_len//2:]`` decoded in one piece with
   ``skip_special_tokens=True`` (``-max_len//2`` is ``floor(-max_len/2)``: for an odd ``max_len``
   the tail gets the extra token and exactly ``max_len`` ids are kept);
3. the model's chat template around it, one user turn (the official code sends the prompt as the
   user message of an OpenAI-style chat request, which the server wraps in the chat template);
4. tokenize the result (the final ``prompt_ids``).

Scoring: ``extract_answer`` (``*`` removed, then ``The correct answer is \\(([A-D])\\)``, then
``The correct answer is ([A-D])``); a sample scores 1 if the letter equals ``answer``, else 0
(also when no letter is found). Task scores are ``round(100 * accuracy, 1)`` as ``result.py``
prints them.

Registry entry: :data:`benchmark` (``evals.registry.get_benchmark("longbench_v2")``), a
:class:`LongBenchV2`; its options are ``data_dir``, ``max_length`` and ``save_samples``. Prompts are
truncated so that prompt + generation budget <= ``min(context_length, window)``.

Deviations from ``pred.py`` (and why):

* ``max_len``: official uses a per-model cap (``config/model2maxlen.json``, e.g. 128000) and lets
  the server reject overflows; here it is ``limit - max_new_tokens - chat overhead`` with ``limit =
  min(context_length, window)`` (lowered by the ``max_length`` option, ``--max-length``), and
  lowered further by any re-tokenisation overflow (:func:`evals.common.fit_prompt`), so the prompt
  plus the generation always fit the context length and the model window.
* Generation: official samples with ``temperature=0.1``; the temperature here is the run's
  (``--temperature``, greedy by default), as for every benchmark of the service.
* An empty generation: official ``pred.py`` skips the item (it is never written, so it leaves the
  denominator); here it stays in the denominator and scores 0.
* ``result.py`` divides by zero when a group (e.g. ``medium``) is empty; here that group is
  ``None``.
"""
from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from evals.base import Sample
from evals.common import (
    ENV_DATA_DIR,
    PromptFitError,
    encode,
    finalize_prompt,
    fit_prompt,
    has_chat_template,
    resolve_benchmark_dir,
    shared_data_dir,
    split_tasks,
)
from evals.records import RecordError, iter_json_records
from evals.spec import BenchmarkBase, Option, check_positive_int

__all__ = [
    "BENCHMARK",
    "TASK",
    "TASKS",
    "TEMPLATE_0SHOT",
    "MAX_NEW_TOKENS",
    "REQUIRED_FIELDS",
    "HUB_REPO",
    "HUB_SPLIT",
    "default_data_dir",
    "resolve_data_dir",
    "find_data_file",
    "load_records",
    "build_prompt",
    "truncate_middle",
    "build_samples",
    "extract_answer",
    "judge",
    "score_sample",
    "accuracy_breakdown",
    "breakdown_from_samples",
    "PREDICTION_FIELDS",
    "score_prediction_records",
    "LongBenchV2",
    "benchmark",
]

BENCHMARK = "longbench_v2"
TASK = "longbench_v2"
TASKS = (TASK,)

#: Official ``prompts/0shot.txt``, verbatim (no trailing newline).
TEMPLATE_0SHOT = (
    "Please read the following text and answer the question below.\n"
    "\n"
    "<text>\n"
    "$DOC$\n"
    "</text>\n"
    "\n"
    "What is the correct answer to this question: $Q$\n"
    "Choices:\n"
    "(A) $C_A$\n"
    "(B) $C_B$\n"
    "(C) $C_C$\n"
    "(D) $C_D$\n"
    "\n"
    'Format your response as follows: "The correct answer is (insert answer here)".'
)

#: Official ``max_new_tokens`` of the 0-shot (non-CoT) run.
MAX_NEW_TOKENS = 128

#: Fields of an official record, in the official order.
REQUIRED_FIELDS = (
    "_id", "domain", "sub_domain", "difficulty", "length", "question",
    "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context",
)
DIFFICULTIES = ("easy", "hard")
LENGTHS = ("short", "medium", "long")
LETTERS = ("A", "B", "C", "D")

HUB_REPO = "THUDM/LongBench-v2"
HUB_SPLIT = "train"
#: File names looked for (in this order) in a data folder; otherwise its only *.json / *.jsonl.
DATA_FILE_NAMES = ("data.json", "longbench_v2.json", "longbench_v2.jsonl", "data.jsonl")


# ---------------------------------------------------------------------------------------------
# Data location and loading
# ---------------------------------------------------------------------------------------------


def default_data_dir() -> Path:
    """``<project root>/../shared/data/longbench_v2``."""
    return shared_data_dir("longbench_v2")


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Explicit ``data_dir`` > ``$SPARSESPEC_DATA_DIR`` (the shared root, or this benchmark's
    folder) > :func:`default_data_dir` (see :func:`evals.common.resolve_benchmark_dir`)."""
    return resolve_benchmark_dir(data_dir, "longbench_v2")


def find_data_file(data_dir: str | os.PathLike | None = None) -> Path | None:
    """The local records file: ``data_dir`` itself if it is a file; in a folder the first of
    :data:`DATA_FILE_NAMES`, else its only ``*.json``/``*.jsonl`` file; ``None`` if there is none.
    Several candidates without a canonical name are an error (which one is meant is unclear)."""
    path = resolve_data_dir(data_dir)
    if path.is_file():
        return path
    if not path.is_dir():
        return None
    for name in DATA_FILE_NAMES:
        if (path / name).is_file():
            return path / name
    candidates = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".jsonl"))
    if len(candidates) > 1:
        raise ValueError(
            f"{path}: several LongBench v2 files ({', '.join(p.name for p in candidates)}); "
            f"pass one with --data-dir FILE or name it data.json"
        )
    return candidates[0] if candidates else None


def _validate_record(rec: Any, where: str) -> dict:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in REQUIRED_FIELDS if k not in rec]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    for key in REQUIRED_FIELDS:
        if not isinstance(rec[key], str):
            raise ValueError(f"{where}: field {key!r} must be a string, got {type(rec[key]).__name__}")
    if rec["answer"] not in LETTERS:
        raise ValueError(f"{where}: field 'answer' must be one of A, B, C, D, got {rec['answer']!r}")
    if rec["difficulty"] not in DIFFICULTIES:
        raise ValueError(f"{where}: field 'difficulty' must be 'easy' or 'hard', got {rec['difficulty']!r}")
    if rec["length"] not in LENGTHS:
        raise ValueError(f"{where}: field 'length' must be short, medium or long, got {rec['length']!r}")
    return rec


def load_records(data_dir: str | os.PathLike | None = None) -> list[dict]:
    """All LongBench v2 records, in file order.

    Local file (see :func:`find_data_file`): the official single JSON array (``data.json``) or JSON
    Lines. Any record that is malformed, not an object, misses a field, has a field of the wrong
    type or value, or repeats an ``_id`` raises ``ValueError`` naming the file and the line on
    which the record starts. Nothing is dropped.

    Without a local file, ``load_dataset("THUDM/LongBench-v2", split="train")`` is used if the hub
    is reachable or cached; otherwise ``FileNotFoundError`` says where it looked.
    """
    path = find_data_file(data_dir)
    records: list[dict] = []
    seen: dict[str, str] = {}

    def add(rec: Any, where: str) -> None:
        _validate_record(rec, where)
        if rec["_id"] in seen:
            raise ValueError(f"{where}: duplicate _id {rec['_id']!r} (first at {seen[rec['_id']]})")
        seen[rec["_id"]] = where
        records.append(rec)

    if path is None:
        from evals.hub import load_hub_rows

        looked = resolve_data_dir(data_dir)
        rows = load_hub_rows(
            HUB_REPO, None, HUB_SPLIT,
            looked_at=f"no LongBench v2 file ({' / '.join(DATA_FILE_NAMES)} or one *.json/*.jsonl) at {looked}",
        )
        for i, rec in enumerate(rows):
            add(rec, f"{HUB_REPO} (split {HUB_SPLIT!r}) row {i}")
        if not records:
            raise ValueError(f"{HUB_REPO} (split {HUB_SPLIT!r}) has no rows")
        return records
    for lineno, rec in iter_json_records(path):
        add(rec, f"{path}:{lineno}")
    if not records:
        raise ValueError(f"{path}: no records")
    return records


# ---------------------------------------------------------------------------------------------
# Prompting and truncation
# ---------------------------------------------------------------------------------------------


def build_prompt(record: dict) -> str:
    """The official 0-shot prompt (chained replaces, stripped fields, as ``pred.py``)."""
    return (
        TEMPLATE_0SHOT.replace("$DOC$", record["context"].strip())
        .replace("$Q$", record["question"].strip())
        .replace("$C_A$", record["choice_A"].strip())
        .replace("$C_B$", record["choice_B"].strip())
        .replace("$C_C$", record["choice_C"].strip())
        .replace("$C_D$", record["choice_D"].strip())
    )


def truncate_middle(tokenizer: Any, text: str, max_len: int) -> tuple[str, int, int]:
    """Official v2 middle truncation (``query_llm``) to ``max_len`` tokens.

    ``ids = tokenizer.encode(text)`` (special tokens included); if ``len(ids) > max_len`` the text
    becomes ``decode(ids[:max_len//2] + ids[-max_len//2:], skip_special_tokens=True)``.
    Returns ``(text, n_raw, n_after)`` with content token counts (without special tokens) of the
    input and of the returned text.
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (got {max_len})")
    ids = encode(tokenizer, text, add_special_tokens=True)
    n_raw = len(encode(tokenizer, text, add_special_tokens=False))
    if len(ids) <= max_len:
        return text, n_raw, n_raw
    kept = ids[: max_len // 2] + ids[-max_len // 2 :]
    out = tokenizer.decode(kept, skip_special_tokens=True)
    return out, n_raw, len(encode(tokenizer, out, add_special_tokens=False))


def _selected_tasks(tasks: str | Sequence[str] | None) -> list[str]:
    named = split_tasks(tasks)
    for t in named:
        if t not in TASKS:
            close = difflib.get_close_matches(t, list(TASKS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown LongBench v2 task {t!r}{hint} (known: {', '.join(TASKS)})")
    return list(dict.fromkeys(named)) or list(TASKS)


def _check_cap(cap: Any) -> int | None:
    return check_positive_int(cap, "--max-length", minimum=2)


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
    """LongBench v2 samples (task ``longbench_v2``; see :meth:`LongBenchV2.build_samples`).

    ``num_samples``: the first N records. ``max_new_tokens``: overrides the official 128. Every
    prompt is truncated officially so that prompt + generation budget <= ``min(context_length,
    window)``; ``options["max_length"]`` caps the truncation length further. ``options``:
    ``data_dir``, ``max_length``, ``save_samples``.
    """
    opts = benchmark.resolve_options(options)
    limit = benchmark.total_limit(window, context_length)
    where = (f"context_length={context_length}" if context_length is not None and context_length < window
             else f"window={window}")
    cap = _check_cap(opts["max_length"])
    num_samples = check_positive_int(num_samples, "num_samples", minimum=0)
    selected = _selected_tasks(tasks)
    records = load_records(opts["data_dir"])
    if num_samples is not None:
        records = records[:num_samples]
    max_new = int(max_new_tokens) if max_new_tokens else MAX_NEW_TOKENS
    use_chat = has_chat_template(tokenizer)
    overhead = len(finalize_prompt(tokenizer, "", use_chat))
    budget = limit - max_new - overhead
    if budget < 2:
        raise ValueError(
            f"{where} leaves no room for a prompt "
            f"(max_new_tokens={max_new}, template overhead={overhead})"
        )
    samples = [
        _build_one(tokenizer, rec, task, max_new, use_chat, overhead, budget, cap, limit, where)
        for task in selected
        for rec in records
    ]
    if opts["save_samples"]:
        from evals.sample_io import write_samples_jsonl

        write_samples_jsonl(samples, opts["save_samples"])
    return samples


def _build_one(
    tokenizer: Any, rec: dict, task: str, max_new: int, use_chat: bool, overhead: int, budget: int,
    cap: int | None, limit: int, where: str,
) -> Sample:
    prompt = build_prompt(rec)

    def render(max_len: int) -> tuple[list[int], tuple[str, int, int]]:
        text, n_raw, n_after = truncate_middle(tokenizer, prompt, max_len)
        return finalize_prompt(tokenizer, text, use_chat), (text, n_raw, n_after)

    try:
        max_len, ids, (text, n_raw, n_after) = fit_prompt(render, min(budget, cap) if cap else budget, limit - max_new)
    except PromptFitError:
        raise ValueError(f"{task}/{rec['_id']}: cannot fit the prompt in {where} (max_new_tokens={max_new})") from None
    wrapper = len(ids) - n_after  # chat-template / BOS tokens around the content
    return Sample(
        benchmark=BENCHMARK,
        task=task,
        sample_id=rec["_id"],
        prompt_ids=tuple(ids),
        references=(rec["answer"],),
        max_new_tokens=max_new,
        num_input_tokens_raw=n_raw + wrapper,
        num_input_tokens=len(ids),
        meta={
            "difficulty": rec["difficulty"],
            "length": rec["length"],
            "domain": rec["domain"],
            "sub_domain": rec["sub_domain"],
            "truncated": text != prompt,
            "max_length": max_len,
            "num_content_tokens_raw": n_raw,
            "num_content_tokens": n_after,
            "chat_template": use_chat,
            "template_overhead": overhead,
        },
    )


# ---------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------

_ANSWER_PAREN = re.compile(r"The correct answer is \(([A-D])\)")
_ANSWER_BARE = re.compile(r"The correct answer is ([A-D])")


def extract_answer(response: str) -> str | None:
    """Official ``extract_answer``: drop ``*``, then the first ``The correct answer is (X)``, else
    the first ``The correct answer is X``; ``None`` when neither occurs."""
    response = response.replace("*", "")
    match = _ANSWER_PAREN.search(response)
    if match:
        return match.group(1)
    match = _ANSWER_BARE.search(response)
    return match.group(1) if match else None


def judge(response: str, answer: str) -> bool:
    """Official ``item['judge'] = extract_answer(response.strip()) == item['answer']``."""
    return extract_answer(response.strip()) == answer


def score_sample(sample: Sample, prediction: str) -> float:
    """1.0 if the extracted letter is the gold one, else 0.0 (no letter found -> 0.0)."""
    return 1.0 if judge(prediction, sample.references[0]) else 0.0


def _pct(acc: float, n: int) -> float | None:
    return round(100 * acc / n, 1) if n else None


def accuracy_breakdown(items: Iterable[tuple[float, str, str]]) -> dict[str, Any]:
    """Official ``result.py`` from ``(score, difficulty, length)`` triples.

    Returns ``overall``, ``easy``, ``hard``, ``short``, ``medium``, ``long`` as
    ``round(100 * accuracy, 1)`` (``None`` for an empty group) and ``counts`` per group. As the
    official script: a difficulty other than ``easy`` counts as hard, a length other than
    ``short``/``medium`` as long.
    """
    acc = {k: 0.0 for k in ("easy", "hard", "short", "medium", "long")}
    cnt = {k: 0 for k in acc}
    n = 0
    for score, difficulty, length in items:
        n += 1
        d = "easy" if difficulty == "easy" else "hard"
        ln = length if length in ("short", "medium") else "long"
        for key in (d, ln):
            acc[key] += score
            cnt[key] += 1
    if n == 0:
        raise ValueError("accuracy_breakdown of no items")
    out: dict[str, Any] = {"overall": _pct(acc["easy"] + acc["hard"], n)}
    for key in acc:
        out[key] = _pct(acc[key], cnt[key])
    out["counts"] = {"overall": n, **cnt}
    return out


def breakdown_from_samples(samples: Sequence[Sample], scores: Sequence[float]) -> dict[str, Any]:
    """:func:`accuracy_breakdown` of samples built here and their per-sample scores."""
    if len(samples) != len(scores):
        raise ValueError(f"{len(samples)} samples but {len(scores)} scores")
    return accuracy_breakdown((sc, s.meta["difficulty"], s.meta["length"]) for s, sc in zip(samples, scores))


#: Fields of an official prediction line (``pred.py`` output) that re-scoring reads.
PREDICTION_FIELDS = ("response", "answer", "difficulty", "length")


def score_prediction_records(task: str, records: Sequence[dict]) -> dict[str, Any]:
    """Re-score official LongBench v2 prediction lines (the items ``pred.py`` writes, with
    ``response``): the answer letter is re-extracted from ``response`` (the stored ``pred`` and
    ``judge`` are ignored) and compared with ``answer``.

    Returns ``{"task", "score", "n"}`` plus the ``result.py`` breakdown (``overall``, ``easy``,
    ``hard``, ``short``, ``medium``, ``long``, ``counts``); ``score == overall``.
    Errors about one record raise :class:`evals.records.RecordError` (with its index).
    """
    if task not in TASKS:
        raise ValueError(f"unknown LongBench v2 task {task!r} (known: {', '.join(TASKS)})")
    if not records:
        raise ValueError(f"{task}: no prediction records")
    items: list[tuple[float, str, str]] = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise RecordError(i, f"expected a JSON object, got {type(rec).__name__}")
        missing = [k for k in PREDICTION_FIELDS if k not in rec]
        if missing:
            raise RecordError(i, f"missing field(s) {missing}")
        for key in PREDICTION_FIELDS:
            if not isinstance(rec[key], str):
                raise RecordError(i, f"field {key!r} must be a string, got {type(rec[key]).__name__}")
        items.append((1.0 if judge(rec["response"], rec["answer"]) else 0.0, rec["difficulty"], rec["length"]))
    breakdown = accuracy_breakdown(items)
    return {"task": task, "score": breakdown["overall"], "n": len(items), **breakdown}


# ---------------------------------------------------------------------------------------------
# The registry entry
# ---------------------------------------------------------------------------------------------


class LongBenchV2(BenchmarkBase):
    """LongBench v2 as a :class:`evals.registry.Benchmark`: natural data, truncated officially to
    each context length."""

    __slots__ = ()

    name = BENCHMARK
    tasks = TASKS
    default_tasks = TASKS
    generated = False
    default_context_length = None
    OPTIONS = (
        Option(
            "--data-dir", None,
            help=f"LongBench v2 records: a data.json (official JSON array) or JSONL file, or a folder holding "
            f"one; unset = ${ENV_DATA_DIR} if set, else {default_data_dir()}; without a local file the hub "
            f"({HUB_REPO}, split {HUB_SPLIT}) is read when reachable or cached",
        ),
        Option(
            "--max-length", None, type=int,
            help="cap on the truncated prompt length in tokens (official: per-model max length); "
            "the model window and the context length always apply",
        ),
        Option("--save-samples", None, help="also write the built samples to this JSONL file"),
    )

    def resolve_tasks(self, tasks: Sequence[str] | None = None,
                      options: Mapping[str, Any] | None = None) -> tuple[str, ...]:
        self.resolve_options(options)
        return tuple(_selected_tasks(tasks))

    def check(self, *, tasks: Sequence[str] | None = None, options: Mapping[str, Any] | None = None) -> None:
        """Unknown option keys or task names, a bad ``max_length``, or records that cannot be read
        (no local file and no hub copy; a malformed record names file:line) raise one-line errors."""
        opts = self.resolve_options(options)
        _check_cap(opts["max_length"])
        _selected_tasks(tasks)
        load_records(opts["data_dir"])

    def build_samples(self, tokenizer: Any, *, window: int, context_length: int | None = None,
                      tasks: Sequence[str] | None = None, num_samples: int | None = None,
                      max_new_tokens: int | None = None, options: Mapping[str, Any] | None = None) -> list[Sample]:
        return build_samples(tokenizer, window=window, context_length=context_length, tasks=tasks,
                             num_samples=num_samples, max_new_tokens=max_new_tokens, options=options)

    def score_sample(self, sample: Sample, prediction: str) -> float:
        return score_sample(sample, prediction)

    def score_predictions(self, task: str, records: Sequence[dict], *, model_name: str | None = None) -> dict:
        """:func:`score_prediction_records` (``model_name`` plays no part in LongBench v2's scorer)."""
        return score_prediction_records(task, records)


#: The registry entry (``evals.registry.get_benchmark("longbench_v2")``).
benchmark = LongBenchV2()
