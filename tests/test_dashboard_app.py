"""Dashboard: its frames and every page through Streamlit's AppTest (no browser) on the seeded store."""
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from cluster.results.store import open_store
from dashboard import PAGES, queries
from tests import dashboard_seed as seed

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path}/dash.db"
    seed.seed(url)
    return url


def test_db_url_precedence():
    from cluster.results.store import DEFAULT_DB_URL

    f = queries.resolve_db_url
    assert f([], {}) == DEFAULT_DB_URL
    assert f([], {"SPARSESPEC_DB": "sqlite:///e.db"}) == "sqlite:///e.db"
    assert f(["--db", "sqlite:///a.db"], {"SPARSESPEC_DB": "sqlite:///e.db"}) == "sqlite:///a.db"
    assert f(["-q", "tests/x.py", "--durations=3", "--d"], {}) == DEFAULT_DB_URL


def test_frames_on_the_seeded_store(db):
    data = queries.load(db)
    runs = queries.runs_frame(data)
    assert len(runs) == 10 and set(runs["status"]) == {"finished", "running"}
    rows = [r for r in data.results if r["run_id"] == "ruler-L2048-B1"]
    cells = queries.cells_frame(rows)
    sp = cells[cells["method"] == "sparsespec-l"].iloc[0]
    assert sp["speedup"] == pytest.approx(1.25) and sp["speedup_total"] == pytest.approx(1.2)
    assert sp["alpha"] == pytest.approx(0.75) and sp["lossless_rate"] == 1.0
    led = queries.ledger_page_frame(rows)
    row = led[led["variant"].str.startswith("sparsespec-l")].iloc[0]
    assert row["predicted_speedup"] == pytest.approx((0.75 * 2 + 1) / (2 * 0.1 + 1))
    assert row["gap"] == pytest.approx(1.25 / row["predicted_speedup"] - 1)
    assert row["straggle"] > 0 and row["batch_predicted_speedup"] == pytest.approx(
        row["predicted_speedup"] * row["straggle"])  # the report's batch ledger, not one of its own
    samples = queries.sample_rows(data, "ruler-L1024-B1")
    assert len(samples) == 6 and list(samples.columns) == queries.SAMPLE_COLUMNS
    assert samples[samples["method"] == "ar"]["speedup_vs_ar"].tolist() == [1.0, 1.0]
    assert samples[samples["method"] == "sparsespec-l"]["speedup_vs_ar"].tolist() == pytest.approx([0.8, 0.8])
    assert queries.sample_rows(data, "no-such-run").empty


def test_filters_keep_ar_as_the_reference(db):
    data = queries.load(db)
    f = queries.Filters(methods=("ngram",), batch_sizes=(2,), context_lengths=(2048,))
    rows = queries.filtered(data, f)
    assert {r["method"] for r in rows} == {"ar", "ngram"} and {r["batch_size"] for r in rows} == {2}
    cells = queries.speedup_map(rows)
    assert set(cells["variant"]) == {"ar", "ngram k=3"} and cells["speedup"].tolist() == pytest.approx([1.0, 0.9])
    opts = queries.filter_options(data)
    assert opts["batch_size"] == [1, 2] and opts["context_length"] == [1024, 2048]
    assert opts["method"] == ["ar", "ngram", "sparsespec-l"]
    trace = queries.k_trace_frame(data, queries.Filters(run_ids=("ruler-L1024-B2",), methods=("ngram",)))
    assert set(trace["method"]) == {"ngram"} and len(trace) == 2 * 5 and set(trace["k"]) == {3}


def test_frames_on_an_empty_db(tmp_path):
    url = f"sqlite:///{tmp_path}/empty.db"
    open_store(url).close()
    data = queries.load(url)
    assert queries.ledger_page_frame([]).empty and queries.s_vs_k_frame([]).empty
    assert queries.acceptance_frame([]).empty and queries.gates_frame([], queries.cq.GateThresholds()).empty
    assert queries.k_trace_frame(data, queries.Filters()).empty and queries.runs_frame(data).empty


