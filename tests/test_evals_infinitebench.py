"""evals.infinitebench: official templates, loaders, truncation and the official per-task scorers.

Expected scorer values are worked out by hand from OpenBMB/InfiniteBench src/compute_scores.py.
"""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from evals.benchmarks import infinitebench as ib
from evals.base import Sample
from evals.records import RecordError

SHARED_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "infinitebench"
SHARED_PASSKEY = SHARED_DIR / "passkey_8192.depth5.jsonl"
SMOL_WINDOW = 8192  # SmolLM2-135M max_position_embeddings


@pytest.fixture(scope="session")
def smol_tokenizer():
    from sparsespec import load_tokenizer

    return load_tokenizer("smollm2-135m")


def _ns(**kw):
    base = dict(data_dir=str(SHARED_DIR), tasks=None, num_samples=None, max_new_tokens=None, max_length=None,
                prompt_set=None, chat_template=None, no_hub=True, save_samples=None)
    base.update(kw)
    return base


_SHARED = ("tasks", "num_samples", "max_new_tokens", "context_length")


def _build(tokenizer, ns, window):
    """``ib.benchmark.build_samples`` from a flat dict of shared arguments + options."""
    kw = dict(vars(ns) if isinstance(ns, types.SimpleNamespace) else ns)
    shared = {k: kw.pop(k) for k in _SHARED if k in kw}
    return ib.benchmark.build_samples(tokenizer, window=window, options=kw, **shared)


def _need_shared():
    if not SHARED_PASSKEY.is_file():
        pytest.skip(f"no shared data at {SHARED_PASSKEY}")


# ============================================================== official configuration


def test_official_max_new_tokens_per_task():
    # src/eval_utils.py DATA_NAME_TO_MAX_NEW_TOKENS
    assert ib.DATA_NAME_TO_MAX_NEW_TOKENS == {
        "passkey": 6, "number_string": 12, "kv_retrieval": 50, "longbook_sum_eng": 1200,
        "longbook_choice_eng": 40, "longbook_qa_eng": 40, "longbook_qa_chn": 40,
        "longdialogue_qa_eng": 40, "math_find": 3, "math_calc": 30000, "code_run": 5, "code_debug": 5,
    }
    assert set(ib.TASKS) == set(ib.DATA_NAME_TO_MAX_NEW_TOKENS) and len(ib.TASKS) == 12
    assert ib.DEFAULT_PROMPT_SET == "yarn_mistral"
    assert ib.resolve_prompt_set("yarn-mistral") == ib.resolve_prompt_set(None) == "yarn_mistral"
    with pytest.raises(ValueError, match="unknown InfiniteBench prompt set"):
        ib.resolve_prompt_set("gpt5")


# Official src/prompt.py, every template of every set.
_PASSKEY_THEM = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you about the important information there.\n\n"  # noqa: E501
_NUMBER = "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the important information there.\n\n"  # noqa: E501
_KV = "Extract the value corresponding to the specified key in the JSON object below.\n\n"
_CHOICE_API = (
    "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\n\nOnly one of the following options "
    "is correct, tell me the answer using one single letter (A, B, C, or D). Don't say anything else.\n"
    "A. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}"
)
_DIALOGUE_HEAD = (
    "Below is a dialogue script where one random occurrence of a character name is replaced with \"$$MASK$$\", "
    "and you should try to guess who that character is."
)
_DIALOGUE_API = (
    _DIALOGUE_HEAD + "\n\nThe dialogue:\n\n---\n\n{context}\n\n---\n\nEnd of dialogue.\n\nWhich character is most "
    "likely \"$$MASK$$\"? Just say the name used by the scriptwriter (before the colon marks) of one single "
    "character and nothing else."
)
_CODE_DEBUG_API_HEAD = (
    "There is ONLY ONE function in the large project that is deliberately made to include an obvious error. Please "
    "find the function that contains the most obvious errors. I will give you four options to narrow your scope. "
)
_CODE_DEBUG_API_TAIL = (
    " Eventually, tell me the answer using one single letter (A, B, C, or D).\n\n{context}\n\nWhich funtion has "
    "deliberate error?\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nYou should first find the "
    "functions in the options. Repeat their content, inspect through code, and at last give me your answer for the "
    "function that has the deliberate and obvious error in A, B, C, or D."
)
_MATH_CALC_API = (
    "Let us calculate the intermediate values of an expression.\nExpression: 1 + 3 + 4\nValues: [1, 4, 8]\n\n"
    "Expression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: {context}\nValues:"
)
_CODE_RUN_FILE = "In the file functions_module.py, there is a function called ${func}.\n\n\nHere is the content of functions_module.py:\n"  # noqa: E501

