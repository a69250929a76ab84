"""Golden tests for evals.metrics. Every expected value is worked out by hand from the official
definitions (THUDM/LongBench metrics.py + eval.py, NVIDIA/RULER eval constants); the derivation
is in the comment next to it."""
from __future__ import annotations

import pytest

from evals import metrics as M

TREC_CLASSES = [
    "Food", "Date", "Order, rank", "Speed", "Disease and medicine", "Word with a special property",
    "Abbreviation", "Language", "Letter like a-z", "Other entity", "Animal", "Expression abbreviated",
    "Price", "Techniques and method", "Musical instrument", "Mountain", "Currency name", "Event",
    "Product", "State", "Individual", "Organ of body", "Reason", "Manner of an action", "City",
    "Religion", "Invention, book and other creative piece", "Distance, linear measure",
    "Temperature", "Postcode or other code", "Size, area and volume", "Sport", "Country",
    "Other location", "Lasting time of somethin", "Equivalent term", "Description of something",
    "Weight", "Vehicle", "Color", "Other number", "Definition of something", "Element and substance",
    "Description of a person", "Symbols and sign", "Number of something", "Plant",
    "Percent, fraction", "Group or organization of person", "Title of a person",
]


# ---------------------------------------------------------------- normalisation / QA F1


def test_normalize_answer():
    # lower -> drop punctuation -> drop articles -> squeeze whitespace
    assert M.normalize_answer("The  Eiffel-Tower, in PARIS!") == "eiffeltower in paris"
    assert M.normalize_answer("An apple a day") == "apple day"


def test_qa_f1_partial_overlap():
    # pred tokens [eiffel, tower, in, paris], gold [eiffel, tower]: overlap 2,
    # P = 2/4, R = 2/2, F1 = 2 * 0.5 * 1 / 1.5 = 2/3
    assert M.qa_f1_score("The Eiffel Tower in Paris", "Eiffel Tower") == pytest.approx(2 / 3)


def test_qa_f1_exact_and_disjoint_and_empty():
    assert M.qa_f1_score("Miller v. California", "miller v california") == 1.0
    assert M.qa_f1_score("London", "Paris") == 0.0
    assert M.qa_f1_score("", "Paris") == 0.0
    # only articles/punctuation -> no tokens -> 0
    assert M.qa_f1_score("the.", "Paris") == 0.0


def test_qa_f1_repeated_tokens_use_multiset_overlap():
    # pred [paris, paris], gold [paris]: overlap min(2,1)=1, P=1/2, R=1, F1=2/3
    assert M.qa_f1_score("Paris Paris", "Paris") == pytest.approx(2 / 3)


def test_qa_f1_zh_jieba():
    # jieba: 我/爱/北京/天安门 vs 北京/天安门/。 -> "。" normalises to "" and is dropped;
    # overlap 2, P = 2/4, R = 2/2, F1 = 2/3
    assert M.qa_f1_zh_score("我爱北京天安门", "北京天安门。") == pytest.approx(2 / 3)
    assert M.qa_f1_zh_score("北京", "北京") == 1.0
    assert M.qa_f1_zh_score("", "北京") == 0.0


def test_normalize_zh_answer_removes_cjk_punctuation_and_spaces():
    assert M.normalize_zh_answer("北京，天安门！ A B") == "北京天安门ab"


# ---------------------------------------------------------------- ROUGE-L (rouge==1.0.1)


def test_rouge_l_counts_unique_words():
    # rouge 1.0.1 ROUGE-L summary level, exclusive=True: m = unique ref words {the,cat,sat} = 3,
    # n = unique hyp words {the,cat,sat,on,mat} = 5, union LCS = 3 -> R = 1, P = 3/5,
    # F = 2PR / (P + R + 1e-8) = 1.2 / 1.6 = 0.75 (minus ~5e-9)
    assert M.rouge_score("the cat sat on the mat", "the cat sat") == pytest.approx(0.75, abs=1e-7)


def test_rouge_l_is_case_sensitive_and_empty_is_zero():
    # "The" != "the": union LCS = {cat, sat} = 2, m = 3, n = 3 -> P = R = 2/3 -> F = 2/3
    assert M.rouge_score("The cat sat", "the cat sat") == pytest.approx(2 / 3, abs=1e-7)
    # empty hypothesis raises inside rouge -> official returns 0
    assert M.rouge_score("", "the cat sat") == 0.0
    assert M.rouge_score("...", "the cat sat") == 0.0


