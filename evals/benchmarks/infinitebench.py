"""InfiniteBench: official prompt sets, output budgets, middle truncation and per-task scorers.

Ground truth: OpenBMB/InfiniteBench ``src/prompt.py`` (the four prompt sets), ``src/eval_utils.py``
(``DATA_NAME_TO_MAX_NEW_TOKENS``, ``create_prompt``, ``get_answer``), ``src/eval_yarn_mistral.py``
(truncation of the open-model runs) and ``src/compute_scores.py`` (``get_score_one_*``, the task
mean it prints). Data: the hub dataset ``xinrongzhang2022/InfiniteBench`` or local
``<task>.jsonl`` files in its schema (``id, context, input, answer, options``).

Prompt construction per record (as ``eval_yarn_mistral.py`` / ``create_prompt``):

1. ``prompt = template.format(...)`` with the task's fields (see :func:`build_prompt`): choice tasks
   list their four options as ``A.``-``D.``; ``code_run`` takes ``func``/``func_call`` from the
   first ``func_N(x)`` in ``input``; ``math_find`` prefixes ``What is <the ... number> in the
   following list?`` taken from ``input``. The gpt4 set sends math_calc's bare context (official).
2. ``tokens = tokenizer.encode(prompt)`` (special tokens included, as ``tok.encode``); if longer
   than ``max_length`` keep ``tokens[:split] + tokens[-split:]`` with ``split = max_length // 2``
   and decode that joined list once with ``skip_special_tokens=True`` (official: one decode of
   the joined list, unlike LongBench's two decodes).
3. optionally wrap it in the tokenizer's chat template (see :data:`CHAT_PROMPT_SETS`);
4. tokenize the result (``tokenizer(text)``, or without specials when chat-templated).

``max_length`` (step 2) is ``limit - max_new_tokens - chat overhead`` with ``limit =
min(context_length, window)`` (``context_length`` None: the model window), so that prompt plus
generation fit the sweep's context length and the model window, optionally lowered by the
``max_length`` option (``--max-length``; official: the model's length, 128K for YaRN-Mistral).
Overflow from re-tokenisation at the seam is corrected by lowering ``max_length`` and rebuilding
(:func:`evals.common.fit_prompt`, as in :mod:`evals.benchmarks.longbench`).

Registry entry: :data:`benchmark` (``evals.registry.get_benchmark("infinitebench")``), an
:class:`InfiniteBench`; its options are ``data_dir``, ``max_length``, ``prompt_set``,
``chat_template``, ``no_hub`` and ``save_samples``.

Answers (``get_answer``): ``longbook_choice_eng`` and ``code_debug`` become ``[option text,
letter]`` (letter = position of the answer among ``options``); every other task keeps ``answer``
as stored. The scorers then take numbers where the official code expects numbers and strings
where it expects strings, so the hub copy (every answer a list of strings) scores like the
original files: ``code_run`` ``["-14"]`` -> ``-14``, ``math_find`` ``["7"]`` -> ``7`` and
``["3.5"]`` -> ``3.5``, ``math_calc`` ``["1", "4", "8"]`` -> ``[1, 4, 8]``, one-element lists
unwrapped where the official scorer expects one value (``passkey``, ``number_string``,
``kv_retrieval``, ``code_run``, ``math_find``, ``longdialogue_qa_eng``), a bare string wrapped where it
iterates a list (``longbook_qa_eng/chn``, ``longbook_sum_eng``). Unparseable numbers are load errors
naming the file and line, never silent zeros.

Scale: every per-sample score is in [0, 1]; the task score of :func:`score_prediction_records`
is the plain mean, exactly what ``compute_scores.py`` prints (a fraction, not a percentage; the
README tables show it x100).

Deviations from the official code (each keeps the official number wherever the official code
returns one):

* Records: the official loader trusts every line; here malformed JSON, missing fields, wrong
  types, duplicate ids and answers that are not among the options raise ``ValueError`` naming
  file and line. The shared legacy passkey layout (``input, context, answer, len``, no ``id`` nor
  ``options``) is accepted for ``passkey`` only: ``id`` = the 1-based line number, ``options`` = [].
* Templates are rendered with every field at hand (``context``, ``input``, ``question`` =
  ``input``, options, ...), so templates that the official ``create_prompt`` cannot format
  (claude2 ``longbook_qa_eng`` uses ``{input}``; kimi's ``{file:{context}}`` /
  ``{file:{document}}`` / ``{fcontext}`` file-upload placeholders) are rendered: kimi's file
  placeholder becomes the context inline (there is no file API here).
* ``math_find`` with an integer answer and a decimal first number in the prediction: official
  ``int("3.5")`` raises and aborts the whole run; here that sample scores 0.
* ``kv_retrieval`` with a one-element answer list (the hub layout): official ``list in words`` is
  always False; here the element is looked up (several elements: any of them).
* ``longdialogue_qa_eng`` with a bare-string answer: official ``label[0]`` takes its first
  character; here the string is the name (a list answer scores exactly as official: element 0,
  compared case-sensitively with the upper-cased words of the prediction).
* A ``None`` prediction (failed generation) scores as the empty string (wrong, still counted).
* ``compute_scores.py`` drops the first predicted number of ``math_calc`` for ``model_name ==
  "gpt4"``; here that follows ``model_name`` in :func:`score_prediction_records` (``python -m
  evals.score --model-name gpt4``; the official ``--model_name`` defaults to ``gpt4``, ours to no
  model, i.e. no rule) and the prompt set of a sample in :func:`score_sample` (the official
  pipeline ties both to the one model name).
* Chat template: the official open-model scripts send the raw prompt (no chat template), the
  API runs (gpt4/claude2/kimi) a chat turn. ``--chat-template auto`` (default) does the same:
  raw for ``yarn_mistral``, the tokenizer's chat template (one user turn, no system message) for
  the API prompt sets.
"""
from __future__ import annotations

import difflib
import json
import os
import re
from collections import Counter
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
from evals.records import RecordError
from evals.spec import BenchmarkBase, Option, check_positive_int
from evals.metrics import normalize_answer, normalize_zh_answer

__all__ = [
    "BENCHMARK",
    "TASKS",
    "HF_DATASET",
    "DATA_NAME_TO_MAX_NEW_TOKENS",
    "GPT4_TEMPLATES",
    "YARN_MISTRAL_TEMPLATES",
    "CLAUDE2_TEMPLATES",
    "KIMI_TEMPLATES",
    "PROMPT_SETS",
    "DEFAULT_PROMPT_SET",
    "CHAT_PROMPT_SETS",
    "REQUIRED_FIELDS",
    "default_data_dir",
    "resolve_data_dir",
    "task_file",
    "available_tasks",
    "load_records",
    "get_answer",
    "build_prompt",
    "truncate_middle",
    "build_samples",
    "score_one",
    "score_sample",
    "score_prediction_records",
    "OFFICIAL_MODEL_NAMES",
    "InfiniteBench",
    "benchmark",
]

