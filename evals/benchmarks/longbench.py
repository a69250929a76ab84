"""LongBench v1 (21 tasks) and LongBench-E (13 tasks): loaders, official prompts, official middle
truncation, official scoring.

Ground truth: THUDM/LongBench (v1, now under ``LongBench/``): ``config/dataset2prompt.json``,
``config/dataset2maxlen.json``, ``pred.py`` (truncation + chat rule + samsum stop),
``eval.py`` / ``metrics.py`` (scoring, see :mod:`evals.metrics`).

Tasks: the 21 names of ``pred.py``; LongBench-E tasks are ``<task>_e`` for the 13 tasks of
``pred.py --e`` (:data:`evals.metrics.LONGBENCH_E_TASKS`). An ``_e`` task uses its base task's
prompt, generation budget and metric, and is reported per length bucket (0-4k, 4-8k, 8k+ by the
record's ``length``; :func:`longbench_e_report`).

Loading (:func:`load_records`): ``<data_dir>/<task>.jsonl`` (official JSONL fields), else the hub
(``datasets.load_dataset("THUDM/LongBench", task, split="test")``) if it is reachable or cached;
otherwise a ``FileNotFoundError`` saying where it looked (see :mod:`evals.hub`).

Prompt construction per record (as ``pred.py``):

1. ``prompt = DATASET2PROMPT[task].format(**record)``
2. tokenize it as ``pred.py`` does (``tokenizer(prompt)``, special tokens included); if longer than
   ``max_length`` tokens keep ``tokens[:half] + tokens[-half:]`` with ``half = int(max_length / 2)``,
   each half decoded separately with ``skip_special_tokens=True`` and the two strings concatenated;
3. wrap it in the model's chat template unless the task is in :data:`NO_CHAT_TASKS`;
4. tokenize the result (the final ``prompt_ids``).

``max_length`` (the cap of step 2) is ``limit - max_new_tokens - chat overhead`` with ``limit =
min(context_length, window)`` (``context_length`` None: the model window), so that prompt +
generation fit the sweep's context length and the model window, optionally lowered by the
``max_length`` option (``--max-length``; the official code uses a per-model cap,
``model2maxlen.json``; the demo uses a small one for speed).

Registry entry: :data:`benchmark` (``evals.registry.get_benchmark("longbench")``), a
:class:`LongBench`; its options are ``data_dir``, ``max_length`` and ``save_samples``.

Deviations from ``pred.py`` (all documented in the report of the change):

* The official code trusts that decode -> re-encode keeps the length. It almost does; when the
  final prompt still overflows the limit (re-tokenisation at the seam or at the chat-template
  boundary), ``max_length`` is lowered by the overflow and the record rebuilt
  (:func:`evals.common.fit_prompt`), so the contract ``len(prompt_ids) + max_new_tokens <= limit``
  always holds.
* samsum: the official run also stops at ``"\\n"``: the id of ``"\\n"`` is an extra EOS id
  (``tokenizer.encode("\\n", add_special_tokens=False)[-1]``) and ``min_length`` forces at least
  one new token. The samples carry this for the engine: ``meta["stop_token_ids"]`` (the exact
  official rule: the engine adds these ids to the model's EOS ids) and ``meta["min_new_tokens"] = 1``
  (the stop ids are masked for the first token, as ``min_length`` does). Scoring uses the first
  line anyway (official eval.py). Other tasks carry no stop keys.
* Chat templates: the official ``build_chat`` hard-codes a few 2023 chat formats; here the
  tokenizer's own chat template is used (one user turn, generation prompt appended).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
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
from evals.metrics import (
    LONGBENCH_E_TASKS,
    longbench_base_task,
    longbench_e_scores,
    longbench_score,
    official_task_score,
)
from evals.records import RecordError
from evals.spec import BenchmarkBase, Option, check_positive_int

__all__ = [
    "BENCHMARK",
    "DATASET2PROMPT",
    "DATASET2MAXLEN",
    "NO_CHAT_TASKS",
    "LONGBENCH_E_TASKS",
    "ALL_TASKS",
    "REQUIRED_FIELDS",
    "HUB_REPO",
    "HUB_ZIP",
    "default_data_dir",
    "resolve_data_dir",
    "available_tasks",
    "load_records",
    "build_prompt",
    "truncate_middle",
    "build_samples",
    "score_sample",
    "samsum_stop",
    "longbench_e_report",
    "PREDICTION_FIELDS",
    "score_prediction_records",
    "LongBench",
    "benchmark",
]

BENCHMARK = "longbench"

# Official config/dataset2prompt.json (LongBench v1), verbatim, including its typos
# ("asconcisely", the leading space of qasper's second paragraph, trailing spaces).
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
    "passage_retrieval_zh": "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是：",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# Official config/dataset2maxlen.json (generation budget per task, tokens).
DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

#: pred.py: "chat models are better off without build prompts on these tasks".
NO_CHAT_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})

#: Fields of an official LongBench v1 record.
REQUIRED_FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")


#: Hub dataset of LongBench v1 / LongBench-E (config = task name, ``<task>_e`` for -E; split test).
HUB_REPO = "THUDM/LongBench"

#: Every task name this module accepts: the 21 tasks, then the 13 LongBench-E ``<task>_e`` names.
ALL_TASKS: tuple[str, ...] = tuple(DATASET2PROMPT) + tuple(f"{t}_e" for t in LONGBENCH_E_TASKS)


def _base_task(task: str) -> str:
    """``hotpotqa_e`` (LongBench-E) -> ``hotpotqa``; other names unchanged."""
    return longbench_base_task(task)


def _check_task(task: str) -> str:
    """The base task of ``task``; ``ValueError`` with a suggestion if it is not one of ALL_TASKS."""
    if task not in ALL_TASKS:
        import difflib

        close = difflib.get_close_matches(task, list(ALL_TASKS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        extra = ""
        if task.endswith("_e") and task[:-2] in DATASET2PROMPT:
            extra = f" ({task[:-2]!r} has no LongBench-E set; the 13 that do: {', '.join(LONGBENCH_E_TASKS)})"
        raise ValueError(f"unknown LongBench task {task!r}{hint}{extra} (known: {', '.join(ALL_TASKS)})")
    return _base_task(task)


# ---------------------------------------------------------------------------------------------
# Data location and loading
# ---------------------------------------------------------------------------------------------


def default_data_dir() -> Path:
    """``<project root>/../shared/data/longbench_v1``."""
    return shared_data_dir("longbench_v1")


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Explicit ``data_dir`` > ``$SPARSESPEC_DATA_DIR`` (the shared root, or this benchmark's
    folder) > :func:`default_data_dir` (see :func:`evals.common.resolve_benchmark_dir`)."""
    return resolve_benchmark_dir(data_dir, "longbench_v1")


