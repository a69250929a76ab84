"""Dashboard: pure queries and the Streamlit page (AppTest, no browser)."""
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from cluster.fake import FakeEngine
from cluster.store import open_store
from dashboard import queries

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")


def _populate(url, *, tasks=("qa", "sum"), n=3, run_id="toy-0001"):
    """Rows as the coordinator writes them, from the fake engine (ar + one speculative method)."""
    eng = FakeEngine()
    rows = []
    for task in tasks:
        for i in range(n):
            prompt = [1, 2, 3, i, len(task)]
            outs = {m: eng.generate([prompt], method=m, method_options={"k": 4} if m != "ar" else {},
                                    max_new_tokens=9)[0] for m in ("ar", "sparsespec-l")}
            for m, o in outs.items():
                rows.append(dict(run_id=run_id, benchmark="toy", task=task, model="fake", method=m,
                                 sample_id=f"s{i}", prediction=o.text, token_ids=o.token_ids,
                                 score=float(i % 2), stats=o.stats,
                                 lossless=None if m == "ar" else o.token_ids == outs["ar"].token_ids,
                                 first_divergence=None, num_input_tokens_raw=5, num_input_tokens=5,
                                 references=["x"]))
    with open_store(url) as st:
        st.start_run(run_id, benchmark="toy", model="fake", methods=["ar", "sparsespec-l"], config={})
        st.add_results(rows)
        st.finish_run(run_id)
    return rows


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path}/dash.db"
    _populate(url)
    return url


def test_db_url_precedence():
    from cluster.store import DEFAULT_DB_URL

    f = queries.resolve_db_url
    assert f([], {}) == DEFAULT_DB_URL
    assert f([], {"SPARSESPEC_DB": "sqlite:///e.db"}) == "sqlite:///e.db"
    assert f(["--db", "sqlite:///a.db"], {"SPARSESPEC_DB": "sqlite:///e.db"}) == "sqlite:///a.db"
    assert f(["-q", "tests/x.py", "--durations=3", "--d"], {}) == DEFAULT_DB_URL


def test_queries(db):
    runs = queries.list_runs(db)
    assert list(runs["run_id"]) == ["toy-0001"] and runs.loc[0, "num_results"] == 12
    rep = queries.report_frame(db)
    assert list(rep.columns) == queries.REPORT_COLUMNS
    assert list(rep["method"]) == ["ar", "sparsespec-l", "ar", "sparsespec-l"]
    sp = rep[rep["method"] == "sparsespec-l"].iloc[0]
    assert sp["speedup"] > 1 and sp["lossless_rate"] == 1.0 and sp["n"] == 3
    led = queries.ledger_frame(rep)
    assert list(led["method"]) == ["sparsespec-l", "sparsespec-l"]
    row = led.iloc[0]
    assert row["predicted_speedup"] == pytest.approx((row["alpha"] * row["mean_k"] + 1) / (row["mean_k"] * row["gamma"] + 1))
    assert row["error"] == pytest.approx(row["speedup"] / row["predicted_speedup"] - 1)
    samples = queries.sample_frame(db, "toy-0001")
    assert len(samples) == 12 and list(samples.columns) == queries.SAMPLE_COLUMNS
    assert samples[samples["method"] == "ar"]["speedup_vs_ar"].tolist() == [1.0] * 6
    assert queries.sample_frame(db, "no-such-run").empty


def test_queries_on_empty_db(tmp_path):
    url = f"sqlite:///{tmp_path}/empty.db"
    open_store(url).close()
    assert queries.list_runs(url).empty
    rep = queries.report_frame(url)
    assert rep.empty and list(rep.columns) == queries.REPORT_COLUMNS
    assert queries.ledger_frame(rep).empty


def _app(monkeypatch, url):
    monkeypatch.setenv("SPARSESPEC_DB", url)
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_app_with_results(monkeypatch, db):
    at = _app(monkeypatch, db)
    report = at.dataframe[0].value
    assert isinstance(report, pd.DataFrame)
    assert set(report["method"]) == {"ar", "sparsespec-l"} and set(report["task"]) == {"qa", "sum"}
    assert len(at.dataframe) == 4  # report, ledger, runs, per-sample
    assert len(at.get("plotly_chart")) == 3  # speedup, alpha, ledger
    assert any("Ledger" in s.value for s in at.subheader)
    ledger = at.dataframe[1].value
    assert {"predicted_speedup", "speedup"} <= set(ledger.columns)
    assert not at.info and not at.warning