BENCHMARK = "infinitebench"
HF_DATASET = "xinrongzhang2022/InfiniteBench"

#: The 12 tasks, in the order of the official ``ALL_TASKS`` (compute_scores.py).
TASKS = (
    "passkey",
    "number_string",
    "kv_retrieval",
    "longdialogue_qa_eng",
    "longbook_sum_eng",
    "longbook_choice_eng",
    "longbook_qa_eng",
    "longbook_qa_chn",
    "math_find",
    "math_calc",
    "code_run",
    "code_debug",
)

#: Official ``DATA_NAME_TO_MAX_NEW_TOKENS`` (src/eval_utils.py).
DATA_NAME_TO_MAX_NEW_TOKENS: dict[str, int] = {
    "passkey": 6,
    "number_string": 12,
    "kv_retrieval": 50,
    "longbook_sum_eng": 1200,
    "longbook_choice_eng": 40,
    "longbook_qa_eng": 40,
    "longbook_qa_chn": 40,
    "longdialogue_qa_eng": 40,
    "math_find": 3,
    "math_calc": 30000,
    "code_run": 5,
    "code_debug": 5,
}

# ---------------------------------------------------------------------------------------------
# Official prompt sets (src/prompt.py), character for character, typos included
# ("funtion", "called named", claude2's "${func}").
# ---------------------------------------------------------------------------------------------

GPT4_TEMPLATES: dict[str, str] = {
    "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you about the important information there.\n\n{context}\n\n{input}",  # noqa: E501
    "number_string": "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the important information there.\n\n{context}\n\n{input}",  # noqa: E501
    "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}",  # noqa: E501
    "longbook_qa_eng": "Read the book below and answer a question.\n\n{context}\n\nQuestion: {question}\n\nBe very concise.",  # noqa: E501
    "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\n\nOnly one of the following options is correct, tell me the answer using one single letter (A, B, C, or D). Don't say anything else.\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}",  # noqa: E501
    "longbook_sum_eng": "Summarize the following book.\n\n{context}",
    "longbook_qa_chn": "请根据以下书籍回答我的问题。\n\n{context}\n\n问题：{question}\n请尽量简短地回答。",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "math_calc": "Compute the intermediate values in the following long expression.\n\n{context}",
    "code_run": "Following is a set of Python functions. There is a function called named {func}.\n\n{context}\n\nPlease give me the exact number of the return value of {func_call}. Be concise. Your response must end with the final returned value.",  # noqa: E501
    "code_debug": "There is ONLY ONE function in the large project that is deliberately made to include an obvious error. Please find the function that contains the most obvious errors. I will give you four options to narrow your scope. You can inspect the options and think. Eventually, tell me the answer using one single letter (A, B, C, or D).\n\n{context}\n\nWhich funtion has deliberate error?\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nYou should first find the functions in the options. Repeat their content, inspect through code, and at last give me your answer for the function that has the deliberate and obvious error in A, B, C, or D.",  # noqa: E501
    "longdialogue_qa_eng": "Below is a dialogue script where one random occurrence of a character name is replaced with \"$$MASK$$\", and you should try to guess who that character is.\n\nThe dialogue:\n\n---\n\n{context}\n\n---\n\nEnd of dialogue.\n\nWhich character is most likely \"$$MASK$$\"? Just say the name used by the scriptwriter (before the colon marks) of one single character and nothing else.",  # noqa: E501
}

YARN_MISTRAL_TEMPLATES: dict[str, str] = {
    "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about the important information.\n\n{context}\n\n{input}\n\nThe pass key is",  # noqa: E501
    "number_string": "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the important information there.\n\n{context}\n\n{input}\n\nThe sequence of digits is",  # noqa: E501
    "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}",  # noqa: E501
    "longbook_sum_eng": "Summarize the book below.\n\n{context}\n\nSummary:",
    "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe letter of the correct answer is",  # noqa: E501
    "longbook_qa_eng": "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\nQuestion: {question}\nAnswer:",  # noqa: E501
    "longbook_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "math_calc": "Let us calculate the intermediate values of an expression.\n\nExpression: 1 + 3 + 4\nValues: [1, 4, 8]\n\nExpression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: {context}\nValues:",  # noqa: E501
    "code_run": "There is a function called {func} in the following Python code.\n\n{context}\n\nPlease compute the exact value of {func_call}. The value of {func_call} is",  # noqa: E501
    "code_debug": "Following is a Python code where exactly one of the functions/methods has a deliberate error that makes it crash.\n\n{context}\n\nOptions:\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe correct option is:",  # noqa: E501
    "longdialogue_qa_eng": "Below is a dialogue script where one random occurrence of a character name is replaced with \"$$MASK$$\", and you should try to guess who that character is.\n\n{context}\n\nThe name that has been replaced with $$MASK$$ is likely",  # noqa: E501
}

CLAUDE2_TEMPLATES: dict[str, str] = {
    "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you about the important information there.\n\n{context}\n{input}\nThe pass key is",  # noqa: E501
    "number_string": "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the important information there.\n\n{context}\n{input}\nThe sequence of digits is",  # noqa: E501
    "kv_retrieval": "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the important information there.\n\n{context}\n{input}",  # noqa: E501
    "longbook_sum_eng": "Summarize the following book.\n\n{context}",
    "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\n\nOnly one of the following options is correct, tell me the answer using one single letter (A, B, C, or D). Don't say anything else.\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}",  # noqa: E501
    "longbook_qa_eng": "Read the novel below and answer a question:\n\n{context}\n\n{input}\nPlease answer as short as possible. The answer is: ",  # noqa: E501
    "longbook_qa_chn": "请根据以下书籍回答我的问题。\n\n{context}\n\n问题：{question}\n请尽量简短地回答。",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "math_calc": "Let us calculate the intermediate values of an expression.\nExpression: 1 + 3 + 4\nValues: [1, 4, 8]\n\nExpression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: {context}\nValues:",  # noqa: E501
    "code_run": "In the file functions_module.py, there is a function called ${func}.\n\n\nHere is the content of functions_module.py:\n{context}\n\nPlease give me the exact number of the return value of {func_call}. Your response should end with the sentence 'The return value is:'.",  # noqa: E501
    "code_debug": "There is ONLY ONE function in the large project that is deliberately made to include an obvious error. Please find the function that contains the most obvious errors. I will give you four options to narrow your scope. You can inspect through the options and think. Eventually, tell me the answer using one single letter (A, B, C, or D).\n\n{context}\n\nWhich funtion has deliberate error?\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nYou should first find the functions in the options. Repeat their content, inspect through code, and at last give me your answer for the function that has the deliberate and obvious error in A, B, C, or D.",  # noqa: E501
    "longdialogue_qa_eng": "Below is a dialogue script where one random occurrence of a character name is replaced with \"$$MASK$$\", and you should try to guess who that character is.\n\nThe dialogue:\n\n---\n\n{context}\n\n---\n\nEnd of dialogue.\n\nWhich character is most likely \"$$MASK$$\"? Just say the name used by the scriptwriter (before the colon marks) of one single character and nothing else.",  # noqa: E501
}

