"""LongBench v1: local JSONL loader, official prompts, official middle truncation, official scoring.

Ground truth: THUDM/LongBench (v1, now under ``LongBench/``): ``config/dataset2prompt.json``,
``config/dataset2maxlen.json``, ``pred.py`` (truncation + chat rule), ``eval.py`` / ``metrics.py``
(scoring, see :mod:`evals.metrics`).

Prompt construction per record (as ``pred.py``):

1. ``prompt = DATASET2PROMPT[task].format(**record)``
2. tokenize it; if longer than ``max_length`` tokens keep ``tokens[:half] + tokens[-half:]`` with
   ``half = int(max_length / 2)``, each half decoded separately with ``skip_special_tokens=True``
   and the two strings concatenated;
3. wrap it in the model's chat template unless the task is in :data:`NO_CHAT_TASKS`;
4. tokenize the result (the final ``prompt_ids``).

``max_length`` (the cap of step 2) is ``max_context - max_new_tokens - chat overhead`` so that
prompt + generation fits the model window, optionally lowered by ``--max-length`` (the official
code uses a per-model cap, ``model2maxlen.json``; the demo uses a small one for speed).

Deviations from ``pred.py`` (all documented in the report of the change):

* Step 2 tokenizes *without* special tokens (official includes the BOS of Llama-style tokenizers,
  which is then dropped by ``skip_special_tokens``; that shifts the head by one token). Without
  it the cap counts content tokens only.
* The official code trusts that decode -> re-encode keeps the length. It almost does; when the
  final prompt still overflows the window (re-tokenisation at the seam or at the chat-template
  boundary), ``max_length`` is lowered by the overflow and the record rebuilt, so the contract
  ``len(prompt_ids) + max_new_tokens <= max_context`` always holds.
* samsum: the official run also stops at ``"\\n"`` (extra EOS id). The engine takes no stop
  strings; ``meta["stop_at_newline"] = True`` records the intent, and scoring uses the first line
  of the prediction anyway (official eval.py).
* Chat templates: the official ``build_chat`` hard-codes a few 2023 chat formats; here the
  tokenizer's own chat template is used (one user turn, generation prompt appended).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script (`python evals/longbench.py`): make the project root importable and keep the
    # script folder off sys.path so evals/*.py cannot shadow top-level modules.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import json
import os
from collections.abc import Sequence
from typing import Any

from evals.base import Sample
from evals.common import add_argument_once, chat_wrap, encode, encode_prompt, has_chat_template
from evals.metrics import longbench_score

__all__ = [
    "BENCHMARK",
    "DATASET2PROMPT",
    "DATASET2MAXLEN",
    "NO_CHAT_TASKS",
    "REQUIRED_FIELDS",
    "default_data_dir",
    "resolve_data_dir",
    "available_tasks",
    "load_records",
    "build_prompt",
    "truncate_middle",
    "build_samples",
    "score_sample",
    "main",
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

ENV_DATA_DIR = "SPARSESPEC_DATA_DIR"


def _base_task(task: str) -> str:
    """``hotpotqa_e`` (LongBench-E file name) -> ``hotpotqa``; other names unchanged."""
    if task not in DATASET2PROMPT and task.endswith("_e") and task[:-2] in DATASET2PROMPT:
        return task[:-2]
    return task


def _check_task(task: str) -> str:
    base = _base_task(task)
    if base not in DATASET2PROMPT:
        import difflib

        close = difflib.get_close_matches(task, list(DATASET2PROMPT), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown LongBench task {task!r}{hint} (known: {', '.join(DATASET2PROMPT)})")
    return base


# ---------------------------------------------------------------------------------------------
# Data location and loading
# ---------------------------------------------------------------------------------------------


def default_data_dir() -> Path:
    """``<project root>/../shared/data/longbench_v1``."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "data" / "longbench_v1"


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Precedence: explicit ``data_dir`` > ``$SPARSESPEC_DATA_DIR`` > :func:`default_data_dir`.

    ``$SPARSESPEC_DATA_DIR`` may point at the shared data root (then its ``longbench_v1/`` is
    used) or directly at the folder of task files.
    """
    if data_dir:
        return Path(data_dir)
    env = os.environ.get(ENV_DATA_DIR)
    if env:
        root = Path(env)
        return root / "longbench_v1" if (root / "longbench_v1").is_dir() else root
    return default_data_dir()


def available_tasks(data_dir: str | os.PathLike) -> list[str]:
    """Tasks (official order) that have a ``<task>.jsonl`` file in ``data_dir``."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"LongBench data folder not found: {data_dir}")
    names = {p.stem for p in data_dir.glob("*.jsonl")}
    ordered = [t for t in DATASET2PROMPT if t in names]
    ordered += sorted(t for t in names if t.endswith("_e") and t[:-2] in DATASET2PROMPT)
    return ordered


