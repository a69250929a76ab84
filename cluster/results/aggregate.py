"""Pure query functions over stored rows: the numbers the report, the leaderboard and every
dashboard page show (no SQL, no Streamlit, no plotting here).

Inputs are the plain dicts the store returns (``Store.results``, ``Store.acceptance_steps``,
``Store.serve_requests``, ``Store.runs``, ``Store.shards``); outputs are lists of plain dicts.
Every ratio comes from the raw counts and seconds through ``sparsespec.stats`` (``pool`` then
``derive``, ``batch_tpot``): nothing here averages a ratio twice.

A *cell* is one (benchmark, task, model, context_length, batch_size, queue_depth, method, k)
group, where ``k`` is the draft length the method ran with (``"auto"``, an integer, or None for
``ar``): a fixed-k sweep and the adaptive controller are different cells, never pooled together;
nor are static batches (``queue_depth`` 1) and queues (continuous batching) of the same size.

Speedup (``paired_speedup``), as in ``cluster.results.report``: a pair is one batch (same run, same
samples, same worker; a queue's samples under ``queue_depth`` > 1) decoded with ``ar`` and with
the method; the batch TPOT is
``(batch_wall_s - batch_prefill_s) / sum(output tokens - 1)``. ``speedup`` = median over pairs
of ``TPOT_ar / TPOT_method``; ``speedup_total`` = total ar decode time / total method decode
time per decoded token over the same pairs; the 95 % interval is a percentile bootstrap of the
median over pairs (seeded) when there are at least ``MIN_CI_PAIRS`` pairs.
"""
from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from cluster.results.events import UNAVAILABLE_EVENT  # noqa: F401 - re-exported (the reports read it here)
from sparsespec.registry import AR
from sparsespec.stats import (_num, batch_straggle, batch_tpot, bootstrap_means, bootstrap_medians,  # noqa: F401
                              derive, drafting_steps, ledger_speedup, mean_acceptance_length, percentile_ci, pool,
                              request_tpot)

MIN_CI_PAIRS = 5
N_BOOT = 2000

#: Keys of a cell (the grouping of ``cell_table``; dashboard filters use the same strings).
#: ``draft_weights``: what the draft forward read (``"target"``, ``"int8"``; None for ar).
#: ``quantize``: the target's own weights (``"none"``, ``"int8"``): a quantised target is another
#: model, whose ar is the reference of its methods (ar's rows of a cell share its quantize).
#: ``options``: the method's other options in its run (``run_options``; "" for none), so runs of
#: one method that differ in any of them (``budget_frac``, vLLM's suffix cache, ...) are not pooled.
CELL_KEYS = ("benchmark", "task", "model", "quantize", "context_length", "batch_size", "queue_depth", "method",
             "k", "draft_weights", "options")
#: Method options a cell keys on by themselves (``k``, ``draft_weights``), left out of ``options``.
KEYED_OPTIONS = ("k", "draft_weights")


# ``UNAVAILABLE_EVENT`` (``cluster.results.events``): the message prefix of the run event a sweep
# records once per (run, method) that could not run on the run's target here
# (``sparsespec.MethodUnavailable``); the event also carries ``method`` and ``unavailable`` (why).
# ``unavailable_methods`` reads them back.


# --------------------------------------------------------------------------- keys
def unavailable_methods(runs: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], str]:
    """``{(model, method): why}`` from the runs' ``UNAVAILABLE_EVENT`` events (the latest run's
    reason when several runs of a model recorded one)."""
    out: dict[tuple[str, str], str] = {}
    for run in sorted(runs, key=lambda r: str(r.get("created_at") or "")):
        for ev in run.get("events") or []:
            if str(ev.get("message", "")).startswith(UNAVAILABLE_EVENT) and ev.get("method"):
                out[(str(run.get("model")), str(ev["method"]))] = str(ev.get("unavailable") or ev["message"])
    return out