KIMI_TEMPLATES: dict[str, str] = {
    "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you about the important information there.\n\n{context}\n{input}\nThe pass key is",  # noqa: E501
    "number_string": "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the important information there.\n\n{context}\n{input}\nThe sequence of digits is",  # noqa: E501
    "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n{input}",  # noqa: E501
    "longbook_sum_eng": "Summarize the book below:\n\n{file:{context}}",
    "longbook_choice_eng": "Read the book and answer the question.\n\nQuestion: {question}\n\nOnly one of the following options is correct, tell me the answer using one single letter (A, B, C, or D). Don't say anything else.\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}" + "{file:{document}}",  # noqa: E501
    "longbook_qa_eng": "Read the book below and answer a question.\n\nQuestion: {question}\n\nBe very concise." + "{file:{context}}",  # noqa: E501
    "longbook_qa_chn": "阅读以下书籍然后回答问题。\n\n问题：{question}\n答案：" + "{file:{context}}",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "math_calc": "Let us calculate the intermediate values of an expression.\nExpression: 1 + 3 + 4\nValues: [1, 4, 8]\n\nExpression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: {context}\nValues:",  # noqa: E501
    "code_run": "In the file functions_module.py, there is a function called ${func}.\n\n\nHere is the content of functions_module.py:\n\nPlease give me the exact number of the return value of ${func_call}. Your response should end with the sentence 'The return value is:'." + "{context}",  # noqa: E501
    "code_debug": "Below is a code repository where there is one single function with bugs that causes an error. Please tell me the name of that function.\nWhich function has bugs? Give me the final answer in this format: \"[FINAL ANSWER: XXX]\". Don't say anything else." + "{fcontext}",  # noqa: E501
    "longdialogue_qa_eng": "Below is a dialogue script where one random occurrence of a character name is replaced with \"$$MASK$$\", and you should try to guess who that character is. Give me the answer using the name before the colons, don't say anything else.\n\n{context}",  # noqa: E501
}

#: ``--prompt-set`` name -> templates. ``yarn_mistral`` is the official set of the open-model runs.
PROMPT_SETS: dict[str, dict[str, str]] = {
    "yarn_mistral": YARN_MISTRAL_TEMPLATES,
    "gpt4": GPT4_TEMPLATES,
    "claude2": CLAUDE2_TEMPLATES,
    "kimi": KIMI_TEMPLATES,
}
DEFAULT_PROMPT_SET = "yarn_mistral"
#: Spellings accepted for ``--prompt-set`` besides the keys of :data:`PROMPT_SETS`.
PROMPT_SET_ALIASES = {"yarn-mistral": "yarn_mistral", "open": "yarn_mistral"}
#: Prompt sets that the official code sends as a chat turn (API models); ``--chat-template auto``
#: wraps these in the tokenizer's chat template and leaves ``yarn_mistral`` raw.
CHAT_PROMPT_SETS = frozenset({"gpt4", "claude2", "kimi"})
CHAT_TEMPLATE_MODES = ("auto", "on", "off")

#: kimi's file-upload placeholders, rendered as the context inline.
_KIMI_FILE_PLACEHOLDERS = ("{file:{context}}", "{file:{document}}", "{fcontext}")

#: Fields of an official record (the hub schema).
REQUIRED_FIELDS = ("id", "context", "input", "answer", "options")
#: Fields required of the legacy passkey layout (shared sample: ``input, context, answer, len``).
LEGACY_PASSKEY_FIELDS = ("input", "context", "answer")
CHOICE_TASKS = frozenset({"longbook_choice_eng", "code_debug"})
OPTION_LETTERS = "ABCD"

_CODE_RUN_CALL = re.compile(r"func_[0-9]+\(\-?[0-9]+\)")
_MATH_FIND_TARGET = re.compile(r"The .+ of")
_INT_TEXT = re.compile(r"\s*[-+]?\d+\s*")


