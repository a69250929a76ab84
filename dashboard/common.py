"""What every dashboard page shares: the database URL, the cached loads, the sidebar filters,
the empty-state messages and the CSV download. Numbers come from ``cluster.results.aggregate`` through
``dashboard.queries``; the pages only lay them out."""
from __future__ import annotations

import os
import sys

import pandas as pd
import streamlit as st

from cluster.results.store import StoreError, StoreNotFoundError, safe_url
from dashboard import queries

#: The sweep that fills an empty store, shown wherever a page has nothing to show.
HOW_TO_FILL = ("Run `make demo` (the sweep `configs/demo.yaml`), or any sweep: "
               "`python -m cluster.sweep configs/cpu_two_models.yaml --db URL`.")


def db_url() -> str:
    return queries.resolve_db_url(sys.argv[1:], os.environ)


@st.cache_data(ttl=15, show_spinner=False)
def load(db: str) -> queries.Data:
    return queries.load(db)


def data_or_stop() -> queries.Data:
    """The store's rows; a missing or unreadable store stops the page with a sentence, never a
    stack trace."""
    db = db_url()
    st.caption(f"Database: `{safe_url(db)}` (set with `streamlit run dashboard/app.py -- --db URL` "
               f"or ${queries.DB_ENV_VAR})")
    try:
        return load(db)
    except StoreNotFoundError:
        st.info(f"No database yet at `{safe_url(db)}`. {HOW_TO_FILL}")
        st.stop()
    except StoreError as e:
        st.warning(f"Cannot read the result store: {e}")
        st.stop()
    raise AssertionError("unreachable")


def spec_rows_or_stop(title: str) -> tuple[queries.Data, queries.Filters, list]:
    """A results page's start: its title, the store, the sidebar filters and the filtered rows;
    without a speculative row the page says why and stops."""
    st.title(title)
    data = data_or_stop()
    f = sidebar_filters(data)
    rows = queries.filtered(data, f)
    if not any(r["method"] != "ar" for r in rows):
        no_results(data)
        st.stop()
    return data, f, rows


def _multi(label: str, values: list, key: str) -> list | None:
    if not values:
        return None
    shown = [("-" if v is None else v) for v in values]
    picked = st.multiselect(label, shown, default=shown, key=key)
    if len(picked) == len(shown):
        return None
    return [None if p == "-" else p for p in picked]


def sidebar_filters(data: queries.Data) -> queries.Filters:
    """Run, benchmark, task, model, method, batch size and context length, from what is stored."""
    opts = queries.filter_options(data)
    if not data.results:  # runs without results yet (e.g. in progress): filter on their cells
        cells = [{"benchmark": r["benchmark"], "model": r["model"], "batch_size": (r.get("config") or {}).get(
            "batch_size"), "context_length": (r.get("config") or {}).get("context_length")} for r in data.runs]
        for key in ("benchmark", "model", "batch_size", "context_length"):
            opts[key] = sorted({c[key] for c in cells}, key=lambda v: (v is not None, v if v is not None else 0))
    with st.sidebar:
        st.header("Filters")
        labels = {r["run_id"]: f"{r['run_id']} · {r['status']}" for r in data.runs}
        runs = st.multiselect("Runs", list(labels), default=list(labels), format_func=labels.get, key="f_runs")
        f = queries.Filters(
            run_ids=None if len(runs) == len(labels) else tuple(runs),
            benchmarks=_tuple(_multi("Benchmark", opts["benchmark"], "f_benchmark")),
            tasks=_tuple(_multi("Task", opts["task"], "f_task")),
            models=_tuple(_multi("Model", opts["model"], "f_model")),
            methods=_tuple(_multi("Method", opts["method"], "f_method")),
            batch_sizes=_tuple(_multi("Batch size", opts["batch_size"], "f_batch")),
            context_lengths=_tuple(_multi("Context length", opts["context_length"], "f_context")),
        )
    return f


def _tuple(v: list | None) -> tuple | None:
    return None if v is None else tuple(v)


def download(df: pd.DataFrame, name: str, label: str = "Download CSV") -> None:
    """A CSV download of exactly what the page shows."""
    st.download_button(label, df.to_csv(index=False).encode(), file_name=f"{name}.csv", mime="text/csv",
                       key=f"dl_{name}")


def no_results(data: queries.Data) -> None:
    """The sentence for a page without result rows: empty store, runs in progress, failed shards."""
    if not data.runs:
        st.info(f"No runs in this database yet. {HOW_TO_FILL}")
        return
    running = [r["run_id"] for r in data.runs if r["status"] == "running"]
    failed = [s for s in data.shards if s["status"] == "failed"]
    msg = "No results match the filters."
    if not data.results:
        msg = "No results stored yet."
    if running:
        msg += f" {len(running)} run(s) still running (results appear as each shard finishes)."
    if failed:
        msg += f" {len(failed)} shard(s) failed: see the Runs page for the errors."
    st.info(f"{msg} {HOW_TO_FILL}" if not data.results else msg)