def _page(monkeypatch, url, path="compare"):
    """Run the app at ``path`` (a url path of ``dashboard.PAGES``); no exception allowed."""
    monkeypatch.setenv("SPARSESPEC_DB", url)
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    if path != PAGES[0][2]:
        file = next(f for f, _, u, _ in PAGES if u == path)
        at.switch_page(f"views/{file}").run()
        assert not at.exception, [e.value for e in at.exception]
    return at


def _downloads(at):
    return at.get("download_button")


def test_compare_page_four_way_section(monkeypatch, tmp_path):
    url = f"sqlite:///{tmp_path}/q.db"
    seed.seed_quantized(url)
    at = _page(monkeypatch, url, "compare")
    assert not at.info and not at.warning
    # a heatmap per (target, variant): sparsespec-l k=2 and its [int8 target] twin, then best, four-way, ...
    assert len(at.get("plotly_chart")) == 2 + 2 + 1 + 2 + 1
    best = at.dataframe[0].value
    assert list(best["quantize"]) == ["int8", "none"] and list(best["best"]) == [
        "sparsespec-l k=2 [int8 target]", "sparsespec-l k=2"]
    four = at.dataframe[1].value
    assert list(four["arm"]) == ["baseline", "quantisation only", "speculation only", "both"]
    assert four["speedup"].tolist() == pytest.approx([1.0, 1.6, 1.25, 1.92])
    assert "dl_four_way" in [d.key for d in _downloads(at)]


def test_compare_page(monkeypatch, db):
    at = _page(monkeypatch, db, "compare")
    assert at.title[0].value.startswith("Compare")
    # one heatmap per variant (ngram k=3, sparsespec-l, and the four fixed-k), the best-per-cell
    # map, speedup vs context, vs batch, score delta
    assert len(at.get("plotly_chart")) == 6 + 1 + 3
    best = at.dataframe[0].value
    assert list(best["best"]) == ["ngram k=3", "sparsespec-l", "sparsespec-l k=2", "sparsespec-l"]
    cells = at.dataframe[1].value
    assert {"speedup", "ci_low", "alpha", "lossless_rate"} <= set(cells.columns)
    # no int8-target run in this store: the four-way section says how to get one
    assert len(_downloads(at)) == 2 and not at.warning
    assert len(at.info) == 1 and "quantize: [none, int8]" in at.info[0].value
    # a filter narrows every chart: batch size 2 only
    at.sidebar.multiselect(key="f_batch").set_value([2]).run()
    assert not at.exception
    assert list(at.dataframe[0].value["batch_size"]) == [2, 2]  # the best-per-cell table: two contexts at batch 2


def test_ledger_page(monkeypatch, db):
    at = _page(monkeypatch, db, "ledger")
    led = at.dataframe[0].value
    assert list(led.columns) == queries.LEDGER_PAGE_COLUMNS
    row = led[(led["variant"] == "sparsespec-l") & (led["context_length"] == 2048) & (led["batch_size"] == 1)].iloc[0]
    assert row["predicted_speedup"] == pytest.approx(2.5 / 1.2) and row["speedup"] == pytest.approx(1.25)
    svk = at.dataframe[1].value
    assert list(svk["k"]) == [1, 2, 4, 8] and list(svk["inversion"]) == [False, False, False, True]
    # ledger bars, round costs, S vs k, acceptance by position, the k trace
    assert len(at.get("plotly_chart")) == 5 and len(_downloads(at)) == 4
    assert not at.info


def test_gates_page_and_editable_thresholds(monkeypatch, db):
    at = _page(monkeypatch, db, "gates")
    gates = at.dataframe[0].value
    assert set(gates["passed"]) == {"pass", "FAIL"}
    assert at.metric[0].value == f"{(gates['passed'] == 'pass').sum()} / {len(gates)}"
    before = (gates["passed"] == "pass").sum()
    at.number_input(key="g_speed").set_value(0.0).run()
    at.number_input(key="g_itl").set_value(20.0).run()
    at.number_input(key="g_thr").set_value(0.0).run()
    after = at.dataframe[0].value
    assert (after["passed"] == "pass").sum() > before
    q = after[(after["benchmark"] == "longbench")].iloc[0]
    assert q["correctness"] == "no data" and q["quality"] == "FAIL"