def _check_task(task: str) -> str:
    if task not in TASKS:
        close = difflib.get_close_matches(task, TASKS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown InfiniteBench task {task!r}{hint} (known: {', '.join(TASKS)})")
    return task


def resolve_prompt_set(name: str | None) -> str:
    """``None`` -> the default set; aliases (``yarn-mistral``, ``open``) -> canonical name."""
    if name is None:
        return DEFAULT_PROMPT_SET
    name = PROMPT_SET_ALIASES.get(name, name)
    if name not in PROMPT_SETS:
        raise ValueError(
            f"unknown InfiniteBench prompt set {name!r} (known: {', '.join(PROMPT_SETS)}, "
            f"aliases: {', '.join(PROMPT_SET_ALIASES)})"
        )
    return name


# ---------------------------------------------------------------------------------------------
# Data location and loading
# ---------------------------------------------------------------------------------------------


def default_data_dir() -> Path:
    """``<project root>/../shared/data/infinitebench``."""
    return shared_data_dir("infinitebench")


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Explicit ``data_dir`` > ``$SPARSESPEC_DATA_DIR`` (the shared root, or this benchmark's
    folder) > :func:`default_data_dir` (see :func:`evals.common.resolve_benchmark_dir`)."""
    return resolve_benchmark_dir(data_dir, "infinitebench")


def _variant_files(data_dir: Path, task: str) -> list[Path]:
    """``<task>_*.jsonl`` / ``<task>.*.jsonl`` (e.g. the shared ``passkey_8192.depth5.jsonl``).
    No task name followed by ``_`` is the start of another task name, so this is unambiguous."""
    found = {p for p in data_dir.glob(f"{task}_*.jsonl")} | {p for p in data_dir.glob(f"{task}.*.jsonl")}
    return sorted(p for p in found if p.is_file())


def task_file(data_dir: str | os.PathLike, task: str) -> Path | None:
    """The local file of ``task``: ``<task>.jsonl``, else the single ``<task>_*.jsonl`` /
    ``<task>.*.jsonl`` variant; ``None`` when there is none. Several variants and no exact file
    is an error (say which one with ``--data-dir`` pointing at a folder holding only it)."""
    _check_task(task)
    data_dir = Path(data_dir)
    exact = data_dir / f"{task}.jsonl"
    if exact.is_file():
        return exact
    if not data_dir.is_dir():
        return None
    variants = _variant_files(data_dir, task)
    if len(variants) > 1:
        names = ", ".join(p.name for p in variants)
        raise ValueError(f"several InfiniteBench files for task {task!r} in {data_dir} ({names}) and no {task}.jsonl")
    return variants[0] if variants else None


def available_tasks(data_dir: str | os.PathLike) -> list[str]:
    """Tasks (official order) that have a local file in ``data_dir``."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"InfiniteBench data folder not found: {data_dir}")
    return [t for t in TASKS if task_file(data_dir, t) is not None]


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_scalar_answer(x: Any) -> bool:
    return isinstance(x, str) or _is_number(x)


def _validate_answer_shape(answer: Any, where: str) -> None:
    if _is_scalar_answer(answer):
        return
    if isinstance(answer, list) and answer:
        if all(_is_scalar_answer(a) for a in answer):
            return
        # math_calc in the original files: [[1, 4, 8]]
        if len(answer) == 1 and isinstance(answer[0], list) and answer[0] and all(_is_number(a) or isinstance(a, str) for a in answer[0]):
            return
    raise ValueError(
        f"{where}: field 'answer' must be a string, a number or a non-empty list of them, got {json.dumps(answer)[:80]}"
    )


def _normalize_record(rec: Any, task: str, where: str, lineno: int) -> dict:
    """Check one record; fill the legacy passkey layout; attach ``_where`` and ``_label``."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in REQUIRED_FIELDS if k not in rec]
    if missing:
        legacy_ok = task == "passkey" and set(missing) <= {"id", "options"} and all(k in rec for k in LEGACY_PASSKEY_FIELDS)
        if not legacy_ok:
            raise ValueError(f"{where}: missing field(s) {missing} (official InfiniteBench fields: {list(REQUIRED_FIELDS)})")
        rec = dict(rec)
        rec.setdefault("id", lineno)  # legacy passkey layout: id = 1-based line number
        rec.setdefault("options", [])
    else:
        rec = dict(rec)
    for key in ("context", "input"):
        if not isinstance(rec[key], str):
            raise ValueError(f"{where}: field {key!r} must be a string, got {type(rec[key]).__name__}")
    if not (isinstance(rec["id"], str) or (isinstance(rec["id"], int) and not isinstance(rec["id"], bool))):
        raise ValueError(f"{where}: field 'id' must be an integer or a string, got {type(rec['id']).__name__}")
    options = rec["options"]
    if options is None:
        options = rec["options"] = []
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        raise ValueError(f"{where}: field 'options' must be a list of strings")
    _validate_answer_shape(rec["answer"], where)
    try:
        label = get_answer(rec, task)
        _canonical_label(task, label)  # numbers that must parse, choice labels, ...
        _prompt_fields(rec, task)  # code_run / math_find need something in `input`
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    rec["_where"] = where
    rec["_label"] = label
    return rec


def _load_from_hub(task: str, looked: str) -> list[dict]:
    """The hub split ``task`` of :data:`HF_DATASET` through ``datasets`` (cache or network;
    :func:`evals.hub.load_hub_rows` skips the network retries when the hub does not resolve).

    The features are the ones the dataset card prescribes (the files disagree on the type of
    ``answer``; cast, every answer is a list of strings)."""
    from evals.hub import load_hub_rows

    import datasets  # lazy: heavy, and only needed when no local file exists

    list_type = getattr(datasets, "List", None) or datasets.Sequence
    features = datasets.Features(
        {
            "id": datasets.Value("int64"),
            "context": datasets.Value("string"),
            "input": datasets.Value("string"),
            "answer": list_type(datasets.Value("string")),
            "options": list_type(datasets.Value("string")),
        }
    )
    return load_hub_rows(HF_DATASET, None, task, looked_at=looked, features=features)


def load_records(data_dir: str | os.PathLike | None, task: str, *, hub: bool = True) -> list[dict]:
    """All records of ``task`` in file order, validated.

    Looks for the local file (:func:`task_file`) in ``resolve_data_dir(data_dir)``; when there is
    none and ``hub`` is true, loads the split from :data:`HF_DATASET` (``datasets``, from its
    cache or the network). Blank lines are skipped; malformed JSON, a record that is not an
    object, a missing or mistyped field, a duplicate ``id``, an answer that is not among the
    options or a number that does not parse raise ``ValueError`` naming the file and 1-based line.
    Each record gets ``_where`` (file:line) and ``_label`` (the official ``get_answer``).
    """
    _check_task(task)
    folder = resolve_data_dir(data_dir)
    path = task_file(folder, task)
    if path is None:
        looked = f"{folder / (task + '.jsonl')} (nor {task}_*.jsonl / {task}.*.jsonl there)"
        if not hub:
            raise FileNotFoundError(f"no InfiniteBench file for task {task!r}: looked for {looked}; hub disabled")
        # evals.hub.HubUnavailableError (a FileNotFoundError): one line saying where it looked
        raw = _load_from_hub(task, f"no InfiniteBench file for task {task!r}: looked for {looked}")
        return _check_all(((f"hf://{HF_DATASET}[{task}]#{i}", i + 1, rec) for i, rec in enumerate(raw)), task)

    def lines() -> Iterable[tuple[str, int, Any]]:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from e
                yield where, lineno, rec

    try:
        return _check_all(lines(), task)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from e


def _check_all(items: Iterable[tuple[str, int, Any]], task: str) -> list[dict]:
    records: list[dict] = []
    seen: dict[str, str] = {}
    for where, lineno, raw in items:
        rec = _normalize_record(raw, task, where, lineno)
        key = str(rec["id"])
        if key in seen:
            raise ValueError(f"{where}: duplicate id {rec['id']!r} (first at {seen[key]})")
        seen[key] = where
        records.append(rec)
    return records


# ---------------------------------------------------------------------------------------------
# Official answers and prompts
# ---------------------------------------------------------------------------------------------


def get_answer(record: dict, task: str) -> Any:
    """Official ``get_answer``: ``[option text, letter]`` for ``longbook_choice_eng`` and
    ``code_debug`` (answer as a string, a one-element list, or already ``[text, letter]``); the
    stored ``answer`` unchanged for every other task."""
    answer = record["answer"]
    if task not in CHOICE_TASKS:
        return answer
    options = list(record.get("options") or [])
    if isinstance(answer, list) and len(answer) == 2 and answer[1] in ("A", "B", "C", "D"):
        return list(answer)
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    if not isinstance(answer, str):
        raise ValueError(f"{task}: answer must be an option text, [text] or [text, letter], got {answer!r}")
    if answer not in options[: len(OPTION_LETTERS)]:
        raise ValueError(f"{task}: answer {answer!r} is not among the first four options {options[:4]}")
    return [answer, OPTION_LETTERS[options.index(answer)]]


def _prompt_fields(record: dict, task: str) -> dict[str, str]:
    """Every field a template of ``task`` may name (superset of what ``create_prompt`` passes)."""
    fields = {"context": record["context"], "input": record["input"], "question": record["input"]}
    if task in CHOICE_TASKS:
        options = record.get("options") or []
        if len(options) < 4:
            raise ValueError(f"{task}: needs 4 options, got {len(options)}")
        for letter, option in zip(OPTION_LETTERS, options):
            fields[f"OPTION_{letter}"] = option
    elif task == "code_run":
        found = _CODE_RUN_CALL.findall(record["input"])
        if not found:
            raise ValueError(f"code_run: no function call func_N(x) in input {record['input'][:80]!r}")
        fields["func_call"] = found[0]
        fields["func"] = found[0].split("(")[0]
    elif task == "math_find":
        found = _MATH_FIND_TARGET.findall(record["input"])
        if not found:
            raise ValueError(f"math_find: cannot find the target number ('The ... of') in input {record['input'][:80]!r}")
        target = found[0].lower()[:-3]  # "The largest number of" -> "the largest number"
        fields["prefix"] = f"What is {target} in the following list?"
    return fields


def build_prompt(record: dict, task: str, prompt_set: str | None = None) -> str:
    """The official prompt of ``record`` (no truncation, no chat template)."""
    _check_task(task)
    prompt_set = resolve_prompt_set(prompt_set)
    if prompt_set == "gpt4" and task == "math_calc":
        return record["context"]  # official create_prompt: GPT-4 gets the bare expression
    template = PROMPT_SETS[prompt_set][task]
    for placeholder in _KIMI_FILE_PLACEHOLDERS:
        template = template.replace(placeholder, "{context}")
    return template.format(**_prompt_fields(record, task))


# ---------------------------------------------------------------------------------------------
# Truncation and samples
# ---------------------------------------------------------------------------------------------


def truncate_middle(tokenizer: Any, text: str, max_length: int) -> tuple[str, int, int]:
    """Official ``truncate_by_tokens`` (eval_yarn_mistral.py) to ``max_length`` tokens.

    ``tokens = tokenizer.encode(text)`` (special tokens included); when longer than ``max_length``
    keep ``tokens[:split] + tokens[-split:]``, ``split = max_length // 2`` (an odd ``max_length``
    keeps ``max_length - 1``), decoded as one list with ``skip_special_tokens=True``.
    Returns ``(text, n_raw, n_after)``: token counts (special tokens included) before and after.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (got {max_length}): split would be 0")
    ids = encode(tokenizer, text, add_special_tokens=True)
    n_raw = len(ids)
    if n_raw <= max_length:
        return text, n_raw, n_raw
    split = max_length // 2
    out = tokenizer.decode(ids[:split] + ids[-split:], skip_special_tokens=True)
    return out, n_raw, len(encode(tokenizer, out, add_special_tokens=True))