def available_tasks(data_dir: str | os.PathLike) -> list[str]:
    """Tasks (official order) that have a ``<task>.jsonl`` file in ``data_dir``."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"LongBench data folder not found: {data_dir}")
    names = {p.stem for p in data_dir.glob("*.jsonl")}
    return [t for t in ALL_TASKS if t in names]


def _validate_record(rec: Any, where: str) -> dict:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in REQUIRED_FIELDS if k not in rec]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    for key in ("input", "context", "_id"):
        if not isinstance(rec[key], str):
            raise ValueError(f"{where}: field {key!r} must be a string, got {type(rec[key]).__name__}")
    length = rec["length"]
    if isinstance(length, bool) or not isinstance(length, (int, float)):
        raise ValueError(f"{where}: field 'length' must be a number, got {type(length).__name__}")
    answers = rec["answers"]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{where}: field 'answers' must be a non-empty list of strings")
    classes = rec["all_classes"]
    if classes is not None and (
        not isinstance(classes, list) or not all(isinstance(c, str) for c in classes)
    ):
        raise ValueError(f"{where}: field 'all_classes' must be null or a list of strings")
    return rec


def _add_record(rec: Any, where: str, records: list[dict], seen: dict[str, str]) -> None:
    _validate_record(rec, where)
    if rec["_id"] in seen:
        raise ValueError(f"{where}: duplicate _id {rec['_id']!r} (first at {seen[rec['_id']]})")
    seen[rec["_id"]] = where
    records.append(rec)


def load_records(data_dir: str | os.PathLike | None, task: str) -> list[dict]:
    """All records of ``task``, in file order.

    Reads ``<data_dir>/<task>.jsonl`` (LongBench-E: ``<task>_e.jsonl``). Blank lines are skipped;
    anything else that is not a valid record (malformed JSON, not an object, a missing or mistyped
    field, a duplicate ``_id``) raises ``ValueError`` naming the file and the 1-based line.
    Nothing is dropped silently.

    When the file does not exist, the rows of ``load_dataset("THUDM/LongBench", task,
    split="test")`` are used if the hub is reachable or has a cached copy, else (``datasets`` >= 4
    cannot run that repo's loading script) ``data/<task>.jsonl`` of the repo's ``data.zip``; both
    validated the same way, errors naming the hub dataset and row (or zip member and line). If
    neither can be had, ``FileNotFoundError`` names the local path and everything tried.
    """
    _check_task(task)
    path = resolve_data_dir(data_dir) / f"{task}.jsonl"
    records: list[dict] = []
    seen: dict[str, str] = {}
    if not path.is_file():
        return _load_from_hub(task, path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from e
            _add_record(rec, where, records, seen)
    if not records:
        raise ValueError(f"{path}: no records (the file is empty)")
    return records


#: The file of the hub repo that holds every task as ``data/<task>.jsonl`` (what the repo's
#: loading script reads).
HUB_ZIP = "data.zip"


def _load_from_hub(task: str, local_path: Path) -> list[dict]:
    """Records of ``task`` from the hub: ``load_dataset(HUB_REPO, task, split="test")``; if that
    fails (``datasets`` >= 4 no longer runs the repo's loading script, ``LongBench.py``), the
    repo's ``data.zip`` (downloaded or cached), member ``data/<task>.jsonl``, read like a local
    file. One ``FileNotFoundError`` naming everything tried when neither works."""
    from evals.hub import HubUnavailableError, download_hub_file, load_hub_rows

    looked = f"no LongBench file for task {task!r} at {local_path}"
    records: list[dict] = []
    seen: dict[str, str] = {}
    try:
        rows = load_hub_rows(HUB_REPO, task, "test", looked_at=looked)
    except HubUnavailableError as first:
        try:
            zip_path = download_hub_file(HUB_REPO, HUB_ZIP, looked_at=str(first))
        except HubUnavailableError as second:
            raise HubUnavailableError(str(second)) from None
        return _load_from_zip(zip_path, task)
    for i, rec in enumerate(rows):
        _add_record(rec, f"{HUB_REPO} (config {task!r}, split 'test') row {i}", records, seen)
    if not records:
        raise ValueError(f"{HUB_REPO} (config {task!r}, split 'test') has no rows")
    return records


def _load_from_zip(zip_path: str | os.PathLike, task: str) -> list[dict]:
    """Records of ``data/<task>.jsonl`` inside the official ``data.zip``; errors name zip:member:line."""
    import zipfile

    try:
        zf = zipfile.ZipFile(zip_path)
    except (OSError, zipfile.BadZipFile) as e:
        raise ValueError(f"{zip_path}: not a readable zip file ({e})") from None
    with zf:
        names = [n for n in zf.namelist() if n.rsplit("/", 1)[-1] == f"{task}.jsonl"]
        if not names:
            raise FileNotFoundError(f"{zip_path}: no member {task}.jsonl")
        member = sorted(names, key=len)[0]
        text = zf.read(member).decode("utf-8")
    records: list[dict] = []
    seen: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{zip_path}:{member}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None
        _add_record(rec, where, records, seen)
    if not records:
        raise ValueError(f"{zip_path}:{member}: no records")
    return records


# ---------------------------------------------------------------------------------------------
# Prompting and truncation
# ---------------------------------------------------------------------------------------------


def build_prompt(record: dict, task: str) -> str:
    """The official prompt: ``dataset2prompt[task].format(**record)`` (no chat template)."""
    return DATASET2PROMPT[_check_task(task)].format(**record)


def truncate_middle(tokenizer: Any, text: str, max_length: int) -> tuple[str, int, int]:
    """Official middle truncation to ``max_length`` tokens (``pred.py``).

    As the official code, the text is tokenized with the tokenizer's special tokens (a Llama BOS
    counts towards ``max_length`` and sits at the head of the first half, where
    ``skip_special_tokens`` then drops it). If that is longer than ``max_length`` the result is
    ``decode(ids[:half]) + decode(ids[-half:])`` with ``half = int(max_length / 2)`` (an odd
    ``max_length`` keeps ``max_length - 1`` tokens), each half decoded with
    ``skip_special_tokens=True``.

    Returns ``(text, n_raw, n_after)``: the (possibly) truncated text and the content token counts
    (without special tokens) of the input and of the returned text (re-tokenised).
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (got {max_length}): half would be 0")
    ids = encode(tokenizer, text, add_special_tokens=True)
    content = encode(tokenizer, text, add_special_tokens=False)
    n_raw = len(content)
    if len(ids) <= max_length:
        return text, n_raw, n_raw
    half = int(max_length / 2)
    out = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )
    return out, n_raw, len(encode(tokenizer, out, add_special_tokens=False))