def test_rouge_zh_uses_jieba_words():
    # jieba: 今天天气/很/好 vs 今天天气/不好 -> LCS 1, R = 1/2, P = 1/3, F = (1/3)/(5/6) = 0.4
    assert M.rouge_zh_score("今天天气很好", "今天天气不好") == pytest.approx(0.4, abs=1e-7)


# ---------------------------------------------------------------- classification


def test_classification_single_label():
    # only "Other location" is a substring of the prediction -> 1/1
    assert M.classification_score("Other location", "Other location", all_classes=TREC_CLASSES) == 1.0


def test_classification_several_labels_named():
    # "Other location" and "Color" both occur (in all_classes order); neither is a strict
    # substring of the gold "Color" except "Color" itself -> kept -> 1/2
    pred = "Color or maybe Other location"
    assert M.classification_score(pred, "Color", all_classes=TREC_CLASSES) == 0.5


def test_classification_wrong_or_no_label():
    assert M.classification_score("Color", "Other location", all_classes=TREC_CLASSES) == 0.0
    assert M.classification_score("no idea", "Color", all_classes=TREC_CLASSES) == 0.0
    assert M.classification_score("", "Color", all_classes=TREC_CLASSES) == 0.0


def test_classification_drops_strict_substrings_of_gold():
    # matched = ["person", "Description of a person"]; "person" is a strict substring of the
    # gold -> removed; the iteration then ends -> ["Description of a person"] -> 1/1
    classes = ["person", "Description of a person", "Title of a person"]
    assert M.classification_score("Description of a person", "Description of a person", all_classes=classes) == 1.0


def test_classification_reproduces_official_remove_while_iterating_quirk():
    # matched = ["per", "son", "person"]; at i=0 "per" is removed, "son" slides to i=0 and is
    # never examined; i=1 is "person" (== gold, kept) -> ["son", "person"] -> 1/2
    # (a "correct" implementation would give 1.0)
    classes = ["per", "son", "person"]
    assert M.classification_score("person", "person", all_classes=classes) == 0.5


def test_classification_needs_all_classes():
    with pytest.raises(ValueError):
        M.classification_score("Color", "Color")


# ---------------------------------------------------------------- code similarity


def test_code_sim_takes_first_line_without_backtick_hash_or_slashes():
    gold = "\t\t\t\tParticipant p = (Participant)m_Participants[i];"
    pred = "\n```csharp\n// next line\n" + gold + "\nmore();\n"
    assert M.code_sim_score(pred, gold) == 1.0


def test_code_sim_skips_lines_that_merely_contain_a_comment():
    # official: '#' anywhere in the line disqualifies it (not only at the start)
    assert M.code_sim_score("x = 1  # set x\ny = 2", "y = 2") == 1.0


def test_code_sim_partial_and_empty():
    # difflib ratio("abcd", "abce") = 2*3/8 = 0.75 -> fuzz.ratio 75 -> 0.75
    assert M.code_sim_score("abcd", "abce") == 0.75
    # every line disqualified -> prediction "" -> fuzz.ratio("", gold) = 0
    assert M.code_sim_score("# only a comment\n`x`", "y = 2") == 0.0
    assert M.code_sim_score("", "y = 2") == 0.0


# ---------------------------------------------------------------- count / retrieval


def test_count_score():
    # numbers [3, 4], one equals gold -> 1/2
    assert M.count_score("There are 3 paragraphs, not 4", "3") == 0.5
    assert M.count_score("3", "3") == 1.0
    assert M.count_score("three", "3") == 0.0


def test_retrieval_score_en_and_zh():
    assert M.retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    # numbers [1, 12] -> 1/2
    assert M.retrieval_score("Paragraph 1 or Paragraph 12", "Paragraph 12") == 0.5
    assert M.retrieval_score("none", "Paragraph 12") == 0.0
    assert M.retrieval_zh_score("段落3", "段落3") == 1.0
    # numbers [3, 30] -> 1/2
    assert M.retrieval_zh_score("段落3，也可能是段落30", "段落3") == 0.5


# ---------------------------------------------------------------- RULER


