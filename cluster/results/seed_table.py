"""The seed's central table in kind: per target and (context, batch), ``ar``, an independent
draft model, MagicDec-SnapKV, EAGLE-3 and SparseSpec-L (``k="auto"`` and every fixed k that
ran), each with alpha, mean k, gamma and the median paired speedup, beside the ledger ``S`` (per
row, and for the batch: times the ``straggle`` of its rows' rounds), the
roofline ``S`` at the measured acceptance and k, and the seed's own figures.

    python -m cluster.results.report --seed-table --db URL

Every number comes from ``cluster.results.aggregate.cell_table`` over the cells pooled across
benchmarks and tasks (keys ``SEED_KEYS``); nothing here derives a ratio of its own except the
roofline ``S`` (``sparsespec.roofline.roofline_speedup`` over the floors of
``sparsespec.roofline.geometry_roofline``):

* the floors use the machine the run's workers measured at start (read bandwidth, GEMM rate)
  and the target's geometry, both stored with the run (``cluster.sweep.worker``);
* AR step: ``batch`` rows, 1 token over the mean context (prompt + half the output);
  verify: ``mean_k + 1`` tokens over it; a draft forward of a self-drafting method over a
  sparse index (``SELF_SPARSE_DRAFT``): 1 token over ``budget_frac`` of it; n-gram: free;
* steps that drafted nothing (an adaptive k chose 0) cost an AR step;
* a draft model or an EAGLE-3 head reads other weights, whose geometry the store does not
  hold: their roofline ``S`` is left empty (``-``), and the table says so.

A method of ``SEED_METHODS`` with no rows for a target is still a row: ``unavailable`` with the
reason the sweep recorded (``sparsespec.MethodUnavailable``: no head, no same-tokenizer pair),
or ``not run`` (the spec did not list it), never a silent gap.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cluster.results.aggregate import batch_label, cell_key, cell_table, unavailable_methods
from sparsespec.registry import AR
from sparsespec.roofline import geometry_roofline, roofline_speedup
from sparsespec.stats import _num, pool

#: The seed's table (Llama-3.1-8B-Instruct, bf16, GPUs, long-context benchmarks): method ->
#: (speedup, alpha, mean k) as the original design quotes them. EAGLE-3's mean k is "~1.1".
SEED: dict[str, tuple[float, float, float]] = {
    "draft-model": (1.22, 0.503, 2.94),
    "magicdec-snapkv": (1.74, 0.801, 1.59),
    "eagle3": (0.89, 0.0195, 1.1),
    "sparsespec-l": (2.79, 0.729, 11.26),
}
#: The seed's rows, in its order; other methods a store holds follow them.
SEED_METHODS = (AR, "draft-model", "magicdec-snapkv", "eagle3", "sparsespec-l")
#: Methods whose draft forward is the target itself over a sparse KV index (its size per step is
#: the stats' ``budget_frac`` of the context).
SELF_SPARSE_DRAFT = ("sparsespec-l", "magicdec-snapkv", "magicdec-streamingllm")
#: Methods that draft without a forward (their draft costs nothing at the roofline).
NO_DRAFT_FORWARD = ("ngram",)
#: The grouping: cells pooled over benchmarks and tasks.
SEED_KEYS = ("model", "quantize", "context_length", "batch_size", "queue_depth", "method", "k", "draft_weights")

SEED_TABLE_KEYS = ("model", "quantize", "context_length", "batch_size", "queue_depth", "method", "k", "status", "n",
                   "n_pairs",
                   "alpha", "mean_k", "gamma", "speedup", "ci_low", "ci_high", "ledger_s", "straggle",
                   "batch_ledger_s", "roofline_s",
                   "lossless_rate", "seed_speedup", "seed_alpha", "seed_mean_k", "note")


def _k_order(k: Any) -> tuple:
    return (0, 0) if k in (None, "auto") else (1, int(k))


def run_floors_inputs(runs: Iterable[Mapping[str, Any]]) -> dict[str, tuple[dict[str, float], dict[str, Any]]]:
    """``{run_id: (machine, geometry)}`` from the worker records stored with each run (the first
    worker that has both); runs without them are left out."""
    out = {}
    for run in runs:
        for w in ((run.get("host") or {}).get("workers") or []):
            if isinstance(w, Mapping) and w.get("machine") and w.get("geometry"):
                out[run["run_id"]] = (dict(w["machine"]), dict(w["geometry"]))
                break
    return out


def cell_roofline_s(method: str, rows: Sequence[Mapping[str, Any]], batch: int,
                    inputs: Mapping[str, tuple[dict[str, float], dict[str, Any]]]) -> float | None:
    """The roofline ``S`` of one cell's rows at their measured tau, mean k and drafting share
    (see the module docstring); None when the floors cannot be derived."""
    if method == AR:
        return 1.0
    ids = {r.get("run_id") for r in rows}
    have = [inputs[i] for i in ids if i in inputs]
    if not have or len(ids) != len(have):
        return None
    machine, geom = have[0]
    p = pool(r.get("stats") or {} for r in rows)
    steps, drafting = p.get("num_steps", 0.0), p.get("num_drafting_steps", 0.0)
    if not steps:
        return None
    tau = p["num_emitted"] / steps
    mean_k = p["num_drafted"] / drafting if drafting else 0.0
    ctx = statistics.fmean(float(r.get("num_input_tokens") or 0) + 0.5 * _num(r.get("stats") or {}, "num_output_tokens")
                           for r in rows)
    ar_s = geometry_roofline(geom, machine, batch, 1, ctx)["roofline_s"]
    verify_s = geometry_roofline(geom, machine, batch, mean_k + 1.0, ctx)["roofline_s"]
    if method in NO_DRAFT_FORWARD:
        draft_s = 0.0
    elif not drafting:  # every step was an AR step
        draft_s = 0.0
    elif method in SELF_SPARSE_DRAFT:
        if not p.get("context_tokens_sum"):
            return None
        budget = p["budget_tokens_sum"] / p["context_tokens_sum"]
        draft_s = geometry_roofline(geom, machine, batch, 1, budget * ctx)["roofline_s"]
    else:
        return None
    return roofline_speedup(tau, mean_k, ar_s, draft_s, verify_s, drafting / steps)


def seed_table(rows: Iterable[Mapping[str, Any]], runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One dict per (target, context, batch, method variant), keys exactly ``SEED_TABLE_KEYS``:
    the seed's methods first (a row with ``status`` ``unavailable`` or ``not run`` and the
    reason in ``note`` where the store has none of its rows), then any other method; within a
    method, ``k="auto"`` first, then the fixed k in order. ``rows``: result rows with their run
    fields (``cluster.results.aggregate.with_run_fields``); ``runs``: the store's runs."""
    rows = [dict(r) for r in rows]
    cells = cell_table(rows, by=SEED_KEYS)
    unavailable = unavailable_methods(runs)
    inputs = run_floors_inputs(runs)
    by_cell: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:  # the rows of each cell, keyed as cell_table grouped them
        by_cell[cell_key(r, SEED_KEYS)].append(r)
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for c in cells:
        groups[(c["model"], c["quantize"], c["context_length"], c["batch_size"], c["queue_depth"])].append(c)
    out = []
    for gkey in sorted(groups, key=lambda g: (str(g[0]), str(g[1]), g[2] or 0, g[3], g[4])):
        model, quantize, ctx, batch, depth = gkey
        present = groups[gkey]
        methods = list(SEED_METHODS) + sorted({c["method"] for c in present} - set(SEED_METHODS))
        for m in methods:
            seed = SEED.get(m, (None, None, None))
            mine = sorted((c for c in present if c["method"] == m), key=lambda c: _k_order(c["k"]))
            base = {"model": model, "quantize": quantize, "context_length": ctx, "batch_size": batch,
                    "queue_depth": depth, "method": m,
                    "seed_speedup": seed[0], "seed_alpha": seed[1], "seed_mean_k": seed[2]}
            if not mine:
                why = unavailable.get((str(model), m))
                out.append({**dict.fromkeys(SEED_TABLE_KEYS), **base,
                            "status": "unavailable" if why else "not run",
                            "note": why or "the store has no run of this method on this target"})
                continue
            for c in mine:
                key = tuple(c[k] for k in SEED_KEYS)
                roof = cell_roofline_s(m, by_cell[key], batch, inputs)
                note = None
                if roof is None and m != AR:
                    note = ("roofline S: the draft reads other weights (not stored)"
                            if m not in SELF_SPARSE_DRAFT + NO_DRAFT_FORWARD
                            else "roofline S: the run stored no machine / geometry")
                out.append({**base, "k": c["k"], "status": "ok", "n": c["n"], "n_pairs": c["n_pairs"],
                            "alpha": c["alpha"], "mean_k": c["mean_k"], "gamma": c["gamma"],
                            "speedup": c["speedup"], "ci_low": c["ci_low"], "ci_high": c["ci_high"],
                            "ledger_s": c["predicted_speedup"], "straggle": c.get("straggle"),
                            "batch_ledger_s": c.get("batch_predicted_speedup"), "roofline_s": roof,
                            "lossless_rate": c["lossless_rate"], "note": note})
    return out


