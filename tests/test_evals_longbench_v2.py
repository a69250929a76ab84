"""evals.longbench_v2: official prompt, truncation, answer extraction and accuracy breakdown, on the
real shared records (SmolLM2 tokenizer) and on tiny fixtures in both file layouts."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from evals.benchmarks import longbench_v2 as v2
from evals.base import Sample

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "longbench_v2"
SHARED_FILE = DATA_DIR / "longbench_v2.reconstructed.shortest20.jsonl"
SMOL_WINDOW = 8192

# THUDM/LongBench prompts/0shot.txt, verbatim (the file has no trailing newline).
OFFICIAL_0SHOT = (
    "Please read the following text and answer the question below.\n\n"
    "<text>\n$DOC$\n</text>\n\n"
    "What is the correct answer to this question: $Q$\n"
    "Choices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$\n\n"
    "Format your response as follows: \"The correct answer is (insert answer here)\"."
)


def _ns(**kw):
    base = dict(data_dir=str(DATA_DIR), tasks=None, num_samples=None, max_new_tokens=None, max_length=None)
    base.update(kw)
    return base


_SHARED = ("tasks", "num_samples", "max_new_tokens", "context_length")


def _build(tokenizer, ns, window):
    """``v2.benchmark.build_samples`` from a flat dict of shared arguments + options."""
    kw = dict(vars(ns) if isinstance(ns, types.SimpleNamespace) else ns)
    shared = {k: kw.pop(k) for k in _SHARED if k in kw}
    return v2.benchmark.build_samples(tokenizer, window=window, options=kw, **shared)


def _record(i: int, **kw) -> dict:
    rec = {
        "_id": f"id{i}", "domain": "Single-Document QA", "sub_domain": "Academic", "difficulty": "easy",
        "length": "short", "question": f" Question {i}? ", "choice_A": " alpha ", "choice_B": "beta",
        "choice_C": "gamma", "choice_D": "delta", "answer": "B", "context": f"\n Document {i}. \n",
    }
    rec.update(kw)
    return rec


@pytest.fixture(scope="session")
def smol_tokenizer():
    from sparsespec import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def shared_samples(smol_tokenizer):
    if not SHARED_FILE.is_file():
        pytest.skip(f"no shared data at {SHARED_FILE}")
    return _build(smol_tokenizer, _ns(), SMOL_WINDOW)


# ------------------------------------------------------------------ official configuration


def test_official_template_and_budget():
    assert v2.TEMPLATE_0SHOT == OFFICIAL_0SHOT
    assert len(v2.TEMPLATE_0SHOT) == 262
    assert v2.MAX_NEW_TOKENS == 128
    assert v2.TASKS == ("longbench_v2",)
    assert (v2.HUB_REPO, v2.HUB_SPLIT) == ("THUDM/LongBench-v2", "train")


def test_build_prompt_strips_fields_and_replaces_in_official_order():
    rec = _record(1)
    assert v2.build_prompt(rec) == (
        OFFICIAL_0SHOT.replace("$DOC$", "Document 1.").replace("$Q$", "Question 1?")
        .replace("$C_A$", "alpha").replace("$C_B$", "beta").replace("$C_C$", "gamma").replace("$C_D$", "delta")
    )
    # chained replaces: a placeholder inside the document is filled too (official behaviour)
    quirk = v2.build_prompt(_record(2, context="see $Q$ and $C_D$"))
    assert "<text>\nsee Question 2? and delta\n</text>" in quirk


# ------------------------------------------------------------------ loading


def test_shared_jsonl_loads_every_record():
    if not SHARED_FILE.is_file():
        pytest.skip(f"no shared data at {SHARED_FILE}")
    assert v2.find_data_file(DATA_DIR) == SHARED_FILE
    records = v2.load_records(DATA_DIR)
    assert len(records) == 20 == sum(1 for line in SHARED_FILE.open(encoding="utf-8") if line.strip())
    for rec in records:
        assert list(rec) == list(v2.REQUIRED_FIELDS)
        assert rec["answer"] in "ABCD" and rec["difficulty"] in ("easy", "hard") and rec["length"] == "short"


def test_official_json_array_and_jsonl_give_the_same_records(tmp_path):
    recs = [_record(1), _record(2, answer="D", difficulty="hard", length="long")]
    (tmp_path / "array").mkdir()
    (tmp_path / "array" / "data.json").write_text(json.dumps(recs, indent=2, ensure_ascii=False), encoding="utf-8")
    (tmp_path / "lines").mkdir()
    (tmp_path / "lines" / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    assert v2.load_records(tmp_path / "array") == recs
    assert v2.load_records(tmp_path / "lines") == recs
    assert v2.load_records(tmp_path / "array" / "data.json") == recs  # a file path works too


def test_data_json_wins_and_ambiguous_folders_are_errors(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps(_record(1)) + "\n", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text(json.dumps(_record(2)) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="several LongBench v2 files"):
        v2.load_records(tmp_path)
    (tmp_path / "data.json").write_text(json.dumps([_record(3)]), encoding="utf-8")
    assert [r["_id"] for r in v2.load_records(tmp_path)] == ["id3"]


def test_malformed_inputs_name_file_and_line(tmp_path):
    path = tmp_path / "data.json"
    bad = _record(2)
    del bad["choice_C"]
    # element 2 starts on line 4 of the array file
    path.write_text("[\n" + json.dumps(_record(1)) + ",\n\n" + json.dumps(bad) + "\n]\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"data\.json:4: missing field\(s\) \['choice_C'\]"):
        v2.load_records(tmp_path)
    path.write_text("[\n" + json.dumps(_record(1)) + ",\n{\"_id\": \n]", encoding="utf-8")
    with pytest.raises(ValueError, match=r"data\.json:4: malformed JSON"):
        v2.load_records(tmp_path)
    path.write_text(json.dumps([_record(1), _record(2)]) + "\ntrailing", encoding="utf-8")
    with pytest.raises(ValueError, match=r"data\.json:2: malformed JSON: extra data"):
        v2.load_records(tmp_path)
    path.unlink()
    jl = tmp_path / "x.jsonl"
    jl.write_text(json.dumps(_record(1)) + "\n" + json.dumps(_record(2, answer="E")) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"x\.jsonl:2: field 'answer' must be one of A, B, C, D"):
        v2.load_records(tmp_path)
    jl.write_text(json.dumps(_record(1)) + "\n" + json.dumps(_record(1)) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"x\.jsonl:2: duplicate _id 'id1'"):
        v2.load_records(tmp_path)
    jl.write_text(json.dumps(_record(1, length="huge")) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"x\.jsonl:1: field 'length'"):
        v2.load_records(tmp_path)
    jl.write_text(json.dumps(_record(1, question=None)) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"x\.jsonl:1: field 'question' must be a string"):
        v2.load_records(tmp_path)
    jl.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"x\.jsonl: no records"):
        v2.load_records(tmp_path)


def test_hub_fallback_and_clean_failure(monkeypatch, tmp_path):
    from evals import hub

    calls = []

    def fake(path, name=None, split=None):
        calls.append((path, name, split))
        return [_record(1), _record(2)]

    monkeypatch.setattr(hub, "LOADER", fake)
    assert [r["_id"] for r in v2.load_records(tmp_path)] == ["id1", "id2"]
    assert calls == [("THUDM/LongBench-v2", None, "train")]

    def offline(path, name=None, split=None):
        raise ConnectionError("Couldn't reach 'THUDM/LongBench-v2' on the Hub")

    monkeypatch.setattr(hub, "LOADER", offline)
    with pytest.raises(FileNotFoundError) as info:
        v2.load_records(tmp_path / "missing")
    msg = str(info.value)
    assert "no LongBench v2 file" in msg and str(tmp_path / "missing") in msg
    assert "hub dataset 'THUDM/LongBench-v2' (split 'train') could not be loaded: ConnectionError" in msg
    assert info.value.__cause__ is None


# ------------------------------------------------------------------ truncation


class CharTokenizer:
    """Character-level tokenizer with a BOS id (like Llama's) for exact truncation checks."""

    BOS = 1

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([self.BOS] if add_special_tokens else []) + [ord(c) + 10 for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<s>" if i == self.BOS else chr(i - 10) for i in ids if not (skip_special_tokens and i == self.BOS))


def test_truncation_is_the_official_query_llm_slice():
    tok = CharTokenizer()
    # "abcdefghij" + BOS = 11 ids
    assert v2.truncate_middle(tok, "abcdefghij", 11) == ("abcdefghij", 10, 10)
    # max_len 5: ids[:5//2] = [BOS, a]; ids[-5//2:] = ids[-3:] = [h, i, j] (floor(-2.5) = -3)
    assert v2.truncate_middle(tok, "abcdefghij", 5) == ("ahij", 10, 4)
    # max_len 6: [BOS, a, b] + [h, i, j]
    assert v2.truncate_middle(tok, "abcdefghij", 6) == ("abhij", 10, 5)


def test_shared_samples_fit_and_keep_question_and_choices(smol_tokenizer, shared_samples):
    records = {r["_id"]: r for r in v2.load_records(DATA_DIR)}
    assert len(shared_samples) == 20
    for s in shared_samples:
        assert isinstance(s, Sample) and s.benchmark == "longbench_v2" and s.task == "longbench_v2"
        rec = records[s.sample_id]
        assert s.references == (rec["answer"],)
        assert s.max_new_tokens == 128
        assert s.num_input_tokens + s.max_new_tokens <= SMOL_WINDOW
        assert s.meta["difficulty"] == rec["difficulty"] and s.meta["length"] == rec["length"]
        assert s.meta["domain"] == rec["domain"] and s.meta["sub_domain"] == rec["sub_domain"]
        assert s.meta["chat_template"]
        text = smol_tokenizer.decode(list(s.prompt_ids))
        assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
        assert "Please read the following text and answer the question below.\n\n<text>\n" in text
        assert f"(D) {rec['choice_D'].strip()}" in text
        assert text.rstrip().endswith('"The correct answer is (insert answer here)".<|im_end|>\n<|im_start|>assistant')
        # 8K-word contexts are longer than SmolLM2's window: all are middle-truncated
        assert s.meta["truncated"] and s.num_input_tokens_raw > s.num_input_tokens
        assert s.meta["num_content_tokens"] <= s.meta["max_length"]


def test_num_samples_max_length_and_task_flags(smol_tokenizer):
    if not SHARED_FILE.is_file():
        pytest.skip(f"no shared data at {SHARED_FILE}")
    samples = _build(smol_tokenizer, _ns(num_samples=2, max_length=600, max_new_tokens=5), SMOL_WINDOW)
    assert len(samples) == 2
    for s in samples:
        assert s.max_new_tokens == 5 and s.meta["max_length"] == 600
        assert s.meta["num_content_tokens"] <= 600
        assert s.num_input_tokens <= 600 + s.meta["template_overhead"] + 2
    assert len(_build(smol_tokenizer, _ns(num_samples=1, tasks="longbench_v2"), SMOL_WINDOW)) == 1
    with pytest.raises(ValueError, match="did you mean 'longbench_v2'"):
        _build(smol_tokenizer, _ns(tasks="longbench_v"), SMOL_WINDOW)
    with pytest.raises(ValueError, match="leaves no room"):
        _build(smol_tokenizer, _ns(num_samples=1), 150)


def test_fixture_record_prompt_is_untruncated(smol_tokenizer, tmp_path):
    (tmp_path / "data.json").write_text(json.dumps([_record(1)]), encoding="utf-8")
    (s,) = _build(smol_tokenizer, _ns(data_dir=str(tmp_path)), SMOL_WINDOW)
    assert not s.meta["truncated"]
    assert smol_tokenizer.decode(list(s.prompt_ids)) == smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": v2.build_prompt(_record(1))}], tokenize=False, add_generation_prompt=True
    )


# ------------------------------------------------------------------ answer extraction and scoring


@pytest.mark.parametrize(
    "response, letter",
    [
        ("The correct answer is (B)", "B"),
        ("**The correct answer is (C)**", "C"),  # '*' removed first
        ("The correct answer is D.", "D"),  # second pattern
        ("Reasoning...\nThe correct answer is (A). So A.", "A"),
        # the parenthesised pattern wins even when the bare one occurs earlier
        ("The correct answer is A, no wait: The correct answer is (B)", "B"),
        ("The correct answer is (E)", None),
        ("the correct answer is (A)", None),  # case-sensitive
        ("(A)", None),
        ("", None),
    ],
)
def test_extract_answer(response, letter):
    assert v2.extract_answer(response) == letter


def test_score_sample_one_or_zero(shared_samples):
    s = shared_samples[0]
    gold = s.references[0]
    wrong = next(c for c in "ABCD" if c != gold)
    assert v2.score_sample(s, f"  The correct answer is ({gold})  ") == 1.0
    assert v2.score_sample(s, f"The correct answer is ({wrong})") == 0.0
    assert v2.score_sample(s, "") == 0.0  # an empty generation counts as wrong


def test_accuracy_breakdown_as_result_py():
    items = [
        (1.0, "easy", "short"), (0.0, "hard", "short"), (1.0, "hard", "medium"),
        (1.0, "easy", "long"), (0.0, "hard", "long"), (0.0, "hard", "long"),
    ]
    # overall 3/6; easy 2/2; hard 1/4; short 1/2; medium 1/1; long 1/3 = 33.3 (one decimal)
    assert v2.accuracy_breakdown(items) == {
        "overall": 50.0, "easy": 100.0, "hard": 25.0, "short": 50.0, "medium": 100.0, "long": 33.3,
        "counts": {"overall": 6, "easy": 2, "hard": 4, "short": 2, "medium": 1, "long": 3},
    }
    only_short = v2.accuracy_breakdown([(1.0, "easy", "short")])
    assert only_short["medium"] is None and only_short["hard"] is None  # official: ZeroDivisionError
    with pytest.raises(ValueError):
        v2.accuracy_breakdown([])


def test_breakdown_from_samples(shared_samples):
    scores = [1.0 if i % 2 == 0 else 0.0 for i in range(len(shared_samples))]
    got = v2.breakdown_from_samples(shared_samples, scores)
    assert got["overall"] == 50.0 and got["counts"]["short"] == 20 and got["medium"] is None


def test_score_prediction_records_re_extracts_from_response():
    recs = [
        {"_id": "a", "answer": "A", "difficulty": "easy", "length": "short",
         "response": "The correct answer is (A)", "pred": "B", "judge": False},  # stored judge ignored
        {"_id": "b", "answer": "C", "difficulty": "hard", "length": "medium", "response": "The correct answer is C"},
        {"_id": "c", "answer": "D", "difficulty": "hard", "length": "long", "response": "I am not sure."},
    ]
    got = v2.score_prediction_records("longbench_v2", recs)
    assert got["task"] == "longbench_v2" and got["n"] == 3
    assert got["score"] == got["overall"] == 66.7
    assert (got["easy"], got["hard"], got["short"], got["medium"], got["long"]) == (100.0, 50.0, 100.0, 100.0, 0.0)
    from evals.records import RecordError

    with pytest.raises(RecordError) as info:
        v2.score_prediction_records("longbench_v2", [recs[0], {"answer": "A"}])
    assert info.value.index == 1 and "'response'" in str(info.value)
    with pytest.raises(ValueError, match="unknown LongBench v2 task"):
        v2.score_prediction_records("longbench", recs)


# ------------------------------------------------------------------ CLI wiring


def test_cli_options_reach_build_samples(smol_tokenizer, tmp_path):
    import argparse

    (tmp_path / "data.json").write_text(json.dumps([_record(1), _record(2)]), encoding="utf-8")
    parser = argparse.ArgumentParser()
    v2.benchmark.add_arguments(parser)
    opts = vars(parser.parse_args(["--data-dir", str(tmp_path), "--max-length", "300"]))
    assert set(opts) == set(v2.benchmark.option_defaults()) == {"data_dir", "max_length", "save_samples"}
    v2.benchmark.check(tasks=None, options=opts)
    (s,) = v2.benchmark.build_samples(smol_tokenizer, window=SMOL_WINDOW, num_samples=1, options=opts)
    assert s.sample_id == "id1" and s.meta["max_length"] == 300


def test_check_missing_data_is_one_line(monkeypatch, tmp_path):
    from evals import hub

    monkeypatch.setattr(hub, "LOADER", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("offline")))
    with pytest.raises(FileNotFoundError) as info:
        v2.benchmark.check(tasks=None, options={"data_dir": str(tmp_path)})
    assert str(info.value).startswith("no LongBench v2 file") and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="unknown LongBench v2 task 'nope'"):
        v2.benchmark.check(tasks=["nope"], options={"data_dir": str(tmp_path)})


def test_runs_as_a_script_help():
    import subprocess


    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "evals" / "longbench_v2.py"), "--help"], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--data-dir" in out.stdout and "--max-length" in out.stdout