def test_string_match_all_per_sample_fraction():
    assert M.string_match_all("The numbers are 123 and ABC.", ["123", "abc"]) == 1.0
    assert M.string_match_all("only 123", ["123", "abc"]) == 0.5
    assert M.string_match_all("", ["123"]) == 0.0
    with pytest.raises(ValueError):
        M.string_match_all("x", [])


def test_string_match_part_any():
    assert M.string_match_part("only 123", ["123", "abc"]) == 1.0
    assert M.string_match_part("nothing", ["123", "abc"]) == 0.0


def test_ruler_postprocess_replaces_control_characters():
    assert M.ruler_postprocess("  12\x0034\t5 \n") == "12\n34\n5"


# ---------------------------------------------------------------- registry and official loop


def test_registry_is_the_official_dataset2metric():
    expected = {
        "narrativeqa": M.qa_f1_score, "qasper": M.qa_f1_score, "multifieldqa_en": M.qa_f1_score,
        "multifieldqa_zh": M.qa_f1_zh_score, "hotpotqa": M.qa_f1_score, "2wikimqa": M.qa_f1_score,
        "musique": M.qa_f1_score, "dureader": M.rouge_zh_score, "gov_report": M.rouge_score,
        "qmsum": M.rouge_score, "multi_news": M.rouge_score, "vcsum": M.rouge_zh_score,
        "trec": M.classification_score, "triviaqa": M.qa_f1_score, "samsum": M.rouge_score,
        "lsht": M.classification_score, "passage_retrieval_en": M.retrieval_score,
        "passage_count": M.count_score, "passage_retrieval_zh": M.retrieval_zh_score,
        "lcc": M.code_sim_score, "repobench-p": M.code_sim_score,
    }
    assert M.DATASET2METRIC == expected
    assert set(M.FIRST_LINE_TASKS) == {"trec", "triviaqa", "samsum", "lsht"}


def test_longbench_score_takes_max_over_answers():
    # F1 vs "Paris" = 1.0, vs "City of Light" = 0 -> max 1.0
    assert M.longbench_score("hotpotqa", "Paris", ["City of Light", "Paris"]) == 1.0
    # F1: vs "Eiffel Tower" 2/3, vs "Tower" 2*(1/4)*1/(5/4) = 0.4 -> 2/3
    assert M.longbench_score("hotpotqa", "The Eiffel Tower in Paris", ["Tower", "Eiffel Tower"]) == pytest.approx(2 / 3)
    assert M.longbench_score("hotpotqa", "", ["Paris"]) == 0.0


def test_longbench_first_line_rule():
    # triviaqa: only "Paris" (first line after leading newlines) is scored -> 1.0;
    # hotpotqa has no such rule: tokens [paris, it, is, capital] vs [paris] -> 2*(1/4)/(5/4) = 0.4
    pred = "\n\nParis\nIt is the capital"
    assert M.longbench_score("triviaqa", pred, ["Paris"]) == 1.0
    assert M.longbench_score("hotpotqa", pred, ["Paris"]) == pytest.approx(0.4)
    # trec: the second line names another class, but only the first line counts -> 1/1
    assert M.longbench_score("trec", "Color\nOther location", ["Color"], all_classes=TREC_CLASSES) == 1.0


def test_longbench_score_lcc_and_unknown_task():
    assert M.longbench_score("lcc", "\n# c\nreturn x;", ["return x;"]) == 1.0
    assert M.longbench_score("hotpotqa_e", "Paris", ["Paris"]) == 1.0  # LongBench-E name
    with pytest.raises(ValueError, match="unknown LongBench task"):
        M.longbench_score("hotpotq", "Paris", ["Paris"])


def test_every_per_sample_score_is_in_unit_interval():
    cases = [
        ("gov_report", "a summary. of things", ["the summary of many things."]),
        ("samsum", "Emilia is angry", ["Emilia is still angry."]),
        ("lcc", "foo(bar)", ["foo(baz)"]),
        ("passage_count", "5 5 6", ["5"]),
        ("qasper", "unanswerable", ["unanswerable"]),
    ]
    for task, pred, answers in cases:
        assert 0.0 <= M.longbench_score(task, pred, answers) <= 1.0


def test_official_task_score_scale():
    assert M.official_task_score([1.0, 0.5, 0.0]) == 50.0
    assert M.official_task_score([2 / 3]) == 66.67
    with pytest.raises(ValueError):
        M.official_task_score([])


