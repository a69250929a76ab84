"""evals.longbench on the real shared LongBench v1 records (CPU, SmolLM2 tokenizer)."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from evals import longbench as lb
from evals.base import Sample

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "longbench_v1"
SMOL_WINDOW = 8192  # SmolLM2-135M max_position_embeddings


@pytest.fixture(scope="session")
def smol_tokenizer():
    from sparsespec import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def all_samples(smol_tokenizer):
    args = types.SimpleNamespace(data_dir=str(DATA_DIR), tasks=None, num_samples=None, max_new_tokens=None, max_length=None)
    return lb.build_samples(smol_tokenizer, args, SMOL_WINDOW)


def _task_files():
    if not DATA_DIR.is_dir():
        return []
    return sorted(p.stem for p in DATA_DIR.glob("*.jsonl"))


def _ns(**kw):
    base = dict(data_dir=str(DATA_DIR), tasks=None, num_samples=None, max_new_tokens=None, max_length=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


# ------------------------------------------------------------------ official configuration


def test_official_max_new_tokens_per_task():
    # config/dataset2maxlen.json
    assert lb.DATASET2MAXLEN == {
        "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64,
        "hotpotqa": 32, "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512,
        "qmsum": 512, "multi_news": 512, "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
        "lsht": 64, "passage_count": 32, "passage_retrieval_en": 32, "passage_retrieval_zh": 32,
        "lcc": 64, "repobench-p": 64,
    }
    assert set(lb.DATASET2PROMPT) == set(lb.DATASET2MAXLEN)
    assert lb.NO_CHAT_TASKS == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}


def test_official_prompt_templates_exact_text():
    P = lb.DATASET2PROMPT
    assert P["hotpotqa"] == (
        "Answer the question based on the given passages. Only give me the answer and do not output any other words."
        "\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. "
        "Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    )
    assert P["hotpotqa"] == P["2wikimqa"] == P["musique"]
    # official typo kept on purpose
    assert P["narrativeqa"].count("asconcisely") == 2
    assert P["lcc"] == "Please complete the code given below. \n{context}Next line of code:\n"
    assert P["repobench-p"] == "Please complete the code given below. \n{context}{input}Next line of code:\n"
    assert P["trec"] == "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    assert P["gov_report"] == (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    )
    assert P["multi_news"].startswith("You are given several news passages. Write a one-page summary of all news. \n\nNews:\n")
    assert P["samsum"] == "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    assert P["passage_retrieval_zh"].endswith("答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是：")
    assert "\n\n Answer the question based on the above article" in P["qasper"]
    for template in P.values():
        assert "{context}" in template


# ------------------------------------------------------------------ loading real records


@pytest.mark.parametrize("task", _task_files() or ["<no data>"])
def test_every_shared_file_loads_and_builds_official_prompt(task):
    if task == "<no data>":
        pytest.skip(f"no shared data at {DATA_DIR}")
    records = lb.load_records(DATA_DIR, task)
    with (DATA_DIR / f"{task}.jsonl").open(encoding="utf-8") as f:
        n_lines = sum(1 for line in f if line.strip())
    assert len(records) == n_lines  # nothing dropped
    template = lb.DATASET2PROMPT[task]
    head, tail = template.split("{context}")
    for rec in records:
        for field in lb.REQUIRED_FIELDS:
            assert field in rec
        prompt = lb.build_prompt(rec, task)
        assert prompt == template.format(**rec)
        assert prompt.startswith(head.format(**rec))
        assert prompt.endswith(tail.format(**rec))
        assert rec["context"] in prompt
        if "{input}" in template:
            assert rec["input"] in prompt


def test_available_tasks_follow_the_files():
    assert lb.available_tasks(DATA_DIR) == [t for t in lb.DATASET2PROMPT if t in set(_task_files())]
    assert len(lb.available_tasks(DATA_DIR)) == 11


def test_data_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv(lb.ENV_DATA_DIR, raising=False)
    assert lb.resolve_data_dir(None) == lb.default_data_dir()
    assert lb.default_data_dir().resolve() == DATA_DIR.resolve()
    (tmp_path / "longbench_v1").mkdir()
    monkeypatch.setenv(lb.ENV_DATA_DIR, str(tmp_path))
    assert lb.resolve_data_dir(None) == tmp_path / "longbench_v1"
    monkeypatch.setenv(lb.ENV_DATA_DIR, str(tmp_path / "longbench_v1"))
    assert lb.resolve_data_dir(None) == tmp_path / "longbench_v1"
    assert lb.resolve_data_dir(str(DATA_DIR)) == DATA_DIR


# ------------------------------------------------------------------ malformed input


def _good_record(i: int) -> dict:
    return {
        "input": f"q{i}", "context": "ctx", "answers": ["a"], "length": 3, "dataset": "hotpotqa",
        "language": "en", "all_classes": None, "_id": f"id{i}",
    }


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "hotpotqa.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_malformed_json_names_file_and_line(tmp_path):
    _write(tmp_path, [json.dumps(_good_record(1)), '{"input": "broken"'])
    with pytest.raises(ValueError, match=r"hotpotqa\.jsonl:2: malformed JSON"):
        lb.load_records(tmp_path, "hotpotqa")


def test_missing_field_names_file_line_and_field(tmp_path):
    bad = _good_record(3)
    del bad["answers"]
    _write(tmp_path, [json.dumps(_good_record(1)), "", json.dumps(bad)])  # blank line 2 is skipped
    with pytest.raises(ValueError, match=r"hotpotqa\.jsonl:3: missing field\(s\) \['answers'\]"):
        lb.load_records(tmp_path, "hotpotqa")


def test_wrong_types_and_duplicates_are_errors(tmp_path):
    bad = _good_record(2)
    bad["answers"] = "a"
    _write(tmp_path, [json.dumps(_good_record(1)), json.dumps(bad)])
    with pytest.raises(ValueError, match=r"hotpotqa\.jsonl:2: .*answers"):
        lb.load_records(tmp_path, "hotpotqa")
    _write(tmp_path, [json.dumps(_good_record(1)), "[1, 2]"])
    with pytest.raises(ValueError, match=r"hotpotqa\.jsonl:2: expected a JSON object"):
        lb.load_records(tmp_path, "hotpotqa")
    _write(tmp_path, [json.dumps(_good_record(1)), json.dumps(_good_record(1))])
    with pytest.raises(ValueError, match=r"hotpotqa\.jsonl:2: duplicate _id"):
        lb.load_records(tmp_path, "hotpotqa")


def test_unknown_task_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="did you mean 'hotpotqa'"):
        lb.load_records(tmp_path, "hotpotq")
    with pytest.raises(FileNotFoundError):
        lb.load_records(tmp_path, "qasper")


# ------------------------------------------------------------------ truncation


def test_truncate_middle_keeps_first_and_last_halves(smol_tokenizer):
    text = " ".join(f"w{i}" for i in range(400))
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 101
    out, n_raw, n_after = lb.truncate_middle(smol_tokenizer, text, 101)  # odd: half = 50
    assert n_raw == len(ids)
    expected = smol_tokenizer.decode(ids[:50], skip_special_tokens=True) + smol_tokenizer.decode(
        ids[-50:], skip_special_tokens=True
    )
    assert out == expected
    assert out.startswith("w0 w1 w2") and out.endswith("w398 w399")
    assert "w200 " not in out
    assert n_after == len(smol_tokenizer(out, add_special_tokens=False)["input_ids"])
    assert n_after <= 101


def test_truncate_middle_short_text_untouched(smol_tokenizer):
    out, n_raw, n_after = lb.truncate_middle(smol_tokenizer, "short text", 100)
    assert out == "short text" and n_raw == n_after
    with pytest.raises(ValueError):
        lb.truncate_middle(smol_tokenizer, "short text", 1)


def test_samples_fit_the_window_and_keep_instructions(smol_tokenizer, all_samples):
    assert len(all_samples) == sum(len(lb.load_records(DATA_DIR, t)) for t in _task_files())
    truncated = 0
    for s in all_samples:
        assert isinstance(s, Sample) and s.benchmark == "longbench"
        assert s.num_input_tokens + s.max_new_tokens <= SMOL_WINDOW
        assert s.num_input_tokens_raw >= s.num_input_tokens
        template = lb.DATASET2PROMPT[s.task]
        head, tail = template.split("{context}")
        rec = next(r for r in lb.load_records(DATA_DIR, s.task) if r["_id"] == s.sample_id)
        text = smol_tokenizer.decode(list(s.prompt_ids))
        assert head.format(**rec).strip() in text  # the instruction before the context survives
        assert tail.format(**rec).strip()[-200:] in text  # ... and the question after it
        if s.meta["truncated"]:
            truncated += 1
            assert s.num_input_tokens_raw > s.num_input_tokens
            assert s.meta["num_content_tokens"] <= s.meta["max_length"]
    assert truncated >= 3  # hotpotqa, gov_report, samsum, lcc ... are longer than 8K tokens


def test_chat_template_only_outside_the_official_no_chat_tasks(smol_tokenizer, all_samples):
    for s in all_samples:
        text = smol_tokenizer.decode(list(s.prompt_ids))
        if s.task in lb.NO_CHAT_TASKS:
            assert not s.meta["chat_template"]
            assert "<|im_start|>" not in text
        else:
            assert s.meta["chat_template"]
            assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")


def test_per_task_max_new_tokens_and_override(smol_tokenizer, all_samples):
    for s in all_samples:
        assert s.max_new_tokens == lb.DATASET2MAXLEN[s.task]
    got = {s.task: s.max_new_tokens for s in all_samples}
    assert got["gov_report"] == 512 and got["hotpotqa"] == 32 and got["trec"] == 64 and got["samsum"] == 128
    samples = lb.build_samples(smol_tokenizer, _ns(tasks="hotpotqa,trec", max_new_tokens=7), SMOL_WINDOW)
    assert {s.max_new_tokens for s in samples} == {7}
    assert {s.task for s in samples} == {"hotpotqa", "trec"}


def test_max_length_cap_and_num_samples(smol_tokenizer):
    samples = lb.build_samples(smol_tokenizer, _ns(tasks=["qasper", "lcc"], num_samples=1, max_length=512), SMOL_WINDOW)
    assert [s.task for s in samples] == ["qasper", "lcc"]
    for s in samples:
        assert s.meta["truncated"] and s.meta["max_length"] == 512
        assert s.meta["num_content_tokens"] <= 512
        assert s.num_input_tokens <= 512 + s.meta["template_overhead"] + 2
        assert s.num_input_tokens_raw > 1000


def test_small_window_budget_is_respected(smol_tokenizer):
    # window 1024: gov_report needs 512 new tokens -> prompt <= 512 tokens, chat template included
    samples = lb.build_samples(smol_tokenizer, _ns(tasks="gov_report,triviaqa"), 1024)
    for s in samples:
        assert s.num_input_tokens + s.max_new_tokens <= 1024
        assert s.num_input_tokens + s.max_new_tokens >= 1024 - 4
    with pytest.raises(ValueError, match="leaves no room"):
        lb.build_samples(smol_tokenizer, _ns(tasks="gov_report"), 540)


def test_score_sample_uses_official_metric(all_samples):
    by_task = {s.task: s for s in all_samples}
    trec = by_task["trec"]
    assert lb.score_sample(trec, trec.references[0] + "\nQuestion: next") == 1.0
    assert lb.score_sample(trec, "") == 0.0
    hot = by_task["hotpotqa"]
    assert lb.score_sample(hot, hot.references[0]) == 1.0
    assert lb.score_sample(hot, "completely unrelated words") == 0.0
    lcc = by_task["lcc"]
    assert lb.score_sample(lcc, "\n" + lcc.references[0] + "\n") == 1.0
    for s in all_samples:
        assert 0.0 <= lb.score_sample(s, "some prediction") <= 1.0


def test_save_samples_roundtrip(smol_tokenizer, tmp_path):
    from evals.sample_io import read_samples_jsonl

    out = tmp_path / "lb.jsonl"
    samples = lb.build_samples(smol_tokenizer, _ns(tasks="trec", num_samples=1, save_samples=str(out)), SMOL_WINDOW)
    assert read_samples_jsonl(out) == samples


def test_main_wires_flags_into_cluster_jobs(monkeypatch, smol_tokenizer, tmp_path):
    import argparse

    captured = {}

    def common_parser(description):
        p = argparse.ArgumentParser(description=description)
        p.add_argument("--tasks")
        p.add_argument("--num-samples", type=int)
        p.add_argument("--max-new-tokens", type=int)
        return p

    def run(benchmark, args, build_samples, score_sample):
        captured["benchmark"] = benchmark
        captured["samples"] = build_samples(smol_tokenizer, args, SMOL_WINDOW)
        captured["score"] = score_sample
        return 0

    fake = types.ModuleType("cluster.jobs")
    fake.common_parser, fake.run = common_parser, run
    monkeypatch.setitem(sys.modules, "cluster.jobs", fake)
    rc = lb.main(["--tasks", "triviaqa", "--num-samples", "1", "--data-dir", str(DATA_DIR), "--max-length", "300"])
    assert rc == 0 and captured["benchmark"] == "longbench"
    (s,) = captured["samples"]
    assert s.task == "triviaqa" and s.meta["max_length"] == 300
    assert captured["score"] is lb.score_sample
