"""Official per-sample metrics of LongBench v1 and RULER.

Ground truth: THUDM/LongBench ``LongBench/metrics.py`` + ``LongBench/eval.py`` (the
``dataset2metric`` registry and the ``scorer`` loop) and NVIDIA/RULER
``scripts/eval/synthetic/constants.py`` + ``scripts/eval/evaluate.py`` (``postprocess_pred``).

Scale (the one rule of this module): **every per-sample score is a float in [0, 1]**.
The official reports multiply the *task mean* by 100 (LongBench: ``round(100 * mean, 2)``;
RULER: ``round(100 * mean, 2)`` inside ``string_match_*``). Use :func:`official_task_score` to get
that number from a list of per-sample scores; do not multiply per-sample scores.

Official quirks that are reproduced on purpose (changing them would change the numbers):

* ``classification_score`` removes items from the list it is iterating over, so the class right
  after a removed one is never examined (see the function).
* ``code_sim_score`` skips lines that *contain* a backtick, ``#`` or ``//`` anywhere (not only
  lines that start with them), and scores ``fuzz.ratio`` (an integer percentage) / 100.
  fuzzywuzzy computes that ratio with python-Levenshtein when it is installed and with
  ``difflib.SequenceMatcher`` otherwise; the two differ (Levenshtein's ratio is 2*LCS/len-sum,
  difflib's counts the blocks of its greedy longest-block matching and treats characters that
  fill over 1 % of a 200+ character string as junk). The official requirements never pinned
  python-Levenshtein, so the reference numbers come from the difflib path. :func:`fuzz_ratio`
  re-implements fuzzywuzzy 0.18.0's ``fuzz.ratio`` on difflib, so our numbers do not change when
  python-Levenshtein happens to be installed.
* ``rouge_score`` uses the ``rouge`` package (1.0.1): case-sensitive, sentences split on ``.``,
  words counted as *unique* words (``exclusive=True``), F = 2PR/(P+R+1e-8); any exception
  (empty hypothesis, recursion depth) scores 0.
* For trec, triviaqa, samsum and lsht only the first line of the prediction is scored.

Deviation: the official code catches everything with a bare ``except:``; here ``except Exception``
(it does not swallow KeyboardInterrupt/SystemExit). Scores are identical.
"""
from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "normalize_answer",
    "normalize_zh_answer",
    "f1_score",
    "qa_f1_score",
    "qa_f1_zh_score",
    "rouge_score",
    "rouge_zh_score",
    "classification_score",
    "fuzz_ratio",
    "code_sim_score",
    "count_score",
    "retrieval_score",
    "retrieval_zh_score",
    "string_match_all",
    "string_match_part",
    "ruler_postprocess",
    "DATASET2METRIC",
    "FIRST_LINE_TASKS",
    "LONGBENCH_E_TASKS",
    "LONGBENCH_E_BUCKETS",
    "longbench_base_task",
    "longbench_score",
    "official_task_score",
    "longbench_e_bucket",
    "longbench_e_scores",
]

# --------------------------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------------------------

_EN_PUNCT = frozenset(string.punctuation)
_ZH_PUNCT = frozenset(
    string.punctuation
    + "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """SQuAD-style normalisation: lower, drop ASCII punctuation, drop articles, squeeze spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _EN_PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    """Chinese normalisation: lower, drop ASCII + CJK punctuation, remove all whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _ZH_PUNCT)
    return "".join(s.split())


# --------------------------------------------------------------------------------------------
# Token F1
# --------------------------------------------------------------------------------------------


def f1_score(prediction: Sequence[str], ground_truth: Sequence[str], **kwargs) -> float:
    """Bag-of-tokens F1 between two token lists (0 when nothing overlaps)."""
    overlap = Counter(prediction) & Counter(ground_truth)
    num_same = sum(overlap.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Token F1 after :func:`normalize_answer` and whitespace split."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _jieba_cut(text: str) -> list[str]:
    import jieba  # lazy: jieba builds its dictionary on first use

    return list(jieba.cut(text, cut_all=False))


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Token F1 over jieba words, each normalised with :func:`normalize_zh_answer`, empties dropped."""
    pred = [t for t in (normalize_zh_answer(w) for w in _jieba_cut(prediction)) if t]
    gold = [t for t in (normalize_zh_answer(w) for w in _jieba_cut(ground_truth)) if t]
    return f1_score(pred, gold)


# --------------------------------------------------------------------------------------------
# ROUGE-L (rouge==1.0.1, exactly as the official scorer calls it)
# --------------------------------------------------------------------------------------------


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F from ``Rouge().get_scores([pred], [gold], avg=True)``; 0.0 on any exception."""
    from rouge import Rouge  # lazy (~75 ms to import): only the summarisation tasks need it

    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # official: bare except (empty hypothesis, RecursionError, ...)
        return 0.0
    return float(scores["rouge-l"]["f"])


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L over jieba words joined by spaces."""
    return rouge_score(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))


