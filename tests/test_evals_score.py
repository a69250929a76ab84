"""python -m evals.score: re-scoring official prediction files, end to end."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from evals import score

ROOT = Path(__file__).resolve().parents[1]


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


LB_LINES = [
    # official LongBench pred.py lines: {"pred", "answers", "all_classes", "length"}
    {"pred": "Paris", "answers": ["Paris"], "all_classes": None, "length": 1200},
    {"pred": "The Eiffel Tower in Paris", "answers": ["Eiffel Tower", "Tower"], "all_classes": None, "length": 6000},
    {"pred": "", "answers": ["London"], "all_classes": None, "length": 12000},
]

V2_LINES = [
    {"_id": "a", "domain": "Single-Document QA", "sub_domain": "Legal", "difficulty": "easy", "length": "short",
     "question": "q", "choice_A": "a", "choice_B": "b", "choice_C": "c", "choice_D": "d", "answer": "B",
     "context": "ctx", "response": "The correct answer is (B)", "pred": "B", "judge": True},
    {"_id": "b", "domain": "Code Repository Understanding", "sub_domain": "x", "difficulty": "hard", "length": "long",
     "question": "q", "choice_A": "a", "choice_B": "b", "choice_C": "c", "choice_D": "d", "answer": "A",
     "context": "ctx", "response": "**The correct answer is C**", "pred": "C", "judge": False},
]


def test_cli_subprocess_longbench(tmp_path):
    path = _write_jsonl(tmp_path / "hotpotqa.jsonl", LB_LINES)
    out = subprocess.run(
        [sys.executable, "-m", "evals.score", "--benchmark", "longbench", "--task", "hotpotqa", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    # per sample: 1, max(F1 vs "Eiffel Tower" = 2/3, vs "Tower" = 0.4) = 2/3, 0 -> 100 * (5/3) / 3 = 55.56
    assert json.loads(out.stdout) == {"task": "hotpotqa", "score": 55.56, "n": 3}


def test_longbench_e_prints_buckets(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "hotpotqa.jsonl", LB_LINES)
    assert score.main(["--benchmark", "longbench", "--task", "hotpotqa_e", str(path)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == {"task": "hotpotqa_e", "score": 55.56, "n": 3,
                   "buckets": {"0-4k": 100.0, "4-8k": 66.67, "8k+": 0.0}}


def test_longbench_v2_breakdown_and_json_array(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "preds.jsonl", V2_LINES)
    assert score.main(["--benchmark", "longbench_v2", "--task", "longbench_v2", str(path)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["task"], got["score"], got["n"]) == ("longbench_v2", 50.0, 2)
    assert (got["easy"], got["hard"], got["short"], got["long"], got["medium"]) == (100.0, 0.0, 100.0, 0.0, None)
    arr = tmp_path / "preds.json"
    arr.write_text(json.dumps(V2_LINES, indent=1), encoding="utf-8")
    assert score.main(["--benchmark", "longbench_v2", "--task", "longbench_v2", str(arr)]) == 0
    assert json.loads(capsys.readouterr().out)["score"] == 50.0


def test_bad_json_names_file_and_line(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(LB_LINES[0]) + "\n\n{\"pred\": \n", encoding="utf-8")
    assert score.main(["--benchmark", "longbench", "--task", "hotpotqa", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:3: malformed JSON") and "Traceback" not in err


def test_missing_field_names_file_and_line(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(LB_LINES[0]) + "\n\n" + json.dumps({"pred": "x", "all_classes": None}) + "\n",
                    encoding="utf-8")
    assert score.main(["--benchmark", "longbench", "--task", "hotpotqa", str(path)]) == 2
    assert capsys.readouterr().err == f"error: {path}:3: missing field(s) ['answers']\n"
    v2 = _write_jsonl(tmp_path / "v2.jsonl", [V2_LINES[0], {k: v for k, v in V2_LINES[1].items() if k != "response"}])
    assert score.main(["--benchmark", "longbench_v2", "--task", "longbench_v2", str(v2)]) == 2
    assert capsys.readouterr().err == f"error: {v2}:2: missing field(s) ['response']\n"
    lst = _write_jsonl(tmp_path / "l.jsonl", [LB_LINES[0], [1, 2]])
    assert score.main(["--benchmark", "longbench", "--task", "hotpotqa", str(lst)]) == 2
    assert capsys.readouterr().err == f"error: {lst}:2: expected a JSON object, got list\n"


def test_other_errors_are_one_line(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "p.jsonl", LB_LINES)
    assert score.main(["--benchmark", "longbench", "--task", "hotpotq", str(path)]) == 2
    assert "did you mean 'hotpotqa'" in capsys.readouterr().err
    assert score.main(["--benchmark", "longbench", "--task", "hotpotqa", str(tmp_path / "none.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    assert score.main(["--benchmark", "longbench", "--task", "hotpotqa", str(empty)]) == 2
    assert "no prediction records" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: unknown benchmark
        score.main(["--benchmark", "nope", "--task", "x", str(path)])


class _FakeBench:
    """A registry entry whose score_predictions is scripted (dispatch goes through evals.registry)."""

    name = "ruler"

    def __init__(self, fn):
        self.fn = fn
        self.calls = []

    def score_predictions(self, task, records, *, model_name=None):
        self.calls.append((task, len(records), model_name))
        return self.fn(task, records)


def test_dispatch_is_through_the_registry(monkeypatch, tmp_path, capsys):
    from evals import registry
    from evals.records import RecordError

    def fn(task, records):
        if any("bad" in r for r in records):
            raise RecordError(next(i for i, r in enumerate(records) if "bad" in r), "bad record")
        return {"task": task, "score": 12.5, "n": len(records)}

    fake = _FakeBench(fn)
    monkeypatch.setitem(registry.BENCHMARKS, "ruler", fake)
    path = _write_jsonl(tmp_path / "p.jsonl", [{"pred": "x"}, {"pred": "y"}])
    assert score.main(["--benchmark", "ruler", "--task", "niah_single_1", str(path)]) == 0
    assert json.loads(capsys.readouterr().out) == {"task": "niah_single_1", "score": 12.5, "n": 2}
    assert score.main(["--benchmark", "ruler", "--task", "t", "--model-name", "gpt4", str(path)]) == 0
    capsys.readouterr()
    assert fake.calls == [("niah_single_1", 2, None), ("t", 2, "gpt4")]
    bad = _write_jsonl(tmp_path / "b.jsonl", [{"pred": "x"}, {"bad": 1}])
    assert score.main(["--benchmark", "ruler", "--task", "t", str(bad)]) == 2
    assert capsys.readouterr().err == f"error: {bad}:2: bad record\n"
    # an entry without score_predictions, and one whose scorer raises KeyError / returns junk
    monkeypatch.setitem(registry.BENCHMARKS, "ruler", object())
    assert score.main(["--benchmark", "ruler", "--task", "t", str(path)]) == 2
    assert "has no score_predictions" in capsys.readouterr().err
    monkeypatch.setitem(registry.BENCHMARKS, "ruler", _FakeBench(lambda task, records: records[0]["answer"]))
    assert score.main(["--benchmark", "ruler", "--task", "t", str(path)]) == 2
    assert "misses field 'answer'" in capsys.readouterr().err
    monkeypatch.setitem(registry.BENCHMARKS, "ruler", _FakeBench(lambda task, records: 3))
    assert score.main(["--benchmark", "ruler", "--task", "t", str(path)]) == 2
    assert "not a dict with task/score/n" in capsys.readouterr().err


IB_CALC = [{"id": 0, "prediction": "1 1 4 8", "ground_truth": [1, 4, 8]},
           {"id": 1, "prediction": "2 2 5", "ground_truth": [2, 5]}]


def test_infinitebench_model_name_is_the_gpt4_math_calc_rule(tmp_path, capsys):
    """compute_scores.py --model_name gpt4 drops the first predicted number of math_calc."""
    path = _write_jsonl(tmp_path / "preds_math_calc.jsonl", IB_CALC)
    base = ["--benchmark", "infinitebench", "--task", "math_calc"]
    assert score.main(base + [str(path)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["n"] == 2 and got["score"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert score.main(base + ["--model-name", "gpt4", str(path)]) == 0
    assert json.loads(capsys.readouterr().out) == {"task": "math_calc", "score": 1.0, "n": 2}
    assert score.main(base + ["--model-name", "gpt-4", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "did you mean 'gpt4'" in err and err.count("\n") == 1
    # the other benchmarks ignore it
    lb = _write_jsonl(tmp_path / "hotpotqa.jsonl", LB_LINES)
    assert score.main(["--benchmark", "longbench", "--task", "hotpotqa", "--model-name", "gpt4", str(lb)]) == 0
    assert json.loads(capsys.readouterr().out)["score"] == 55.56


def test_infinitebench_record_errors_name_file_and_line(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(IB_CALC[0]) + "\n\n" + json.dumps({"id": 7, "prediction": "1"}) + "\n",
                    encoding="utf-8")
    assert score.main(["--benchmark", "infinitebench", "--task", "math_calc", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:3: math_calc (id 7): needs one of") and err.count("\n") == 1


def test_new_evals_modules_stay_light():
    code = (
        "import sys\n"
        "import evals.longbench, evals.longbench_v2, evals.score, evals.hub, evals.records, evals.registry\n"
        "bad = [m for m in ('ray', 'sqlalchemy', 'streamlit', 'sparsespec', 'cluster', 'datasets', 'torch')"
        " if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"evals imported: {out.stdout.strip()}"


LB_SHARED = ROOT.parent / "shared" / "data" / "longbench_v1"
V2_SHARED = ROOT.parent / "shared" / "data" / "longbench_v2" / "longbench_v2.reconstructed.shortest20.jsonl"


def test_shared_longbench_records_gold_and_empty_predictions(tmp_path, capsys):
    """Prediction files built from the real shared records: the gold answer scores 100 on every
    task (rouge's 1e-8 rounds away), an empty prediction 0."""
    from evals.benchmarks import longbench as lb

    if not LB_SHARED.is_dir():
        pytest.skip(f"no shared data at {LB_SHARED}")
    tasks = lb.available_tasks(LB_SHARED)
    assert len(tasks) == 11
    for task in tasks:
        recs = lb.load_records(LB_SHARED, task)
        for pred_of, expected in ((lambda r: r["answers"][0], 100.0), (lambda r: "", 0.0)):
            lines = [{"pred": pred_of(r), "answers": r["answers"], "all_classes": r["all_classes"],
                      "length": r["length"]} for r in recs]
            path = _write_jsonl(tmp_path / f"{task}.jsonl", lines)
            assert score.main(["--benchmark", "longbench", "--task", task, str(path)]) == 0
            assert json.loads(capsys.readouterr().out) == {"task": task, "score": expected, "n": len(recs)}, task
    # the same qasper lines as a LongBench-E file: lengths 3141 and 3207 both fall in 0-4k
    recs = lb.load_records(LB_SHARED, "qasper")
    lines = [{"pred": r["answers"][0], "answers": r["answers"], "all_classes": None, "length": r["length"]} for r in recs]
    path = _write_jsonl(tmp_path / "qasper_e.jsonl", lines)
    assert score.main(["--benchmark", "longbench", "--task", "qasper_e", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["buckets"] == {"0-4k": 100.0, "4-8k": None, "8k+": None}


def test_shared_longbench_v2_records_as_official_prediction_lines(tmp_path, capsys):
    from evals.benchmarks import longbench_v2 as v2

    if not V2_SHARED.is_file():
        pytest.skip(f"no shared data at {V2_SHARED}")
    recs = v2.load_records(V2_SHARED)
    lines = []
    for i, r in enumerate(recs):
        letter = r["answer"] if i % 4 else "ABCD"[("ABCD".index(r["answer"]) + 1) % 4]  # every 4th wrong
        response = f"The correct answer is ({letter})"
        lines.append({**r, "context": r["context"][:1000], "response": response,
                      "pred": v2.extract_answer(response), "judge": letter == r["answer"]})
    path = _write_jsonl(tmp_path / "v2.jsonl", lines)
    assert score.main(["--benchmark", "longbench_v2", "--task", "longbench_v2", str(path)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["n"] == 20 and got["score"] == 75.0 and got["short"] == 75.0 and got["long"] is None
    easy = [ln["judge"] for ln in lines if ln["difficulty"] == "easy"]
    assert got["easy"] == round(100 * sum(easy) / len(easy), 1)


def test_records_reader_edge_cases(tmp_path):
    from evals.records import read_json_records

    p = tmp_path / "a.json"
    p.write_text("\ufeff [ ]\n", encoding="utf-8")
    assert read_json_records(p) == []
    p.write_text('[{"a": [1, 2]},\n {"b": {"c": "]"}}]', encoding="utf-8")
    assert read_json_records(p) == [(1, {"a": [1, 2]}), (2, {"b": {"c": "]"}})]
    p.write_text('[{"a": 1} {"b": 2}]', encoding="utf-8")
    with pytest.raises(ValueError, match=r"a\.json:1: malformed JSON: expected ',' or ']'"):
        read_json_records(p)
    p.write_text('[{"a": 1},', encoding="utf-8")
    with pytest.raises(ValueError, match=r"a\.json:1: malformed JSON: unterminated array"):
        read_json_records(p)
    p.write_bytes(b'{"a": "\xff"}\n')
    with pytest.raises(ValueError, match="not UTF-8"):
        read_json_records(p)
