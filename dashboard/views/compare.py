"""Compare: where each method pays, as a map over context length x batch size."""
from __future__ import annotations

import plotly.express as px
import streamlit as st

from dashboard import common
from dashboard import queries as dq

_, _, rows = common.spec_rows_or_stop("Compare: where speculation pays")

st.caption("Paired speedup = median over batches of TPOT_ar / TPOT_method, both decoded from the same "
           "samples in the same worker (prefill excluded). The selected benchmarks and tasks are pooled "
           "per cell; 1.0 = as fast as ar. A fixed draft length shows as its own method (`k=4`).")
cells = dq.speedup_map(rows)
spec = cells[cells["method"] != "ar"].dropna(subset=["speedup"])
if spec.empty:
    st.info("The speculative rows have no paired ar batch yet (a cell in progress).")
    st.stop()

spec = spec.assign(context=spec["context_length"].map(lambda v: "default" if v is None or v != v else str(int(v))),
                   batch=dq.batch_labels(spec))


def _ctx_order(values) -> list[str]:
    return sorted(set(values), key=lambda s: (s != "default", int(s) if s.isdigit() else 0))


ctx_order = _ctx_order(spec["context"])
batch_order = dq.batch_order(spec["batch"])
for model in sorted(spec["model"].unique()):
    st.subheader(f"Paired speedup vs ar · {model}")
    m = spec[spec["model"] == model]
    m_ctx, m_batch = _ctx_order(m["context"]), dq.batch_order(m["batch"])
    variants = sorted(m["variant"].unique())
    cols = st.columns(min(3, len(variants)))
    for i, v in enumerate(variants):
        grid = (m[m["variant"] == v].pivot_table(index="batch", columns="context", values="speedup", aggfunc="first")
                .reindex(index=m_batch, columns=m_ctx))
        fig = px.imshow(grid, text_auto=".2f", aspect="auto", color_continuous_scale="RdBu", zmin=0, zmax=2,
                        origin="lower", labels=dict(x="context length (tokens)", y="batch size", color="speedup"),
                        title=v)
        fig.update_layout(margin=dict(t=40, b=10, l=10, r=10), height=300)
        fig.update_xaxes(type="category")
        fig.update_yaxes(type="category")
        cols[i % len(cols)].plotly_chart(fig, key=f"heat_{model}_{v}")

best = dq.best_frame(rows)
st.subheader("Best method per cell")
st.caption("The fastest lossless method by median paired speedup; `ar` where no method beats 1.0.")
b = best.assign(context=best["context_length"].map(lambda v: "default" if v is None or v != v else str(int(v))),
                batch=dq.batch_labels(best))
b = b.assign(model=[m if q in (None, "none") else f"{m} [{q} target]" for m, q in zip(b["model"], b["quantize"])])
for model in sorted(b["model"].unique()):
    bm = b[b["model"] == model]
    order = dict(index=dq.batch_order(bm["batch"]), columns=_ctx_order(bm["context"]))
    label = bm.pivot_table(index="batch", columns="context", values="best", aggfunc="first").reindex(**order)
    value = bm.pivot_table(index="batch", columns="context", values="speedup", aggfunc="first").reindex(**order)
    text = label.where(label.notna(), "") + value.map(lambda v: "" if v != v else f"<br>{v:.2f}x")
    fig = px.imshow(value, aspect="auto", color_continuous_scale="Greens", origin="lower", zmin=1,
                    zmax=max(1.5, float(value.max().max())),
                    labels=dict(x="context length (tokens)", y="batch size", color="speedup"), title=model)
    fig.update_traces(text=text.values, texttemplate="%{text}")
    fig.update_layout(margin=dict(t=40, b=10), height=300)
    fig.update_xaxes(type="category")
    fig.update_yaxes(type="category")
    st.plotly_chart(fig, key=f"best_{model}")
st.dataframe(best, hide_index=True)
common.download(best, "best_per_cell", "Download best-per-cell CSV")

left, right = st.columns(2)
with left:
    fig = px.line(spec.sort_values("context_length"), x="context", y="speedup", color="variant",
                  line_dash="model", facet_col="batch", markers=True, title="Speedup vs context length (facet: batch size)",
                  category_orders={"context": ctx_order, "batch": batch_order},
                  hover_data=["model", "n_pairs", "alpha", "mean_k"])
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    fig.update_xaxes(type="category")
    st.plotly_chart(fig, key="vs_context")
with right:
    fig = px.line(spec.sort_values("batch_size"), x="batch", y="speedup", color="variant", line_dash="model",
                  facet_col="context",
                  markers=True, title="Speedup vs batch size (facet: context length)",
                  category_orders={"context": ctx_order, "batch": batch_order},
                  hover_data=["model", "n_pairs", "alpha", "mean_k"])
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    fig.update_xaxes(type="category")
    st.plotly_chart(fig, key="vs_batch")

st.subheader("Quantisation x speculation")
four = dq.four_way_frame(rows)
if four.empty:
    st.info("No setting in the selection has both a full-precision and an int8-target run. Run a sweep with "
            "`quantize: [none, int8]` (or `--quantize none,int8`) for the four-way table: baseline (full-precision "
            "ar), quantisation only, speculation only, both.")
else:
    st.caption("Speed and quality relative to the full-precision `ar` (the baseline) on the same samples. A quantised "
               "target is a new model: its `ar` is not lossless against the baseline (`same tokens as baseline` says "
               "how often it matches); speculation on it is lossless against its own `ar`. The quantised arms are "
               "paired with the baseline across two runs (same batches, decoded one after the other).")
    f4 = four.assign(setting=four["model"] + " · " + four["benchmark"] + " · L=" + four["context_length"].astype(str)
                     + " · B=" + four["batch_size"].astype(str) + " · " + four["speculation"])
    fig = px.bar(f4, x="setting", y="speedup", color="arm", barmode="group", hover_data=["variant", "n_pairs",
                 "score_delta", "lossless_rate", "lossless_against", "agreement_with_baseline"],
                 category_orders={"arm": list(dq.FOUR_WAY_ARMS)}, title="Speedup vs the full-precision ar")
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    st.plotly_chart(fig, key="four_way")
    st.dataframe(four, hide_index=True)
    common.download(four, "four_way", "Download the four-way CSV")

st.subheader("Score vs ar")
st.caption("Score delta = mean over paired samples of (method score - ar score), in score points x100. "
           "Greedy lossless methods give 0; a sampling run's delta is its quality cost.")
per_task = dq.cells_frame(rows)
q = per_task[per_task["method"] != "ar"].dropna(subset=["score_delta"])
if q.empty:
    st.info("No scored paired samples in the selection.")
else:
    q = q.assign(score_delta_x100=100 * q["score_delta"], setting=q["benchmark"] + "/" + q["task"])
    fig = px.bar(q, x="setting", y="score_delta_x100", color="variant", barmode="group",
                 hover_data=["context_length", "batch_size", "n", "score", "score_ar"],
                 title="Score delta vs ar (x100)")
    st.plotly_chart(fig, key="score_delta")

st.subheader("Cells")
shown = per_task[[c for c in ("benchmark", "task", "model", "context_length", "batch_size", "variant", "n", "n_pairs",
                              "score", "score_delta", "speedup", "ci_low", "ci_high", "speedup_total", "alpha", "tau",
                              "mean_k", "gamma", "lossless_rate", "tpot_p50_s", "ttft_p50_s", "throughput")]]
st.dataframe(shown, hide_index=True)
common.download(shown, "cells")