OFFICIAL = {
    "gpt4": {
        "passkey": _PASSKEY_THEM + "{context}\n\n{input}",
        "number_string": _NUMBER + "{context}\n\n{input}",
        "kv_retrieval": _KV + "{context}\n\n{input}",
        "longbook_qa_eng": "Read the book below and answer a question.\n\n{context}\n\nQuestion: {question}\n\nBe very concise.",
        "longbook_choice_eng": _CHOICE_API,
        "longbook_sum_eng": "Summarize the following book.\n\n{context}",
        "longbook_qa_chn": "请根据以下书籍回答我的问题。\n\n{context}\n\n问题：{question}\n请尽量简短地回答。",
        "math_find": "{prefix}\n\n{context}\n\n{input}",
        "math_calc": "Compute the intermediate values in the following long expression.\n\n{context}",
        "code_run": (
            "Following is a set of Python functions. There is a function called named {func}.\n\n{context}\n\nPlease "
            "give me the exact number of the return value of {func_call}. Be concise. Your response must end with "
            "the final returned value."
        ),
        "code_debug": _CODE_DEBUG_API_HEAD + "You can inspect the options and think." + _CODE_DEBUG_API_TAIL,
        "longdialogue_qa_eng": _DIALOGUE_API,
    },
    "yarn_mistral": {
        "passkey": (
            "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz "
            "you about the important information.\n\n{context}\n\n{input}\n\nThe pass key is"
        ),
        "number_string": _NUMBER + "{context}\n\n{input}\n\nThe sequence of digits is",
        "kv_retrieval": _KV + "{context}\n\n{input}",
        "longbook_sum_eng": "Summarize the book below.\n\n{context}\n\nSummary:",
        "longbook_choice_eng": (
            "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\nA. {OPTION_A}\n"
            "B. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe letter of the correct answer is"
        ),
        "longbook_qa_eng": (
            "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\n"
            "Question: {question}\nAnswer:"
        ),
        "longbook_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：",
        "math_find": "{prefix}\n\n{context}\n\n{input}",
        "math_calc": (
            "Let us calculate the intermediate values of an expression.\n\nExpression: 1 + 3 + 4\nValues: [1, 4, 8]"
            "\n\nExpression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: {context}\nValues:"
        ),
        "code_run": (
            "There is a function called {func} in the following Python code.\n\n{context}\n\nPlease compute the "
            "exact value of {func_call}. The value of {func_call} is"
        ),
        "code_debug": (
            "Following is a Python code where exactly one of the functions/methods has a deliberate error that "
            "makes it crash.\n\n{context}\n\nOptions:\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}"
            "\n\nThe correct option is:"
        ),
        "longdialogue_qa_eng": _DIALOGUE_HEAD + "\n\n{context}\n\nThe name that has been replaced with $$MASK$$ is likely",
    },
    "claude2": {
        "passkey": _PASSKEY_THEM + "{context}\n{input}\nThe pass key is",
        "number_string": _NUMBER + "{context}\n{input}\nThe sequence of digits is",
        "kv_retrieval": _NUMBER + "{context}\n{input}",
        "longbook_sum_eng": "Summarize the following book.\n\n{context}",
        "longbook_choice_eng": _CHOICE_API,
        "longbook_qa_eng": (
            "Read the novel below and answer a question:\n\n{context}\n\n{input}\nPlease answer as short as "
            "possible. The answer is: "
        ),
        "longbook_qa_chn": "请根据以下书籍回答我的问题。\n\n{context}\n\n问题：{question}\n请尽量简短地回答。",
        "math_find": "{prefix}\n\n{context}\n\n{input}",
        "math_calc": _MATH_CALC_API,
        "code_run": (
            _CODE_RUN_FILE + "{context}\n\nPlease give me the exact number of the return value of {func_call}. Your "
            "response should end with the sentence 'The return value is:'."
        ),
        "code_debug": _CODE_DEBUG_API_HEAD + "You can inspect through the options and think." + _CODE_DEBUG_API_TAIL,
        "longdialogue_qa_eng": _DIALOGUE_API,
    },
    "kimi": {
        "passkey": _PASSKEY_THEM + "{context}\n{input}\nThe pass key is",
        "number_string": _NUMBER + "{context}\n{input}\nThe sequence of digits is",
        "kv_retrieval": _KV + "{context}\n{input}",
        "longbook_sum_eng": "Summarize the book below:\n\n{file:{context}}",
        "longbook_choice_eng": (
            "Read the book and answer the question.\n\nQuestion: {question}\n\nOnly one of the following options is "
            "correct, tell me the answer using one single letter (A, B, C, or D). Don't say anything else.\n"
            "A. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}{file:{document}}"
        ),
        "longbook_qa_eng": "Read the book below and answer a question.\n\nQuestion: {question}\n\nBe very concise.{file:{context}}",
        "longbook_qa_chn": "阅读以下书籍然后回答问题。\n\n问题：{question}\n答案：{file:{context}}",
        "math_find": "{prefix}\n\n{context}\n\n{input}",
        "math_calc": _MATH_CALC_API,
        "code_run": (
            _CODE_RUN_FILE + "\nPlease give me the exact number of the return value of ${func_call}. Your response "
            "should end with the sentence 'The return value is:'.{context}"
        ),
        "code_debug": (
            "Below is a code repository where there is one single function with bugs that causes an error. Please "
            "tell me the name of that function.\nWhich function has bugs? Give me the final answer in this format: "
            "\"[FINAL ANSWER: XXX]\". Don't say anything else.{fcontext}"
        ),
        "longdialogue_qa_eng": (
            _DIALOGUE_HEAD + " Give me the answer using the name before the colons, don't say anything else.\n\n{context}"
        ),
    },
}


@pytest.mark.parametrize("prompt_set", sorted(OFFICIAL))
@pytest.mark.parametrize("task", ib.TASKS)
def test_every_template_is_the_official_string(prompt_set, task):
    assert ib.PROMPT_SETS[prompt_set][task] == OFFICIAL[prompt_set][task]


def test_prompt_sets_cover_all_tasks():
    assert set(ib.PROMPT_SETS) == {"gpt4", "yarn_mistral", "claude2", "kimi"}
    for templates in ib.PROMPT_SETS.values():
        assert set(templates) == set(ib.TASKS)


# ============================================================== fixtures in the official schema

CODE = "def func_1(x):\n    return x + 1\n\ndef func_2(x):\n    return func_1(x) * 2\n"

FIXTURES: dict[str, dict] = {
    "passkey": {"id": 0, "context": "Noise. The pass key is 12345. Remember it. 12345 is the pass key. Noise.",
                "input": "What is the pass key?", "answer": ["12345"], "options": []},
    "number_string": {"id": 0, "context": "Noise. The sequence of digits is 0012233445. Remember it.",
                      "input": "What is the sequence of digits?", "answer": ["0012233445"], "options": []},
    "kv_retrieval": {"id": 0, "context": 'JSON data:\n{"a1b2-c3": "d4e5-f6", "x9y8-z7": "w6v5-u4"}',
                     "input": 'Key: "a1b2-c3"\nThe value associated with the specified key is: ',
                     "answer": ["d4e5-f6"], "options": []},
    "longdialogue_qa_eng": {"id": 0, "context": "JOHN: Hello.\n$$MASK$$: Hi John.\nJOHN: Bye, Mary.",
                            "input": "", "answer": ["MARY"], "options": []},
    "longbook_sum_eng": {"id": 0, "context": "Chapter 1. A cat sat on a mat.", "input": "",
                         "answer": ["A cat sat on a mat."], "options": []},
    "longbook_choice_eng": {"id": 0, "context": "Bob met Alice.", "input": "Whom did Alice meet?",
                            "answer": ["Bob"], "options": ["Carol", "Bob", "Dave", "Eve"]},
    "longbook_qa_eng": {"id": 0, "context": "Bob Smith met Alice.", "input": "Whom did Alice meet?",
                        "answer": ["Bob Smith"], "options": []},
    "longbook_qa_chn": {"id": 0, "context": "小明有一只猫。", "input": "谁有一只猫？", "answer": ["小明"], "options": []},
    "math_find": {"id": 0, "context": "[3, 9, 1, 7]", "input": "The largest number of the list is: ",
                  "answer": ["9"], "options": []},
    "math_calc": {"id": 0, "context": "1 + 3 + 4", "input": "", "answer": ["1", "4", "8"], "options": []},
    "code_run": {"id": 0, "context": CODE, "input": "What is the return value of func_2(-3)?", "answer": ["-4"],
                 "options": []},
    "code_debug": {"id": 0, "context": CODE, "input": "", "answer": ["func_2"],
                   "options": ["func_1", "func_3", "func_2", "func_4"]},
}


