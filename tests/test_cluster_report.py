"""Report maths on hand-made rows with known answers, and the report CLI."""
import json

import pytest

from cluster.results import report
from cluster.results.aggregate import cell_table
from cluster.results.report import REPORT_KEYS, compute_report, main, report_rows, tpot
from cluster.results.store import open_store


def _r(method, sample_id, stats, *, run_id="r1", task="t", score=None, lossless=None):
    return dict(run_id=run_id, benchmark="bench", task=task, model="m", method=method, sample_id=sample_id,
                prediction="p", token_ids=[1], score=score, stats=stats, lossless=lossless,
                first_divergence=None if lossless is not False else 3,
                num_input_tokens_raw=10, num_input_tokens=10, references=["x"])


def _ar(sample_id, n_out, decode_s, score):
    return _r("ar", sample_id, {"num_output_tokens": n_out, "decode_s": decode_s, "num_steps": n_out - 1,
                                "num_emitted": n_out - 1, "num_drafted": 0, "num_accepted": 0,
                                "verify_s": decode_s, "total_s": decode_s + 0.1}, score=score)


def _sp(sample_id, n_out, decode_s, *, drafted, accepted, steps, emitted, hist, draft_s, forwards, verify_s,
        score, lossless):
    return _r("spec", sample_id, {"num_output_tokens": n_out, "decode_s": decode_s, "num_drafted": drafted,
                                  "num_accepted": accepted, "num_steps": steps, "num_emitted": emitted,
                                  "accept_hist": hist, "draft_s": draft_s, "num_draft_forwards": forwards,
                                  "verify_s": verify_s, "total_s": decode_s + 0.1}, score=score, lossless=lossless)


def hand_rows():
    """ar TPOTs: s1 0.1, s2 0.2, s3 (1 token: skipped), s5 0.1; s4 has no ar row (unpaired)."""
    return [
        _ar("s1", 11, 1.0, 1.0),
        _ar("s2", 11, 2.0, 1.0),
        _ar("s3", 1, 0.0, 0.0),
        _ar("s5", 11, 1.0, 0.0),
        # s1: TPOT 0.05 -> ratio 2
        _sp("s1", 11, 0.5, drafted=10, accepted=8, steps=4, emitted=10, hist={"5:5": 1, "5:3": 1, "0:0": 2},
            draft_s=0.2, forwards=10, verify_s=0.4, score=1.0, lossless=True),
        # s2: TPOT 0.05 -> ratio 4
        _sp("s2", 11, 0.5, drafted=30, accepted=6, steps=6, emitted=10, hist={"5:1": 6},
            draft_s=0.6, forwards=30, verify_s=0.8, score=0.0, lossless=False),
        # s3: one output token, no ratio; drafted nothing -> inconclusive
        _sp("s3", 1, 0.0, drafted=0, accepted=0, steps=0, emitted=0, hist={},
            draft_s=0.0, forwards=0, verify_s=0.0, score=0.5, lossless=None),
        # s4: unpaired (no ar): pooled into alpha etc., not into speedup / lossless
        _sp("s4", 11, 0.5, drafted=10, accepted=10, steps=1, emitted=11, hist={"10:10": 1},
            draft_s=0.1, forwards=10, verify_s=0.1, score=1.0, lossless=True),
        # s5: TPOT 0.01 -> ratio 10
        _sp("s5", 11, 0.1, drafted=0, accepted=0, steps=0, emitted=0, hist={},
            draft_s=0.0, forwards=0, verify_s=0.0, score=None, lossless=True),
    ]


def test_report_known_answers():
    rows = compute_report(hand_rows())
    assert [(r["method"], r["n"]) for r in rows] == [("ar", 4), ("spec", 5)]
    ar, sp = rows
    assert all(tuple(r) == REPORT_KEYS for r in rows)
    assert ar == {"benchmark": "bench", "task": "t", "model": "m", "quantize": "none", "context_length": None, "batch_size": 1,
                  "queue_depth": 1, "method": "ar", "k": None, "draft_weights": None, "options": "", "variant": "ar", "n": 4, "score": 0.5,
                  "speedup": 1.0, "alpha": None, "tau": 1.0, "mean_k": None, "gamma": None,
                  "lossless_rate": None}
    assert sp["score"] == pytest.approx(2.5 / 4)  # mean of non-null scores
    assert sp["speedup"] == pytest.approx(4.0)  # median of [2, 4, 10], not the mean 5.33
    assert sp["alpha"] == pytest.approx(24 / 50)  # pooled; the mean of ratios would be 0.667
    assert sp["tau"] == pytest.approx(31 / 11)
    assert sp["mean_k"] == pytest.approx(50 / 9)  # drafting steps: 2 + 6 + 1
    assert sp["gamma"] == pytest.approx((0.9 / 50) / (1.3 / 11))
    assert sp["lossless_rate"] == pytest.approx(2 / 3)  # s1 T, s2 F, s5 T; s3 inconclusive, s4 unpaired


