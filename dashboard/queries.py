"""Pure query functions over the result store, returning pandas DataFrames (no Streamlit here).

Every function takes a database URL and opens the store read-only (``create=False``): a missing
SQLite file raises ``cluster.results.store.StoreNotFoundError``; an empty store gives empty frames with
the documented columns, so callers can test ``df.empty``.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from cluster.results.report import tpot
from cluster.results import aggregate as cq
from cluster.results.store import DEFAULT_DB_URL, open_store
from sparsespec.roofline import max_speedup, x_roofline
from sparsespec.stats import derive

#: Environment variable naming the store the dashboard reads.
DB_ENV_VAR = "SPARSESPEC_DB"

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


def sample_rows(data: "Data", run_id: str) -> pd.DataFrame:
    """Per-sample rows of one run (from already loaded rows), with per-sample TPOT and the
    paired ratio against ar."""
    return _sample_frame([r for r in data.results if r["run_id"] == run_id])


def _sample_frame(results: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
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
    """The stored ``cluster.speed.measure`` step rows (``kind == "steps"``) against their rooflines:
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


# --------------------------------------------------------------------------- the pages' data
@dataclass(frozen=True)
class Data:
    """Everything the pages read, loaded once per refresh: result rows (with their run's
    context length, batch size and sampling temperature), runs, shards, per-step acceptance,
    Serve requests and bench rows (plain dicts, as the store returns them)."""

    results: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    shards: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    serve_requests: list[dict[str, Any]] = field(default_factory=list)


def load(db_url: str = DEFAULT_DB_URL) -> Data:
    """Read the store at ``db_url`` (read-only; StoreNotFoundError for a missing SQLite file)."""
    with open_store(db_url, create=False) as store:
        runs = store.runs()
        steps = store.acceptance_steps() if hasattr(store, "acceptance_steps") else []
        return Data(results=cq.with_run_fields(store.results(), runs), runs=runs, shards=store.shards(),
                    steps=steps, serve_requests=store.serve_requests())


@dataclass(frozen=True)
class Filters:
    """The sidebar's choices: None = no restriction on that key; values are the stored strings."""

    run_ids: tuple[str, ...] | None = None
    benchmarks: tuple[str, ...] | None = None
    tasks: tuple[str, ...] | None = None
    models: tuple[str, ...] | None = None
    methods: tuple[str, ...] | None = None
    batch_sizes: tuple[int, ...] | None = None
    context_lengths: tuple[int | None, ...] | None = None

    _KEYS = (("run_ids", "run_id"), ("benchmarks", "benchmark"), ("tasks", "task"), ("models", "model"),
             ("methods", "method"), ("batch_sizes", "batch_size"), ("context_lengths", "context_length"))

    def keep(self, row: Mapping[str, Any], *, keep_ar: bool = True) -> bool:
        """Whether a result (or acceptance-step) row passes; ``ar`` rows pass the method filter
        when ``keep_ar`` (every speedup needs its reference)."""
        for attr, key in self._KEYS:
            allowed = getattr(self, attr)
            if allowed is None:
                continue
            if key == "method" and keep_ar and row.get("method") == cq.AR:
                continue
            if row.get(key) not in allowed:
                return False
        return True


    def keep_run(self, run: Mapping[str, Any]) -> bool:
        """Whether a ``runs_frame`` row passes: its run id, benchmark, model and cell (context,
        batch) are allowed, and it ran at least one allowed method (tasks are not a run's key)."""
        for attr, key in self._KEYS:
            allowed = getattr(self, attr)
            if allowed is None or key == "task":
                continue
            if key == "method":
                if not set(str(run.get("methods") or "").split(", ")) & set(allowed):
                    return False
            elif run.get(key) not in allowed:
                return False
        return True


def filter_options(data: Data) -> dict[str, list]:
    """The distinct stored values of each filter key (sorted; None, the benchmark default, first)."""
    out = {}
    for key in ("benchmark", "task", "model", "method", "batch_size", "context_length"):
        vals = {r.get(key) for r in data.results}
        out[key] = sorted(vals, key=lambda v: (v is not None, v if v is not None else 0))
    return out


def filtered(data: Data, f: Filters) -> list[dict[str, Any]]:
    return [r for r in data.results if f.keep(r)]


def cells_frame(rows: Sequence[Mapping[str, Any]], by: Sequence[str] = cq.CELL_KEYS) -> pd.DataFrame:
    """``cluster.results.aggregate.cell_table`` as a frame (``k`` as text, so "auto" and 4 share a column)."""
    return _k_text(pd.DataFrame(cq.cell_table(rows, by=by)))


#: A map cell: a (model, target weights, context, batch, queue) and a method variant (k, draft weights, options).
MAP_KEYS = ("model", "quantize", "context_length", "batch_size", "queue_depth", "method", "k", "draft_weights",
            "options")


