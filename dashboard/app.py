"""Streamlit dashboard over the result store.

    streamlit run dashboard/app.py                          # SPARSESPEC_DB or sqlite:///results/sparsespec.db
    streamlit run dashboard/app.py -- --db postgresql+psycopg://user@host/db

Shows the report (score, paired speedup, acceptance), bar charts of speedup and alpha per method
faceted by task, the ledger (predicted S = (alpha*k + 1)/(k*gamma + 1) with k = mean_k next to
the measured speedup), the runs, per-sample rows of one run, and (for ``cluster.bench`` runs) the
step times against their rooflines. All numbers come from
``dashboard.queries`` (pure functions); this file only lays them out.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `streamlit run dashboard/app.py` puts only dashboard/ on sys.path
    sys.path.insert(0, str(_ROOT))

import pandas as pd  # noqa: E402
import plotly.express as px  # noqa: E402
import streamlit as st  # noqa: E402

from cluster.store import StoreError, StoreNotFoundError, safe_url  # noqa: E402
from dashboard import queries  # noqa: E402


@st.cache_data(ttl=15, show_spinner=False)
def _runs(db: str) -> pd.DataFrame:
    return queries.list_runs(db)


@st.cache_data(ttl=15, show_spinner=False)
def _report(db: str, run_ids: tuple[str, ...]) -> pd.DataFrame:
    return queries.report_frame(db, list(run_ids))


@st.cache_data(ttl=15, show_spinner=False)
def _samples(db: str, run_id: str) -> pd.DataFrame:
    return queries.sample_frame(db, run_id)


@st.cache_data(ttl=15, show_spinner=False)
def _roofline(db: str, run_ids: tuple[str, ...]) -> pd.DataFrame:
    return queries.roofline_frame(db, list(run_ids))


def _roofline_section(db: str, run_ids: tuple[str, ...]) -> None:
    """The bench's step times vs their roofline floors (nothing when no bench run is selected)."""
    roof = _roofline(db, run_ids)
    if roof.empty:
        return
    st.subheader("Roofline")
    st.caption("cluster.bench step timings (ms) against their floors: max(bytes / measured read bandwidth, "
               "FLOPs / measured GEMM rate); x_roofline = measured / floor. max speedup: every draft accepted, "
               "(k+1) T_AR / (k T_draft + T_verify), at the floors and at the measured step times.")
    st.dataframe(roof, hide_index=True)


def _facet_label(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    if df["benchmark"].nunique() > 1:
        df["facet"] = df["benchmark"] + "/" + df["task"]
    else:
        df["facet"] = df["task"]
    return df


def _bar(df: pd.DataFrame, y: str, title: str, reference: float | None = None):
    fig = px.bar(df, x="method", y=y, color="method", facet_col="facet", facet_col_wrap=4,
                 hover_data=["model", "n"], title=title)
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    if reference is not None:
        fig.add_hline(y=reference, line_dash="dot", line_color="grey")
    fig.update_layout(showlegend=False, margin=dict(t=60, b=20))
    return fig


def main() -> None:
    st.set_page_config(page_title="sparsespec results", layout="wide")
    st.title("SparseSpec: long-context speculative decoding benchmarks")
    db = queries.resolve_db_url(sys.argv[1:], os.environ)
    st.caption(f"Database: `{safe_url(db)}` (set with `-- --db URL` or ${queries.DB_ENV_VAR})")

    try:
        runs = _runs(db)
    except StoreNotFoundError:
        st.info(f"No database yet at `{safe_url(db)}`. Run a benchmark first, e.g. "
                "`python evals/ruler.py --num-samples 2`, or point the dashboard at another store "
                "with `streamlit run dashboard/app.py -- --db URL`.")
        st.stop()
    except StoreError as e:
        st.warning(f"Cannot read the result store: {e}")
        st.stop()
    if runs.empty:
        st.info(f"No runs in `{safe_url(db)}` yet. Run a benchmark first, e.g. "
                "`python evals/ruler.py --num-samples 2`.")
        st.stop()

    with st.sidebar:
        st.header("Runs")
        benchmarks = sorted(runs["benchmark"].unique())
        chosen_b = st.multiselect("Benchmarks", benchmarks, default=benchmarks)
        pool = runs[runs["benchmark"].isin(chosen_b)]
        labels = {r.run_id: f"{r.run_id} · {r.model} · {r.status} · {r.num_results} rows"
                  for r in pool.itertuples()}
        chosen = st.multiselect("Runs (rows of the same benchmark/task/model/method are pooled)",
                                list(labels), default=list(labels), format_func=labels.get)
    if not chosen:
        st.info("Select at least one run in the sidebar.")
        st.stop()

    report = _report(db, tuple(chosen))
    if report.empty:
        st.info("The selected runs have no results yet (a run in progress writes as each shard finishes).")
        _roofline_section(db, tuple(chosen))
        st.stop()

    st.subheader("Report")
    st.caption("score: mean per-sample official score in [0, 1]. speedup: median over samples of the paired "
               "TPOT ratio ar / method (same worker, interleaved). alpha, tau, mean_k, gamma: pooled over "
               "samples. lossless_rate: share of conclusive greedy samples token-identical to ar.")
    st.dataframe(report, hide_index=True)

    df = _facet_label(report)
    left, right = st.columns(2)
    with left:
        st.plotly_chart(_bar(df.dropna(subset=["speedup"]), "speedup", "Speedup vs ar (median, paired)",
                             reference=1.0), key="speedup_chart")
    with right:
        spec = df[(df["method"] != "ar")].dropna(subset=["alpha"])
        if spec.empty:
            st.info("No speculative method has drafted tokens yet: no acceptance to show.")
        else:
            st.plotly_chart(_bar(spec, "alpha", "Acceptance alpha (pooled)"), key="alpha_chart")

    st.subheader("Ledger: predicted vs measured speedup")
    st.latex(r"S(k) = \frac{\alpha k + 1}{k \gamma + 1},\quad k = \text{mean } k,\ "
             r"\gamma = \frac{\text{draft time per draft forward}}{\text{verify time per step}}")
    ledger = queries.ledger_frame(report)
    if ledger.empty:
        st.info("Only ar in the selected runs: nothing to predict.")
    else:
        st.dataframe(ledger, hide_index=True)
        long = ledger.melt(id_vars=["task", "method"], value_vars=["predicted_speedup", "speedup"],
                           var_name="kind", value_name="S").dropna(subset=["S"])
        if not long.empty:
            fig = px.bar(long, x="method", y="S", color="kind", barmode="group", facet_col="task",
                         facet_col_wrap=4, title="Predicted (ledger) vs measured speedup")
            fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
            st.plotly_chart(fig, key="ledger_chart")

    st.subheader("Runs")
    st.dataframe(runs[runs["run_id"].isin(chosen)], hide_index=True)

    st.subheader("Per-sample results")
    run_id = st.selectbox("Run", chosen, format_func=labels.get)
    samples = _samples(db, run_id)
    if samples.empty:
        st.info("No results for this run yet.")
    else:
        st.dataframe(samples, hide_index=True)

    _roofline_section(db, tuple(chosen))


main()