def test_tpot_and_edge_cases():
    assert tpot({"num_output_tokens": 5, "decode_s": 2.0}) == pytest.approx(0.5)
    assert tpot({"num_output_tokens": 1, "decode_s": 2.0}) is None
    assert tpot({}) is None
    # a method with no drafts at all: ratios are None, not a ZeroDivisionError
    (row,) = compute_report([_r("spec", "a", {"num_output_tokens": 3, "decode_s": 1.0})])
    assert row["alpha"] is None and row["tau"] is None and row["mean_k"] is None and row["gamma"] is None
    assert row["speedup"] is None and row["lossless_rate"] is None and row["score"] is None


def test_pairs_never_cross_runs():
    rows = [_ar("s1", 11, 1.0, 1.0),
            dict(_sp("s1", 11, 0.5, drafted=1, accepted=1, steps=1, emitted=2, hist={"1:1": 1}, draft_s=0.1,
                     forwards=1, verify_s=0.1, score=1.0, lossless=True), run_id="other")]
    sp = compute_report(rows)[1]
    assert sp["speedup"] is None and sp["lossless_rate"] is None


def test_groups_by_task_and_orders_ar_first():
    rows = hand_rows() + [dict(r, task="a-task") for r in hand_rows()]
    out = compute_report(rows)
    assert [(r["task"], r["method"]) for r in out] == [("a-task", "ar"), ("a-task", "spec"), ("t", "ar"), ("t", "spec")]
    assert out[1]["speedup"] == pytest.approx(4.0)


def test_cells_total_time_ratio_and_ledger():
    """cell_table's further numbers per cell (the dashboard's): the total-time speedup, the ledger
    prediction and tokens/s."""
    ex = {r["method"]: r for r in cell_table(hand_rows())}
    # paired with TPOT on both sides: s1, s2, s5 -> ar 4.0 s / 30 tok, spec 1.1 s / 30 tok
    assert ex["spec"]["speedup_total"] == pytest.approx(4.0 / 1.1)
    sp = compute_report(hand_rows())[1]
    k, a, g = sp["mean_k"], sp["alpha"], sp["gamma"]
    assert ex["spec"]["predicted_speedup"] == pytest.approx((a * k + 1) / (k * g + 1))
    assert ex["ar"]["speedup_total"] == 1.0 and ex["ar"]["predicted_speedup"] == 1.0
    # tokens/s = total tokens / total time (ar: 34 tokens over 4.0 + 0.4 s)
    assert ex["ar"]["tokens_per_s"] == pytest.approx(34 / 4.4)
    assert ex["spec"]["n_pairs"] == 3


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path}/r.db"
    with open_store(url) as s:
        s.start_run("r1", benchmark="bench", model="m", methods=["ar", "spec"], config={})
        s.add_results(hand_rows())
        s.start_run("r2", benchmark="bench", model="m", methods=["ar"], config={})
        s.add_results([dict(_ar("s1", 11, 1.0, 1.0), run_id="r2")])
    return url


def test_report_rows_from_db(db):
    assert report_rows(db, ["r1"]) == compute_report(hand_rows())
    assert report_rows(db, "r1") == compute_report(hand_rows())
    both = report_rows(db)
    assert both[0]["method"] == "ar" and both[0]["n"] == 5  # r1 and r2 pooled
    assert report_rows(db, ["nope"]) == []