def _template_overhead(tokenizer: Any, use_chat: bool) -> int:
    """Tokens the final prompt adds around the content (chat template or BOS)."""
    return len(finalize_prompt(tokenizer, "", use_chat))


def _selected_tasks(tasks: str | Sequence[str] | None, data_dir: Path) -> list[str]:
    """Named tasks (validated, duplicates dropped), else every task with a file in ``data_dir``."""
    named = split_tasks(tasks)
    for t in named:
        _check_task(t)
    if named:
        return list(dict.fromkeys(named))
    hint = f"; name tasks with --tasks to read them from the hub ({HUB_REPO})"
    if not Path(data_dir).is_dir():
        raise FileNotFoundError(f"LongBench data folder not found: {data_dir}{hint}")
    found = available_tasks(data_dir)
    if not found:
        raise FileNotFoundError(f"no LongBench task files (<task>.jsonl) in {data_dir}{hint}")
    return found


def _check_cap(cap: Any) -> int | None:
    return check_positive_int(cap, "--max-length", minimum=2)


def _limit_text(window: int, context_length: int | None) -> str:
    if context_length is not None and context_length < window:
        return f"context_length={context_length}"
    return f"window={window}"


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
    """LongBench samples (see :meth:`LongBench.build_samples`).

    ``tasks``: names (or a comma list); default every task with a file in the data folder.
    ``num_samples``: per-task cap (the first records of the file). ``max_new_tokens``: overrides
    the official per-task budget. Every prompt is truncated officially so that prompt +
    generation budget <= ``min(context_length, window)``; ``options["max_length"]`` caps the
    truncation length further. ``options``: ``data_dir``, ``max_length``, ``save_samples``.
    """
    opts = benchmark.resolve_options(options)
    limit = benchmark.total_limit(window, context_length)
    where = _limit_text(window, context_length)
    cap = _check_cap(opts["max_length"])
    num_samples = check_positive_int(num_samples, "num_samples", minimum=0)
    data_dir = resolve_data_dir(opts["data_dir"])
    selected = _selected_tasks(tasks, data_dir)

    samples: list[Sample] = []
    for task in selected:
        base = _base_task(task)
        records = load_records(data_dir, task)
        if num_samples is not None:
            records = records[:num_samples]
        max_new = int(max_new_tokens) if max_new_tokens else DATASET2MAXLEN[base]
        use_chat = base not in NO_CHAT_TASKS and has_chat_template(tokenizer)
        overhead = _template_overhead(tokenizer, use_chat)
        budget = limit - max_new - overhead
        if budget < 2:
            raise ValueError(
                f"{task}: {where} leaves no room for a prompt "
                f"(max_new_tokens={max_new}, template overhead={overhead})"
            )
        for rec in records:
            samples.append(_build_one(tokenizer, rec, task, base, max_new, use_chat, overhead, budget, cap, limit, where))
    if opts["save_samples"]:
        from evals.sample_io import write_samples_jsonl

        write_samples_jsonl(samples, opts["save_samples"])
    return samples


