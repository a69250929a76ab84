"""Runs: what ran, what is running, what failed, and on what."""
from __future__ import annotations

import streamlit as st

from dashboard import common
from dashboard import queries as dq

st.title("Runs")
data = common.data_or_stop()
if not data.runs:
    common.no_results(data)
    st.stop()
f = common.sidebar_filters(data)
runs = dq.runs_frame(data)
runs = runs[[f.keep_run(r) for r in runs.to_dict("records")]]
if runs.empty:
    st.info("No run matches the filters.")
    st.stop()
failed = runs[runs["shards_failed"] > 0]
if not failed.empty:
    st.warning(f"{len(failed)} run(s) have failed shards: " + ", ".join(failed["run_id"])
               + ". Rerunning the same sweep retries them (done shards are skipped).")
st.dataframe(runs, hide_index=True)
common.download(runs, "runs")

labels = {r["run_id"]: f"{r['run_id']} · {r['status']}" for r in data.runs if r["run_id"] in set(runs["run_id"])}
run_id = st.selectbox("Run", list(labels), format_func=labels.get, key="runs_pick")
st.subheader("Shards")
shards = dq.shards_frame(data, [run_id])
if shards.empty:
    st.info("No shards recorded for this run (results written directly, e.g. by evals/*.py).")
else:
    st.dataframe(shards, hide_index=True)
    common.download(shards, f"shards_{run_id}", "Download shards CSV")

run = next(r for r in data.runs if r["run_id"] == run_id)
left, right = st.columns(2)
with left:
    st.subheader("Configuration")
    st.json(run.get("config") or {}, expanded=False)
with right:
    st.subheader("Provenance")
    st.json(run.get("host") or {}, expanded=False)
if run.get("events"):
    st.subheader("Events")
    st.dataframe(run["events"], hide_index=True)

st.subheader("Per-sample results")
samples = dq.sample_rows(data, run_id)
if samples.empty:
    st.info("No results for this run yet.")
else:
    st.dataframe(samples, hide_index=True)
    common.download(samples, f"samples_{run_id}", "Download samples CSV")

roof = dq.roofline_frame(common.db_url(), [run_id])
if not roof.empty:
    st.subheader("Roofline")
    st.caption("cluster.speed.measure step timings (ms) against their floors: max(bytes / measured read bandwidth, "
               "FLOPs / measured GEMM rate); x_roofline = measured / floor.")
    st.dataframe(roof, hide_index=True)