def _validate_record(rec: Any, where: str) -> dict:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in REQUIRED_FIELDS if k not in rec]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    for key in ("input", "context", "_id"):
        if not isinstance(rec[key], str):
            raise ValueError(f"{where}: field {key!r} must be a string, got {type(rec[key]).__name__}")
    answers = rec["answers"]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{where}: field 'answers' must be a non-empty list of strings")
    classes = rec["all_classes"]
    if classes is not None and (
        not isinstance(classes, list) or not all(isinstance(c, str) for c in classes)
    ):
        raise ValueError(f"{where}: field 'all_classes' must be null or a list of strings")
    return rec


def load_records(data_dir: str | os.PathLike | None, task: str) -> list[dict]:
    """All records of ``<data_dir>/<task>.jsonl`` in file order.

    Blank lines are skipped; anything else that is not a valid record (malformed JSON, not an
    object, a missing or mistyped field, a duplicate ``_id``) raises ``ValueError`` naming the
    file and the 1-based line number. Nothing is dropped silently.
    """
    _check_task(task)
    path = resolve_data_dir(data_dir) / f"{task}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no LongBench file for task {task!r}: {path}")
    records: list[dict] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from e
            _validate_record(rec, where)
            if rec["_id"] in seen:
                raise ValueError(f"{where}: duplicate _id {rec['_id']!r} (first on line {seen[rec['_id']]})")
            seen[rec["_id"]] = lineno
            records.append(rec)
    return records


# ---------------------------------------------------------------------------------------------
# Prompting and truncation
# ---------------------------------------------------------------------------------------------


def build_prompt(record: dict, task: str) -> str:
    """The official prompt: ``dataset2prompt[task].format(**record)`` (no chat template)."""
    return DATASET2PROMPT[_check_task(task)].format(**record)