def speedup_map(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Speedup per (model, target, variant, context, batch), the selected benchmarks and tasks
    pooled; each method against the ar of its own target."""
    return cells_frame(rows, by=MAP_KEYS)


def best_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The fastest lossless variant per (model, target, context, batch) against that target's ar."""
    cells = cq.cell_table(rows, by=MAP_KEYS)
    setting = ("model", "quantize", "context_length", "batch_size", "queue_depth")
    return pd.DataFrame(cq.best_per_cell(cells, setting), columns=[*setting, "best", "speedup", "runner_up"])


def batch_labels(frame: pd.DataFrame) -> list[str]:
    """A frame's ``batch_size`` / ``queue_depth`` as the maps' row labels
    (``cluster.results.aggregate.batch_label``: "4", "4 (queue 16)")."""
    q = frame["queue_depth"] if "queue_depth" in frame else [1] * len(frame)
    return [cq.batch_label(int(b), None if v != v else v) for b, v in zip(frame["batch_size"], q)]


def batch_order(labels) -> list[str]:
    """``batch_labels`` in order: by batch size, then static before queued."""
    return sorted(set(labels), key=lambda s: (int(s.split()[0]), len(s), s))


FOUR_WAY_COLUMNS = list(cq.FOUR_WAY_KEYS)
FOUR_WAY_ARMS = cq.FOUR_WAY_ARMS


def four_way_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """``cluster.results.aggregate.four_way``: baseline, quantisation only, speculation only, both."""
    return pd.DataFrame(cq.four_way(rows), columns=FOUR_WAY_COLUMNS)


LEDGER_PAGE_COLUMNS = ["benchmark", "task", "model", "context_length", "batch_size", "queue_depth", "variant", "n",
                       "alpha",
                       "mean_k", "gamma", "tau", "predicted_speedup", "straggle", "batch_predicted_speedup",
                       "predicted_speedup_round", "speedup",
                       "speedup_total", "draft_forwards_per_round", "c_draft", "c_verify", "c_other", "gap"]


def ledger_page_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Per speculative cell: the ledger's three numbers, both predictions next to the measured
    speedup, the static batch's ``straggle`` and the batch ledger (``batch_predicted_speedup``),
    and the round costs that explain the gap (``gap`` = measured / ledger - 1)."""
    df = cells_frame(rows)
    if df.empty:
        return pd.DataFrame(columns=LEDGER_PAGE_COLUMNS)
    df = df[df["method"] != cq.AR].copy()
    df["gap"] = [(m / p - 1.0) if (p and m is not None and not pd.isna(m)) else None
                 for m, p in zip(df["speedup"], df["predicted_speedup"])]
    return df.reindex(columns=LEDGER_PAGE_COLUMNS)


def s_vs_k_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """``cluster.results.aggregate.s_vs_k`` per setting (benchmark, task, model, context, batch, method)
    that has at least two fixed-k cells."""
    cells = cq.cell_table(rows)
    setting = [k for k in cq.CELL_KEYS if k != "k"]  # one curve per setting, draft weights included
    groups: dict[tuple, list] = {}
    for c in cells:
        if c["method"] != cq.AR:
            groups.setdefault(tuple(c[k] for k in setting), []).append(c)
    out = []
    for key, cs in groups.items():
        pts = cq.s_vs_k(cs)
        if len(pts) >= 2:
            out.extend({**dict(zip(setting, key)), **p} for p in pts)
    return pd.DataFrame(out, columns=[*setting, "k", "variant", "speedup", "predicted_speedup", "alpha",
                                      "gamma", "expected_accepted", "marginal_acceptance", "inversion"])


def acceptance_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Acceptance by draft position per method variant (speculative rows only)."""
    by: dict[str, list] = {}
    for r in rows:
        if r["method"] != cq.AR:
            by.setdefault(cq.variant(r["method"], cq.run_k(r), cq.run_draft_weights(r), r.get("quantize")),
                          []).append(r)
    out = [{"variant": v, **p} for v, rs in sorted(by.items()) for p in cq.acceptance_by_position(rs)]
    return pd.DataFrame(out, columns=["variant", "position", "drafted", "reached", "accepted", "rate", "conditional"])


def k_trace_frame(data: Data, f: Filters) -> pd.DataFrame:
    steps = [s for s in data.steps if f.keep(s, keep_ar=False)]
    return pd.DataFrame(cq.k_trace(steps), columns=["run_id", "task", "sample_id", "method", "context_length",
                                                    "batch_size", "step", "k", "accepted", "mean_k_so_far"])


def _k_text(df: pd.DataFrame) -> pd.DataFrame:
    """``k`` as text ("auto", "4", None), so Arrow sees one type in the column."""
    if not df.empty and "k" in df:
        df["k"] = df["k"].map(lambda v: None if v is None or (isinstance(v, float) and v != v) else str(v))
    return df


def gates_frame(rows: Sequence[Mapping[str, Any]], thresholds: cq.GateThresholds) -> pd.DataFrame:
    return _k_text(pd.DataFrame(cq.gates_table(rows, thresholds),
                        columns=[*cq.SETTING_KEYS, "variant", "n", *cq.GATES, "passed", "lossless_rate", "n_conclusive",
                                 "n_sampling", "score_delta", "speedup", "itl_p95_ratio", "mem_ratio", "kv_ratio",
                                 "throughput_ratio", "reason"]))


def experiments(data: Data) -> list[str]:
    return sorted({q["experiment"] for q in data.serve_requests})


def runs_frame(data: Data) -> pd.DataFrame:
    return pd.DataFrame(cq.run_rows(data.runs, data.shards))


SHARD_COLUMNS = ["run_id", "key", "task", "status", "attempts", "error", "worker", "wall_s", "started_at",
                 "finished_at"]


def shards_frame(data: Data, run_ids: Sequence[str] | None = None) -> pd.DataFrame:
    rows = [{**{k: s.get(k) for k in SHARD_COLUMNS}, "worker": str(s.get("worker") or "")}
            for s in data.shards if run_ids is None or s["run_id"] in run_ids]
    return pd.DataFrame(rows, columns=SHARD_COLUMNS)