def test_ab_page(monkeypatch, db):
    at = _page(monkeypatch, db, "ab")
    arms = at.dataframe[0].value
    assert set(arms["arm"]) == {"ar", "spec", "(refused at the router)"}
    assert any("0.80x ar's" in m.value and "significantly faster" in m.value for m in at.markdown)
    assert len(at.get("plotly_chart")) == 4 and len(_downloads(at)) == 2


def test_runs_page(monkeypatch, db):
    at = _page(monkeypatch, db, "runs")
    runs = at.dataframe[0].value
    assert runs.iloc[0]["run_id"] == "ruler-running" and runs.iloc[0]["shards_failed"] == 1
    assert any("failed shards" in w.value for w in at.warning)
    shards = at.dataframe[1].value
    assert set(shards["status"]) == {"failed", "running"} and "worker died" in shards["error"].dropna().iloc[0]
    assert any("No results for this run yet" in i.value for i in at.info)
    at.selectbox(key="runs_pick").set_value("ruler-L1024-B1").run()
    assert not at.exception
    samples = at.dataframe[-1].value
    assert len(samples) == 6 and set(samples["method"]) == {"ar", "sparsespec-l", "ngram"}


@pytest.mark.parametrize("path", [p[2] for p in PAGES])
def test_every_page_on_an_empty_and_a_missing_db(monkeypatch, tmp_path, path):
    url = f"sqlite:///{tmp_path}/empty.db"
    open_store(url).close()
    at = _page(monkeypatch, url, path)
    assert at.info and ("No runs in this database" in at.info[0].value or "No Serve requests" in at.info[0].value)
    assert not at.get("plotly_chart") and not at.dataframe
    at = _page(monkeypatch, f"sqlite:///{tmp_path}/nothing-here.db", path)
    assert any("No database yet" in i.value for i in at.info)
    assert not (tmp_path / "nothing-here.db").exists()
    at = _page(monkeypatch, "definitely not a url", path)
    assert any("Cannot read the result store" in w.value for w in at.warning)


# --------------------------------------------------------------------------- roofline (cluster.speed.measure rows)
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


def test_runs_page_shows_the_roofline_of_a_bench_run(monkeypatch, tmp_path):
    url = f"sqlite:///{tmp_path}/steps-only.db"
    _add_bench(url, [_steps_row(), _steps_row(batch_size=4)])  # a bench run: steps rows, no results
    at = _page(monkeypatch, url, "runs")
    assert any(s.value == "Roofline" for s in at.subheader)
    roof = at.dataframe[-1].value
    assert list(roof.columns) == queries.ROOFLINE_COLUMNS and list(roof["batch_size"]) == [1, 4]
    assert any("No results for this run yet" in i.value for i in at.info)
    at = _page(monkeypatch, url, "compare")  # no results: a sentence, not a chart
    assert any("No results stored yet" in i.value for i in at.info) and not at.get("plotly_chart")


def test_runs_and_ab_pages_filter(monkeypatch, db):
    data = queries.load(db)
    runs = queries.runs_frame(data).to_dict("records")
    f = queries.Filters(batch_sizes=(2,), methods=("ngram",))
    assert sorted(r["run_id"] for r in runs if f.keep_run(r)) == ["ruler-L1024-B2", "ruler-L2048-B2"]
    assert [r["run_id"] for r in runs if queries.Filters(models=("other",)).keep_run(r)] == []
    at = _page(monkeypatch, db, "runs")
    at.sidebar.multiselect(key="f_batch").set_value([2]).run()
    assert not at.exception and set(at.dataframe[0].value["run_id"]) == {"ruler-L1024-B2", "ruler-L2048-B2"}
    at = _page(monkeypatch, db, "ab")
    at.sidebar.multiselect(key="ab_arms").set_value(["ar"]).run()
    assert not at.exception and list(at.dataframe[0].value["arm"]) == ["ar"]
    assert any("Only one arm" in i.value for i in at.info)