# ---------------------------------------------------------------- more goldens (issue 5)

#: metrics.py ``normalize_zh_answer``: the official ``cn_punctuation`` string, verbatim.
OFFICIAL_CN_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."


def test_zh_punctuation_is_the_official_set():
    import string

    assert M._ZH_PUNCT == frozenset(string.punctuation + OFFICIAL_CN_PUNCTUATION)


def test_qa_f1_multi_word_exact_match_after_normalisation():
    # both normalise to "united states of america" (article, case and "." removed) -> 1.0
    assert M.qa_f1_score("The United States of America.", "United States of America") == 1.0
    # word order does not matter for a bag-of-tokens F1
    assert M.qa_f1_score("America, United States of", "United States of America") == 1.0


def test_multiple_references_take_the_best_and_first_line():
    # triviaqa: first line "Paris, France" -> [paris, france] vs [paris]: P=1/2, R=1 -> 2/3;
    # vs "City of Light" -> 0; best 2/3
    pred = "Paris, France\nThe capital of France is Paris"
    assert M.longbench_score("triviaqa", pred, ["City of Light", "paris"]) == pytest.approx(2 / 3)
    # multifieldqa_zh: 北京 vs [上海, 北京] -> max(0, 1) = 1
    assert M.longbench_score("multifieldqa_zh", "北京", ["上海", "北京"]) == 1.0
    # repobench-p: code_sim vs "abaa" 0.57 (see below), vs "zzz" 0 -> 0.57
    assert M.longbench_score("repobench-p", "aaa", ["zzz", "abaa"]) == 0.57


def test_empty_prediction_scores_zero_for_every_metric():
    assert M.qa_f1_score("", "Paris") == 0.0
    assert M.qa_f1_zh_score("", "北京") == 0.0
    assert M.rouge_score("", "the cat sat") == 0.0
    assert M.rouge_zh_score("", "今天天气不好") == 0.0
    assert M.classification_score("", "Color", all_classes=TREC_CLASSES) == 0.0
    assert M.code_sim_score("", "y = 2") == 0.0
    assert M.count_score("", "3") == 0.0
    assert M.retrieval_score("", "Paragraph 3") == 0.0
    assert M.retrieval_zh_score("", "段落3") == 0.0
    for task in M.DATASET2METRIC:
        answers = {"passage_retrieval_en": ["Paragraph 3"], "passage_retrieval_zh": ["段落3"]}.get(task, ["3"])
        classes = TREC_CLASSES if task in ("trec", "lsht") else None
        assert M.longbench_score(task, "", answers, all_classes=classes) == 0.0, task


def test_chinese_rouge_and_f1_goldens():
    # jieba: 我/爱/北京/天安门 vs 北京/天安门/。 -> rouge over unique words: m = 3 (我 爱 are not in
    # the gold; gold words {北京, 天安门, 。}), n = 4, LCS = 2 -> R = 2/3, P = 2/4,
    # F = 2PR/(P+R+1e-8) = (2/3)/(7/6) = 4/7
    assert M.rouge_zh_score("我爱北京天安门", "北京天安门。") == pytest.approx(4 / 7, abs=1e-7)
    # dureader / vcsum use rouge_zh; identical text -> 1 (minus the 1e-8 of the formula)
    assert M.longbench_score("vcsum", "会议讨论了预算", ["会议讨论了预算"]) == pytest.approx(1.0, abs=1e-7)
    assert M.longbench_score("dureader", "今天天气很好", ["今天天气不好"]) == pytest.approx(0.4, abs=1e-7)


def test_lsht_classification_in_chinese():
    classes = ["体育", "财经", "教育", "科技"]
    # one label named -> 1/1
    assert M.longbench_score("lsht", "这是一条体育新闻", ["体育"], all_classes=classes) == 1.0
    # two labels named, gold among them -> 1/2
    assert M.longbench_score("lsht", "体育还是财经", ["财经"], all_classes=classes) == 0.5
    # lsht is a first-line task: a label on the second line is not seen -> 0
    assert M.longbench_score("lsht", "不知道\n财经", ["财经"], all_classes=classes) == 0.0