def twin_key(config: Mapping[str, Any] | None) -> str | None:
    """The identity a run shares with its twin on the other target: a digest of its config
    without ``quantize`` (two runs of one sweep that differ only in the target's weights)."""
    if not config:
        return None
    blob = json.dumps({k: v for k, v in config.items() if k != "quantize"}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_options(config: Mapping[str, Any] | None, method: str) -> str:
    """``method``'s own options in a run's config (``config["method_options"][method]``) except
    ``KEYED_OPTIONS``, as canonical JSON; "" when it has none (``ar``) or the config lists none."""
    opts = ((config or {}).get("method_options") or {}).get(method) or {}
    rest = {k: v for k, v in opts.items() if k not in KEYED_OPTIONS}
    return json.dumps(rest, sort_keys=True, default=str) if rest else ""


def with_run_fields(results: Iterable[Mapping[str, Any]], runs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Result rows with their run's sampling ``temperature`` (from the run config; 0 = greedy),
    ``twin`` (``twin_key``: the same for the full-precision and the int8 run of one cell) and
    ``options`` (``run_options`` of the row's method: a cell key)."""
    runs = list(runs)
    temp = {r["run_id"]: float(((r.get("config") or {}).get("sampling") or {}).get("temperature") or 0.0)
            for r in runs}
    twin = {r["run_id"]: twin_key(r.get("config")) for r in runs}
    config = {r["run_id"]: r.get("config") for r in runs}
    return [{**r, "temperature": temp.get(r["run_id"], 0.0), "twin": twin.get(r["run_id"]),
             "options": run_options(config.get(r["run_id"]), r["method"])} for r in results]


def run_k(row: Mapping[str, Any]) -> int | str | None:
    """The draft length a row ran with: an int, ``"auto"``, or None for ``ar``."""
    if row["method"] == AR:
        return None
    k = (row.get("stats") or {}).get("k")
    if k is None:
        return None
    if isinstance(k, str) and not k.lstrip("-").isdigit():
        return k
    return int(k)


def run_draft_weights(row: Mapping[str, Any]) -> str | None:
    """What a row's draft forward read: ``"int8"`` (its stats count a draft weight copy),
    ``"target"``, or None for an engine's plain decoding (``ar``, ``vllm:ar``)."""
    if row["method"] == engine_ar(row["method"]):
        return None
    return "int8" if _num(row.get("stats") or {}, "draft_weight_bytes") > 0 else "target"


def variant(method: str, k: int | str | None, draft_weights: str | None = None, quantize: str | None = None) -> str:
    """A cell's method label: ``sparsespec-l`` (adaptive or unknown k), ``sparsespec-l k=4``,
    ``sparsespec-l k=4 int8-draft``; on a quantised target ``... [int8 target]`` (``ar`` too)."""
    label = method if (k is None or k == "auto" or method == AR) else f"{method} k={k}"
    if draft_weights not in (None, "target") and method != AR:
        label = f"{label} {draft_weights}-draft"
    return label if quantize in (None, "none") else f"{label} [{quantize} target]"


def batch_label(batch_size: int, queue_depth: int | None = 1) -> str:
    """A cell's batching as tables print it: ``"4"`` (static batches of 4) or ``"4 (queue 16)"``
    (4 slots fed from queues of 16 samples, ``cluster.sweep.schema.SweepSpec.queue_depth``)."""
    q = int(queue_depth or 1)
    return f"{batch_size}" if q <= 1 else f"{batch_size} (queue {batch_size * q})"


def cell_key(r: Mapping[str, Any], by: Sequence[str]) -> tuple:
    """A result row's values of the keys ``by`` as ``cell_table`` groups them (``k`` from its
    stats, ``draft_weights``, ``batch_size`` and ``quantize`` with their defaults)."""
    return _cell_key(r, by)


def _cell_key(r: Mapping[str, Any], by: Sequence[str]) -> tuple:
    out = []
    for key in by:
        if key == "k":
            out.append(run_k(r))
        elif key == "draft_weights":
            out.append(run_draft_weights(r))
        elif key in ("batch_size", "queue_depth"):
            out.append(int(r.get(key) or 1))
        elif key == "quantize":
            out.append(str(r.get("quantize") or "none"))
        elif key == "options":
            out.append(str(r.get("options") or ""))
        else:
            out.append(r.get(key))
    return tuple(out)


def _sort_value(v: Any) -> tuple:
    return (0, -1, "") if v is None else (1, v, "") if isinstance(v, (int, float)) else (2, 0, str(v))


def _batch_key(r: Mapping[str, Any]) -> tuple[str, str]:
    st = r.get("stats") or {}
    return (r["run_id"], str(st.get("batch_key") or f"{r['task']}/{r['sample_id']}"))


def _pair_key(r: Mapping[str, Any]) -> tuple:
    return (r["run_id"], r["benchmark"], r["task"], r["model"], str(r["sample_id"]))


# --------------------------------------------------------------------------- speedup
def shared_batch_key(r: Mapping[str, Any]) -> tuple:
    """A batch's identity across runs: the same samples of the same task at the same context,
    batch size and repetition (its shard key without the run id). Two runs of one sweep that
    differ only in the target's quantisation decode the same batches under these keys."""
    run_id, key = _batch_key(r)
    tail = key.split("/", 1)[1] if key.startswith(run_id + "/") else key
    return (r["benchmark"], r["model"], r.get("context_length"), int(r.get("batch_size") or 1),
            int(r.get("queue_depth") or 1), int(r.get("repetition") or 0), tail)


def _stats_by_batch(rows: Iterable[Mapping[str, Any]], key: Callable[[Mapping[str, Any]], tuple]
                    ) -> dict[tuple, list[Mapping[str, Any]]]:
    """The rows' stats grouped by ``key`` (a batch's identity)."""
    out: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        out[key(r)].append(r.get("stats") or {})
    return out


def paired_batches(rows: Sequence[Mapping[str, Any]], ar_rows: Sequence[Mapping[str, Any]],
                   key: Callable[[Mapping[str, Any]], tuple] = _batch_key) -> list[tuple[float, float, float]]:
    """``(tpot_ar, tpot_method, decoded_tokens)`` per batch decoded by both (``rows``: one
    method's rows; ``ar_rows``: the reference's rows of the same cells). ``key``: a batch's
    identity (default: within one run; ``shared_batch_key``: across runs). Batches without
    decode time or decoded tokens are skipped."""
    mine, ref = _stats_by_batch(rows, key), _stats_by_batch(ar_rows, key)
    pairs = []
    for key, st in mine.items():
        if key not in ref:
            continue
        t_ar, t_m = batch_tpot(ref[key]), batch_tpot(st)
        if t_ar is not None and t_m is not None:
            tokens = sum(max(0.0, _num(s, "num_output_tokens") - 1) for s in st)
            pairs.append((t_ar, t_m, tokens))
    return pairs


def paired_straggle(rows: Sequence[Mapping[str, Any]], ar_rows: Sequence[Mapping[str, Any]],
                    key: Callable[[Mapping[str, Any]], tuple] = _batch_key) -> float | None:
    """Median over the batches decoded by both of ``batch_straggle(method) / batch_straggle(ar)``
    (``sparsespec.stats.batch_straggle``): the share of the ledger's per-row ``S`` a static batch
    keeps when it waits for its slowest row. None without a paired batch."""
    mine, ref = _stats_by_batch(rows, key), _stats_by_batch(ar_rows, key)
    ratios = []
    for k, st in mine.items():
        s_m, s_ar = batch_straggle(st), batch_straggle(ref.get(k, ()))
        if s_m is not None and s_ar:
            ratios.append(s_m / s_ar)
    return float(np.median(ratios)) if ratios else None


def paired_speedup(rows: Sequence[Mapping[str, Any]], ar_rows: Sequence[Mapping[str, Any]], *,
                   n_boot: int = N_BOOT, seed: int = 0, confidence: float = 0.95,
                   key: Callable[[Mapping[str, Any]], tuple] = _batch_key) -> dict[str, Any]:
    """Paired speedup of one method's rows against ar's: ``speedup`` (median of per-batch
    ``TPOT_ar / TPOT_method``), ``speedup_total`` (sum of ar decode seconds / sum of method
    decode seconds, each batch's seconds = its TPOT x its decoded tokens), ``ci_low`` /
    ``ci_high`` (bootstrap of the median; None below ``MIN_CI_PAIRS`` pairs), ``n_pairs``."""
    pairs = paired_batches(rows, ar_rows, key)
    out: dict[str, Any] = {"speedup": None, "speedup_total": None, "ci_low": None, "ci_high": None,
                           "n_pairs": len(pairs)}
    if not pairs:
        return out
    ratios = np.asarray([a / m for a, m, _ in pairs])
    out["speedup"] = float(np.median(ratios))
    t_ar = sum(a * n for a, _, n in pairs)
    t_m = sum(m * n for _, m, n in pairs)
    out["speedup_total"] = t_ar / t_m if t_m > 0 else None
    if len(pairs) >= MIN_CI_PAIRS:
        ci = percentile_ci(bootstrap_medians(ratios, n_boot, np.random.default_rng(seed)), confidence)
        if ci:
            out["ci_low"], out["ci_high"] = ci
    return out


# --------------------------------------------------------------------------- cells
def _pct(values: Sequence[float], q: float) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.percentile(vals, q)) if vals else None


def _latency(rs: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    st = [r.get("stats") or {} for r in rs]
    ttft = [_num(s, "ttft_s") or _num(s, "prefill_s") for s in st if ("ttft_s" in s or "prefill_s" in s)]
    tpot = [derive(s)["tpot_s"] for s in st]
    itl95 = [s.get("itl_p95_s") for s in st if s.get("itl_p95_s") is not None]
    itl99 = [s.get("itl_p99_s") for s in st if s.get("itl_p99_s") is not None]
    mem = [_num(s, "peak_mem_bytes") for s in st if s.get("peak_mem_bytes")]
    kv = [_num(s, "kv_bytes") for s in st if s.get("kv_bytes")]
    return {
        "ttft_p50_s": _pct(ttft, 50), "ttft_p95_s": _pct(ttft, 95),
        "tpot_p50_s": _pct([t for t in tpot if t is not None], 50),
        "tpot_p95_s": _pct([t for t in tpot if t is not None], 95),
        # per-request ITL percentiles, taken at the median request (the gaps themselves are not stored)
        "itl_p95_s": _pct(itl95, 50), "itl_p99_s": _pct(itl99, 50),
        "peak_mem_bytes": max(mem) if mem else None,
        "kv_bytes": max(kv) if kv else None,
    }


def _throughput(rs: Sequence[Mapping[str, Any]]) -> float | None:
    """Decoded tokens per decode second of whole batches: sum(tokens - 1) / sum(batch decode s)."""
    batches: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for r in rs:
        batches[_batch_key(r)].append(r.get("stats") or {})
    tokens = seconds = 0.0
    for st in batches.values():
        t = batch_tpot(st)
        if t is None:
            continue
        n = sum(max(0.0, _num(s, "num_output_tokens") - 1) for s in st)
        tokens += n
        seconds += t * n
    return tokens / seconds if seconds > 0 else None


def _round_costs(p: Mapping[str, float], ar_round: float | None) -> dict[str, float | None]:
    """Per-round costs relative to one AR step: ``T_round / T_AR = f_d * c_draft + c_verify + c_other``
    with ``f_d`` draft forwards per round."""
    steps = p.get("num_steps") or 0.0
    if not steps or not ar_round:
        return {"draft_forwards_per_round": None, "c_draft": None, "c_verify": None, "c_other": None}
    fwd = p.get("num_draft_forwards", 0.0)
    return {
        "draft_forwards_per_round": fwd / steps,
        "c_draft": (p.get("draft_s", 0.0) / fwd) / ar_round if fwd else None,
        "c_verify": (p.get("verify_s", 0.0) / steps) / ar_round,
        "c_other": (p.get("other_s", 0.0) / steps) / ar_round,
    }


def cell_table(rows: Iterable[Mapping[str, Any]], by: Sequence[str] = CELL_KEYS, *,
               n_boot: int = N_BOOT, seed: int = 0) -> list[dict[str, Any]]:
    """One dict per group of ``by`` (default: a cell), with ar's numbers beside each method's.

    Keys: ``by``, ``variant``, ``n``, ``n_pairs``, ``score``, ``score_ar`` (mean over the same
    samples' ar rows), ``score_delta`` (paired: mean of method - ar per sample), ``speedup``,
    ``speedup_total``, ``ci_low``, ``ci_high``, ``alpha``, ``tau``, ``mean_k``, ``gamma``,
    ``predicted_speedup`` (ledger), ``straggle`` (``paired_straggle``: the share of it a static
    batch keeps, waiting for its slowest row) and ``batch_predicted_speedup`` (the two
    multiplied), ``predicted_speedup_round`` (``tau * T_AR / T_round``), the
    round costs (``c_draft``, ``c_verify``, ``c_other`` relative to an AR step,
    ``draft_forwards_per_round``), ``lossless_rate`` / ``n_conclusive`` (the stored verdicts of
    samples paired with an ar row of the cell; None when none), ``n_sampling``
    (rows sampled at temperature > 0, where greedy losslessness does not apply), the latency
    and memory fields of the method (``ttft_p50_s`` ... ``kv_bytes``) and of ar (``ar_``
    prefix), ``throughput`` and ``ar_throughput`` (decoded tokens per decode second of whole
    batches), and the pooled ``tokens_per_s`` (output tokens / total seconds), ``tpot_s`` (decode
    seconds / decoded tokens) and ``budget_frac`` (``sparsespec.stats.derive``).
    ``by`` must contain ``method``; ar's rows of a group are those with the same keys except
    method, k, draft weights and options. Groups that differ only in ``options`` name the
    options they differ in after their ``variant`` (``sparsespec-l k=4 (budget_frac=0.2)``).
    """
    by = tuple(by)
    if "method" not in by:
        raise ValueError(f"cell_table: `by` must include 'method', got {by}")
    rows = list(rows)
    groups: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[_cell_key(r, by)].append(r)
    mi = by.index("method")
    ki = by.index("k") if "k" in by else None
    di = by.index("draft_weights") if "draft_weights" in by else None
    qi = by.index("quantize") if "quantize" in by else None
    oi = by.index("options") if "options" in by else None

    def ar_key(key: tuple) -> tuple:
        k = list(key)
        k[mi] = AR
        for i in (ki, di):
            if i is not None:
                k[i] = None
        if oi is not None:
            k[oi] = ""
        return tuple(k)

    out = []
    # the full-precision target first ("none" sorts as ""), then ar first within its cell
    for key in sorted(groups, key=lambda t: tuple(
            _sort_value("" if (i == qi and v == "none") else (0 if (i == mi and v == AR) else v))
            for i, v in enumerate(t))):
        rs = groups[key]
        method = key[mi]
        ar_rows = groups.get(ar_key(key), [])
        ar_by_pair = {_pair_key(r): r for r in ar_rows}
        scores = [float(r["score"]) for r in rs if r.get("score") is not None]
        deltas = [float(r["score"]) - float(ar_by_pair[_pair_key(r)]["score"]) for r in rs
                  if r.get("score") is not None and _pair_key(r) in ar_by_pair
                  and ar_by_pair[_pair_key(r)].get("score") is not None]
        ar_scores = [float(ar_by_pair[_pair_key(r)]["score"]) for r in rs if _pair_key(r) in ar_by_pair
                     and ar_by_pair[_pair_key(r)].get("score") is not None]
        p = pool(r.get("stats") or {} for r in rs)
        p_ar = pool(r.get("stats") or {} for r in ar_rows)
        d = derive(p, ar=p_ar if ar_rows else None)
        ar_round = derive(p_ar)["round_s"] if ar_rows else None
        row: dict[str, Any] = dict(zip(by, key))
        row["variant"] = variant(method, key[ki] if ki is not None else None, key[di] if di is not None else None,
                                 key[qi] if qi is not None else None)
        row["n"] = len(rs)
        row["score"] = statistics.fmean(scores) if scores else None
        row["score_ar"] = statistics.fmean(ar_scores) if ar_scores else None
        row["score_delta"] = statistics.fmean(deltas) if deltas else None
        if method == AR:
            row.update(speedup=1.0, speedup_total=1.0, ci_low=None, ci_high=None, n_pairs=len(rs),
                       alpha=None, tau=1.0, mean_k=None, gamma=None, predicted_speedup=1.0, straggle=1.0,
                       batch_predicted_speedup=1.0,
                       predicted_speedup_round=1.0, lossless_rate=None, n_conclusive=0, score_delta=0.0
                       if scores else None)
            row.update(_round_costs(p, ar_round))
        else:
            row.update(paired_speedup(rs, ar_rows, n_boot=n_boot, seed=seed))
            # over samples paired with an ar row of the cell (the reference the verdict is against)
            verdicts = [bool(r["lossless"]) for r in rs if r.get("lossless") is not None and _pair_key(r) in ar_by_pair]
            straggle = paired_straggle(rs, ar_rows)
            ledger = ledger_speedup(d["alpha"], d["mean_k"], d["gamma"])
            row.update(alpha=d["alpha"], tau=d["tau"], mean_k=d["mean_k"], gamma=d["gamma"],
                       predicted_speedup=ledger, straggle=straggle,
                       batch_predicted_speedup=ledger * straggle if ledger is not None and straggle else None,
                       predicted_speedup_round=d["predicted_speedup_round"],
                       lossless_rate=(sum(verdicts) / len(verdicts)) if verdicts else None,
                       n_conclusive=len(verdicts))
            row.update(_round_costs(p, ar_round))
        row["n_sampling"] = sum(1 for r in rs if (r.get("temperature") or 0) > 0)  # see with_run_fields
        row.update(_latency(rs))
        row.update({f"ar_{k}": v for k, v in _latency(ar_rows).items()})
        row.update(tokens_per_s=d["tokens_per_s"], tpot_s=d["tpot_s"], budget_frac=d["budget_frac"])
        row["throughput"] = _throughput(rs)
        row["ar_throughput"] = _throughput(ar_rows)
        out.append(row)
    if oi is not None:
        _name_options(out, by)
    return out


def _name_options(cells: Sequence[dict[str, Any]], by: Sequence[str]) -> None:
    """Cells that differ only in ``options``: append the options they differ in to ``variant``."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for c in cells:
        groups[tuple(c[k] for k in by if k != "options")].append(c)
    for cs in groups.values():
        if len({c["options"] for c in cs}) < 2:
            continue
        parsed = [json.loads(c["options"]) if c["options"] else {} for c in cs]
        names = sorted({n for p in parsed for n in p
                        if len({json.dumps(q.get(n), sort_keys=True, default=str) for q in parsed}) > 1})
        for c, p in zip(cs, parsed):
            c["variant"] += " (" + ", ".join(f"{n}={p.get(n)}" for n in names) + ")"


def best_per_cell(cells: Sequence[Mapping[str, Any]], by: Sequence[str]) -> list[dict[str, Any]]:
    """Per group of ``by`` (e.g. model, context_length, batch_size): the fastest variant by
    median paired speedup, lossless ones only (``lossless_rate`` 1 or not conclusive); ``ar``
    when nothing beats 1.0. Keys ``by``, ``best``, ``speedup``, ``runner_up``."""
    groups: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for c in cells:
        groups[tuple(c.get(k) for k in by)].append(c)
    out = []
    for key in sorted(groups, key=lambda t: tuple(_sort_value(v) for v in t)):
        cand = [c for c in groups[key] if c.get("speedup") is not None
                and (c.get("lossless_rate") is None or c["lossless_rate"] >= 1.0)]
        cand.sort(key=lambda c: -c["speedup"])
        best = cand[0] if cand else None
        row = dict(zip(by, key))
        if best is None or best["method"] == AR or best["speedup"] <= 1.0:
            row.update(best=AR, speedup=1.0,
                       runner_up=next((c["variant"] for c in cand if c["method"] != AR), None))
        else:
            row.update(best=best["variant"], speedup=best["speedup"],
                       runner_up=next((c["variant"] for c in cand[1:]), None))
        out.append(row)
    return out


# --------------------------------------------------------------------------- ledger
# --------------------------------------------------------------------------- quantisation x speculation
FOUR_WAY_ARMS = ("baseline", "quantisation only", "speculation only", "both")
FOUR_WAY_KEYS = ("benchmark", "model", "context_length", "batch_size", "speculation", "arm", "variant", "quantize",
                 "n", "speedup", "ci_low", "ci_high", "n_pairs", "speedup_vs_own_ar", "score", "score_delta",
                 "lossless_rate", "n_conclusive", "lossless_against", "agreement_with_baseline")


def _sample_key(r: Mapping[str, Any]) -> tuple:
    return (r["task"], str(r["sample_id"]), int(r.get("repetition") or 0))


def four_way(rows: Iterable[Mapping[str, Any]], *, n_boot: int = N_BOOT, seed: int = 0) -> list[dict[str, Any]]:
    """Quantisation x speculation per setting (benchmark, model, context, batch; tasks pooled):
    for each speculative variant, four rows (``FOUR_WAY_ARMS``):

    - ``baseline``: full-precision ``ar``, the reference of every speed and quality number here;
    - ``quantisation only``: ``ar`` on the int8 target, a new model: ``lossless_against`` is
      None and ``agreement_with_baseline`` the fraction of its samples whose tokens equal the
      baseline's (greedy);
    - ``speculation only``: the method on the full-precision target, lossless against the
      baseline (``lossless_rate``);
    - ``both``: the method on the int8 target, lossless against the int8 ``ar``
      (``lossless_against`` says which); ``speedup_vs_own_ar`` is its speedup over that ar.

    ``speedup``: median of per-batch ``TPOT_baseline / TPOT_arm``; within one run for
    ``speculation only``, across the two runs (same batches, ``shared_batch_key``) for the
    quantised arms, so those pairs were decoded one run after the other, not interleaved.
    ``score_delta``: mean per-sample score minus the baseline's. Rows are grouped by their
    run's ``twin`` (``with_run_fields``) within a setting, so an int8 run is compared with the
    full-precision run of the same sweep cell only, never with another sweep's run at the same
    setting; a group without both is left out. Keys ``FOUR_WAY_KEYS``.
    """
    rows = [dict(r) for r in rows]
    for r in rows:
        r.setdefault("quantize", "none")
    settings: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        settings[(r["benchmark"], r["model"], r.get("context_length"), int(r.get("batch_size") or 1),
                  r.get("twin"))].append(r)
    out: list[dict[str, Any]] = []
    for gkey in sorted(settings, key=lambda t: tuple(_sort_value(v) for v in t)):
        rs, skey = settings[gkey], gkey[:4]
        base = [r for r in rs if r["method"] == AR and r["quantize"] == "none"]
        q_ar = [r for r in rs if r["method"] == AR and r["quantize"] != "none"]
        if not base or not q_ar:
            continue
        base_by = {_sample_key(r): r for r in base}

        def quality(arm: list[dict[str, Any]]) -> dict[str, Any]:
            scores = [float(r["score"]) for r in arm if r.get("score") is not None]
            deltas = [float(r["score"]) - float(base_by[_sample_key(r)]["score"]) for r in arm
                      if r.get("score") is not None and _sample_key(r) in base_by
                      and base_by[_sample_key(r)].get("score") is not None]
            same = [list(r.get("token_ids") or []) == list(base_by[_sample_key(r)].get("token_ids") or [])
                    for r in arm if _sample_key(r) in base_by and (r.get("temperature") or 0) == 0]
            return {"n": len(arm), "score": statistics.fmean(scores) if scores else None,
                    "score_delta": statistics.fmean(deltas) if deltas else None,
                    "agreement_with_baseline": (sum(same) / len(same)) if same else None}

        def lossless(arm: list[dict[str, Any]]) -> dict[str, Any]:
            v = [bool(r["lossless"]) for r in arm if r.get("lossless") is not None]
            return {"lossless_rate": (sum(v) / len(v)) if v else None, "n_conclusive": len(v)}

        def speed(arm: list[dict[str, Any]], ref: list[dict[str, Any]], cross: bool) -> dict[str, Any]:
            p = paired_speedup(arm, ref, n_boot=n_boot, seed=seed, key=shared_batch_key if cross else _batch_key)
            return {k: p[k] for k in ("speedup", "ci_low", "ci_high", "n_pairs")}

        q_kind = q_ar[0]["quantize"]
        q_label = variant(AR, None, None, q_kind)
        baseline = {"arm": "baseline", "variant": AR, "quantize": "none", "speedup": 1.0, "ci_low": None,
                    "ci_high": None, "n_pairs": None, "speedup_vs_own_ar": 1.0, "lossless_rate": None,
                    "n_conclusive": 0, "lossless_against": None, **quality(base)}
        baseline["score_delta"] = 0.0 if baseline["score"] is not None else None
        quant_only = {"arm": "quantisation only", "variant": q_label, "quantize": q_kind,
                      **speed(q_ar, base, True), "speedup_vs_own_ar": 1.0, "lossless_rate": None,
                      "n_conclusive": 0, "lossless_against": None, **quality(q_ar)}
        spec_groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
        for r in rs:
            if r["method"] != AR:
                spec_groups[(r["method"], run_k(r), run_draft_weights(r))].append(r)
        for (method, k, dw) in sorted(spec_groups, key=lambda t: tuple(_sort_value(v) for v in t)):
            g = spec_groups[(method, k, dw)]
            fp = [r for r in g if r["quantize"] == "none"]
            q8 = [r for r in g if r["quantize"] != "none"]
            label = variant(method, k, dw)
            arms = [baseline, quant_only]
            if fp:
                arms.append({"arm": "speculation only", "variant": label, "quantize": "none",
                             **speed(fp, base, False), "speedup_vs_own_ar": None, **lossless(fp),
                             "lossless_against": variant(AR, None), **quality(fp)})
                arms[-1]["speedup_vs_own_ar"] = arms[-1]["speedup"]
            if q8:
                arms.append({"arm": "both", "variant": variant(method, k, dw, q_kind), "quantize": q_kind,
                             **speed(q8, base, True),
                             "speedup_vs_own_ar": speed(q8, q_ar, False)["speedup"], **lossless(q8),
                             "lossless_against": q_label, **quality(q8)})
            for a in arms:
                out.append({**dict(zip(("benchmark", "model", "context_length", "batch_size"), skey)),
                            "speculation": label, **{k: a.get(k) for k in FOUR_WAY_KEYS[6:]},
                            "arm": a["arm"]})
    return [{k: r.get(k) for k in FOUR_WAY_KEYS} for r in out]


def _hist(st: Mapping[str, Any]) -> dict[tuple[int, int], float]:
    out: dict[tuple[int, int], float] = defaultdict(float)
    for key, count in (st.get("accept_hist") or {}).items():
        try:
            k, a = (int(x) for x in str(key).split(":", 1))
        except ValueError:
            continue
        out[(k, a)] += float(count)
    return out


def acceptance_by_position(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Acceptance by draft position from the (k, accepted) histograms of ``rows``.

    For position ``i`` (1-based): ``drafted`` = steps that proposed at least i tokens;
    ``reached`` = those that accepted the first i-1; ``accepted`` = those that accepted at least
    i. ``rate`` = accepted / drafted (the chance the i-th draft token is kept);
    ``conditional`` = accepted / reached (kept, given the ones before it were). One dict per
    position with drafted > 0.
    """
    h: dict[tuple[int, int], float] = defaultdict(float)
    for r in rows:
        for key, n in _hist(r.get("stats") or {}).items():
            h[key] += n
    max_k = max((k for k, _ in h), default=0)
    out = []
    for i in range(1, max_k + 1):
        drafted = sum(n for (k, a), n in h.items() if k >= i)
        reached = sum(n for (k, a), n in h.items() if k >= i and a >= i - 1)
        accepted = sum(n for (k, a), n in h.items() if k >= i and a >= i)
        if drafted:
            out.append({"position": i, "drafted": drafted, "reached": reached, "accepted": accepted,
                        "rate": accepted / drafted, "conditional": accepted / reached if reached else None})
    return out


def s_vs_k(cells: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Fixed-k cells of one method and setting, ordered by k: measured speedup, the ledger at
    the measured (alpha, k, gamma), expected accepted tokens per round ``alpha * k``, and the
    marginal acceptance ``m(k) = (alpha_k k - alpha_j j) / (k - j)`` against the previous k
    (``j``; from 0 for the first). ``inversion`` is True at the first k where ``m(k) < gamma``:
    the extra draft tokens cost more (in verify-step units) than they are expected to return.
    Only integer-k cells are used; pass the cells of one setting (same model, benchmark, task,
    context, batch, method)."""
    fixed = sorted((c for c in cells if isinstance(c.get("k"), int) and c.get("alpha") is not None),
                   key=lambda c: c["k"])
    out, prev_k, prev_e, inverted = [], 0, 0.0, False
    for c in fixed:
        k, alpha, gamma = c["k"], c["alpha"], c.get("gamma")
        e = alpha * k
        m = (e - prev_e) / (k - prev_k) if k > prev_k else None
        inv = bool(not inverted and m is not None and gamma is not None and m < gamma)
        inverted = inverted or inv
        out.append({"k": k, "variant": c.get("variant"), "speedup": c.get("speedup"),
                    "predicted_speedup": ledger_speedup(alpha, k, gamma), "alpha": alpha, "gamma": gamma,
                    "expected_accepted": e, "marginal_acceptance": m, "inversion": inv})
        prev_k, prev_e = k, e
    return out


def k_trace(steps: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The controller's k over a run: per (run, task, sample, method) the steps in order, each
    with ``step``, ``k``, ``accepted`` and the running mean k (from ``Store.acceptance_steps``)."""
    by: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for s in steps:
        by[(s["run_id"], s["task"], str(s["sample_id"]), s["method"])].append(s)
    out = []
    for (run_id, task, sample_id, method), ss in by.items():
        total = 0
        for i, s in enumerate(sorted(ss, key=lambda s: s["step"])):
            total += int(s["k"])
            out.append({"run_id": run_id, "task": task, "sample_id": sample_id, "method": method,
                        "context_length": s.get("context_length"), "batch_size": s.get("batch_size"),
                        "step": int(s["step"]), "k": int(s["k"]), "accepted": int(s["accepted"]),
                        "mean_k_so_far": total / (i + 1)})
    return out


# --------------------------------------------------------------------------- gates
@dataclass(frozen=True)
class GateThresholds:
    """Deployment gate thresholds (the dashboard shows and edits them).

    correctness: greedy lossless rate >= ``min_lossless_rate`` over at least one conclusive sample;
    quality: paired score delta vs ar >= ``-max_score_drop`` (score in [0, 1]);
    latency: median TPOT speedup >= ``min_speedup`` and P95 inter-token gap <= ``max_itl_ratio``
    x ar's; capacity: peak memory <= ``max_mem_ratio`` x ar's, KV bytes <= ``max_kv_ratio`` x
    ar's, decode throughput >= ``min_throughput_ratio`` x ar's at the setting's batch size.
    """

    min_lossless_rate: float = 1.0
    max_score_drop: float = 0.01
    min_speedup: float = 1.0
    max_itl_ratio: float = 1.5
    max_mem_ratio: float = 1.10
    max_kv_ratio: float = 1.10
    min_throughput_ratio: float = 1.0

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"gate threshold {name} must be a finite number >= 0, got {v!r}")
        if self.min_lossless_rate > 1:
            raise ValueError(f"min_lossless_rate must be in [0, 1], got {self.min_lossless_rate}")


GATES = ("correctness", "quality", "latency", "capacity")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if (a is not None and b) else None


def gate_row(cell: Mapping[str, Any], t: GateThresholds = GateThresholds()) -> dict[str, Any]:
    """The four gates for one non-ar cell: each ``True`` (pass), ``False`` (fail) or None (no
    data: counts as not passed), the measured values they compare, ``reason`` (the failures, in
    words) and ``passed`` (all four True)."""
    reasons: list[str] = []

    def check(ok: bool | None, what: str) -> bool | None:
        if ok is False:
            reasons.append(what)
        elif ok is None:
            reasons.append(f"no data: {what}")
        return ok

    lr = cell.get("lossless_rate")
    correct = check(None if lr is None else lr >= t.min_lossless_rate,
                    f"lossless rate {_f(lr)} < {t.min_lossless_rate:g}" if lr is not None
                    else "no conclusive greedy sample (nothing drafted, or sampling only)")
    sd = cell.get("score_delta")
    quality = check(None if sd is None else sd >= -t.max_score_drop,
                    f"score delta {_f(sd)} < -{t.max_score_drop:g}" if sd is not None else "score vs ar")
    sp = cell.get("speedup")
    itl = _ratio(cell.get("itl_p95_s"), cell.get("ar_itl_p95_s"))
    lat_ok = None if sp is None else (sp >= t.min_speedup and (itl is None or itl <= t.max_itl_ratio))
    latency = check(lat_ok, (f"speedup {_f(sp)} (min {t.min_speedup:g}), P95 ITL {_f(itl)}x ar "
                             f"(max {t.max_itl_ratio:g})") if sp is not None else "paired speedup")
    mem = _ratio(cell.get("peak_mem_bytes"), cell.get("ar_peak_mem_bytes"))
    kv = _ratio(cell.get("kv_bytes"), cell.get("ar_kv_bytes"))
    thr = _ratio(cell.get("throughput"), cell.get("ar_throughput"))
    if mem is None and kv is None and thr is None:
        cap_ok = None
    else:
        cap_ok = ((mem is None or mem <= t.max_mem_ratio) and (kv is None or kv <= t.max_kv_ratio)
                  and (thr is None or thr >= t.min_throughput_ratio))
    capacity = check(cap_ok, f"memory {_f(mem)}x (max {t.max_mem_ratio:g}), KV {_f(kv)}x (max {t.max_kv_ratio:g}), "
                             f"throughput {_f(thr)}x (min {t.min_throughput_ratio:g})")
    return {
        "correctness": correct, "quality": quality, "latency": latency, "capacity": capacity,
        "passed": all(g is True for g in (correct, quality, latency, capacity)),
        "lossless_rate": lr, "n_conclusive": cell.get("n_conclusive"), "n_sampling": cell.get("n_sampling"),
        "score_delta": sd, "speedup": sp, "itl_p95_ratio": itl, "mem_ratio": mem, "kv_ratio": kv,
        "throughput_ratio": thr, "reason": "; ".join(reasons),
    }


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


SETTING_KEYS = ("benchmark", "model", "quantize", "context_length", "batch_size", "queue_depth", "method", "k",
                "draft_weights", "options")


def gates_table(rows: Iterable[Mapping[str, Any]], t: GateThresholds = GateThresholds(), *,
                n_boot: int = N_BOOT) -> list[dict[str, Any]]:
    """The four gates per setting (benchmark, model, context, batch, method, k), the benchmark's
    tasks pooled; ar's own rows are the reference and get no row."""
    cells = cell_table(rows, by=SETTING_KEYS, n_boot=n_boot)
    return [{**{k: c[k] for k in SETTING_KEYS}, "variant": c["variant"], "n": c["n"], **gate_row(c, t)}
            for c in cells if c["method"] != AR]


# --------------------------------------------------------------------------- A/B traffic
def _serve_records(requests: Iterable[Mapping[str, Any]]) -> list[Any]:
    from cluster.results.ab import RequestRecord

    recs = []
    for i, q in enumerate(requests):
        recs.append(RequestRecord(index=i, session=q.get("session") or "", arm=q.get("arm"), method=q.get("method"),
                                  sent=True, success=q.get("status") == 200, status=q.get("status"),
                                  error=q.get("error"), ttft_s=q.get("ttft_s"), e2el_s=q.get("e2el_s"),
                                  output_tokens=int(q.get("output_tokens") or 0),
                                  prompt_tokens=q.get("prompt_tokens"), finish_reason=q.get("finish_reason")))
    return recs


def ab_arms(requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per arm of stored Serve requests: requests, errors (status != 200; 499 = client went
    away), error rate, TTFT / TPOT / ITL percentiles (seconds; TPOT = (E2EL - TTFT) / (output -
    1) per request, ITL = the per-request chunk-gap percentiles at the median request), pooled
    acceptance (alpha, mean acceptance length) and output tokens."""
    by: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for q in requests:
        by[q.get("arm") or "(refused at the router)"].append(q)
    out = []
    for arm in sorted(by):
        qs = by[arm]
        ok = [q for q in qs if q.get("status") == 200]
        tpot = [t for t in (request_tpot(q.get("e2el_s"), q.get("ttft_s"), q.get("output_tokens")) for q in ok)
                if t is not None]
        ttft = [q["ttft_s"] for q in ok if q.get("ttft_s") is not None]
        st = [q.get("stats") or {} for q in ok]
        p = derive(pool(st))
        steps = sum(drafting_steps(s) for s in st)
        accepted = sum(_num(s, "num_accepted") for s in st)
        out.append({
            # a policy arm decodes with several methods: all of them, "+"-joined
            "arm": arm, "method": "+".join(sorted({q["method"] for q in qs if q.get("method")})) or None,
            "requests": len(qs), "errors": len(qs) - len(ok), "error_rate": (len(qs) - len(ok)) / len(qs),
            "output_tokens": int(sum(q.get("output_tokens") or 0 for q in ok)),
            "ttft_p50_s": _pct(ttft, 50), "ttft_p95_s": _pct(ttft, 95), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50), "tpot_p95_s": _pct(tpot, 95), "tpot_p99_s": _pct(tpot, 99),
            "itl_p95_s": _pct([s.get("itl_p95_s") for s in st], 50),
            "itl_p99_s": _pct([s.get("itl_p99_s") for s in st], 50),
            "alpha": p["alpha"], "mean_acceptance_length": mean_acceptance_length(accepted, steps),
        })
    return out


def ab_decisions(requests: Sequence[Mapping[str, Any]], baseline: str | None = None, *, n_boot: int = N_BOOT,
                 seed: int = 0) -> list[dict[str, Any]]:
    """Every arm's median TPOT against the baseline arm's (default ``ar`` if present), with the
    bootstrap 95 % interval: the same decision (``cluster.results.ab``) ``cluster.serve.loadtest``
    prints, from stored rows."""
    from cluster.results.ab import ab_decisions as decide

    return decide(_serve_records(requests), baseline, n_boot=n_boot, seed=seed)


def ab_timeline(requests: Sequence[Mapping[str, Any]], bucket_s: float = 60.0) -> list[dict[str, Any]]:
    """Requests per arm per time bucket (``bucket_s`` seconds, aligned to the first request):
    ``t`` (bucket start, the stored timestamp), ``arm``, ``requests``, ``errors``."""
    if bucket_s <= 0:
        raise ValueError(f"bucket_s must be > 0, got {bucket_s}")
    ts = [q for q in requests if q.get("created_at") is not None]
    if not ts:
        return []
    t0 = min(q["created_at"] for q in ts)
    counts: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])
    for q in ts:
        b = int((q["created_at"] - t0).total_seconds() // bucket_s)
        c = counts[(b, q.get("arm") or "(router)")]
        c[0] += 1
        c[1] += q.get("status") != 200
    import datetime as dt

    return [{"t": t0 + dt.timedelta(seconds=b * bucket_s), "arm": arm, "requests": n, "errors": e}
            for (b, arm), (n, e) in sorted(counts.items())]


# --------------------------------------------------------------------------- runs
def run_rows(runs: Sequence[Mapping[str, Any]], shards: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One dict per run: its cell (context, batch), status, results and shard counts by status,
    attempts, failed shards' last error, the device and the git commit from its provenance."""
    by_run: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for s in shards:
        by_run[s["run_id"]].append(s)
    out = []
    for r in runs:
        ss = by_run.get(r["run_id"], [])
        cfg = r.get("config") or {}
        prov = (r.get("host") or {}).get("provenance") or {}
        out.append({
            "run_id": r["run_id"], "benchmark": r["benchmark"], "model": r["model"],
            "methods": ", ".join(r.get("methods") or []),
            "context_length": cfg.get("context_length"), "batch_size": cfg.get("batch_size"),
            "status": r["status"], "num_results": r.get("num_results"),
            "shards": len(ss), "shards_done": sum(s["status"] == "done" for s in ss),
            "shards_failed": sum(s["status"] == "failed" for s in ss),
            "shards_pending": sum(s["status"] in ("pending", "running") for s in ss),
            "attempts": sum(int(s.get("attempts") or 0) for s in ss),
            "last_error": next((s["error"] for s in reversed(ss) if s.get("error")), None),
            "device": device_label(r), "commit": (prov.get("git") or {}).get("commit"),
            "sweep": (prov.get("sweep") or {}).get("name"),
            "created_at": r.get("created_at"), "finished_at": r.get("finished_at"),
            "events": len(r.get("events") or []),
        })
    return out


def device_label(run: Mapping[str, Any]) -> str | None:
    """The devices a run's workers used, e.g. ``cpu (2 cores on vm)`` (from its host record)."""
    host = run.get("host") or {}
    devs = (host.get("devices") or {}).get("devices")
    if devs:
        return ", ".join(f"{d} x{n}" if n > 1 else d for d, n in sorted(devs.items()))
    workers = host.get("workers") or []
    names = sorted({str(w.get("device")) for w in workers if w.get("device")})
    return ", ".join(names) or None


# --------------------------------------------------------------------------- leaderboard
LEADERBOARD_KEYS = ("benchmark", "model", "context_length", "batch_size", "queue_depth", "variant", "n", "speedup",
                    "ci_low",
                    "ci_high", "speedup_total", "alpha", "tau", "mean_k", "gamma", "score", "score_delta",
                    "lossless_rate", "tpot_p50_s", "throughput")


def leaderboard(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Spec-Bench-style rows: per setting (benchmark, model, context, batch; tasks pooled) an
    ``ar`` row first, then every method variant by descending median speedup."""
    cells = cell_table(rows, by=SETTING_KEYS)
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for c in cells:
        groups[tuple(c[k] for k in SETTING_KEYS[:6])].append(c)
    out = []
    # the full-precision target first within a (benchmark, model): quantize "none" sorts as ""
    for key in sorted(groups, key=lambda t: tuple(_sort_value("" if (i == 2 and v == "none") else v)
                                                  for i, v in enumerate(t))):
        cs = groups[key]
        ordered = ([c for c in cs if c["method"] == AR]
                   + sorted((c for c in cs if c["method"] != AR),
                            key=lambda c: -(c["speedup"] if c["speedup"] is not None else -1e9)))
        out.extend({k: c.get(k) for k in LEADERBOARD_KEYS} for c in ordered)
    return out


@dataclass(frozen=True)
class Environment:
    """What a leaderboard's numbers were measured on (its header)."""

    devices: list[str] = field(default_factory=list)
    packages: dict[str, str] = field(default_factory=dict)
    commits: list[str] = field(default_factory=list)
    runs: int = 0


def environment(runs: Sequence[Mapping[str, Any]]) -> Environment:
    """Devices, package versions and git commits over ``runs`` (from their provenance)."""
    devices, commits, packages = set(), set(), {}
    for r in runs:
        d = device_label(r)
        if d:
            devices.add(d)
        prov = (r.get("host") or {}).get("provenance") or {}
        c = (prov.get("git") or {}).get("commit")
        if c:
            commits.add(c)
        for name, v in (prov.get("packages") or {}).items():
            packages.setdefault(name, set()).add(str(v))
    return Environment(devices=sorted(devices), commits=sorted(commits), runs=len(runs),
                       packages={k: ", ".join(sorted(v)) for k, v in sorted(packages.items())})


# --------------------------------------------------------------------------- engines
#: the keys of an engines-table cell (tasks pooled, like the leaderboard's settings)
ENGINE_CELL_KEYS = ("benchmark", "model", "quantize", "context_length", "batch_size", "queue_depth")


def engine_of(method: str) -> str:
    """The engine a method ran on: ``"vllm"`` for ``vllm:ngram`` (any ``<engine>:<name>``),
    ``"sparsespec"`` for ours."""
    return method.split(":", 1)[0] if ":" in method else "sparsespec"


def engine_ar(method: str) -> str:
    """The plain decoding of ``method``'s own engine: ``vllm:ar`` for ``vllm:ngram``, ``ar`` for ours."""
    engine = engine_of(method)
    return AR if engine == "sparsespec" else f"{engine}:{AR}"


def _median_batch_tpot(rows: Iterable[Mapping[str, Any]]) -> float | None:
    """The median over batches of ``batch_tpot`` (what every paired speedup divides)."""
    by: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        by[_batch_key(r)].append(r.get("stats") or {})
    tpots = [t for t in (batch_tpot(st) for st in by.values()) if t is not None]
    return float(statistics.median(tpots)) if tpots else None


def engines_table(rows: Iterable[Mapping[str, Any]], *, n_boot: int = N_BOOT, seed: int = 0) -> list[dict[str, Any]]:
    """Methods of several engines on the same batches (issue 29's table): per cell
    (``ENGINE_CELL_KEYS``) and method variant, ``speedup`` against our ``ar`` (as everywhere),
    ``speedup_own_ar`` against its own engine's plain decoding (``engine_ar``; None without its
    rows) and ``speedup_fastest_ar`` against the faster plain decoding of the cell
    (``fastest_ar``: the engine ar with the least decode time over the batches both decoded), each
    a median of paired batches (``paired_speedup``); ``alpha``, ``tau`` (accepted length + 1 per
    step), ``tpot_s`` (the median batch TPOT, ``sparsespec.stats.batch_tpot``), and
    ``lossless_rate`` (for ``vllm:ar``: the share of samples whose greedy tokens equal our
    ``ar``'s)."""
    rows = list(rows)
    by = (*ENGINE_CELL_KEYS, "method", "k", "draft_weights", "options")
    cells = cell_table(rows, by=by, n_boot=n_boot, seed=seed)
    groups: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[_cell_key(r, by)].append(r)
    nk = len(ENGINE_CELL_KEYS)

    def ar_rows(setting: tuple, method: str) -> list[Mapping[str, Any]]:
        return groups.get((*setting, method, None, None, ""), [])

    out = []
    for c in cells:
        setting = tuple(c[k] for k in ENGINE_CELL_KEYS)
        mine, ours = groups[tuple(c[k] for k in by)], ar_rows(setting, AR)
        own = ar_rows(setting, engine_ar(c["method"]))
        fastest = AR
        other = [m for m in {engine_ar(k[nk]) for k in groups if k[:nk] == setting} if m != AR]
        for m in sorted(other):  # an engine's ar that decoded the cell's batches in less time than ours
            s = paired_speedup(ar_rows(setting, m), ours, n_boot=0)["speedup_total"]
            best = paired_speedup(ar_rows(setting, m), ar_rows(setting, fastest), n_boot=0)["speedup_total"]
            if s is not None and best is not None and best > 1.0:
                fastest = m
        def vs(ref: list[Mapping[str, Any]], method_is_ref: bool) -> float | None:
            if method_is_ref:
                return 1.0
            return paired_speedup(mine, ref, n_boot=0)["speedup"] if ref else None
        out.append({**{k: c[k] for k in ENGINE_CELL_KEYS}, "engine": engine_of(c["method"]),
                    "method": c["method"], "k": c["k"], "variant": c["variant"], "n": c["n"],
                    "n_pairs": c["n_pairs"], "speedup": c["speedup"], "ci_low": c["ci_low"], "ci_high": c["ci_high"],
                    "speedup_own_ar": vs(own, c["method"] == engine_ar(c["method"])),
                    "fastest_ar": fastest, "speedup_fastest_ar": vs(ar_rows(setting, fastest), c["method"] == fastest),
                    "alpha": c["alpha"], "tau": c["tau"], "tpot_s": _median_batch_tpot(mine),
                    "lossless_rate": c["lossless_rate"],
                    "n_conclusive": c["n_conclusive"]})
    return out