# --------------------------------------------------------------------------------------------
# Classification (trec, lsht)
# --------------------------------------------------------------------------------------------


def classification_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """1/len(matches) if the gold class is among the class names found in the prediction.

    ``all_classes`` (keyword, required) is the task's label list. A class found in the prediction
    that is a strict substring of the gold label is discarded, *with the official iteration
    quirk*: removal happens on the list being iterated, so the element that slides into the
    removed slot is skipped (e.g. classes ``["per", "son", "person"]``, gold ``"person"``,
    prediction ``"person"`` -> ``"son"`` survives -> score 0.5).
    The official ``if em_match_list != 0`` guard is always true (a list is never 0), so its
    difflib fallback branch is dead code and is not reproduced.
    """
    all_classes = kwargs.get("all_classes")
    if all_classes is None:
        raise ValueError("classification_score needs all_classes=[...]")
    matched = [name for name in all_classes if name in prediction]
    for term in matched:  # iterating while removing: intentional (official behaviour)
        if term in ground_truth and term != ground_truth:
            matched.remove(term)
    if ground_truth in matched:
        return 1.0 / len(matched)
    return 0.0


# --------------------------------------------------------------------------------------------
# Code (lcc, repobench-p)
# --------------------------------------------------------------------------------------------


def fuzz_ratio(s1: str | None, s2: str | None) -> int:
    """fuzzywuzzy 0.18.0 ``fuzz.ratio`` on its pure-Python (difflib) path, as an int in [0, 100].

    Its decorators run in this order: either side ``None`` -> 0; equal strings -> 100 (so two
    empty strings give 100); either side empty -> 0. Otherwise
    ``int(round(100 * difflib.SequenceMatcher(None, s1, s2).ratio()))`` -- Python's ``round``
    rounds halves to even (12.5 -> 12). ``SequenceMatcher``'s default ``autojunk=True`` is kept.
    """
    if s1 is None or s2 is None:
        return 0
    if s1 == s2:
        return 100
    if len(s1) == 0 or len(s2) == 0:
        return 0
    if not (isinstance(s1, str) and isinstance(s2, str)):  # utils.make_type_consistent
        s1, s2 = str(s1), str(s2)
    return int(round(100 * difflib.SequenceMatcher(None, s1, s2).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """fuzz.ratio/100 between the gold line and the first predicted line that contains none of
    a backtick, ``#`` or ``//`` (after stripping leading newlines); "" when there is none."""
    first = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            first = line
            break
    return fuzz_ratio(first, ground_truth) / 100


# --------------------------------------------------------------------------------------------
# Synthetic (passage_count, passage_retrieval_en/zh)
# --------------------------------------------------------------------------------------------

_DIGITS = re.compile(r"\d+")


def _fraction_equal(prediction: str, target: str) -> float:
    numbers = _DIGITS.findall(prediction)
    if not numbers:
        return 0.0
    return float(sum(1 for n in numbers if n == str(target)) / len(numbers))


def count_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Fraction of the integers in the prediction that equal the gold count."""
    return _fraction_equal(prediction, ground_truth)


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Fraction of the integers in the prediction equal to N of the gold ``Paragraph N``."""
    return _fraction_equal(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Fraction of the integers in the prediction equal to N of the gold ``段落N``."""
    return _fraction_equal(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


# --------------------------------------------------------------------------------------------
# RULER
# --------------------------------------------------------------------------------------------

_NON_PRINTABLE = re.compile(r"[\x00-\x1f]")


def ruler_postprocess(prediction: str) -> str:
    """RULER ``postprocess_pred``: strip, control characters -> newline, strip."""
    return _NON_PRINTABLE.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Iterable[str]) -> float:
    """RULER niah/vt/cwe/fwe metric for ONE sample, in [0, 1]: the fraction of references that
    occur (case-insensitively) in the prediction. Official returns 100 x the mean over samples."""
    refs = list(references)
    if not refs:
        raise ValueError("string_match_all needs at least one reference")
    pred = prediction.lower()
    return sum(1.0 for r in refs if r.lower() in pred) / len(refs)


def string_match_part(prediction: str, references: Iterable[str]) -> float:
    """RULER qa metric for ONE sample, in [0, 1]: 1.0 if any reference occurs (case-insensitively)."""
    refs = list(references)
    if not refs:
        raise ValueError("string_match_part needs at least one reference")
    pred = prediction.lower()
    return max(1.0 if r.lower() in pred else 0.0 for r in refs)


# --------------------------------------------------------------------------------------------
# Registry and the official per-sample loop
# --------------------------------------------------------------------------------------------

Metric = Callable[..., float]

DATASET2METRIC: dict[str, Metric] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}

#: Tasks whose prediction is cut to its first line before scoring (official eval.py).
FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")


#: The 13 tasks of LongBench-E (official pred.py/eval.py ``--e``); ``<task>_e`` scores like ``<task>``.
LONGBENCH_E_TASKS = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec",
    "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)

#: LongBench-E length buckets (official ``scorer_e``) by the record's ``length`` field.
LONGBENCH_E_BUCKETS = ("0-4k", "4-8k", "8k+")


def longbench_base_task(task: str) -> str:
    """``hotpotqa_e`` -> ``hotpotqa`` for the 13 LongBench-E tasks; other names unchanged."""
    if task.endswith("_e") and task[:-2] in LONGBENCH_E_TASKS:
        return task[:-2]
    return task


_base_task = longbench_base_task


def longbench_score(
    task: str,
    prediction: str,
    answers: Iterable[str],
    all_classes: Sequence[str] | None = None,
) -> float:
    """Official LongBench per-sample score in [0, 1]: the task metric maxed over the answers,
    after the first-line cut for trec/triviaqa/samsum/lsht."""
    base = _base_task(task)
    if base not in DATASET2METRIC:
        raise ValueError(f"unknown LongBench task {task!r}; known: {sorted(DATASET2METRIC)}")
    metric = DATASET2METRIC[base]
    if base in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    score = 0.0
    for answer in answers:
        score = max(score, metric(prediction, answer, all_classes=all_classes))
    return float(score)


def official_task_score(scores: Iterable[float]) -> float:
    """Task score on the official 0-100 scale: ``round(100 * mean(scores), 2)``."""
    values = list(scores)
    if not values:
        raise ValueError("official_task_score of no scores")
    return round(100 * sum(values) / len(values), 2)


def longbench_e_bucket(length: int | float) -> str:
    """Official ``scorer_e`` bucket of a record: ``<4000`` -> 0-4k, ``<8000`` -> 4-8k, else 8k+."""
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"


def longbench_e_scores(scores: Iterable[float], lengths: Iterable[int | float]) -> dict[str, float | None]:
    """Official LongBench-E report of one task: ``round(100 * np.mean(bucket), 2)`` per bucket.

    The official code gives ``nan`` (numpy's mean of an empty list) for an empty bucket; here it
    is ``None`` (JSON ``null``). ``numpy.mean`` is used as in the official code (pairwise summation).
    """
    import numpy as np

    buckets: dict[str, list[float]] = {b: [] for b in LONGBENCH_E_BUCKETS}
    values, lens = list(scores), list(lengths)
    if len(values) != len(lens):
        raise ValueError(f"longbench_e_scores: {len(values)} scores but {len(lens)} lengths")
    for score, length in zip(values, lens):
        buckets[longbench_e_bucket(length)].append(score)
    out: dict[str, float | None] = {}
    for name, vals in buckets.items():
        # numpy's round of an np.float64, exactly as the official expression evaluates
        out[name] = float(round(100 * np.mean(vals), 2)) if vals else None
    return out