def _template_overhead(tokenizer: Any, use_chat: bool) -> int:
    """Tokens the final prompt adds beyond what the truncation counts (chat template tokens;
    the BOS of ``tokenizer(text)`` is already inside the truncation count)."""
    return len(finalize_prompt(tokenizer, "", use_chat)) - len(encode(tokenizer, "", add_special_tokens=True))


def _check_chat_mode(mode: str) -> str:
    if mode not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"--chat-template must be one of {CHAT_TEMPLATE_MODES}, got {mode!r}")
    return mode


def _use_chat(mode: str, prompt_set: str, tokenizer: Any) -> bool:
    _check_chat_mode(mode)
    if mode == "off":
        return False
    if mode == "on":
        if not has_chat_template(tokenizer):
            raise ValueError("--chat-template on: the tokenizer has no chat template")
        return True
    return prompt_set in CHAT_PROMPT_SETS and has_chat_template(tokenizer)


def _selected_tasks(tasks: str | Sequence[str] | None, data_dir: Path) -> list[str]:
    """Named tasks (validated, duplicates dropped), else every task with a local file."""
    named = split_tasks(tasks)
    for t in named:
        _check_task(t)
    if named:
        return list(dict.fromkeys(named))
    found = available_tasks(data_dir)
    if not found:
        raise FileNotFoundError(
            f"no InfiniteBench task files (<task>.jsonl) in {data_dir}; name tasks with --tasks to load them from the hub"
        )
    return found


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
    """InfiniteBench samples (see :meth:`InfiniteBench.build_samples`).

    ``tasks``: names (or a comma list); default every task with a local file. ``num_samples``:
    per-task cap (the first records). ``max_new_tokens``: overrides the official budget. Every
    prompt is truncated officially so that prompt + generation budget <= ``min(context_length,
    window)``; ``options["max_length"]`` caps the truncation length further. ``options``:
    ``data_dir``, ``max_length``, ``prompt_set``, ``chat_template`` (auto/on/off), ``no_hub``,
    ``save_samples``.
    """
    opts = benchmark.resolve_options(options)
    limit = benchmark.total_limit(window, context_length)
    where = (f"context_length={context_length}" if context_length is not None and context_length < window
             else f"window={window}")
    cap = _check_cap(opts["max_length"])
    num_samples = check_positive_int(num_samples, "num_samples", minimum=0)
    data_dir = resolve_data_dir(opts["data_dir"])
    selected = _selected_tasks(tasks, data_dir)
    prompt_set = resolve_prompt_set(opts["prompt_set"])
    use_chat = _use_chat(opts["chat_template"] or "auto", prompt_set, tokenizer)
    hub = not opts["no_hub"]
    overhead = _template_overhead(tokenizer, use_chat)

    samples: list[Sample] = []
    for task in selected:
        max_new = int(max_new_tokens) if max_new_tokens else DATA_NAME_TO_MAX_NEW_TOKENS[task]
        budget = limit - max_new - overhead
        if budget < 2:
            raise ValueError(
                f"{task}: {where} leaves no room for a prompt (max_new_tokens={max_new}, "
                f"official budget {DATA_NAME_TO_MAX_NEW_TOKENS[task]}; chat template overhead={overhead}); "
                f"lower it with --max-new-tokens or leave the task out"
            )
        records = load_records(data_dir, task, hub=hub)
        if num_samples is not None:
            records = records[:num_samples]
        for rec in records:
            samples.append(
                _build_one(tokenizer, rec, task, prompt_set, max_new, use_chat, overhead, budget, cap, limit, where)
            )
    if opts["save_samples"]:
        from evals.sample_io import write_samples_jsonl

        write_samples_jsonl(samples, opts["save_samples"])
    return samples


