"""A/B traffic: the Serve endpoint's arms on live requests."""
from __future__ import annotations

import pandas as pd
import plotly.express as px
import streamlit as st

from dashboard import common
from dashboard import queries as dq
from cluster.results import aggregate as cq

st.title("A/B traffic")
data = common.data_or_stop()
exps = dq.experiments(data)
if not exps:
    st.info("No Serve requests stored yet. Start the A/B endpoint with `make serve` (configs/serve.yaml) and "
            "send traffic, e.g. `python -m cluster.serve.loadtest --base-url http://127.0.0.1:8000`.")
    st.stop()
with st.sidebar:
    st.header("A/B")
    exp = st.selectbox("Experiment", exps, key="ab_experiment")
    pool = [q for q in data.serve_requests if q["experiment"] == exp]
    arm_names = sorted({q.get("arm") or "(router)" for q in pool})
    arms_kept = st.multiselect("Arms", arm_names, default=arm_names, key="ab_arms")
    models = sorted({q["model"] for q in pool})
    models_kept = st.multiselect("Model", models, default=models, key="ab_models")
    endpoints = sorted({q["endpoint"] for q in pool})
    endpoints_kept = st.multiselect("Endpoint", endpoints, default=endpoints, key="ab_endpoints")
reqs = [q for q in pool if (q.get("arm") or "(router)") in arms_kept and q["model"] in models_kept
        and q["endpoint"] in endpoints_kept]
if not reqs:
    st.info("No request matches the filters.")
    st.stop()
arms = pd.DataFrame(cq.ab_arms(reqs))
st.caption("Per arm of the experiment: every request the endpoint answered or refused (status != 200 counts as an "
           "error; 499 = the client went away; refused at the router = before an arm was chosen). TPOT = (E2EL - "
           "TTFT) / (output tokens - 1) per request; ITL = the per-request chunk-gap P95/P99 at the median request; "
           "seconds.")
st.dataframe(arms, hide_index=True)
common.download(arms, f"ab_arms_{exp}", "Download per-arm CSV")

st.subheader("TPOT ratio with its confidence interval")
decisions = cq.ab_decisions(reqs)
if not decisions:
    st.info("Only one arm has completed requests: nothing to compare yet.")
for d in decisions:
    st.markdown(f"- {d['conclusion']}")
if decisions:
    dec = pd.DataFrame([{k: d[k] for k in ("baseline", "treatment", "n_baseline", "n_treatment",
                                           "baseline_median_tpot_ms", "treatment_median_tpot_ms", "tpot_ratio",
                                           "significant", "too_small")}
                        | {"ci_low": (d["tpot_ratio_ci"] or [None, None])[0],
                           "ci_high": (d["tpot_ratio_ci"] or [None, None])[1]} for d in decisions])
    fig = px.scatter(dec, x="tpot_ratio", y="treatment", error_x=dec["ci_high"] - dec["tpot_ratio"],
                     error_x_minus=dec["tpot_ratio"] - dec["ci_low"], title="Median TPOT ratio vs the baseline (95% CI)")
    fig.add_vline(x=1.0, line_dash="dot", line_color="grey")
    st.plotly_chart(fig, key="ab_ratio")
    common.download(dec, f"ab_decision_{exp}", "Download decision CSV")

st.subheader("Requests per arm over time")
bucket = st.select_slider("Bucket", options=[10, 30, 60, 300, 900], value=60, format_func=lambda s: f"{s} s",
                          key="ab_bucket")
tl = pd.DataFrame(cq.ab_timeline(reqs, bucket_s=float(bucket)))
if not tl.empty:
    fig = px.bar(tl, x="t", y="requests", color="arm", title="Requests per bucket", hover_data=["errors"])
    st.plotly_chart(fig, key="ab_timeline")

ok = pd.DataFrame([q for q in reqs if q.get("status") == 200 and q.get("arm")])
if not ok.empty:
    ok = ok.assign(tpot_s=(ok["e2el_s"] - ok["ttft_s"]) / (ok["output_tokens"] - 1).where(ok["output_tokens"] > 1))
    left, right = st.columns(2)
    left.plotly_chart(px.box(ok, x="arm", y="ttft_s", points="all", title="TTFT (s)"), key="ab_ttft")
    right.plotly_chart(px.box(ok, x="arm", y="tpot_s", points="all", title="TPOT (s)"), key="ab_tpot")
