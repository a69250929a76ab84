"""Quality gates: a method ships for a setting only when correctness, quality, latency and capacity all pass."""
from __future__ import annotations

import streamlit as st

from cluster.results.aggregate import GATES, GateThresholds
from dashboard import common
from dashboard import queries as dq

_, _, rows = common.spec_rows_or_stop("Quality gates")

d = GateThresholds()
with st.expander("Thresholds (editable)", expanded=True):
    c1, c2, c3, c4 = st.columns(4)
    with c1:
        st.markdown("**Correctness**")
        lossless = st.number_input("min greedy lossless rate", 0.0, 1.0, d.min_lossless_rate, 0.01, key="g_lossless")
    with c2:
        st.markdown("**Quality**")
        drop = st.number_input("max score drop vs ar (x100)", 0.0, 100.0, 100 * d.max_score_drop, 0.5, key="g_drop")
    with c3:
        st.markdown("**Latency**")
        speed = st.number_input("min TPOT speedup", 0.0, 10.0, d.min_speedup, 0.05, key="g_speed")
        itl = st.number_input("max P95 inter-token gap / ar", 0.0, 20.0, d.max_itl_ratio, 0.1, key="g_itl")
    with c4:
        st.markdown("**Capacity**")
        mem = st.number_input("max peak memory / ar", 0.0, 10.0, d.max_mem_ratio, 0.05, key="g_mem")
        kv = st.number_input("max KV bytes / ar", 0.0, 10.0, d.max_kv_ratio, 0.05, key="g_kv")
        thr = st.number_input("min decode throughput / ar", 0.0, 10.0, d.min_throughput_ratio, 0.05, key="g_thr")
t = GateThresholds(min_lossless_rate=lossless, max_score_drop=drop / 100.0, min_speedup=speed, max_itl_ratio=itl,
                   max_mem_ratio=mem, max_kv_ratio=kv, min_throughput_ratio=thr)
st.caption("Per setting (benchmark, model, context length, batch size, method; the benchmark's tasks pooled). "
           "Correctness: greedy outputs token-identical to ar over the conclusive samples (a sample that drafted "
           "nothing is inconclusive; sampling runs are checked by the distribution tests, here they count as no "
           "data). Quality: mean paired score delta vs ar. Latency: median paired TPOT speedup and the median "
           "request's P95 inter-token gap vs ar's. Capacity: peak memory and KV bytes vs ar, decode throughput "
           "vs ar at the setting's batch size. No data counts as not passed.")
gates = dq.gates_frame(rows, t)
n_pass = int(gates["passed"].sum())
st.metric("Settings passing all four gates", f"{n_pass} / {len(gates)}")
shown = gates.copy()
for g in (*GATES, "passed"):
    shown[g] = shown[g].map(lambda v: "pass" if v is True else "FAIL" if v is False else "no data")


def _color(v: str) -> str:
    return {"pass": "background-color: #d4edda", "FAIL": "background-color: #f8d7da"}.get(v, "background-color: #fff3cd")


st.dataframe(shown.style.map(_color, subset=[*GATES, "passed"]), hide_index=True, height=min(800, 35 * (len(shown) + 1) + 3))
common.download(gates, "gates")