def test_cli_json_has_exactly_the_keys(db, capsys):
    assert report.main(["--db", db, "--json", "--run", "r1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [list(d) for d in data] == [list(REPORT_KEYS)] * 2
    assert data[1]["speedup"] == pytest.approx(4.0)


def test_cli_table(db, capsys):
    assert report.main(["--db", db]) == 0
    out = capsys.readouterr().out
    assert "score (x100)" in out and "speedup" in out and "spec" in out
    assert "62.5" in out  # spec score 0.625 printed x100


def test_cli_missing_and_empty_db(tmp_path, capsys):
    missing = f"sqlite:///{tmp_path}/missing.db"
    assert report.main(["--db", missing]) == 1
    assert "no database" in capsys.readouterr().err
    assert not (tmp_path / "missing.db").exists()
    empty = f"sqlite:///{tmp_path}/empty.db"
    open_store(empty).close()
    assert report.main(["--db", empty, "--json"]) == 1
    assert "no results" in capsys.readouterr().err
    assert report.main(["--db", "not-a-url"]) == 2
    assert "sqlite:///" in capsys.readouterr().err


def test_leaderboard_markdown_and_csv(tmp_path, capsys):
    import pandas as pd

    from tests.dashboard_seed import seed

    url = f"sqlite:///{tmp_path}/lb.db"
    seed(url)
    prefix = tmp_path / "out" / "leaderboard"
    assert main(["--db", url, "--leaderboard", "--out", str(prefix)]) == 0
    md = capsys.readouterr().out
    assert md == (tmp_path / "out" / "leaderboard.md").read_text()
    head = md.splitlines()[:6]
    assert head[0] == "# sparsespec leaderboard: 10 run(s)"
    assert "- device: cpu (2 cores on vm)" in head and "- commit: abc1234" in head
    assert any(h.startswith("- software:") and "torch 2.13.0+cpu" in h for h in head)
    table = [line for line in md.splitlines() if line.startswith("| ruler ") and "| 2048 " in line and "| 1 " in line]
    assert table[0].split("|")[6].strip() == "ar"  # the reference row first in its setting
    assert table[1].split("|")[6].strip() == "sparsespec-l k=2" and "1.964" in table[1]
    assert table[0].split("|")[5].strip() == "1"  # queue depth: static batches
    df = pd.read_csv(prefix.with_suffix(".csv"), comment="#")
    assert list(df.columns)[:6] == ["benchmark", "model", "context_length", "batch_size", "queue_depth", "variant"]
    first = df[(df["benchmark"] == "longbench")].iloc[1]
    assert first["variant"] == "ngram k=3" and first["score_delta"] == pytest.approx(-0.1)
    assert first["speedup"] == pytest.approx(1.2)
    assert (tmp_path / "out" / "leaderboard.csv").read_text().startswith("# sparsespec leaderboard")


def test_leaderboard_errors(tmp_path, capsys):
    assert main(["--db", f"sqlite:///{tmp_path}/none.db", "--leaderboard"]) == 1
    assert "no database" in capsys.readouterr().err
    url = f"sqlite:///{tmp_path}/empty.db"
    open_store(url).close()
    assert main(["--db", url, "--leaderboard"]) == 1
    assert "no results" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--db", url, "--out", str(tmp_path / "x")])  # --out without --leaderboard


def test_four_way_table_cli(tmp_path, capsys):
    import json as _json

    from tests.dashboard_seed import seed, seed_quantized

    url = f"sqlite:///{tmp_path}/q.db"
    seed_quantized(url)
    assert main(["--db", url, "--four-way"]) == 0
    md = capsys.readouterr().out
    lines = [line for line in md.splitlines() if line.startswith("| ruler ")]
    assert [line.split("|")[6].strip() for line in lines] == ["baseline", "quantisation only", "speculation only", "both"]
    assert "1.920" in lines[3] and "ar [int8 target]" in lines[3] and "1.600" in lines[1]
    assert "- (new model)" in lines[1] and "paired across the two runs" in md
    assert main(["--db", url, "--four-way", "--json"]) == 0
    rows = _json.loads(capsys.readouterr().out)
    assert [r["speedup"] for r in rows] == pytest.approx([1.0, 1.6, 1.25, 1.92])
    # the per-cell report keeps the two targets apart, each method against its own ar
    rep = report_rows(url)
    assert [(r["quantize"], r["method"], round(r["speedup"], 3)) for r in rep] == [
        ("none", "ar", 1.0), ("none", "sparsespec-l", 1.25), ("int8", "ar", 1.0), ("int8", "sparsespec-l", 1.2)]
    # no int8 run: a sentence, exit 1; --leaderboard with --four-way: a usage error
    plain = f"sqlite:///{tmp_path}/plain.db"
    seed(plain)
    assert main(["--db", plain, "--four-way"]) == 1
    assert "quantize: [none, int8]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--db", url, "--four-way", "--leaderboard"])