def _build_one(
    tokenizer: Any,
    rec: dict,
    task: str,
    base: str,
    max_new: int,
    use_chat: bool,
    overhead: int,
    budget: int,
    cap: int | None,
    limit: int,
    where: str,
) -> Sample:
    prompt = build_prompt(rec, base)

    def render(max_length: int) -> tuple[list[int], tuple[str, int, int]]:
        text, n_raw, n_after = truncate_middle(tokenizer, prompt, max_length)
        return finalize_prompt(tokenizer, text, use_chat), (text, n_raw, n_after)

    try:
        max_length, ids, (text, n_raw, n_after) = fit_prompt(
            render, min(budget, cap) if cap else budget, limit - max_new
        )
    except PromptFitError:
        raise ValueError(f"{task}/{rec['_id']}: cannot fit the prompt in {where} "
                         f"(max_new_tokens={max_new})") from None
    wrapper = len(ids) - n_after  # chat-template / BOS tokens around the content
    meta: dict[str, Any] = {
        "all_classes": rec["all_classes"],
        "language": rec["language"],
        "length": rec["length"],
        "dataset": rec["dataset"],
        "truncated": text != prompt,
        "max_length": max_length,
        "num_content_tokens_raw": n_raw,
        "num_content_tokens": n_after,
        "chat_template": use_chat,
        "template_overhead": overhead,
    }
    if base == "samsum":
        meta.update(samsum_stop(tokenizer))
    return Sample(
        benchmark=BENCHMARK,
        task=task,
        sample_id=rec["_id"],
        prompt_ids=tuple(ids),
        references=tuple(rec["answers"]),
        max_new_tokens=max_new,
        num_input_tokens_raw=n_raw + wrapper,
        num_input_tokens=len(ids),
        meta=meta,
    )