def test_app_on_empty_db(monkeypatch, tmp_path):
    url = f"sqlite:///{tmp_path}/empty.db"
    open_store(url).close()
    at = _app(monkeypatch, url)
    assert any("No runs" in i.value for i in at.info)
    assert not at.dataframe


def test_app_on_missing_db_and_bad_url(monkeypatch, tmp_path):
    at = _app(monkeypatch, f"sqlite:///{tmp_path}/nothing-here.db")
    assert any("No database yet" in i.value for i in at.info)
    assert not (tmp_path / "nothing-here.db").exists()
    at = _app(monkeypatch, "definitely not a url")
    assert any("Cannot read the result store" in w.value for w in at.warning)


# --------------------------------------------------------------------------- roofline (cluster.bench rows)
def _steps_row(**kw):
    row = {"kind": "steps", "context_len": 1024, "prompt_len": 960, "batch_size": 1, "k": 4, "n_index": 128,
           "ar_step_s": 0.020, "ar_step_roofline_s": 0.010, "verify_importance_s": 0.030, "verify_roofline_s": 0.012,
           "draft_step_s": 0.004, "draft_step_roofline_s": 0.001}
    row.update(kw)
    return row


def _add_bench(url, rows, run_id="bench-0001"):
    with open_store(url) as st:
        st.start_run(run_id, benchmark="bench", model="fake", methods=["ar", "sparsespec-l"], config={})
        st.add_bench_rows(run_id, "fake", "cpu", rows)
        st.finish_run(run_id)


def test_roofline_frame_by_hand(tmp_path):
    from sparsespec.roofline import max_speedup

    url = f"sqlite:///{tmp_path}/b.db"
    # an older row without the stored maximum (derived here), one with it, and a row of another kind
    _add_bench(url, [_steps_row(), _steps_row(batch_size=4, roofline_max_speedup=9.0),
                     {"kind": "hf", "context_len": 1024, "batch_size": 1, "hf_step_s": 0.05}])
    df = queries.roofline_frame(url)
    assert list(df.columns) == queries.ROOFLINE_COLUMNS and len(df) == 2
    r = df.iloc[0]
    assert (r["context_len"], r["batch_size"], r["k"]) == (1024, 1, 4)
    assert r["ar_step_ms"] == pytest.approx(20.0) and r["ar_roofline_ms"] == pytest.approx(10.0)
    assert r["ar_x_roofline"] == pytest.approx(2.0) and r["verify_x_roofline"] == pytest.approx(2.5)
    assert r["draft_x_roofline"] == pytest.approx(4.0)
    assert r["gamma"] == pytest.approx(0.004 / 0.030) and r["gamma_roofline"] == pytest.approx(0.001 / 0.012)
    # every draft accepted: (k + 1) T_AR / (k T_draft + T_verify), at the floors and at the measured times
    assert r["roofline_max_speedup"] == pytest.approx(5 * 10 / (4 * 1 + 12)) == max_speedup(4, 0.010, 0.001, 0.012)
    assert r["step_max_speedup"] == pytest.approx(5 * 20 / (4 * 4 + 30))
    assert df.iloc[1]["roofline_max_speedup"] == 9.0  # a stored value is shown as stored
    assert queries.roofline_frame(url, ["other-run"]).empty
    empty = f"sqlite:///{tmp_path}/e.db"
    open_store(empty).close()
    assert queries.roofline_frame(empty).empty and list(queries.roofline_frame(empty).columns) == queries.ROOFLINE_COLUMNS


def test_app_shows_the_roofline_under_its_heading(monkeypatch, db):
    _add_bench(db, [_steps_row(), _steps_row(batch_size=4)])
    at = _app(monkeypatch, db)
    assert any(s.value == "Roofline" for s in at.subheader)
    roof = at.dataframe[-1].value
    assert list(roof.columns) == queries.ROOFLINE_COLUMNS and list(roof["batch_size"]) == [1, 4]
    # report, ledger, runs, roofline (the per-sample box opens on the newest run: the bench, no results)
    assert len(at.dataframe) == 4 and any("No results for this run" in i.value for i in at.info)


def test_app_without_bench_rows_has_no_roofline_and_a_steps_only_store_still_shows_it(monkeypatch, db, tmp_path):
    at = _app(monkeypatch, db)
    assert not any(s.value == "Roofline" for s in at.subheader)
    url = f"sqlite:///{tmp_path}/steps-only.db"
    _add_bench(url, [_steps_row()])  # a steps-only bench: a run without results
    at = _app(monkeypatch, url)
    assert any("no results yet" in i.value for i in at.info)
    assert any(s.value == "Roofline" for s in at.subheader) and len(at.dataframe) == 1
