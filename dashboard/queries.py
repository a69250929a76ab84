"""Pure query functions over the result store, returning pandas DataFrames (no Streamlit here).

Every function takes a database URL and opens the store read-only (``create=False``): a missing
SQLite file raises ``cluster.store.StoreNotFoundError``; an empty store gives empty frames with
the documented columns, so callers can test ``df.empty``.
"""
from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from cluster.report import (
    EXTRA_KEYS,
    GROUP_KEYS,
    REPORT_KEYS,
    compute_extras,
    compute_report,
    predicted_speedup,
    tpot,
)
from cluster.store import DEFAULT_DB_URL, open_store
from sparsespec.roofline import max_speedup, x_roofline
from sparsespec.stats import derive

#: Environment variable naming the store the dashboard reads.
DB_ENV_VAR = "SPARSESPEC_DB"

RUN_COLUMNS = ["run_id", "benchmark", "model", "methods", "status", "num_results", "created_at",
               "finished_at", "num_events"]
REPORT_COLUMNS = [*REPORT_KEYS, "predicted_speedup", "speedup_total", "tokens_per_s", "ttft_s", "budget_frac"]
LEDGER_COLUMNS = ["benchmark", "task", "model", "context_length", "batch_size", "method", "alpha", "mean_k", "gamma", "predicted_speedup",
                  "speedup", "error"]
ROOFLINE_COLUMNS = ["run_id", "model", "device", "context_len", "batch_size", "k", "n_index",
                    "ar_step_ms", "ar_roofline_ms", "ar_x_roofline",
                    "verify_ms", "verify_roofline_ms", "verify_x_roofline",
                    "draft_step_ms", "draft_roofline_ms", "draft_x_roofline",
                    "gamma", "gamma_roofline", "roofline_max_speedup", "step_max_speedup"]
SAMPLE_COLUMNS = ["task", "sample_id", "method", "score", "lossless", "first_divergence", "num_input_tokens",
                  "num_output_tokens", "tpot_ms", "speedup_vs_ar", "alpha", "tau", "mean_k", "prefill_s",
                  "prediction", "references"]