def truncate_middle(tokenizer: Any, text: str, max_length: int) -> tuple[str, int, int]:
    """Official middle truncation to ``max_length`` tokens.

    Returns ``(text, n_raw, n_after)``: the (possibly) truncated text, the token count of the
    input and the token count of the returned text (re-tokenised; both without special tokens).
    When truncating, the text is ``decode(ids[:half]) + decode(ids[-half:])`` with
    ``half = int(max_length / 2)`` (so an odd ``max_length`` keeps ``max_length - 1`` tokens).
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (got {max_length}): half would be 0")
    ids = encode(tokenizer, text, add_special_tokens=False)
    n_raw = len(ids)
    if n_raw <= max_length:
        return text, n_raw, n_raw
    half = int(max_length / 2)
    out = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )
    return out, n_raw, len(encode(tokenizer, out, add_special_tokens=False))


def _finalize(tokenizer: Any, text: str, use_chat: bool) -> list[int]:
    final_text = chat_wrap(tokenizer, text) if use_chat else text
    return encode_prompt(tokenizer, final_text, chat_templated=use_chat)


def _template_overhead(tokenizer: Any, use_chat: bool) -> int:
    """Tokens the final prompt adds around the content (chat template or BOS)."""
    return len(_finalize(tokenizer, "", use_chat))


def _get(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def _selected_tasks(args: Any, data_dir: Path) -> list[str]:
    value = getattr(args, "tasks", None)
    if value:
        items = value.split(",") if isinstance(value, str) else list(value)
        tasks = [t.strip() for t in items if t and t.strip()]
        for t in tasks:
            _check_task(t)
        if tasks:
            return tasks
    tasks = available_tasks(data_dir)
    if not tasks:
        raise FileNotFoundError(f"no LongBench task files (<task>.jsonl) in {data_dir}")
    return tasks


def build_samples(tokenizer: Any, args: Any, max_context: int) -> list[Sample]:
    """LongBench samples for ``args.tasks`` (comma list or list; default: every task with a file).

    Reads ``args.data_dir``, ``args.num_samples`` (per-task cap, first records of the file),
    ``args.max_new_tokens`` (overrides the official per-task budget), ``args.max_length`` (cap
    of the truncation length) and ``args.save_samples`` (write the samples as JSONL); all optional.
    """
    data_dir = resolve_data_dir(getattr(args, "data_dir", None))
    tasks = _selected_tasks(args, data_dir)
    num_samples = getattr(args, "num_samples", None)
    if num_samples is not None and num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    override_new = getattr(args, "max_new_tokens", None)
    cap = getattr(args, "max_length", None)
    if cap is not None and cap < 2:
        raise ValueError(f"--max-length must be >= 2, got {cap}")

    samples: list[Sample] = []
    for task in tasks:
        base = _base_task(task)
        records = load_records(data_dir, task)
        if num_samples is not None:
            records = records[:num_samples]
        max_new = int(override_new) if override_new else DATASET2MAXLEN[base]
        use_chat = base not in NO_CHAT_TASKS and has_chat_template(tokenizer)
        overhead = _template_overhead(tokenizer, use_chat)
        budget = max_context - max_new - overhead
        if budget < 2:
            raise ValueError(
                f"{task}: max_context={max_context} leaves no room for a prompt "
                f"(max_new_tokens={max_new}, template overhead={overhead})"
            )
        for rec in records:
            samples.append(
                _build_one(tokenizer, rec, task, base, max_new, use_chat, overhead, budget, cap, max_context)
            )
    save = getattr(args, "save_samples", None)
    if save:
        from evals.sample_io import write_samples_jsonl

        write_samples_jsonl(samples, save)
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
    max_context: int,
) -> Sample:
    prompt = build_prompt(rec, base)
    max_length = min(budget, cap) if cap else budget
    for _ in range(8):
        text, n_raw, n_after = truncate_middle(tokenizer, prompt, max_length)
        ids = _finalize(tokenizer, text, use_chat)
        overflow = len(ids) + max_new - max_context
        if overflow <= 0:
            break
        max_length -= overflow
        if max_length < 2:
            break
    else:
        overflow = 1
    if overflow > 0:
        raise ValueError(f"{task}/{rec['_id']}: cannot fit the prompt in max_context={max_context}")
    wrapper = len(ids) - n_after  # chat-template / BOS tokens around the content
    return Sample(
        benchmark=BENCHMARK,
        task=task,
        sample_id=rec["_id"],
        prompt_ids=tuple(ids),
        references=tuple(rec["answers"]),
        max_new_tokens=max_new,
        num_input_tokens_raw=n_raw + wrapper,
        num_input_tokens=len(ids),
        meta={
            "all_classes": rec["all_classes"],
            "language": rec["language"],
            "length": rec["length"],
            "dataset": rec["dataset"],
            "truncated": n_raw > max_length,
            "max_length": max_length,
            "num_content_tokens_raw": n_raw,
            "num_content_tokens": n_after,
            "chat_template": use_chat,
            "template_overhead": overhead,
            "stop_at_newline": base == "samsum",
        },
    )


def score_sample(sample: Sample, prediction: str) -> float:
    """Official LongBench score of one prediction, in [0, 1] (max over the reference answers)."""
    return longbench_score(sample.task, prediction, sample.references, all_classes=sample.meta.get("all_classes"))


def main(argv: Sequence[str] | None = None) -> int:
    from cluster.jobs import common_parser, run

    parser = common_parser("LongBench v1 (official prompts, truncation and metrics) on local JSONL files")
    add_argument_once(
        parser,
        "--data-dir",
        default=None,
        help=f"folder of <task>.jsonl files; unset = ${ENV_DATA_DIR} if set, else {default_data_dir()}",
    )
    add_argument_once(
        parser,
        "--max-length",
        type=int,
        default=None,
        help="cap on the truncated prompt length in tokens (official: per-model max length); "
        "the model window always applies",
    )
    add_argument_once(parser, "--save-samples", default=None, help="also write the built samples to this JSONL file")
    args = parser.parse_args(argv)
    # Hand over the functions of the importable module (picklable by reference), also when this
    # file runs as __main__.
    import importlib

    mod = importlib.import_module("evals.longbench")
    return run(BENCHMARK, args, mod.build_samples, mod.score_sample)


if __name__ == "__main__":
    raise SystemExit(main())