def _references(label: Any) -> tuple[str, ...]:
    items = label if isinstance(label, list) else [label]
    flat: list[str] = []
    for item in items:
        if isinstance(item, list):
            flat.extend(str(x) for x in item)
        else:
            flat.append(str(item))
    return tuple(flat)


def _build_one(
    tokenizer: Any,
    rec: dict,
    task: str,
    prompt_set: str,
    max_new: int,
    use_chat: bool,
    overhead: int,
    budget: int,
    cap: int | None,
    limit: int,
    where: str,
) -> Sample:
    prompt = build_prompt(rec, task, prompt_set)

    def render(max_length: int) -> tuple[list[int], tuple[str, int, int]]:
        text, n_raw, n_after = truncate_middle(tokenizer, prompt, max_length)
        return finalize_prompt(tokenizer, text, use_chat), (text, n_raw, n_after)

    try:
        max_length, ids, (_, n_raw, n_after) = fit_prompt(render, min(budget, cap) if cap else budget, limit - max_new)
    except PromptFitError:
        raise ValueError(f"{rec['_where']}: cannot fit the prompt in {where} (max_new_tokens={max_new})") from None
    wrapper = len(ids) - n_after  # chat-template tokens around the content (0 for raw prompts)
    return Sample(
        benchmark=BENCHMARK,
        task=task,
        sample_id=str(rec["id"]),
        prompt_ids=tuple(ids),
        references=_references(rec["_label"]),
        max_new_tokens=max_new,
        num_input_tokens_raw=n_raw + wrapper,
        num_input_tokens=len(ids),
        meta={
            "label": rec["_label"],
            "options": list(rec["options"]),
            "prompt_set": prompt_set,
            "chat_template": use_chat,
            "template_overhead": overhead,
            "truncated": n_raw > max_length,
            "max_length": max_length,
            "num_content_tokens_raw": n_raw,
            "num_content_tokens": n_after,
            "source": rec["_where"],
        },
    )


# ---------------------------------------------------------------------------------------------
# Official scorers (src/compute_scores.py, get_score_one_*)
# ---------------------------------------------------------------------------------------------


def _first_int_match(prediction: str) -> str:
    """First run of ASCII digits (``re.split("[^0-9]", pred)``), "" when there is none."""
    for item in re.split("[^0-9]", prediction):
        if item != "":
            return item
    return ""


def _unwrap_one(label: Any) -> Any:
    return label[0] if isinstance(label, list) else label


def _to_int(value: Any, what: str) -> int:
    if _is_number(value):
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{what}: expected an integer, got {value!r}")
        return int(value)
    if isinstance(value, str) and _INT_TEXT.fullmatch(value):
        return int(value)
    raise ValueError(f"{what}: expected an integer, got {value!r}")


def _to_int_or_float(value: Any, what: str) -> int | float:
    """math_find label: an int stays int, a float float; a string becomes whichever it spells."""
    if _is_number(value):
        return value
    if isinstance(value, str):
        text = value.strip()
        if _INT_TEXT.fullmatch(text):
            return int(text)
        try:
            return float(text)
        except ValueError:
            pass
    raise ValueError(f"{what}: expected a number, got {value!r}")


def _math_calc_label(label: Any) -> list[int]:
    if isinstance(label, str):  # a whole list stored as one string, e.g. "[1, 4, 8]"
        label = [label]
    if not isinstance(label, list) or not label:
        raise ValueError(f"math_calc: answer must be a non-empty list of integers, got {label!r}")
    if isinstance(label[0], list):  # official: the original files store [[...]]
        label = label[0]
    if len(label) == 1 and isinstance(label[0], str) and not _INT_TEXT.fullmatch(label[0]):
        try:
            parsed = json.loads(label[0])
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, list):
            label = parsed
    values = [_to_int(v, "math_calc answer") for v in label]
    if not values:
        raise ValueError("math_calc: empty answer list")
    return values


def _choice_label(task: str, label: Any, options: Sequence[str] | None) -> list[str]:
    if isinstance(label, list) and len(label) == 2 and label[1] in ("A", "B", "C", "D"):
        return [str(label[0]), label[1]]
    if options:
        return get_answer({"answer": label, "options": list(options)}, task)
    raise ValueError(f"{task}: label must be [option text, letter] (official get_answer), got {label!r}; "
                     f"give the record's options to derive the letter")


def _canonical_label(task: str, label: Any, options: Sequence[str] | None = None) -> Any:
    """The label in the type the official ``get_score_one_<task>`` expects (see module doc)."""
    if task in ("passkey", "number_string"):
        value = _unwrap_one(label)
        return str(value) if _is_number(value) else value
    if task == "kv_retrieval":
        items = label if isinstance(label, list) else [label]
        return [str(x) for x in items]
    if task == "code_run":
        return _to_int(_unwrap_one(label), "code_run answer")
    if task == "math_find":
        return _to_int_or_float(_unwrap_one(label), "math_find answer")
    if task == "math_calc":
        return _math_calc_label(label)
    if task in CHOICE_TASKS:
        return _choice_label(task, label, options)
    if task == "longdialogue_qa_eng":
        return str(_unwrap_one(label))
    if task in ("longbook_qa_eng", "longbook_qa_chn", "longbook_sum_eng"):
        items = label if isinstance(label, list) else [label]
        return [str(x) for x in items]
    raise ValueError(f"unknown InfiniteBench task {task!r}")


def _score_kv_retrieval(pred: str, labels: list[str]) -> bool:
    for c in ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]:
        pred = pred.replace(c, " ")
    words = pred.split()
    return any(label in words for label in labels)


def _score_code_run(pred: str, label: int) -> bool:
    pred = pred.strip()
    for c in ["\n", ".", "`", "'", '"', ":"]:
        pred = pred.replace(c, " ")
    words = pred.split()
    if not words:
        return False
    try:
        return label == int(words[-1])
    except ValueError:
        return False