def samsum_stop(tokenizer: Any) -> dict[str, Any]:
    """The official samsum stopping rule as Sample.meta keys (see the module docstring).

    ``stop_token_ids``: ``[tokenizer.encode("\\n", add_special_tokens=False)[-1]]``, ids to add to the
    model's EOS ids (official ``eos_token_id=[eos, newline_id]``); ``min_new_tokens``: 1 (official
    ``min_length=context_length+1``).
    """
    newline_ids = encode(tokenizer, "\n", add_special_tokens=False)
    return {
        "stop_token_ids": [int(newline_ids[-1])] if newline_ids else [],
        "min_new_tokens": 1,
    }


def score_sample(sample: Sample, prediction: str) -> float:
    """Official LongBench score of one prediction, in [0, 1] (max over the reference answers)."""
    return longbench_score(sample.task, prediction, sample.references, all_classes=sample.meta.get("all_classes"))


def longbench_e_report(samples: Sequence[Sample], scores: Sequence[float]) -> dict[str, Any]:
    """Task report of LongBench-E samples: ``score`` (official 0-100 mean over all samples) and
    ``buckets`` (official ``scorer_e``: 0-4k / 4-8k / 8k+ by ``meta["length"]``, None if empty)."""
    if len(samples) != len(scores):
        raise ValueError(f"{len(samples)} samples but {len(scores)} scores")
    return {
        "score": official_task_score(scores),
        "n": len(scores),
        "buckets": longbench_e_scores(scores, [s.meta["length"] for s in samples]),
    }


#: Fields of an official prediction line (``pred.py``) that scoring reads; ``length`` too for ``_e``.
PREDICTION_FIELDS = ("pred", "answers", "all_classes")


def score_prediction_records(task: str, records: Sequence[dict]) -> dict[str, Any]:
    """Re-score official LongBench prediction lines (``{"pred", "answers", "all_classes",
    "length"}``) exactly as the official ``eval.py`` does.

    Returns ``{"task", "score", "n"}`` with ``score = round(100 * mean, 2)`` (``scorer``); for a
    LongBench-E task (``<task>_e``) also ``"buckets"``: the dict ``scorer_e`` prints
    (``{"0-4k", "4-8k", "8k+"}``, ``None`` for an empty bucket where the official prints NaN).
    Deviation: ``all_classes`` is read per line (the official script uses the last line's value for
    the whole file; every official file has the same value on every line).
    Errors about one record raise :class:`evals.records.RecordError` (with its index).
    """
    base = _check_task(task)
    is_e = task != base
    if not records:
        raise ValueError(f"{task}: no prediction records")
    need = PREDICTION_FIELDS + (("length",) if is_e else ())
    scores: list[float] = []
    lengths: list[float] = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise RecordError(i, f"expected a JSON object, got {type(rec).__name__}")
        missing = [k for k in need if k not in rec]
        if missing:
            raise RecordError(i, f"missing field(s) {missing}")
        pred, answers, classes = rec["pred"], rec["answers"], rec["all_classes"]
        if not isinstance(pred, str):
            raise RecordError(i, f"field 'pred' must be a string, got {type(pred).__name__}")
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            raise RecordError(i, "field 'answers' must be a non-empty list of strings")
        if classes is not None and (not isinstance(classes, list) or not all(isinstance(c, str) for c in classes)):
            raise RecordError(i, "field 'all_classes' must be null or a list of strings")
        if classes is None and base in ("trec", "lsht"):
            raise RecordError(i, f"field 'all_classes' must be the label list for {base}")
        if is_e:
            length = rec["length"]
            if isinstance(length, bool) or not isinstance(length, (int, float)):
                raise RecordError(i, f"field 'length' must be a number, got {type(length).__name__}")
            lengths.append(length)
        scores.append(longbench_score(task, pred, answers, all_classes=classes))
    out: dict[str, Any] = {"task": task, "score": official_task_score(scores), "n": len(scores)}
    if is_e:
        out["buckets"] = longbench_e_scores(scores, lengths)
    return out