def format_seed_table(table: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one section per target, one table per (context, batch); the seed's figures in
    the last columns."""
    from tabulate import tabulate

    def f(v: Any, d: int = 3) -> str:
        if v is None:
            return "-"
        return f"{v:.{d}f}" if isinstance(v, float) else str(v)

    out: list[str] = []
    sections: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for r in table:
        sections[(r["model"], r["quantize"], r["context_length"], r["batch_size"], r.get("queue_depth"))].append(r)
    for (model, quantize, ctx, batch, depth), rs in sections.items():
        target = model if quantize in (None, "none") else f"{model} [{quantize} target]"
        out.append(f"## {target}, context {ctx}, batch {batch_label(batch, depth)}\n")
        body = []
        for r in rs:
            label = r["method"] if r.get("k") in (None, "auto") or r["method"] == AR else f"{r['method']} k={r['k']}"
            if r["method"] != AR and r.get("k") == "auto":
                label += " (k auto)"
            sp = f(r["speedup"])
            if r.get("ci_low") is not None:
                sp += f" [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"
            seed = ("-" if r["seed_speedup"] is None else
                    f"{r['seed_speedup']:.2f}x / {r['seed_alpha']:g} / {r['seed_mean_k']:g}")
            status = r["status"] if r["status"] != "ok" else ""
            body.append([label, status or f(r["n"]), f(r["n_pairs"]), f(r["alpha"]), f(r["mean_k"], 2), f(r["gamma"]),
                         sp, f(r["ledger_s"]), f(r.get("straggle")), f(r.get("batch_ledger_s")), f(r["roofline_s"]),
                         f(r["lossless_rate"]), seed, r.get("note") or ""])
        out.append(tabulate(body, headers=["method", "n", "pairs", "alpha", "mean k", "gamma",
                                           "speedup (median, 95% CI)", "ledger S", "straggle", "batch ledger S",
                                           "roofline S", "lossless",
                                           "seed: speedup / alpha / mean k", "note"],
                            tablefmt="github", disable_numparse=True))
        out.append("")
    out.append("speedup: median over paired batches of TPOT_ar / TPOT_method (interval: bootstrap, >= 5 pairs); "
               "ledger S = (alpha*k + 1)/(k*gamma + 1) at the measured alpha, mean k, gamma (per row); straggle: "
               "a static batch waits for its slowest row, so it keeps mean / max of its rows' rounds (a queue: its "
               "rows' rounds over its slot-rounds), over ar's, and batch ledger S = ledger S x straggle; "
               "roofline S: what "
               "the step floors (this run's measured bandwidth and GEMM rate) allow at the measured tau and mean k. "
               "The seed's figures are Llama-3.1-8B-Instruct on GPUs at long context, not this target: compare "
               "the ordering and the regime, not the values.")
    return "\n".join(out) + "\n"


__all__ = ["SEED", "SEED_KEYS", "SEED_METHODS", "SEED_TABLE_KEYS", "SELF_SPARSE_DRAFT", "cell_roofline_s",
           "format_seed_table", "run_floors_inputs", "seed_table"]
