"""Ledger: every speedup explained by alpha, gamma and k, and where the model and the measurement part."""
from __future__ import annotations

import plotly.express as px
import plotly.graph_objects as go
import streamlit as st

from dashboard import common
from dashboard import queries as dq

data, f, rows = common.spec_rows_or_stop("Ledger: why each speedup is what it is")

st.latex(r"S(k) = \frac{\alpha k + 1}{k \gamma + 1} \qquad "
         r"S_{\text{round}} = \frac{\tau\, T_{AR}}{T_{\text{round}}},\quad "
         r"\frac{T_{\text{round}}}{T_{AR}} = f_d\, c_{\text{draft}} + c_{\text{verify}} + c_{\text{other}}")
st.caption("alpha: accepted / drafted tokens; k: mean draft length of drafting steps; gamma: one draft forward's "
           "time / one verify step's. The ledger S assumes a verify costs one AR step and nothing else runs per "
           "round; the full-round model uses the measured costs relative to one AR step (T_AR): f_d draft forwards "
           "per round at c_draft each, the verify (c_verify) and the rest of the round (c_other: sampling, "
           "acceptance, cache and index upkeep). straggle: a static batch decodes until its slowest row is done, so "
           "it keeps mean / max of its rows' rounds (over ar's) of the per-row ledger; batch ledger S = ledger S x "
           "straggle. gap = measured / ledger - 1.")
led = dq.ledger_page_frame(rows)
if led.empty:
    st.info("Only ar in the selection: nothing to predict.")
else:
    st.dataframe(led, hide_index=True)
    common.download(led, "ledger")
    led = led.assign(setting=led["model"] + " · " + led["benchmark"] + "/" + led["task"] + " L="
                     + led["context_length"].astype(str) + " B=" + led["batch_size"].astype(str))
    long = led
    long = long.melt(id_vars=["setting", "variant"],
                     value_vars=["predicted_speedup", "batch_predicted_speedup", "predicted_speedup_round", "speedup"],
                     var_name="kind", value_name="S")
    long = long.dropna(subset=["S"])
    if not long.empty:
        fig = px.bar(long, x="setting", y="S", color="kind", barmode="group", facet_row="variant",
                     title="Ledger (per row and per batch), full-round model and measured speedup",
                     labels={"kind": ""})
        fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
        fig.update_layout(height=max(320, 260 * long["variant"].nunique()))
        st.plotly_chart(fig, key="ledger_bars")
    costs = led.dropna(subset=["c_verify"]).copy()
    if not costs.empty:
        costs["draft"] = costs["draft_forwards_per_round"].fillna(0) * costs["c_draft"].fillna(0)
        costs["label"] = costs["variant"] + " · " + costs["setting"]  # one bar per cell (plotly stacks equal labels)
        fig = go.Figure()
        for col, name in (("draft", "draft forwards"), ("c_verify", "verify"), ("c_other", "other")):
            fig.add_bar(y=costs["label"], x=costs[col], name=name, orientation="h")
        fig.update_layout(barmode="stack", title="One round's cost in AR steps (1.0 = an AR step)",
                          height=max(300, 28 * len(costs) + 120))
        fig.add_vline(x=1.0, line_dash="dot", line_color="grey")
        st.plotly_chart(fig, key="round_costs")

st.subheader("S against k (fixed-k runs)")
svk = dq.s_vs_k_frame(rows)
if svk.empty:
    st.info("No setting has two or more fixed-k runs of one method. Run a sweep with e.g. "
            "`methods: {sparsespec-l: {k: 2}}`, then k: 4 and k: 8, on the same cell.")
else:
    draft = svk["draft_weights"].map(lambda d: " int8-draft" if d == "int8" else "")
    svk = svk.assign(setting=svk["method"] + draft + " · " + svk["model"] + " · " + svk["benchmark"] + "/"
                     + svk["task"] + " L=" + svk["context_length"].astype(str) + " B=" + svk["batch_size"].astype(str))
    fig = go.Figure()
    for setting, g in svk.groupby("setting"):
        fig.add_scatter(x=g["k"], y=g["speedup"], mode="lines+markers", name=f"measured · {setting}")
        fig.add_scatter(x=g["k"], y=g["predicted_speedup"], mode="lines", line=dict(dash="dash"),
                        name=f"ledger · {setting}")
        inv = g[g["inversion"]]
        if not inv.empty:
            fig.add_scatter(x=inv["k"], y=inv["speedup"], mode="markers", marker=dict(size=16, symbol="x"),
                            name=f"inversion · {setting}")
    fig.update_layout(title="Speedup vs k; x = efficiency inversion (marginal acceptance < gamma)",
                      xaxis_title="k (draft tokens per step)", yaxis_title="speedup vs ar")
    st.plotly_chart(fig, key="s_vs_k")
    st.dataframe(svk, hide_index=True)
    common.download(svk, "s_vs_k", "Download S-vs-k CSV")

st.subheader("Acceptance by draft position")
acc = dq.acceptance_frame(rows)
if acc.empty:
    st.info("No drafting step in the selection.")
else:
    st.caption("rate: the share of steps that drafted position i and kept it; conditional: kept given the "
               "tokens before it were kept. Summed from the per-step (k, accepted) histograms.")
    fig = px.bar(acc, x="position", y="rate", color="variant", barmode="group", hover_data=["drafted", "conditional"],
                 title="Acceptance rate by draft position")
    st.plotly_chart(fig, key="acceptance_position")
    common.download(acc, "acceptance_by_position", "Download acceptance CSV")

st.subheader("The controller's k over a run")
trace = dq.k_trace_frame(data, f)
if trace.empty:
    st.info("No per-step trace stored for the selection (rows written before the trace existed, or ar only).")
else:
    trace = trace.assign(request=trace["run_id"] + "/" + trace["task"] + "/" + trace["sample_id"] + " · "
                         + trace["method"])
    choices = sorted(trace["request"].unique())
    picked = st.multiselect("Requests", choices, default=choices[: min(4, len(choices))], key="trace_requests")
    t = trace[trace["request"].isin(picked)]
    fig = px.line(t, x="step", y="k", color="request", markers=True, line_shape="hv",
                  hover_data=["accepted", "mean_k_so_far"], title="Draft length k per verify step")
    st.plotly_chart(fig, key="k_trace")
    common.download(t, "k_trace", "Download k-trace CSV")