def _score_code_debug(pred: str, label: list[str]) -> bool:
    pred = pred.strip()
    fn_name, label_c = label[0], label[1]
    if pred[:2] in [f"{label_c}.", f"{label_c}:"]:
        return True
    ans_prefixes = ["answer is:", "is:", "answer:", "correct option is:"]
    for c in ["\n", "`", "'", '"', "-", "*", "Option", "option"]:
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    for prefix in ans_prefixes:
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:  # the prediction ends with the prefix
            return False
        rest = pred[idx + len(prefix) + 1 :]
        return any(rest.startswith(s) for s in (label_c, fn_name))
    return False


_FIRST_NUMBER = re.compile(r"\d+\.\d+|\d+")


def _score_math_find(pred: str, label: int | float) -> bool:
    found = _FIRST_NUMBER.search(pred)
    if found is None:
        return False
    text = found.group(0).strip()
    if isinstance(label, int):
        try:
            return int(text) == label
        except ValueError:  # official: int("3.5") raises; a decimal never equals an int label
            return False
    return float(text) == label


def _score_longdialogue(pred: str, label: str) -> bool:
    pred = pred.strip()
    for c in ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]:
        pred = pred.replace(c, " ")
    words = [w.upper() for w in pred.split()]
    return label in words


def _score_longbook_choice(pred: str, label: list[str]) -> bool:
    pred = pred.strip()
    if pred == "":
        return False
    if pred[0] in "ABCD":
        return pred[0] in label
    if pred in label:
        return True
    for c in ["\n", '"', "'", ".", ",", "?", "!", "{", "}"]:
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    for prefix in ["answer is:", "answer:", "answer is", "option is"]:
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return False
        after = pred[idx + len(prefix) + 1 :]
        return any(after.startswith(s) for s in label)
    for word in pred.split():  # finally: the first word that is (a substring of) "ABCD"
        if word in "ABCD":
            return word in label
    return False


def _f1(pred_tokens: Sequence[str], gold_tokens: Sequence[str]) -> float:
    common = Counter(pred_tokens) & Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _score_qa_eng(pred: str, labels: list[str]) -> float:
    """Token F1 after SQuAD normalisation, max over the references (official qa_f1_score)."""
    return max((_f1(normalize_answer(pred).split(), normalize_answer(g).split()) for g in labels), default=0.0)


def _score_qa_chn(pred: str, labels: list[str]) -> float:
    """Character F1 after Chinese normalisation (one character = one token), max over references."""
    return max((_f1(list(normalize_zh_answer(pred)), list(normalize_zh_answer(g))) for g in labels), default=0.0)


_ROUGE_LSUM = None


def _score_sum(pred: str, labels: list[str]) -> float:
    """``evaluate.load("rouge").compute(predictions=[pred], references=[labels],
    use_aggregator=False)["rougeLsum"][0]``: Google's rouge-score, no stemmer, sentences split on
    newlines, the best reference by F-measure."""
    global _ROUGE_LSUM
    if _ROUGE_LSUM is None:
        from rouge_score import rouge_scorer  # lazy: only En.Sum needs it

        _ROUGE_LSUM = rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)
    return float(_ROUGE_LSUM.score_multi(labels, pred)["rougeLsum"].fmeasure)


def _score_math_calc(pred: str, label: list[int], model_name: str | None) -> float:
    pred_nums = [int(item) for item in re.split("[^0-9]", pred) if item != ""]
    if model_name == "gpt4":  # official: GPT-4 repeats the first number of the expression
        pred_nums = pred_nums[1:]
    cnt = 0
    for i, value in enumerate(label):
        if i >= len(pred_nums) or value != pred_nums[i]:
            break
        cnt += 1
    return cnt / len(label)


def score_one(
    task: str,
    prediction: str | None,
    label: Any,
    *,
    options: Sequence[str] | None = None,
    model_name: str | None = None,
) -> float:
    """Official per-sample score of ``prediction`` for ``task``, in [0, 1].

    ``label`` is the official ground truth (``get_answer``) in any of the stored layouts (numbers
    as strings, one-element lists, ...). ``options`` lets a choice task derive ``[text, letter]``
    from a bare answer; ``model_name="gpt4"`` applies the official math_calc GPT-4 rule.
    """
    _check_task(task)
    pred = "" if prediction is None else prediction
    if not isinstance(pred, str):
        raise TypeError(f"prediction must be a string, got {type(pred).__name__}")
    gold = _canonical_label(task, label, options)
    if task in ("passkey", "number_string"):
        return float(gold == _first_int_match(pred))
    if task == "kv_retrieval":
        return float(_score_kv_retrieval(pred, gold))
    if task == "code_run":
        return float(_score_code_run(pred, gold))
    if task == "code_debug":
        return float(_score_code_debug(pred, gold))
    if task == "math_find":
        return float(_score_math_find(pred, gold))
    if task == "math_calc":
        return float(_score_math_calc(pred, gold, model_name))
    if task == "longdialogue_qa_eng":
        return float(_score_longdialogue(pred, gold))
    if task == "longbook_choice_eng":
        return float(_score_longbook_choice(pred, gold))
    if task == "longbook_qa_eng":
        return float(_score_qa_eng(pred, gold))
    if task == "longbook_qa_chn":
        return float(_score_qa_chn(pred, gold))
    return _score_sum(pred, gold)  # longbook_sum_eng


def score_sample(sample: Sample, prediction: str) -> float:
    """Official InfiniteBench score of one prediction for a built sample, in [0, 1]."""
    model_name = "gpt4" if sample.meta.get("prompt_set") == "gpt4" else None
    return score_one(
        sample.task, prediction, sample.meta["label"], options=sample.meta.get("options"), model_name=model_name
    )


_PRED_KEYS = ("prediction", "pred")
_LABEL_KEYS = ("ground_truth", "label")


#: ``--model_name`` choices of the official ``src/args.py`` (``compute_scores.py`` defaults to
#: ``gpt4``). Only ``gpt4`` changes a score: math_calc drops the first predicted number.
OFFICIAL_MODEL_NAMES = ("gpt4", "yarn-mistral", "kimi", "claude2", "rwkv", "yi-6b-200k", "yi-34b-200k", "chatglm3")


def _check_model_name(model_name: str | None) -> str | None:
    if model_name is None or model_name in OFFICIAL_MODEL_NAMES:
        return model_name
    close = difflib.get_close_matches(str(model_name), OFFICIAL_MODEL_NAMES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"unknown InfiniteBench model name {model_name!r}{hint} (official compute_scores.py --model_name choices: "
        f"{', '.join(OFFICIAL_MODEL_NAMES)}; only gpt4 changes a score, math_calc; omit it for any other model)"
    )