def test_count_and_retrieval_more_cases():
    assert M.count_score("The final answer is: 12", "12") == 1.0
    # "1, 2" holds the integers 1 and 2, neither is 12 -> 0
    assert M.count_score("1, 2", "12") == 0.0
    # numbers [12, 12, 7] -> 2/3
    assert M.count_score("12 or 12, maybe 7", "12") == pytest.approx(2 / 3)
    # gold Paragraph 1 vs predicted 12 -> whole numbers compared, not prefixes -> 0
    assert M.retrieval_score("Paragraph 12", "Paragraph 1") == 0.0
    assert M.retrieval_zh_score("段落12", "段落1") == 0.0
    assert M.retrieval_zh_score("没有编号", "段落1") == 0.0


# ---------------------------------------------------------------- fuzz ratio (difflib path)


def test_fuzz_ratio_difflib_differs_from_levenshtein():
    # difflib's greedy matching: longest block of "aaa" / "abaa" is "aa" (a[0:2] = b[2:4]); the
    # leftovers "" / "ab" (left) and "a" / "" (right) match nothing -> M = 2,
    # ratio = 2*2/7 = 0.5714 -> 57. python-Levenshtein's ratio is 2*LCS/7 with LCS("aaa","abaa") = 3
    # -> 0.857 -> 86. The official numbers come from the difflib path: 57.
    assert M.fuzz_ratio("aaa", "abaa") == 57
    assert M.code_sim_score("aaa", "abaa") == 0.57


def test_fuzz_ratio_rounds_half_to_even_and_decorator_order():
    # one matching character out of 8 + 8 -> 2/16 = 0.125 -> 12.5 -> round() -> 12 (banker's)
    assert M.fuzz_ratio("abcdefgh", "aijklmno") == 12
    assert M.code_sim_score("abcdefgh", "aijklmno") == 0.12
    assert M.fuzz_ratio("", "") == 100  # equality is checked before emptiness
    assert M.fuzz_ratio("", "x") == 0
    assert M.fuzz_ratio(None, "x") == 0
    assert M.fuzz_ratio("abcd", "abce") == 75


def test_fuzz_ratio_matches_fuzzywuzzy_pure_python_path():
    import difflib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fuzzywuzzy import fuzz
    if fuzz.SequenceMatcher is not difflib.SequenceMatcher:
        pytest.skip("fuzzywuzzy uses python-Levenshtein here; its numbers are not the official ones")
    pairs = [
        ("aaa", "abaa"), ("abcdefgh", "aijklmno"), ("", ""), ("", "x"),
        ("return x;", "return y;"), ("\t\tfoo(bar, baz);", "foo(bar);"),
        ("x = " + "a b " * 80, "x = " + "a c " * 80),  # > 200 chars: difflib's autojunk applies
    ]
    for a, b in pairs:
        assert M.fuzz_ratio(a, b) == fuzz.ratio(a, b), (a, b)


# ---------------------------------------------------------------- LongBench-E


def test_longbench_e_task_names():
    assert len(M.LONGBENCH_E_TASKS) == 13
    assert M.longbench_base_task("hotpotqa_e") == "hotpotqa"
    assert M.longbench_base_task("narrativeqa_e") == "narrativeqa_e"  # no LongBench-E set
    assert M.longbench_score("samsum_e", "\nA is late.\nB", ["A is late."]) == pytest.approx(1.0, abs=1e-7)
    with pytest.raises(ValueError, match="unknown LongBench task"):
        M.longbench_score("narrativeqa_e", "x", ["x"])


def test_longbench_e_buckets():
    assert [M.longbench_e_bucket(n) for n in (0, 3999, 4000, 7999, 8000, 50000)] == [
        "0-4k", "0-4k", "4-8k", "4-8k", "8k+", "8k+"
    ]
    # 0-4k: mean(1, 0) = 0.5 -> 50.0; 4-8k: mean(0.5) -> 50.0; 8k+: mean(1, 2/3) -> 83.33
    got = M.longbench_e_scores([1.0, 0.0, 0.5, 1.0, 2 / 3], [100, 3999, 4000, 9000, 8000])
    assert got == {"0-4k": 50.0, "4-8k": 50.0, "8k+": 83.33}
    # an empty bucket: official prints NaN, we give None
    assert M.longbench_e_scores([1.0], [10]) == {"0-4k": 100.0, "4-8k": None, "8k+": None}
    with pytest.raises(ValueError):
        M.longbench_e_scores([1.0], [])