# ---------------------------------------------------------------------------------------------
# The registry entry
# ---------------------------------------------------------------------------------------------


class LongBench(BenchmarkBase):
    """LongBench v1 + LongBench-E as a :class:`evals.registry.Benchmark`: natural data, truncated
    officially to each context length."""

    __slots__ = ()

    name = BENCHMARK
    tasks = ALL_TASKS
    generated = False
    default_context_length = None
    OPTIONS = (
        Option(
            "--data-dir", None,
            help=f"folder of <task>.jsonl files (LongBench-E: <task>_e.jsonl); unset = ${ENV_DATA_DIR} if set, "
            f"else {default_data_dir()}; a missing file is read from the hub ({HUB_REPO}) when reachable or cached",
        ),
        Option(
            "--max-length", None, type=int,
            help="cap on the truncated prompt length in tokens (official: per-model max length); "
            "the model window and the context length always apply",
        ),
        Option("--save-samples", None, help="also write the built samples to this JSONL file"),
    )

    @property
    def default_tasks(self) -> tuple[str, ...]:  # type: ignore[override]
        """Data-dependent: every task with a ``<task>.jsonl`` in the default data folder
        (``$SPARSESPEC_DATA_DIR`` or the shared data), in official order; ``()`` when there is
        none. With ``options["data_dir"]`` use :meth:`resolve_tasks`."""
        try:
            return tuple(available_tasks(resolve_data_dir(None)))
        except FileNotFoundError:
            return ()

    def resolve_tasks(self, tasks: Sequence[str] | None = None,
                      options: Mapping[str, Any] | None = None) -> tuple[str, ...]:
        """The tasks ``build_samples`` would run: ``tasks`` validated, else those with a file."""
        opts = self.resolve_options(options)
        return tuple(_selected_tasks(tasks, resolve_data_dir(opts["data_dir"])))

    def check(self, *, tasks: Sequence[str] | None = None, options: Mapping[str, Any] | None = None) -> None:
        """Unknown option keys or task names, a bad ``max_length``, a missing data folder, or a
        task whose records cannot be read (a missing file is looked up on the hub, as
        ``build_samples`` would; a malformed record names file:line) raise one-line errors."""
        opts = self.resolve_options(options)
        _check_cap(opts["max_length"])
        data_dir = resolve_data_dir(opts["data_dir"])
        for task in _selected_tasks(tasks, data_dir):
            load_records(data_dir, task)

    def build_samples(self, tokenizer: Any, *, window: int, context_length: int | None = None,
                      tasks: Sequence[str] | None = None, num_samples: int | None = None,
                      max_new_tokens: int | None = None, options: Mapping[str, Any] | None = None) -> list[Sample]:
        return build_samples(tokenizer, window=window, context_length=context_length, tasks=tasks,
                             num_samples=num_samples, max_new_tokens=max_new_tokens, options=options)

    def score_sample(self, sample: Sample, prediction: str) -> float:
        return score_sample(sample, prediction)

    def score_predictions(self, task: str, records: Sequence[dict], *, model_name: str | None = None) -> dict:
        """:func:`score_prediction_records` (``model_name`` plays no part in LongBench's scorer)."""
        return score_prediction_records(task, records)


#: The registry entry (``evals.registry.get_benchmark("longbench")``).
benchmark = LongBench()