def score_prediction_records(task: str, records: Sequence[dict], *, model_name: str | None = None) -> dict:
    """Re-score records of an official prediction file (``{"id", "prediction", "ground_truth"}``
    per line; ``pred``/``label`` as written by eval_yarn_mistral.py also accepted).

    Returns ``{"task": task, "score": S, "n": N}`` with ``S`` the mean per-sample score, the
    number ``compute_scores.py`` prints (a fraction in [0, 1], unrounded). A record without a
    prediction or label key is an error (official: missing labels silently become "XXXXXXXXXX");
    a ``null`` prediction scores as the empty string.

    ``model_name`` is ``compute_scores.py --model_name`` (one of :data:`OFFICIAL_MODEL_NAMES`, or
    None): with ``"gpt4"`` math_calc drops the first predicted number (the official rule: its
    prompt makes GPT-4 repeat the expression's first number); no other name changes a score.
    Deviation: the official default is ``gpt4``; here None (no rule) unless named.
    Errors about one record raise :class:`evals.records.RecordError` (with its index).
    """
    _check_task(task)
    _check_model_name(model_name)
    records = list(records)
    if not records:
        raise ValueError(f"{task}: no prediction records to score")
    total = 0.0
    for i, rec in enumerate(records):
        where = task + (f" (id {rec.get('id')!r})" if isinstance(rec, dict) and "id" in rec else "")
        if not isinstance(rec, dict):
            raise RecordError(i, f"{where}: expected a JSON object, got {type(rec).__name__}")
        pred_key = next((k for k in _PRED_KEYS if k in rec), None)
        label_key = next((k for k in _LABEL_KEYS if k in rec), None)
        if pred_key is None or label_key is None:
            raise RecordError(i, f"{where}: needs one of {_PRED_KEYS} and one of {_LABEL_KEYS}, has {sorted(rec)}")
        try:
            total += score_one(task, rec[pred_key], rec[label_key], options=rec.get("options"), model_name=model_name)
        except (ValueError, TypeError) as e:
            raise RecordError(i, f"{where}: {e}") from e
    return {"task": task, "score": total / len(records), "n": len(records)}


# ---------------------------------------------------------------------------------------------
# The registry entry
# ---------------------------------------------------------------------------------------------


class InfiniteBench(BenchmarkBase):
    """InfiniteBench as a :class:`evals.registry.Benchmark`: natural data, truncated officially to
    each context length."""

    __slots__ = ()

    name = BENCHMARK
    tasks = TASKS
    generated = False
    default_context_length = None
    OPTIONS = (
        Option(
            "--data-dir", None,
            help=f"folder of <task>.jsonl files (official schema); unset = ${ENV_DATA_DIR} if set, "
            f"else {default_data_dir()}",
        ),
        Option(
            "--max-length", None, type=int,
            help="cap on the truncated prompt length in tokens (official: the model's length, e.g. 128K); "
            "the model window and the context length always apply",
        ),
        Option(
            "--prompt-set", DEFAULT_PROMPT_SET, choices=tuple(sorted(set(PROMPT_SETS) | set(PROMPT_SET_ALIASES))),
            help="official template set (src/prompt.py); yarn_mistral is the set of the official open-model runs",
        ),
        Option(
            "--chat-template", "auto", choices=CHAT_TEMPLATE_MODES,
            help="auto: raw prompt for yarn_mistral (official open-model runs), chat turn for gpt4/claude2/kimi",
        ),
        Option(
            "--no-hub", store_true=True,
            help=f"never try the hub ({HF_DATASET}) when a task has no local file: fail at once "
            "(offline, the hub client retries for ~25 s first; HF_HUB_OFFLINE=1 uses its cache only)",
        ),
        Option("--save-samples", None, help="also write the built samples to this JSONL file"),
    )

    @property
    def default_tasks(self) -> tuple[str, ...]:  # type: ignore[override]
        """Data-dependent: every task with a local file in the default data folder
        (``$SPARSESPEC_DATA_DIR`` or the shared data), in official order; ``()`` when there is
        none. With ``options["data_dir"]`` use :meth:`resolve_tasks`."""
        try:
            return tuple(available_tasks(resolve_data_dir(None)))
        except (FileNotFoundError, ValueError):
            return ()

    def resolve_tasks(self, tasks: Sequence[str] | None = None,
                      options: Mapping[str, Any] | None = None) -> tuple[str, ...]:
        """The tasks ``build_samples`` would run: ``tasks`` validated, else those with a local file."""
        opts = self.resolve_options(options)
        return tuple(_selected_tasks(tasks, resolve_data_dir(opts["data_dir"])))

    def check(self, *, tasks: Sequence[str] | None = None, options: Mapping[str, Any] | None = None) -> None:
        """Unknown option keys, task names, prompt sets or chat modes, a bad ``max_length``, no
        task file when none is named, a malformed local file (file:line), or a task without a
        local file when ``no_hub`` is set raise one-line errors. A task without a local file is
        not fetched here (a hub split is large): ``build_samples`` loads it."""
        opts = self.resolve_options(options)
        _check_cap(opts["max_length"])
        resolve_prompt_set(opts["prompt_set"])
        _check_chat_mode(opts["chat_template"] or "auto")
        data_dir = resolve_data_dir(opts["data_dir"])
        for task in _selected_tasks(tasks, data_dir):
            if task_file(data_dir, task) is not None or opts["no_hub"]:
                load_records(data_dir, task, hub=False)

    def build_samples(self, tokenizer: Any, *, window: int, context_length: int | None = None,
                      tasks: Sequence[str] | None = None, num_samples: int | None = None,
                      max_new_tokens: int | None = None, options: Mapping[str, Any] | None = None) -> list[Sample]:
        return build_samples(tokenizer, window=window, context_length=context_length, tasks=tasks,
                             num_samples=num_samples, max_new_tokens=max_new_tokens, options=options)

    def score_sample(self, sample: Sample, prediction: str) -> float:
        return score_sample(sample, prediction)

    def score_predictions(self, task: str, records: Sequence[dict], *, model_name: str | None = None) -> dict:
        """:func:`score_prediction_records`; ``model_name`` is the official ``--model_name``
        (``"gpt4"``: the math_calc rule)."""
        return score_prediction_records(task, records, model_name=model_name)


#: The registry entry (``evals.registry.get_benchmark("infinitebench")``).
benchmark = InfiniteBench()
