"""Streamlit dashboard over the result store (multipage).

    streamlit run dashboard/app.py                          # $SPARSESPEC_DB or sqlite:///results/sparsespec.db
    streamlit run dashboard/app.py -- --db postgresql+psycopg://user@host/db

Pages (``dashboard/views/``; url paths in brackets):

- Compare [compare]: where each method pays: paired speedup heatmaps over context length x batch
  size, the best method per cell, speedup against context and batch, score against ``ar``.
- Ledger [ledger]: alpha, gamma, k, the ledger's and the full-round model's predictions against
  the measured speedup and the round costs that explain the gap; S against k from fixed-k runs
  with the efficiency-inversion point; acceptance by draft position; the controller's k over a run.
- Quality gates [gates]: correctness, quality, latency and capacity per setting, thresholds editable.
- A/B traffic [ab]: the Serve endpoint's arms: requests over time, latency percentiles,
  acceptance, errors, and the TPOT ratio with its confidence interval.
- Runs [runs]: runs and shards (status, attempts, errors), a run's provenance, its per-sample
  rows and (``cluster.speed.measure`` runs) its step times against their rooflines.

Every number comes from ``cluster.results.aggregate`` through ``dashboard.queries`` (pure functions);
the pages only lay them out.
"""
from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `streamlit run dashboard/app.py` puts only dashboard/ on sys.path
    sys.path.insert(0, str(_ROOT))

import streamlit as st  # noqa: E402

from dashboard import PAGES  # noqa: E402

_VIEWS = Path(__file__).resolve().parent / "views"

def main() -> None:
    st.set_page_config(page_title="sparsespec results", layout="wide")
    pages = [st.Page(str(_VIEWS / f), title=t, url_path=u, icon=i, default=(n == 0))
             for n, (f, t, u, i) in enumerate(PAGES)]
    st.navigation(pages).run()


main()