def _write_task(folder: Path, task: str, records: list, name: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (name or f"{task}.jsonl")
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture()
def fixture_dir(tmp_path):
    for task, rec in FIXTURES.items():
        _write_task(tmp_path, task, [rec, {**rec, "id": 1}])
    return tmp_path


@pytest.mark.parametrize("task", ib.TASKS)
def test_loader_reads_official_fixture_of_every_task(fixture_dir, task):
    records = ib.load_records(fixture_dir, task, hub=False)
    assert [r["id"] for r in records] == [0, 1]
    for rec in records:
        for field in ib.REQUIRED_FIELDS:
            assert rec[field] == {**FIXTURES[task], "id": rec["id"]}[field]
        assert rec["_where"].endswith(f"{task}.jsonl:{rec['id'] + 1}")
        prompt = ib.build_prompt(rec, task)
        assert rec["context"] in prompt
    assert ib.available_tasks(fixture_dir) == list(ib.TASKS)


def test_get_answer_lists_choice_tasks_with_their_letter(fixture_dir):
    (choice,) = ib.load_records(fixture_dir, "longbook_choice_eng", hub=False)[:1]
    assert choice["_label"] == ["Bob", "B"]
    (debug,) = ib.load_records(fixture_dir, "code_debug", hub=False)[:1]
    assert debug["_label"] == ["func_2", "C"]
    # the three stored layouts of get_answer
    rec = {"answer": "Eve", "options": ["Carol", "Bob", "Dave", "Eve"]}
    assert ib.get_answer(rec, "longbook_choice_eng") == ["Eve", "D"]
    assert ib.get_answer({**rec, "answer": ["Eve"]}, "longbook_choice_eng") == ["Eve", "D"]
    assert ib.get_answer({**rec, "answer": ["Eve", "D"]}, "longbook_choice_eng") == ["Eve", "D"]
    assert ib.get_answer({"answer": ["12345"]}, "passkey") == ["12345"]


def test_rendered_prompts_follow_official_create_prompt(fixture_dir):
    rec = {t: ib.load_records(fixture_dir, t, hub=False)[0] for t in ib.TASKS}
    assert ib.build_prompt(rec["code_run"], "code_run") == (
        f"There is a function called func_2 in the following Python code.\n\n{CODE}\n\n"
        "Please compute the exact value of func_2(-3). The value of func_2(-3) is"
    )
    assert ib.build_prompt(rec["longbook_choice_eng"], "longbook_choice_eng") == (
        "Read the book and answer the question.\n\nBob met Alice.\n\nQuestion: Whom did Alice meet?\n"
        "A. Carol\nB. Bob\nC. Dave\nD. Eve\n\nThe letter of the correct answer is"
    )
    assert ib.build_prompt(rec["code_debug"], "code_debug").endswith(
        "Options:\nA. func_1\nB. func_3\nC. func_2\nD. func_4\n\nThe correct option is:"
    )
    assert ib.build_prompt(rec["math_find"], "math_find") == (
        "What is the largest number in the following list?\n\n[3, 9, 1, 7]\n\nThe largest number of the list is: "
    )
    assert ib.build_prompt(rec["passkey"], "passkey").endswith(
        "12345 is the pass key. Noise.\n\nWhat is the pass key?\n\nThe pass key is"
    )
    assert ib.build_prompt(rec["longbook_qa_chn"], "longbook_qa_chn") == (
        "阅读以下书籍然后回答问题。\n\n小明有一只猫。\n\n问题：谁有一只猫？\n答案："
    )
    assert ib.build_prompt(rec["math_calc"], "math_calc").endswith("Expression: 1 + 3 + 4\nValues:")
    # gpt4: math_calc is the bare expression (official create_prompt)
    assert ib.build_prompt(rec["math_calc"], "math_calc", "gpt4") == "1 + 3 + 4"
    assert ib.build_prompt(rec["code_run"], "code_run", "gpt4").startswith(
        "Following is a set of Python functions. There is a function called named func_2.\n\n"
    )
    # claude2 longbook_qa_eng names {input} (the official create_prompt cannot format it)
    assert ib.build_prompt(rec["longbook_qa_eng"], "longbook_qa_eng", "claude2") == (
        "Read the novel below and answer a question:\n\nBob Smith met Alice.\n\nWhom did Alice meet?\n"
        "Please answer as short as possible. The answer is: "
    )
    # kimi: the file-upload placeholder becomes the context inline
    assert ib.build_prompt(rec["longbook_sum_eng"], "longbook_sum_eng", "kimi") == (
        "Summarize the book below:\n\nChapter 1. A cat sat on a mat."
    )
    assert ib.build_prompt(rec["code_debug"], "code_debug", "kimi").endswith("Don't say anything else." + CODE)
    assert ib.build_prompt(rec["code_run"], "code_run", "kimi").endswith(
        "return value of $func_2(-3). Your response should end with the sentence 'The return value is:'." + CODE
    )


# ============================================================== the shared (legacy) passkey file


def test_shared_passkey_file_loads_in_legacy_layout():
    _need_shared()
    assert ib.task_file(SHARED_DIR, "passkey") == SHARED_PASSKEY
    assert ib.available_tasks(SHARED_DIR) == ["passkey"]
    records = ib.load_records(SHARED_DIR, "passkey", hub=False)
    with SHARED_PASSKEY.open(encoding="utf-8") as f:
        raw = [json.loads(line) for line in f if line.strip()]
    assert len(records) == len(raw) == 5  # nothing dropped
    assert [r["id"] for r in records] == [1, 2, 3, 4, 5]  # legacy: id = line number
    for rec, orig in zip(records, raw):
        assert rec["options"] == [] and rec["context"] == orig["context"] and rec["answer"] == orig["answer"]
        assert rec["_label"] == orig["answer"]
        assert f"The pass key is {orig['answer']}" in rec["context"]
        prompt = ib.build_prompt(rec, "passkey")
        assert prompt.endswith("\n\nWhat is the pass key?\n\nThe pass key is")
    assert records[0]["context"].startswith("The pass key is 69682.")  # depth 0


def test_legacy_layout_is_passkey_only(tmp_path):
    legacy = {"input": "What is the pass key?", "context": "The pass key is 1.", "answer": "1", "len": 3}
    _write_task(tmp_path, "number_string", [legacy])
    with pytest.raises(ValueError, match=r"number_string\.jsonl:1: missing field\(s\) \['id', 'options'\]"):
        ib.load_records(tmp_path, "number_string", hub=False)
    bad = dict(legacy)
    del bad["answer"]
    _write_task(tmp_path, "passkey", [legacy, bad])
    with pytest.raises(ValueError, match=r"passkey\.jsonl:2: missing field\(s\) \['id', 'answer', 'options'\]"):
        ib.load_records(tmp_path, "passkey", hub=False)


def test_data_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv(ib.ENV_DATA_DIR, raising=False)
    assert ib.resolve_data_dir(None) == ib.default_data_dir()
    assert ib.default_data_dir().resolve() == SHARED_DIR.resolve()
    (tmp_path / "infinitebench").mkdir()
    monkeypatch.setenv(ib.ENV_DATA_DIR, str(tmp_path))
    assert ib.resolve_data_dir(None) == tmp_path / "infinitebench"
    assert ib.resolve_data_dir(str(SHARED_DIR)) == SHARED_DIR


# ============================================================== malformed input and missing data


def test_malformed_json_names_file_and_line(tmp_path):
    _write_task(tmp_path, "passkey", [FIXTURES["passkey"], "", '{"id": 1, "context": "x"'])
    with pytest.raises(ValueError, match=r"passkey\.jsonl:3: malformed JSON"):
        ib.load_records(tmp_path, "passkey", hub=False)


@pytest.mark.parametrize(
    "task, change, message",
    [
        ("kv_retrieval", {"id": None}, r"field 'id' must be"),
        ("kv_retrieval", {"context": 5}, r"field 'context' must be a string"),
        ("kv_retrieval", {"answer": []}, r"field 'answer' must be"),
        ("kv_retrieval", {"answer": {"a": 1}}, r"field 'answer' must be"),
        ("kv_retrieval", {"options": "A"}, r"field 'options' must be a list"),
        ("longbook_choice_eng", {"answer": ["Zed"]}, r"answer 'Zed' is not among the first four options"),
        ("longbook_choice_eng", {"options": ["Bob", "Carol"]}, r"needs 4 options"),
        ("code_run", {"answer": ["four"]}, r"code_run answer: expected an integer"),
        ("code_run", {"input": "What is the value?"}, r"no function call func_N\(x\)"),
        ("math_find", {"answer": ["nine"]}, r"math_find answer: expected a number"),
        ("math_find", {"input": "Find the largest."}, r"cannot find the target number"),
        ("math_calc", {"answer": ["1", "x"]}, r"math_calc answer: expected an integer"),
    ],
)
def test_bad_records_name_file_line_and_problem(tmp_path, task, change, message):
    _write_task(tmp_path, task, [FIXTURES[task], {**FIXTURES[task], "id": 1, **change}])
    with pytest.raises(ValueError, match=rf"{task}\.jsonl:2: .*{message}"):
        ib.load_records(tmp_path, task, hub=False)


def test_missing_official_field_non_object_and_duplicates(tmp_path):
    rec = dict(FIXTURES["math_calc"])
    del rec["options"]
    _write_task(tmp_path, "math_calc", [FIXTURES["math_calc"], rec])
    with pytest.raises(ValueError, match=r"math_calc\.jsonl:2: missing field\(s\) \['options'\]"):
        ib.load_records(tmp_path, "math_calc", hub=False)
    _write_task(tmp_path, "math_calc", [FIXTURES["math_calc"], "[1, 2]"])
    with pytest.raises(ValueError, match=r"math_calc\.jsonl:2: expected a JSON object"):
        ib.load_records(tmp_path, "math_calc", hub=False)
    _write_task(tmp_path, "math_calc", [FIXTURES["math_calc"], FIXTURES["math_calc"]])
    with pytest.raises(ValueError, match=r"math_calc\.jsonl:2: duplicate id 0"):
        ib.load_records(tmp_path, "math_calc", hub=False)


def test_unknown_task_missing_file_and_ambiguous_variants(tmp_path):
    with pytest.raises(ValueError, match="did you mean 'passkey'"):
        ib.load_records(tmp_path, "passkeys", hub=False)
    with pytest.raises(FileNotFoundError, match=r"code_run\.jsonl.*hub disabled"):
        ib.load_records(tmp_path, "code_run", hub=False)
    _write_task(tmp_path, "passkey", [FIXTURES["passkey"]], name="passkey_8k.jsonl")
    _write_task(tmp_path, "passkey", [FIXTURES["passkey"]], name="passkey_16k.jsonl")
    with pytest.raises(ValueError, match="several InfiniteBench files for task 'passkey'"):
        ib.load_records(tmp_path, "passkey", hub=False)
    _write_task(tmp_path, "passkey", [FIXTURES["passkey"]])  # the exact name wins
    assert len(ib.load_records(tmp_path, "passkey", hub=False)) == 1
    with pytest.raises(FileNotFoundError, match="InfiniteBench data folder not found"):
        ib.available_tasks(tmp_path / "nowhere")


def test_hub_fallback_when_no_local_file(monkeypatch, tmp_path):
    calls = []

    def fake_hub(task, looked):
        calls.append(task)
        return [{**FIXTURES[task], "id": i} for i in range(3)]

    monkeypatch.setattr(ib, "_load_from_hub", fake_hub)
    records = ib.load_records(tmp_path, "code_debug")
    assert calls == ["code_debug"] and len(records) == 3
    assert records[2]["_where"] == f"hf://{ib.HF_DATASET}[code_debug]#2"
    assert records[0]["_label"] == ["func_2", "C"]

    def bad_hub(task, looked):
        return [{**FIXTURES[task], "answer": ["nope"]}]

    monkeypatch.setattr(ib, "_load_from_hub", bad_hub)
    with pytest.raises(ValueError, match=r"hf://xinrongzhang2022/InfiniteBench\[code_run\]#0: .*expected an integer"):
        ib.load_records(tmp_path, "code_run")


def test_unreachable_hub_gives_clear_error(monkeypatch, tmp_path, smol_tokenizer):
    from evals import hub

    def offline(repo, split, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(hub, "LOADER", offline)
    with pytest.raises(FileNotFoundError) as info:
        ib.load_records(tmp_path, "kv_retrieval")
    msg = str(info.value)
    assert str(tmp_path / "kv_retrieval.jsonl") in msg and ib.HF_DATASET in msg and "no network" in msg
    # build_samples with an explicit task and nothing local: the same error
    with pytest.raises(FileNotFoundError, match="kv_retrieval"):
        _build(smol_tokenizer, _ns(data_dir=str(tmp_path), tasks="kv_retrieval", no_hub=False), SMOL_WINDOW)
    with pytest.raises(FileNotFoundError, match="no InfiniteBench task files"):
        _build(smol_tokenizer, _ns(data_dir=str(tmp_path)), SMOL_WINDOW)


# ============================================================== golden scorer tests (hand-worked)


def test_passkey_and_number_string_first_integer():
    s = ib.score_one
    assert s("passkey", " 12345.", ["12345"]) == 1.0
    assert s("passkey", "The pass key is 12345", ["12345"]) == 1.0
    assert s("passkey", "1. 12345", ["12345"]) == 0.0  # the FIRST integer counts
    assert s("passkey", "12345", 12345) == 1.0  # answer stored as a number
    assert s("passkey", "12345", [12345]) == 1.0
    assert s("passkey", "12345", "12345") == 1.0  # bare string answer
    assert s("passkey", "", ["12345"]) == 0.0
    assert s("passkey", None, ["12345"]) == 0.0  # failed generation
    assert s("number_string", " 0012233445 is it", ["0012233445"]) == 1.0
    assert s("number_string", "12233445", ["0012233445"]) == 0.0  # compared as strings
    assert s("number_string", "00122 33445", ["0012233445"]) == 0.0


def test_kv_retrieval_whole_word():
    s = ib.score_one
    assert s("kv_retrieval", 'The value is "d4e5-f6".', ["d4e5-f6"]) == 1.0
    assert s("kv_retrieval", "d4e5-f6", "d4e5-f6") == 1.0  # bare string (original files)
    assert s("kv_retrieval", "{d4e5-f6}", ["d4e5-f6"]) == 1.0
    assert s("kv_retrieval", "d4e5-f6x", ["d4e5-f6"]) == 0.0  # substring is not enough
    assert s("kv_retrieval", "d4e5 f6", ["d4e5-f6"]) == 0.0
    assert s("kv_retrieval", "", ["d4e5-f6"]) == 0.0


def test_code_run_last_word_as_integer():
    s = ib.score_one
    assert s("code_run", " -4.", ["-4"]) == 1.0  # answer stored as a string, scorer needs an int
    assert s("code_run", "The value is 4\n", [4]) == 1.0
    assert s("code_run", "func_2(-3) = -4", -4) == 1.0
    assert s("code_run", "-4 is the value", ["-4"]) == 0.0  # last word must be the number
    assert s("code_run", "`-4`", ["-4"]) == 1.0
    assert s("code_run", "-4.5", ["-4"]) == 0.0  # "." -> " ": last word "5"
    assert s("code_run", "", ["-4"]) == 0.0


def test_code_debug_letter_or_function_name():
    s = ib.score_one
    label = ["func_2", "C"]
    assert s("code_debug", "C. func_2", label) == 1.0
    assert s("code_debug", "C: it crashes", label) == 1.0
    assert s("code_debug", "C", label) == 0.0  # a bare letter matches no official rule
    assert s("code_debug", "The correct option is: C", label) == 1.0  # "option" removed -> "is:" prefix
    assert s("code_debug", "The answer is: func_2", label) == 1.0
    assert s("code_debug", "The answer is: B", label) == 0.0
    assert s("code_debug", "The answer is:", label) == 0.0  # ends with the prefix
    assert s("code_debug", "", label) == 0.0
    # one-element answer list + options: the letter comes from the options (get_answer)
    opts = ["func_1", "func_3", "func_2", "func_4"]
    assert s("code_debug", "C.", ["func_2"], options=opts) == 1.0
    with pytest.raises(ValueError, match=r"\[option text, letter\]"):
        s("code_debug", "C.", ["func_2"])


def test_math_find_first_number_with_type_of_answer():
    s = ib.score_one
    assert s("math_find", "9", ["9"]) == 1.0  # "9" stored as a string -> int 9
    assert s("math_find", "The answer is 9, not 7", [9]) == 1.0
    assert s("math_find", "7 or 9", [9]) == 0.0
    assert s("math_find", "-7", [7]) == 1.0  # the official number pattern has no sign
    assert s("math_find", "3.5", ["3.5"]) == 1.0  # float answer stored as a string
    assert s("math_find", "3.50 exactly", [3.5]) == 1.0
    assert s("math_find", "3", ["3.5"]) == 0.0
    assert s("math_find", "9.0", [9]) == 0.0  # official int("9.0") raises; here: wrong
    assert s("math_find", "", [9]) == 0.0


def test_math_calc_prefix_accuracy():
    s = ib.score_one
    assert s("math_calc", "[1, 4, 8]", ["1", "4", "8"]) == 1.0
    assert s("math_calc", "1, 4, 9", [1, 4, 8]) == pytest.approx(2 / 3)
    assert s("math_calc", "4, 8", [1, 4, 8]) == 0.0  # stops at the first mismatch
    assert s("math_calc", "[1, 4, 8, 99]", [[1, 4, 8]]) == 1.0  # nested list of the original files
    assert s("math_calc", "1 4 8", "[1, 4, 8]") == 1.0  # whole list stored as one string
    assert s("math_calc", "[8, 5, 7, 3]", ["8", "5", "7", "3"]) == 1.0
    assert s("math_calc", "[8, -5]", [8, -5]) == 0.5  # official digits-only split drops signs
    assert s("math_calc", "", [1, 4, 8]) == 0.0
    assert s("math_calc", "1 1 4 8", [1, 4, 8], model_name="gpt4") == 1.0  # GPT-4 rule: drop the first
    assert s("math_calc", "1 1 4 8", [1, 4, 8]) == pytest.approx(1 / 3)


def test_longdialogue_name_in_upper_cased_words():
    s = ib.score_one
    assert s("longdialogue_qa_eng", "Mary", ["MARY"]) == 1.0
    assert s("longdialogue_qa_eng", "It is mary.", ["MARY"]) == 1.0
    assert s("longdialogue_qa_eng", "Maryanne", ["MARY"]) == 0.0
    assert s("longdialogue_qa_eng", "Mary", ["Mary"]) == 0.0  # official: the answer is not upper-cased
    assert s("longdialogue_qa_eng", "JOHN", ["MARY", "JOHN"]) == 0.0  # official: first answer only
    assert s("longdialogue_qa_eng", "MARY", "MARY") == 1.0  # bare string: the name, not its first letter
    assert s("longdialogue_qa_eng", "", ["MARY"]) == 0.0


def test_longbook_choice_letter_text_prefix_rules():
    s = ib.score_one
    label = ["Eve", "D"]
    assert s("longbook_choice_eng", "D", label) == 1.0
    assert s("longbook_choice_eng", " D) Eve", label) == 1.0
    assert s("longbook_choice_eng", "A. Carol", label) == 0.0
    assert s("longbook_choice_eng", "Eve", label) == 1.0  # the option text itself
    assert s("longbook_choice_eng", "The answer is D", label) == 1.0
    assert s("longbook_choice_eng", "The answer is: Eve.", label) == 1.0
    assert s("longbook_choice_eng", "I think the option is B.", label) == 0.0
    assert s("longbook_choice_eng", "the correct choice is D", label) == 1.0  # first word that is a letter
    assert s("longbook_choice_eng", "Bob", ["Bob", "B"]) == 1.0  # first character "B" is a letter
    assert s("longbook_choice_eng", "Bob", ["Bob", "C"]) == 0.0  # ... and decides alone
    assert s("longbook_choice_eng", "", label) == 0.0
    opts = ["Carol", "Bob", "Dave", "Eve"]
    assert s("longbook_choice_eng", "D", "Eve", options=opts) == 1.0  # bare answer + options


def test_longbook_qa_eng_token_f1_best_reference():
    s = ib.score_one
    refs = ["Bob Smith", "Robert"]
    assert s("longbook_qa_eng", "Bob", refs) == pytest.approx(2 / 3)  # P=1, R=1/2
    assert s("longbook_qa_eng", "The Robert.", refs) == 1.0  # articles and punctuation removed
    assert s("longbook_qa_eng", "Smith, Bob and Alice", refs) == pytest.approx(2 / 3)  # P=1/2, R=1
    assert s("longbook_qa_eng", "bob smith", "Bob Smith") == 1.0  # bare string answer
    assert s("longbook_qa_eng", "", refs) == 0.0
    assert s("longbook_qa_eng", "the", refs) == 0.0  # normalises to nothing


def test_longbook_qa_chn_character_f1():
    s = ib.score_one
    assert s("longbook_qa_chn", "小明", ["小明的猫"]) == pytest.approx(2 / 3)  # P=1, R=1/2
    assert s("longbook_qa_chn", "小明。", ["小明的猫"]) == pytest.approx(2 / 3)  # CJK punctuation removed
    assert s("longbook_qa_chn", "北京市", ["北京", "北京市"]) == 1.0
    assert s("longbook_qa_chn", "北京市", ["北京"]) == pytest.approx(0.8)  # P=2/3, R=1
    assert s("longbook_qa_chn", "上海", ["北京"]) == 0.0
    assert s("longbook_qa_chn", "", ["北京"]) == 0.0


def test_longbook_sum_rouge_lsum():
    s = ib.score_one
    # one sentence each: LCS (the cat on the mat) = 5 of 6 tokens both ways
    assert s("longbook_sum_eng", "the cat lay on the mat", ["The cat sat on the mat."]) == pytest.approx(5 / 6)
    # summary level: each reference line is matched against the whole prediction (rougeL would be 0.5)
    assert s("longbook_sum_eng", "c d a b", ["a b\nc d"]) == 1.0
    assert s("longbook_sum_eng", "the cat sat on the mat", ["x y z", "the cat sat on the mat"]) == 1.0
    assert s("longbook_sum_eng", "The cat sat on the mat.", "the cat sat on the mat") == 1.0
    assert s("longbook_sum_eng", "", ["the cat sat"]) == 0.0


def test_every_score_is_in_unit_interval():
    preds = ["", "A", "B. func_2", "12345", "[1, 4, 8]", "Bob Smith", "小明", "MARY", "d4e5-f6 -4 9"]
    for task, rec in FIXTURES.items():
        label = ib.get_answer(rec, task)
        for p in preds:
            assert 0.0 <= ib.score_one(task, p, label, options=rec["options"]) <= 1.0
    with pytest.raises(ValueError, match="unknown InfiniteBench task"):
        ib.score_one("passkeys", "1", ["1"])


# ============================================================== official prediction files


def test_score_prediction_records_official_format():
    records = [
        {"id": 0, "prediction": " 109.", "ground_truth": [4]},
        {"id": 1, "prediction": " 1.", "ground_truth": [1]},
        {"id": 2, "prediction": " -14.", "ground_truth": ["-14"]},
        {"id": 3, "prediction": None, "ground_truth": [5]},
    ]
    assert ib.score_prediction_records("code_run", records) == {"task": "code_run", "score": 0.5, "n": 4}
    # eval_yarn_mistral.py writes pred/label
    got = ib.score_prediction_records("passkey", [{"id": 0, "pred": "12345", "label": "12345"},
                                                  {"id": 1, "pred": "1", "label": ["12345"]}])
    assert got == {"task": "passkey", "score": 0.5, "n": 2}
    # choice labels as get_answer writes them, or derived from the record's options
    got = ib.score_prediction_records("longbook_choice_eng", [
        {"id": 0, "prediction": "B", "ground_truth": ["Bob", "B"]},
        {"id": 1, "prediction": "B", "ground_truth": ["Bob"], "options": ["Carol", "Bob", "Dave", "Eve"]},
        {"id": 2, "prediction": "C", "ground_truth": ["Bob", "B"]},
    ])
    assert got["score"] == pytest.approx(2 / 3) and got["n"] == 3
    got = ib.score_prediction_records("math_calc", [{"id": 0, "prediction": "1 1 4 8", "ground_truth": [1, 4, 8]}],
                                      model_name="gpt4")
    assert got["score"] == 1.0


def test_score_prediction_records_errors():
    with pytest.raises(ValueError, match="no prediction records"):
        ib.score_prediction_records("passkey", [])
    with pytest.raises(RecordError, match=r"record 1: passkey \(id 7\): needs one of") as info:
        ib.score_prediction_records("passkey", [{"prediction": "1", "ground_truth": "1"}, {"id": 7, "prediction": "1"}])
    assert info.value.index == 1  # evals.score turns it into FILE:LINE
    with pytest.raises(RecordError, match=r"record 0: code_run: .*expected an integer"):
        ib.score_prediction_records("code_run", [{"prediction": "1", "ground_truth": ["one"]}])
    with pytest.raises(ValueError, match="unknown InfiniteBench task"):
        ib.score_prediction_records("passkeys", [{"prediction": "1", "ground_truth": "1"}])


# ============================================================== truncation and samples (real tokenizer)


def test_truncate_middle_official_split(smol_tokenizer):
    text = " ".join(f"w{i}" for i in range(400))
    ids = smol_tokenizer(text)["input_ids"]  # tok.encode: special tokens included
    assert len(ids) > 101
    out, n_raw, n_after = ib.truncate_middle(smol_tokenizer, text, 101)  # odd: split = 50
    assert n_raw == len(ids)
    assert out == smol_tokenizer.decode(ids[:50] + ids[-50:], skip_special_tokens=True)  # one decode
    assert out.startswith("w0 w1 w2") and out.endswith("w398 w399") and "w200 " not in out
    assert n_after == len(smol_tokenizer(out)["input_ids"]) and n_after <= 101
    short, n1, n2 = ib.truncate_middle(smol_tokenizer, "short text", 100)
    assert short == "short text" and n1 == n2
    with pytest.raises(ValueError):
        ib.truncate_middle(smol_tokenizer, "short text", 1)


def test_shared_passkey_samples_truncated_to_the_window(smol_tokenizer):
    _need_shared()
    samples = _build(smol_tokenizer, _ns(), SMOL_WINDOW)
    assert [s.task for s in samples] == ["passkey"] * 5
    assert [s.sample_id for s in samples] == ["1", "2", "3", "4", "5"]
    for s in samples:
        assert isinstance(s, Sample) and s.benchmark == "infinitebench"
        assert s.max_new_tokens == 6
        assert s.num_input_tokens + s.max_new_tokens <= SMOL_WINDOW
        assert s.num_input_tokens + s.max_new_tokens >= SMOL_WINDOW - 4
        assert s.num_input_tokens_raw > s.num_input_tokens == len(s.prompt_ids)  # ~8.2K tokens raw
        assert s.meta["truncated"] and s.meta["prompt_set"] == "yarn_mistral" and not s.meta["chat_template"]
        assert s.meta["num_content_tokens"] <= s.meta["max_length"]
        text = smol_tokenizer.decode(list(s.prompt_ids))
        assert text.startswith("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it.")
        assert text.endswith("\n\nWhat is the pass key?\n\nThe pass key is")
        assert "<|im_start|>" not in text  # official open-model runs: raw prompt
        assert s.references == (s.meta["label"],)
    first, last = samples[0], samples[-1]  # key at depth 0 and 100 %: kept by middle truncation
    assert f"The pass key is {first.meta['label']}." in smol_tokenizer.decode(list(first.prompt_ids))
    assert f"The pass key is {last.meta['label']}." in smol_tokenizer.decode(list(last.prompt_ids))
    assert ib.score_sample(first, f" {first.meta['label']}.") == 1.0
    assert ib.score_sample(first, " 00000") == 0.0


def test_max_length_cap_and_num_samples(smol_tokenizer):
    _need_shared()
    samples = _build(smol_tokenizer, _ns(num_samples=2, max_length=1024), SMOL_WINDOW)
    assert len(samples) == 2
    for s in samples:
        assert s.meta["max_length"] == 1024 and s.meta["truncated"]
        assert s.num_input_tokens <= 1024 and s.meta["num_content_tokens"] <= 1024
        assert s.num_input_tokens_raw > 8000
        assert s.num_input_tokens_raw == s.meta["num_content_tokens_raw"]  # raw prompt: no wrapper


def test_fixture_samples_every_task_budgets_and_chat(smol_tokenizer, fixture_dir):
    tasks = [t for t in ib.TASKS if t != "math_calc"]
    samples = _build(smol_tokenizer, _ns(data_dir=str(fixture_dir), tasks=tasks), SMOL_WINDOW)
    assert [s.task for s in samples] == [t for t in tasks for _ in range(2)]
    for s in samples:
        assert s.max_new_tokens == ib.DATA_NAME_TO_MAX_NEW_TOKENS[s.task]
        assert not s.meta["truncated"] and s.num_input_tokens_raw == s.num_input_tokens
        rec = {**FIXTURES[s.task], "id": int(s.sample_id)}
        assert smol_tokenizer.decode(list(s.prompt_ids)) == ib.build_prompt(rec, s.task)
        assert s.meta["label"] == ib.get_answer(rec, s.task)
    by_task = {s.task: s for s in samples}
    assert by_task["code_debug"].references == ("func_2", "C")
    assert ib.score_sample(by_task["code_run"], " -4.") == 1.0
    assert ib.score_sample(by_task["math_find"], "9") == 1.0
    # official 30000 new tokens for math_calc do not fit an 8K window: clear error, override works
    with pytest.raises(ValueError, match=r"math_calc: window=8192 leaves no room.*--max-new-tokens"):
        _build(smol_tokenizer, _ns(data_dir=str(fixture_dir), tasks="math_calc"), SMOL_WINDOW)
    (calc, _) = _build(smol_tokenizer, _ns(data_dir=str(fixture_dir), tasks="math_calc", max_new_tokens=64),
                                 SMOL_WINDOW)
    assert calc.max_new_tokens == 64
    # API prompt sets are chat turns under --chat-template auto; gpt4 math_calc scores with the GPT-4 rule
    (gpt, _) = _build(smol_tokenizer, _ns(data_dir=str(fixture_dir), tasks="math_calc", max_new_tokens=64,
                                                    prompt_set="gpt4"), SMOL_WINDOW)
    text = smol_tokenizer.decode(list(gpt.prompt_ids))
    assert gpt.meta["chat_template"] and text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\n1 + 3 + 4<|im_end|>" in text
    assert gpt.num_input_tokens_raw == gpt.num_input_tokens > gpt.meta["num_content_tokens"]
    assert ib.score_sample(gpt, "1 1 4 8") == 1.0 and ib.score_sample(calc, "1 1 4 8") == pytest.approx(1 / 3)
    (off, _) = _build(smol_tokenizer, _ns(data_dir=str(fixture_dir), tasks="passkey", prompt_set="gpt4",
                                                    chat_template="off"), SMOL_WINDOW)
    assert not off.meta["chat_template"]


def test_small_window_truncates_with_chat_template(smol_tokenizer, tmp_path):
    rec = {**FIXTURES["longbook_qa_eng"], "context": " ".join(f"w{i}" for i in range(3000))}
    _write_task(tmp_path, "longbook_qa_eng", [rec])
    (s,) = _build(smol_tokenizer, _ns(data_dir=str(tmp_path), tasks="longbook_qa_eng",
                                                chat_template="on"), 1024)
    assert s.meta["chat_template"] and s.meta["truncated"]
    assert s.num_input_tokens + s.max_new_tokens <= 1024 and s.num_input_tokens + s.max_new_tokens >= 1024 - 4
    assert s.num_input_tokens_raw > 6000
    assert s.num_input_tokens_raw - s.meta["num_content_tokens_raw"] == s.num_input_tokens - s.meta["num_content_tokens"]
    text = smol_tokenizer.decode(list(s.prompt_ids))
    assert "Read the book and answer the question. Be very concise in your answer.\n\nw0 w1" in text
    assert "w2999\n\nQuestion: Whom did Alice meet?\nAnswer:<|im_end|>" in text
    with pytest.raises(ValueError, match="leaves no room"):
        _build(smol_tokenizer, _ns(data_dir=str(tmp_path), tasks="longbook_qa_eng"), 40)


def test_save_samples_roundtrip(smol_tokenizer, fixture_dir, tmp_path):
    from evals.sample_io import read_samples_jsonl

    out = tmp_path / "out" / "ib.jsonl"
    samples = _build(smol_tokenizer, _ns(data_dir=str(fixture_dir), tasks="code_debug,math_find",
                                                   save_samples=str(out)), SMOL_WINDOW)
    back = read_samples_jsonl(out)
    assert back == samples
    assert ib.score_sample(back[0], "C.") == 1.0


def test_cli_options_reach_build_samples(smol_tokenizer, fixture_dir):
    import argparse

    parser = argparse.ArgumentParser()
    ib.benchmark.add_arguments(parser)
    assert vars(parser.parse_args([])) == ib.benchmark.option_defaults()
    opts = vars(parser.parse_args(["--data-dir", str(fixture_dir), "--max-length", "300", "--prompt-set", "claude2",
                                   "--chat-template", "off", "--no-hub"]))
    ib.benchmark.check(tasks=["passkey"], options=opts)
    (s,) = ib.benchmark.build_samples(smol_tokenizer, window=SMOL_WINDOW, tasks=["passkey"], num_samples=1,
                                      options=opts)
    assert s.task == "passkey" and s.meta["max_length"] == 300 and s.meta["prompt_set"] == "claude2"
    assert smol_tokenizer.decode(list(s.prompt_ids)).endswith("\nWhat is the pass key?\nThe pass key is")


def test_check_fails_fast(tmp_path, fixture_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no InfiniteBench task files"):
        ib.benchmark.check(tasks=None, options={"data_dir": str(empty)})
    with pytest.raises(FileNotFoundError, match="hub disabled"):
        ib.benchmark.check(tasks=["kv_retrieval"], options={"data_dir": str(empty), "no_hub": True})
    ib.benchmark.check(tasks=["kv_retrieval"], options={"data_dir": str(empty)})  # the hub: tried at build
    with pytest.raises(ValueError, match="unknown InfiniteBench prompt set"):
        ib.benchmark.check(tasks=None, options={"data_dir": str(fixture_dir), "prompt_set": "gpt5"})
    with pytest.raises(ValueError, match="--chat-template must be one of"):
        ib.benchmark.check(tasks=None, options={"data_dir": str(fixture_dir), "chat_template": "yes"})
    _write_task(empty, "passkey", ["{broken"])
    with pytest.raises(ValueError, match=r"passkey\.jsonl:1: malformed JSON"):
        ib.benchmark.check(tasks=None, options={"data_dir": str(empty)})


def test_score_predictions_model_name():
    recs = [{"id": 0, "prediction": "1 1 4 8", "ground_truth": [1, 4, 8]}]
    # without the rule the repeated first number breaks the match after one value: 1/3
    assert ib.benchmark.score_predictions("math_calc", recs)["score"] == pytest.approx(1 / 3)
    assert ib.benchmark.score_predictions("math_calc", recs, model_name="yarn-mistral")["score"] == pytest.approx(1 / 3)
    assert ib.benchmark.score_predictions("math_calc", recs, model_name="gpt4")["score"] == 1.0
    # only math_calc has a model rule
    pk = [{"id": 0, "prediction": "12345", "ground_truth": ["12345"]}]
    assert ib.benchmark.score_predictions("passkey", pk, model_name="gpt4")["score"] == 1.0
    with pytest.raises(ValueError, match="unknown InfiniteBench model name 'gpt-4'; did you mean 'gpt4'"):
        ib.benchmark.score_predictions("math_calc", recs, model_name="gpt-4")


def test_hub_fallback_when_the_local_file_is_missing(tmp_path, monkeypatch):
    """No local file: the split comes from the hub through ``datasets`` (here a fake loader, with
    the dataset-card features passed through); a failing hub gives one error naming both places."""
    from evals import hub

    calls = []

    def fake_loader(repo, split, **kwargs):
        calls.append((repo, split, sorted(kwargs)))
        return [{"id": 7, "context": "noise. The pass key is 123. noise.", "input": "What is the pass key?",
                 "answer": ["123"], "options": []}]

    monkeypatch.setattr(hub, "LOADER", fake_loader)
    (rec,) = ib.load_records(tmp_path, "passkey")
    assert calls == [("xinrongzhang2022/InfiniteBench", "passkey", ["features"])]
    assert rec["id"] == 7 and rec["_where"].startswith("hf://xinrongzhang2022/InfiniteBench[passkey]")

    def broken(repo, split, **kwargs):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(hub, "LOADER", broken)
    with pytest.raises(FileNotFoundError, match=r"looked for .*passkey\.jsonl.*no route to host"):
        ib.load_records(tmp_path, "passkey")