def resolve_db_url(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """``--db URL`` (given after ``--`` to ``streamlit run``), else $SPARSESPEC_DB, else the default."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--db", default=None)
    args, _ = p.parse_known_args(list(argv))
    return args.db or environ.get(DB_ENV_VAR) or DEFAULT_DB_URL


def _runs_arg(run_ids: str | Iterable[str] | None) -> list[str] | None:
    if run_ids is None:
        return None
    return [run_ids] if isinstance(run_ids, str) else list(run_ids)


def _results(db_url: str, run_ids: str | Iterable[str] | None) -> list[dict[str, Any]]:
    with open_store(db_url, create=False) as store:
        return store.results(run_ids=_runs_arg(run_ids))


def list_runs(db_url: str = DEFAULT_DB_URL) -> pd.DataFrame:
    """One row per run, newest first."""
    with open_store(db_url, create=False) as store:
        runs = store.runs()
    rows = [{
        "run_id": r["run_id"], "benchmark": r["benchmark"], "model": r["model"],
        "methods": ", ".join(r["methods"]), "status": r["status"], "num_results": r["num_results"],
        "created_at": r["created_at"], "finished_at": r["finished_at"], "num_events": len(r["events"]),
    } for r in runs]
    return pd.DataFrame(rows, columns=RUN_COLUMNS)


def report_frame(db_url: str = DEFAULT_DB_URL, run_ids: str | Iterable[str] | None = None) -> pd.DataFrame:
    """The report (``cluster.report`` keys) plus ledger prediction, total-time speedup, tokens/s."""
    results = _results(db_url, run_ids)
    rep = compute_report(results)
    extras = {tuple(e[k] for k in GROUP_KEYS): e for e in compute_extras(results)}
    rows = []
    for r in rep:
        e = extras[tuple(r[k] for k in GROUP_KEYS)]
        rows.append({**r, **{k: e[k] for k in EXTRA_KEYS if k in REPORT_COLUMNS and k not in r}})
    return pd.DataFrame(rows, columns=REPORT_COLUMNS)


def ledger_frame(report: pd.DataFrame) -> pd.DataFrame:
    """Speculative methods only: predicted S = (alpha*k + 1)/(k*gamma + 1), k = mean_k, vs measured."""
    rows = []
    for r in report.to_dict("records"):
        if r["method"] == "ar":
            continue
        alpha, k, gamma = (None if pd.isna(r[c]) else float(r[c]) for c in ("alpha", "mean_k", "gamma"))
        pred = predicted_speedup(alpha, k, gamma)
        meas = None if pd.isna(r["speedup"]) else float(r["speedup"])
        rows.append({
            "benchmark": r["benchmark"], "task": r["task"], "model": r["model"],
            "context_length": r["context_length"], "batch_size": r["batch_size"], "method": r["method"],
            "alpha": alpha, "mean_k": k, "gamma": gamma, "predicted_speedup": pred, "speedup": meas,
            "error": (meas / pred - 1.0) if (pred and meas is not None) else None,
        })
    return pd.DataFrame(rows, columns=LEDGER_COLUMNS)


def sample_frame(db_url: str, run_id: str) -> pd.DataFrame:
    """Per-sample rows of one run, with per-sample TPOT and the paired ratio against ar."""
    results = _results(db_url, [run_id])
    ar_tpot = {(r["task"], r["sample_id"]): tpot(r["stats"] or {}) for r in results if r["method"] == "ar"}
    rows = []
    for r in results:
        st = r["stats"] or {}
        t = tpot(st)
        a = ar_tpot.get((r["task"], r["sample_id"]))
        d = derive(st)
        rows.append({
            "task": r["task"], "sample_id": r["sample_id"], "method": r["method"], "score": r["score"],
            "lossless": r["lossless"], "first_divergence": r["first_divergence"],
            "num_input_tokens": r["num_input_tokens"], "num_output_tokens": st.get("num_output_tokens"),
            "tpot_ms": None if t is None else 1000.0 * t,
            "speedup_vs_ar": (a / t) if (a is not None and t) else None,
            "alpha": d["alpha"],
            "tau": d["tau"],
            "mean_k": d["mean_k"],
            "prefill_s": st.get("prefill_s"),
            "prediction": r["prediction"], "references": " | ".join(map(str, r["references"] or [])),
        })
    return pd.DataFrame(rows, columns=SAMPLE_COLUMNS)


def _f(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if pd.isna(f) else f


def _ms(v: float | None) -> float | None:
    return None if v is None else 1000.0 * v


def roofline_frame(db_url: str = DEFAULT_DB_URL, run_ids: str | Iterable[str] | None = None) -> pd.DataFrame:
    """The stored ``cluster.bench`` step rows (``kind == "steps"``) against their rooflines:
    the AR, verify (K+1 tokens, importance rows on) and draft step times and their floors (ms),
    each time as a multiple of its floor, gamma (draft / verify) measured and at the floors, and
    the best-case speedup (every draft accepted) at the floors (``roofline_max_speedup``) and at
    the measured step times (``step_max_speedup``). Values a row lacks are derived with
    ``sparsespec.roofline`` (``x_roofline``, ``max_speedup``). Oldest first."""
    wanted = _runs_arg(run_ids)
    with open_store(db_url, create=False) as store:
        rows = [r for r in store.bench_rows() if r.get("kind") == "steps"
                and (wanted is None or r["run_id"] in wanted)]
    out = []
    for r in rows:
        ar, ar_roof = _f(r.get("ar_step_s")), _f(r.get("ar_step_roofline_s"))
        ver, ver_roof = _f(r.get("verify_importance_s")), _f(r.get("verify_roofline_s"))
        dr, dr_roof = _f(r.get("draft_step_s")), _f(r.get("draft_step_roofline_s"))
        k = int(r["k"]) if r.get("k") is not None else None
        roof_max = _f(r.get("roofline_max_speedup"))
        if roof_max is None and k is not None:
            roof_max = max_speedup(k, ar_roof, dr_roof, ver_roof)
        step_max = _f(r.get("step_max_speedup"))
        if step_max is None and k is not None:
            step_max = max_speedup(k, ar, dr, ver)
        out.append({
            "run_id": r["run_id"], "model": r.get("model"), "device": r.get("device"),
            "context_len": r.get("context_len"), "batch_size": r.get("batch_size"), "k": k,
            "n_index": r.get("n_index"),
            "ar_step_ms": _ms(ar), "ar_roofline_ms": _ms(ar_roof), "ar_x_roofline": x_roofline(ar, ar_roof),
            "verify_ms": _ms(ver), "verify_roofline_ms": _ms(ver_roof), "verify_x_roofline": x_roofline(ver, ver_roof),
            "draft_step_ms": _ms(dr), "draft_roofline_ms": _ms(dr_roof), "draft_x_roofline": x_roofline(dr, dr_roof),
            "gamma": (dr / ver) if (dr is not None and ver) else None,
            "gamma_roofline": (dr_roof / ver_roof) if (dr_roof is not None and ver_roof) else None,
            "roofline_max_speedup": roof_max, "step_max_speedup": step_max,
        })
    return pd.DataFrame(out, columns=ROOFLINE_COLUMNS)
